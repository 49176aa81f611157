"""What structured outputs cost (issue 25): W0 with one json_schema request
among its 256 against W0 unconstrained, side by side (A B A B, each run in a
fresh process), and the compile time of a 20-property JSON schema.

The W0 model has no tokenizer of its own; both variants load the demo model's
(4,096 tokens, so the constrained request can only use ids below that; the
unconstrained requests are token ids and never detokenized, as in throughput.py).

    python benchmarks/make_models.py w0
    python benchmarks/structured.py --rounds 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import workloads  # noqa: E402
from throughput import _digest, machine  # noqa: E402

DEMO = HERE.parent / "nanoserve" / "demo_model"
# A record whose string fields let a random model write until max_tokens: the
# constrained request stays as long as the one it replaces, most of the time.
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "tags": {"type": "array",
          "items": {"type": "string"}}}, "required": ["title", "tags"]}


def schema_20() -> dict:
    """20 properties of every JSON type, some nested, some optional."""
    kinds = [{"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "number"}, {"type": "boolean"},
             {"type": "array", "items": {"type": "string"}, "maxItems": 4},
             {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "required": ["a"]},
             {"enum": ["red", "green", "blue"]}, {"type": "string", "pattern": "[a-z]{3}-[0-9]{4}"}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(20)}
    return {"type": "object", "properties": props, "required": list(props)[:15]}


def run_worker(variant: str, model: str) -> dict:
    from nanoserve import LLM, SamplingParams, StructuredOutputsParams
    w = workloads.get("W0")
    llm = LLM(model, tokenizer=str(DEMO), kv_cache_memory_bytes=4 * 2**30)
    constraint = StructuredOutputsParams(json=SCHEMA)
    warm = SamplingParams(temperature=0, max_tokens=2)
    # the grammar compiles at warm-up, as a server compiles it off the loop before admission
    llm.generate([w.prompts[0][:16]], warm if variant == "plain" else
                 SamplingParams(temperature=0, max_tokens=2, structured_outputs=constraint), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in w.output_lens]
    if variant == "one_json":
        params[0] = SamplingParams(temperature=0, max_tokens=w.output_lens[0], structured_outputs=constraint)
    t = time.perf_counter()
    outs = llm.generate(w.prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    first = outs[0].outputs[0]
    return dict(wall=wall, num_out=sum(len(o.outputs[0].token_ids) for o in outs),
                constrained_tokens=len(first.token_ids), constrained_text=first.text[:200],
                rest_digest=_digest(o.outputs[0].token_ids for o in outs[1:]))


def compile_times(repeats: int) -> dict:
    """Seconds to compile the 20-property schema: the first constraint of a
    process (TokenizerInfo built too) and later ones (a fresh compiler each,
    so the cache never answers)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DEMO)
    schema = json.dumps(schema_20())
    firsts, later = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
        xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(schema)
        firsts.append(time.perf_counter() - t)
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t = time.perf_counter()
        compiler.compile_json_schema(schema)
        later.append(time.perf_counter() - t)
    return dict(vocab=len(tok), first_s=statistics.median(firsts), compile_s=statistics.median(later),
                all_first=[round(x, 4) for x in firsts], all_compile=[round(x, 4) for x in later])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--models", type=Path, default=HERE / "models")
    ap.add_argument("--compile-repeats", type=int, default=5)
    ap.add_argument("--worker", choices=["plain", "one_json"])
    args = ap.parse_args()
    model = str(args.models / "w0")
    if args.worker:
        print("RESULT " + json.dumps(run_worker(args.worker, model)), flush=True)
        return
    runs = []
    for rnd in range(args.rounds):
        for variant in ("plain", "one_json"):
            proc = subprocess.run([sys.executable, __file__, "--worker", variant, "--models", str(args.models)],
                                  capture_output=True, text=True)
            line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{variant} failed:\n{proc.stderr[-3000:]}")
            r = json.loads(line[7:]) | dict(variant=variant, round=rnd)
            runs.append(r)
            print(f"[round {rnd}] {variant}: {r['wall']:.2f} s, {r['num_out']} tokens "
                  f"(constrained request: {r['constrained_tokens']})", flush=True)
    med = {v: statistics.median(r["wall"] for r in runs if r["variant"] == v) for v in ("plain", "one_json")}
    pairs = [b["wall"] / a["wall"] for a, b in zip(runs[::2], runs[1::2])]
    summary = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=" ".join(sys.argv),
                   machine=machine(), median_s=med, ratio_of_medians=med["one_json"] / med["plain"],
                   pair_ratios=[round(p, 3) for p in pairs], compile=compile_times(args.compile_repeats),
                   runs=runs)
    out = HERE / "results" / "structured-w0.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
