"""What reading a streamed response's tool calls costs the event loop: N calls in
hermes tags (and as tool_choice "required"'s JSON array) fed to ``ToolStream`` a
token at a time (the demo model's tokenizer cuts the text): "hermes" as a Responses
or Messages stream reads them (as a response), "hermes-chat" and "required-chat" as a
chat stream (vLLM 0.32's streamed reading: each call's arguments sent as they come);
"llama3_json-chat" N calls joined by "; " as a llama3_json chat stream (vLLM's reading,
which reads the call being written again at each delta: its cost grows with a call's
length). Parsing runs on the server's one loop thread: a cost that grows faster than
the text stalls every other client.

    python benchmarks/tool_stream.py               # 5 and 400 calls
    python benchmarks/tool_stream.py --calls 5 400 2000
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from tokenizers import Tokenizer

from nanoserve.entry import HermesToolParser, Llama3JsonToolParser, RequiredToolParser, ToolStream

DEMO = Path(__file__).resolve().parent.parent / "nanoserve" / "demo_model"
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": %d, "units": "metric"}}'


def texts(n: int) -> dict[str, str]:
    calls = [CALL % i for i in range(n)]
    hermes = "I will check.\n" + "".join(f"<tool_call>\n{c}\n</tool_call>\n" for c in calls)
    llama = [c.replace('"arguments"', '"parameters"') for c in calls]
    return {"hermes": hermes, "hermes-chat": hermes, "required": "[" + ", ".join(llama) + "]",
            "required-chat": "[" + ", ".join(llama) + "]", "llama3_json-chat": "; ".join(llama)}


def tokens(tok: Tokenizer, text: str) -> list[str]:
    ends = [end for _, end in tok.encode(text, add_special_tokens=False).offsets]
    return [text[a:b] for a, b in zip([0] + ends, ends)] + [text[ends[-1]:]]


def feed_all(parser, pieces: list[str], chat: bool) -> tuple[float, int]:
    stream, made, start = ToolStream(parser, streamed=chat), 0, time.perf_counter()
    for i, piece in enumerate(pieces):
        made += sum("id" in d for d in stream.feed(piece, i == len(pieces) - 1)[1])
    return time.perf_counter() - start, made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, nargs="+", default=[5, 400])
    args = ap.parse_args()
    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    for n in args.calls:
        for name, text in texts(n).items():
            pieces = tokens(tok, text)
            parser = {"hermes": HermesToolParser, "hermes-chat": HermesToolParser, "required": RequiredToolParser,
                      "required-chat": RequiredToolParser, "llama3_json-chat": Llama3JsonToolParser}
            runs = [feed_all(parser[name](), pieces, name.endswith("-chat")) for _ in range(3 if n <= 100 else 1)]
            secs = min(s for s, _ in runs)
            assert runs[0][1] == n, (name, n, runs[0][1])
            print(f"{name:16} {n:5} calls  {len(pieces):7} deltas  {len(text):8} chars  {secs * 1e3:9.1f} ms  "
                  f"{secs / len(pieces) * 1e6:7.2f} us/delta")


if __name__ == "__main__":
    main()
