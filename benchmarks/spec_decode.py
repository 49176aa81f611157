"""Speculative decoding with n-gram drafts, single stream: one greedy request at a time on w0
(benchmarks/make_models.py), with and without --speculative-config, alternated A B A B in one
process (both engines loaded once, each warmed up), and the median of each side reported:

* ``decode_tok_s``: output tokens after the first over the time from the first to the last;
* the acceptance rate: accepted draft tokens / draft tokens (vLLM's spec-decode counters), and
  the mean tokens a step emitted for the request (1 + accepted / drafts);
* whether the two sides' tokens are equal (greedy: they must be).

Cases: ``repeat``, a random 64-token passage written four times (an edit of a file it was given, a
summary quoting its input: the output's continuation is in the context); ``random``, 256 random
tokens (drafts come only from what the model repeats of its own output); ``rejected``, the random
prompt with a proposer that always drafts k tokens of id 1 (the cost of verifying drafts that fail:
the worst case). w0's weights are random: its greedy output soon loops on a token or two, which
n-gram drafts predict well, so ``repeat`` and ``random`` show what acceptance buys, not a real
model's acceptance rate.

    python benchmarks/make_models.py w0      # once
    python benchmarks/spec_decode.py --rounds 5 [--k 3] [--dtype float32]

Results go to benchmarks/results/spec-decode.json.

**Batched** (``--concurrency 1,8,32``): c greedy requests at once (c random 64-token prompts, each
``--output-len`` tokens, one ``generate`` call), on ``--model`` (w0 or w1), for each c: A without
speculation, then B with it in three cases, in one round, the order rotated from round to round:

* ``loop``: the n-gram drafts as they come; a random-weight model's greedy output loops, so they are
  accepted near-ideally (the best case, not a real model's);
* ``partial``: the same drafts with each token replaced by a wrong one with probability ``--corrupt``
  (seeded): acceptance near a half at 0.3, falling from position to position as a real model's does;
* ``rejected``: k tokens of id 1 every step, none accepted (the worst case).

With ``--schedule '[[1, 8, 3], [9, 256, 0]]'`` a third engine, C, speculates with that
``num_speculative_tokens_per_batch_size`` (vLLM's dynamic speculative decoding: drafts by batch size),
in the same three cases (``C:loop``, ...), rotated with the others.

Each run reports output tokens/s over the whole call (prefill included) and over the decode (from the
last first token to the last token), and B's acceptance, per draft position too (vLLM's
``spec_decode_num_accepted_tokens_per_pos`` / drafts). Results go to
benchmarks/results/spec-decode-batched-<model>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUTPUT_LEN = 256


def prompts() -> dict[str, list[int]]:
    import torch
    g = torch.Generator().manual_seed(0)
    passage = torch.randint(100, 32000, (64,), generator=g).tolist()
    return {"repeat": passage * 4, "random": torch.randint(100, 32000, (256,), generator=g).tolist()}


def run(llm, prompt: list[int]) -> dict:
    from nanoserve import SamplingParams
    before = llm.stats()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True,
                                                detokenize=False), use_tqdm=False)[0]
    m, after = out.metrics, llm.stats()
    spec = {k: after[k] - before[k] for k in after if k.startswith("spec_decode_")}
    return dict(decode_tok_s=(OUTPUT_LEN - 1) / (m.last_token_time - m.first_token_time),
                tokens=list(out.outputs[0].token_ids), **spec)


def always_rejected(llm, k: int):
    """Swap the engine's proposer for one that always drafts ``k`` tokens of id 1; returns the undo."""
    proposer = llm.engine.proposer
    propose = proposer.propose
    proposer.propose = lambda token_ids, n: [1] * min(k, n)
    return lambda: setattr(proposer, "propose", propose)


def corrupted(llm, p: float, seed: int = 0):
    """Swap the engine's proposer for one whose n-gram drafts have each token replaced by another
    (the next id) with probability ``p``; returns the undo."""
    import random
    proposer, rng, vocab = llm.engine.proposer, random.Random(seed), llm.engine.model_config.vocab_size
    propose = proposer.propose
    proposer.propose = lambda token_ids, n: [(t + 1) % vocab if rng.random() < p else t for t in propose(token_ids, n)]
    return lambda: setattr(proposer, "propose", propose)


def spec_delta(before: dict, after: dict) -> dict:
    """The spec-decode counters' change between two ``stats()`` (per position: a list)."""
    return {k: [a - b for a, b in zip(after[k], before[k])] if isinstance(after[k], list) else after[k] - before[k]
            for k in after if k.startswith("spec_decode_")}


