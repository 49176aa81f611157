"""Issue 23: no input can stall, crash or bloat the server; a failed step costs
only its own requests; shutdown ends every stream cleanly. Faults are injected
by patching the model runner or the tokenizer in the test; nothing here waits
on a clock except with deadlines far beyond what a loaded machine needs."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from nanoserve import LLM, SamplingParams, entry
from conftest import run_request
from test_server import ServerThread, _check_error, _metrics, offline, sse_events  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tiny_model):
    with ServerThread(tiny_model, "--max-request-body-bytes", "4MiB") as s:
        yield s


def _post(url: str, body, path: str = "/v1/completions", **kw) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60, **kw)


def _health_while_held(server, body, entered: threading.Event, release: threading.Event,
                       path: str = "/v1/completions") -> httpx.Response:
    """POST ``body`` on a thread; once it is held inside the server (``entered``), /health
    must answer while the request still has none; then ``release`` it and return its response."""
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("r", _post(server.url, body, path)))
    worker.start()
    try:
        assert entered.wait(30)
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        assert "r" not in result
    finally:
        release.set()
    worker.join(60)
    return result["r"]


# =========================================================================== bounded work before tokenizing

def test_health_answers_while_a_prompt_is_being_tokenized(server):
    """Tokenizing runs off the event loop: /health answers while the tokenizer
    is held (on an Event, not a clock) in the middle of a request."""
    tokenizer = server.engine.tokenizer
    entered, release = threading.Event(), threading.Event()
    encode = tokenizer.encode

    def held_encode(text, **kw):
        entered.set()
        assert release.wait(60)
        return encode(text, **kw)
    tokenizer.encode = held_encode
    result = {}
    try:
        worker = threading.Thread(target=lambda: result.setdefault("r", _post(server.url, {
            "prompt": "hello world", "max_tokens": 2})))
        worker.start()
        assert entered.wait(30)
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        assert httpx.get(server.url + "/metrics", timeout=30).status_code == 200
        assert not release.is_set() and "r" not in result  # the request is still being tokenized
    finally:
        release.set()
        del tokenizer.encode
    worker.join(60)
    assert result["r"].status_code == 200
    server.wait_idle()


def test_bad_words_are_tokenized_off_the_loop_once_per_request(server, monkeypatch):
    """bad_words were tokenized by the engine's add_request, on the event loop, for every prompt: a body
    of long bad words held /health for seconds. Now the tokenizer thread does it, once per request."""
    tokenizer = server.engine.tokenizer
    entered, release, words = threading.Event(), threading.Event(), []
    encode = tokenizer.encode

    def held_encode(text, **kw):
        if "zebra" in text:
            words.append(text)
            entered.set()
            assert release.wait(60)
        return encode(text, **kw)
    monkeypatch.setattr(tokenizer, "encode", held_encode)
    r = _health_while_held(server, {"prompt": ["hello", "world", "again"], "max_tokens": 2, "bad_words": ["zebra"]},
                           entered, release)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    assert sorted(words) == [" zebra", "zebra"]  # the word, and with a space: once for the three prompts
    server.wait_idle()


def test_health_answers_while_a_large_body_is_decoded(server, monkeypatch):
    """A body over LARGE_BODY_BYTES is decoded off the event loop too."""
    entered, release = threading.Event(), threading.Event()
    parse = entry.parse_json_object

    def held_parse(raw, yielding=False):
        entered.set()
        assert release.wait(60) and yielding
        return parse(raw, yielding)
    monkeypatch.setattr(entry, "parse_json_object", held_parse)
    too_long = [1] * (server.engine.max_model_len + 1)
    body = {"prompt": [too_long] * (entry.LARGE_BODY_BYTES // (3 * len(too_long)) + 1), "max_tokens": 1}
    _check_error(_health_while_held(server, body, entered, release), 400, "input_tokens")  # too long, after decoding


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/invocations", "/tokenize"])
def test_a_large_body_is_validated_off_the_loop_too(server, monkeypatch, path):
    """Validating a large body (here 60,000 assistant tool calls, 3 MB) took seconds of the event loop
    after its decoding had left it; now it is parsed where it was decoded."""
    entered, release = threading.Event(), threading.Event()
    parse = entry.parse_body

    def held_parse(*args, **kw):
        entered.set()
        assert release.wait(60)
        return parse(*args, **kw)
    monkeypatch.setattr(entry, "parse_body", held_parse)
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {"messages": [{"role": "assistant", "content": "", "tool_calls": [call] * 60000}], "max_tokens": 1}
    assert len(json.dumps(body)) > entry.LARGE_BODY_BYTES
    r = _health_while_held(server, body, entered, release, path)
    assert r.status_code == 200, r.text  # the test's template renders no tool calls
    server.wait_idle()


def test_a_huge_token_id_prompt_is_refused_from_its_bytes(server, monkeypatch):
    """Millions of token ids in one prompt: the 400 is the engine's own, counted in
    the raw body before any number is decoded; where the count is not certain (an
    escape, a second "prompt", a list of lists) the body is decoded as before."""
    decoded = []
    parse = entry.parse_json_object
    monkeypatch.setattr(entry, "parse_json_object",
                        lambda raw, yielding=False: decoded.append(1) or parse(raw, yielding))
    num = entry.LARGE_BODY_BYTES // 3 + 1000
    raw = '{"model": "m",  "prompt" :\n [ 7,' + " 1," * (num - 2) + ' 3 ], "max_tokens": 1}'
    err = _check_error(_post(server.url, raw), 400, "input_tokens")
    assert err["message"].startswith(f"This model's maximum context length is {server.engine.max_model_len} "
                                      f"tokens. However, your prompt contains {num} input tokens, which exceeds")
    assert decoded == []
    pad = " " * entry.LARGE_BODY_BYTES  # JSON whitespace: large, and a prompt that fits
    assert _post(server.url, '{"prompt": [5, 6, 7],' + pad + '"max_tokens": 1}').status_code == 200
    assert decoded == [1]
    for body in ({"prompt": [1] * num, "stop": ["prompt"]}, {"prompt": [1] * num, "user": "é"},
                 {"prompt": [[1] * num]}):
        _check_error(_post(server.url, json.dumps(body)), 400, "input_tokens")
    assert "not valid JSON" in _check_error(_post(server.url, '{"prompt": [' + "1, " * num), 400, None)["message"]
    assert decoded == [1] * 5
    # truncated to what fits, a huge prompt is a good request: decoded, and served
    r = _post(server.url, json.dumps({"prompt": [1] * num, "truncate_prompt_tokens": 4, "max_tokens": 1}))
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 4, r.text
    assert decoded == [1] * 6
    server.wait_idle()


def test_a_text_longer_than_any_prompt_that_fits_is_refused_untokenized(server):
    tokenizer = server.engine.tokenizer
    calls = []
    encode = tokenizer.encode
    tokenizer.encode = lambda text, **kw: calls.append(len(text)) or encode(text, **kw)
    try:
        bound = server.engine.max_prompt_chars
        assert 0 < bound < 2**20
        for path, body in [
                ("/v1/completions", {"prompt": "x" * (bound + 1)}),
                ("/v1/completions", {"prompt": ["hi", "x" * (bound + 1)]}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (bound + 1)}]}),
                ("/tokenize", {"prompt": "x" * (bound + 1)})]:
            err = _check_error(_post(server.url, body, path), 400, "input_text")  # vLLM's words and param
            assert err["message"].startswith("This model's maximum context length is "
                                             f"{server.engine.max_model_len} tokens. However, your prompt contains "), err
            assert f"(more than {bound} characters, which is the upper bound for" in err["message"], err
        assert all(n <= bound for n in calls), calls  # only "hi" was tokenized
    finally:
        del tokenizer.encode
    # a token-id prompt over the limit is refused on its length, before its ids are checked
    err = _check_error(_post(server.url, {"prompt": [1] + ["a"] * 100_000}), 400, "input_tokens")
    assert "maximum context length" in err["message"]
    server.wait_idle()


def test_the_character_bound_never_refuses_a_prompt_that_fits(offline_small):
    """The bound's argument: a token stands for at most as many characters as
    the longest string of the vocabulary. Tokens of that longest string, run
    together, make the densest text there is."""
    engine = offline_small.engine
    vocab = engine.tokenizer.get_vocab()
    longest = max(vocab, key=len)
    text = engine.tokenizer.decode([vocab[longest]]) * (engine.max_model_len - 1)
    assert len(text) <= engine.max_prompt_chars
    assert len(engine.tokenize(text)[1]) >= len(text) / max(map(len, vocab))


@pytest.fixture(scope="module")
def offline_small(tiny_model):
    return LLM(str(tiny_model), dtype="float32", num_kv_blocks=16, max_model_len=64)


# =========================================================================== lone surrogates

SURROGATE_BODIES = [  # raw JSON text: "\ud800" is a lone UTF-16 surrogate, which json.loads lets through
    ("/v1/completions", r'{"prompt": "a\ud800b"}', "prompt"),
    ("/v1/completions", r'{"prompt": ["ok", "\udfff"]}', "prompt"),
    ("/v1/completions", r'{"prompt": "hi", "stop": ["\ud800"]}', "stop"),
    ("/v1/completions", r'{"prompt": "hi", "model": "\ud800"}', "model"),
    ("/v1/completions", r'{"prompt": "hi", "\ud800": 1}', "\\ud800"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages"),
    ("/v1/chat/completions", r'{"messages": [{"role": "\ud800", "content": "hi"}]}', "messages"),
    ("/tokenize", r'{"prompt": "\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": ' + "[" * 900 + r'"\ud800"' + "]" * 900 + "}", "prompt"),  # deep: no recursion
]


def test_lone_surrogates_are_a_400_naming_the_field_and_keep_the_connection(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for path, body, param in SURROGATE_BODIES:
            r = c.post(path, content=body, headers={"Content-Type": "application/json"})
            err = _check_error(r, 400, param)
            assert "surrogate" in err["message"], err
            # the same keep-alive connection still serves the next request
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
        # UTF-8 that encodes a surrogate is not UTF-8
        _check_error(c.post("/v1/completions", content=b'{"prompt": "\xed\xa0\x80"}'), 400, None)
        # a pair of escapes is one valid character
        assert c.post("/v1/completions", content=r'{"prompt": "\ud83d\ude00", "max_tokens": 1}').status_code == 200
    server.wait_idle()


def test_a_utf8_bom_before_the_body_is_ignored(server):
    """As vLLM's (FastAPI's json.loads of the bytes) and as RFC 8259 allows: a body file saved with a BOM (Windows
    PowerShell 5's utf8, Notepad) and sent with curl -d @file was a 400 ("Unexpected UTF-8 BOM")."""
    bom = b"\xef\xbb\xbf"
    r, plain = (_post(server.url, b + b'{"prompt": "hi", "max_tokens": 1}') for b in (bom, b""))
    assert r.status_code == 200 and r.json()["usage"] == plain.json()["usage"], r.text  # the BOM is no text
    big = bom + b'{"prompt": "hi",' + b" " * entry.LARGE_BODY_BYTES + b'"max_tokens": 1}'  # decoded off the loop
    assert _post(server.url, big).status_code == 200
    # only one, and only first: a second is text before the JSON, and bytes are counted from the body's first
    assert "not valid JSON" in _check_error(_post(server.url, bom * 2 + b"{}"), 400, None)["message"]
    err = _check_error(_post(server.url, bom + b'{"prompt": "\xff"}'), 400, None)
    assert err["message"] == "the request body is not valid UTF-8: invalid start byte at byte 15", err
    server.wait_idle()


# numbers JSON has not, which Python's json takes: a Responses body echoes text, reasoning and tools back (a 500
# once, as no JSON answer can carry them); in a tool's schema or a template kwarg they would reach the template
NON_FINITE_BODIES = [
    ("/v1/responses", '{"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": '
                      '{"type": "number", "maximum": NaN}}}}', "text"),
    ("/v1/responses", '{"input": "x", "reasoning": {"effort": "low", "budget": Infinity}}', "reasoning"),
    ("/v1/responses", '{"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", '
                      '"properties": {"a": {"type": "number", "maximum": 1e999}}}}]}', "tools"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
                             '"chat_template_kwargs": {"x": -Infinity}}', "chat_template_kwargs"),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', "temperature"),
    # beyond a double's range with no exponent to give it away (a 500 once: the Responses body echoes reasoning),
    # or with one of two digits
    ("/v1/responses", '{"input": "x", "reasoning": {"effort": "low", "budget": 1' + "0" * 400 + '.0}}', "reasoning"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
                             '"chat_template_kwargs": {"x": ' + "9" * 250 + 'e99}}', "chat_template_kwargs"),
]


@pytest.mark.parametrize("path,body,param", NON_FINITE_BODIES)
def test_numbers_json_has_not_are_a_400_naming_the_field(server, path, body, param):
    err = _check_error(_post(server.url, body, path), 400, param)
    assert "NaN, Infinity" in err["message"], err
    # the same words in a string, and large finite numbers, are no such thing
    r = _post(server.url, {"prompt": "NaN Infinity 1e999", "max_tokens": 1, "unknown_field": 1e300, "user": "9" * 400})
    assert r.status_code == 200, r.text
    server.wait_idle()


def test_a_field_with_an_empty_name_is_named_as_json_spells_it(server):
    """A key "" is a field like any other: its error began with nothing (" holds NaN, ...")."""
    for body, words in [('{"prompt": "hi", "": NaN}', "NaN, Infinity"),
                        ('{"prompt": "hi", "": "\\ud800"}', "surrogate"),
                        ('{"prompt": "hi", "": ' + "[" * 200 + "]" * 200 + "}", "nested")]:
        err = _check_error(_post(server.url, body), 400, "")
        assert err["message"].startswith('"" ') and words in err["message"], err


def test_an_integer_too_long_for_python_is_a_400_that_says_so(server):
    """Python's json refuses an integer of more than 4,300 digits with its own advice ("use
    sys.set_int_max_str_digits() to increase the limit"), which was the 400's message, after "not valid JSON"."""
    limit = sys.get_int_max_str_digits()
    number = "1" + "0" * limit
    for body in ('{"prompt": "hi", "seed": ' + number + "}",  # small and large (decoded off the loop)
                 '{"prompt": "hi", "max_tokens": 1, ' + " " * entry.LARGE_BODY_BYTES + '"x": ' + number + "}"):
        err = _check_error(_post(server.url, body), 400, None)
        assert err["message"] == (f"the request body holds an integer of {limit + 1} digits, more than the {limit} "
                                  f"this server reads (no field takes such a number)"), err
    server.wait_idle()


def _nested_schema(levels: int) -> str:
    """A JSON schema of ``levels`` nested objects, as text (json.dumps would recurse as deep)."""
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "integer"}' + '}, "required": ["a"]}' * levels


