"""nanoserve's /v1/responses and /v1/messages stream events, event by event against vLLM 0.32's own code.

    python benchmarks/event_seq.py [--peer benchmarks/.peers/vllm/bin/python] [--quiet]

For every case (text only; text then one call; two calls; a call with text after it; reasoning then a call;
a call cut by max_tokens; each with hermes and llama3_json; hermes' text only and text then a call also with
logprobs) a nanoserve server on a tiny random qwen3 (the
tests' tool template) writes the case's text (forced by structured_outputs' choice) three times: as a chat
stream (stream_options include_usage and continuous_usage_stats, as vLLM's Messages path asks its chat server),
as a Responses stream and as a Messages stream. The peer's interpreter then feeds the chat stream's deltas to
vLLM's own event code: its Responses server's _process_simple_streaming_events (split_delta and
SimpleStreamingEventProcessor; each delta as its parser's parse_delta would return it) and its Anthropic
server's message_stream_converter (which reads the chat stream's SSE text as it is). Both servers' events are
compared whole (type, order, every field; ids, signatures and timestamps by their shape only), and so are the
Responses output items and status vLLM's response.completed would carry. Prints each difference and the
counts (--quiet: the counts only); exits 1 on any. Needs the peer venv (benchmarks/PEERS.md); vLLM serves
nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WEATHER = '{"city": "Paris", "days": 3}'
TIME = '{"tz": "cet"}'
CALLS = {"hermes": lambda name, args: f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>',
         "llama3_json": lambda name, args: f'{{"name": "{name}", "parameters": {args}}}'}
JOIN = {"hermes": "\n", "llama3_json": "; "}
LOGPROBS = {"include": ["message.output_text.logprobs"], "top_logprobs": 1}
THOUGHT = "<think>\nThe user wants the weather.\n</think>\n\n"


def cases() -> list[dict]:
    out = []
    for parser, call in CALLS.items():
        one, two = call("get_weather", WEATHER), call("get_time", TIME)
        texts = {"text only": ("Hello there, friend.", 300), "text then a call": (f"I will check. {one}", 300),
                 "two calls": (one + JOIN[parser] + two, 300),
                 # (llama3_json's call must open the content: no blank line after the thought)
                 "reasoning then a call": (THOUGHT + one if parser == "hermes" else THOUGHT.rstrip() + one, 300),
                 "a call cut by max_tokens": (one, 12)}
        if parser == "hermes":  # llama3_json's parser reads no text after its calls (vLLM's neither)
            texts["a call then text"] = (f"{one}\nDone.", 300)
        out += [dict(parser=parser, name=name, text=text, max_tokens=max_tokens, logprobs=False)
                for name, (text, max_tokens) in texts.items()]
    out += [dict(parser="hermes", name=f"{name}, with logprobs", text=text, max_tokens=300, logprobs=True)
            for name, text in (("text only", "Hello there, friend."),
                               ("text then a call", "I will check. " + CALLS["hermes"]("get_weather", WEATHER)))]
    return out


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
             "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string"}}, "required": []}}}]


def vllm_side() -> None:
    """(Run by the peer's interpreter.) Reads the cases' chat streams (JSON on stdin); writes vLLM's Responses
    and Messages events for each, as JSON on stdout."""
    import logging
    logging.disable(logging.CRITICAL)
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
    from vllm.entrypoints.openai.responses.context import SimpleContext
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses
    from openai.types.responses.response_output_text import Logprob, LogprobTopLogprob

    def delta_message(delta: dict) -> DeltaMessage:
        calls = [DeltaToolCall(index=c["index"], id=c.get("id"), type=c.get("type"),
                               function=None if "function" not in c else DeltaFunctionCall(**c["function"]))
                 for c in delta.get("tool_calls") or []]
        return DeltaMessage(content=delta.get("content"), reasoning=delta.get("reasoning"), tool_calls=calls)

    class Parser:  # returns each chunk's delta, as a parser's parse_delta would have
        def __init__(self, deltas):
            self.deltas = iter(deltas)

        def parse_delta(self, **_):
            return next(self.deltas)

    class Output:  # the step's CompletionOutput, as far as the event code reads it (its logprobs: the chunk's)
        def __init__(self, step):
            self.text, self.finish_reason = "", step["finish_reason"]
            self.logprobs = (step.get("logprobs") or {}).get("content") or []
            self.token_ids = list(range(len(self.logprobs)))

    def response_logprobs(token_ids, logprobs, tokenizer, top_logprobs):  # (_create_response_logprobs's)
        return [Logprob(token=t["token"], logprob=t["logprob"], bytes=t["bytes"], top_logprobs=[
            LogprobTopLogprob(token=k["token"], logprob=k["logprob"], bytes=k["bytes"])
            for k in t["top_logprobs"][:top_logprobs]]) for t in logprobs]

    async def responses(chunks: list[dict], tools: list[dict], logprobs: bool) -> dict:
        request = ResponsesRequest.model_validate({"model": "m", "input": "x", "tools": [
            {"type": "function", **t["function"]} for t in tools], **(LOGPROBS if logprobs else {})})
        steps = [c["choices"][0] for c in chunks if c["choices"] and "role" not in c["choices"][0]["delta"]]
        context = object.__new__(SimpleContext)
        context.response_parser = Parser([delta_message(s["delta"]) for s in steps])

        async def results():
            for s in steps:
                context.last_output = type("R", (), {"outputs": [Output(s)],
                                                     "prompt_token_ids": [1]})()
                yield context
        numbers = iter(range(2, 10**6))  # after response.created and .in_progress

        def number(event):
            event.sequence_number = next(numbers)
            return event
        server = type("S", (), {"_raise_if_error": lambda *a: None,
                                "_create_response_logprobs": staticmethod(response_logprobs)})()
        events = [json.loads(e.model_dump_json(indent=None, by_alias=True)) async for e in
                  OpenAIServingResponses._process_simple_streaming_events(
                      server, request, None, results(), context, "m", None, None, 0, number)]
        finish = steps[-1]["finish_reason"] if steps else None
        return {"events": events, "status": "incomplete" if finish == "length" else "completed",
                "output": [json.loads(i.model_dump_json(by_alias=True)) for i in context.streamed_output_items]}

    async def messages(chunks: list[dict]) -> list[dict]:
        async def sse():
            for c in chunks:
                yield f"data: {json.dumps(c)}\n\n"
            yield "data: [DONE]\n\n"
        out = []
        async for frame in AnthropicServingMessages.message_stream_converter(None, sse()):
            name, data = frame.rstrip("\n").split("\n")
            out.append(json.loads(data.removeprefix("data: ")))
            assert name == f"event: {out[-1]['type']}", frame
        return out

    async def run(cases):
        return [{"responses": await responses(c["chat"], TOOLS, c["logprobs"]), "messages": await messages(c["chat"])}
                for c in cases]
    json.dump(asyncio.run(run(json.load(sys.stdin))), sys.stdout)


def shape(value):
    """``value`` with ids, signatures and timestamps as their shape (a prefix) only."""
    if isinstance(value, list):
        return [shape(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for k, v in value.items():
        if k in ("id", "item_id", "call_id") and isinstance(v, str):
            v = "<id>"  # their shapes differ (msg_ or chatcmpl-, fc_ hex or uuid): by design, not compared
        elif k == "signature" and isinstance(v, str):
            v = "<hex>" if re.fullmatch(r"[0-9a-f]{32}", v) else v
        elif k in ("created_at", "created"):
            v = "<time>"
        out[k] = shape(v)
    return out


def sse_frames(text: str) -> list[tuple[str | None, str]]:
    frames = []
    for frame in text.strip("\n").split("\n\n"):
        lines = frame.split("\n")
        name = lines[0].removeprefix("event: ") if lines[0].startswith("event: ") else None
        frames.append((name, lines[-1].removeprefix("data: ")))
    return frames


def nanoserve_side(cases: list[dict]) -> None:
    """Each case's chat stream (raw chunks), Responses events and Messages events from a nanoserve server."""
    import httpx
    sys.path.insert(0, str(HERE.parent / "tests"))
    from conftest import make_model
    from test_server import ServerThread
    from test_tools import TEMPLATE

    from nanoserve import entry
    chat_body = entry.AnthropicMessagesRequest.chat_body
    forced = {}

    def body(self, rid: str) -> dict:  # the Messages API has no structured_outputs: forced on its chat request
        return {**chat_body(self, rid), "structured_outputs": {"choice": [forced["text"]]}}
    entry.AnthropicMessagesRequest.chat_body = body
    tmp = Path(tempfile.mkdtemp(prefix="event_seq-"))
    model = make_model(tmp, "qwen3")
    (tmp / "tools.jinja").write_text(TEMPLATE)
    for parser in CALLS:
        with ServerThread(model, "--chat-template", str(tmp / "tools.jinja"), "--enable-auto-tool-choice",
                          "--tool-call-parser", parser, "--max-model-len", "512") as server:
            for c in (c for c in cases if c["parser"] == parser):
                server.app.state.server.reasoning_parser = "qwen3" if c["text"].startswith("<think>") else None
                common = {"temperature": 0, "stream": True}
                force = {"structured_outputs": {"choice": [c["text"]]}}
                post = lambda path, **body: httpx.post(server.url + path, json={**common, **body}, timeout=120)  # noqa
                chat = post("/v1/chat/completions", model=str(model), max_tokens=c["max_tokens"], tools=TOOLS,
                            messages=[{"role": "user", "content": "weather?"}],
                            stream_options={"include_usage": True, "continuous_usage_stats": True}, **force,
                            **({"logprobs": True, "top_logprobs": 1} if c["logprobs"] else {}))
                c["chat"] = [json.loads(d) for _, d in sse_frames(chat.text) if d != "[DONE]"]
                responses = post("/v1/responses", input="weather?", max_output_tokens=c["max_tokens"],
                                 tools=[{"type": "function", **t["function"]} for t in TOOLS], **force,
                                 **(LOGPROBS if c["logprobs"] else {}))
                c["responses"] = [json.loads(d) for _, d in sse_frames(responses.text)]
                forced["text"] = c["text"]
                messages = post("/v1/messages", model=str(model), max_tokens=c["max_tokens"],
                                messages=[{"role": "user", "content": "weather?"}],
                                tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                                       for t in TOOLS])
                c["messages"] = [json.loads(d) for _, d in sse_frames(messages.text)]
            server.wait_idle()


