"""nanoserve's /v1/responses and /v1/messages answers, streamed event by event and whole, against vLLM 0.32's code.

    python benchmarks/event_seq.py [--peer benchmarks/.peers/vllm/bin/python] [--quiet]

For every case (text only; text then one call; two calls; a call with text after it; reasoning then one call,
then two; a call cut by max_tokens before its arguments, and mid-arguments, also after a thought; tool_choice
"required" (one call, two, one cut) and a named function (one call, after a thought, cut); two calls with
parallel_tool_calls false, also "required"; each with hermes and llama3_json; hermes' text only and text then a
call also with logprobs) a nanoserve server on a tiny random qwen3 (the tests' tool template) writes the case's
text (forced by a structured-outputs choice on every chat request) as a chat stream (stream_options
include_usage and continuous_usage_stats, as vLLM's Messages path asks its chat server), a Responses stream, a
Messages stream, and each of the three whole. The peer's interpreter then feeds the chat stream's deltas to
vLLM's own event code: its Responses server's _process_simple_streaming_events (split_delta and
SimpleStreamingEventProcessor; each delta as its parser's parse_delta would return it) and its Anthropic
server's message_stream_converter (which reads the chat stream's SSE text as it is); and reads the whole output
(the chat body's token ids) with vLLM's own parser (ParserManager's, of the same tool and reasoning parsers):
the chat message vLLM's chat server makes of it, _make_response_output_items' Responses items, and
messages_full_converter's message. Events are compared whole (type, order, every field; ids, signatures and
timestamps by their shape only), and so are the Responses output items and status (streamed: those vLLM's
response.completed would carry), the chat message and the Messages body. vLLM's own bugs are KEPT (listed with
why, not counted). Prints each difference and the counts (--quiet: the counts only); exits 1 on any. Needs the
peer venv (benchmarks/PEERS.md); vLLM serves nothing.
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
# max_tokens that cut the call inside its arguments (the tests' tokenizer writes a character or so a token; where
# exactly depends on how the model spells the forced text: within {"city": "Paris"), and the thought's tokens
CUT = {"hermes": 62, "llama3_json": 47}
THOUGHT_TOKENS = {"hermes": 36, "llama3_json": 34}


def cases() -> list[dict]:
    out = []
    for parser, call in CALLS.items():
        one, two = call("get_weather", WEATHER), call("get_time", TIME)
        both = one + JOIN[parser] + two
        # (llama3_json's call must open the content: no blank line after the thought)
        thought = THOUGHT if parser == "hermes" else THOUGHT.rstrip()
        texts = {"text only": ("Hello there, friend.", 300), "text then a call": (f"I will check. {one}", 300),
                 "two calls": (both, 300), "reasoning then a call": (thought + one, 300),
                 "a call cut by max_tokens": (one, 12), "a call cut mid-arguments": (one, CUT[parser]),
                 "reasoning then two calls": (thought + both, 300),
                 "reasoning then a call cut mid-arguments": (thought + one, CUT[parser] + THOUGHT_TOKENS[parser])}
        if parser == "hermes":  # llama3_json's parser reads no text after its calls (vLLM's neither)
            texts["a call then text"] = (f"{one}\nDone.", 300)
        out += [dict(parser=parser, name=name, text=text, max_tokens=max_tokens) for name, (text, max_tokens) in
                texts.items()]
        # tool_choice "required" and a named function write a call in the parser's own format (vLLM 0.32's
        # structural tag for hermes and llama3_json), which its "auto" reading reads back
        out += [dict(parser=parser, name=f"{choice} tool_choice, {name}", text=text, max_tokens=max_tokens,
                     choice=choice) for choice, name, text, max_tokens in (
                    ("required", "one call", one, 300), ("required", "two calls", both, 300),
                    ("required", "a call cut mid-arguments", one, CUT[parser]), ("named", "one call", one, 300),
                    ("named", "reasoning then a call", thought + one, 300),
                    ("named", "a call cut mid-arguments", one, CUT[parser]))]
        out += [dict(parser=parser, name="two calls, parallel_tool_calls false", text=both, max_tokens=300,
                     parallel=False),
                dict(parser=parser, name="required tool_choice, two calls, parallel_tool_calls false", text=both,
                     max_tokens=300, parallel=False, choice="required")]
    out += [dict(parser="hermes", name=f"{name}, with logprobs", text=text, max_tokens=300, logprobs=True)
            for name, text in (("text only", "Hello there, friend."),
                               ("text then a call", "I will check. " + CALLS["hermes"]("get_weather", WEATHER)))]
    return [{"logprobs": False, "choice": "auto", "parallel": True, **c} for c in out]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
             "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string"}}, "required": []}}}]


def chat_choice(c: dict) -> dict:
    """The case's tool_choice and parallel_tool_calls as a chat body says them."""
    choice = {"type": "function", "function": {"name": "get_weather"}} if c["choice"] == "named" else c["choice"]
    return {} if c["choice"] == "auto" and c["parallel"] else {
        "tool_choice": choice, **({} if c["parallel"] else {"parallel_tool_calls": False})}


