"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) as vLLM serves it: the body served
as a chat request, so the same prompt, tokens and usage as the chat endpoint for the same conversation; system
text, multi-turn and prefill rendered by the chat template; stop_sequences and max_tokens as stop_reason; the
stream's events in Anthropic's order adding up to the whole message; tool_use blocks out of the hermes parser (the
output forced by a structured-outputs choice, as tests/test_tools.py does) and of a forced tool_choice, and
tool_result blocks back in; thinking blocks with --reasoning-parser; a client that leaves; the anthropic SDK; and a
4xx in Anthropic's error shape naming the field for each request it does not take."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from nanoserve import entry
from test_responses import STREAMED_CALLS, chat, chat_call_pieces, prompts, server  # noqa: F401 (server: the same
# tool-calling server, one per module)
from test_server import ServerThread, _metrics
from test_tools import CLOCK, FORCED, RENDERED_HISTORY, THOUGHT, TOLD, WEATHER, fits, no_blanks, strict_json  # noqa: F401
from test_tools import TOOLS as CHAT_TOOLS

# strict: a forced call's input follows the schema (with hermes, vLLM 0.32 constrains only a strict tool's)
TOOLS = [{"name": "get_weather", "description": "the forecast", "input_schema": WEATHER, "strict": True},
         {"name": "get_time", "input_schema": CLOCK, "strict": True}]
USER = [{"role": "user", "content": "hello"}]
LONG = {"type": "json_schema", "schema": {"type": "string", "minLength": 200}}  # no end before max_tokens


def message(server, **body) -> dict:
    body = {"model": server.args.served_model_name[0], "max_tokens": 16, "messages": USER, **body}
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 200, r.text
    m = r.json()
    served = server.args.served_model_name[0]
    assert (m["type"], m["role"], m["model"]) == ("message", "assistant", served) and m["id"].startswith("msg_")
    assert set(m) == {"id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"}
    return m


def stream(server, **body) -> tuple[list[dict], dict]:
    """A stream's events (each an SSE event named by its type), checked for Anthropic's order and replayed
    into the message they build: returns both."""
    body = {"model": server.args.served_model_name[0], "max_tokens": 16, "messages": USER, **body, "stream": True}
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    assert r.text.endswith("\n\n") and "[DONE]" not in r.text
    events = []
    for frame in r.text[:-2].split("\n\n"):
        name, data = frame.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert name == "event: " + events[-1]["type"]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    built, blocks, args = {**events[0]["message"], "content": []}, [], {}
    assert built["content"] == [] and built["stop_reason"] is None and built["usage"]["output_tokens"] == 0
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            assert e["index"] == len(blocks) and (not blocks or blocks[-1] is None), kinds  # the one before stopped
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_stop":
            assert e["index"] == len(blocks) - 1
            if blocks[-1]["type"] == "tool_use":
                blocks[-1]["input"] = json.loads(args.pop(e["index"], "{}"))
            built["content"].append(blocks[-1])
            blocks[-1] = None
        else:
            assert e["type"] == "content_block_delta" and e["index"] == len(blocks) - 1, e
            delta, block = e["delta"], blocks[-1]
            if delta["type"] == "input_json_delta":
                args[e["index"]] = args.get(e["index"], "") + delta["partial_json"]
            else:
                key = delta["type"].removesuffix("_delta")
                block[key] = block.get(key, "") + delta[key]  # (a thinking block's signature starts unset)
    assert not blocks or blocks[-1] is None  # every block stopped
    built.update(events[-2]["delta"], usage=events[-2]["usage"])
    return events, built


def no_ids(m: dict) -> dict:
    """A message as two answers to one greedy request share it: without the message's and the calls' ids."""
    return {**m, "id": None, "content": [{k: v for k, v in b.items() if k != "id"} for b in m["content"]]}


def text_of(m: dict) -> str:
    return "".join(b["text"] for b in m["content"] if b["type"] == "text")


