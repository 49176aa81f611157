"""Single-stream latency, nanoserve against llama.cpp: one request on W1's
model, 64 prompt tokens, 128 output tokens, greedy, ignore_eos.

Each run is a fresh process (the engine's venv), engines alternated A B A B
for ``--rounds`` rounds. A run starts its engine, runs one warm-up request
(another prompt, so nothing of the measured one is cached), then the measured
one, and reports:

* ``prefill_s``: from handing the request over to its first token (nanoserve:
  ``metrics.first_token_time - metrics.arrival_time``; llama.cpp: from the
  call to the step that sampled the first token);
* ``decode_tok_s``: the other 127 tokens over the time from the first token to
  the last.

    python benchmarks/llamacpp_peer.py --make-gguf --models benchmarks/models w1   # once
    python benchmarks/single_stream.py --models benchmarks/models --rounds 3

Results go to benchmarks/results/single-stream.json.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import workloads  # noqa: E402

PROMPT_LEN, OUTPUT_LEN = 64, 128


def prompts() -> tuple[list[int], list[int]]:
    """The measured prompt (W1's first prompt, cut to 64 tokens) and a warm-up one."""
    w = workloads.get("W1")
    return w.prompts[0][:PROMPT_LEN], w.prompts[1][:16]


def run_nanoserve(models: Path) -> dict:
    from nanoserve import LLM, SamplingParams
    import nanoserve
    prompt, warm = prompts()
    t0 = time.perf_counter()
    llm = LLM(str(models / "w1"), skip_tokenizer_init=True, enable_prefix_caching=False)
    llm.generate([warm], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    startup = time.perf_counter() - t0
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True,
                                                detokenize=False), use_tqdm=False)[0]
    m, tokens = out.metrics, list(out.outputs[0].token_ids)
    assert len(tokens) == OUTPUT_LEN, len(tokens)
    return dict(startup=startup, prefill_s=m.first_token_time - m.arrival_time,
                decode_tok_s=(OUTPUT_LEN - 1) / (m.last_token_time - m.first_token_time),
                tokens=tokens, version=nanoserve.__version__,
                settings=dict(backend=llm.engine.backend.name, prefix_caching=False))


def run_llamacpp(models: Path) -> dict:
    from llamacpp_peer import gguf_path, single_stream
    prompt, _ = prompts()
    return single_stream(str(gguf_path(models, "w1")), prompt, OUTPUT_LEN, {"threads": 2})


WORKERS = {"nanoserve": run_nanoserve, "llamacpp": run_llamacpp}
PYTHON = {"nanoserve": sys.executable, "llamacpp": str(HERE / ".peers/llamacpp/bin/python")}


def run_one(engine: str, models: Path, timeout: float) -> dict:
    cmd = [PYTHON[engine], __file__, "--worker", engine, "--models", str(models)]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(  # this tree's nanoserve
                           filter(None, [str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH")]))))
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        return dict(error=f"exit {p.returncode}: {(p.stderr or p.stdout)[-3000:]}")
    return json.loads(lines[-1][7:]) | dict(process_s=time.perf_counter() - t)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", default=["nanoserve", "llamacpp"], choices=list(WORKERS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", type=Path, default=HERE / "models")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--worker", choices=list(WORKERS))
    args = ap.parse_args()
    if args.worker:
        r = WORKERS[args.worker](args.models)
        r["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print("RESULT " + json.dumps(r), flush=True)
        return
    runs = []
    for rnd in range(args.rounds):
        for engine in args.engines:
            r = run_one(engine, args.models, args.timeout) | dict(engine=engine, round=rnd)
            runs.append(r)
            print(f"[round {rnd}] {engine}: " + (f"decode {r['decode_tok_s']:.2f} tok/s, prefill {r['prefill_s']:.3f} s, "
                                                f"start-up {r['startup']:.1f} s" if "error" not in r else r["error"]),
                  flush=True)
    summary = []
    base = next((r["tokens"] for r in runs if r["engine"] == "nanoserve" and "tokens" in r), None)
    for engine in args.engines:
        ok = [r for r in runs if r["engine"] == engine and "error" not in r]
        if not ok:
            continue
        summary.append(dict(engine=engine, runs=len(ok),
                            decode_tok_s=round(statistics.median(r["decode_tok_s"] for r in ok), 2),
                            decode_tok_s_all=[round(r["decode_tok_s"], 2) for r in ok],
                            prefill_s=round(statistics.median(r["prefill_s"] for r in ok), 3),
                            prefill_s_all=[round(r["prefill_s"], 3) for r in ok],
                            startup_s=round(statistics.median(r["startup"] for r in ok), 1),
                            peak_rss_gib=round(max(r["peak_rss_gib"] for r in ok), 2),
                            tokens_agree_with_nanoserve=None if base is None else common_prefix(base, ok[0]["tokens"]),
                            version=ok[0].get("version"), settings=ok[0].get("settings")))
    by = {s["engine"]: s for s in summary}
    if "nanoserve" in by and "llamacpp" in by:
        by["llamacpp"]["decode_vs_nanoserve"] = round(by["llamacpp"]["decode_tok_s"] / by["nanoserve"]["decode_tok_s"], 2)
    args.out.mkdir(parents=True, exist_ok=True)
    from throughput import machine
    record = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=" ".join(sys.argv),
                  machine=machine(), prompt_len=PROMPT_LEN, output_len=OUTPUT_LEN, summary=summary, runs=runs)
    (args.out / "single-stream.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