def responses_choice(c: dict) -> dict:
    choice = {"type": "function", "name": "get_weather"} if c["choice"] == "named" else c["choice"]
    return {} if c["choice"] == "auto" and c["parallel"] else {
        "tool_choice": choice, **({} if c["parallel"] else {"parallel_tool_calls": False})}


def messages_choice(c: dict) -> dict:
    kind = {"auto": "auto", "required": "any", "named": "tool"}[c["choice"]]
    choice = {"type": kind, **({"name": "get_weather"} if kind == "tool" else {}),
              **({} if c["parallel"] else {"disable_parallel_tool_use": True})}
    return {} if c["choice"] == "auto" and c["parallel"] else {"tool_choice": choice}


def vllm_side() -> None:
    """(Run by the peer's interpreter.) Reads the cases' chat streams and bodies (JSON on stdin); writes vLLM's
    Responses and Messages events and bodies for each, as JSON on stdout."""
    import logging
    logging.disable(logging.CRITICAL)
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse
    from vllm.parser import ParserManager
    from transformers import AutoTokenizer
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

    def responses_request(c: dict) -> ResponsesRequest:
        return ResponsesRequest.model_validate({"model": "m", "input": "x", "tools": [
            {"type": "function", **t["function"]} for t in TOOLS], **responses_choice(c),
            **(LOGPROBS if c["logprobs"] else {})})

    server = type("S", (), {"_raise_if_error": lambda *a: None, "enable_auto_tools": True,
                            "_create_response_logprobs": staticmethod(response_logprobs)})()

    def whole_parser(c: dict):
        """vLLM's parser of the case's server (its tool parser, and qwen3's reasoning parser where it had one)."""
        tokenizer = AutoTokenizer.from_pretrained(c["model"])
        tokenizer.add_tokens(["<|python_tag|>"])  # llama3_json's parser looks it up (the output has none)
        return ParserManager.get_parser(tool_parser_name=c["parser"], reasoning_parser_name=c["reasoning_parser"],
                                        enable_auto_tools=True)(tokenizer, TOOLS), tokenizer

    def whole_output(c: dict):
        """The chat body's output as vLLM's CompletionOutput has it: the text of its token ids (no EOS)."""
        choice = c["chat body"]["choices"][0]
        parser, tokenizer = whole_parser(c)
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        return parser, type("O", (), {"text": tokenizer.decode(choice["token_ids"], skip_special_tokens=True),
                                      "logprobs": logprobs, "token_ids": choice["token_ids"],
                                      "finish_reason": choice["finish_reason"]})()

    def chat_message(c: dict) -> dict:
        """vLLM's chat server's whole message (chat_completion_full_generator's choice of fields)."""
        parser, output = whole_output(c)
        request = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                        "tools": TOOLS, "tool_choice": "auto", **chat_choice(c)})
        reasoning, content, calls = parser.parse(output.text, request, enable_auto_tools=True)
        calls = (calls or [])[:1 if c["parallel"] is False else None]  # (maybe_filter_parallel_tool_calls)
        ours = c["chat body"]["choices"][0]["message"].get("tool_calls") or []
        if c["choice"] != "auto":  # a forced call's message has a content, "" if none
            content = content or ""
        return {"role": "assistant", "content": content, "reasoning": reasoning, "tool_calls": [
            {"id": mine["id"] if mine else "", "type": "function",  # (ids aside: ours, where there is one)
             "function": {"name": t.name, "arguments": t.arguments}}
            for t, mine in zip(calls, ours + [None] * len(calls))]}

    def responses_body(c: dict) -> dict:
        """_make_response_output_items on the whole output, read by vLLM's parser."""
        parser, output = whole_output(c)
        items = OpenAIServingResponses._make_response_output_items(server, responses_request(c), output, None,
                                                                    parser=parser)
        return {"status": "incomplete" if output.finish_reason == "length" else "completed",
                "output": [json.loads(i.model_dump_json(by_alias=True)) for i in items]}

    async def responses(c: dict) -> dict:
        request, chunks = responses_request(c), c["chat"]
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

    def messages_body(c: dict, message: dict) -> dict:
        """messages_full_converter on the chat body with vLLM's message."""
        body = c["chat body"]
        whole = ChatCompletionResponse.model_validate({**body, "choices": [{**body["choices"][0],
                                                                          "message": message}]})
        return AnthropicServingMessages.messages_full_converter(None, whole).model_dump(exclude_none=True)

    async def run(cases):
        out = []
        for c in cases:
            message = chat_message(c)
            out.append({"responses": await responses(c), "messages": await messages(c["chat"]),
                        "chat message": message, "responses body": responses_body(c),
                        "messages body": messages_body(c, message)})
        return out
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
    forced = {}
    # every API's chat request writes the case's text: the Messages API has no structured_outputs, and a forced
    # call's own constraint (the parser's structural tag) admits more than the one text
    entry.ChatCompletionRequest.structured_spec = lambda self: entry.StructuredOutputsParams(choice=[forced["text"]])
    tmp = Path(tempfile.mkdtemp(prefix="event_seq-"))
    model = make_model(tmp, "qwen3")
    (tmp / "tools.jinja").write_text(TEMPLATE)
    for parser in CALLS:
        with ServerThread(model, "--chat-template", str(tmp / "tools.jinja"), "--enable-auto-tool-choice",
                          "--tool-call-parser", parser, "--max-model-len", "512") as server:
            for c in (c for c in cases if c["parser"] == parser):
                server.app.state.server.reasoning_parser = "qwen3" if c["text"].startswith("<think>") else None
                forced["text"], c["model"] = c["text"], str(model)
                c["reasoning_parser"] = server.app.state.server.reasoning_parser
                bodies = {"/v1/chat/completions": dict(
                              model=str(model), max_tokens=c["max_tokens"], tools=TOOLS, **chat_choice(c),
                              messages=[{"role": "user", "content": "weather?"}], return_token_ids=True,
                              **({"logprobs": True, "top_logprobs": 1} if c["logprobs"] else {})),
                          "/v1/responses": dict(
                              input="weather?", max_output_tokens=c["max_tokens"], **responses_choice(c),
                              tools=[{"type": "function", **t["function"]} for t in TOOLS],
                              **(LOGPROBS if c["logprobs"] else {})),
                          "/v1/messages": dict(
                              model=str(model), max_tokens=c["max_tokens"], **messages_choice(c),
                              messages=[{"role": "user", "content": "weather?"}],
                              tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                                     for t in TOOLS])}
                for (path, body), key in zip(bodies.items(), ("chat", "responses", "messages")):
                    usage = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}} \
                        if key == "chat" else {}  # as vLLM's Messages path asks its chat server
                    stream = httpx.post(server.url + path, json={"temperature": 0, "stream": True, **body, **usage},
                                        timeout=120)
                    c[key] = [json.loads(d) for _, d in sse_frames(stream.text) if d != "[DONE]"]
                    c[f"{key} body"] = httpx.post(server.url + path, json={"temperature": 0, **body},
                                                  timeout=120).json()
            server.wait_idle()