@pytest.fixture
def forced(monkeypatch):
    """Forces the output of the next requests to the text given (a structured-outputs choice on the chat request
    the body becomes: the Messages API has no such field, and the random model would never write a call). Its
    tools are made not strict: as vLLM 0.32's, a strict tool's calls would be an alternative to the choice."""
    def force(text: str) -> None:
        chat_body = entry.AnthropicMessagesRequest.chat_body

        def body(self, rid: str) -> dict:
            out = chat_body(self, rid)
            tools = [{**t, "function": {**t["function"], "strict": None}} for t in out.get("tools") or []]
            return {**out, **({"tools": tools} if tools else {}), "structured_outputs": {"choice": [text]}}
        monkeypatch.setattr(entry.AnthropicMessagesRequest, "chat_body", body)
    return force


# =========================================================================== text

def test_message_is_the_chat_completion(server):
    """The same tokens and usage as the chat endpoint for the same greedy request; its finish_reason as
    stop_reason (the random model may end before max_tokens: either way they agree)."""
    for max_tokens in (1, 8):
        m = message(server, max_tokens=max_tokens, temperature=0)
        want = chat(server, messages=USER, max_tokens=max_tokens, temperature=0)
        (choice,) = want["choices"]
        assert text_of(m) == (choice["message"]["content"] or "")
        assert m["stop_reason"] == {"length": "max_tokens", "stop": "end_turn"}[choice["finish_reason"]]
        assert m["usage"] == {"input_tokens": want["usage"]["prompt_tokens"],
                              "output_tokens": want["usage"]["completion_tokens"]}
        assert all(b["type"] == "text" and b["text"] for b in m["content"]) and m["stop_sequence"] is None
    # "model": "" is unset, as vLLM's check takes it (the field itself is required: the BAD rows)
    assert message(server, max_tokens=8, temperature=0, model="")["content"] == m["content"]
    server.wait_idle()


def test_max_tokens_and_stop_sequences(server):
    """Cut by max_tokens: stop_reason "max_tokens" (a JSON schema too long to end keeps EOS out); ended by one of
    stop_sequences: stop_reason "stop_sequence", the sequence named, the text before it (greedy, so the same)."""
    m = message(server, max_tokens=12, temperature=0, output_config={"format": LONG})
    text = text_of(m)
    assert (m["stop_reason"], m["stop_sequence"], m["usage"]["output_tokens"]) == ("max_tokens", None, 12)
    assert text.startswith('"') and len(text) > 6, text
    stop = text[3:6]
    cut = message(server, max_tokens=12, temperature=0, output_config={"format": LONG}, stop_sequences=["@@", stop])
    assert (text_of(cut), cut["stop_reason"], cut["stop_sequence"]) == (text[:text.find(stop)], "stop_sequence",
                                                                         stop)
    assert cut["usage"]["output_tokens"] < 12
    _, streamed = stream(server, max_tokens=12, temperature=0, output_config={"format": LONG}, stop_sequences=[stop])
    assert (text_of(streamed), streamed["stop_reason"], streamed["stop_sequence"]) == (text_of(cut), "stop_sequence",
                                                                                       stop)
    server.wait_idle()


def test_a_repetition_ends_the_turn():
    """vLLM's repetition_detection finishes with "repetition" and stop_reason "repetition_detected", a string
    as a stop sequence's is: Anthropic's stop_reason is end_turn, with no stop sequence named."""
    assert entry.anthropic_stop_reason("repetition", "repetition_detected", []) == "end_turn"
    assert entry.anthropic_stop_reason("stop", "@@", []) == "stop_sequence"


def test_stream_adds_up_to_the_message(server):
    """message_start, one text block's start, deltas and stop, message_delta, message_stop; the text_deltas
    concatenated are the greedy message's text, and the usage is the same."""
    body = dict(max_tokens=10, temperature=0, output_config={"format": LONG})
    whole = message(server, **body)
    events, built = stream(server, **body)
    kinds = [e["type"] for e in events]
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * (len(kinds) - 5),
                     "content_block_stop", "message_delta", "message_stop"]
    assert events[0]["message"]["usage"] == {"input_tokens": whole["usage"]["input_tokens"], "output_tokens": 0}
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == text_of(whole)
    assert no_ids(built) == no_ids(whole)
    server.wait_idle()


