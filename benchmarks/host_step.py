"""Host work per decode step (issue 22's target: at most 0.5 ms for a batch of 64 at
~400 tokens of context), measured on the CPU with a tiny model, so that the
model's arithmetic is small and the engine's Python is what shows.

The phases are those of benchmarks/gpu.py's breakdown, timed the same way:
schedule, build_inputs, buffer_copy (the padded decode path filling the runner's
persistent input buffers, which a CUDA graph then replays), forward, prepare (what
an eager step builds instead), logits, sampler, postprocess. Host work is
schedule + build_inputs + buffer_copy + postprocess, as gpu.py counts it; on a GPU
buffer_copy also pays the host-to-device copies that here are memcpys.

The model is Qwen3-shaped, hidden 64, 2 layers, bf16, greedy, with a vocabulary
of 4096 (--vocab): on a GPU host the forward and the logits do not pass through
the CPU's caches, while here W1's 151936 (64 rows of logits are 19 MB) would
evict the engine's own data between the phases and inflate every host phase.
By default it runs as W1 does (token ids in, no tokenizer, detokenize off, outputs
only when a request finishes: LLM.generate's FINAL_ONLY); --detokenize loads the
demo model's tokenizer (whose vocabulary is 4096), detokenizes every token and
builds an output a step for each request (DELTA), as a streaming server does.
torch runs one thread (--threads): on a few busy cores, the host's small tensor
ops would otherwise wait on OpenMP workers and the times would be mostly noise.

    python benchmarks/host_step.py                        # one JSON line
    python benchmarks/host_step.py --compare /work/main .  # A B A B in fresh processes: medians, B/A
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PHASES = ("schedule", "build_inputs", "buffer_copy", "forward", "prepare", "logits", "sampler", "postprocess")
HOST = ("schedule", "build_inputs", "buffer_copy", "postprocess")


class _NoReplay:
    """Stands in for a captured graph while the runner fills its input buffers
    (as in gpu.py), so that filling them is timed apart from the forward."""

    def replay(self) -> None:
        pass


def make_model(root: Path, vocab: int, tokenizer: bool) -> Path:
    if tokenizer and vocab != 4096:
        raise SystemExit("--detokenize needs --vocab 4096, the demo tokenizer's")
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=0, bos_token_id=None)
    out = root / f"host-{vocab}"
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    if tokenizer:
        demo = HERE.parent / "nanoserve" / "demo_model"
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(demo / name, out / name)
    return out


def run_once(engine, params, batch: int, prompt_len: int, steps: int, warmup: int, rng) -> dict:
    """Prefill ``batch`` requests, then time ``steps`` decode steps phase by phase;
    each phase's median over the steps, in ms."""
    import torch

    from nanoserve.engine import RequestOutputKind
    runner, vocab = engine.runner, engine.model_config.vocab_size
    # outputs as W1 (LLM.generate) asks for them: at the end; detokenizing, as a server streams them
    kind = RequestOutputKind.DELTA if params.detokenize else RequestOutputKind.FINAL_ONLY
    rids = [engine.add_request([rng.randrange(1, vocab) for _ in range(prompt_len)], params, output_kind=kind)
            for _ in range(batch)]
    reqs = [engine.scheduler.requests[r] for r in rids]
    while not all(r.output_token_ids for r in reqs):
        engine.step()
    times = {p: [] for p in PHASES}
    with torch.inference_mode():
        for step in range(warmup + steps):
            t0 = time.perf_counter()
            sched = engine.scheduler.schedule()
            t1 = time.perf_counter()
            seqs = engine.build_inputs(sched)
            t2 = time.perf_counter()
            assert len(seqs) == batch and all(len(s.token_ids) == 1 for s in seqs), "not a decode step of all"
            bs = next(s for s in runner.decode_sizes if s >= batch)
            saved, runner.graphs = runner.graphs, {bs: _NoReplay()}
            try:
                runner._run_decode_padded(seqs)
            finally:
                runner.graphs = saved
            t3 = time.perf_counter()
            hidden = runner._forward_static(bs)[:batch]
            t4 = time.perf_counter()
            runner.prepare(seqs)
            t5 = time.perf_counter()
            logits = runner.model.compute_logits(hidden)
            t6 = time.perf_counter()
            results = runner.sampler(logits, [s.sample for s in seqs])
            t7 = time.perf_counter()
            engine.postprocess(sched, results)
            t8 = time.perf_counter()
            if step >= warmup:
                for p, a, b in zip(PHASES, (t0, t1, t2, t3, t4, t5, t6, t7), (t1, t2, t3, t4, t5, t6, t7, t8)):
                    times[p].append((b - a) * 1000)
    plain = []
    for _ in range(steps):  # engine.step() as the engine's loop runs it
        t = time.perf_counter()
        engine.step()
        plain.append((time.perf_counter() - t) * 1000)
    for r in rids:
        engine.abort_request(r)
    ms = {p: statistics.median(v) for p, v in times.items()}
    return dict(ms, plain_step=statistics.median(plain), context_last=reqs[0].num_tokens)