# vLLM's own bugs, kept: what differs (by where, on the body's shapes) and why nanoserve does not follow it
KEPT = [("Messages bodies", "stop_sequence: null",
         lambda ours, theirs: ours.get("stop_sequence", 0) is None and "stop_sequence" not in theirs,
         lambda ours: {k: v for k, v in ours.items() if k != "stop_sequence"},
         "vLLM's /v1/messages router drops every null field (exclude_none), Anthropic's body has stop_sequence "
         "null (vLLM's own stream writes it there, for strict SDK clients)")]


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
    differ = dict.fromkeys(("Responses streams", "Messages streams", "chat messages", "Responses bodies",
                            "Messages bodies"), 0)
    kept = {what: 0 for _, what, *_ in KEPT}
    for c, theirs in zip(todo, json.loads(run.stdout)):
        for what in keep(c, theirs):
            kept[what] += 1
        for kind, found in compare(c, theirs).items():
            differ[kind] += bool(found)
            for f in found:
                show(f"[{kind}] {c['parser']}, {c['name']}: {f}")
    for (where, what, *_, why), n in zip(KEPT, kept.values()):
        print(f"KEPT ({where}, {n} cases): {what}: {why}")
    print(f"{len(todo)} cases, differing: " + ", ".join(f"{kind} {n}" for kind, n in differ.items()))
    return 1 if any(differ.values()) else 0