def test_a_body_nested_too_deep_is_a_400_naming_the_field(server):
    """A schema 480 objects deep (961 JSON levels, which json.loads takes) compiled for 10 s, then json's
    recursion overflowed on the event loop: a 500; deep template kwargs were misnamed as messages."""
    chat = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, '
    for path, body, param in (
            ("/v1/completions", '{"prompt": "hi", "guided_json": ' + _nested_schema(480) + "}", "guided_json"),
            ("/v1/chat/completions", chat + '"chat_template_kwargs": {"k": ' + "[" * 200 + "]" * 200 + "}}",
             "chat_template_kwargs"),
            ("/v1/responses", '{"input": "x", "tools": [{"type": "function", "name": "f", "parameters": '
                              + _nested_schema(100) + "}]}", "tools")):
        err = _check_error(_post(server.url, body, path), 400, param)
        assert f"nested more than {entry.MAX_JSON_DEPTH} levels" in err["message"], err
    r = _post(server.url, '{"prompt": "hi", "max_tokens": 2, "guided_json": ' + _nested_schema(20) + "}")
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("{"), r.text  # deep enough
    server.wait_idle()


def test_sampling_params_of_another_type_are_a_type_error(offline_small):
    """A dict (the server's body fields) was an AttributeError from inside the engine."""
    for bad in ({"max_tokens": 1}, "x", {}, "", [SamplingParams(), {"max_tokens": 1}]):  # empty ones too
        with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them, got"):
            offline_small.generate(["a", "b"], bad, use_tqdm=False)
    assert not offline_small.engine.has_unfinished_requests()


