"""Time the top-k/top-p mask alone, as the CPU's Sampler runs it, by batch size and setting.

    PYTHONPATH=. python benchmarks/top_k_top_p.py [--rows 1 8 64] [--vocab 151936] [--repeat 9]
        [--against OTHER_TREE]

The op is the CPU backend's (cpu_backend.top_k_top_p_by_candidates). --against: also the
model.apply_top_k_top_p of another checkout's nanoserve/model.py (one from before the CPU's
variant moved behind the Backend, 2026-12-07, when that function held it), loaded in this
process, the two called in turn (A B, then B A, ...) so that a busy machine slows both alike.
fp32 logits at temperature 0.7 (the Sampler's, divided), "peaked" and "flat" as in
benchmarks/sampler.py. Prints the median of --repeat calls in ms (and B/A).
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

import torch

from nanoserve import cpu_backend

SETTINGS = {"top_p 0.9": (0, 0.9), "top_k 50": (50, 1.0), "top_k 50, top_p 0.9": (50, 0.9)}


def logits_of(shape: str, rows: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, vocab, generator=g)
    if shape == "peaked":  # top_p 0.9 keeps ~14 tokens, as in benchmarks/sampler.py
        x[:, :1000] += 12 - 1.3 * torch.log1p(torch.arange(1000.0))
        x = x[:, torch.randperm(vocab, generator=g)]
    else:
        x *= 0.5
    return x / 0.7


def other_tree_op(tree: str):
    """That checkout's model.apply_top_k_top_p (its model.py's own imports resolve to this tree)."""
    spec = importlib.util.spec_from_file_location("other_model", f"{tree}/nanoserve/model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.apply_top_k_top_p


def timed(op, logits, k, p) -> float:
    rows = logits.shape[0]
    start = time.perf_counter()
    op(logits, [k] * rows, [p] * rows)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--against", help="another checkout's root: its model.apply_top_k_top_p is A")
    args = ap.parse_args()
    ops = {"B": cpu_backend.top_k_top_p_by_candidates}
    if args.against:
        ops = {"A": other_tree_op(args.against), **ops}
    print(f"{' / '.join(ops)} ms, {torch.get_num_threads()} threads, median of {args.repeat}")
    for shape in ("peaked", "flat"):
        for rows in args.rows:
            logits = logits_of(shape, rows, args.vocab)
            for name, (k, p) in SETTINGS.items():
                times = {n: [] for n in ops}
                for n, op in ops.items():  # warm-up; the masks must agree
                    out = op(logits, [k] * rows, [p] * rows)
                    assert torch.equal(out, next(iter(ops.values()))(logits, [k] * rows, [p] * rows)), n
                for r in range(args.repeat):
                    for n in (list(ops) if r % 2 == 0 else list(ops)[::-1]):
                        times[n].append(timed(ops[n], logits, k, p))
                medians = {n: statistics.median(t) * 1e3 for n, t in times.items()}
                ratio = f"  B/A {medians['B'] / medians['A']:.2f}" if "A" in medians else ""
                print(f"{shape:7s} {rows:3d} rows {name:20s} " + " ".join(f"{m:8.2f}" for m in medians.values())
                      + ratio)


if __name__ == "__main__":
    main()