def keep(c: dict, theirs: dict) -> list[str]:
    """Takes a case's kept differences out of our bodies (KEPT); says which it took."""
    keys = {"Messages bodies": "messages body"}
    taken = []
    for where, what, differs, mend, _ in KEPT:
        if differs(c[keys[where]], theirs[keys[where]]):
            c[keys[where]] = mend(c[keys[where]])
            taken.append(what)
    return taken


def compare(c: dict, theirs: dict) -> dict[str, list[str]]:
    """A case's differences, by what differs."""
    # response.created/.in_progress and response.completed's body are the request's echo (api_diff.py's)
    final = c["responses"][-1]["response"]
    streamed = differences(shape(c["responses"][2:-1]), shape(theirs["responses"]["events"]))
    whole = c["responses body"]
    return {"Responses streams": streamed + output_differs("response.completed", final, theirs["responses"]),
            "Messages streams": differences(shape(c["messages"]), shape(theirs["messages"])),
            "chat messages": [] if chat_message(c) == shape(theirs["chat message"]) else [
                f"ours {json.dumps(chat_message(c))}\n      vLLM {json.dumps(shape(theirs['chat message']))}"],
            "Responses bodies": output_differs("the response", whole, theirs["responses body"]),
            "Messages bodies": [] if shape(c["messages body"]) == shape(theirs["messages body"]) else [
                f"ours {json.dumps(shape(c['messages body']))}\n"
                f"      vLLM {json.dumps(shape(theirs['messages body']))}"]}


def chat_message(c: dict) -> dict:
    """Our chat body's message, as far as vLLM's parser makes it (ids as their shape)."""
    message = c["chat body"]["choices"][0]["message"]
    return shape({k: message.get(k) for k in ("role", "content", "reasoning")} | {"tool_calls": [
        {k: t[k] for k in ("id", "type", "function")} for t in message.get("tool_calls") or []]})


def output_differs(where: str, ours: dict, theirs: dict) -> list[str]:
    """A response's output items and status against vLLM's."""
    if shape(ours.get("output")) == shape(theirs["output"]) and ours.get("status") == theirs["status"]:
        return []
    return [f"{where}: ours {ours.get('status')} {json.dumps(shape(ours.get('output', ours)))}\n"
            f"      vLLM {theirs['status']} {json.dumps(shape(theirs['output']))}"]


if __name__ == "__main__":
    sys.exit(main())