def differences(ours: list[dict], theirs: list[dict]) -> list[str]:
    """Event by event: the first few that differ (or a count that does)."""
    out = [f"#{i} {o.get('type')}: ours {json.dumps(o)}\n      vLLM {json.dumps(t)}"
           for i, (o, t) in enumerate(zip(ours, theirs)) if o != t]
    if len(ours) != len(theirs):
        out.append(f"{len(ours)} events, vLLM {len(theirs)}: ours {[e.get('type') for e in ours]}\n"
                   f"      vLLM {[e.get('type') for e in theirs]}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", default=str(HERE / ".peers" / "vllm" / "bin" / "python"))
    ap.add_argument("--vllm-side", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quiet", action="store_true", help="print the counts only")
    args = ap.parse_args()
    if args.vllm_side:
        vllm_side()
        return 0
    todo = cases()
    nanoserve_side(todo)
    run = subprocess.run([args.peer, __file__, "--vllm-side"], input=json.dumps(todo), capture_output=True,
                         text=True)
    if run.returncode:
        sys.exit(f"the peer failed:\n{run.stderr[-3000:]}")
    show = (lambda *a: None) if args.quiet else print
    differ = {"responses": 0, "messages": 0}
    for c, theirs in zip(todo, json.loads(run.stdout)):
        label = f"{c['parser']}, {c['name']}"
        # response.created/.in_progress and response.completed's body are the request's echo (api_diff.py's)
        ours = shape(c["responses"][2:-1])
        final = c["responses"][-1]["response"]
        found = differences(ours, shape(theirs["responses"]["events"]))
        if shape(final["output"]) != shape(theirs["responses"]["output"]) or \
                final["status"] != theirs["responses"]["status"]:
            found.append(f"response.completed: ours {final['status']} {json.dumps(shape(final['output']))}\n"
                         f"      vLLM {theirs['responses']['status']} "
                         f"{json.dumps(shape(theirs['responses']['output']))}")
        differ["responses"] += bool(found)
        for f in found:
            show(f"[responses] {label}: {f}")
        found = differences(shape(c["messages"]), shape(theirs["messages"]))
        differ["messages"] += bool(found)
        for f in found:
            show(f"[messages] {label}: {f}")
    print(f"{len(todo)} cases: Responses streams differing {differ['responses']}, Messages streams differing "
          f"{differ['messages']}")
    return 1 if any(differ.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
