"""nanoserve's structural tags over tool calls, format for format against vLLM 0.32's own.

    python benchmarks/tool_tags.py [--peer benchmarks/.peers/vllm/bin/python]

For every case (parser hermes / llama3_json / openai; strict and loose tools; tool_choice auto, required or a
named function; parallel_tool_calls absent or false; --tool-strict-level auto, function or parameter; "auto"
beside a request's own json or regex constraint) the peer's interpreter builds the request vLLM's chat server
would build (its ChatCompletionRequest through DelegatingParser._apply_structural_tag) and prints the structural
tag it gets; this interpreter builds nanoserve's (entry.tool_call_tag), and both are compared after xgrammar's
StructuralTag has read them (so defaults written or left out compare equal). Then vLLM's llama3_json parser and
nanoserve's read the same texts, and vLLM's hermes parser and nanoserve's read the same responses (3000 random
texts, whole). Then chat streams, delta by delta against vLLM's own DelegatingParser.parse_delta (which routes
by tool_choice: with the strict tool calling on, hermes' and llama3_json's "required" and named calls read as
"auto"): llama3_json's (and its responses) on 3000 outputs, half like a model's (calls with and without
separators, text around them, cut short) and half random texts of JSON fragments; hermes' on 3000 random
texts of tags and JSON fragments; "required"'s and a named function's in vLLM's older JSON form (pythonic's
parser, which has no tag) on 1000 each; every text cut at random into deltas. Prints each difference and the
counts (--quiet: the counts only); exits 1 on any.
Needs the peer venv (benchmarks/PEERS.md); nothing is served.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CLOCK = {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}}
TOOLSETS = {
    "one strict": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
                   {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}],
    "loose": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
              {"type": "function", "function": {"name": "bare", "strict": False}}],
}
CHOICES = {"auto": "auto", "required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}}
OUTPUTS = {None: None, "json": {"json": {"type": "object"}}, "regex": {"regex": "[a-z]+"}}
PEER_MODELS = {"hermes": "hermes", "llama3_json": "llama", "openai": "harmony"}
TEXTS = ['{"name": "f", "parameters": {"a": 1}}', '{"name": "f", "parameters": {"a": 1}} x {"name": "g", '
         '"arguments": [1]} y', '{"name": "f", "parameters": {"a": 1}}{"name": "g", "parameters": {"b": 2}}',
         '{"name": "f", "parameters": {"a": 1}}{"name": "g", "parameters": 3}', '{"name": "f", "parameters": {}} {}',
         '{"name": "f", "parameters": {"a": 1', '{"name": "f"}', '{"name": 3, "parameters": {}}', "plain text"]


# hermes chat streams: texts of these pieces, cut at random
FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool", "_call>", "</tool_", '{"name": "a", "arguments": {"x": [1]}}',
             '{"name": "b", "parameters": {}}', '{"name": "c", "arguments": {"s": "}]\\"{"}}', '{"name":', ' "d"',
             ', "arguments":', ' {"y": 2', "}", "}}", "[", "]", "{", '"', "\\", ",", " ", "\n", "x", "é", "<",
             '"arguments": ', '"name": "e"', "\t", '"nam', 'e"']


def streams(n: int = 3000, seed: int = 0, fragments: list[str] = FRAGMENTS) -> list[list[str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 12)))
        cuts = sorted({rng.randint(0, len(text)) for _ in range(rng.randint(0, 10))})
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] or [""])
    return out


BODIES = ['{"name": "a", "arguments": {"x": [1]}}', '{"name": "b", "arguments": "s"}', '{"name": "c"}',
          '{"name": "d", "parameters": {}}', "[1]", "{oops", '{"name": 3, "arguments": {}}', "",
          '{"name": "e", "arguments": {"s": "</tool_call>"}}', '{"name": "f", "arguments": {}} x']


def responses(n: int = 3000, seed: int = 1) -> list[str]:
    """Whole outputs for hermes' response reading: text, then blocks of calls (most of them whole) or not,
    the last maybe left open; half of them random texts of FRAGMENTS. No control characters, which vLLM's
    strict JSON refuses in a string and nanoserve's reading takes (README)."""
    plain = [f for f in FRAGMENTS if f not in "\n\t"]
    rng, out = random.Random(seed), ["".join(p) for p in streams(n // 2, seed, plain)]
    for _ in range(n - len(out)):
        blocks = [f"<tool_call>{rng.choice(['', ' '])}{rng.choice(BODIES[:2] * 12 + BODIES)}</tool_call>"
                  f"{rng.choice(['', ' ', ' and '])}" for _ in range(rng.randint(0, 3))]
        end = rng.choice(["", "", "", "<tool_call>", "<tool_call>{"])
        out.append(rng.choice(["", "Sure. ", "<tool"]) + "".join(blocks) + end)
    return out


# llama3_json outputs: calls as a model writes them, with what may stand around and between them
LLAMA_CALLS = ['{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', '{"name": "f", "parameters": {}}',
               '{"name": "g", "arguments": {"s": "a \\"q\\" }]{", "n": [1, 2.5, -3e2, true, null]}}',
               '{"name": "h", "parameters": {"x": {"y": [{"z": "é"}]}}}', '{"name":"k","parameters":{"a":1}}',
               '{"name": "u", "parameters": {"s": "\\u00e9\\n"}}', '{"name": "v", "parameters": "text"}']
LLAMA_SEPS = ["; ", "; ", ";", " ", "\n", "", ";\n", " and "]
LLAMA_FRAGMENTS = [*LLAMA_CALLS, "<|python_tag|>", "; ", '{"name": ', '"f"', ', "parameters": ', "{", "}", "[", "]",
                   '"', "\\", ",", ":", " ", "\n", "x", "1", "-", ".", "tru", "null", '"\\u00', "é"]


def llama_texts(n: int = 3000, seed: int = 2) -> list[str]:
    """Half like a model's output (maybe <|python_tag|> or text first, calls joined, text after, cut short),
    half random texts of LLAMA_FRAGMENTS."""
    rng, out = random.Random(seed), []
    for _ in range(n // 2):
        calls = [rng.choice(LLAMA_CALLS) for _ in range(rng.randint(0, 3))]
        text = rng.choice(["", "", "", "<|python_tag|>", "Sure. "]) + "".join(
            c + (rng.choice(LLAMA_SEPS) if i < len(calls) - 1 else "") for i, c in enumerate(calls))
        text += rng.choice(["", "", "", " done", "; ", "\n"])
        out.append(text[:rng.randint(0, len(text))] if rng.random() < 0.2 else text)
    out += ["".join(rng.choice(LLAMA_FRAGMENTS) for _ in range(rng.randint(0, 10))) for _ in range(n - len(out))]
    return out


def llama_streams(seed: int = 3) -> list[list[str]]:
    """Each of llama_texts cut into deltas: mostly of a few characters (as tokens; some empty, see cut), else at
    a few random places."""
    rng, out = random.Random(seed), []
    for text in llama_texts():
        if rng.random() < 0.7:
            cuts, at = [], 0
            while (at := at + rng.choice([0, *range(1, 7)])) < len(text):
                cuts.append(at)
        else:
            cuts = sorted({rng.randint(0, len(text)) for _ in range(rng.randint(0, 6))})
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] or [""])
    return out


def cases() -> list[dict]:
    """The requests compared (a constraint of the request's own beside "auto" only; none with gpt-oss, whose
    vLLM wraps it in harmony first)."""
    return [dict(parser=parser, tools=TOOLSETS[tools], tool_choice=CHOICES[choice], parallel=parallel, level=level,
                 output=OUTPUTS[output])
            for parser, tools, choice, parallel, level, output in itertools.product(
                PEER_MODELS, TOOLSETS, CHOICES, (None, False), ("auto", "function", "parameter"), OUTPUTS)
            if output is None or (choice == "auto" and parser != "openai")]


def vllm_side() -> None:
    """(Run by the peer's interpreter.) vLLM's tags and llama3_json readings, as JSON on stdout."""
    import logging
    logging.disable(logging.CRITICAL)
    import vllm.parser.harmony  # noqa: F401  (registers harmony's tag)
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.abstract_parser import DelegatingParser
    from vllm.tool_parsers.abstract_tool_parser import ToolParser
    from vllm.tool_parsers.llama_tool_parser import Llama3JsonToolParser
    from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

    class Parser:  # the two attributes _apply_structural_tag reads, and the tool parser's tag builder
        def __init__(self, model: str, level: str):
            tool_parser = type("P", (), {"structural_tag_model": model, "default_tool_strict_level": None,
                                         "get_structural_tag": ToolParser.get_structural_tag})
            self._tool_parser, self.tool_strict_level = tool_parser(), ToolStrictLevel.from_name(level)

    tags = []
    for c in cases():
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": c["tools"],
                "tool_choice": c["tool_choice"], **({"structured_outputs": c["output"]} if c["output"] else {}),
                **({} if c["parallel"] is None else {"parallel_tool_calls": c["parallel"]})}
        req = DelegatingParser._apply_structural_tag(Parser(PEER_MODELS[c["parser"]], c["level"]),
                                                     ChatCompletionRequest.model_validate(body))
        so = req.structured_outputs
        tags.append(json.loads(so.structural_tag) if so is not None and so.structural_tag else None)
    tokenizer = type("T", (), {"get_vocab": lambda self: {"<|python_tag|>": 0}})()
    parser, readings = Llama3JsonToolParser(tokenizer, None), []
    for text in TEXTS:
        r = parser.extract_tool_calls(text, None)
        readings.append([[c.function.name, c.function.arguments] for c in r.tool_calls] if r.tools_called else None)
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
    whole = []
    for text in responses():
        r = Hermes2ProToolParser(tokenizer, None).extract_tool_calls(text, None)
        whole.append([r.content or "", [[c.function.name, c.function.arguments] for c in r.tool_calls]])
    json.dump({"tags": tags, "readings": readings, "responses": whole,
               **vllm_llama(tokenizer)}, sys.stdout)


