"""Tensor parallelism on this machine: one workload at each --tp size, every run
in its own process, the same prompts and greedy output lengths as
throughput.py. Besides wall time it reports what TP costs: the share of rank
0's step time spent in collectives (all-reduce, the logits gather, the step
message; waiting for the slower rank counts, as it does in a step), and each
rank's peak RSS (VmHWM).

    python benchmarks/make_models.py w0
    python benchmarks/tp.py --workload W0 --tp 1 2

The KV budget is split over the ranks (each holds its share of the KV heads),
so every size gets the same number of blocks. Results go to
benchmarks/results/tp-<workload>.json.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import workloads  # noqa: E402
from throughput import _digest, machine  # noqa: E402


def _timed(fn, totals: dict, key: str):
    def run(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - t
    return run


def _vm_hwm_gib(pid: str | int = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def worker(workload: str, models: Path, tp: int, kv_gib: float) -> dict:
    import torch.distributed as dist
    from nanoserve import LLM, SamplingParams
    from nanoserve.model import TPGroup
    w = workloads.get(workload)
    totals: dict[str, float] = {}
    for name in ("all_reduce", "gather", "broadcast_object_list"):  # model.py looks them up per call
        setattr(dist, name, _timed(getattr(dist, name), totals, name))
    TPGroup.send_step = _timed(TPGroup.send_step, totals, "send_step")  # the step message (TCPStore)
    t0 = time.perf_counter()
    llm = LLM(str(models / w.model), skip_tokenizer_init=True, tensor_parallel_size=tp,
              kv_cache_memory_bytes=int(kv_gib * 2**30 / tp))
    llm.generate([w.prompts[0][:16]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    startup = time.perf_counter() - t0
    runner = llm.engine.runner
    runner.execute = _timed(runner.execute, totals, "step")
    totals.clear()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in w.output_lens]
    t = time.perf_counter()
    outs = llm.generate(w.prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    workers = llm.engine.workers.procs if llm.engine.workers else []
    peaks = [_vm_hwm_gib()] + [_vm_hwm_gib(p.pid) for p in workers]
    comm = sum(v for k, v in totals.items() if k != "step")
    result = dict(tp=tp, wall=wall, startup=startup, output_tok_s=w.num_output_tokens / wall,
                  tokens=_digest(o.outputs[0].token_ids for o in outs), step_s=totals.get("step", 0.0),
                  collectives_s={k: round(v, 2) for k, v in totals.items() if k != "step"},
                  collective_share=comm / max(totals.get("step", 1e-9), 1e-9),
                  peak_rss_gib_per_rank=[round(p, 3) for p in peaks], weight_bytes_rank0=llm.engine.weight_bytes,
                  kv_blocks=llm.engine.kv_plan.num_blocks, backend=llm.engine.backend.name,
                  ru_maxrss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    llm.shutdown()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="W0")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--kv-gib", type=float, default=4.0, help="KV budget over all ranks")
    ap.add_argument("--models", type=Path, default=HERE / "models")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--worker-tp", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_tp:
        print("RESULT " + json.dumps(worker(args.workload, args.models, args.worker_tp, args.kv_gib)), flush=True)
        return
    runs = []
    for rnd in range(args.rounds):
        for tp in args.tp:
            cmd = [sys.executable, __file__, "--workload", args.workload, "--models", str(args.models),
                   "--kv-gib", str(args.kv_gib), "--worker-tp", str(tp)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
            r = json.loads(lines[-1][7:]) if lines else dict(tp=tp, error=out.stderr[-2000:])
            r["round"] = rnd
            runs.append(r)
            print(json.dumps(r), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    record = dict(workload=args.workload, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  command=" ".join(sys.argv), machine=machine(), runs=runs)
    (args.out / f"tp-{args.workload}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
