"""Time one sampling step (model.Sampler) over a large vocabulary, by setting.

    PYTHONPATH=. python benchmarks/sampler.py [--rows 64] [--vocab 151936] [--repeat 5]

Logits are synthetic, in two shapes, because the cost of top-p depends on how many
tokens a row's nucleus holds and the benchmark models' random weights give flat rows:
- peaked: a language model's look, a few hundred likely tokens of falling (Zipf-like)
  logits over a long flat tail;
- flat: a random-weight model's rows, where the nucleus takes most of the vocabulary.
bf16 logits, as a bf16 model's head gives them. The Sampler takes the CPU backend's top-k/top-p
(cpu_backend.top_k_top_p_by_candidates), as the engine's does on a CPU; --reference: model.py's.
Prints the median of --repeat calls in ms.
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from nanoserve import cpu_backend, kernels
from nanoserve.model import SampleRequest, Sampler

BASE = dict(temperature=0.7, top_p=1.0, top_k=0, min_p=0.0, seed=None, presence_penalty=0.0,
            frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=None, logprobs=None,
            allowed_token_ids=None, logprob_token_ids=None)
SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 0.7": {},
    "top_p 0.9": dict(top_p=0.9),
    "top_p 0.95, seed": dict(top_p=0.95, seed=1),
    "top_k 50": dict(top_k=50),
    "top_k 50, top_p 0.9": dict(top_k=50, top_p=0.9),
}


def logits_of(shape: str, rows: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, vocab, generator=g)
    if shape == "peaked":  # at temperature 0.7: top_p 0.9 keeps ~14 tokens, 0.95 ~30; the top 1,024 hold 99.5%
        x[:, :1000] += 12 - 1.3 * torch.log1p(torch.arange(1000.0))
        x = x[:, torch.randperm(vocab, generator=g)]
    else:
        x *= 0.5
    return x.bfloat16()


def time_setting(sampler: Sampler, logits: torch.Tensor, setting: dict, repeat: int) -> float:
    rows = [SampleRequest(SimpleNamespace(**{**BASE, **setting}), [1, 2, 3], [4]) for _ in range(logits.shape[0])]
    sampler(logits, rows)  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        sampler(logits, rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--reference", action="store_true", help="the reference top-k/top-p (it sorts top-p rows)")
    args = ap.parse_args()
    top_k_top_p = kernels.top_k_top_p_reference if args.reference else cpu_backend.top_k_top_p_by_candidates
    sampler = Sampler(top_k_top_p=top_k_top_p)
    print(f"{args.rows} rows x {args.vocab} vocabulary, {torch.get_num_threads()} threads, median of {args.repeat}")
    for shape in ("peaked", "flat"):
        logits = logits_of(shape, args.rows, args.vocab)
        for name, setting in SETTINGS.items():
            print(f"{shape:7s} {name:22s} {time_setting(sampler, logits, setting, args.repeat):8.1f} ms")


if __name__ == "__main__":
    main()
