"""Time IncrementalDetokenizer over runs of tokens that add no text for a while.

    PYTHONPATH=. python benchmarks/detokenizer.py [--tokens 1000 4000 8000]

The bundled demo model's tokenizer (byte-level BPE, as Qwen's), one token a step as
the engine calls it, then the flush at the end, on:
- lead bytes: one token that is a lone UTF-8 lead byte, repeated (each is a
  replacement character once the next arrives), as allowed_token_ids can force;
- special tokens: <|im_start|> repeated, skipped from the text (skip_special_tokens);
- text: an ordinary English text's tokens, for the common case's cost.
With DecodeStream (a fast tokenizer's path) and without (the two-decode window).
Prints seconds per run (median of --repeat).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from transformers import AutoTokenizer

import nanoserve
from nanoserve.engine import IncrementalDetokenizer

TEXT = ("The quick brown fox jumps over the lazy dog while the engine streams its tokens one by one. " * 400)


def run(tok, ids: list[int], stream: bool) -> float:
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    if not stream:
        d.stream = None
    t = time.perf_counter()
    for token in ids:
        d.step(token)
    d.flush()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1000, 4000, 8000])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(Path(nanoserve.__file__).parent / "demo_model")
    lead = tok.convert_tokens_to_ids("ã")  # byte 0xE3 in the byte-level alphabet
    special = tok.convert_tokens_to_ids("<|im_start|>")
    text = tok.encode(TEXT)
    for n in args.tokens:
        for name, ids in (("lead bytes", [lead] * n), ("special tokens", [special] * n), ("text", text[:n])):
            for stream in (True, False):
                secs = statistics.median(run(tok, ids, stream) for _ in range(args.repeat))
                print(f"{n:6d} {name:15s} {'DecodeStream' if stream else 'window':12s} {secs:8.3f} s", flush=True)


if __name__ == "__main__":
    main()
