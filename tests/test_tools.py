"""Tool calling and chat-template control on the chat endpoint, as vLLM has them
(issue 25): the tool-call parsers on crafted texts; tools, tool-call history and
chat_template_kwargs reaching a real Jinja template; tool_choice "required" and a
named function enforced by the structured-outputs grammar on a tiny random model
sampling at temperature 1 (the constraint, not the model, makes every call valid);
"auto" end to end with the output forced into a call by a structured-outputs
choice (the random model would never write one); --chat-template, the request's
chat_template, continue_final_message; --reasoning-parser (the thought forced the same way) splitting
reasoning_content from the content the tool parser reads; and a 400 naming the field for each bad shape."""
from __future__ import annotations

import json
import os
import re
import shutil
import sys

import httpx
import openai
import pytest

from nanoserve import LLM, SamplingParams, entry
from nanoserve.entry import (HermesToolParser, Llama3JsonToolParser, MistralToolParser, NamedToolParser,
                            PythonicToolParser, RequiredToolParser, ToolStream, load_chat_template, parse_args)
from test_server import ServerThread, _check_error, sse_events

# Prints what a Qwen-style template prints: the tools, each past call with its arguments as JSON, tool results.
TEMPLATE = (
    '{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}'
    '({{ t.function.parameters.required | join(",") }}){% endfor %}<|im_end|>\n{% endif %}'
    '{% for m in messages %}<|im_start|>{{ m.role }}{% if m.role == "tool" %} [{{ m.tool_call_id }}]{% endif %}'
    '{{ "\\n" }}{{ m.content }}{% for tc in m.tool_calls or [] %}<tool_call>{"name": "{{ tc.function.name }}", '
    '"arguments": {{ tc.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>{{ "\\n" }}{% endfor %}'
    '{% if add_generation_prompt %}<|im_start|>assistant{{ "\\n" }}'
    '{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}')

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1,
                                                                              "maximum": 9}}}
