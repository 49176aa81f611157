"""Smoke test of the peer engines installed by benchmarks/setup_peers.sh.

Run with any python (it only orchestrates; each step runs in its peer's venv):

    python3 benchmarks/peer_smoke.py                 # all steps
    python3 benchmarks/peer_smoke.py --steps make-model,vllm-offline
    python3 benchmarks/peer_smoke.py --vllm-compile  # vLLM offline with its default torch.compile

Steps (each prints one "RESULT {json}" line; the summary goes to
<workdir>/results.json):

  make-model     (hf venv)   tiny random Qwen3 (hidden 64, 2 layers, 4 heads,
                             2 kv heads, head_dim 32 (--head-dim; vLLM CPU
                             cannot run 16), inter 128, vocab 1000,
                             tied embeddings) saved in bfloat16, plus a
                             WordLevel tokenizer where token "w<i>" <-> id i.
  hf-reference   (hf venv)   model.generate greedy, one prompt at a time
                             (the reference the others are compared with).
  hf-cb          (hf venv)   transformers continuous batching:
                             init_continuous_batching() + add_request(...,
                             max_new_tokens=n) per request.
  vllm-offline   (vllm venv) LLM(path, skip_tokenizer_init=True, dtype=bf16)
                             with {"prompt_token_ids": ...} prompts.
  vllm-server    (vllm venv) python -m vllm.entrypoints.openai.api_server on
                             127.0.0.1:<free port>, POST /v1/completions with
                             token-id prompts.
  hf-serve       (hf venv)   transformers serve --continuous-batching on
                             127.0.0.1:<free port>, POST /v1/completions with
                             a text prompt ("w5 w17 ..." == ids [5, 17, ...]).

Nothing is downloaded at run time (HF_HUB_OFFLINE=1); servers bind 127.0.0.1
only and are killed at the end of their step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.path.join(HERE, ".peers")
VENV_PY = {
    "hf": os.path.join(PEERS, "hf", "bin", "python"),
    "vllm": os.path.join(PEERS, "vllm", "bin", "python"),
}

# 4 prompts of different lengths, each with its own output length.
PROMPTS = [
    [5, 17, 42, 99, 123, 7],
    [300, 301, 302],
    [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 222, 333],
    [900, 4],
]
MAX_NEW = [8, 5, 12, 3]

# Keep CPU use modest: the machine is shared (2 cores).
THREADS = os.environ.get("PEER_SMOKE_THREADS", "2")

BASE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": THREADS,
    # vLLM's engine<->worker message queues connect to get_ip() (the machine's
    # outward address) unless told otherwise: keep everything on loopback.
    "VLLM_HOST_IP": "127.0.0.1",
    # vLLM CPU: KV cache size in GiB (default would be sized from RAM).
    "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
}


def result(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method, url, body=None, timeout=60):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read().decode()
        return r.status, (json.loads(raw) if raw.strip().startswith(("{", "[")) else raw)


def wait_http(url, proc, timeout):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early with rc={proc.returncode}")
        try:
            st, _ = http("GET", url, timeout=5)
            if st == 200:
                return time.time() - t0
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not up after {timeout}s")


def stop_proc(proc):
    """Stop a server we started (its own process group), politely then hard."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=20)
    except Exception:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


# --------------------------------------------------------------------------- steps


def step_make_model(d, head_dim):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    os.makedirs(d, exist_ok=True)
    cfg = Qwen3Config(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=3,
        # a larger init than the default 0.02 makes greedy argmax less tie-prone,
        # so cross-engine token agreement is a meaningful check
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3)
    model.save_pretrained(d)  # config.json (dtype bfloat16) + model.safetensors

    # Tokenizer: fixed WordLevel vocab, "w<i>" <-> id i for i >= 4 and
    # specials 0..3, so a text prompt "w5 w17" is exactly ids [5, 17].
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), cfg.vocab_size)})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=2048,
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"
    )
    fast.save_pretrained(d)
    assert fast("w5 w17 w42", add_special_tokens=False)["input_ids"] == [5, 17, 42]
    result(step="make-model", ok=True, dir=d, files=sorted(os.listdir(d)),
           params=sum(p.numel() for p in model.parameters()))