def test_lone_surrogates_offline_are_a_value_error(offline_small):
    with pytest.raises(ValueError, match="prompt is not valid Unicode"):
        offline_small.generate(["a\ud800"], use_tqdm=False)
    assert not offline_small.engine.has_unfinished_requests()



def test_stop_strings_and_bad_words_are_bounded_in_number(server):
    """Each step of a request checks all its stop strings, stop_token_ids (and bad words) on the event loop: a
    million of them (a few MB of body) held the loop for seconds a step, /health and every stream with it."""
    many, ids = [f"zz{i}" for i in range(entry.MAX_STOP_WORDS + 1)], [5] * (entry.MAX_STOP_WORDS + 1)
    for path, body, param in (("/v1/completions", {"prompt": "hi", "stop": many}, "stop"),
                              ("/v1/completions", {"prompt": "hi", "stop_token_ids": ids}, "stop_token_ids"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "bad_words": many}, "bad_words")):
        err = _check_error(_post(server.url, body, path), 400, param)
        assert err["message"].startswith(f"{param} must hold at most {entry.MAX_STOP_WORDS} entries"), err
    r = _post(server.url, {"model": "", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                           "stop_sequences": many}, "/v1/messages")
    assert r.status_code == 400 and "stop_sequences" in r.json()["error"]["message"], r.text
    r = _post(server.url, {"prompt": "hi", "max_tokens": 1, "stop": many[1:], "bad_words": many[1:],
                           "stop_token_ids": ids[1:]})
    assert r.status_code == 200, r.text
    server.wait_idle()