def test_system_multi_turn_and_prefill_render_as_chat(server, prompts):
    """system (a string, or text blocks, Claude Code's billing line dropped as vLLM drops it) and system-role
    messages as one system message first; the turns as chat's; an assistant message last is continued."""
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
             {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    message(server, messages=turns, system="Be brief.", max_tokens=1)
    chat(server, messages=[{"role": "system", "content": "Be brief."}, turns[0],
                           {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "a\nb"}],
         max_tokens=1)
    assert prompts[-2] == prompts[-1] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHello."
        "<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n")
    message(server, messages=[{"role": "system", "content": "too."}, *turns], max_tokens=1, system=[
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1"}, {"type": "text", "text": "Be brief, "}])
    assert prompts[-1].startswith("<|im_start|>system\nBe brief, too.<|im_end|>\n<|im_start|>user\nhi<|im_end|>")
    m = message(server, messages=[*turns, {"role": "assistant", "content": "It is"}], max_tokens=1)
    assert prompts[-1].endswith("<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\nIt is")
    assert m["role"] == "assistant"
    server.wait_idle()


def test_client_that_leaves_aborts(server):
    """A stream's client that leaves after message_start: its engine request is aborted, its blocks freed."""
    before = _metrics(server.url).get("nanoserve:request_success_total{finished_reason=abort}", 0)
    server.delay = 0.05
    try:
        body = {"model": server.args.served_model_name[0], "max_tokens": 200, "messages": USER, "stream": True,
                "output_config": {"format": LONG}}
        with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as r:
            assert next(r.iter_lines()) == "event: message_start"
    finally:
        server.delay = 0.0
    server.wait_idle()
    assert _metrics(server.url)["nanoserve:request_success_total{finished_reason=abort}"] == before + 1


# =========================================================================== tools

@pytest.mark.parametrize("streamed", [False, True])
def test_hermes_calls_become_tool_use_blocks(server, forced, streamed):
    """The model's <tool_call>s (forced) are tool_use blocks after the text before them, stop_reason "tool_use";
    streamed, their input arrives in input_json_delta events that add up to it."""
    forced(FORCED)
    body = dict(tools=TOOLS, max_tokens=300)
    m = stream(server, **body)[1] if streamed else message(server, **body)
    assert [b["type"] for b in m["content"]] == ["text", "tool_use", "tool_use"] and text_of(m) == TOLD
    assert [[b["name"], b["input"]] for b in m["content"][1:]] == [["get_weather", {"city": "Paris", "days": 3}],
                                                                    ["get_time", {"tz": "cet"}]]
    assert all(b["id"] for b in m["content"][1:]) and m["stop_reason"] == "tool_use"
    if streamed:
        return
    # disable_parallel_tool_use keeps the first call; tool_choice none leaves the text as it is
    m = message(server, **body, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.get("name") for b in m["content"]] == [None, "get_weather"]
    m = message(server, **body, tool_choice={"type": "none"})
    assert m["content"] == [{"type": "text", "text": FORCED}] and m["stop_reason"] == "end_turn"
    server.wait_idle()


@pytest.mark.parametrize("parser", STREAMED_CALLS)
def test_calls_stream_as_the_chat_stream_sends_them(server, forced, monkeypatch, parser):
    """As vLLM 0.32's Messages stream (the chat stream's deltas converted): each tool_use block's
    input_json_delta events carry the arguments the chat stream's deltas do, as the model writes them (hermes,
    llama3_json), not the whole input at the output's end."""
    monkeypatch.setattr(server.app.state.server, "tool_parser", parser)
    text = STREAMED_CALLS[parser]
    content, want = chat_call_pieces(server, text, messages=USER)
    forced(text)
    events, m = stream(server, tools=TOOLS, max_tokens=300, temperature=0)
    got = []
    for e in events:
        if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use":
            got.append([e["content_block"]["name"], []])
        elif e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
            got[-1][1].append(e["delta"]["partial_json"])
    assert got == want and [name for name, _ in got] == ["get_weather", "get_time"], (got, want)
    assert text_of(m) == content and m["stop_reason"] == "tool_use"
    if parser in ("hermes", "llama3_json"):
        assert all(len(pieces) > 1 for _, pieces in got), got
    server.wait_idle()


def test_text_while_a_call_streams_follows_it_and_a_cut_call_does_not_run():
    """As vLLM 0.32's stream converter: text that comes while a tool_use block is open is held, and goes out as a
    text block after that block stops; a stop string that cut the last call short (its input no JSON) is the
    stop_reason "stop_sequence", where a whole call's is "tool_use"."""
    content = entry.AnthropicContent()
    first = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}
    events = content.feed({"tool_calls": [first]}) + content.feed({"content": "late"})
    assert [kind for kind, _ in events] == ["content_block_start", "content_block_delta"]
    assert content.call_cut()
    events += content.feed({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}) + content.close()
    assert [(kind, f["index"]) for kind, f in events[2:]] == [("content_block_delta", 0), ("content_block_stop", 0),
                                                              ("content_block_start", 1), ("content_block_delta", 1),
                                                              ("content_block_stop", 1)]
    assert content.blocks == [{"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}},
                              {"type": "text", "text": "late"}] and not content.call_cut()
    calls = content.blocks[:1]
    assert entry.anthropic_stop_reason("stop", "END", calls, call_cut=True) == "stop_sequence"
    assert entry.anthropic_stop_reason("stop", "END", calls) == "tool_use"
    assert entry.anthropic_stop_reason("stop", "END", []) == "stop_sequence"
    assert entry.anthropic_stop_reason("tool_calls", None, calls, call_cut=True) == "tool_use"


@pytest.mark.parametrize("streamed", [False, True])
def test_a_lone_surrogate_the_model_escaped_in_a_call_stays_escaped(server, forced, streamed):
    """A call whose JSON holds "\\ud800" (six characters the model may write) has that lone surrogate in its
    input: the message goes out as UTF-8 with it escaped (it was a 500, UnicodeEncodeError, unstreamed)."""
    forced('<tool_call>{"name": "get_time", "arguments": {"tz": "\\ud800"}}</tool_call>')
    body = dict(tools=TOOLS, max_tokens=300)
    m = stream(server, **body)[1] if streamed else message(server, **body)
    assert [(b["name"], b["input"]) for b in m["content"]] == [("get_time", {"tz": "\ud800"})], m
    server.wait_idle()


@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},  # one call: a random
                                    {"type": "tool", "name": "get_time"}])  # model would call till max_tokens