CLOCK = {"type": "object", "additionalProperties": False, "required": ["tz"],
         "properties": {"tz": {"enum": ["utc", "cet"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
USER = [{"role": "user", "content": "weather in Paris?"}]
HISTORY = [{"role": "user", "content": "weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
RENDERED_HISTORY = ('<|im_start|>system\nTools: get_weather(city,days) get_time(tz)'
                    '<|im_end|>\n<|im_start|>user\nweather in Paris?<|im_end|>\n<|im_start|>assistant\n'
                    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'
                    '<|im_end|>\n<|im_start|>tool [call_1]\nsunny<|im_end|>\n<|im_start|>assistant\n')
SEEDS = range(4)
NULLS = dict.fromkeys(("refusal", "annotations", "audio", "function_call", "reasoning"))  # what vLLM's message has null


def parse(text: str):
    """JSON as xgrammar's grammar (and so vLLM's) defines it: control characters other than CR and
    LF may stand unescaped inside strings. A named function's arguments are the output as it is."""
    return json.loads(text, strict=False)


def same_calls(streamed: list, whole: list) -> bool:
    """A stream's calls are a response's: as vLLM 0.32's, hermes streams the arguments as the model wrote them,
    and a response has them read and written back (the same JSON, maybe other blanks)."""
    return [(n, parse(a)) for n, a in streamed] == [(n, parse(a)) for n, a in whole]


def fits(name: str, args) -> bool:
    """A hand-written check of the two parameter schemas above."""
    if name == "get_weather":
        return (isinstance(args, dict) and set(args) == {"city", "days"} and isinstance(args["city"], str)
                and len(args["city"]) <= 8 and type(args["days"]) is int and 1 <= args["days"] <= 9)
    return name == "get_time" and args in ({"tz": "utc"}, {"tz": "cet"})


# =========================================================================== parsers, on crafted texts

def parse_once(parser, text: str, final: bool = True, streamed: bool = False) -> tuple[str, list[tuple[str, str]]]:
    """As a response that is not streamed reads it: the whole text in one feed (``streamed``: as a stream's)."""
    content, deltas, made = ToolStream(parser, streamed).feed(text, final)
    assert all("id" in d for d in deltas) and made == bool(deltas)  # each call whole in its first delta
    return content, [(d["function"]["name"], d["function"]["arguments"]) for d in deltas]


def stream_by_pieces(parser, pieces: list[str]) -> tuple[str, list[tuple[str, str]], bool]:
    """Feed ``pieces`` one by one, as a stream would: the concatenated content and calls."""
    stream, content, calls, made = ToolStream(parser, streamed=True), "", [], False
    for i, piece in enumerate(pieces):
        delta, deltas, made = stream.feed(piece, i == len(pieces) - 1)
        content += delta
        for d in deltas:
            if "id" in d:  # a call's first delta names it
                assert d["index"] == len(calls) and d["type"] == "function" and d["id"].startswith("chatcmpl-tool-")
                calls.append([d["function"]["name"], d["function"].get("arguments", "")])
            else:  # ("required"'s stream says the name is null, as vLLM's)
                assert set(d) == {"index", "function"} and d["function"].get("name", None) is None
                calls[d["index"]][1] += d["function"]["arguments"]
    return content, [tuple(c) for c in calls], made


def stream_by_chars(parser, text: str) -> tuple[str, list[tuple[str, str]], bool]:
    return stream_by_pieces(parser, list(text))


DEEP = "[" * 1500 + "]" * 1500  # JSON nested deeper than Python's json can read
HERMES_CASES = [  # text -> (content, [(name, arguments)])
    ("Just text, no <tools>.", "Just text, no <tools>.", []),
    ('<tool_call>\n{"name": "get_time", "arguments": {"tz": "utc"}}\n</tool_call>', "",
     [("get_time", '{"tz": "utc"}')]),
    ('Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": "é"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "b", "arguments": {}}\n</tool_call>\n', "Sure.\n", [("a", '{"x": "é"}'), ("b", "{}")]),
    ('text <tool_call>{"name": broken}</tool_call> more', 'text <tool_call>{"name": broken}</tool_call> more', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ('ok <tool_call>{"name": "a", "arguments": {"x": 1}}', "ok ", [("a", '{"x": 1}')]),  # closed by the end
    ("cut short <tool", "cut short <tool", []),
    # as vLLM's: the content is the text before the first call, as written; text between and after calls is not
    ('Hi <tool_call>{"name": "a", "arguments": {}}</tool_call> then <tool_call>{"name": "b", "arguments": {}}'
     '</tool_call> bye', "Hi ", [("a", "{}"), ("b", "{}")]),
    # any block that is no call (no JSON, no "arguments", a call cut short) makes the whole output content
    ('Hi <tool_call>{"name": "a", "arguments": {}}</tool_call> then <tool_call>{"name": "b", "arguments": {}}'
     '</tool_call> bye <tool_call>{"name": broken}</tool_call> <tool_call>{"oops',
     'Hi <tool_call>{"name": "a", "arguments": {}}</tool_call> then <tool_call>{"name": "b", "arguments": {}}'
     '</tool_call> bye <tool_call>{"name": broken}</tool_call> <tool_call>{"oops', []),
    ('<tool_call>[1]</tool_call> <tool_call>{"name": "a", "arguments": {}}</tool_call>\n',
     '<tool_call>[1]</tool_call> <tool_call>{"name": "a", "arguments": {}}</tool_call>\n', []),
    ('<tool_call>{"name": "a"}</tool_call>', '<tool_call>{"name": "a"}</tool_call>', []),
    # arguments that must go out as UTF-8 JSON: a lone surrogate stays escaped; Infinity is no JSON, so no call
    ('<tool_call>{"name": "a", "arguments": {"c": "\\ud800é"}}</tool_call>', "", [("a", '{"c": "\\ud800\\u00e9"}')]),
    ('<tool_call>{"name": "a", "arguments": {"c": 1e999}}</tool_call>',
     '<tool_call>{"name": "a", "arguments": {"c": 1e999}}</tool_call>', []),
    # nested deeper than json's recursion: text, as any block that is no call (it was a RecursionError, a 500)
    (f'<tool_call>{{"name": "a", "arguments": {{"c": {DEEP}}}}}</tool_call>',
     f'<tool_call>{{"name": "a", "arguments": {{"c": {DEEP}}}}}</tool_call>', []),
]


def test_deep_arguments_are_no_call_whatever_the_recursion_limit():
    # json's RecursionError falls where the process's recursion limit puts it (torch.compile raises it to 2000,
    # so a server whose CPU kernels came from inductor read 1,500 levels): the bound must not depend on it
    mid = "[" * 200 + "]" * 200  # over MAX_JSON_DEPTH, under any recursion limit and Python's parser's 200
    cases = [(HermesToolParser, f'<tool_call>{{"name": "a", "arguments": {{"c": {DEEP}}}}}</tool_call>'),
             (HermesToolParser, f'<tool_call>{{"name": "a", "arguments": {{"c": {mid}}}}}</tool_call>'),
             (Llama3JsonToolParser, f'{{"name": "a", "parameters": {{"x": {mid}}}}}'),
             (MistralToolParser, f'[TOOL_CALLS] [{{"name": "a", "arguments": {{"x": {DEEP}}}}}]'),
             (PythonicToolParser, f"[f(x={'[' * 150 + ']' * 150})]")]
    limit = sys.getrecursionlimit()
    try:
        for new_limit in (limit, 5000):
            sys.setrecursionlimit(new_limit)
            for parser, text in cases:
                assert parse_once(parser(), text) == (text, []), (parser.__name__, new_limit)
    finally:
        sys.setrecursionlimit(limit)
    shallow = "[" * 100 + "]" * 100  # within the bound: a call
    assert parse_once(HermesToolParser(), f'<tool_call>{{"name": "a", "arguments": {{"c": {shallow}}}}}</tool_call>'
                      )[1] == [("a", json.dumps({"c": json.loads(shallow)}))]


def vllm_hermes_stream(pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """vLLM 0.32's streamed hermes reading (Hermes2ProToolParser.extract_tool_calls_streaming), done as it does
    it, all the text read again at each delta, written afresh here (benchmarks/tool_tags.py checks it against
    vLLM's own on random texts cut at random): the content is the text before the first <tool_call> (a tag's
    start at the end held back); each block (to </tool_call>, or the end less a partial one, stripped) whole
    where closed or a whole JSON value; its call named by the first "name": "...", once whole (no later block
    read before); its arguments the text after "arguments":, of a whole block less the "}" that ends it,
    sent where longer than what went before; where the last delta sends some of a call and the last block read
    sent no arguments, "{}" goes out after it (finalize_generation: they read as {} not sent yet)."""
    start, end = HermesToolParser.START, HermesToolParser.END
    name_re, args_re = re.compile(r'"name"\s*:\s*"([^"]+)"'), re.compile(r'"arguments"\s*:\s*')
    text, content, calls, sent = "", "", [], []

    def whole(body: str) -> bool:
        try:
            json.loads(body)
            return True
        except (ValueError, RecursionError):  # (vLLM's parser then fails the whole delta: it sends nothing)
            return False
    for piece in pieces:
        text += piece
        before = [list(c) for c in calls]
        first = text.find(start)
        content = text[:first if first >= 0 else len(text) - entry._tag_start(text, start)]
        blocks, pos = [], 0
        while (at := text.find(start, pos)) >= 0:
            close = text.find(end, at + len(start))
            body = text[at + len(start):close if close >= 0 else len(text) - entry._tag_start(text, end)].strip()
            blocks.append((body, close >= 0 or (bool(body) and whole(body))))
            if close < 0:
                break
            pos = close + len(end)
        last_sent = False  # whether the last block read sent arguments
        for i, (body, closed) in enumerate(blocks):
            if i == len(calls):
                if (m := name_re.search(body)) is None:
                    last_sent = False
                    break
                calls.append([m.group(1), ""])
                sent.append(0)
            if (m := args_re.search(body)) is not None:
                args = body[m.end():]
                args = args.rstrip()[:-1].rstrip() if closed and args.rstrip().endswith("}") else args
                if len(args) > sent[i]:
                    calls[i][1], sent[i] = calls[i][1] + args[sent[i]:], len(args)
            last_sent = sent[i] > 0
    changed = [i for i, c in enumerate(calls) if i >= len(before) or c != before[i]]
    if changed and not last_sent:
        calls[changed[-1]][1] += "{}"
    return content, [tuple(c) for c in calls]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_parser(text, content, calls):
    """A response as vLLM's reads it whole; a stream as vLLM 0.32's streamed parser reads it, a character at a
    time: no text after the first <tool_call>, a call named as soon as its name is whole, its arguments as
    written (a response's are read and written back)."""
    assert parse_once(HermesToolParser(), text) == (content, calls)
    assert stream_by_chars(HermesToolParser(), text) == (*vllm_hermes_stream(list(text)),
                                                         bool(vllm_hermes_stream(list(text))[1]))


def test_hermes_stream_reads_as_vllm_0_32s():
    """The stream: a call cut short is named before its arguments are whole; the arguments go out as written,
    as they come; a block that is no call stops the content and, closed with no name, the reading of every
    later block; a tag's start at the end never goes out. A response reads those as vLLM's whole parser."""
    cut = 'Hi <tool_call>\n{"name": "get", "arguments": {"x": [1, '
    assert parse_once(HermesToolParser(), cut) == (cut, [])
    assert stream_by_chars(HermesToolParser(), cut) == ("Hi ", [("get", '{"x": [1,')], True)
    spaced = '<tool_call>{"name":"a","arguments" :{"x":1} }\n</tool_call>'
    assert parse_once(HermesToolParser(), spaced) == ("", [("a", '{"x": 1}')])
    assert stream_by_chars(HermesToolParser(), spaced) == ("", [("a", '{"x":1}')], True)
    stream, deltas = ToolStream(HermesToolParser(), streamed=True), 0
    for ch in spaced:
        deltas += len(stream.feed(ch, False)[1])
    assert deltas == len('{"x":1}') + 1  # the name, then each character of the arguments
    whole = '<tool_call>{"name": "a", "arguments": "x"}'  # any JSON value is arguments, as vLLM's parsers
    assert parse_once(HermesToolParser(), whole) == ("", [("a", '"x"')])
    assert stream_by_chars(HermesToolParser(), whole) == ("", [("a", '"x"')], True)
    nameless = '<tool_call>[1]</tool_call>text<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    assert parse_once(HermesToolParser(), nameless) == (nameless, [])
    assert stream_by_chars(HermesToolParser(), nameless) == ("", [], False)
    assert stream_by_chars(HermesToolParser(), "cut short <tool") == ("cut short ", [], False)
    # the last delta names a call that sent no arguments: "{}" goes out with it (vLLM's finalize_generation)
    assert stream_by_pieces(HermesToolParser(), ['<tool_call>{"na', 'me": "a"}</tool_call>']) == ("", [("a", "{}")],
                                                                                                   True)
    assert stream_by_pieces(HermesToolParser(), ['<tool_call>{"name": "a"', '}</tool_call>']) == ("", [("a", "")],
                                                                                                   True)
    assert stream_by_pieces(HermesToolParser(), ['<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
                                                 '<tool_call>{"na', 'me": "b"'])[1] == [("a", '{"x": 1}'), ("b", "{}")]


def test_hermes_holds_back_only_what_may_be_a_call():
    assert parse_once(HermesToolParser(), "Hello <tool_c", final=False) == ("Hello ", [])      # maybe a tag: wait
    assert parse_once(HermesToolParser(), 'Hi <tool_call>{"name": "a"', final=False) == ("Hi ", [])  # open: wait
    assert parse_once(HermesToolParser(), "Hello <b>", final=False) == ("Hello <b>", [])      # not a tag: send


@pytest.mark.parametrize("text,content,calls", [  # what vLLM 0.32's llama3_json parser reads in each (its peer, run)
    ('{"name": "f", "parameters": {"a": 1}}', "", [("f", '{"a": 1}')]),
    ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}', "",
     [("a", '{"x": 1}'), ("b", "{}")]),
    # the text around and between the calls dropped ("auto" as a forced call)
    ('Here: {"name": "a", "parameters": {}}', "", [("a", "{}")]),
    ('{"name": "f", "parameters": {"a": 1}} junk {"name": "g", "parameters": {"b": 2}} tail', "",
     [("f", '{"a": 1}'), ("g", '{"b": 2}')]),
    ('{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": [{"b": "é"}]}', "",
     [("f", '{"a": 1}'), ("g", '[{"b": "é"}]')]),
    # a "{" right where an object ended is skipped: two calls back to back read as none (the second's arguments
    # are an object without a name), or as the first alone (arguments that hold no "{")
    ('{"name": "f", "parameters": {"a": 1}}{"name": "g", "parameters": {"b": 2}}',
     '{"name": "f", "parameters": {"a": 1}}{"name": "g", "parameters": {"b": 2}}', []),
    ('{"name": "f", "parameters": {"a": 1}}{"name": "g", "parameters": 3}', "", [("f", '{"a": 1}')]),
    # an object that is no call, a "{" that starts no JSON, a call cut short: all of it is content
    ('{"name": "f", "parameters": {"a": 1}} {}', '{"name": "f", "parameters": {"a": 1}} {}', []),
    ('{"name": "f", "parameters": {"a": 1}} {oops', '{"name": "f", "parameters": {"a": 1}} {oops', []),
    ('{"name": "f", "parameters": {"a": 1}', '{"name": "f", "parameters": {"a": 1}', []),
    ('{"name": "f"}', '{"name": "f"}', []),
    ('{"name": 3, "parameters": {}}', '{"name": 3, "parameters": {}}', []),
    ("It is sunny.", "It is sunny.", []),
    (f'{{"name": "a", "parameters": {{"x": {DEEP}}}}}', f'{{"name": "a", "parameters": {{"x": {DEEP}}}}}', []),
])
def test_llama3_json_parser(text, content, calls):
    """A response (of "auto" or a forced call) read as vLLM 0.32 reads it; a stream that is not a chat's (the
    Responses and Messages APIs) reads the same, its text held to the end (a "{" may yet take it out)."""
    assert parse_once(Llama3JsonToolParser(), text) == (content, calls)
    stream = ToolStream(Llama3JsonToolParser())
    assert stream.feed(text[:5], False) == ("", [], False)
    last, deltas, _ = stream.feed(text[5:], True)
    assert (last, [(d["function"]["name"], d["function"]["arguments"]) for d in deltas]) == (content, calls)


def llama_chunks(pieces: list[str], parser=Llama3JsonToolParser) -> list[list]:
    """A llama3_json chat stream's chunks for these deltas: [content, [tool-call deltas, the id as whether
    there is one]] for each delta that sends something."""
    stream, out = ToolStream(parser(), streamed=True), []
    for i, piece in enumerate(pieces):
        content, deltas, _ = stream.feed(piece, i == len(pieces) - 1)
        for d in deltas:
            assert d.get("type", "function") == "function" and d.get("id", "chatcmpl-tool-").startswith("chatcmpl-tool-")
        if content or deltas:
            out.append([content, [{"index": d["index"], "id": "id" in d, **d["function"]} for d in deltas]])
    return out


def named(index: int, name: str, **more) -> dict:
    return {"index": index, "id": True, "name": name, **more}


def args(index: int, text: str) -> dict:
    return {"index": index, "id": False, "arguments": text}


def test_llama3_json_chat_stream_is_vllm_0_32s():
    """A chat stream's chunks, a character a delta, as vLLM 0.32's (its peer, run: benchmarks/tool_tags.py checks
    thousands more): the name alone once whole, then the arguments, written afresh, as far as two deltas read
    them alike, the rest once the call is whole, then an empty delta of them at each delta after it; a call with
    no arguments never sends them; text first makes it all content; text after a call ends the reading."""
    assert llama_chunks(list('{"name": "get_time", "parameters": {"tz": "utc"}}')) == [
        ["", [named(0, "get_time")]], ["", [args(0, '{"tz": "')]], ["", [args(0, "u")]], ["", [args(0, "t")]],
        ["", [args(0, 'c"}')]]]
    assert llama_chunks(list('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}')) == [
        ["", [named(0, "a")]], ["", [args(0, '{"x": 1}')]], *[["", [args(0, "")]]] * 3, ["", [named(1, "b")]]]
    assert llama_chunks(list('{"name": "f", "parameters": {}}')) == [["", [named(0, "f")]]]
    text = 'Sure: {"name": "f", "parameters": {}}'
    assert llama_chunks(list(text)) == [[ch, []] for ch in text]
    assert llama_chunks(list('{"name": "a", "parameters": {"x": 1}} then {"name": "b", "parameters": {}}')) == [
        ["", [named(0, "a")]], ["", [args(0, '{"x": 1}')]], *[["", [args(0, "")]]] * 2]
    # the last delta sends what the call's arguments still lack, here beside its name
    assert llama_chunks(['{"name": "a", "param', 'eters": {"x": [1, 2]}}']) == [
        ["", [named(0, "a", arguments='{"x": [1, 2]}')]]]


def test_llama3_json_chat_stream_with_brackets_that_do_not_match_sends_vllm_0_32s():
    """Where a call's brackets do not match, partial_json_parser fails by an assertion (or an empty stack's pop):
    as vLLM 0.32's (its peer, run), the stream sends nothing more from there, and raises nothing."""
    assert llama_chunks(list('{"name": "a", "parameters": {"x": 1]}')) == [["", [named(0, "a")]]]
    assert llama_chunks(list('{"name": "a", "parameters": {"x": [1}}')) == [
        ["", [named(0, "a")]], ["", [args(0, '{"x": [')]]]


def test_a_streamed_call_whose_json_escapes_a_lone_surrogate_goes_out_escaped():
    """The model may write "\\ud800" inside a call's JSON: read, it is a lone surrogate, which UTF-8 cannot
    carry, so the events holding it go out in ASCII escapes (once, a stream died mid-call on the encode)."""
    text = '{"name": "f", "parameters": {"a": "x\\ud800y"}}'
    stream, events = ToolStream(Llama3JsonToolParser(), streamed=True), []
    for i in range(0, len(text), 5):
        _, deltas, _ = stream.feed(text[i:i + 5], i + 5 >= len(text))
        events += [entry.sse({"tool_calls": [d]}).encode() for d in deltas]
    sent = "".join(json.loads(e[len(b"data: "):])["tool_calls"][0]["function"].get("arguments", "") for e in events)
    assert json.loads(sent) == {"a": "x\ud800y"}
    assert entry.json_response({"a": "\ud800", "b": "é"}).body == b'{"a":"\\ud800","b":"\\u00e9"}'


class UnkeptLlama3JsonToolParser(Llama3JsonToolParser):
    KEEP_WHOLE = False  # all the calls' text read again at each delta, as vLLM's does


@pytest.mark.parametrize("text,content,calls", [
    ('[get_weather(city="Paris", days=3), f()]', "", [("get_weather", '{"city": "Paris", "days": 3}'), ("f", "{}")]),
    ("  <|python_start|>[g(x=[1, {'k': None}], y=True, s='é')]<|python_end|>", "",
     [("g", '{"x": [1, {"k": null}], "y": true, "s": "é"}')]),
    ("[f(x=-1.5, t=(1, 2))]\n", "", [("f", '{"x": -1.5, "t": [1, 2]}')]),
    ("It is sunny.", "It is sunny.", []),
    ("<|python_start|> plain words", "<|python_start|> plain words", []),
    ("[1, 2]", "[1, 2]", []),                             # a list, not of calls
    ("[]", "[]", []),
    ("[f(x=y)]", "[f(x=y)]", []),                         # a name, not a literal
    ("[f(1)]", "[f(1)]", []),                             # positional
    ("[f(**kw)]", "[f(**kw)]", []),
    ("[a.b(x=1)]", "[a.b(x=1)]", []),                     # not a plain name
    ("[f(x={1, 2})]", "[f(x={1, 2})]", []),               # a set is no JSON
    ("[f(x=1e999)]", "[f(x=1e999)]", []),                 # nor is infinity
    ("[f(x=1)] and more", "[f(x=1)] and more", []),
    ('[f(x="cut', '[f(x="cut', []),
])
def test_pythonic_parser(text, content, calls):
    assert parse_once(PythonicToolParser(), text) == (content, calls)
    assert stream_by_chars(PythonicToolParser(), text)[:2] == (content, calls)


@pytest.mark.parametrize("text,content,calls", [
    ('Sure. [TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "utc"}}, {"name": "f"}]', "Sure. ",
     [("get_time", '{"tz": "utc"}'), ("f", "{}")]),
    ('[TOOL_CALLS][{"name": "a", "arguments": {"x": "é"}}]</s> junk', "", [("a", '{"x": "é"}')]),  # as vLLM's
    ('[TOOL_CALLS]get_time{"tz": "cet"}[TOOL_CALLS]f[ARGS]{}', "", [("get_time", '{"tz": "cet"}'), ("f", "{}")]),
    ("No call [TOOL here.", "No call [TOOL here.", []),
    ('Hi [TOOL_CALLS] [{"name": "a", "argu', 'Hi [TOOL_CALLS] [{"name": "a", "argu', []),  # cut short
    ('[TOOL_CALLS] [{"arguments": {}}]', '[TOOL_CALLS] [{"arguments": {}}]', []),       # no name
    ("[TOOL_CALLS] []", "[TOOL_CALLS] []", []),
    ('x [TOOL_CALLS]f{"a": 1} and more', 'x [TOOL_CALLS]f{"a": 1} and more', []),
    ("[TOOL_CALLS]{}", "[TOOL_CALLS]{}", []),                                          # no name
    ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
    (f'[TOOL_CALLS] [{{"name": "a", "arguments": {DEEP}}}]', f'[TOOL_CALLS] [{{"name": "a", "arguments": {DEEP}}}]', []),
    (f'[TOOL_CALLS]f{{"a": {DEEP}}}', f'[TOOL_CALLS]f{{"a": {DEEP}}}', []),
])
def test_mistral_parser(text, content, calls):
    assert parse_once(MistralToolParser(), text) == (content, calls)
    assert stream_by_chars(MistralToolParser(), text)[:2] == (content, calls)
    assert parse_once(MistralToolParser(), "Hello [TOOL", final=False) == ("Hello ", [])  # maybe the tag: wait


def test_required_and_named_parsers_stream_as_they_parse():
    text = '[{"name": "get_time", "parameters": {"tz": "utc"}}, {"name": "a", "parameters": {}}]'
    assert parse_once(RequiredToolParser(), text) == ("", [("get_time", '{"tz": "utc"}'), ("a", "{}")])
    assert len(parse_once(RequiredToolParser(), text[:60], final=False)[1]) == 1  # the first call is out already
    assert stream_by_chars(RequiredToolParser(), text)[1] == [("get_time", '{"tz": "utc"}'), ("a", "{}")]
    # a chat stream, as vLLM 0.32's (its peer, run): a call once its name is whole and its arguments begun, with
    # them so far, then the rest as written (each delta's arguments with a null name)
    stream = ToolStream(RequiredToolParser(), streamed=True)
    assert [[{k: v for k, v in d.items() if k != "id"} for d in stream.feed(piece, False)[1]] for piece in
            ['[{"name": "get_time", "param', 'eters": {"tz"', ': "utc"}}, {"name": "a", "parameters": {}}]']] == [
        [], [{"index": 0, "type": "function", "function": {"name": "get_time", "arguments": '{"tz"'}}],
        [{"index": 0, "function": {"name": None, "arguments": ': "utc"}'}},
         {"index": 1, "type": "function", "function": {"name": "a", "arguments": "{}"}}]]
    # brackets, braces and escaped quotes inside strings do not end a call (a stream's arguments are as written)
    tricky = r'[{"name": "f", "parameters": {"s": "}]\\\"{["}}]'
    assert parse_once(RequiredToolParser(), tricky)[1] == [("f", json.dumps({"s": '}]\\"{['}))]
    assert stream_by_chars(RequiredToolParser(), tricky)[1] == [("f", r'{"s": "}]\\\"{["}')]
    # cut short (max_tokens): what the calls do not account for is content, as the model wrote it; a chat stream
    # sends none, as vLLM's
    assert parse_once(RequiredToolParser(), text[:60])[0] == '{"name":'
    assert parse_once(RequiredToolParser(), text[:30]) == (text[:30], [])
    assert stream_by_chars(RequiredToolParser(), text[:60])[:2] == ("", [("get_time", '{"tz": "utc"}')])
    # a named function: the whole output is its arguments, streamed as it comes (one delta a character here)
    assert stream_by_chars(NamedToolParser("f"), '{"x": 1}')[1] == [("f", '{"x": 1}')]
    assert parse_once(NamedToolParser("f"), "", final=False) == ("", [])
    assert parse_once(NamedToolParser("f"), "") == ("", [("f", "")])
    # a chat stream, as vLLM 0.32's: a delta for each step, one that added no text (part of a character) too
    stream = ToolStream(NamedToolParser("f"), streamed=True)
    assert [[{k: v for k, v in d.items() if k != "id"} for d in stream.feed(piece, False)[1]]
            for piece in ["", '{"x"', "", ": 1}"]] == [
        [{"index": 0, "type": "function", "function": {"name": "f", "arguments": ""}}],
        [{"index": 0, "function": {"arguments": '{"x"'}}], [{"index": 0, "function": {"arguments": ""}}],
        [{"index": 0, "function": {"arguments": ": 1}"}}]]


PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "pythonic": PythonicToolParser,
           "mistral": MistralToolParser, "required": RequiredToolParser, "named": lambda: NamedToolParser("f")}


def test_a_stream_adds_up_to_the_response_however_it_is_cut():
    """The deltas of any cut of the text into pieces add up to what one feed of a stream gives (the response
    that is not streamed), for texts built from tags, calls, brackets, escapes and their fragments; hermes'
    add up to what vLLM 0.32's streamed parser sends for those pieces (which a cut may change: a block's
    closing "}" is sent where a delta ends while its JSON is not whole); llama3_json's chunks are those of a
    reading of all the text again at each delta, as vLLM's."""
    from hypothesis import given, settings, strategies as st

    frags = ["<tool_call>", "</tool_call>", "<tool", "_call>", '{"name": "a", "arguments": {"x": [1]}}',
             '{"name": "b", "parameters": {}}', '{"name": "c", "arguments": {"s": "}]\\"{"}}', "<|python_tag|>",
             "[", "]", "{", "}", '"', "\\", ",", ";", " ", "\n", "x", "é", "<", "<|python_start|>", "<|python_end|>",
             "f(x=1)", "g(s='}]\\'')", "(", ")", "=", "[TOOL_CALLS]", "[TOOL", "[ARGS]", "f{}", "g"]

    @settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "300")), deadline=None)
    @given(st.lists(st.sampled_from(frags), max_size=12), st.lists(st.integers(0, 200), max_size=12),
           st.sampled_from(sorted(PARSERS)))
    def check(parts, cuts, name):
        text = "".join(parts)
        cuts = sorted({c for c in cuts if c <= len(text)})
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        if name == "hermes":  # vLLM 0.32's stream reads each delta as it comes, not as the whole text
            assert stream_by_pieces(PARSERS[name](), pieces)[:2] == vllm_hermes_stream(pieces)
            return
        if name == "llama3_json":
            assert llama_chunks(pieces) == llama_chunks(pieces, UnkeptLlama3JsonToolParser)
            return
        content, calls = parse_once(PARSERS[name](), text, streamed=True)
        if name != "required":  # (whose chat stream sends the arguments as written, a response's JSON afresh)
            assert parse_once(PARSERS[name](), text) == (content, calls)
        assert stream_by_pieces(PARSERS[name](), pieces)[:2] == (content, calls)
    check()


def test_reading_a_stream_is_linear_in_its_text(monkeypatch):
    """A feed looks at its own text (and a tag's length before it), and a call's JSON is read once, when it is
    whole: the work of reading N calls fed a few characters at a time grows as the text does. (Re-reading the
    whole text every token was quadratic: 400 hermes calls held the server's one loop thread for seconds.)
    Work is counted, not timed: the lines of entry.py that run, and the characters the JSON decoder reads."""
    decoded = [0]
    raw_decode = json.JSONDecoder.raw_decode

    def counting(self, s, idx=0):
        try:
            value, end = raw_decode(self, s, idx)
        except json.JSONDecodeError as e:
            decoded[0] += e.pos - idx + 1
            raise
        decoded[0] += end - idx
        return value, end
    monkeypatch.setattr(json.JSONDecoder, "raw_decode", counting)

    def work(name: str, n: int) -> tuple[float, float]:
        """(lines run, characters decoded), each per character of a text of ``n`` calls."""
        call = '{"name": "get_weather", "%s": {"city": "Paris \\"%d\\"", "days": [3, {"x": "}"}]}}'
        text = {"hermes": "Sure.\n" + "".join(f"<tool_call>\n{call % ('arguments', i)}\n</tool_call>\n"
                                              for i in range(n)),
                "required": "[" + ", ".join(call % ("parameters", i) for i in range(n)) + "]",
                "llama3_json": "; ".join(call % ("parameters", i) for i in range(n)),
                "pythonic": "[" + ", ".join(f"get_weather(city='Paris \\'{i}\\'', days=[3, {{'x': '}}'}}])"
                                            for i in range(n)) + "]",
                "mistral": "Sure. [TOOL_CALLS][" + ", ".join(call % ("arguments", i) for i in range(n)) + "]",
                "named": "[" + ", ".join(call % ("parameters", i) for i in range(n)) + "]"}[name]
        lines, decoded[0] = 0, 0

        def trace(frame, event, arg):  # count the lines run in entry.py's frames only
            def line(frame, event, arg):
                nonlocal lines
                lines += event == "line"
                return line
            return line if frame.f_code.co_filename == entry.__file__ else None
        old = sys.gettrace()
        sys.settrace(trace)
        try:
            content, calls, _ = stream_by_pieces(PARSERS[name](), [text[i:i + 3] for i in range(0, len(text), 3)])
        finally:
            sys.settrace(old)
        assert len(calls) == (1 if name == "named" else n)
        return lines / len(text), decoded[0] / len(text)

    for name in PARSERS:
        (lines_small, decoded_small), (lines_big, decoded_big) = work(name, 20), work(name, 400)
        assert lines_big < 1.25 * lines_small, (name, lines_small, lines_big)  # quadratic: ~20x
        if name == "llama3_json":  # its chat stream reads the call being written again at each delta, as vLLM's
            # (whose chunks depend on that reading): its work per character grows with a call's length, not the
            # output's
            assert decoded_big < 1.25 * decoded_small, (name, decoded_small, decoded_big)
            continue
        assert decoded_big <= 2.5 and decoded_small <= 2.5, (name, decoded_small, decoded_big)


# =========================================================================== offline: LLM.chat

@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model), dtype="float32", num_kv_blocks=64, max_model_len=256)