def run_batch(llm, prompts: list[list[int]], output_len: int) -> dict:
    from nanoserve import SamplingParams
    engine, steps = llm.engine, []
    step = engine.step

    def timed_step():  # each engine step's time: what a verification step costs against a decode step
        t = time.perf_counter()
        out = step()
        steps.append(time.perf_counter() - t)
        return out
    before = llm.stats()
    engine.step = timed_step
    start = time.perf_counter()
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                                                    detokenize=False), use_tqdm=False)
    finally:
        del engine.step
    wall = time.perf_counter() - start
    first, last = max(o.metrics.first_token_time for o in outs), max(o.metrics.last_token_time for o in outs)
    return dict(tok_s=len(prompts) * output_len / wall, decode_tok_s=len(prompts) * (output_len - 1) / (last - first),
                step_ms=1000 * statistics.median(steps[1:]), num_steps=len(steps),  # [1:]: past the prefill
                tokens=[list(o.outputs[0].token_ids) for o in outs], **spec_delta(before, llm.stats()))


def batched(args, spec: dict) -> None:
    import torch

    from nanoserve import LLM, SamplingParams
    common = dict(skip_tokenizer_init=True, enable_prefix_caching=False, dtype=args.dtype, kv_cache_memory_bytes=2**30)
    path = str(args.models / args.model)
    engines = {"A": LLM(path, **common), "B": LLM(path, **common, speculative_config=spec)}
    if args.schedule is not None:  # C: the same drafts, by batch size
        engines["C"] = LLM(path, **common, speculative_config={**spec,
                                                              "num_speculative_tokens_per_batch_size": args.schedule})
    for llm in engines.values():  # warm-up: another prompt, long enough to speculate, and a batch
        llm.generate([list(range(200, 264)) * 2] * 4, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    g = torch.Generator().manual_seed(0)
    pool = [torch.randint(100, 32000, (64,), generator=g).tolist() for _ in range(max(args.concurrency))]
    cases = {"A": ("A", lambda: None)}  # name: (engine, the drafts' swap)
    for side in [s for s in engines if s != "A"]:
        prefix = "" if side == "B" else f"{side}:"  # B's names as before the schedule
        cases.update({f"{prefix}loop": (side, lambda: None),
                      f"{prefix}partial": (side, lambda side=side: corrupted(engines[side], args.corrupt)),
                      f"{prefix}rejected": (side, lambda side=side: always_rejected(engines[side], args.k))})
    report = {"speculative_config": spec, "schedule": args.schedule, "model": args.model,
              "dtype": str(engines["A"].engine.dtype), "output_len": args.output_len, "rounds": args.rounds, "corrupt": args.corrupt,
              "load_before": os.getloadavg(), "concurrency": {}}
    for c in args.concurrency:
        prompts, runs = pool[:c], {name: [] for name in cases}
        for r in range(args.rounds):
            names = list(cases)
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotated: no case always runs first
                side, swap = cases[name]
                undo = swap()
                runs[name].append(run_batch(engines[side], prompts, args.output_len))
                if undo is not None:
                    undo()
        report["concurrency"][c] = row = {}
        base = statistics.median(x["tok_s"] for x in runs["A"])
        base_decode = statistics.median(x["decode_tok_s"] for x in runs["A"])
        for name, rs in runs.items():
            row[name] = summary(rs, runs["A"][0]["tokens"])
            paired = [b["tok_s"] / a["tok_s"] for a, b in zip(runs["A"], rs)]  # a round's B over its A: drift cancels
            row[name].update(ratio=row[name]["tok_s_median"] / base,
                             decode_ratio=row[name]["decode_tok_s_median"] / base_decode,
                             round_ratios=[round(x, 3) for x in paired], round_ratio_median=statistics.median(paired),
                             step_ratios=[round(b["step_ms"] / a["step_ms"], 3) for a, b in zip(runs["A"], rs)])
            print(f"c={c} {name}: {row[name]['tok_s_median']:.1f} tok/s (x{row[name]['ratio']:.2f}; rounds' median "
                  f"x{row[name]['round_ratio_median']:.2f}), decode "
                  f"{row[name]['decode_tok_s_median']:.1f} tok/s (x{row[name]['decode_ratio']:.2f}), a step "
                  f"{row[name]['step_ms_median']:.1f} ms (x{statistics.median(row[name]['step_ratios']):.2f}), "
                  f"acceptance "
                  f"{row[name].get('acceptance_rate')}, per position {row[name].get('per_position')}, "
                  f"same tokens {row[name]['same_tokens']}", flush=True)
    report["load_after"] = os.getloadavg()
    report["when"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    out = HERE / "results" / f"spec-decode-batched-{args.model}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"-> {out}", file=sys.stderr)


def summary(rs: list[dict], tokens: list[list[int]]) -> dict:
    """One side's runs: medians, each run's numbers, and (speculative) acceptance over all its runs."""
    row = {"tok_s_median": statistics.median(r["tok_s"] for r in rs), "tok_s": [round(r["tok_s"], 1) for r in rs],
           "decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in rs),
           "decode_tok_s": [round(r["decode_tok_s"], 1) for r in rs],
           "step_ms_median": statistics.median(r["step_ms"] for r in rs),
           "step_ms": [round(r["step_ms"], 1) for r in rs],
           "steps_per_run": statistics.median(r["num_steps"] for r in rs),
           "same_tokens": sum(r["tokens"] == tokens for r in rs) / len(rs)}
    drafts = sum(r.get("spec_decode_num_drafts", 0) for r in rs)
    if drafts:
        drafted = sum(r["spec_decode_num_draft_tokens"] for r in rs)
        accepted = sum(r["spec_decode_num_accepted_tokens"] for r in rs)
        per_pos = [sum(col) for col in zip(*(r["spec_decode_num_accepted_tokens_per_pos"] for r in rs))]
        row.update(acceptance_rate=round(accepted / drafted, 3), mean_acceptance_length=round(1 + accepted / drafts, 2),
                   per_position=[round(n / drafts, 3) for n in per_pos], drafts_per_run=drafts / len(rs))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, default=HERE / "models")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="bfloat16 on the CPU by default; float32's greedy tokens "
                                                    "do not depend on the chunk's length")
    ap.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=None,
                    help="batched: requests at once, e.g. 1,8,32 (default: the single-stream cases)")
    ap.add_argument("--model", default="w0", help="batched: the model under --models")
    ap.add_argument("--output-len", type=int, default=128, help="batched: tokens each request generates")
    ap.add_argument("--schedule", type=json.loads, default=None,
                    help="batched: also run C, speculating with this num_speculative_tokens_per_batch_size (JSON), "
                         "e.g. '[[1, 8, 3], [9, 256, 0]]'")
    ap.add_argument("--corrupt", type=float, default=0.3, help="batched: the partial case's chance of a wrong "
                                                               "draft token")
    args = ap.parse_args()
    from nanoserve import LLM, SamplingParams
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min}
    if args.concurrency:
        return batched(args, spec)
    common = dict(skip_tokenizer_init=True, enable_prefix_caching=False, dtype=args.dtype, kv_cache_memory_bytes=2**30)
    engines = {"A": LLM(str(args.models / "w0"), **common),
               "B": LLM(str(args.models / "w0"), **common, speculative_config=spec)}
    for llm in engines.values():  # warm-up: another prompt, long enough to speculate
        llm.generate([list(range(200, 264)) * 2], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    report = {"speculative_config": spec, "dtype": str(engines["A"].engine.dtype), "output_len": OUTPUT_LEN,
              "rounds": args.rounds, "prompts": {}}
    cases = {**prompts()}
    cases["rejected"] = cases["random"]
    for name, prompt in cases.items():
        runs = {"A": [], "B": []}
        undo = always_rejected(engines["B"], args.k) if name == "rejected" else None
        for _ in range(args.rounds):
            for side in ("A", "B"):
                runs[side].append(run(engines[side], prompt))
        if undo is not None:
            undo()
        b = runs["B"]
        drafted = sum(r["spec_decode_num_draft_tokens"] for r in b)
        accepted = sum(r["spec_decode_num_accepted_tokens"] for r in b)
        drafts = sum(r["spec_decode_num_drafts"] for r in b)
        row = {side: {"decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in rs),
                      "decode_tok_s": [round(r["decode_tok_s"], 1) for r in rs]} for side, rs in runs.items()}
        row.update(acceptance_rate=accepted / drafted if drafted else None,
                   tokens_per_draft_step=1 + accepted / drafts if drafts else None,
                   draft_tokens_per_round=drafted / args.rounds,
                   same_tokens=all(r["tokens"] == runs["A"][0]["tokens"] for rs in runs.values() for r in rs),
                   speedup=row["B"]["decode_tok_s_median"] / row["A"]["decode_tok_s_median"])
        report["prompts"][name] = row
        print(f"{name}: A {row['A']['decode_tok_s_median']:.1f} tok/s, B {row['B']['decode_tok_s_median']:.1f} "
              f"tok/s (x{row['speedup']:.2f}), acceptance {row['acceptance_rate']}, tokens/draft step "
              f"{row['tokens_per_draft_step']}, same tokens {row['same_tokens']}", flush=True)
    report["when"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    out = HERE / "results" / "spec-decode.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"-> {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
