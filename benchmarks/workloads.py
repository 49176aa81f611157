"""The benchmark workloads, as plain token ids, identical for every engine."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    model: str                 # benchmarks/models/<model>
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def _random(name, model, n, prompt_range, output_range, vocab) -> Workload:
    rng = random.Random(0)  # as nano-vllm's bench: random.seed(0), then draw
    prompts, outs = [], []
    for _ in range(n):
        prompts.append([rng.randint(0, vocab - 1) for _ in range(rng.randint(*prompt_range))])
        outs.append(rng.randint(*output_range))
    return Workload(name, model, prompts, outs)


def _shared_prefix(n=64, prefix_len=1024, vocab=151936) -> Workload:
    rng = random.Random(0)
    prefix = [rng.randint(0, vocab - 1) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randint(0, vocab - 1) for _ in range(rng.randint(32, 64))] for _ in range(n)]
    return Workload("W2", "w1", prompts, [64] * n)


def get(name: str) -> Workload:
    if name == "W1":
        return _random("W1", "w1", 64, (64, 512), (32, 256), 151936)
    if name == "W0":
        return _random("W0", "w0", 256, (64, 256), (32, 128), 32000)
    if name == "WMOE":  # W0's first 16 requests on wmoe: W0's shapes through a mixture of experts
        w = get("W0")
        return Workload("WMOE", "wmoe", w.prompts[:16], w.output_lens[:16])
    if name == "W2":
        return _shared_prefix()
    if name == "tiny":  # a smoke test of the harness itself
        return _random("tiny", "w0", 8, (16, 32), (4, 8), 32000)
    raise ValueError(f"unknown workload {name!r}: W0, W1, W2, WMOE or tiny")