def test_forced_tool_choice_makes_valid_calls(server, strict_json, monkeypatch, choice):
    """tool_choice any (chat's "required") or a named tool: the grammar makes each call valid; streamed (its
    input as the model wrote it, read as strict JSON: no control characters), the same message."""
    chat_body = entry.AnthropicMessagesRequest.chat_body
    monkeypatch.setattr(entry.AnthropicMessagesRequest, "chat_body",  # the whitespace a random model wanders in
                        lambda self, rid: {**chat_body(self, rid), "logit_bias": strict_json})
    for seed in range(2):
        body = dict(tools=TOOLS, tool_choice=choice, temperature=1.0, max_tokens=200,
                    metadata={"user_id": str(seed)})
        m = message(server, **body)
        calls = [b for b in m["content"] if b["type"] == "tool_use"]
        assert calls and all(fits(b["name"], b["input"]) for b in calls) and m["stop_reason"] == "tool_use", json.dumps(m)
        if choice["type"] == "tool":
            assert [b["name"] for b in calls] == ["get_time"]
    _, built = stream(server, **{**body, "temperature": 0})
    assert no_ids(built) == no_ids(message(server, **{**body, "temperature": 0}))
    server.wait_idle()


def test_tool_result_round_trip(server, prompts):
    """An assistant's tool_use block and the user's tool_result reach the template as chat's tool_calls and tool
    message: the prompt chat renders for that history; count_tokens counts it as chat's usage does."""
    history = [{"role": "user", "content": "weather in Paris?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                                  "input": {"city": "Paris", "days": 2}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                             "content": [{"type": "text", "text": "sunny"}]}]}]
    m = message(server, messages=history, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=2)
    assert prompts[-1] == RENDERED_HISTORY
    r = httpx.post(server.url + "/v1/messages/count_tokens", json={
        "model": server.args.served_model_name[0], "messages": history, "tools": TOOLS,
        "tool_choice": {"type": "none"}})
    assert r.status_code == 200 and r.json() == {"input_tokens": m["usage"]["input_tokens"],
                                                 "context_management": {"original_input_tokens": m["usage"][
                                                     "input_tokens"]}}
    want = chat(server, messages=[{"role": "system", "content": "Be brief."}, *USER], tools=CHAT_TOOLS, max_tokens=1)
    r = httpx.post(server.url + "/v1/messages/count_tokens", json={
        "model": server.args.served_model_name[0], "messages": USER, "system": "Be brief.", "tools": TOOLS})
    assert r.json()["input_tokens"] == want["usage"]["prompt_tokens"]
    server.wait_idle()


@pytest.mark.parametrize("streamed", [False, True])
def test_reasoning_parser_makes_thinking_blocks(server, forced, monkeypatch, streamed):
    """With --reasoning-parser the thought is a thinking block (signed, as vLLM's) before the text (what the
    parser leaves, as vLLM's); thinking and redacted_thinking blocks sent back are taken."""
    monkeypatch.setattr(server.app.state.server, "reasoning_parser", "deepseek_r1")
    forced(THOUGHT + "Sunny.")
    events, m = stream(server, max_tokens=100) if streamed else (None, message(server, max_tokens=100))
    (thought, text) = m["content"]
    assert thought["type"] == "thinking" and thought["thinking"] == "\nThe user wants the weather.\n"
    assert thought["signature"] and text == {"type": "text", "text": "\n\nSunny."}
    assert m["stop_reason"] == "end_turn"
    if streamed:
        assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"].count("signature_delta") == 1
        # as vLLM 0.32's (benchmarks/event_seq.py): the block starts without a signature, which comes at its end
        assert events[1]["content_block"] == {"type": "thinking", "thinking": ""}, events[1]
    else:
        back = [*USER, {"role": "assistant", "content": [*m["content"], {"type": "redacted_thinking", "data": "x"}]},
                {"role": "user", "content": "and tomorrow?"}]
        assert message(server, messages=back, max_tokens=1)["usage"]["input_tokens"] == chat(
            server, messages=[*USER, {"role": "assistant", "content": "\n\nSunny."},
                              {"role": "user", "content": "and tomorrow?"}], max_tokens=1)["usage"]["prompt_tokens"]
    server.wait_idle()


def test_a_blank_line_between_a_thought_and_calls_is_no_text_block(server, forced, monkeypatch):
    """As vLLM 0.32's parser (benchmarks/event_seq.py): the blank line after a thought, before calls, is no text
    in a whole message (no text block); a stream sends it as it comes (a text block, as vLLM's stream)."""
    monkeypatch.setattr(server.app.state.server, "reasoning_parser", "qwen3")
    forced(THOUGHT + FORCED[len(TOLD):])
    m = message(server, tools=TOOLS, max_tokens=400)
    assert [b["type"] for b in m["content"]] == ["thinking", "tool_use", "tool_use"], m
    m = stream(server, tools=TOOLS, max_tokens=400)[1]
    assert [b["type"] for b in m["content"]] == ["thinking", "text", "tool_use", "tool_use"] and text_of(m) == "\n\n"
    server.wait_idle()


# =========================================================================== the anthropic SDK

def test_sdk(server):
    """The anthropic SDK reads the messages, the stream (its own accumulator checks the events), the count and
    the errors."""
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    model = server.args.served_model_name[0]
    # (this SDK's create has no temperature: greedy by extra_body)
    body = dict(model=model, max_tokens=10, messages=USER, output_config={"format": LONG},
                extra_body={"temperature": 0})
    m = client.messages.create(**body)
    assert (m.type, m.role, m.stop_reason, m.usage.output_tokens) == ("message", "assistant", "max_tokens", 10)
    with client.messages.stream(**body) as s:
        final = s.get_final_message()
    assert final.content[0].text == m.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10 and final.usage.input_tokens == m.usage.input_tokens
    called = client.messages.create(model=model, max_tokens=400, messages=USER, tools=TOOLS,  # seeded: no chance
                                    tool_choice={"type": "tool", "name": "get_time"}, extra_body={"seed": 0})
    assert called.content[-1].type == "tool_use" and called.content[-1].name == "get_time"
    assert client.messages.count_tokens(model=model, messages=USER).input_tokens == m.usage.input_tokens
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model=model, max_tokens=10_000, messages=USER)
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        client.messages.create(model="claude-x", max_tokens=1, messages=USER)
    server.wait_idle()


def test_api_key(tiny_model):
    """--api-key guards /v1/messages as every /v1 path: `Authorization: Bearer` (the SDK's auth_token, Claude
    Code's ANTHROPIC_AUTH_TOKEN), as vLLM's check, and there also Anthropic's `x-api-key` (the SDK's api_key,
    Claude Code's ANTHROPIC_API_KEY); a 401 in Anthropic's shape."""
    with ServerThread(tiny_model, "--api-key", "k", "--max-model-len", "128") as s:
        model = s.args.served_model_name[0]
        body = {"model": model, "max_tokens": 1, "messages": USER}
        for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong", "x-api-key": "k"}):
            r = httpx.post(s.url + "/v1/messages", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
            assert "x-api-key" in r.json()["error"]["message"]  # the header these clients know
        for client in (anthropic.Anthropic(base_url=s.url, auth_token="k", max_retries=0),
                       anthropic.Anthropic(base_url=s.url, api_key="k", max_retries=0)):
            assert client.messages.create(model=model, max_tokens=1, messages=USER).usage.output_tokens == 1
        # an OpenAI path takes only the bearer token, as vLLM's
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"x-api-key": "k"})
        assert r.status_code == 401, r.text