def step_hf_reference(d):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(int(THREADS))
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    outs = []
    t0 = time.time()
    for p, n in zip(PROMPTS, MAX_NEW):
        ids = torch.tensor([p])
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=3)
        outs.append(g[0, len(p):].tolist())
    result(step="hf-reference", ok=True, outputs=outs, gen_s=round(time.time() - t0, 3))


def step_hf_cb(d):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    torch.set_num_threads(int(THREADS))
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    # eos_token_id=-1 disables EOS (== ignore_eos); greedy.
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max(MAX_NEW), eos_token_id=-1, pad_token_id=3)
    # On CPU the default KV cache would take 60% of *total RAM* (max_memory_percent
    # 0.6 via psutil): size it explicitly.  No flash-attn on CPU -> keep sdpa
    # (auto_switch_to_flash=False also avoids any kernels-hub lookup).
    cb_cfg = ContinuousBatchingConfig(
        page_size=16, num_blocks=64, max_batch_tokens=256, max_requests_per_batch=8,
        auto_switch_to_flash=False, use_cuda_graph=False,
    )
    manager = model.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb_cfg)
    manager.start()
    t_start = time.time()
    rids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
            for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))]
    done = {}
    while len(done) < len(rids) and time.time() - t_start < 120:
        r = manager.get_result(timeout=1)
        if r is not None and r.is_finished():
            done[r.request_id] = r
    gen_s = time.time() - t_start
    manager.stop(block=True, timeout=10)
    errors = {k: v.error for k, v in done.items() if v.error}
    outs = [list(done[r].generated_tokens) if r in done else None for r in rids]

    # the one-shot helper, same model (max_new_tokens is per call there)
    t1 = time.time()
    batch = model.generate_batch(inputs=PROMPTS, generation_config=gen_cfg, continuous_batching_config=cb_cfg,
                                 max_new_tokens=max(MAX_NEW), warmup=False)
    gb_s = time.time() - t1
    gb = [list(v.generated_tokens) for v in batch.values()]
    result(step="hf-cb", ok=not errors and all(o is not None for o in outs), outputs=outs,
           errors=errors, attn=model.config._attn_implementation, transformers=transformers.__version__,
           setup_and_gen_s=round(time.time() - t0, 2), gen_s=round(gen_s, 3),
           generate_batch_lens=[len(x) for x in gb], generate_batch_s=round(gb_s, 3),
           generate_batch_outputs=gb)


def step_vllm_offline(d, compile_on):
    import vllm
    from vllm import LLM, SamplingParams

    kw = {} if compile_on else {"enforce_eager": True}
    t0 = time.time()
    llm = LLM(model=d, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512,
              max_num_seqs=8, **kw)
    t_load = time.time() - t0
    cc = llm.llm_engine.vllm_config.compilation_config if hasattr(llm.llm_engine, "vllm_config") else None
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in MAX_NEW]
    t1 = time.time()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    gen_s = time.time() - t1
    t2 = time.time()
    llm.generate(prompts, sps, use_tqdm=False)  # second (warm) run
    gen2_s = time.time() - t2
    toks = [list(o.outputs[0].token_ids) for o in outs]
    result(step="vllm-offline", ok=[len(t) for t in toks] == MAX_NEW, outputs=toks,
           vllm=vllm.__version__, enforce_eager=not compile_on,
           compilation_mode=str(getattr(cc, "mode", None)), compile_backend=str(getattr(cc, "backend", None)),
           load_s=round(t_load, 2), gen_s=round(gen_s, 3), gen_warm_s=round(gen2_s, 3))