NAMED = {"type": "function", "function": {"name": "f"}}
# forced calls in vLLM's older JSON form (pythonic, or no parser): "required"'s list, a named function's arguments
REQUIRED_CALLS = ['{"name": "f", "parameters": {"a": 1}}', '{"name": "get_weather", "parameters": {"city": "Pa\\"ris"}}',
                  '{"name":"g","parameters":{"x":[1,{"y":"}]"}]}}', '{"name": "h", "parameters": {}}']
ARGUMENTS = ['{"a": 1}', '{"city": "Pa\\"ris", "days": [1, 2]}', "{}", '{"s": "}]{["}']


def required_streams(seed: int = 4) -> list[list[str]]:
    rng, texts = random.Random(seed), []
    for _ in range(1000):
        text = "[" + ", ".join(rng.choice(REQUIRED_CALLS) for _ in range(rng.randint(1, 3))) + "]"
        texts.append(text[:rng.randint(0, len(text))] if rng.random() < 0.2 else text)
    return [cut(t, rng) for t in texts]


def named_streams(seed: int = 5) -> list[list[str]]:
    rng = random.Random(seed)
    return [cut(rng.choice(ARGUMENTS), rng) for _ in range(1000)]


def cut(text: str, rng: random.Random) -> list[str]:
    """``text`` cut into deltas of a few characters (as tokens), some of them empty (a token that holds part
    of a character: the step adds no text, but vLLM's parser still reads it)."""
    cuts, at = [], 0
    while (at := at + rng.choice([0, *range(1, 7)])) < len(text):
        cuts.append(at)
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] or [""]