# =========================================================================== bad requests

M = [{"role": "user", "content": "hi"}]
BAD = [  # body (the model added unless given), status, a word the message must hold
    ({"messages": M}, 400, "max_tokens"),
    ({"messages": M, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": M, "max_tokens": "many"}, 400, "max_tokens"),
    ({"messages": M, "max_tokens": 100000}, 400, "max_tokens"),  # over --max-model-len itself (with the prompt: clamped)
    ({"model": None, "messages": M, "max_tokens": 1}, 400, "model"),
    ({"model": "claude-x", "messages": M, "max_tokens": 1}, 404, "model"),
    ({"max_tokens": 1}, 400, "messages"),
    ({"messages": [], "max_tokens": 1}, 400, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}], "max_tokens": 1}, 400, "messages[0]"),
    ({"messages": [{"role": "user", "content": []}], "max_tokens": 1}, 400, "messages[0]"),
    ({"messages": [{"role": ["user"], "content": "x"}], "max_tokens": 1}, 400, "messages[0]"),
    ({"messages": ["hi"], "max_tokens": 1}, 400, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "AA=="}}]}],
      "max_tokens": 1}, 400, "images"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}], "max_tokens": 1}, 400, "messages[0].content[0].content"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}],
      "max_tokens": 1}, 400, "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}],
      "max_tokens": 1}, 400, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "redacted_thinking", "data": "x"}]}], "max_tokens": 1},
     400, "nothing to render"),  # only opaque blocks, which are dropped: no conversation left
    ({"messages": [{"role": "system", "content": ""}, {"role": "user", "content": [{"type": "tool_reference"}]}],
      "max_tokens": 1}, 400, "nothing to render"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": False}]}],
      "max_tokens": 1}, 400, "messages[0].content[0].content"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "", "input": {}}]}],
      "max_tokens": 1}, 400, "messages[0].content[0]"),  # in the body's words, not the chat request's
    ({"messages": M, "max_tokens": 1, "system": 3}, 400, "system"),
    ({"messages": M, "max_tokens": 1, "system": [{"type": "image"}]}, 400, "system"),
    ({"messages": M, "max_tokens": 1, "temperature": -1}, 400, "temperature"),
    ({"messages": M, "max_tokens": 1, "top_p": 2}, 400, "top_p"),
    ({"messages": M, "max_tokens": 1, "stop_sequences": "x"}, 400, "stop_sequences"),
    ({"messages": M, "max_tokens": 1, "tools": [{"name": "f"}]}, 400, "input_schema"),
    ({"messages": M, "max_tokens": 1, "tools": [{"name": "", "input_schema": {}}]}, 400, "name"),
    ({"messages": M, "max_tokens": 1, "tools": [TOOLS[0], {"name": "f", "input_schema": {"type": "integer"}}]}, 400,
     "tools[1].input_schema"),  # a forced call's input would be no object
    ({"messages": M, "max_tokens": 1, "tool_choice": {"type": "any"}}, 400, "tool_choice"),
    ({"messages": M, "max_tokens": 1, "tools": TOOLS, "tool_choice": {"type": "tool"}}, 400, "tool_choice.name"),
    ({"messages": M, "max_tokens": 1, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "f"}}, 400,
     "tool_choice"),
    ({"messages": M, "max_tokens": 1, "tools": TOOLS, "tool_choice": {"type": "maybe"}}, 400, "tool_choice"),
    ({"messages": M, "max_tokens": 1, "output_config": {"format": {"type": "json_object"}}}, 400, "output_config"),
    ({"messages": M, "max_tokens": 1, "output_config": {"effort": "huge"}}, 400, "output_config"),
    ({"messages": M, "max_tokens": 1, "stream": "sometimes"}, 400, "stream"),
]


