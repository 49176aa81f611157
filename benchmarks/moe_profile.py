"""Where a mixture-of-experts decode step's time goes on the CPU: wall time per module
kind (attention, router gate, experts), by forward hooks, over the steps of 16 sequences
of 8-token prompts generating 33 tokens each (RESULTS.md, "mixture-of-experts models").

    python benchmarks/make_models.py wmoe
    PYTHONPATH=.:benchmarks python benchmarks/moe_profile.py [--models DIR] [--enforce-eager]
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import workloads  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, default=HERE / "models")
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    from nanoserve import LLM, SamplingParams
    llm = LLM(str(args.models / "wmoe"), skip_tokenizer_init=True, kv_cache_memory_bytes=2**30,
              enforce_eager=args.enforce_eager)
    model = llm.engine.runner.model
    acc, started, on = collections.defaultdict(float), {}, [False]

    def hook(name, mod):
        def before(m, args):
            started[id(m)] = time.perf_counter()

        def after(m, args, out):  # returns None: the output stays
            if on[0]:
                acc[name] += time.perf_counter() - started[id(m)]
        mod.register_forward_pre_hook(before)
        mod.register_forward_hook(after)
    for layer in model.model.layers:
        for name, mod in [("attention", layer.self_attn), ("sparse MLP", layer.mlp), ("router gate", layer.mlp.gate),
                          ("experts (fused_moe)", layer.mlp.experts)]:
            hook(name, mod)
    hook("model forward", model)
    prompts = [p[:8] for p in workloads.get("WMOE").prompts]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm
    on[0], steps = True, 33
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - t
    print(f"backend {llm.engine.backend.name}: {wall / steps * 1e3:.1f} ms a step")
    for name, seconds in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"  {name:22s} {seconds / steps * 1e3:8.2f} ms a step")


if __name__ == "__main__":
    main()
