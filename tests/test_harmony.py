"""gpt-oss's harmony output read as vLLM serves it (--reasoning-parser openai_gptoss, --tool-call-parser
openai): HarmonyParser on crafted texts, whole and streamed a character at a time (every marker split
across deltas); the tokenizer's harmony special tokens kept in the text a request parses; and the chat
endpoint end to end on the tiny model, its output forced by a structured-outputs choice (the random model
would never write harmony; the markers then come as plain text over several deltas, the harder case)."""
from __future__ import annotations

import json

import httpx
import pytest

from nanoserve import entry
from nanoserve.entry import HarmonyParser, parse_args
from test_server import ServerThread
from test_tools import NULLS, STRICT_TOOLS, TOOLS, chat, chat_stream, fits, parse, written

THINK = "The user asks for the weather. Use the tool."
BOTH = f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant<|channel|>final<|message|>It is sunny."
# a call as gpt-oss writes it: <|call|> is an EOS token, so not in the text (with it, the same)
CALL = (f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris", "days": 3}')
CASES = [  # text -> (reasoning, content, [(name, arguments)]) as a response reads it, ended on an EOS
    (BOTH + "<|return|>", THINK, "It is sunny.", []),
    (BOTH, THINK, "It is sunny.", []),
    ("<|channel|>final<|message|>Just this.", None, "Just this.", []),  # no analysis: all content
    (CALL, THINK, None, [("get_weather", '{"city": "Paris", "days": 3}')]),
    (CALL + "<|call|>", THINK, None, [("get_weather", '{"city": "Paris", "days": 3}')]),
    # the recipient in the header before the channel; a content type without <|constrain|>
    (' to=functions.get_time<|channel|>commentary json<|message|>{"tz": "cet"}', None, None,
     [("get_time", '{"tz": "cet"}')]),
    # a preamble (commentary, no recipient) is content; messages of a kind are joined by newlines
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
     "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_time<|message|>{"tz": "utc"}<|call|>', "a\nb", "Checking.", [("get_time", '{"tz": "utc"}')]),
    # a recipient that is no function (a built-in tool) is neither content nor a call; arguments not JSON stay text
    ('<|channel|>analysis<|message|>r<|end|><|start|>assistant to=browser.search<|channel|>analysis<|message|>'
     '{"q": 1}<|call|>', "r", None, []),
    ('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{oops', None, None, [("f", "{oops")]),
    # not harmony at all (a constraint held from the first token writes bare JSON): all content
    ('{"city": "Paris"}', None, '{"city": "Paris"}', []),
    ("", None, None, []),
]


def whole(text: str, calls: bool = True, cut: bool = False):
    reasoning, content, found = HarmonyParser(calls, whole=True).feed(text, True, cut)
    return reasoning or None, content or None, [(c["name"], c["arguments"]) for c in found]


def streamed(text: str, calls: bool = True, cut: bool = False, size: int = 1):
    parser, reasoning, content, found = HarmonyParser(calls), "", "", []
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for i, piece in enumerate(pieces):
        r, c, deltas = parser.feed(piece, i == len(pieces) - 1, cut)
        reasoning, content = reasoning + r, content + c
        for d in deltas:
            if "name" in d:
                found.append([d["name"], d["arguments"]])
            else:
                found[-1][1] += d["arguments"]
    return reasoning or None, content or None, [tuple(f) for f in found]


@pytest.mark.parametrize("text,reasoning,content,calls", CASES)
def test_harmony_parser(text, reasoning, content, calls):
    """A response's fields; a stream's deltas add up to the same (its arguments as the model wrote them),
    however the text is cut, and leak no marker; without tool calls asked for, calls are dropped."""
    assert whole(text) == (reasoning, content, calls)
    for size in (1, 3, 1000):
        r, c, found = streamed(text, size=size)
        assert (r, c) == (reasoning, content)
        assert [name for name, _ in found] == [name for name, _ in calls]
        for (_, args), (_, want) in zip(found, calls):
            assert args.replace(" ", "") == want.replace(" ", "")
    assert whole(text, calls=False) == (reasoning, content, [])
    assert streamed(text, calls=False) == (reasoning, content, [])


def test_cut_short():
    """max_tokens ends it mid-message: the reasoning so far (a marker's start held back while streaming
    comes out at the end), and a call cut short is no call (as vLLM's: only whole messages are calls)."""
    for text in ("<|channel|>analysis<|message|>Thinking about it", "<|channel|>analysis<|message|>Thinking <|en",
                 "<|channel|>analy"):
        want = text.partition("<|message|>")[2] or None
        assert whole(text, cut=True) == (want, None, []) == streamed(text, cut=True, size=2)
    text = '<|channel|>commentary to=functions.get_time<|message|>{"tz": "u'
    assert whole(text, cut=True) == (None, None, [])
    assert streamed(text, cut=True) == (None, None, [("get_time", '{"tz": "u')])  # a stream sent what came


def test_special_tokens_are_kept_for_the_parser(tiny_model, tmp_path):
    """The markers are special tokens: decoded with skip_special_tokens (the default) they vanish; a
    harmony request decodes with them kept, so the parser sees them."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model)
    markers = ["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>", "<|call|>", "<|return|>"]
    tok.add_special_tokens({"additional_special_tokens": markers})
    ids = tok.encode(BOTH + "<|return|>", add_special_tokens=False)
    assert sum(i in tok.all_special_ids for i in ids) == 7  # the markers, each one token
    assert "<|" not in tok.decode(ids, skip_special_tokens=True)
    assert whole(tok.decode(ids, skip_special_tokens=False)) == (THINK, "It is sunny.", [])


@pytest.fixture(scope="module")
def server(tiny_model):
    with ServerThread(tiny_model, "--enable-auto-tool-choice", "--tool-call-parser", "openai",
                      "--reasoning-parser", "openai_gptoss", "--max-model-len", "512") as s:
        yield s


def reasoning_stream(server, **body):
    chunks, content, calls, finish = chat_stream(server, **body)
    reasoning = "".join(ch["choices"][0]["delta"].get("reasoning_content", "") for ch in chunks)
    return reasoning, content, calls, finish


def test_chat_reads_harmony(server, monkeypatch):
    """The flags parse; analysis -> reasoning_content (and reasoning, vLLM's later name), final -> content,
    a call -> tool_calls with finish_reason tool_calls, whole and streamed; max_tokens cut mid-analysis
    gives the reasoning so far; include_reasoning false drops it. Chat requests keep the special tokens."""
    state = server.app.state.server
    skips, add_request = [], state.async_llm.add_request
    monkeypatch.setattr(state.async_llm, "add_request", lambda prompt, params, *a, **k:
                        skips.append(params.skip_special_tokens) or add_request(prompt, params, *a, **k))
    args = parse_args(["--dtype", "float32", "--enable-auto-tool-choice", "--tool-call-parser", "openai",
                       "--reasoning-parser", "openai_gptoss"])
    assert (args.tool_call_parser, args.reasoning_parser) == ("openai", "openai_gptoss")
    (choice,) = chat(server, structured_outputs={"choice": [BOTH]}, max_tokens=300)["choices"]
    assert choice["message"] == {**NULLS, "role": "assistant", "content": "It is sunny.", "reasoning_content": THINK,
                                 "reasoning": THINK} and choice["finish_reason"] == "stop"
    assert reasoning_stream(server, structured_outputs={"choice": [BOTH]}, max_tokens=300) == \
        (THINK, "It is sunny.", [], "stop")
    body = dict(tools=TOOLS, structured_outputs={"choice": [CALL]}, max_tokens=300)
    (choice,) = chat(server, **body)["choices"]
    (call,) = choice["message"]["tool_calls"]
    assert (choice["message"]["content"], choice["message"]["reasoning_content"], choice["finish_reason"]) == \
        (None, THINK, "tool_calls")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}
    reasoning, content, calls, finish = reasoning_stream(server, **body)
    assert (reasoning, content, finish) == (THINK, "", "tool_calls")
    assert [c[0] for c in calls] == ["get_weather"] and json.loads(calls[0][1]) == {"city": "Paris", "days": 3}
    # without tools the call is dropped, its reasoning stays
    (choice,) = chat(server, structured_outputs={"choice": [CALL]}, max_tokens=300)["choices"]
    assert choice["message"] == {**NULLS, "role": "assistant", "content": None, "reasoning_content": THINK,
                                 "reasoning": THINK} and choice["finish_reason"] == "stop"
    cut = len(server.engine.tokenizer.encode(BOTH.partition("<|end|>")[0], add_special_tokens=False)) - 3
    (choice,) = chat(server, structured_outputs={"choice": [BOTH]}, max_tokens=cut, temperature=0)["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert THINK.startswith(choice["message"]["reasoning_content"]) and choice["message"]["reasoning_content"]
    reasoning, content, calls, finish = reasoning_stream(server, structured_outputs={"choice": [BOTH]},
                                                         max_tokens=cut, temperature=0)  # the same tokens
    assert (reasoning, content, finish) == (choice["message"]["reasoning_content"], "", "length")
    (choice,) = chat(server, include_reasoning=False, structured_outputs={"choice": [BOTH]})["choices"]
    assert choice["message"]["reasoning_content"] is None and choice["message"]["content"] == "It is sunny."
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "structured_outputs": {"choice": [BOTH]},
                                                          "max_tokens": 300}, timeout=60)
    assert r.json()["choices"][0]["text"] == BOTH  # the completions endpoint does not parse (as vLLM's)
    assert len(skips) == 9 and not any(skips[:-1]) and skips[-1]  # the completion decodes as it asks
    server.wait_idle()


@pytest.fixture(scope="module")
def no_openings(tiny_model) -> dict[str, float]:
    """A logit_bias against "<" (but in the EOS) and every blank but a space. The harmony tag lets the output
    start with a message's <|channel|> or with a call's " to=functions.NAME", and in an analysis message a random
    model would write free text until max_tokens: the bias makes it take the call at once (the grammar alone
    writes every marker the call needs) and keeps its JSON from wandering in whitespace."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model)
    return {str(i): -100 for i in range(len(tok)) if i not in tok.all_special_ids
            and ("<" in (text := tok.decode([i])) or (not text.strip() and text != " "))}


def test_forced_and_strict_calls_take_the_harmony_tag(server, no_openings):
    """vLLM 0.32's harmony structural tag makes a random model write a harmony call: a named function's, one of
    any tool's for "required", and for "auto" where a tool is strict (without one "auto" is free, and the random
    text is content); read back as a call with arguments per the tool's schema, content "", finish_reason
    "stop" for the named function and "tool_calls" otherwise, whole and streamed."""
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(2):
        body = dict(temperature=1.0, seed=seed, max_tokens=200, logit_bias=no_openings, return_token_ids=True)
        for choice, finish in ((named, "stop"), ("required", "tool_calls"), ("auto", "tool_calls")):
            (out,) = chat(server, tools=STRICT_TOOLS, tool_choice=choice, **body)["choices"]
            text = written(server, out)
            assert text.startswith(" to=functions.") and "<|message|>" in text, text
            (call,) = out["message"]["tool_calls"]
            name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
            assert fits(name, args) and (name == "get_time" or choice != named), (choice, text)
            assert (out["message"]["content"], out["finish_reason"]) == (None if choice == "auto" else "", finish)
            _, content, calls, streamed_finish = reasoning_stream(server, tools=STRICT_TOOLS, tool_choice=choice,
                                                                  **body)
            assert (content, streamed_finish) == ("", finish)  # the same tokens: the same call, as written
            assert [(n, parse(a)) for n, a in calls] == [(name, args)]
        (out,) = chat(server, tools=TOOLS, tool_choice="auto", **body)["choices"]
        assert "tool_calls" not in out["message"] and out["message"]["content"], out
    server.wait_idle()



def test_responses_and_messages_read_harmony(server, monkeypatch):
    """The Responses API: the analysis a reasoning item, the call a function_call item; the Messages API
    (its output forced through the chat body it becomes, as test_anthropic.py does): a thinking block, then
    a tool_use block."""
    body = dict(input="weather in Paris?", structured_outputs={"choice": [CALL]}, max_output_tokens=300,
                tools=[{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
                       for t in TOOLS])
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60).json()
    assert [i["type"] for i in r["output"]] == ["reasoning", "function_call"], r
    assert r["output"][0]["content"] == [{"type": "reasoning_text", "text": THINK}]
    assert (r["output"][1]["name"], json.loads(r["output"][1]["arguments"])) == ("get_weather", {"city": "Paris",
                                                                                               "days": 3})
    chat_body = entry.AnthropicMessagesRequest.chat_body
    monkeypatch.setattr(entry.AnthropicMessagesRequest, "chat_body", lambda self, rid: {
        **chat_body(self, rid), "structured_outputs": {"choice": [CALL]}})
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    a = httpx.post(server.url + "/v1/messages", json=dict(model=server.args.served_model_name[0], max_tokens=300,
                   messages=[{"role": "user", "content": "hi"}], tools=tools), timeout=60).json()
    assert [b["type"] for b in a["content"]] == ["thinking", "tool_use"] and a["stop_reason"] == "tool_use", a
    assert a["content"][0]["thinking"] == THINK and a["content"][1]["input"] == {"city": "Paris", "days": 3}
    server.wait_idle()