def test_llm_chat_gives_templates_a_null_content_as_empty_text(llm, monkeypatch):
    """As vLLM and the server do: transformers 5.17 would render a None as "None" (later ones make it "")."""
    tok, given = llm.engine.tokenizer, []
    render = tok.apply_chat_template
    monkeypatch.setattr(tok, "apply_chat_template", lambda messages, **kw: given.append(messages) or render(messages, **kw))
    messages = [USER[0], {"role": "assistant", "content": None}, USER[0]]
    out = llm.chat(messages, SamplingParams(max_tokens=1), chat_template="{% for m in messages %}[{{ m.content }}]"
                   "{% endfor %}", use_tqdm=False)
    assert [m["content"] for m in given[0]] == ["weather in Paris?", "", "weather in Paris?"]
    assert out[0].prompt == "[weather in Paris?][][weather in Paris?]"


def test_llm_chat_renders_tools_history_and_template_kwargs(llm):
    p = SamplingParams(max_tokens=2)
    out = llm.chat(HISTORY, p, chat_template=TEMPLATE, tools=TOOLS, use_tqdm=False)
    assert out[0].prompt == RENDERED_HISTORY
    thinking_off = llm.chat(USER, p, chat_template=TEMPLATE, chat_template_kwargs={"enable_thinking": False},
                            use_tqdm=False)
    assert thinking_off[0].prompt.endswith("<|im_start|>assistant\n<think></think>")
    no_prompt = llm.chat(USER, p, chat_template=TEMPLATE, add_generation_prompt=False, use_tqdm=False)
    assert no_prompt[0].prompt == "<|im_start|>user\nweather in Paris?<|im_end|>\n"
    # continue_final_message: the last (assistant) message stays open, with no generation prompt after it
    prefill = USER + [{"role": "assistant", "content": "It is"}]
    cont = llm.chat(prefill, p, chat_template=TEMPLATE, continue_final_message=True, use_tqdm=False)
    assert cont[0].prompt == "<|im_start|>user\nweather in Paris?<|im_end|>\n<|im_start|>assistant\nIt is"
    with pytest.raises(ValueError, match=r"Cannot set both `continue_final_message` and `add_generation_prompt` to "
                                         r"True\."):
        llm.chat(prefill, p, continue_final_message=True, add_generation_prompt=True, use_tqdm=False)
    with pytest.raises(ValueError, match="chat_template_kwargs cannot set tokenize"):
        llm.chat(USER, p, chat_template_kwargs={"tokenize": True}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^messages\[1\].tool_calls\[0\].function.arguments must be"):
        bad = [HISTORY[0], {**HISTORY[1], "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]
        llm.chat(bad, p, chat_template=TEMPLATE, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


# =========================================================================== the server

@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("templates") / "tools.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(tiny_model, template_file):
    """The tiny model with the tool template, auto tool choice (hermes), and request templates allowed."""
    with ServerThread(tiny_model, "--chat-template", str(template_file), "--enable-auto-tool-choice",
                      "--tool-call-parser", "hermes", "--trust-request-chat-template", "--max-model-len", "512") as s:
        yield s


@pytest.fixture(scope="module")
def bare_server(tiny_model, tmp_path_factory):
    """No flags, and a tokenizer without a chat template."""
    bare = tmp_path_factory.mktemp("bare") / "no-template"
    shutil.copytree(tiny_model, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    with ServerThread(bare) as s:
        yield s


def chat(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def chat_stream(server, **body) -> tuple[list[dict], str, list[list[str]], str]:
    """The chunks, the content and the calls their deltas add up to, and the finish reason."""
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER, "stream": True, **body}, timeout=60)
    assert r.status_code == 200, r.text
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    content, calls, finish = "", [], None
    for ch in chunks:
        (choice,) = ch["choices"]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for d in delta.get("tool_calls", []):
            if "id" in d:
                assert d["index"] == len(calls) and d["type"] == "function"
                calls.append([d["function"]["name"], d["function"].get("arguments", "")])
            else:
                calls[d["index"]][1] += d["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return chunks, content, calls, finish


def calls_of(message: dict) -> list[list[str]]:
    calls = message.get("tool_calls") or []
    for c in calls:
        assert set(c) == {"id", "type", "function"} and c["type"] == "function"
        assert c["id"].startswith("chatcmpl-tool-") and isinstance(c["function"]["arguments"], str)
    return [[c["function"]["name"], c["function"]["arguments"]] for c in calls]


def render(server, **body) -> str:
    """The prompt the server renders for ``body`` (its /tokenize, then /detokenize)."""
    r = httpx.post(server.url + "/tokenize", json={"messages": USER, **body})
    assert r.status_code == 200, r.text
    return httpx.post(server.url + "/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]


def test_history_tools_and_kwargs_reach_the_server_template(server):
    assert render(server, messages=HISTORY, tools=TOOLS) == RENDERED_HISTORY
    assert render(server, chat_template_kwargs={"enable_thinking": False}).endswith("assistant\n<think></think>")
    prefill = USER + [{"role": "assistant", "content": "It is"}]
    assert render(server, messages=prefill, continue_final_message=True).endswith("<|im_start|>assistant\nIt is")
    assert render(server, add_generation_prompt=False).endswith("weather in Paris?<|im_end|>\n")
    assert render(server, chat_template="{% for m in messages %}[{{ m.content }}]{% endfor %}") == \
        "[weather in Paris?]"
    # the chat endpoint renders the same prompt: its usage counts those tokens
    n = httpx.post(server.url + "/tokenize", json={"messages": HISTORY, "tools": TOOLS}).json()["count"]
    body = chat(server, messages=HISTORY, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert body["usage"]["prompt_tokens"] == n


@pytest.fixture(scope="module")
def no_blanks(tiny_model) -> dict[str, float]:
    """A logit_bias against the whitespace tokens: the grammar allows free whitespace in JSON (as vLLM's
    does), where a random model could wander until max_tokens; the bias, not the grammar, keeps it out."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model)
    return {str(i): -100 for i in range(len(tok)) if not tok.decode([i]).strip()}


@pytest.fixture(scope="module")
def strict_json(tiny_model, no_blanks) -> dict[str, float]:
    """no_blanks, and a bias against control characters, which xgrammar's JSON lets stand in strings: such
    JSON is not strict, so vLLM 0.32's hermes stream (and nanoserve's) never sees a call's JSON whole and
    sends the "}" that closes it in the arguments, and its llama3_json stream stops reading the call there; a
    test that reads those streams' arguments as JSON."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model)
    return {**no_blanks, **{str(i): -100 for i in range(len(tok))
                            if any(ord(c) < 32 or ord(c) == 127 for c in tok.decode([i]))}}


STRICT_TOOLS = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]  # arguments per the schema
STREAMS_READ = ("hermes", "llama3_json", "json")  # formats whose chat stream sends the calls' JSON as vLLM's does
# (hermes and "json" as written, which a test reads as strict JSON; llama3_json as read by vLLM's strict JSON)


@pytest.fixture(params=["hermes", "json", "mistral", "llama3_json"])
def call_format(request, server, monkeypatch):
    """The format a forced call takes: the hermes parser's own (vLLM 0.32's), with VLLM_ENFORCE_STRICT_TOOL_CALLING
    off vLLM's JSON form (as without a parser), the mistral parser's list of {"name", "arguments"}, or the
    llama3_json parser's {"name", "parameters"} (xgrammar's builtin llama tag)."""
    monkeypatch.setattr(server.app.state.server, "strict_tool_calling", request.param != "json")
    if request.param in ("mistral", "llama3_json"):
        monkeypatch.setattr(server.app.state.server, "tool_parser", request.param)
    return request.param


def written(server, choice: dict) -> str:
    """The text the model wrote (its token ids detokenized), before any parser read it."""
    return httpx.post(server.url + "/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"]


def check_written(server, choice: dict, call_format: str, calls: list, first_only: bool = False) -> None:
    """The output is in the format asked for, and reads back (hermes: with its own parser) as ``calls`` (the
    first of them with ``first_only``: parallel_tool_calls false, which mistral's list does not bound)."""
    text = written(server, choice)
    if call_format == "hermes":
        assert text.startswith("<tool_call>"), text
        assert [list(c) for c in parse_once(HermesToolParser(), text)[1]] == calls
    elif call_format == "llama3_json":
        assert text.startswith('{"name": "') and '"parameters": ' in text, text
        assert [list(c) for c in parse_once(Llama3JsonToolParser(), text)[1]] == calls
    elif call_format == "mistral":
        assert text.startswith("[{") and '"parameters"' not in text and '"arguments"' in text, text  # its key
        assert [list(c) for c in parse_once(RequiredToolParser(), text)[1]][:1 if first_only else None] == calls
    else:
        assert text[:1] in ("[", "{"), text  # vLLM's JSON form: a list of calls, or a named call's arguments


@pytest.mark.parametrize("stream", [False, True])
def test_required_makes_valid_calls(server, no_blanks, strict_json, call_format, stream):
    """One call with parallel_tool_calls false (the grammar stops after it: vLLM's stop_after_first, or the
    JSON list's maxItems 1; mistral's list is not bounded, and the first call is kept), the same streamed;
    without it, n=2 choices of one or more calls each."""
    for seed in SEEDS:
        body = dict(tools=STRICT_TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_tokens=200,
                    logit_bias=strict_json if call_format in STREAMS_READ else no_blanks, parallel_tool_calls=False)
        if stream:
            _, content, calls, finish = chat_stream(server, **body)
            assert content == ""
        else:
            (choice,) = chat(server, **body, return_token_ids=True)["choices"]
            calls, finish = calls_of(choice["message"]), choice["finish_reason"]
            check_written(server, choice, call_format, calls, first_only=True)
            assert choice["message"]["content"] == ""  # vLLM 0.32's, with any parser
            assert same_calls(chat_stream(server, **body)[2], calls)  # the same seed streamed: the same call
        assert finish in ("tool_calls", "length" if call_format == "mistral" else None) and len(calls) == 1, \
            (finish, calls)  # (mistral's list may run on to max_tokens)
        assert all(fits(name, json.loads(args)) for name, args in calls), calls  # re-encoded: strict JSON
    if stream:
        return
    body = dict(tools=STRICT_TOOLS, tool_choice="required", temperature=1.0, seed=0, max_tokens=120,
                logit_bias=no_blanks, n=2, return_token_ids=True)
    for choice in chat(server, **body)["choices"]:
        calls = calls_of(choice["message"])
        assert choice["finish_reason"] in ("tool_calls", "length")  # more calls may follow until max_tokens
        check_written(server, choice, call_format, calls)
        if call_format == "hermes" and choice["finish_reason"] == "length" and not calls:  # as vLLM reads it,
            assert choice["message"]["content"] == written(server, choice)  # a call cut short: all content
            continue
        assert calls and all(fits(name, json.loads(args)) for name, args in calls), calls


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_function_makes_a_valid_call(server, no_blanks, strict_json, call_format, name):
    named = {"type": "function", "function": {"name": name}}
    for seed in SEEDS:
        body = dict(tools=STRICT_TOOLS, tool_choice=named, temperature=1.0, seed=seed, max_tokens=200,
                    logit_bias=strict_json if call_format in STREAMS_READ else no_blanks)
        (choice,) = chat(server, **body, return_token_ids=True)["choices"]
        (call,) = calls_of(choice["message"])
        check_written(server, choice, call_format, [call])
        assert call[0] == name and fits(name, parse(call[1])), call
        assert choice["message"]["content"] == ""
        assert choice["finish_reason"] == "stop"  # as OpenAI and vLLM finish a forced function
        chunks, content, calls, finish = chat_stream(server, **body)
        assert content == "" and finish == "stop"
        assert same_calls(calls, [call])
        if len(call[1]) > 1 and call_format != "mistral":  # the arguments came in fragments
            assert sum(1 for ch in chunks for d in ch["choices"][0]["delta"].get("tool_calls", [])) > 2
        if call_format in ("hermes", "llama3_json"):  # vLLM 0.32's chunks: the name alone first (hermes': the
            # content null)
            first = next(ch["choices"][0]["delta"] for ch in chunks if ch["choices"][0]["delta"].get("tool_calls"))
            assert set(first["tool_calls"][0]["function"]) == {"name"}, first
            assert first.get("content", "absent") == (None if call_format == "hermes" else "absent"), first


def test_a_named_stream_sends_a_delta_for_each_step(server, no_blanks, monkeypatch):
    """As vLLM 0.32's parse_delta reads every step: a named function's stream (without a parser: vLLM's older JSON
    form, extract_named_tool_call_streaming) sends a tool-call delta for each, its arguments "" where the step
    added no text (each token but the last of a character the tokenizer splits in bytes), logprobs or not."""
    monkeypatch.setattr(server.app.state.server, "tool_parser", None)
    clef = {"type": "object", "properties": {"s": {"const": "\U0001d11e"}}, "required": ["s"],
            "additionalProperties": False}  # 4 bytes, 4 tokens: 3 steps add no text
    tools = [{"type": "function", "function": {"name": "clef", "parameters": clef, "strict": True}}]
    body = dict(tools=tools, tool_choice={"type": "function", "function": {"name": "clef"}}, temperature=0,
                max_tokens=40, logit_bias=no_blanks)
    steps = chat(server, **body)["usage"]["completion_tokens"]  # greedy: the stream's too
    chunks, content, calls, finish = chat_stream(server, **body)
    assert calls == [["clef", '{"s":"\U0001d11e"}']] and finish == "stop", calls  # (no blanks: the bias)
    deltas = [d for ch in chunks for c in ch["choices"] for d in c["delta"].get("tool_calls", [])]
    assert len(deltas) == steps  # one a step, the EOS step's too
    assert sum(d["function"]["arguments"] == "" for d in deltas) >= 3, deltas
    server.wait_idle()


def test_a_required_response_that_stopped_says_tool_calls(server, no_blanks, monkeypatch):
    """As vLLM 0.32's: a response to "required" that stopped has finish_reason "tool_calls" even where its text
    reads as no call (here llama3_json's reading made to find none; the text is then the content); its stream
    says so only where it sent a call."""
    monkeypatch.setattr(server.app.state.server, "tool_parser", "llama3_json")
    monkeypatch.setattr(Llama3JsonToolParser, "read", lambda self, body: None)
    monkeypatch.setattr(Llama3JsonToolParser, "_read_stream", lambda self: None)
    body = dict(tools=STRICT_TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=0,
                max_tokens=200, logit_bias=no_blanks)
    (choice,) = chat(server, **body)["choices"]
    assert "tool_calls" not in choice["message"] and choice["message"]["content"].startswith('{"name": "')
    assert choice["finish_reason"] == "tool_calls"
    assert chat_stream(server, **body)[2:] == ([], "stop")
    server.wait_idle()


NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


def call_grammar(parser: str, tools: list[dict], choice, parallel=None, level="auto", output=None):
    """The grammar of vLLM 0.32's structural tag over the calls (None where it takes none)."""
    import xgrammar as xgr
    tag = entry.tool_call_tag(parser, [entry.ChatCompletionToolsParam.model_validate(t) for t in tools], choice,
                              parallel, level, output)
    return None if tag is None else xgr.Grammar.from_structural_tag(json.dumps(tag))


def test_hermes_call_grammar():
    """The structural tag of hermes calls takes the parser's format, with or without the newlines: of the named
    function only (once); of any tool for "required" (one or more, nothing around them; one with
    parallel_tool_calls false); for "auto" free text in which each call opened (<tool_call>) is whole. A strict
    tool's arguments follow its schema, any other tool's are any JSON (vLLM's default --tool-strict-level)."""
    from xgrammar.testing import _is_grammar_accept_string as accepts
    tools = [STRICT_TOOLS[0], TOOLS[1]]
    w = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    t = '<tool_call>{"name": "get_time", "arguments": "any JSON"}</tool_call>'
    required, named = call_grammar("hermes", tools, "required"), call_grammar("hermes", tools, NAMED_TIME)
    for text in (w, t, w + t, t + t):
        assert accepts(required, text), text
    for text in ("", "Sure. " + w, w.replace("3", "0"), w + " ", '[{"name": "get_time", "parameters": {}}]'):
        assert not accepts(required, text), text  # nothing around the calls; the strict tool's schema holds
    assert accepts(named, t) and not accepts(named, w) and not accepts(named, t + t)
    single = call_grammar("hermes", tools, "required", parallel=False)
    assert accepts(single, w) and not accepts(single, w + t)
    auto = call_grammar("hermes", tools, "auto")
    for text in ("", "No call.", "Sure. " + w + " then " + t + " done", w + w):
        assert accepts(auto, text), text
    for text in ("Sure. " + w.replace("3", "0"), "Sure. <tool_call>oops</tool_call>", "<tool_call>{"):
        assert not accepts(auto, text), text  # a call opened is whole, and the strict tool's follows its schema
    single = call_grammar("hermes", tools, "auto", parallel=False)
    assert accepts(single, "Sure. " + w) and not accepts(single, w + t) and not accepts(single, w + " bye")


def test_which_calls_take_a_tag():
    """As vLLM 0.32's _apply_structural_tag and resolve_tool_strictness: forced calls always; "auto" where a tool
    is strict, --tool-strict-level is function (the envelope: any JSON arguments) or parameter (every tool's
    arguments per its schema), or parallel_tool_calls is false, unless a structured output of the request's
    own stands beside the calls (then only where a tool is strict or the level says, the two as alternatives);
    the parsers that have no tag (mistral, pythonic) never."""
    from xgrammar.testing import _is_grammar_accept_string as accepts
    bad_days = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 0}}</tool_call>'
    junk = '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>'
    assert call_grammar("hermes", TOOLS, "auto") is None
    for parser in ("mistral", "pythonic"):
        assert call_grammar(parser, STRICT_TOOLS, "required") is None
    function = call_grammar("hermes", TOOLS, "auto", level="function")
    assert accepts(function, junk) and not accepts(function, "<tool_call>{}</tool_call>")
    parameter = call_grammar("hermes", TOOLS, "auto", level="parameter")
    assert not accepts(parameter, junk) and not accepts(parameter, bad_days)
    assert accepts(parameter, bad_days.replace("0", "2"))
    assert accepts(call_grammar("hermes", TOOLS, "auto", parallel=False), "Hi " + junk)
    regex = {"type": "regex", "pattern": "[a-z]{3}"}
    assert call_grammar("hermes", TOOLS, "auto", parallel=False, output=regex) is None
    either = call_grammar("hermes", STRICT_TOOLS, "auto", output=regex)
    assert accepts(either, "abc") and accepts(either, bad_days.replace("0", "2")) and not accepts(either, "Hi abc")


def test_llama_tag_is_xgrammars_builtin():
    """llama3_json's tag is xgrammar's builtin "llama" structure, as vLLM 0.32 asks for it (each tool's strict
    settled first; parallel_tool_calls false stops the list of calls after one)."""
    import xgrammar as xgr
    for tools, level in ((STRICT_TOOLS, "auto"), ([STRICT_TOOLS[0], TOOLS[1]], "auto"), (TOOLS, "function"),
                         (TOOLS, "parameter")):
        for choice in ("auto", "required", NAMED_TIME):
            for parallel in (None, False):
                ours = entry.tool_call_tag("llama3_json", [entry.ChatCompletionToolsParam.model_validate(t)
                                                           for t in tools], choice, parallel, level)
                pinned = [{**t, "function": {**t["function"], "strict": level == "parameter"
                                             or t["function"].get("strict") is True}} for t in tools]
                theirs = xgr.get_model_structural_tag("llama", tools=pinned, tool_choice=choice, reasoning=False,
                                                      parallel_tool_calls=parallel is not False)
                assert xgr.StructuralTag.model_validate(ours).model_dump() == theirs.model_dump(), (choice, level)


def test_harmony_call_grammar():
    """gpt-oss's tag (vLLM 0.32's own): an analysis and a commentary message, each optional, then one call to
    functions.NAME (its recipient before or after the channel, either JSON content type, ended by <|end|> or
    by the EOS); for "auto" a final message instead."""
    from xgrammar.testing import _is_grammar_accept_string as accepts
    call = '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"tz": "cet"}'
    think = "<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant"
    final = "<|channel|>final<|message|>It is noon."
    named = call_grammar("openai", STRICT_TOOLS, NAMED_TIME)
    for text in (call, think + call, call + "<|end|>", ' to=functions.get_time<|channel|>analysis json<|message|>{"tz":'
                 '"utc"}'):
        assert accepts(named, text), text
    for text in ("", think, final, call.replace("cet", "pst"), call.replace("get_time", "get_weather"), call + call):
        assert not accepts(named, text), text
    assert accepts(call_grammar("openai", STRICT_TOOLS, "auto"), think + final)
    assert not accepts(call_grammar("openai", STRICT_TOOLS, "required"), think + final)


def test_auto_calls_under_the_tag(server, strict_json, tiny_model, monkeypatch):
    """End to end: "auto" with a strict tool beside the request's own regex lets the model write the regex's
    text or hermes calls (vLLM 0.32's "or" of the two); a bias against the regex's letters makes a random model
    take the calls: one (parallel_tool_calls false) whole call per its schema, read back by the parser. Without
    a strict tool the regex alone holds. And which "auto" requests the engine gets the tag for, as the server's
    --tool-strict-level and VLLM_ENFORCE_STRICT_TOOL_CALLING say."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model)
    letters = {str(i): -100 for i in range(len(tok)) if re.fullmatch("[a-z]+", tok.decode([i]))}
    body = dict(structured_outputs={"regex": "[a-z]{3}"}, parallel_tool_calls=False, temperature=1.0,
                max_tokens=200, logit_bias={**strict_json, **letters})
    for seed in SEEDS:
        (choice,) = chat(server, tools=STRICT_TOOLS, seed=seed, **body)["choices"]
        (call,) = calls_of(choice["message"])
        assert fits(call[0], json.loads(call[1])) and not choice["message"]["content"], choice
        assert choice["finish_reason"] == "tool_calls"
        _, content, calls, finish = chat_stream(server, tools=STRICT_TOOLS, seed=seed, **body)
        assert (content, finish) == ("", "tool_calls") and same_calls(calls, [call])
        (choice,) = chat(server, tools=TOOLS, seed=seed, **body)["choices"]
        assert re.fullmatch("[a-z]{3}", choice["message"]["content"]) and "tool_calls" not in choice["message"]
    state, specs, add_request = server.app.state.server, [], server.app.state.server.async_llm.add_request
    monkeypatch.setattr(state.async_llm, "add_request", lambda prompt, params, *a, **k:
                        specs.append(params.structured_outputs) or add_request(prompt, params, *a, **k))

    def tag(strict: bool = False, **settings) -> str | None:
        """The type of the format the engine got for an "auto" request (None: no constraint)."""
        for name, value in settings.items():
            monkeypatch.setattr(state, name, value)
        specs.clear()
        chat(server, tools=STRICT_TOOLS if strict else TOOLS, max_tokens=1)
        return specs[0] and json.loads(specs[0].structural_tag)["format"]["type"]
    assert parse_args(["--tool-strict-level", "parameter"]).tool_strict_level == "parameter"
    with pytest.raises(SystemExit):
        parse_args(["--tool-strict-level", "strict"])
    assert tag() is None and tag(strict=True) == "triggered_tags"
    assert tag(tool_strict_level="function") == "triggered_tags" == tag(tool_strict_level="parameter")
    assert tag(tool_strict_level="auto", strict_tool_calling=False, strict=True) is None
    server.wait_idle()


def test_echo_leads_the_content_and_is_no_part_of_a_call(server, no_blanks):
    """As vLLM: chat echo (here the continued assistant message) is content put before the parsed output,
    never text the tool parser reads: the named function's arguments stay the model's JSON alone."""
    body = dict(messages=USER + [{"role": "assistant", "content": "Sure"}], continue_final_message=True, echo=True,
                tools=STRICT_TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=0,
                max_tokens=200, logit_bias=no_blanks)
    (choice,) = chat(server, **body)["choices"]
    (call,) = calls_of(choice["message"])
    assert choice["message"]["content"] == "Sure" and call[0] == "get_time" and fits("get_time", parse(call[1])), call
    _, content, calls, finish = chat_stream(server, **body)
    assert (content, finish) == ("Sure", choice["finish_reason"]) and same_calls(calls, [call])


def test_required_hands_xgrammar_a_defs_that_is_not_an_object(server):
    """Only an object $defs is gathered at the root; any other is left where it is, for xgrammar to judge
    (as a named function's is), never a 500."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "$defs": 1}}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={"messages": USER, "tools": tools, "tool_choice": choice, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 or r.json()["error"]["param"] == "tools", r.text
    server.wait_idle()


FORCED = ('I will check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "cet"}}\n</tool_call>\nDone.')
TOLD = "I will check. "  # as vLLM's hermes parser: the text before the first call, as written; none after it


def test_auto_parses_the_calls_the_model_writes(server):
    """The output is forced by a structured-outputs choice, then read by the hermes parser."""
    body = dict(tools=TOOLS, structured_outputs={"choice": [FORCED]}, max_tokens=300)
    (choice,) = chat(server, **body)["choices"]
    want = [["get_weather", '{"city": "Paris", "days": 3}'], ["get_time", '{"tz": "cet"}']]
    assert calls_of(choice["message"]) == want
    assert choice["message"]["content"] == TOLD and choice["finish_reason"] == "tool_calls"
    _, content, calls, finish = chat_stream(server, **body)
    assert (content, calls, finish) == (TOLD, want, "tool_calls")
    # the same model through the openai SDK
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    msg = client.chat.completions.create(model=server.args.served_model_name[0], messages=USER, tools=TOOLS,
                                         extra_body={"structured_outputs": {"choice": [FORCED]}},
                                         max_tokens=300).choices[0].message
    assert [[c.function.name, c.function.arguments] for c in msg.tool_calls] == want
    streamed: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(model=server.args.served_model_name[0], messages=USER, tools=TOOLS,
                                                extra_body={"structured_outputs": {"choice": [FORCED]}},
                                                max_tokens=300, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            call = streamed.setdefault(d.index, ["", ""])
            call[0] += d.function.name or ""
            call[1] += d.function.arguments or ""
    assert [streamed[i] for i in sorted(streamed)] == want
    # no call in the text: content as it is
    plain = chat(server, tools=TOOLS, structured_outputs={"choice": ["No tools <needed>."]})["choices"][0]
    assert plain["message"] == {**NULLS, "role": "assistant", "content": "No tools <needed>."}
    assert plain["finish_reason"] == "stop"
    assert chat_stream(server, tools=TOOLS, structured_outputs={"choice": ["No tools <needed>."]})[1:] == \
        ("No tools <needed>.", [], "stop")
    # tool_choice "none": the tools reach the template, the output is not parsed
    none = chat(server, tools=TOOLS, tool_choice="none", structured_outputs={"choice": [FORCED]}, max_tokens=300)
    assert none["choices"][0]["message"] == {**NULLS, "role": "assistant", "content": FORCED}
    server.wait_idle()


WRITTEN = {  # --tool-call-parser -> (an output in its format, the content it leaves)
    "pythonic": ('[get_weather(city="Paris", days=3), get_time(tz="cet")]', ""),
    "mistral": ('Let me see. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "get_time", "arguments": {"tz": "cet"}}]', "Let me see. "),
}


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_auto_reads_each_parsers_format(server, name, monkeypatch):
    """The same forced calls, written in each --tool-call-parser's format, come out as the same tool_calls.
    As vLLM's, mistral keeps special tokens in the text: its [TOOL_CALLS] is one."""
    assert parse_args(["--enable-auto-tool-choice", "--tool-call-parser", name]).tool_call_parser == name
    state, (text, told) = server.app.state.server, WRITTEN[name]
    skips, add_request = set(), state.async_llm.add_request
    monkeypatch.setattr(state.async_llm, "add_request",
                        lambda prompt, params, *a, **k: skips.add(params.skip_special_tokens) or
                        add_request(prompt, params, *a, **k))
    want = [["get_weather", '{"city": "Paris", "days": 3}'], ["get_time", '{"tz": "cet"}']]
    state.tool_parser = name
    try:
        body = dict(tools=TOOLS, structured_outputs={"choice": [text]}, max_tokens=300)
        (choice,) = chat(server, **body)["choices"]
        assert calls_of(choice["message"]) == want and choice["finish_reason"] == "tool_calls"
        assert (choice["message"]["content"] or "") == told
        assert chat_stream(server, **body)[1:] == (told, want, "tool_calls")
        plain = chat(server, tools=TOOLS, structured_outputs={"choice": ["No tools [needed]."]})["choices"][0]
        assert plain["message"] == {**NULLS, "role": "assistant", "content": "No tools [needed]."}
        assert skips == {name != "mistral"}
    finally:
        state.tool_parser = "hermes"
    server.wait_idle()


def test_parallel_tool_calls_false_keeps_the_first_call(server):
    """As vLLM: the calls are parsed, then all but the first dropped; true (or absent) keeps them all."""
    body = dict(tools=TOOLS, structured_outputs={"choice": [FORCED]}, max_tokens=300)
    first = [["get_weather", '{"city": "Paris", "days": 3}']]
    (choice,) = chat(server, **body, parallel_tool_calls=False)["choices"]
    assert calls_of(choice["message"]) == first
    assert choice["message"]["content"] == TOLD and choice["finish_reason"] == "tool_calls"
    chunks, content, calls, finish = chat_stream(server, **body, parallel_tool_calls=False)
    assert (content, calls, finish) == (TOLD, first, "tool_calls")
    assert all(d["index"] == 0 for ch in chunks for d in ch["choices"][0]["delta"].get("tool_calls", []))
    assert len(calls_of(chat(server, **body, parallel_tool_calls=True)["choices"][0]["message"])) == 2
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    msg = client.chat.completions.create(model=server.args.served_model_name[0], messages=USER, tools=TOOLS,
                                         parallel_tool_calls=False, max_tokens=300,
                                         extra_body={"structured_outputs": {"choice": [FORCED]}}).choices[0].message
    assert [[c.function.name, c.function.arguments] for c in msg.tool_calls] == first
    server.wait_idle()


def test_exclude_tools_when_tool_choice_none(server):
    """vLLM's --exclude-tools-when-tool-choice-none: "none" renders no tools; other choices still do."""
    assert parse_args(["--dtype", "float32", "--exclude-tools-when-tool-choice-none"]) \
        .exclude_tools_when_tool_choice_none
    state = server.app.state.server
    assert state.exclude_tools_when_tool_choice_none is False  # off by default: the tools are rendered
    count = {key: httpx.post(server.url + "/tokenize", json={"messages": HISTORY, **tools}).json()["count"]
             for key, tools in (("plain", {}), ("tools", {"tools": TOOLS}))}
    assert count["plain"] < count["tools"]
    state.exclude_tools_when_tool_choice_none = True
    try:
        for choice, tokens in (("none", count["plain"]), ("auto", count["tools"])):
            body = chat(server, messages=HISTORY, tools=TOOLS, tool_choice=choice, max_tokens=1,
                        structured_outputs={"choice": ["x"]})
            assert body["usage"]["prompt_tokens"] == tokens, choice
    finally:
        state.exclude_tools_when_tool_choice_none = False
    server.wait_idle()


def test_an_empty_tools_list_is_refused(server):
    """As vLLM's check_tool_usage (and OpenAI): tools [] is a 400 naming tools, whatever the
    tool_choice; /tokenize renders it as no tools (the template's {% if tools %} sees none)."""
    named = {"type": "function", "function": {"name": "get_time"}}
    for extra in ({}, {"tool_choice": "required"}, {"tool_choice": "auto"}, {"tool_choice": named}):
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER, "tools": [], **extra})
        assert "must not be an empty array" in _check_error(r, 400, "tools")["message"], extra
    assert render(server, tools=[]) == render(server)


def test_content_format_of_a_request_template_and_the_flag(server, tiny_model, caplog):
    """A request's own template that loops over a message's content gets its parts (vLLM's "auto" detects it
    per template); --chat-template-content-format string forces them joined, and start-up logs what auto found."""
    parts = ("{% for m in messages %}{% if m['content'] is string %}[{{ m['content'] }}]{% else %}"
             "{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}{% endif %}{% endfor %}")
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render(server, messages=messages, chat_template=parts) == "<a><b>"
    assert render(server, messages=[{"role": "user", "content": "ab"}], chat_template=parts) == "<ab>"
    with ServerThread(tiny_model, "--chat-template", parts, "--chat-template-content-format", "string") as s:
        assert render(s, messages=messages) == "[a\nb]"
        with caplog.at_level("INFO", logger="nanoserve.entry"):
            entry.log_content_format(s.app.state.server)  # "string" given: nothing detected, nothing said
            s.app.state.server.chat_template_content_format = "auto"
            entry.log_content_format(s.app.state.server)
        assert render(s, messages=messages) == "<a><b>"
    assert caplog.text.count("chat template") == 1 and "reads message contents as lists of text parts" in caplog.text
    with pytest.raises(SystemExit):
        parse_args(["--chat-template-content-format", "list"])


def test_chat_template_flag_file_and_inline(template_file):
    base = ["--dtype", "float32"]
    assert parse_args([*base, "--chat-template", str(template_file)]).chat_template == TEMPLATE
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert parse_args([*base, "--chat-template", inline]).chat_template == inline
    assert load_chat_template(inline) == inline
    with pytest.raises(SystemExit):
        parse_args([*base, "--chat-template", "no/such/file.jinja"])
    binary = template_file.with_name("binary.jinja")
    binary.write_bytes(b"\xd0\x00\xff")
    with pytest.raises(ValueError, match=r"--chat-template .*binary.jinja.*cannot read it as a file \(UnicodeDecode"):
        load_chat_template(str(binary))
    with pytest.raises(SystemExit):
        parse_args([*base, "--enable-auto-tool-choice"])  # needs --tool-call-parser
    with pytest.raises(SystemExit):
        parse_args([*base, "--tool-call-parser", "nope"])


BAD = [  # body (over USER), param, words the message must have
    (dict(tools="get_time"), "tools", "tools must be a list of objects"),
    (dict(tools=[{"type": "function"}]), "tools", "tools[0].function is required"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools", "tools[0].type"),
    (dict(tools=[{"type": "function", "function": {"name": ""}}]), "tools", "tools[0].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]), "tools",
     "tools[0].function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "description": 3}}]), "tools",
     "tools[0].function.description"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice", '"required"'),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "not one of the tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function"}), "tool_choice", "tool_choice must be"),
    (dict(tools=TOOLS, parallel_tool_calls="maybe"), "parallel_tool_calls", "parallel_tool_calls"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
     "cannot be combined"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}, "strict": True}}],
          tool_choice="required"), "tools", "xgrammar can compile"),  # (hermes reads a strict tool's schema only)
    (dict(messages=[HISTORY[0], {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]),
     "messages", "messages[1].tool_calls[0].function.name"),
    (dict(messages=[HISTORY[0], {"role": "assistant", "tool_calls": "x"}]), "messages", "messages[1].tool_calls"),
    (dict(messages=[{"role": "user", "content": "hi", "tool_calls": []}]), "messages", "messages[0].tool_calls"),
    (dict(messages=[HISTORY[0], {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]),
     "messages", "messages[1].tool_calls[0].function.arguments"),
    (dict(messages=[HISTORY[0], {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}]),
     "messages", "messages[1].tool_calls[0].function.arguments must be"),
    (dict(messages=[HISTORY[0], {"role": "assistant", "tool_calls": [  # json reads it: too deep for the template
        {"type": "function", "function": {"name": "f", "arguments": '{"a": ' + "[" * 200 + "]" * 200 + "}"}}]}]),
     "messages", "nested at most 128 levels deep"),
    (dict(messages=[HISTORY[0], {"role": "tool", "tool_call_id": 5, "content": "x"}]), "messages",
     "messages[1].tool_call_id"),
    (dict(chat_template_kwargs="x"), "chat_template_kwargs", "chat_template_kwargs"),
    (dict(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs", "tokenize"),
    (dict(continue_final_message=True, add_generation_prompt=True), "continue_final_message",
     "Cannot set both `continue_final_message` and `add_generation_prompt` to True."),  # vLLM's words
    (dict(continue_final_message="maybe"), "continue_final_message", "continue_final_message"),
    (dict(chat_template="{% for m in messages %}"), "chat_template", "not valid Jinja"),
    (dict(chat_template="{{ raise_exception('no tools here') }}"), "messages", "no tools here"),
    (dict(chat_template="{{ messages[5].content }}"), "messages", "chat template"),
    (dict(chat_template=7), "chat_template", "chat_template"),
]


@pytest.mark.parametrize("body,param,words", BAD, ids=[f"{i}-{row[1]}" for i, row in enumerate(BAD)])
def test_bad_shapes_are_400s_naming_the_field(server, body, param, words):
    for path in ("/v1/chat/completions", "/tokenize"):
        if path == "/tokenize" and {"tool_choice", "parallel_tool_calls"} & set(body):
            continue  # chat-only fields
        r = httpx.post(server.url + path, json={"messages": USER, **body})
        err = _check_error(r, 400, param)
        assert words in err["message"], err


def test_flags_and_templates_the_server_lacks(bare_server):
    """vLLM's answers without --enable-auto-tool-choice, and HTTP advice for a model without a template."""
    for body in (dict(tools=TOOLS), dict(tools=TOOLS, tool_choice="auto")):  # tools alone mean "auto"
        err = _check_error(httpx.post(bare_server.url + "/v1/chat/completions", json={"messages": USER, **body}),
                           400, "tool_choice")
        assert err["message"] == '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    for path in ("/v1/chat/completions", "/tokenize"):
        err = _check_error(httpx.post(bare_server.url + path, json={"messages": USER}), 400, "chat_template")
        assert "--chat-template" in err["message"] and "chat_template=" not in err["message"], err
        err = _check_error(httpx.post(bare_server.url + path, json={"messages": USER, "chat_template": "{{ 1 }}"}),
                           400, "chat_template")
        assert "--trust-request-chat-template" in err["message"]
    bare_server.wait_idle()


def test_tool_fields_fuzzed_never_5xx(server):
    """Random values for the fields of this feature: a 2xx or a 4xx in the error shape, never a 5xx."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=6),
                        st.sampled_from(["auto", "none", "required", "function", "get_time", "{}", '{"a": 1}']))
    values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(
        st.sampled_from(["type", "function", "name", "arguments", "parameters", "tool_calls", "role", "content",
                         "tool_call_id", "enable_thinking"]), inner, max_size=3)), max_leaves=8)
    fields = ["tools", "tool_choice", "chat_template_kwargs", "continue_final_message", "add_generation_prompt",
              "messages", "chat_template"]

    @settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "60")), deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(body=st.fixed_dictionaries({}, optional={f: values for f in fields}), stream=st.booleans())
    def check(body, stream):
        body = {"messages": HISTORY, "tools": TOOLS, "max_tokens": 3, "stream": stream, **body}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            _check_error(r, r.status_code, None)
        elif stream:
            sse_events(r.text)
    check()
    server.wait_idle()


# =========================================================================== --reasoning-parser

REASONING_CASES = [  # text -> {parser: (reasoning, content) as vLLM v0.10-0.11's parsers split a whole output}
    ("<think>\nLet me see.\n</think>\n\nHello.", {"deepseek_r1": ("\nLet me see.\n", "\n\nHello."),
                                                 "qwen3": ("\nLet me see.\n", "\n\nHello.")}),
    ("Let me see.</think>Hello.", {"deepseek_r1": ("Let me see.", "Hello."),  # R1: its template opened <think>
                                   "qwen3": (None, "Let me see.</think>Hello.")}),  # qwen3: needs both tags
    ("Thinking, cut short <thi", {"deepseek_r1": ("Thinking, cut short <thi", None),
                                  "qwen3": (None, "Thinking, cut short <thi")}),
    ("<think>a</think>", {"deepseek_r1": ("a", None), "qwen3": ("a", None)}),
    ("</think></thin", {"deepseek_r1": ("", "</thin"), "qwen3": (None, "</think></thin")}),
]


def stream_reasoning(name: str, pieces: list[str]) -> tuple[str, str]:
    parser, reasoning, content = entry.ReasoningParser(name), "", ""
    for i, piece in enumerate(pieces):
        r, c = parser.feed(piece, i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize("text,want", REASONING_CASES)
def test_reasoning_parsers(text, want):
    """Whole and streamed a character at a time (every tag split across deltas): where vLLM's streamed
    parser agrees with its whole-output one, the stream adds up to the same fields and leaks no tag."""
    for name, (reasoning, content) in want.items():
        assert entry.ReasoningParser(name).extract(text) == (reasoning, content), name
        if reasoning is not None:
            assert stream_reasoning(name, list(text)) == (reasoning, content or ""), name
    assert stream_reasoning("qwen3", list("Let me see.</think>Hello.")) == ("", "Let me see.</think>Hello.")
    # as vLLM's streamed parsers: reasoning after <think> needs no </think> (qwen3), a later <think> is dropped
    assert stream_reasoning("qwen3", list("<think>cut <think>short")) == ("cut short", "")
    assert stream_reasoning("deepseek_r1", ["<thi", "nk>a</th", "ink", ">b"]) == ("a", "b")


THOUGHT = "<think>\nThe user wants the weather.\n</think>\n\n"


def chat_reasoning_stream(server, **body) -> tuple[list[dict], str, str, list[list[str]], str]:
    """chat_stream's, with the reasoning the deltas add up to: (chunks, reasoning, content, calls, finish)."""
    chunks, content, calls, finish = chat_stream(server, **body)
    reasoning = "".join(ch["choices"][0]["delta"].get("reasoning_content", "") for ch in chunks)
    assert all(ch["choices"][0]["delta"].get("reasoning") == ch["choices"][0]["delta"].get("reasoning_content")
               for ch in chunks if ch["choices"])  # the later vLLM name, the same text
    return chunks, reasoning, content, calls, finish


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_reasoning_parser_on_chat(server, name, monkeypatch):
    """The forced output's <think> part is message.reasoning_content and the rest its content, whole and
    streamed (reasoning deltas first, the tags split across token deltas never in either); the hermes
    parser reads calls from the content only; include_reasoning false drops the reasoning."""
    tok = server.engine.tokenizer
    assert len(tok.encode("</think>", add_special_tokens=False)) > 1  # so the tag comes over several deltas
    monkeypatch.setattr(server.app.state.server, "reasoning_parser", name)
    text = THOUGHT + "It is sunny."
    (choice,) = chat(server, structured_outputs={"choice": [text]}, max_tokens=300)["choices"]
    thought = "\nThe user wants the weather.\n"
    assert choice["message"] == {**NULLS, "role": "assistant", "reasoning_content": thought, "reasoning": thought,
                                 "content": "\n\nIt is sunny."}
    chunks, reasoning, content, _, finish = chat_reasoning_stream(server, structured_outputs={"choice": [text]},
                                                                  max_tokens=300)
    assert (reasoning, content, finish) == ("\nThe user wants the weather.\n", "\n\nIt is sunny.", "stop")
    kinds = [k for ch in chunks[1:] for k in ch["choices"][0]["delta"] if k in ("reasoning_content", "content")]
    assert kinds == sorted(kinds, reverse=True) and len(kinds) > 2  # reasoning, then content, token by token
    # a call after the thought is a call; one written inside it is reasoning
    body = dict(tools=TOOLS, structured_outputs={"choice": [THOUGHT + FORCED]}, max_tokens=400)
    want = [["get_weather", '{"city": "Paris", "days": 3}'], ["get_time", '{"tz": "cet"}']]
    (choice,) = chat(server, **body)["choices"]
    assert choice["message"]["reasoning_content"] == "\nThe user wants the weather.\n"
    assert (choice["message"]["content"], calls_of(choice["message"]), choice["finish_reason"]) == \
        ("\n\n" + TOLD, want, "tool_calls")
    assert chat_reasoning_stream(server, **body)[1:] == ("\nThe user wants the weather.\n", "\n\n" + TOLD, want,
                                                         "tool_calls")
    inner = "<think>" + FORCED + "</think>No call."
    (choice,) = chat(server, tools=TOOLS, structured_outputs={"choice": [inner]}, max_tokens=400)["choices"]
    assert choice["message"] == {**NULLS, "role": "assistant", "reasoning_content": FORCED, "reasoning": FORCED,
                                 "content": "No call."} and choice["finish_reason"] == "stop"
    (choice,) = chat(server, include_reasoning=False, structured_outputs={"choice": [text]})["choices"]
    assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == (None, "\n\nIt is sunny.")
    assert chat_reasoning_stream(server, include_reasoning=False, structured_outputs={"choice": [text]})[1:3] == \
        ("", "\n\nIt is sunny.")
    # the completions endpoint does not split (as vLLM's)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "structured_outputs": {"choice": [text]},
                                                          "max_tokens": 300}, timeout=60)
    assert r.json()["choices"][0]["text"] == text
    server.wait_idle()


def test_reasoning_parser_without_a_closing_tag(server, monkeypatch):
    """No </think>: deepseek_r1's output is all reasoning (cut short while thinking: the parser's own
    tests), but a constrained one is the answer, whole in content or tool_calls, where the tokenizer has
    no </think> token, so the grammar holds from the first token (with one it starts after </think>:
    test_structured_outputs.py); qwen3's is all content, as is its output
    under enable_thinking false (its template closes the thought in the prompt, so the output has no tags)."""
    state = server.app.state.server
    text = "Still thinking about it"
    assert entry.ReasoningParser("deepseek_r1").extract(text) == (text, None)
    assert stream_reasoning("deepseek_r1", list(text)) == (text, "")
    monkeypatch.setattr(state, "reasoning_parser", "deepseek_r1")
    (choice,) = chat(server, structured_outputs={"choice": [text]}, max_tokens=300)["choices"]
    assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == (None, text)
    assert chat_reasoning_stream(server, structured_outputs={"choice": [text]}, max_tokens=300)[1:3] == ("", text)
    named = {"type": "function", "function": {"name": "get_weather"}}
    (choice,) = chat(server, tools=STRICT_TOOLS, tool_choice=named, max_tokens=300)["choices"]
    (call,) = choice["message"]["tool_calls"]
    assert choice["message"]["reasoning_content"] is None and parse(call["function"]["arguments"])
    monkeypatch.setattr(state, "reasoning_parser", "qwen3")
    for kwargs in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):
        (choice,) = chat(server, structured_outputs={"choice": [text]}, max_tokens=300, **kwargs)["choices"]
        assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == (None, text)
        assert chat_reasoning_stream(server, structured_outputs={"choice": [text]}, max_tokens=300,
                                     **kwargs)[1:3] == ("", text)
    assert render(server, chat_template_kwargs={"enable_thinking": False}).endswith("assistant\n<think></think>")
    server.wait_idle()


def test_no_reasoning_parser_splits_nothing(server):
    """Without the flag (the default) the thought is content, as it is written, and no field is added."""
    assert parse_args(["--dtype", "float32"]).reasoning_parser is None
    for name in ("deepseek_r1", "qwen3"):
        assert parse_args(["--dtype", "float32", "--reasoning-parser", name]).reasoning_parser == name
    with pytest.raises(SystemExit):
        parse_args(["--dtype", "float32", "--reasoning-parser", "granite"])
    args = parse_args(["--model", str(server.args.model), "--dtype", "float32", "--reasoning-parser", "qwen3"])
    assert entry.build_app(server.async_llm, args).state.server.reasoning_parser == "qwen3"
    assert server.app.state.server.reasoning_parser is None
    text = THOUGHT + "It is sunny."
    (choice,) = chat(server, structured_outputs={"choice": [text]}, max_tokens=300)["choices"]
    assert choice["message"] == {**NULLS, "role": "assistant", "content": text}
    chunks, reasoning, content, _, _ = chat_reasoning_stream(server, structured_outputs={"choice": [text]},
                                                             max_tokens=300)
    assert (reasoning, content) == ("", text)
    server.wait_idle()