def step_vllm_server(d, workdir, extra_args):
    port = free_port()
    log = os.path.join(workdir, f"vllm_server-{os.path.basename(d)}.log")
    cmd = [VENV_PY["vllm"], "-m", "vllm.entrypoints.openai.api_server", "--model", d,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
           "--max-model-len", "512", "--max-num-seqs", "8", "--enforce-eager", *extra_args]
    t0 = time.time()
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **BASE_ENV})
    try:
        up_s = wait_http(f"http://127.0.0.1:{port}/health", proc, timeout=300)
        _, models = http("GET", f"http://127.0.0.1:{port}/v1/models")
        served = models["data"][0]["id"]
        outs, times = [], []
        for p, n in zip(PROMPTS, MAX_NEW):
            t1 = time.time()
            _, r = http("POST", f"http://127.0.0.1:{port}/v1/completions", {
                "model": served, "prompt": p, "max_tokens": n, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            times.append(round(time.time() - t1, 3))
            outs.append(r["choices"][0].get("token_ids"))
        # batched form: a list of token-id lists in one request
        _, rb = http("POST", f"http://127.0.0.1:{port}/v1/completions", {
            "model": served, "prompt": PROMPTS, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        result(step="vllm-server", ok=all(o is not None and len(o) == n for o, n in zip(outs, MAX_NEW)),
               outputs=outs, served_model=served, startup_s=round(up_s, 1), request_s=times,
               batched_choices=len(rb["choices"]), usage=rb.get("usage"), args=extra_args,
               sample_text=rb["choices"][0].get("text"), log=log, cmd=" ".join(cmd))
    finally:
        stop_proc(proc)
        print(f"vllm-server: stopped after {time.time() - t0:.1f}s, log {log}")


def step_hf_serve(d, workdir):
    port = free_port()
    log = os.path.join(workdir, f"hf_serve-{os.path.basename(d)}.log")
    exe = os.path.join(os.path.dirname(VENV_PY["hf"]), "transformers")
    cmd = [exe, "serve", d, "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", "--dtype", "bfloat16", "--cb-num-blocks", "64", "--cb-block-size", "16",
           "--cb-max-batch-tokens", "256", "--log-level", "info"]
    t0 = time.time()
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **BASE_ENV})
    try:
        up_s = wait_http(f"http://127.0.0.1:{port}/health", proc, timeout=180)
        outs, texts, times = [], [], []
        for p, n in zip(PROMPTS, MAX_NEW):
            t1 = time.time()
            gc = json.dumps({"max_new_tokens": n, "do_sample": False, "eos_token_id": None,
                             "pad_token_id": 3})
            _, r = http("POST", f"http://127.0.0.1:{port}/v1/completions", {
                "model": d, "prompt": " ".join(f"w{i}" for i in p), "max_tokens": n,
                "temperature": 0, "generation_config": gc}, timeout=120)
            times.append(round(time.time() - t1, 3))
            text = r["choices"][0]["text"]
            texts.append(text)
            outs.append([int(w[1:]) for w in text.split() if w.startswith("w") and w[1:].isdigit()])
        result(step="hf-serve", ok=all(len(o) > 0 for o in outs), outputs=outs, texts=texts,
               usage_last=r.get("usage"), startup_s=round(up_s, 1), request_s=times, log=log,
               cmd=" ".join(cmd))
    finally:
        stop_proc(proc)
        print(f"hf-serve: stopped after {time.time() - t0:.1f}s, log {log}")


# --------------------------------------------------------------------------- driver

STEP_VENV = {"make-model": "hf", "hf-reference": "hf", "hf-cb": "hf", "vllm-offline": "vllm",
             "vllm-server": None, "hf-serve": None}
ALL_STEPS = list(STEP_VENV)


def run_step(name, args):
    venv = STEP_VENV[name]
    py = VENV_PY[venv] if venv else sys.executable
    cmd = [py, os.path.abspath(__file__), "_step", name, "--workdir", args.workdir,
           "--head-dim", str(args.head_dim)]
    if args.vllm_compile:
        cmd.append("--vllm-compile")
    if args.vllm_server_skip_tokenizer:
        cmd.append("--vllm-server-skip-tokenizer")
    log = os.path.join(args.workdir, f"{name}-hd{args.head_dim}.log")
    t0 = time.time()
    with open(log, "w") as lf:
        p = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, env={**os.environ, **BASE_ENV},
                           timeout=args.step_timeout)
    wall = round(time.time() - t0, 1)
    res = None
    with open(log) as lf:
        lines = lf.read().splitlines()
    for line in lines:
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
    if res is None:
        res = {"step": name, "ok": False, "rc": p.returncode, "tail": lines[-25:]}
    res["wall_s"] = wall
    res["log"] = log
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("_step", nargs="?", help=argparse.SUPPRESS)
    ap.add_argument("step_name", nargs="?", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", default="/tmp/peer_smoke")
    ap.add_argument("--steps", default=",".join(ALL_STEPS))
    ap.add_argument("--vllm-compile", action="store_true",
                    help="vllm-offline without enforce_eager (vLLM's default torch.compile path)")
    ap.add_argument("--vllm-server-skip-tokenizer", action="store_true",
                    help="start the vLLM server with --skip-tokenizer-init (token ids in and out)")
    ap.add_argument("--head-dim", type=int, default=32,
                    help="16 is what nanoserve's tiny test model uses, but vLLM's CPU attention "
                         "kernels reject it at the first forward (supported: 32, 64, 80, 96, 112, "
                         "128, 160, 192, 224, 256, 512), so the default is 32")
    ap.add_argument("--step-timeout", type=int, default=900)
    args = ap.parse_args()
    model_dir = os.path.join(args.workdir, f"tiny-qwen3-hd{args.head_dim}")

    if args._step == "_step":
        os.environ.update(BASE_ENV)
        s = args.step_name
        if s == "make-model":
            step_make_model(model_dir, args.head_dim)
        elif s == "hf-reference":
            step_hf_reference(model_dir)
        elif s == "hf-cb":
            step_hf_cb(model_dir)
        elif s == "vllm-offline":
            step_vllm_offline(model_dir, args.vllm_compile)
        elif s == "vllm-server":
            step_vllm_server(model_dir, args.workdir,
                             ["--skip-tokenizer-init"] if args.vllm_server_skip_tokenizer else [])
        elif s == "hf-serve":
            step_hf_serve(model_dir, args.workdir)
        return

    os.makedirs(args.workdir, exist_ok=True)
    steps = [s for s in args.steps.split(",") if s]
    if not os.path.exists(os.path.join(model_dir, "config.json")) and "make-model" not in steps:
        steps.insert(0, "make-model")
    results = {}
    for s in steps:
        print(f"[peer_smoke] {s} ...", flush=True)
        r = run_step(s, args)
        results[s] = r
        short = {k: v for k, v in r.items() if k not in ("outputs", "tail", "files", "generate_batch_outputs")}
        print(f"[peer_smoke] {s}: {'OK' if r.get('ok') else 'FAIL'} {json.dumps(short)}", flush=True)
        if not r.get("ok"):
            print("\n".join(r.get("tail", [])))

    ref_path = os.path.join(model_dir, "reference_outputs.json")
    if "hf-reference" in results and results["hf-reference"].get("ok"):
        with open(ref_path, "w") as f:
            json.dump(results["hf-reference"]["outputs"], f)
    if os.path.exists(ref_path):
        ref = json.load(open(ref_path))
        for s, r in results.items():
            if s in ("hf-reference", "make-model") or not r.get("outputs"):
                continue
            outs = r["outputs"]
            same = [o == x[: len(o)] if o is not None else False for o, x in zip(outs, ref)]
            r["matches_reference"] = same
            print(f"[peer_smoke] {s} vs hf-reference greedy tokens: {sum(same)}/{len(same)} prompts identical")
    out = os.path.join(args.workdir, f"results-hd{args.head_dim}.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"[peer_smoke] wrote {out}")
    sys.exit(0 if all(r.get("ok") for r in results.values()) else 1)


if __name__ == "__main__":
    main()