def measure(args) -> dict:
    import torch

    import nanoserve
    from nanoserve import LLM, SamplingParams
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp), args.vocab, args.detokenize)
        # every prompt prefilled in one step, so that all contexts are equal
        llm = LLM(str(path), dtype="bfloat16", device="cpu", max_model_len=1024, max_num_seqs=args.batch,
                  max_num_batched_tokens=args.batch * args.prompt_len, skip_tokenizer_init=not args.detokenize,
                  cudagraph_capture_sizes=[args.batch], enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True, detokenize=args.detokenize)
    rng = random.Random(0)
    runs = [run_once(llm.engine, params, args.batch, args.prompt_len, args.steps, args.warmup, rng)
            for _ in range(args.runs)]
    ms = {k: round(statistics.median(r[k] for r in runs), 4) for k in (*PHASES, "plain_step")}
    return dict(detokenize=args.detokenize, vocab=args.vocab, batch=args.batch, context=f"{args.prompt_len}-"
                f"{runs[0]['context_last']}", runs=args.runs, steps=args.steps, torch_threads=torch.get_num_threads(),
                nanoserve=str(Path(nanoserve.__file__).parent), ms=ms,
                host_ms=round(sum(ms[p] for p in HOST), 4),
                host_eager_ms=round(sum(ms[p] for p in ("schedule", "build_inputs", "prepare", "postprocess")), 4))


def compare(args) -> dict:
    """A B A B: this script in fresh processes, each with one tree's nanoserve first
    on PYTHONPATH; per tree the median of each number over the rounds, and B / A."""
    trees = [str(Path(t).resolve()) for t in args.compare]
    opts = {"--vocab": args.vocab, "--batch": args.batch, "--prompt-len": args.prompt_len, "--steps": args.steps,
            "--warmup": args.warmup, "--runs": args.runs, "--threads": args.threads}
    cmd = [sys.executable, __file__, *(["--detokenize"] if args.detokenize else []),
           *(x for k, v in opts.items() for x in (k, str(v)))]
    got: dict[str, list[dict]] = {t: [] for t in trees}
    for _ in range(args.rounds):
        for t in trees:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([t, str(HERE)]))
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            got[t].append(json.loads(out.strip().splitlines()[-1]))
    med = {t: {k: round(statistics.median(r["ms"][k] if k in r["ms"] else r[k] for r in rs), 4)
               for k in (*PHASES, "plain_step", "host_ms", "host_eager_ms")} for t, rs in got.items()}
    a, b = trees
    return dict(detokenize=args.detokenize, vocab=args.vocab, rounds=args.rounds, A=a, B=b, A_ms=med[a], B_ms=med[b],
                ratio_B_over_A={k: round(med[b][k] / med[a][k], 3) for k in med[a] if med[a][k]},
                host_ms_each_round={t: [r["host_ms"] for r in rs] for t, rs in got.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--detokenize", action="store_true", help="the demo tokenizer, every token detokenized")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=400)
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per run")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3, help="runs (fresh requests) per process; medians over them")
    ap.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    ap.add_argument("--compare", nargs=2, metavar=("TREE_A", "TREE_B"),
                    help="two checkouts: A B A B in fresh processes")
    ap.add_argument("--rounds", type=int, default=3, help="with --compare")
    args = ap.parse_args()
    print(json.dumps(compare(args) if args.compare else measure(args)), flush=True)


if __name__ == "__main__":
    main()