@pytest.mark.parametrize("body,status,word", BAD, ids=[f"{i}-{row[2]}" for i, row in enumerate(BAD)])
def test_bad_requests(server, body, status, word):
    body = {"model": server.args.served_model_name[0], **body}
    check_error(httpx.post(server.url + "/v1/messages", json={k: v for k, v in body.items() if v is not None},
                           timeout=60), status, word)
    if word not in ("max_tokens", "temperature", "top_p", "stop_sequences", "output_config", "stream"):  # its own
        body.pop("max_tokens", None)
        check_error(httpx.post(server.url + "/v1/messages/count_tokens", timeout=60,
                               json={k: v for k, v in body.items() if v is not None}), status, word)


def check_error(r: httpx.Response, status: int, word: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()
    assert set(err) == {"type", "error"} and err["type"] == "error" and set(err["error"]) == {"type", "message"}
    assert err["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert word in err["error"]["message"] and "Traceback" not in r.text, err


def test_errors_quote_the_body_not_the_chat_request_it_becomes(server):
    """A check made on the translated chat request speaks the body's terms: its tool_choice {"type": "any"}, not
    chat's "required"; its output_config, not chat's response_format.json."""
    body = {"model": server.args.served_model_name[0], "max_tokens": 4, "messages": USER, "tools": TOOLS,
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_time"}):
        r = httpx.post(server.url + "/v1/messages", json={**body, "tool_choice": choice}, timeout=60)
        check_error(r, 400, f"tool_choice {json.dumps(choice)} constrains the output to tool calls")
        assert "required" not in r.text and "function" not in r.text, r.text
    r = httpx.post(server.url + "/v1/messages", timeout=60, json={
        **body, "output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}})
    check_error(r, 400, "output_config cannot be compiled")
    frob = {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "frob"}}}, "strict": True}
    r = httpx.post(server.url + "/v1/messages", timeout=60, json={**body, "output_config": None, "tools": [frob],
                                                                  "tool_choice": {"type": "any"}})
    check_error(r, 400, "the tools' input_schema are not JSON schemas")  # Anthropic's name, not chat's "parameters"


def test_more_bad_requests(server):
    """Not JSON, the wrong method: Anthropic's shape too; other paths keep OpenAI's."""
    r = httpx.post(server.url + "/v1/messages", content=b"{", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error" and "JSON" in r.text
    r = httpx.get(server.url + "/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": M, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    server.wait_idle()


def test_count_tokens_is_bounded_as_a_message_is(server):
    """count_tokens counts what a message could send (vLLM's: up to max_model_len tokens, no output beside them);
    a longer conversation is /v1/messages' 400, "maximum context length" with its count (it was counted, at any
    length up to the character bound); past that bound, the same 400 untokenized; never a 500."""
    model, limit = server.args.served_model_name[0], server.engine.max_model_len

    def post(path: str, words: int, **body) -> httpx.Response:
        return httpx.post(server.url + path, timeout=60, json={"model": model, **body, "messages": [
            {"role": "user", "content": "hello " * words}]})
    one, two = (post("/v1/messages/count_tokens", k).json()["input_tokens"] for k in (10, 20))
    fits = 10 + (limit - one) * 10 // (two - one)  # the most words whose prompt fits, if each word is as many tokens
    r = post("/v1/messages/count_tokens", fits)
    assert r.status_code == 200 and limit - (two - one) // 10 <= r.json()["input_tokens"] <= limit, r.text
    over = post("/v1/messages/count_tokens", 2 * limit)
    check_error(over, 400, f"maximum context length is {limit} tokens. However, your prompt contains ")
    check_error(post("/v1/messages", 2 * limit, max_tokens=1), 400, over.json()["error"]["message"][:-1])
    check_error(post("/v1/messages/count_tokens", server.engine.max_prompt_chars // 6 + 1), 400,
                f"(more than {server.engine.max_prompt_chars} characters, which is the upper bound")
    server.wait_idle()