def test_allowed_token_ids_reach_the_sampler_once_each(server, monkeypatch):
    """The sampler masks a row by its allowed_token_ids at every step, in time that grows with the list: the
    vocabulary 100 times over (a 2 MB body, n=32) held every request in the batch for 3 s a token."""
    rows, execute = [], server.engine.runner.execute
    monkeypatch.setattr(server.engine.runner, "execute", lambda seqs: rows.extend(
        s.sample.params.allowed_token_ids for s in seqs if s.sample) or execute(seqs))
    last = server.engine.model_config.vocab_size - 1
    r = _post(server.url, {"prompt": "hi", "max_tokens": 2, "n": 2, "allowed_token_ids": [7, 5] * 1000 + [last, 5]})
    assert r.status_code == 200, r.text
    assert len(rows) == 4 and all(ids == [7, 5, last] for ids in rows), rows  # in the order given
    assert SamplingParams(allowed_token_ids=[3, 3, 1]).allowed_token_ids == [3, 1]  # offline too
    server.wait_idle()



def test_truncating_to_fit_fits(server, offline_small):
    """truncate_prompt_tokens -1 keeps max_model_len - 1 tokens, whatever max_tokens, which is then clamped to the
    one token left (vLLM 0.32's max_truncation_tokens and get_max_tokens); truncating to max_model_len leaves no
    room: vLLM's clamped "max_tokens must be at least 1, got 0"."""
    limit = server.engine.max_model_len
    for body in ({"max_tokens": 3}, {}):  # completions' default max_tokens 16 too
        r = _post(server.url, {"prompt": [5] * (limit + 50), "truncate_prompt_tokens": -1, "ignore_eos": True, **body})
        assert r.status_code == 200, r.text
        out = r.json()
        usage = out["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (limit - 1, 1, limit)
        assert out["choices"][0]["finish_reason"] == "length"
    err = _check_error(_post(server.url, {"prompt": [5] * (limit + 50), "truncate_prompt_tokens": limit}), 400,
                       "max_tokens")
    assert err["message"].startswith("max_tokens must be at least 1, got 0."), err
    out = offline_small.generate([[5] * 100], SamplingParams(max_tokens=4, truncate_prompt_tokens=-1,
                                                             ignore_eos=True), use_tqdm=False)
    assert len(out[0].prompt_token_ids) == offline_small.engine.max_model_len - 1
    assert len(out[0].outputs[0].token_ids) == 1 and out[0].outputs[0].finish_reason == "length"
    for path, body in (("/v1/completions", {"prompt": [5] * 4}), ("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "hi"}]})):  # more than max_model_len: vLLM's 400 (it was served whole)
        r = _post(server.url, {**body, "truncate_prompt_tokens": limit + 1, "max_tokens": 1}, path=path)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "truncate_prompt_tokens", r.text
        assert err["message"].startswith(f"truncate_prompt_tokens={limit + 1} cannot be greater than max_model_len")
    server.wait_idle()


# =========================================================================== the queue counts engine requests

def test_one_request_makes_at_most_max_engine_requests(server, monkeypatch):
    """Without --max-queue-len, a 16 MiB body of one-token prompts queued 3M engine requests (~6 GB; a
    200k-prompt body held the demo server for 42 s). prompts x n is bounded by entry.MAX_ENGINE_REQUESTS."""
    import nanoserve.entry as entry_mod
    assert server.args.max_queue_len is None
    monkeypatch.setattr(entry_mod, "MAX_ENGINE_REQUESTS", 6)
    err = _check_error(_post(server.url, {"prompt": [[5]] * 7, "max_tokens": 1}), 400, "prompt")
    assert "7 engine requests (7 prompt(s) x n=1)" in err["message"] and "in one request (6)" in err["message"]
    _check_error(_post(server.url, {"prompt": ["a", "b"], "n": 4, "max_tokens": 1}), 400, "n")
    r = _post(server.url, {"prompt": ["a", "b"], "n": 3, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 6, r.text
    server.wait_idle()


def test_max_queue_len_counts_prompts_times_n(tiny_model):
    with ServerThread(tiny_model, "--max-num-seqs", "1", "--max-queue-len", "4") as s:
        err = _check_error(_post(s.url, {"prompt": ["a", "b", "c", "d", "e"], "max_tokens": 1}), 400, "prompt")
        assert "5 engine requests" in err["message"] and "--max-queue-len 4" in err["message"]
        _check_error(_post(s.url, {"prompt": "a", "n": 5, "max_tokens": 1}), 400, "n")
        assert _post(s.url, {"prompt": ["a", "b"], "n": 2, "max_tokens": 1}).status_code == 200
        # hold the model step, so that queued requests stay queued
        release, execute = threading.Event(), s.engine.runner.execute
        s.engine.runner.execute = lambda seqs: release.wait(60) and execute(seqs)
        try:
            with httpx.Client(timeout=60) as c, c.stream("POST", s.url + "/v1/completions", json={
                    "prompt": ["a", "b", "c", "d"], "max_tokens": 1, "stream": True}) as r:
                assert r.status_code == 200
                deadline = time.monotonic() + 30
                while s.stats()["num_waiting"] < 3:  # one runs (held), three wait
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                busy = _post(s.url, {"prompt": ["e", "f"], "max_tokens": 1})
                assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
                release.set()
                assert sse_events(r.read().decode())
        finally:
            release.set()
            s.engine.runner.execute = execute
        assert _metrics(s.url)["nanoserve:request_rejected_total{code=429}"] == 1
        assert _metrics(s.url)["nanoserve:request_rejected_total{code=400}"] == 2
        s.wait_idle()


# =========================================================================== a failed step

VICTIM = [5, 6, 7, 8] * 10  # 40 tokens: two full blocks, registered in the prefix cache by its prefill


def _fail_the_victims_prefill(s: ServerThread):
    execute = s.engine.runner.execute
    state = {"armed": True, "failed": 0}

    def flaky(seqs):
        if state["armed"] and any(x.start == 0 and x.token_ids[:len(VICTIM)] == VICTIM for x in seqs):
            state["failed"] += 1
            raise RuntimeError("simulated device failure: secret-internal-detail")
        return execute(seqs)
    s.engine.runner.execute = flaky
    return state


def test_a_failed_step_ends_only_its_requests(tiny_model, offline):
    with ServerThread(tiny_model) as s:
        state = _fail_the_victims_prefill(s)
        r = _post(s.url, {"prompt": VICTIM, "max_tokens": 4})
        err = _check_error(r, 500, None)
        assert "secret" not in r.text and "RuntimeError" not in r.text and "model step" in err["message"]
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                          json={"prompt": VICTIM, "max_tokens": 4, "stream": True}) as stream:
            payloads = sse_events(stream.read().decode())
        error = json.loads(payloads[-2])["error"]
        assert error["code"] == 500 and "secret" not in payloads[-2]
        assert state["failed"] == 2
        s.wait_idle()  # their blocks are free
        # the engine carries on, and the victim's blocks were not left in the prefix cache half written
        assert httpx.get(s.url + "/health").status_code == 200
        state["armed"] = False
        got = _post(s.url, {"prompt": VICTIM, "max_tokens": 8, "temperature": 0}).json()["choices"][0]["text"]
        want = offline.generate([VICTIM], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert got == want[0].outputs[0].text
        assert _metrics(s.url)["nanoserve:request_rejected_total{code=500}"] == 1
        s.wait_idle()


class _BrokenDetokenizer:
    def step(self, token_id):
        raise RuntimeError("secret-internal-detail")


def test_a_request_whose_output_cannot_be_taken_in_fails_alone(offline, caplog):
    """A bug met by one request's output as its step lands (here its detokenizer raises) ends that request,
    with words that show no internals (its traceback goes to the log); the others in its steps end as they
    would without it, and LLM.generate raises RequestFailedError for it."""
    from nanoserve.engine import RequestFailedError
    engine, prompts = offline.engine, [[5, 9, 11, 3], [40, 41, 42], [100, 7, 7, 2]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, f"r{i}")
    engine.scheduler.requests["r1"].detokenizer = _BrokenDetokenizer()
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    failed, engine.failed_requests = engine.failed_requests, {}
    assert failed == {"r1": "taking in this request's output failed; the server log has the details"}
    assert "r1: taking in its output failed: RuntimeError: secret-internal-detail" in caplog.text
    want = offline.generate([prompts[0], prompts[2]], params, use_tqdm=False)
    assert finals == {"r0": want[0].outputs[0].token_ids, "r2": want[1].outputs[0].token_ids}
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks

    def broken_stop(req):
        raise RuntimeError("secret-internal-detail")
    engine._check_stop = broken_stop
    try:
        with pytest.raises(RequestFailedError, match="taking in this request's output failed"):
            offline.generate([prompts[0]], params, use_tqdm=False)
    finally:
        del engine._check_stop
    assert offline.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].token_ids == finals["r0"]


def test_a_request_whose_step_inputs_cannot_be_built_fails_alone(offline, caplog, monkeypatch):
    """A bug met by one request's step inputs (here its sampling row raises) ends that request before the
    step runs, with words that show no internals; the others, greedy and seeded, end as they would without
    it; the blocks its prefill was to write are free and not left in the prefix cache half written; and
    LLM.generate raises RequestFailedError for it."""
    from nanoserve.engine import Request, RequestFailedError
    real, armed = Request.sample_request, [True]

    def broken(req):
        if armed and req.prompt_token_ids == VICTIM:
            raise RuntimeError("secret-internal-detail")
        return real(req)
    monkeypatch.setattr(Request, "sample_request", broken)
    engine, prompts = offline.engine, [[5, 9, 11, 3], VICTIM, [100, 7, 7, 2]]
    assert offline.reset_prefix_cache()  # VICTIM's blocks from tests before
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True)]
    steps, execute = [], engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", lambda seqs: steps.append(len(seqs)) or execute(seqs))
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(prompt, p, f"r{i}")
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    failed, engine.failed_requests = engine.failed_requests, {}
    why = "building this request's step inputs failed; the server log has the details"
    assert failed == {"r1": why} and steps and max(steps) == 2  # r1 was in no step that ran
    assert "r1: building its step inputs failed: RuntimeError: secret-internal-detail" in caplog.text
    want = [offline.generate([prompts[i]], params[i], use_tqdm=False)[0].outputs[0].token_ids for i in (0, 2)]
    assert finals == {"r0": want[0], "r2": want[1]}
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    with pytest.raises(RequestFailedError, match="building this request's step inputs failed"):
        offline.generate([VICTIM], params[0], use_tqdm=False)
    armed.clear()
    hits = bm.prefix_cache_hits
    got = offline.generate([VICTIM], params[0], use_tqdm=False)[0].outputs[0].token_ids
    assert bm.prefix_cache_hits == hits  # its blocks were never written: no hit on them
    monkeypatch.undo()
    engine.scheduler.reset_prefix_cache()
    assert got == offline.generate([VICTIM], params[0], use_tqdm=False)[0].outputs[0].token_ids


def test_requests_that_fail_beside_served_ones_make_no_failed_step(offline, monkeypatch):
    """A step in which one request's inputs raise and another is served is no failed step: more of those
    in a row than MAX_CONSECUTIVE_STEP_FAILURES leave the engine running, and the served ones right."""
    import asyncio
    from nanoserve.engine import MAX_CONSECUTIVE_STEP_FAILURES, AsyncLLM, Request, RequestFailedError
    real = Request.sample_request
    monkeypatch.setattr(Request, "sample_request", lambda req: _broken() if req.prompt_token_ids == VICTIM
                        else real(req))
    params = SamplingParams(temperature=0, max_tokens=1)  # one step a round: no step of a's alone between

    async def serve():
        front, served = AsyncLLM(offline.engine), []
        front.start()
        try:
            for i in range(MAX_CONSECUTIVE_STEP_FAILURES + 1):
                qa, qb = asyncio.Queue(), asyncio.Queue()
                front.add_request([5, 9, 11, 3], params, f"a{i}", qa)  # both in the step that comes next
                front.add_request(VICTIM, params, f"b{i}", qb)
                assert isinstance(await asyncio.wait_for(qb.get(), 60), RequestFailedError)
                while not (out := await asyncio.wait_for(qa.get(), 60)).finished:
                    pass
                served.append(out.outputs[0].token_ids)
            return served, front.is_running
        finally:
            await front.shutdown()
    served, running = asyncio.run(serve())
    assert running and not offline.engine.has_unfinished_requests()
    monkeypatch.undo()
    want = offline.generate([[5, 9, 11, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert served == [want] * (MAX_CONSECUTIVE_STEP_FAILURES + 1)


def _broken(*args):
    raise RuntimeError("simulated failure: secret-internal-detail")


@pytest.mark.parametrize("where", ["model step", "inputs", "output"])
def test_repeated_failures_turn_health_503(tiny_model, monkeypatch, where):
    """Steps that raise, or that a bug met by every request of ends request by request (building its
    inputs, taking in its output), MAX_CONSECUTIVE_STEP_FAILURES in a row: the engine is dead."""
    from nanoserve.engine import Request
    with ServerThread(tiny_model) as s:
        s.app.state.server.request_shutdown = None  # keep it up, to ask it (the CLI test sees the exit)
        if where == "model step":
            s.engine.runner.execute = _broken
        elif where == "inputs":
            monkeypatch.setattr(Request, "sample_request", _broken)
        else:
            s.engine._check_stop = _broken
        for _ in range(3):
            _check_error(_post(s.url, {"prompt": "hi", "max_tokens": 2}), 500, None)
        r = httpx.get(s.url + "/health")
        _check_error(r, 503, None)
        r2 = _post(s.url, {"prompt": "hi", "max_tokens": 2})
        _check_error(r2, 503, None)
        assert "secret" not in r.text + r2.text and "RuntimeError" not in r.text + r2.text
        st = s.stats()
        assert st["num_running"] == st["num_waiting"] == 0 and st["num_free_blocks"] == st["num_total_blocks"]


BROKEN_CLI = """
import sys
import nanoserve.model
def broken(self, seqs):
    raise RuntimeError("simulated device failure")
nanoserve.model.ModelRunner.execute = broken
from nanoserve.entry import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_engine_that_cannot_recover_exits_1(tiny_model):
    proc = subprocess.Popen([sys.executable, "-c", BROKEN_CLI, "--model", str(tiny_model), "--dtype", "float32",
                             "--num-kv-blocks", "64", "--port", "0", "--disable-log-stats",
                             "--enforce-eager"],  # no decode attention compiled in the fresh process: ~4 s
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = next(line for line in proc.stdout if line.strip().startswith("URL")).split()[1]
        for _ in range(3):
            r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
            assert r.status_code == 500 and "Traceback" not in r.text
        assert proc.wait(timeout=60) == 1
        err = proc.stderr.read()
        assert "the engine cannot recover" in err and "[entry] shut down (exit status 1)" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# =========================================================================== connections

def test_idle_and_slow_connections_are_closed(tiny_model, monkeypatch):
    monkeypatch.setattr(entry, "HEADER_TIMEOUT_S", 0.3)
    with ServerThread(tiny_model) as s:
        s.app.state.server.body_timeout = 0.3
        assert 16 <= s.server.config.limit_concurrency <= 4096
        host, port = s.url.rsplit("/", 1)[1].split(":")
        with socket.create_connection((host, int(port)), timeout=60) as idle:  # sends nothing
            assert idle.recv(1024) == b""
        with socket.create_connection((host, int(port)), timeout=60) as slow:  # headers never complete
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            assert slow.recv(1024) == b""
        with socket.create_connection((host, int(port)), timeout=60) as no_body:  # the body never arrives
            no_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 100\r\n\r\n{")
            reply = b""
            while b"did not arrive" not in reply and (chunk := no_body.recv(65536)):  # headers, body may split
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.3 s" in reply
        assert httpx.get(s.url + "/health").status_code == 200


@pytest.mark.parametrize("raw", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nbroken header\r\n\r\n",
    b"GET /health\r\n\r\n",  # HTTP/0.9
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 40,  # TLS to a plain-HTTP port
])
def test_a_request_h11_cannot_parse_is_a_400_in_the_error_shape(server, raw):
    """uvicorn answered these in plain text ("Invalid HTTP request received.")."""
    host, port = server.url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(raw)
        reply = b""
        while chunk := sock.recv(65536):  # it closes the connection
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head, reply
    assert json.loads(body)["error"]["code"] == 400 and "not valid HTTP/1.1" in json.loads(body)["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_over_the_connection_limit_is_a_503_in_the_error_shape(server):
    """uvicorn's was plain text ("Service Unavailable"). Under a limit of 1 every request is over it: its own
    connection counts."""
    config, key = server.server.config, "nanoserve:request_rejected_total{code=503}"
    rejected = _metrics(server.url).get(key, 0)
    limit, config.limit_concurrency = config.limit_concurrency, 1  # read by each new connection
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        anthropic = httpx.post(server.url + "/v1/messages", json={})
        # a browser's preflight too (as uvicorn's limit): not an OK for a request that would be refused
        preflight = httpx.options(server.url + "/v1/completions", headers={
            "Origin": "http://page.example", "Access-Control-Request-Method": "POST"})
    finally:
        config.limit_concurrency = limit
    assert "connections" in _check_error(preflight, 503, None)["message"]
    assert preflight.headers["access-control-allow-origin"] == "*"  # the browser may read why
    assert "connections" in _check_error(r, 503, None)["message"] and r.headers["connection"] == "close"
    assert anthropic.status_code == 503 and anthropic.json()["error"]["type"] == "api_error"
    assert r.headers["x-request-id"] and _metrics(server.url)[key] == rejected + 3  # counted as every rejection
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    server.wait_idle()


def test_the_banner_url_takes_connections_before_uvicorn_has_started(tiny_model, monkeypatch, capsys):
    """A client that connects as soon as it reads the URL line waits for the server, never refused."""
    monkeypatch.setattr(entry, "configure_logging", lambda *levels: None)  # leave pytest's handlers alone
    connected = []

    async def serve(self, sockets):  # in place of uvicorn's: nothing accepts yet
        url = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("URL"))
        host, port = url.split()[1].rsplit("/", 1)[1].split(":")
        with socket.create_connection((host, int(port)), timeout=60):
            connected.append(port)
    monkeypatch.setattr(entry.Server, "serve", serve)
    assert entry.main(["--model", str(tiny_model), "--port", "0", "--disable-log-stats", "--dtype", "float32",
                       "--num-kv-blocks", "16", "--max-model-len", "64"]) == 0
    assert len(connected) == 1


def test_connections_turn_nagle_off():
    """bind_socket's socket named no protocol, so asyncio (which uvicorn serves it with) left Nagle's algorithm on
    for every connection, and an answer's body, written after its headers, waited for the client's delayed ACK:
    ~40 ms each JSON answer (the API fuzz found every request that slow). Now each connection has TCP_NODELAY."""
    async def accepted_nodelay() -> int:
        loop, sock = asyncio.get_running_loop(), entry.bind_socket("127.0.0.1", 0)
        seen = loop.create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                seen.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        server = await loop.create_server(Probe, sock=sock)  # as uvicorn's serve(sockets=...) does
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            nodelay = await asyncio.wait_for(seen, 60)
            writer.close()
        return nodelay
    assert asyncio.run(accepted_nodelay())


@pytest.mark.parametrize("held", ["grammar", "body", "tokenize", "lora"])
def test_a_request_still_being_admitted_at_the_drain_timeout_is_a_503(tiny_model, caplog, monkeypatch, held):
    """At the drain timeout a request the engine has not yet (its grammar still compiling, its body still
    arriving), or one the engine never has (/tokenize tokenizing, a LoRA adapter's load waiting for the model
    thread), ends as those in it do, with a 503 in the error shape, not uvicorn's cancellation DRAIN_GRACE_S
    later: a plain-text 500 and a traceback."""
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    s = ServerThread(tiny_model, *(["--enable-lora"] if held == "lora" else []), graceful=0.3)
    release, entered, result = threading.Event(), threading.Event(), {}
    so = s.engine.structured_outputs
    compile_ = so.compile

    def held_compile(spec):
        if spec is not None and spec.regex == "held[0-9]":
            entered.set()
            release.wait(60)
        return compile_(spec)
    so.compile = held_compile

    def holding(fn):  # on the tokenizer thread, or the model thread (which the shutdown waits for: see post)
        def held_fn(*args, **kwargs):
            entered.set()
            release.wait(60)
            return fn(*args, **kwargs)
        return held_fn
    s.engine.tokenize, s.engine.add_lora = holding(s.engine.tokenize), holding(s.engine.add_lora)

    def post():
        if held != "body":
            path, body = {"grammar": ("/v1/completions", {"prompt": "hi", "max_tokens": 4,
                                                          "structured_outputs": {"regex": "held[0-9]"}}),
                          "tokenize": ("/tokenize", {"prompt": "hi"}),
                          "lora": ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "x"})}[held]
            r = httpx.post(s.url + path, json=body, timeout=60)
            result["r"] = r.status_code, r.text
            release.set()  # answered: the held work may end (the server's shutdown waits for its model thread)
            return
        with socket.create_connection(("127.0.0.1", int(s.url.rsplit(":", 1)[1])), timeout=30) as c:
            c.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompt": ')
            entered.set()
            raw = b""
            while chunk := c.recv(65536):
                raw += chunk
            head, _, body = raw.partition(b"\r\n\r\n")
            result["r"] = int(head.split()[1]), body.decode()
    try:
        with s:
            worker = threading.Thread(target=post)
            worker.start()
            assert entered.wait(30)
            deadline = time.monotonic() + 30
            while not s.app.state.server.admitting:  # its handler is waiting (for the body, for the grammar)
                assert time.monotonic() < deadline
                time.sleep(0.01)
            s.stop()  # the drain: 0.3 s
            worker.join(30)
    finally:
        release.set()
    status, text = result["r"]
    assert status == 503 and "shutting down" in json.loads(text)["error"]["message"], text
    assert not any(rec.exc_info or "Traceback" in rec.getMessage() for rec in caplog.records)
    assert "shutdown: ending 1 request(s) not in the engine" in caplog.text


# =========================================================================== logs

def test_client_strings_cannot_forge_log_lines(server, caplog):
    caplog.set_level(logging.INFO, logger="nanoserve")
    forged = "\n2026-01-01 00:00:00 INFO [entry] forged"
    assert _post(server.url, {"prompt": "hi", "max_tokens": 1, "frob" + forged: 1}).status_code == 200
    _check_error(_post(server.url, {"prompt": "hi", "model": "m" + forged}), 404, "model")
    _check_error(httpx.post(server.url + "/v1/x%0Aforged"), 404, None)
    lines = [rec.getMessage() for rec in caplog.records]
    assert any("ignoring unknown field" in line for line in lines)
    assert not any("\n" in line for line in lines), lines


# =========================================================================== small fixes

def test_chat_template_kwargs_cannot_set_self(server):
    """A bound method's signature leaves ``self`` out, so it was not among the renderer's own arguments: the 400
    named messages and read "PreTrainedTokenizerBase.apply_chat_template() got multiple values for argument 'self'"."""
    for path in ("/v1/chat/completions", "/tokenize"):
        err = _check_error(_post(server.url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                              "chat_template_kwargs": {"self": 1}}, path), 400, "chat_template_kwargs")
        assert err["message"].startswith("chat_template_kwargs cannot set self:"), err
    server.wait_idle()


def test_a_template_error_without_words_is_named(offline_small):
    """A MemoryError has no message: the error read "cannot apply the chat template: " and stopped there."""
    with pytest.raises(ValueError, match=r"^cannot apply the chat template: MemoryError$"):
        offline_small.chat([{"role": "user", "content": "hi"}], chat_template="{{ (range(99999)|list) * 10**14 }}",
                           use_tqdm=False)
    assert not offline_small.engine.has_unfinished_requests()


def test_prefix_cache_queries_are_not_counted_with_caching_off(tiny_model):
    llm = LLM(str(tiny_model), dtype="float32", num_kv_blocks=32, max_model_len=128, enable_prefix_caching=False)
    llm.generate(["hello world", "hello world"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.stats()["prefix_cache_queries"] == 0 and llm.stats()["prefix_cache_hits"] == 0


def test_default_cpu_kv_cache_is_what_max_num_seqs_requests_can_use(tiny_model):
    llm = LLM(str(tiny_model), dtype="float32", max_num_seqs=3, max_model_len=100)
    assert llm.stats()["num_total_blocks"] == 3 * 7  # ceil(100 / 16) blocks a request


def test_building_an_engine_leaves_the_global_seed_alone(tiny_model):
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    LLM(str(tiny_model), dtype="float32", num_kv_blocks=16, max_model_len=64, seed=7)
    assert torch.equal(before, torch.get_rng_state())


# =========================================================================== memory

@pytest.mark.parametrize("tuning", [True, False])
def test_the_engine_trims_the_heap_each_time_it_goes_idle(tiny_model, monkeypatch, tuning):
    """glibc's own trimming is off while steps run (tune_process); the server's engine
    gives the freed memory back once each time it goes idle after steps, on its model
    thread, and never when the process settings are off."""
    import asyncio
    from nanoserve import cpu_backend
    from nanoserve.engine import AsyncLLM, EngineConfig, LLMEngine
    trims = []
    monkeypatch.setattr(cpu_backend, "trim_heap", lambda: trims.append(threading.current_thread().name))
    engine = LLMEngine(EngineConfig(model=str(tiny_model), dtype="float32", num_kv_blocks=32, max_model_len=128,
                                    cpu_allocator_tuning=tuning))

    async def run():
        async_llm = AsyncLLM(engine)
        async_llm.start()
        try:
            for i in range(2):
                await run_request(async_llm, "hello", SamplingParams(max_tokens=2), f"idle-{i}")
                for _ in range(1000):  # the engine trims after its last step: a deadline, not a timing
                    if not tuning or len(trims) > i:
                        break
                    await asyncio.sleep(0.01)
        finally:
            await async_llm.shutdown()
    asyncio.run(run())
    if tuning:
        assert len(trims) == 2 and trims[0] == trims[1] != threading.current_thread().name, trims
    else:
        assert trims == []


@pytest.mark.parametrize("body, param, message", [
    ({"repetition_detection": {"max_pattern_size": 2, "min_count": 3}, "repetition_min_count": 2},
     "repetition_detection", "not both"),
    ({"repetition_detection": {"max_pattern_size": 2, "count": 3}}, "repetition_detection",
     "unknown field(s) ['count']"),
    ({"repetition_detection": {"max_pattern_size": 2, "min_count": 1}}, "repetition_detection", "min_count >= 2"),
    # vLLM's older flat fields: the error names one of them (it named repetition_detection, which the body has not)
    ({"max_repetition_pattern_size": 1, "min_repetition_pattern_size": 2, "repetition_min_count": 2},
     "min_repetition_pattern_size", "0 <= min_repetition_pattern_size <= max_repetition_pattern_size"),
    ({"min_repetition_pattern_size": 3}, "min_repetition_pattern_size", "got max_repetition_pattern_size 0, "
                                                                        "min_repetition_pattern_size 3"),
    ({"max_repetition_pattern_size": 2}, "repetition_min_count", "repetition_min_count >= 2"),
    ({"max_repetition_pattern_size": -1}, "max_repetition_pattern_size", "max_repetition_pattern_size -1"),
])
def test_bad_repetition_detection_is_a_400_naming_it(server, body, param, message):
    err = _check_error(_post(server.url, {"prompt": "hi", "max_tokens": 2, **body}), 400, param)
    assert message in err["message"] and param in err["message"], err



def test_a_daemon_threads_error_is_never_logged_as_unretrieved(caplog):
    """A grammar compile's (or a template render's) future whose waiter left as it failed (its client gone:
    cancel_on_disconnect) is read once it ends, so asyncio never logs "Future exception was never retrieved"
    (the API fuzz saw that log when a disconnect met a failing compile); a waiter still gets the error."""
    import gc

    def fails():
        raise ValueError("cannot be compiled")

    async def main():
        left = entry.on_daemon_thread("test", fails)  # nobody awaits it: as a waiter that left
        waited = entry.on_daemon_thread("test", fails)
        with pytest.raises(ValueError, match="cannot be compiled"):
            await waited
        while not left.done():
            await asyncio.sleep(0.01)

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(main())
        gc.collect()
    assert "never retrieved" not in caplog.text