def vllm_chunks(tokenizer, tool_parser_cls, tool_choice, streams: list[list[str]]) -> list[list]:
    """(Peer.) Chat streams as vLLM's chat server reads them: one parser per choice (DelegatingParser.parse_delta,
    which routes by the request's tool_choice), fed each delta; each delta's content and tool-call deltas."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.abstract_parser import DelegatingParser

    class Parser(DelegatingParser):
        pass
    Parser.tool_parser_cls = tool_parser_cls
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                    "tools": [{"type": "function", "function": {"name": "f"}}],
                                                    "tool_choice": tool_choice})
    out = []
    for pieces in streams:
        parser, deltas = Parser(tokenizer), []
        for i, piece in enumerate(pieces):
            d = parser.parse_delta(piece, [], request, prompt_token_ids=[1], finished=i == len(pieces) - 1)
            deltas.append(None if d is None else [d.content or "", [
                {"index": t.index, "id": t.id is not None, **t.function.model_dump(exclude_unset=True)}
                for t in d.tool_calls or []]])
        out.append(deltas)
    return out


def vllm_llama(tokenizer) -> dict:
    """(Peer.) llama3_json's chat streams (its request's tool_choice routes nothing here: with the strict tool
    calling on, "required" and a named function read as "auto") and responses; hermes' chat streams (likewise);
    "required" and a named function's streams in vLLM's older JSON form (pythonic's parser, which has no tag)."""
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
    from vllm.tool_parsers.llama_tool_parser import Llama3JsonToolParser
    from vllm.tool_parsers.pythonic_tool_parser import PythonicToolParser
    whole = []
    for text in llama_texts():
        r = Llama3JsonToolParser(tokenizer).extract_tool_calls(text, None)
        whole.append([r.content or "", [[c.function.name, c.function.arguments] for c in r.tool_calls]])
    return {"llama_streams": vllm_chunks(tokenizer, Llama3JsonToolParser, "required", llama_streams()),
            "llama_responses": whole,
            "hermes_chunks": vllm_chunks(tokenizer, Hermes2ProToolParser, "required", streams()),
            "required_chunks": vllm_chunks(tokenizer, PythonicToolParser, "required", required_streams()),
            "named_chunks": vllm_chunks(tokenizer, PythonicToolParser, NAMED, named_streams())}


def chunk_differences(parser, streams: list[list[str]], want: list[list], label: str, show) -> int:
    """How many streams nanoserve's ``parser`` sends otherwise than vLLM, delta by delta."""
    from nanoserve.entry import ToolStream
    differ = 0
    for pieces, theirs in zip(streams, want):
        stream, ours = ToolStream(parser(), streamed=True), []
        for i, piece in enumerate(pieces):
            content, found, _ = stream.feed(piece, i == len(pieces) - 1)
            ours.append([content, [{"index": d["index"], "id": "id" in d, **d["function"]} for d in found]])
        # vLLM's None (no chunk) and a delta of nothing are one chunk-less step to a client
        if any((w or ["", []]) != o for w, o in zip(theirs, ours)):
            differ += 1
            show(f"{label} streams differently:", pieces, "\n  ours", ours, "\n  vLLM", theirs)
    return differ


def llama_differences(theirs: dict, show) -> tuple[int, int]:
    """How many of llama3_json's chat streams (delta by delta, each of "auto"'s and "required"'s parser) and
    responses nanoserve reads otherwise than vLLM."""
    from nanoserve.entry import ToolStream, tool_parser
    parsers = {"auto": tool_parser("auto", "llama3_json"), "required": tool_parser("required", "llama3_json",
                                                                                    "llama3_json")}
    streams = sum(chunk_differences(parser, llama_streams(), theirs["llama_streams"], f"llama3_json ({choice})",
                                    show) for choice, parser in parsers.items())
    responses = 0
    for text, want in zip(llama_texts(), theirs["llama_responses"]):
        for choice, parser in parsers.items():
            content, found, _ = ToolStream(parser()).feed(text, True)
            if [content, [[d["function"]["name"], d["function"]["arguments"]] for d in found]] != want:
                responses += 1
                show(f"llama3_json ({choice}) reads differently:", repr(text), "ours", [content, found], "vLLM", want)
                break
    return streams, responses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", default=str(Path(__file__).parent / ".peers" / "vllm" / "bin" / "python"))
    ap.add_argument("--vllm-side", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quiet", action="store_true", help="print the counts only")
    args = ap.parse_args()
    if args.vllm_side:
        vllm_side()
        return 0
    import xgrammar as xgr
    from nanoserve.engine import StructuredOutputsParams
    from nanoserve.entry import (ChatCompletionToolsParam, HermesToolParser, ToolStream, output_format, tool_call_tag,
                                 tool_parser)
    run = subprocess.run([args.peer, __file__, "--vllm-side"], capture_output=True, text=True, check=True)
    show = (lambda *a: None) if args.quiet else print
    theirs = json.loads(run.stdout)

    def norm(tag: dict | None) -> dict | None:
        return None if tag is None else xgr.StructuralTag.model_validate(tag).model_dump()
    differ = 0
    for c, want in zip(cases(), theirs["tags"]):
        tools = [ChatCompletionToolsParam.model_validate(t) for t in c["tools"]]
        output = None if c["output"] is None else output_format(StructuredOutputsParams(**c["output"]))
        ours = tool_call_tag(c["parser"], tools, c["tool_choice"], c["parallel"], c["level"], output)
        if norm(ours) != norm(want):
            differ += 1
            show("tag differs:", {k: v for k, v in c.items() if k != "tools"}, "\n  ours ", json.dumps(ours),
                  "\n  vLLM ", json.dumps(want))
    misread = 0
    for text, want in zip(TEXTS, theirs["readings"]):
        parser = tool_parser("required", "llama3_json", "llama3_json")()  # a forced call's reading
        parser.streamed = False
        calls = parser.feed(text, True)[1]
        ours = [[c["name"], c["arguments"]] for c in calls] or None
        if ours != want:
            misread += 1
            show("llama3_json reads differently:", repr(text), "ours", ours, "vLLM", want)
    unlike = 0
    for text, want in zip(responses(), theirs["responses"]):
        content, calls = HermesToolParser().feed(text, True)
        if [content, [[c["name"], c["arguments"]] for c in calls]] != want:
            unlike += 1
            show("hermes reads differently:", repr(text), "ours", [content, calls], "vLLM", want)
    llama_streamed, llama_read = llama_differences(theirs, show)
    forced = {"hermes": (tool_parser("required", "hermes", "hermes"), streams()),  # (as "auto")
              "required": (tool_parser("required", "pythonic"), required_streams()),
              "named": (tool_parser(NAMED, "pythonic"), named_streams())}
    chunks = {k: chunk_differences(parser, texts, theirs[f"{k}_chunks"], k, show)
              for k, (parser, texts) in forced.items()}
    print(f"{len(theirs['tags'])} tags, {differ} differ; {len(TEXTS)} llama3_json texts, {misread} read "
          f"differently; {len(theirs['responses'])} hermes responses, {unlike} differ; "
          f"{len(theirs['llama_streams'])} llama3_json chat streams, {llama_streamed} differ, and as many "
          f"responses, {llama_read} differ")
    print("chat streams differing delta by delta:", ", ".join(f"{k} {v} of {len(theirs[f'{k}_chunks'])}"
                                                               for k, v in chunks.items()))
    return 1 if differ or misread or unlike or llama_streamed or llama_read or any(chunks.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
