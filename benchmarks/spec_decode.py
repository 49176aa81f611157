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
"""
from __future__ import annotations

import argparse
import json
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, default=HERE / "models")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="bfloat16 on the CPU by default; float32's greedy tokens "
                                                    "do not depend on the chunk's length")
    args = ap.parse_args()
    from nanoserve import LLM, SamplingParams
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min}
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
