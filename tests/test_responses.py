"""OpenAI's Responses API (POST /v1/responses) as vLLM serves it without its response store: the
openai SDK's client.responses.create, plain and streamed, read into its types (and the raw JSON
validated against them strictly); string and list input, instructions and function-call history
rendered by the chat template as the chat endpoint renders them; text.format json_schema;
function tools read by the hermes parser (the output forced by structured_outputs, as
tests/test_tools.py does) and forced by tool_choice; --reasoning-parser items; logprobs;
max_output_tokens -> status "incomplete"; a client that leaves; and a 400 (or vLLM's 404)
naming the field for each request it does not take."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from test_server import ServerThread, _check_error, _metrics
from test_tools import CLOCK, FORCED, RENDERED_HISTORY, TEMPLATE, THOUGHT, TOLD, WEATHER, fits, no_blanks  # noqa: F401
from test_tools import STRICT_TOOLS as CHAT_TOOLS
from test_tools import TOOLS as LOOSE_CHAT_TOOLS
from test_tools import calls_of, chat_stream

# strict: a forced call's arguments follow the schema (with hermes, vLLM 0.32 constrains only a strict tool's)
TOOLS = [{"type": "function", "name": "get_weather", "description": "the forecast", "parameters": WEATHER,
          "strict": True}, {"type": "function", "name": "get_time", "parameters": CLOCK, "strict": True}]
# for an output forced by a structured-outputs choice: as vLLM 0.32's, a strict tool's calls would be an
# alternative to the choice (a structural tag for "auto")
LOOSE_TOOLS = [{**t, "strict": False} for t in TOOLS]
CALLS = [["get_weather", '{"city": "Paris", "days": 3}'], ["get_time", '{"tz": "cet"}']]
EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    template = tmp_path_factory.mktemp("responses") / "tools.jinja"
    template.write_text(TEMPLATE)
    with ServerThread(tiny_model, "--chat-template", str(template), "--enable-auto-tool-choice",
                      "--tool-call-parser", "hermes", "--max-model-len", "512") as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def create(server, **body) -> dict:
    """A response, its JSON checked against the SDK's Response type strictly (the SDK's own parse does not check)."""
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())
    return r.json()


def stream(server, **body) -> tuple[list[dict], dict]:
    """A stream's events (each an SSE event named by its type, numbered from 0, and strictly of an SDK event
    type), replayed to check that they build the response that response.completed carries: returns both."""
    r = httpx.post(server.url + "/v1/responses", json={**body, "stream": True}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    assert r.text.endswith("\n\n") and "[DONE]" not in r.text  # as vLLM's and OpenAI's
    events = []
    for frame in r.text[:-2].split("\n\n"):
        name, data = frame.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert name == "event: " + events[-1]["type"]
        EVENT.validate_python(events[-1])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"  # vLLM's, also when the status is "incomplete"
    items, texts = [], {}
    for e in events[2:-1]:
        if e["type"] == "response.output_item.added":
            assert e["output_index"] == len(items)
            items.append(e["item"])
        elif e["type"] == "response.output_item.done":
            assert e["output_index"] == len(items) - 1 and e["item"]["id"] == items[-1]["id"]
            assert e["item"] == final["output"][e["output_index"]]
        else:
            assert e["output_index"] == len(items) - 1 and e["item_id"] == items[-1]["id"], e
        if e["type"].endswith(".delta"):
            texts[e["item_id"]] = texts.get(e["item_id"], "") + e["delta"]
        elif e["type"] in ("response.output_text.done", "response.reasoning_text.done"):
            assert e["text"] == texts.pop(e["item_id"], "")
        elif e["type"] == "response.function_call_arguments.done":
            assert e["arguments"] == texts.pop(e["item_id"], "")
    assert len(items) == len(final["output"]) and not texts
    return events, final


def output_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def chat(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def prompts(server, monkeypatch) -> list[str]:
    """The prompts the server renders, as the engine gets them."""
    seen, add_request = [], server.async_llm.add_request
    monkeypatch.setattr(server.async_llm, "add_request",
                        lambda prompt, *a, **k: seen.append(prompt.text) or add_request(prompt, *a, **k))
    return seen


# =========================================================================== text

def test_sdk_response_and_stream_match_chat(server, client):
    """The same tokens as the chat endpoint for the same message; cut short by max_output_tokens: status
    "incomplete" (vLLM's reason), in the SDK's types, plain, streamed and through its stream helper."""
    model = server.args.served_model_name[0]
    body = dict(input="hello", max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    r = client.responses.create(model=model, **body)
    want = chat(server, messages=[{"role": "user", "content": "hello"}], max_completion_tokens=6, temperature=0,
                ignore_eos=True)
    assert r.output_text == want["choices"][0]["message"]["content"] and r.id.startswith("resp_")
    assert (r.status, r.incomplete_details.reason, r.object, r.model) == ("incomplete", "max_output_tokens",
                                                                          "response", model)
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == \
        (want["usage"]["prompt_tokens"], 6, want["usage"]["prompt_tokens"] + 6)
    (item,) = r.output
    assert (item.type, item.role, item.status, item.content[0].type) == ("message", "assistant", "completed",
                                                                         "output_text")
    assert (r.max_output_tokens, r.temperature, r.top_p, r.tool_choice, r.tools, r.parallel_tool_calls) == \
        (6, 0.0, 1.0, "none", [], True)  # "auto" without tools comes to "none", as vLLM reports it
    events = list(client.responses.create(model=model, stream=True, **body))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress", "response.output_item.added",
                                            "response.content_part.added"]
    assert [e.type for e in events[-4:]] == ["response.output_text.done", "response.content_part.done",
                                             "response.output_item.done", "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text and events[-1].response.status == "incomplete"
    with client.responses.stream(model=model, input="hello", max_output_tokens=6, temperature=0,
                                 extra_body={"ignore_eos": True}) as s:
        assert s.get_final_response().output_text == r.output_text  # its checks of items, indices and ids pass
    raw = create(server, input="hello", max_output_tokens=6, temperature=0, ignore_eos=True)
    assert stream(server, input="hello", max_output_tokens=6, temperature=0, ignore_eos=True)[1]["output"][0][
        "content"] == raw["output"][0]["content"]
    server.wait_idle()


def test_a_whole_answer_is_completed(server):
    # greedy: the choice's text has more than one tokenization, and a sampled draw may take another each time
    body = dict(input="hi", structured_outputs={"choice": ["Hello there."]}, max_output_tokens=50, temperature=0)
    r = create(server, **body)
    assert (output_text(r), r["status"], r["incomplete_details"]) == ("Hello there.", "completed", None)
    events, final = stream(server, **body)
    assert output_text(final) == "Hello there." and final["status"] == "completed"
    assert final["usage"] == {**r["usage"], "input_tokens_details": final["usage"]["input_tokens_details"]}
    server.wait_idle()


def test_response_keys_as_vllms(server):
    """The keys vLLM 0.32's response has (measured with benchmarks/api_diff.py), null where it says null."""
    r = create(server, input="hi", max_output_tokens=2, presence_penalty=0.5)
    assert {k: r[k] for k in ("prompt", "kv_transfer_params", "ec_transfer_params", "input_messages",
                              "output_messages", "text")} == dict.fromkeys(("prompt", "kv_transfer_params",
                              "ec_transfer_params", "input_messages", "output_messages", "text"))
    assert (r["presence_penalty"], r["frequency_penalty"]) == (0.5, 0.0)
    (item,) = r["output"]
    assert item["phase"] is None and item["content"][0]["logprobs"] is None  # logprobs not asked for
    assert set(r["usage"]["input_tokens_details"]) == {"cached_tokens", "cache_write_tokens", "input_tokens_per_turn",
                                                       "cached_tokens_per_turn"}
    assert set(r["usage"]["output_tokens_details"]) == {"reasoning_tokens", "tool_output_tokens",
                                                        "output_tokens_per_turn", "tool_output_tokens_per_turn"}
    server.wait_idle()


def test_input_items_and_instructions_render_as_chat_messages(server, prompts):
    """instructions first as a system message; text parts joined; an earlier output message as the assistant's;
    reasoning items dropped (as vLLM); an unfinished assistant message last is continued."""
    create(server, input="hi", max_output_tokens=1)
    assert prompts[-1] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    items = [{"role": "user", "content": "hi"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
             {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
             {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}]
    r = create(server, input=items, instructions="Be brief.", max_output_tokens=1)
    assert prompts[-1] == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                           "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n"
                           "<|im_start|>assistant\n")
    assert r["instructions"] == "Be brief."
    create(server, input=[*items, {"role": "assistant", "content": "It is", "status": "incomplete"}],
           max_output_tokens=1)
    assert prompts[-1].endswith("<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\nIt is")
    server.wait_idle()


def test_function_call_output_round_trip(server, prompts):
    """A function_call and its function_call_output reach the template as chat's assistant tool_calls and tool
    message: the prompt is the one the chat endpoint renders for that history (tests/test_tools.py)."""
    items = [{"role": "user", "content": "weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris", "days": 2}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    create(server, input=items, tools=TOOLS, tool_choice="none", max_output_tokens=1)
    assert prompts[-1] == RENDERED_HISTORY
    # a function_call after the assistant's text joins that message, as vLLM's
    create(server, input=[items[0], {"role": "assistant", "content": "Let me see."}, *items[1:]], tools=TOOLS,
           tool_choice="none", max_output_tokens=1)
    assert "<|im_start|>assistant\nLet me see.<tool_call>" in prompts[-1]
    server.wait_idle()


def test_json_schema_text_format(server, client, monkeypatch):
    schema = {"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}}
    text = {"format": {"type": "json_schema", "name": "count", "schema": schema, "strict": True}}
    for seed in range(3):
        r = create(server, input="a number", text=text, temperature=1.0, seed=seed, max_output_tokens=100)
        value = json.loads(output_text(r))
        assert set(value) == {"n"} and type(value["n"]) is int and 1 <= value["n"] <= 9, value
        # echoed as vLLM's model dumps it: its unset fields null
        assert r["text"] == {"format": {**text["format"], "description": None}, "verbosity": None}
        assert r["status"] == "completed"
    # json_object: a random model writes endless keys, so look at the constraint the engine gets
    seen, add_request = [], server.async_llm.add_request
    monkeypatch.setattr(server.async_llm, "add_request",
                        lambda prompt, params, *a, **k: seen.append(params) or add_request(prompt, params, *a, **k))
    r = client.responses.create(model=server.args.served_model_name[0], input="x", max_output_tokens=3,
                                text={"format": {"type": "json_object"}})
    assert r.output_text.startswith("{") and seen[-1].structured_outputs.json_object is True
    server.wait_idle()


# =========================================================================== tools

def test_hermes_calls_become_function_call_items(server, client):
    """The model's <tool_call>s (forced, as tests/test_tools.py does) are function_call items after the message
    of the text before them; streamed, their arguments arrive in function_call_arguments events."""
    body = dict(input="weather in Paris?", tools=LOOSE_TOOLS, structured_outputs={"choice": [FORCED]},
                max_output_tokens=300)
    r = create(server, **body)
    (message, *calls) = r["output"]
    assert message["type"] == "message" and output_text(r) == TOLD and r["status"] == "completed"
    assert [[c["name"], c["arguments"]] for c in calls] == CALLS
    assert all(c["type"] == "function_call" and c["status"] == "completed" and c["id"].startswith("fc_")
               and c["call_id"] for c in calls) and len({c["call_id"] for c in calls}) == 2
    assert r["tools"] == [{"description": None, **LOOSE_TOOLS[0]}, {"description": None, **LOOSE_TOOLS[1]}]
    events, final = stream(server, **body)
    assert output_text(final) == TOLD
    assert [[c["name"], c["arguments"]] for c in final["output"][1:]] == CALLS
    assert [e["type"] for e in events].count("response.function_call_arguments.done") == 2
    sdk = client.responses.create(model=server.args.served_model_name[0], input="weather in Paris?", tools=LOOSE_TOOLS,
                                  max_output_tokens=300, extra_body={"structured_outputs": {"choice": [FORCED]}})
    assert [[c.name, c.arguments] for c in sdk.output if c.type == "function_call"] == CALLS
    # parallel_tool_calls false keeps the first call; tool_choice "none" leaves the text as it is
    assert [c["name"] for c in create(server, **body, parallel_tool_calls=False)["output"][1:]] == ["get_weather"]
    assert output_text(create(server, **body, tool_choice="none")) == FORCED
    server.wait_idle()


# each parser's two calls (forced, as tests/test_tools.py does): hermes and llama3_json stream them as written;
# pythonic and mistral read them at the output's end, as vLLM 0.32's parsers do
STREAMED_CALLS = {
    "hermes": FORCED,
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                   '{"name": "get_time", "parameters": {"tz": "cet"}}',
    "pythonic": '[get_weather(city="Paris", days=3), get_time(tz="cet")]',
    "mistral": 'I will check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
               '{"name": "get_time", "arguments": {"tz": "cet"}}]',
}


def chat_call_pieces(server, text: str, **body) -> tuple[str, list[list]]:
    """The chat stream's content and, for each call, its name and the arguments its deltas carry, in order."""
    chunks, content, calls, _ = chat_stream(server, tools=LOOSE_CHAT_TOOLS, structured_outputs={"choice": [text]},
                                            max_tokens=300, temperature=0, **body)
    pieces = [[name, []] for name, _ in calls]
    for d in (d for ch in chunks for c in ch["choices"] for d in c["delta"].get("tool_calls", [])):
        if d["function"].get("arguments"):
            pieces[d["index"]][1].append(d["function"]["arguments"])
    return content, pieces


@pytest.mark.parametrize("parser", STREAMED_CALLS)
def test_calls_stream_as_the_chat_stream_sends_them(server, monkeypatch, parser):
    """As vLLM 0.32's Responses stream (the chat stream's parse_delta, then an item per call): each call's
    function_call_arguments.delta events carry the arguments the chat stream's deltas do, as the model writes
    them (hermes, llama3_json), not the whole arguments at the output's end."""
    monkeypatch.setattr(server.app.state.server, "tool_parser", parser)
    text = STREAMED_CALLS[parser]
    content, want = chat_call_pieces(server, text, messages=[{"role": "user", "content": "weather?"}])
    events, final = stream(server, input="weather?", tools=LOOSE_TOOLS, structured_outputs={"choice": [text]},
                           max_output_tokens=300, temperature=0)
    got = []
    for e in events:
        if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call":
            got.append([e["item"]["name"], []])
        elif e["type"] == "response.function_call_arguments.delta":
            got[-1][1].append(e["delta"])
    assert got == want and [name for name, _ in got] == ["get_weather", "get_time"], (got, want)
    assert output_text(final) == content
    if parser in ("hermes", "llama3_json"):
        assert all(len(pieces) > 1 for _, pieces in got), got
    server.wait_idle()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
def test_forced_tool_choice_makes_valid_calls(server, no_blanks, choice):
    """tool_choice "required" or a named function: the chat path's grammar makes the call valid (vLLM's
    Responses path parses such output unconstrained)."""
    for seed in range(3):
        body = dict(input="time?", tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed, max_output_tokens=200,
                    logit_bias=no_blanks)
        r = create(server, **body)
        calls = [c for c in r["output"] if c["type"] == "function_call"]
        assert calls and all(fits(c["name"], json.loads(c["arguments"], strict=False)) for c in calls), r["output"]
        assert r["tool_choice"] == choice and r["status"] == "completed"
        if isinstance(choice, dict):
            assert [c["name"] for c in calls] == ["get_time"]
        # (a stream's arguments as the model wrote them, vLLM 0.32's streamed parsers'; a response's written back)
        assert calls_read(stream(server, **body)[1]["output"]) == calls_read(calls)
    server.wait_idle()


def test_auto_without_a_parser_leaves_the_text(server, monkeypatch):
    """As vLLM's Responses path: without --enable-auto-tool-choice the tools reach the template and the text is
    not parsed (chat completions answers 400 there)."""
    monkeypatch.setattr(server.app.state.server, "tool_parser", None)
    r = create(server, input="x", tools=LOOSE_TOOLS, structured_outputs={"choice": [FORCED]}, max_output_tokens=300)
    assert output_text(r) == FORCED and [i["type"] for i in r["output"]] == ["message"]
    # the tools are in the prompt, also with --exclude-tools-when-tool-choice-none (only "none" hides them)
    monkeypatch.setattr(server.app.state.server, "exclude_tools_when_tool_choice_none", True)
    used = {choice: create(server, input="x", tools=TOOLS, tool_choice=choice, max_output_tokens=1)["usage"]
            for choice in ("auto", "none")}
    assert used["auto"]["input_tokens"] == r["usage"]["input_tokens"] > used["none"]["input_tokens"], used
    server.wait_idle()


def comparable(output: list[dict]) -> list[dict]:
    """Output items as two responses to one greedy request share them: without ids, logprobs to 1e-4 (a
    prefix-cache hit may change their last digits), and a reasoning item's status (a whole response's is null,
    a stream's done item "completed", as vLLM's)."""
    if isinstance(output, list):
        return [comparable(v) for v in output]
    if not isinstance(output, dict):
        return output
    return {k: pytest.approx(v, abs=1e-4) if k == "logprob" else comparable(v) for k, v in output.items()
            if k not in ("id", "call_id") and not (k == "status" and output.get("type") == "reasoning")}


LOGPROBS = dict(include=["message.output_text.logprobs"], top_logprobs=1)


def calls_read(output: list[dict]) -> list[dict]:
    """Output items as a stream's and a whole response share them: comparable, their calls' arguments read as
    JSON (a stream's are as the model wrote them, a response's written back), no logprobs (see below)."""
    return [{**comparable(item), **({"arguments": json.loads(item["arguments"], strict=False)}
                                    if item["type"] == "function_call" else {}),
             **({"content": [{**p, "logprobs": None} for p in item["content"]]} if item["type"] == "message" else {})}
            for item in output]


def message_logprobs(output: list[dict]) -> list[dict]:
    return [lp for item in output if item["type"] == "message" for p in item["content"] for lp in p["logprobs"]]


@pytest.mark.parametrize("reasoning", [None, "deepseek_r1"])
@pytest.mark.parametrize("choice", ["auto", "none", "required", {"type": "function", "name": "get_weather"}])
def test_a_stream_completes_with_the_whole_response(server, monkeypatch, no_blanks, choice, reasoning):
    """An output read whole, streamed (its calls through the streamed parser, as vLLM 0.32's Responses stream
    reads them) ends in response.completed with the non-streamed body's items in the same order (only their ids
    differ, and the form of their arguments' JSON); its message's logprobs are the whole one's up to the first
    call, where the message item ends. Cut short (e.g. "required" cut inside a call: all text in a response, as
    vLLM's hermes parser reads a call cut short; a call begun in a stream), both agree on the status and the
    tokens, and without calls on everything. With and without a reasoning parser (the cuts fall after the
    thought: one cut inside it is split as vLLM's parsers split it, which differs between a stream and a whole
    text)."""
    monkeypatch.setattr(server.app.state.server, "reasoning_parser", reasoning)
    body = dict(input="weather?", tools=TOOLS, tool_choice=choice, temperature=0, **LOGPROBS)
    if choice in ("auto", "none"):  # the hermes text the model writes: forced
        body["structured_outputs"] = {"choice": [(THOUGHT if reasoning else "") + FORCED]}
    else:
        body["logit_bias"] = no_blanks
    # "auto" writes until the limit whatever it is (see below): 120 tokens show it as well as 300
    most = 120 if choice == "auto" else 300
    uncut = create(server, **body, max_output_tokens=most)
    full = uncut["usage"]["output_tokens"]
    kinds = set()
    for limit in (most, full // 2, full - 8):
        whole = uncut if limit == most else create(server, **body, max_output_tokens=limit)  # greedy: the same body
        final = stream(server, **body, max_output_tokens=limit)[1]
        assert (final["status"], final["usage"]["output_tokens"]) == (whole["status"], whole["usage"]["output_tokens"])
        if choice == "none":  # the same but the logprobs of the steps that add no text (the EOS, </think>),
            # which vLLM's stream has not: the streamed ones are the whole's but those, and spell the text
            streamed, lps = message_logprobs(final["output"]), message_logprobs(whole["output"])
            assert comparable(without_logprobs(final["output"])) == comparable(without_logprobs(whole["output"]))
            rest = iter(comparable(lps))
            assert all(lp in rest for lp in comparable(streamed)), limit
            assert "".join(lp["token"] for lp in streamed) == output_text(final), limit
        elif whole["status"] == "completed":  # (here "auto" and "required" wander till max_output_tokens)
            assert calls_read(final["output"]) == calls_read(whole["output"])
            kinds.add("compared")
            streamed, lps = message_logprobs(final["output"]), message_logprobs(whole["output"])
            assert comparable(streamed) == comparable(lps[:len(streamed)])
            assert bool(streamed) == any(item["type"] == "message" for item in whole["output"])
        kinds.add(tuple(item["type"] for item in whole["output"]))
    assert "compared" in kinds or not isinstance(choice, dict), kinds
    if choice == "required":  # uncut: calls; a cut inside a (hermes) call: all text, as vLLM's parser reads it
        assert ("message",) in kinds and any(set(k) == {"function_call"} for k in kinds), kinds
    server.wait_idle()


def without_logprobs(output: list[dict]) -> list[dict]:
    return [{**i, "content": [{**p, "logprobs": None} for p in i["content"]]} if i["type"] == "message" else i
            for i in output]


def until_first_call(chunks: list[dict]) -> list[dict]:
    """A chat stream's logprobs up to its first tool-call delta's, of the deltas with content only: those a
    Responses stream's message has (its item ends where the first call's begins; as vLLM 0.32's, a step that
    adds no text, e.g. one whose tokens the parser holds, streams no logprobs)."""
    logprobs = []
    for ch in chunks:
        for c in ch["choices"]:
            if c["delta"].get("content"):
                logprobs += (c["logprobs"] or {}).get("content") or []
            if c["delta"].get("tool_calls"):
                return logprobs
    return logprobs


def test_logprobs_of_a_text_before_calls(server):
    """A message followed by function calls: the whole response's logprobs are all the output's (as vLLM's whole
    response, and chat's logprobs.content); a stream's message ends where the first call's item begins (the
    calls stream as the model writes them), with the logprobs of the text's tokens up to there (as vLLM's
    stream: not those its text held back, the tag's start)."""
    body = dict(input="weather?", tools=LOOSE_TOOLS, structured_outputs={"choice": [FORCED]}, temperature=0,
                max_output_tokens=300, **LOGPROBS)
    whole, final = create(server, **body)["output"], stream(server, **body)[1]["output"]
    assert [i["type"] for i in whole] == [i["type"] for i in final] == ["message", "function_call", "function_call"]
    chat_body = dict(messages=[{"role": "user", "content": "weather?"}], tools=LOOSE_CHAT_TOOLS, temperature=0,
                     structured_outputs={"choice": [FORCED]}, max_tokens=300, logprobs=True, top_logprobs=1)
    want = chat(server, **chat_body)
    (lps,), (streamed,) = ([part["logprobs"] for part in r[0]["content"]] for r in (whole, final))
    assert comparable(lps) == comparable(want["choices"][0]["logprobs"]["content"])
    assert comparable(streamed) == comparable(until_first_call(chat_stream(server, **chat_body)[0]))
    assert "".join(lp["token"] for lp in streamed) == TOLD and len(streamed) < len(lps)
    server.wait_idle()


ASK = [{"role": "user", "content": "weather?"}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n"],
          "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}}
NAMED = ({"type": "function", "name": "get_time"}, {"type": "function", "function": {"name": "get_time"}})
SHAPES = {  # a Responses body, and the chat body that asks the same (both greedy, logprobs added to both)
    "text": (dict(input="hello", max_output_tokens=8, ignore_eos=True),
             dict(messages=[{"role": "user", "content": "hello"}], max_tokens=8, ignore_eos=True)),
    "instructions": (dict(input=ASK, instructions="Be brief.", max_output_tokens=8),
                     dict(messages=[{"role": "system", "content": "Be brief."}, *ASK], max_tokens=8)),
    "json_schema": (dict(input=ASK, text={"format": {"type": "json_schema", "name": "n", "schema": SCHEMA}},
                         max_output_tokens=60),
                    dict(messages=ASK, response_format={"type": "json_schema", "json_schema": {"name": "n",
                                                                                             "schema": SCHEMA}},
                         max_tokens=60)),
    "auto": (dict(input=ASK, tools=LOOSE_TOOLS, structured_outputs={"choice": [FORCED]}, max_output_tokens=300),
             dict(messages=ASK, tools=LOOSE_CHAT_TOOLS, structured_outputs={"choice": [FORCED]}, max_tokens=300)),
    "none": (dict(input=ASK, tools=TOOLS, tool_choice="none", max_output_tokens=8),
             dict(messages=ASK, tools=CHAT_TOOLS, tool_choice="none", max_tokens=8)),
    "required": (dict(input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=80),  # cut in a call
                 dict(messages=ASK, tools=CHAT_TOOLS, tool_choice="required", max_tokens=80)),
    "named": (dict(input=ASK, tools=TOOLS, tool_choice=NAMED[0], max_output_tokens=80),
              dict(messages=ASK, tools=CHAT_TOOLS, tool_choice=NAMED[1], max_tokens=80)),
    "truncation": (dict(input="x " * 600, truncation="auto", max_output_tokens=5, ignore_eos=True),
                   dict(messages=[{"role": "user", "content": "x " * 600}], truncate_prompt_tokens=512 - 1,
                        max_tokens=5, ignore_eos=True)),  # max_model_len - 1 kept, max_tokens clamped to 1
}


def answer(message: dict, logprobs: list[dict]) -> dict:
    """A message's text and calls, and its logprobs where it has text (a response has none to put them on)."""
    content = message.get("content") or ""
    return {"content": content, "calls": [[n, a] for n, a in message["calls"]],
            "logprobs": comparable(logprobs) if content else []}


def responses_answer(response: dict) -> dict:
    """A response's output read as a chat message: its text, its calls, the logprobs of its text."""
    parts = [part for item in response["output"] if item["type"] == "message" for part in item["content"]]
    calls = [[c["name"], c["arguments"]] for c in response["output"] if c["type"] == "function_call"]
    return answer({"content": "".join(p["text"] for p in parts), "calls": calls},
                  [lp for p in parts for lp in p["logprobs"]])


@pytest.mark.parametrize("shape", SHAPES)
def test_the_same_answer_as_chat(server, no_blanks, shape):
    """Each request shape against the chat completion it means, for the same greedy request: the same text,
    tool calls and logprobs, token counts and finish, whole and streamed."""
    body, chat_body = SHAPES[shape]
    bias = {"logit_bias": no_blanks} if shape in ("required", "named") else {}
    body = {**body, **bias, "temperature": 0, **LOGPROBS}
    chat_body = {**chat_body, **bias, "temperature": 0, "logprobs": True, "top_logprobs": 1}
    (choice,), usage = (want := chat(server, **chat_body))["choices"], want["usage"]
    message = {**choice["message"], "calls": calls_of(choice["message"])}
    whole = create(server, **body)
    assert responses_answer(whole) == answer(message, choice["logprobs"]["content"])
    assert (whole["usage"]["input_tokens"], whole["usage"]["output_tokens"]) == (usage["prompt_tokens"],
                                                                                usage["completion_tokens"])
    assert whole["status"] == ("incomplete" if choice["finish_reason"] == "length" else "completed")
    chunks, content, calls, finish = chat_stream(server, **chat_body)
    final = stream(server, **body)[1]
    # the same streamed parser's reading: the calls' arguments as the model wrote them (vLLM 0.32's), the
    # message's logprobs up to the first call (see test_logprobs_of_a_text_before_calls)
    got, want = responses_answer(final), answer({"content": content, "calls": calls}, until_first_call(chunks))
    assert got == want and finish == choice["finish_reason"]
    assert (final["usage"]["output_tokens"], final["status"]) == (usage["completion_tokens"], whole["status"])
    if shape in ("auto", "required", "named"):
        assert got["calls"], got  # the shape makes calls
    server.wait_idle()


# =========================================================================== reasoning, logprobs

def test_a_blank_line_between_a_thought_and_calls_is_no_text_in_a_whole_answer(server, monkeypatch):
    """As vLLM 0.32's parser (benchmarks/event_seq.py): text of only whitespace beside calls (the blank line after
    a thought) is none in a whole answer: no message item, chat's content null; a stream sends it as it comes (a
    message item of it, as vLLM's Responses stream)."""
    monkeypatch.setattr(server.app.state.server, "reasoning_parser", "qwen3")
    forced = {"choice": [THOUGHT + FORCED[len(TOLD):]]}
    body = dict(input="weather?", tools=LOOSE_TOOLS, structured_outputs=forced, max_output_tokens=400)
    assert [i["type"] for i in create(server, **body)["output"]] == ["reasoning", "function_call", "function_call"]
    final = stream(server, **body)[1]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert output_text(final) == "\n\n"
    m = chat(server, messages=[{"role": "user", "content": "weather?"}], tools=LOOSE_CHAT_TOOLS,
             structured_outputs=forced, max_tokens=400)["choices"][0]["message"]
    assert m["content"] is None and len(m["tool_calls"]) == 2, m
    server.wait_idle()


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_reasoning_parser_gives_a_reasoning_item(server, monkeypatch, name):
    monkeypatch.setattr(server.app.state.server, "reasoning_parser", name)
    body = dict(input="weather?", tools=LOOSE_TOOLS, structured_outputs={"choice": [THOUGHT + FORCED]},
                max_output_tokens=400, reasoning={"effort": "low"})
    r = create(server, **body)
    assert [i["type"] for i in r["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert r["output"][0]["content"] == [{"type": "reasoning_text", "text": "\nThe user wants the weather.\n"}]
    assert output_text(r) == "\n\n" + TOLD and r["reasoning"] == {"effort": "low"}
    events, final = stream(server, **body)
    assert final["output"][0]["content"] == r["output"][0]["content"] and output_text(final) == output_text(r)
    # as vLLM 0.32's (benchmarks/event_seq.py): the SDK's null fields written, a reasoning item's content null
    # until it is done; a function call's namespace, async and caller null
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert (added[0]["content"], added[0]["encrypted_content"]) == (None, None), added[0]
    assert final["output"][0]["encrypted_content"] is None
    # a whole response's reasoning item has no status (vLLM's construct_output_items), a stream's done one does
    assert (r["output"][0]["status"], final["output"][0]["status"]) == (None, "completed")
    assert all((c["namespace"], c["async"], c["caller"]) == (None, None, None)
               for c in [*added[2:], *final["output"][2:]])
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert sum(k == "response.reasoning_text.delta" for k in kinds) > 1  # token by token
    server.wait_idle()


def test_logprobs_when_included(server):
    body = dict(input="hello", max_output_tokens=5, temperature=0, ignore_eos=True, top_logprobs=2,
                include=["message.output_text.logprobs"])
    r = create(server, **body)
    (part,) = r["output"][0]["content"]
    assert len(part["logprobs"]) == 5 and all(len(lp["top_logprobs"]) == 2 for lp in part["logprobs"])
    assert "".join(lp["token"] for lp in part["logprobs"]) == part["text"] and r["top_logprobs"] == 2
    events, final = stream(server, **body)

    def tokens(logprobs: list[dict]) -> list:  # a prefix-cache hit may change the logprobs in their last digits
        return [(lp["token"], pytest.approx(lp["logprob"], abs=1e-4)) for lp in logprobs]
    assert tokens(final["output"][0]["content"][0]["logprobs"]) == tokens(part["logprobs"])
    assert tokens([lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]) == \
        tokens(part["logprobs"])
    assert create(server, input="hello", max_output_tokens=2)["output"][0]["content"][0]["logprobs"] is None
    # as vLLM 0.32's stream (benchmarks/event_seq.py): a delta's logprobs without bytes, none on output_text.done
    assert all(set(lp) == {"token", "logprob", "top_logprobs"} and set(lp["top_logprobs"][0]) == {"token", "logprob"}
               for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"])
    assert [e["logprobs"] for e in events if e["type"] == "response.output_text.done"] == [[]]
    # an answer that ends on EOS (the grammar allows nothing else after "yes"): its last logprob has no text
    # delta to ride on, and as vLLM's stream the streamed response has not it (the whole one has)
    body = dict(input="hello", temperature=0, structured_outputs={"choice": ["yes"]},
                include=["message.output_text.logprobs"])
    whole = create(server, **body)["output"][0]["content"][0]["logprobs"]
    events, final = stream(server, **body)
    assert len(whole) > 1 and tokens(final["output"][0]["content"][0]["logprobs"]) == tokens(whole[:-1])
    server.wait_idle()


# =========================================================================== the rest of the HTTP contract

def test_request_id_metrics_auth_and_disconnect(server):
    """The other /v1 routes' wrappers: X-Request-Id, the finished-request counters, a disconnect aborting the
    engine request, the API key."""
    length, abort = (f"nanoserve:request_success_total{{finished_reason={r}}}" for r in ("length", "abort"))
    before = _metrics(server.url)
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 1, "ignore_eos": True},
                   headers={"X-Request-Id": "abc-1"})
    assert r.headers["x-request-id"] == "abc-1" and r.json()["id"] == "resp_abc-1"
    assert _metrics(server.url)[length] == before.get(length, 0) + 1
    before, before_abort = server.stats()["generation_tokens"], _metrics(server.url).get(abort, 0)
    server.delay = 0.05
    try:
        with httpx.Client() as c:
            with c.stream("POST", server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 200,
                                                                     "ignore_eos": True, "stream": True}) as r:
                next(r.iter_lines())
        server.wait_idle(timeout=5)  # aborted: its blocks are back
    finally:
        server.delay = 0.0
    assert server.stats()["generation_tokens"] - before < 200
    assert _metrics(server.url)[abort] == before_abort + 1
    with ServerThread(server.args.model, "--api-key", "s3cret") as s:
        assert httpx.post(s.url + "/v1/responses", json={"input": "hi"}).status_code == 401
        assert httpx.get(s.url + "/v1/responses/resp_1").status_code == 401


def test_no_store_as_vllm(server, client):
    """Without vLLM's store (VLLM_ENABLE_RESPONSES_API_STORE unset): store is taken and ignored, a previous
    response or a stored one is not found (404, vLLM's answer), background mode is a 400."""
    r = create(server, input="hi", store=True, max_output_tokens=1)
    err = _check_error(httpx.get(f"{server.url}/v1/responses/{r['id']}"), 404, "response_id")
    assert r["id"] in err["message"] and "VLLM_ENABLE_RESPONSES_API_STORE" in err["message"]
    _check_error(httpx.post(f"{server.url}/v1/responses/{r['id']}/cancel"), 404, "response_id")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=server.args.served_model_name[0], input="and then?",
                                previous_response_id=r["id"])
    _check_error(httpx.post(server.url + "/v1/responses", json={"input": "x", "previous_response_id": r["id"]}),
                 404, "previous_response_id")
    for store in (True, False):
        _check_error(httpx.post(server.url + "/v1/responses", json={"input": "x", "background": True,
                                                                    "store": store}), 400, "background")
    server.wait_idle()


BAD = [  # body, param, words the message must have
    ({}, "input", "input must be"),
    ({"input": []}, "input", "non-empty"),
    ({"input": 3}, "input", "input must be"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}]}, "input",
     "images"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "input[0] must be"),
    ({"input": [{"role": "user", "content": 3}]}, "input", "input[0].content"),
    # OpenAI's roles only (a "tool" message is a function_call_output item); any role was rendered
    ({"input": [{"role": "bogus", "content": "x"}]}, "input", "input[0] must be a message {role (user, assistant"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "input[0] must be"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}, "input",
     "arguments must be a JSON object"),
    # named by its place in input: it was "input[2].tool_calls[0].function.arguments", the chat message's place
    ({"instructions": "Be brief.", "input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c",
                                                                                "name": "f", "arguments": "{oops"}]},
     "input", "input[1].arguments must be a JSON object in a string, got \"{oops\""),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "", "arguments": "{}"}]}, "input",
     "input[0] must be"),  # was "messages[0].tool_calls[0].function.name ..."
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "no message"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "\"web_search\" are not supported"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools", "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 3}]}, "tools", "tools[0].parameters"),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools",
     "\"file_search\" are not supported"),
    ({"input": "x", "tools": [{"type": "custom", "name": "f"}]}, "tools", "\"custom\" are not supported"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice",
     'type "web_search_preview" is not supported'),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "required",
                                                    "tools": [{"type": "function", "name": "get_time"}]}},
     "tool_choice", 'type "allowed_tools" is not supported'),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "custom", "name": "f"}}, "tool_choice",
     'type "custom" is not supported'),
    ({"input": "x", "tool_choice": "any"}, "tool_choice", "tool_choice must be"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs tools"),  # once ignored: a text answer
    ({"input": "x", "tool_choice": {"type": "function", "name": "f"}}, "tool_choice",
     'tool_choice {"type": "function", "name": "f"} needs tools'),  # as sent, not as the chat request has it
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "not one of the tools"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text", "text.format"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text", "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nonsense"}}}}, "text",
     "text cannot be compiled"),  # not chat's "response_format.json"
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"}, "text": {"format": {
        "type": "json_object"}}}, "tool_choice", 'tool_choice {"type": "function", "name": "get_time"} constrains'),
    # what the SDK's Response type would refuse when the request is echoed back: refused here, as by vLLM
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text", "text.format"),  # no name
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {}, "strict": "yes"}}}, "text",
     "text.format"),
    ({"input": "x", "reasoning": {"effort": "bogus"}}, "reasoning", "reasoning.effort"),
    ({"input": "x", "reasoning": {"effort": 5}}, "reasoning", "reasoning.effort"),
    ({"input": "x", "include": ["everything"]}, "include", "message.output_text.logprobs"),
    ({"input": "x", "truncation": "sometimes"}, "truncation", "truncation"),
    ({"input": "x", "temperature": "hot"}, "temperature", "temperature"),
    ({"input": "x", "temperature": -1}, "temperature", "temperature"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10000}, "max_output_tokens", "max_output_tokens=10000 cannot be greater "
                                                                      "than max_model_len="),
    ({"input": "x" * 4000}, "input_tokens", "maximum context length"),
    ({"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": -2}, "top_logprobs", "top_logprobs"),
    ({"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 99}, "top_logprobs", ""),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "prompt templates"),
    ({"input": "x", "enable_response_messages": True}, "enable_response_messages", "gpt-oss"),
    ({"input": "x", "background": True}, "background", "response store"),
    ({"input": "x", "priority": 3}, "priority", "priority"),
    ({"input": "x", "seed": 2.5}, "seed", "seed"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata", "metadata"),
    ({"input": "x", "model": "gpt-5"}, "model", "does not exist"),
    ({"input": "x", "structured_outputs": {"regex": "a"}, "text": {"format": {"type": "json_object"}}}, None,
     "one structured-output constraint"),
]


@pytest.mark.parametrize("body,param,words", BAD)
def test_bad_requests_name_the_field(server, body, param, words):
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    err = _check_error(r, 404 if param == "model" else 400, param)
    assert words in err["message"], err


def test_chat_only_fields_are_ignored(server, caplog):
    """A chat field the Responses API does not have (here n) is ignored with a warning, as vLLM ignores unknown
    fields: one output, not n."""
    with caplog.at_level("WARNING", logger="nanoserve.entry"):
        r = create(server, input="hi", n=3, max_output_tokens=2, ignore_eos=True, temperature=0)
    assert r["usage"]["output_tokens"] == 2 and len(r["output"]) == 1
    assert any("does not have" in m and '"n"' in m for m in caplog.messages)
    server.wait_idle()


def test_truncation_auto_leaves_room_for_the_answer(server):
    """As vLLM 0.32's: truncation "auto" keeps the input's last max_model_len - 1 tokens, and max_output_tokens is
    clamped to the one left (reported as applied); "disabled" (the default) refuses an input too long for the
    context."""
    room = server.engine.max_model_len
    body = dict(input="x " * room, max_output_tokens=5, temperature=0, ignore_eos=True)
    assert httpx.post(server.url + "/v1/responses", json=body, timeout=60).status_code == 400
    r = create(server, **body, truncation="auto")
    assert r["usage"]["input_tokens"] == room - 1 and r["usage"]["output_tokens"] == 1, r["usage"]
    assert r["status"] == "incomplete" and r["max_output_tokens"] == 1, r
    server.wait_idle()
