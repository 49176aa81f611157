"""Offline throughput, nanoserve side by side with its peers.

Each engine runs in its own process (its own virtualenv for the peers, see
setup_peers.sh), alternated A B A B for ``--rounds`` rounds. Start-up and one
warm-up request are timed apart from the measured ``generate`` call, as
nano-vllm's bench does. Every engine gets the same token-id prompts and the
same per-request output lengths, greedy, ignore_eos.

    python benchmarks/make_models.py
    python benchmarks/throughput.py --workloads W1 --engines nanoserve vllm hf --rounds 2
    python benchmarks/llamacpp_peer.py --make-gguf     # once, for --engines ... llamacpp

Workers print one JSON line; the parent collects them into
benchmarks/results/throughput-<workload>.json and prints a table.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import workloads  # noqa: E402

PEERS = HERE / ".peers"
PYTHON = {"nanoserve": sys.executable, "vllm": str(PEERS / "vllm/bin/python"),
          "hf": str(PEERS / "hf/bin/python"), "llamacpp": str(PEERS / "llamacpp/bin/python")}


# ============================================================================ workers

def _digest(token_lists) -> str:
    h = hashlib.sha256()
    for t in token_lists:
        h.update(json.dumps(list(t)).encode())
    return h.hexdigest()[:16]


def run_nanoserve(w: workloads.Workload, model: str, prefix_caching: bool, extra: dict) -> dict:
    from nanoserve import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(model, skip_tokenizer_init=True, enable_prefix_caching=prefix_caching,
              kv_cache_memory_bytes=int(extra.get("kv_gib", 4) * 2**30),
              **({"async_scheduling": True} if extra.get("async_scheduling") else {}))
    llm.generate([w.prompts[0][:16]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    startup = time.perf_counter() - t0
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in w.output_lens]
    t = time.perf_counter()
    outs = llm.generate(w.prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    import nanoserve
    return dict(wall=wall, startup=startup, tokens=_digest(o.outputs[0].token_ids for o in outs),
                num_out=sum(len(o.outputs[0].token_ids) for o in outs),
                first8=[list(o.outputs[0].token_ids[:8]) for o in outs],
                version=nanoserve.__version__, stats=llm.stats(),
                settings=dict(backend=llm.engine.backend.name, compile_s=round(llm.engine.compile_time_s, 1)))


def run_vllm(w: workloads.Workload, model: str, prefix_caching: bool, extra: dict) -> dict:
    # PEERS.md: a KV budget is required on the CPU; loopback only; no network; and
    # both cores for the model worker (its default pins the worker to core 0 and
    # keeps core 1 for the scheduler process), as nanoserve uses both.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(extra.get("kv_gib", 4))))
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", extra.get("vllm_bind", "0-1"))
    import vllm
    from vllm import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(model, skip_tokenizer_init=True, dtype=extra.get("vllm_dtype", "bfloat16"),
              enable_prefix_caching=prefix_caching,
              seed=0, max_model_len=2048, enforce_eager=not extra.get("vllm_compile", True))
    llm.generate([{"prompt_token_ids": w.prompts[0][:16]}],
                 SamplingParams(temperature=0, max_tokens=2, detokenize=False), use_tqdm=False)
    startup = time.perf_counter() - t0
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in w.output_lens]
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in w.prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t
    return dict(wall=wall, startup=startup, tokens=_digest(o.outputs[0].token_ids for o in outs),
                num_out=sum(len(o.outputs[0].token_ids) for o in outs), version=vllm.__version__,
                settings=dict(torch_compile=extra.get("vllm_compile", True), dtype=extra.get("vllm_dtype", "bfloat16"),
                              omp_bind=os.environ["VLLM_CPU_OMP_THREADS_BIND"],
                              kv_gib=os.environ["VLLM_CPU_KVCACHE_SPACE"], max_model_len=2048))


def run_hf(w: workloads.Workload, model: str, prefix_caching: bool, extra: dict) -> dict:
    import transformers
    from hf_peer import generate_batch  # benchmarks/hf_peer.py: the working recipe
    return generate_batch(w, model, extra) | {"version": transformers.__version__}


def run_llamacpp(w: workloads.Workload, model: str, prefix_caching: bool, extra: dict) -> dict:
    # benchmarks/llamacpp_peer.py: llama-cpp-python's low-level batch API, the
    # model converted to <models>/<w0|w1>.gguf (bf16) by llama.cpp's converter
    from llamacpp_peer import generate_batch
    return generate_batch(w, Path(model).parent, extra)


WORKERS = {"nanoserve": run_nanoserve, "vllm": run_vllm, "hf": run_hf, "llamacpp": run_llamacpp}


def worker_main(args) -> None:
    w = workloads.get(args.workload)
    model = str(Path(args.models) / w.model)
    result = WORKERS[args.worker](w, model, not args.no_prefix_caching, json.loads(args.extra))
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print("RESULT " + json.dumps(result), flush=True)


# ============================================================================ parent

def run_one(engine: str, workload: str, prefix_caching: bool, models: Path, extra: dict,
            timeout: float) -> dict:
    cmd = [PYTHON[engine], __file__, "--worker", engine, "--workload", workload,
           "--models", str(models), "--extra", json.dumps(extra)]
    if not prefix_caching:
        cmd.append("--no-prefix-caching")
    # This tree's nanoserve, not whichever one the venv has installed (an editable
    # install points at another checkout); then benchmarks/ for workloads and peers.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH")])))
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = TreeRss(proc.pid)  # vLLM computes in child processes: count the whole tree
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        peak.stop()
    proc.stdout, proc.stderr = stdout, stderr
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-3000:]
        return dict(error=f"exit {proc.returncode}: {tail}", process_s=time.perf_counter() - t)
    if os.environ.get("BENCH_SHOW_STDERR"):
        sys.stderr.write(stderr[-4000:])
    return json.loads(lines[-1][7:]) | dict(process_s=time.perf_counter() - t,
                                            peak_tree_rss_gib=peak.peak / 2**30)


class TreeRss:
    """Samples the summed RSS of a process and its descendants every 0.2 s."""

    def __init__(self, pid: int):
        import threading
        import psutil
        self.root, self.peak, self.done = psutil.Process(pid), 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import psutil
        while not self.done.wait(0.2):
            try:
                procs = [self.root] + self.root.children(recursive=True)
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs if p.is_running()))
            except psutil.Error:
                pass

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def machine() -> dict:
    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    # "AMD EPYC" alone hides the generation, and Zen 4 and Zen 5 differ ~2x in bf16 GEMM rate
    return dict(cpu=info.get("model name", platform.processor()), cpu_family=info.get("cpu family"),
                cpu_model=info.get("model"), cores=os.cpu_count(), memory_gib=round(mem, 1),
                python=platform.python_version())


def first_token_agreement(runs: list[dict]) -> None:
    """For each peer run that returned its first 8 tokens per request: the share
    of requests whose first token, and whose first 8 tokens, equal nanoserve's
    (its first run). A sanity check that a peer runs the same model; random
    weights put top logits close together, so rounding alone flips some."""
    base = next((r["first8"] for r in runs if r.get("engine") == "nanoserve" and "first8" in r), None)
    for r in runs:
        if base is not None and r.get("engine") != "nanoserve" and "first8" in r:
            pairs = list(zip(base, r["first8"]))
            r["first_token_match"] = round(sum(a[:1] == b[:1] for a, b in pairs) / len(pairs), 3)
            r["first8_match"] = round(sum(a == b for a, b in pairs) / len(pairs), 3)
    for r in runs:
        r.pop("first8", None)


def summarize(workload: str, runs: list[dict]) -> list[dict]:
    w = workloads.get(workload)
    rows = []
    for key in dict.fromkeys((r["engine"], r["prefix_caching"]) for r in runs):
        ok = [r for r in runs if (r["engine"], r["prefix_caching"]) == key and "wall" in r]
        if not ok:
            rows.append(dict(engine=key[0], prefix_caching=key[1], error=runs[-1].get("error", "?")[:300]))
            continue
        wall = statistics.median(r["wall"] for r in ok)
        rows.append(dict(engine=key[0], prefix_caching=key[1], runs=len(ok), wall_s=round(wall, 2),
                         walls=[round(r["wall"], 2) for r in ok],
                         output_tok_s=round(w.num_output_tokens / wall, 1),
                         total_tok_s=round((w.num_output_tokens + w.num_prompt_tokens) / wall, 1),
                         startup_s=round(statistics.median(r["startup"] for r in ok), 1),
                         peak_rss_gib=round(max(r["peak_tree_rss_gib"] for r in ok), 2),
                         tokens=sorted({r["tokens"] for r in ok}), version=ok[0].get("version")))
        if "first8_match" in ok[0]:
            rows[-1]["first_token_match"] = [r["first_token_match"] for r in ok]
            rows[-1]["first8_match"] = [r["first8_match"] for r in ok]
        if "stats" in ok[0]:  # nanoserve: the share of held KV slots that stayed empty at the peak
            rows[-1]["kv_unused_at_peak"] = max(r["stats"]["kv_unused_fraction_at_peak"] for r in ok)
    base = next((r for r in rows if r["engine"] == "nanoserve" and "wall_s" in r), None)
    for r in rows:
        if base and "wall_s" in r:
            r["time_vs_nanoserve"] = round(r["wall_s"] / base["wall_s"], 2)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["W1"])
    ap.add_argument("--engines", nargs="+", default=["nanoserve", "vllm", "hf"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--models", type=Path, default=HERE / "models")
    ap.add_argument("--kv-gib", type=float, default=4.0)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--vllm-eager", action="store_true", help="turn vLLM's torch.compile off")
    ap.add_argument("--vllm-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND for vLLM")
    ap.add_argument("--vllm-dtype", default="bfloat16",
                    help="vLLM's dtype (float32: what a vLLM user may pick on a CPU without bf16 instructions)")
    ap.add_argument("--llamacpp-unified", action="store_true",
                    help="llama.cpp with one unified KV cache for all sequences (default: a stream per sequence)")
    ap.add_argument("--llamacpp-type", default="bf16", choices=["bf16", "f16", "f32"],
                    help="which GGUF llama.cpp loads (llamacpp_peer.py --make-gguf --outtype); bf16 as the others")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--worker", choices=list(WORKERS))
    ap.add_argument("--workload", default="W1")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--w2-caching", choices=["both", "on", "off"], default="both",
                    help="W2 runs each engine with prefix caching on and off; or only one of them")
    ap.add_argument("--async-scheduling", action="store_true", help="nanoserve with async_scheduling=True")
    ap.add_argument("--extra", default="{}")
    args = ap.parse_args()
    if args.worker:
        return worker_main(args)
    args.out.mkdir(parents=True, exist_ok=True)
    extra = {"kv_gib": args.kv_gib, "vllm_compile": not args.vllm_eager, "vllm_bind": args.vllm_bind,
             "vllm_dtype": args.vllm_dtype, "llamacpp_unified": args.llamacpp_unified,
             "llamacpp_type": args.llamacpp_type,
             "async_scheduling": args.async_scheduling}
    for workload in args.workloads:
        # W2 is the prefix-caching workload: run each engine with caching on and off.
        variants = {"both": [True, False], "on": [True], "off": [False]}[args.w2_caching] \
            if workload == "W2" else [True]
        runs = []
        for rnd in range(args.rounds):
            for engine in args.engines:
                for pc in variants:
                    if engine == "hf" and not pc:
                        continue  # transformers has no prefix cache to turn off
                    r = run_one(engine, workload, pc, args.models, extra, args.timeout)
                    r.update(engine=engine, prefix_caching=pc, round=rnd)
                    runs.append(r)
                    print(f"[{workload} round {rnd}] {engine} prefix_caching={pc}: "
                          + (f"{r['wall']:.1f}s (start-up {r['startup']:.1f}s, peak RSS "
                             f"{r['peak_tree_rss_gib']:.2f} GiB)" if "wall" in r else r["error"][-500:]),
                          flush=True)
        first_token_agreement(runs)
        summary = summarize(workload, runs)
        record = dict(workload=workload, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      command=" ".join(sys.argv), machine=machine(), summary=summary, runs=runs)
        (args.out / f"throughput-{workload}.json").write_text(json.dumps(record, indent=1))
        print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
