"""No silent differences (issue 25): every field of vLLM's completion and chat
request schemas, sent to the running server with a value that asks for
something, is either honoured (a 200 whose output, or the SamplingParams and
prompt the engine received, reflect it) or refused with a 400 naming it.
Fields OpenAI or vLLM document as changing nothing here are accepted."""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading
import time

import httpx
import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.engine import Request
from nanoserve.entry import UNSUPPORTED_FIELDS, ChatCompletionRequest, CompletionRequest
import test_tools
from test_server import ServerThread, sse_events  # noqa: F401

# vLLM's request fields, pinned: the union of CompletionRequest and
# ChatCompletionRequest in vllm/entrypoints/openai/completion/protocol.py and
# vllm/entrypoints/openai/chat_completion/protocol.py at vllm-project/vllm
# d5dba2d7b0ab9b98096560c69db7126b54b14d79 and at the later
# 002032ee2b18e1f7bd924ec47b62504ba3866063 (which added session_id,
# watermarking, truncation_side, logprob_token_ids, thinking_token_budget,
# stream_interval, ... and dropped logits_processors and the repetition_* trio).
COMPLETION_FIELDS = [
    "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty",
    "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user", "use_beam_search", "top_k",
    "min_p", "repetition_penalty", "watermarking", "length_penalty", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "truncation_side", "allowed_token_ids", "prompt_logprobs", "logprob_token_ids", "bad_words", "prompt_embeds",
    "add_special_tokens", "response_format", "structured_outputs", "priority", "request_id", "session_id",
    "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "routed_experts_prompt_start",
    "return_token_offsets", "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params",
    "vllm_xargs", "max_repetition_pattern_size", "min_repetition_pattern_size", "repetition_min_count",
    "repetition_detection", "thinking_token_budget", "stream_interval"]
CHAT_FIELDS = [
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream", "stream_options",
    "temperature", "top_p", "tools", "tool_choice", "reasoning_effort", "thinking_token_budget", "include_reasoning",
    "parallel_tool_calls", "user", "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking",
    "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side",
    "prompt_logprobs", "logprob_token_ids", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template", "chat_template_kwargs",
    "media_io_kwargs", "mm_processor_kwargs", "structured_outputs", "priority", "request_id", "session_id",
    "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "routed_experts_prompt_start",
    "return_token_offsets", "return_prompt_text", "return_mm_kwargs", "cache_salt", "kv_transfer_params",
    "ec_transfer_params", "vllm_xargs", "max_repetition_pattern_size", "min_repetition_pattern_size",
    "repetition_min_count", "repetition_detection", "stream_interval",
    "structural_tag"]  # vLLM v0.10's (at 0052bed36509c7a5a2d8e48265334e40cf2f5a0e), later in structured_outputs
# Accepted, and change nothing: in OpenAI's words or vLLM's (a label; render endpoints only; the
# reasoning fields without a reasoning parser).
NO_OPS = {"user": "u-1", "session_id": "s-1", "return_token_offsets": True, "return_mm_kwargs": False,
          "include_reasoning": False,
          "spaces_between_special_tokens": False}  # fast tokenizers decode as they do (vLLM's detokenizer too)
# Honoured, and its effect checked by a test of its own (it needs a tool-call parser this server lacks).
TESTED_ELSEWHERE = {"parallel_tool_calls": (False, test_tools.test_parallel_tool_calls_false_keeps_the_first_call)}
# Refused with these values (each asks for something nanoserve does not do; thinking_token_budget, priority and
# prompt_embeds: not without --reasoning-parser, --scheduling-policy priority or --enable-prompt-embeds, which this
# server lacks; tested elsewhere).
REFUSED = {"suffix": " tail", "priority": 1, "watermarking": True, "logits_processors": ["my.Processor"],
           "prompt_embeds": "AAAA", "kv_transfer_params": {"do_remote_decode": True},
           "ec_transfer_params": {"x": 1}, "thinking_token_budget": 10, "routed_experts_prompt_start": 1,
           "media_io_kwargs": {"image": {}}, "mm_processor_kwargs": {"num_crops": 4}}

PROMPT = "The quick brown"
BASE = {"completions": {"prompt": PROMPT, "max_tokens": 4, "temperature": 0},
        "chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}}
TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
SAMPLED = {"temperature": 1.0, "seed": 1}  # truncations only stay in SamplingParams when not greedy


@pytest.fixture(scope="module")
def server(tiny_model):
    with ServerThread(tiny_model, "--trust-request-chat-template") as s:
        yield s


class Result:
    """One request: the response (a body, or a stream's events) and what the engine was handed."""

    def __init__(self, response: httpx.Response, calls: list):
        self.status, self.headers = response.status_code, response.headers
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            self.events = sse_events(response.text)
            self.body = None
        else:
            self.body, self.events = response.json(), None
        self.process = [c for c in calls if c[0] == "process"]
        self.prompts, self.params = [c[1] for c in calls if c[0] == "add"], [c[2] for c in calls if c[0] == "add"]

    @property
    def choice(self) -> dict:
        return self.body["choices"][0]

    @property
    def text(self) -> str:
        c = self.choice
        return c["text"] if "text" in c else c["message"]["content"]

    @property
    def sp(self):
        return self.params[0]


@contextlib.contextmanager
def recording(server):
    """What the handler hands the engine: process_prompt's arguments, add_request's prompt and params."""
    engine, calls = server.engine, []
    process, add = engine.process_prompt, engine.add_request

    def recorded_process(*args, **kw):
        calls.append(("process", *args))
        return process(*args, **kw)

    def recorded_add(prompt, params=None, *rest):
        calls.append(("add", prompt, params))
        return add(prompt, params, *rest)
    engine.process_prompt, engine.add_request = recorded_process, recorded_add
    try:
        yield calls
    finally:
        del engine.process_prompt, engine.add_request


def send(server, endpoint: str, body: dict) -> Result:
    with recording(server) as calls:
        r = httpx.post(f"{server.url}/v1/{endpoint.replace('chat', 'chat/completions')}", json=body, timeout=60)
    return Result(r, calls)


def carried(name, value=None):
    """The field reached SamplingParams under its own name."""
    return lambda r, v: r.sp.__getattribute__(name) == (v if value is None else value)


def _tokens_are(allowed):
    return lambda r, v: set(r.choice["token_ids"]) <= allowed and r.choice["token_ids"]


REPEAT = {"logit_bias": {"5": 100}, "return_token_ids": True}


def _ended_repeating(r, v) -> bool:
    c = r.choice
    return c["finish_reason"] == "repetition" and c["stop_reason"] == "repetition_detected" and \
        c["token_ids"] == [5, 5, 5]


def _chunk_sizes(r) -> list[int]:
    """How many tokens each chunk of a stream (with return_token_ids) carries."""
    chunks = [json.loads(e) for e in r.events if e != "[DONE]"]
    return [len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"] and c["choices"][0].get("token_ids")]


# field -> (value, what else the body needs, check(result, value)); per endpoint where they differ
HONOURED = {
    "model": ("SERVED", {}, lambda r, v: r.body["model"] == v),
    "prompt": ("hello world", {}, lambda r, v: r.sp is not None and r.process[0][1] == v),
    "messages": ([{"role": "user", "content": "hello there"}], {}, lambda r, v: "hello there" in r.process[0][1]),
    "frequency_penalty": (0.5, {}, carried("frequency_penalty")),
    "presence_penalty": (0.5, {}, carried("presence_penalty")),
    "repetition_penalty": (1.2, {}, carried("repetition_penalty")),
    "temperature": (0.7, {}, carried("temperature")),
    "top_p": (0.5, SAMPLED, carried("top_p")),
    "top_k": (5, SAMPLED, carried("top_k")),
    "min_p": (0.1, SAMPLED, carried("min_p")),
    "seed": (123, {}, carried("seed")),
    "logit_bias": ({"5": 100}, {"return_token_ids": True}, _tokens_are({5})),
    "max_tokens": (3, {"ignore_eos": True}, lambda r, v: r.body["usage"]["completion_tokens"] == 3),
    "max_completion_tokens": (3, {"ignore_eos": True}, lambda r, v: r.body["usage"]["completion_tokens"] == 3),
    "n": (2, SAMPLED, lambda r, v: len(r.body["choices"]) == 2),
    "stop": (["x"], {}, carried("stop")),
    "stream": (True, {}, lambda r, v: r.events[-1] == "[DONE]"),
    "stream_options": ({"include_usage": True}, {"stream": True},
                       lambda r, v: json.loads(r.events[-2])["usage"]["completion_tokens"] == 4),
    "stop_token_ids": ([7], {}, carried("stop_token_ids")),
    "include_stop_str_in_output": (True, {}, carried("include_stop_str_in_output")),
    "ignore_eos": (True, {}, carried("ignore_eos")),
    "min_tokens": (2, {}, carried("min_tokens")),
    "skip_special_tokens": (False, {}, carried("skip_special_tokens")),
    "truncate_prompt_tokens": (2, {}, lambda r, v: r.body["usage"]["prompt_tokens"] == 2),
    "allowed_token_ids": ([5, 6], {"return_token_ids": True}, _tokens_are({5, 6})),
    "bad_words": (["fox jumps"], {}, carried("bad_words")),
    "add_special_tokens": (False, {}, lambda r, v: r.process[0][3] is False),
    "response_format": ({"type": "json_object"}, {}, lambda r, v: r.sp.structured_outputs.json_object),
    "structured_outputs": ({"regex": "a+"}, {}, lambda r, v: r.sp.structured_outputs.regex == "a+"),
    "stream_interval": (3, {"stream": True, "return_token_ids": True, "ignore_eos": True},
                        lambda r, v: _chunk_sizes(r) == [1, 3]),  # max_tokens 4: the first token, then 3
    "vllm_xargs": ({"k": "v", "n": [1, 2.5]}, {}, lambda r, v: r.sp.extra_args == v),  # as vLLM's: for extensions
    # a greedy run of token 5 (its bias) is a 1-token pattern: it ends at its 3rd repeat, before max_tokens 4
    "repetition_detection": ({"max_pattern_size": 2, "min_count": 3}, REPEAT, _ended_repeating),
    "max_repetition_pattern_size": (2, {**REPEAT, "repetition_min_count": 3}, _ended_repeating),
    "min_repetition_pattern_size": (1, {**REPEAT, "max_repetition_pattern_size": 1, "repetition_min_count": 3},
                                    _ended_repeating),
    "repetition_min_count": (3, {**REPEAT, "max_repetition_pattern_size": 1}, _ended_repeating),
    "request_id": ("my-id-1", {}, lambda r, v: r.body["id"].endswith("-my-id-1")
                   and r.headers["x-request-id"] == "my-id-1"),
    "cache_salt": ("salt-1", {}, lambda r, v: r.prompts[0].cache_salt == "salt-1"),
    "use_beam_search": (True, {"n": 2}, lambda r, v: r.sp.beam_width == 2 and len(r.body["choices"]) == 2),
    "length_penalty": (0.5, {"use_beam_search": True}, carried("length_penalty")),  # tests/test_beam_search.py
}
COMPLETION_ONLY = {
    "logprob_token_ids": ([5, 6], {"return_tokens_as_token_ids": True}, lambda r, v: all(
        {"token_id:5", "token_id:6"} <= set(top) for top in r.choice["logprobs"]["top_logprobs"])),
    "return_tokens_as_token_ids": (True, {"logprobs": 1}, lambda r, v: all(
        t.startswith("token_id:") for t in r.choice["logprobs"]["tokens"])),
    "echo": (True, {}, lambda r, v: r.text.startswith(PROMPT)),
    "logprobs": (2, {}, lambda r, v: all(1 <= len(t) <= 3 for t in r.choice["logprobs"]["top_logprobs"])),
    "truncation_side": ("right", {"prompt": [11, 12, 13, 14], "truncate_prompt_tokens": 2, "return_token_ids": True},
                        lambda r, v: r.choice["prompt_token_ids"] == [11, 12]),
    "prompt_logprobs": (1, {}, lambda r, v: r.choice["prompt_logprobs"][0] is None
                        and len(r.choice["prompt_logprobs"]) == r.body["usage"]["prompt_tokens"]),
    "return_token_ids": (True, {}, lambda r, v: len(r.choice["token_ids"]) == r.body["usage"]["completion_tokens"]
                         and len(r.choice["prompt_token_ids"]) == r.body["usage"]["prompt_tokens"]),
}
CHAT_ONLY = {
    "logprob_token_ids": ([5, 6], {"logprobs": True, "return_tokens_as_token_ids": True}, lambda r, v: all(
        {"token_id:5", "token_id:6"} <= {t["token"] for t in item["top_logprobs"]}
        for item in r.choice["logprobs"]["content"])),
    "return_tokens_as_token_ids": (True, {"logprobs": True, "top_logprobs": 1}, lambda r, v: all(
        t["token"].startswith("token_id:") and t["top_logprobs"][0]["token"].startswith("token_id:")
        for t in r.choice["logprobs"]["content"])),
    "echo": (True, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}]},
             lambda r, v: r.text.startswith("Sure,") and r.body["prompt_logprobs"][0] is None),
    "logprobs": (True, {}, lambda r, v: len(r.choice["logprobs"]["content"]) == 4),
    "top_logprobs": (2, {"logprobs": True}, lambda r, v: all(len(i["top_logprobs"]) == 2
                                                             for i in r.choice["logprobs"]["content"])),
    "truncation_side": ("right", {"truncate_prompt_tokens": 2, "return_token_ids": True},
                        lambda r, v: r.body["prompt_token_ids"][0] == 1),  # <|im_start|>: the rendered prompt's first
    "prompt_logprobs": (1, {}, lambda r, v: r.body["prompt_logprobs"][0] is None
                        and len(r.body["prompt_logprobs"]) == r.body["usage"]["prompt_tokens"]),
    "return_token_ids": (True, {}, lambda r, v: len(r.choice["token_ids"]) == r.body["usage"]["completion_tokens"]
                         and len(r.body["prompt_token_ids"]) == r.body["usage"]["prompt_tokens"]),
    "return_prompt_text": (True, {}, lambda r, v: r.body["prompt_text"].startswith("<|im_start|>user\nhi")),
    "tools": (TOOL, {"tool_choice": "required"}, lambda r, v: r.sp.structured_outputs.json["type"] == "array"),
    "tool_choice": ({"type": "function", "function": {"name": "f"}}, {"tools": TOOL},
                    lambda r, v: r.sp.structured_outputs.json == TOOL[0]["function"]["parameters"]),
    "chat_template": ("[{{ messages[0].content }}]", {}, lambda r, v: r.process[0][1] == "[hi]"),
    "chat_template_kwargs": ({"who": "me"}, {"chat_template": "{{ who }}"}, lambda r, v: r.process[0][1] == "me"),
    # as vLLM's build_chat_params: the effort reaches the template, and "none" turns thinking off
    "reasoning_effort": ("none", {"chat_template": "{{ reasoning_effort }} {{ enable_thinking }}"},
                         lambda r, v: r.process[0][1] == "none False"),
    "documents": ([{"title": "t", "text": "x"}], {"chat_template": "{{ documents[0].title }}"},
                  lambda r, v: r.process[0][1] == "t"),
    "add_generation_prompt": (False, {}, lambda r, v: r.process[0][1] == "<|im_start|>user\nhi<|im_end|>\n"),
    "structural_tag": ('{"type": "structural_tag", "format": {"type": "const_string", "value": "ok"}}', {},
                       lambda r, v: r.text == "ok" and r.sp.structured_outputs.structural_tag == v),
    "continue_final_message": (True, {"messages": [{"role": "user", "content": "hi"},
                                                   {"role": "assistant", "content": "Sure,"}]},
                               lambda r, v: r.process[0][1].endswith("assistant\nSure,")),
}
CASES = {"completions": (COMPLETION_FIELDS, {**HONOURED, **COMPLETION_ONLY}),
         "chat": (CHAT_FIELDS, {**HONOURED, **CHAT_ONLY})}
ROWS = [(endpoint, f) for endpoint, (fields, _) in CASES.items() for f in fields]


@pytest.mark.parametrize("endpoint,field", ROWS, ids=[f"{e}-{f}" for e, f in ROWS])
def test_every_vllm_field_is_honoured_or_refused(server, endpoint, field):
    base = BASE[endpoint]
    if field in REFUSED:
        r = send(server, endpoint, {**base, field: REFUSED[field]})
        assert r.status == 400, r.body
        err = r.body["error"]
        assert err["param"] == field or field in err["message"], err
        return
    if field in NO_OPS or field in TESTED_ELSEWHERE:
        r = send(server, endpoint, {**base, field: NO_OPS[field] if field in NO_OPS else TESTED_ELSEWHERE[field][0]})
        assert r.status == 200 and r.params, r.body
        return
    value, extra, check = CASES[endpoint][1][field]
    value = server.args.served_model_name[0] if value == "SERVED" else value
    r = send(server, endpoint, {**base, **extra, field: value})
    assert r.status == 200, r.body
    assert check(r, value), (r.body or r.events)
    server.wait_idle()


def test_the_table_covers_every_field_and_none_is_ignored():
    """Each vLLM field has one row here, and the server declares it or refuses
    it by name: none falls through to "ignoring unknown field"."""
    for endpoint, (fields, cases) in CASES.items():
        schema = CompletionRequest if endpoint == "completions" else ChatCompletionRequest
        for f in fields:
            kinds = [f in REFUSED, f in NO_OPS, f in cases, f in TESTED_ELSEWHERE]
            assert sum(kinds) == 1, (endpoint, f, kinds)
            assert f in schema.model_fields or f in UNSUPPORTED_FIELDS, (endpoint, f)
    assert set(UNSUPPORTED_FIELDS) <= set(REFUSED)


def test_a_literal_fields_error_names_its_values(server):
    r = send(server, "chat", {**BASE["chat"], "reasoning_effort": "maximal"})
    assert r.status == 400 and r.body["error"]["param"] == "reasoning_effort", r.body
    assert r.body["error"]["message"] == ('reasoning_effort must be "none" or "minimal" or "low" or "medium" or '
                                          '"high" or "xhigh" or "max", got "maximal"'), r.body


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_refused_fields_at_their_default_are_accepted(server, endpoint):
    """A client that sends vLLM's defaults (beam search off, priority 0, ...) asks for nothing nanoserve lacks."""
    defaults = {"use_beam_search": False, "length_penalty": 1.0, "priority": 0, "watermarking": False,
                "logits_processors": None, "kv_transfer_params": None, "vllm_xargs": None,
                "max_repetition_pattern_size": 0, "thinking_token_budget": -1, "stream_interval": 1,
                "routed_experts_prompt_start": 0}
    r = send(server, endpoint, {**BASE[endpoint], **defaults})
    assert r.status == 200, r.body
    # vLLM reads these by their truth (`elif processors:`, `or None`): an empty one asks for nothing (once a 400)
    empty = {"logits_processors": [], "logprob_token_ids": [], "kv_transfer_params": {}, "ec_transfer_params": {},
             "vllm_xargs": {}, "media_io_kwargs": {}, "mm_processor_kwargs": {}}
    r = send(server, endpoint, {**BASE[endpoint], **empty})
    assert r.status == 200, r.body
    r = send(server, endpoint, {**BASE[endpoint], "vllm_xargs": []})  # of the wrong kind: no empty dict
    assert r.status == 400 and r.body["error"]["param"] == "vllm_xargs", r.body


def test_echo_with_logprobs_has_openais_legacy_shape(server):
    """The prompt's tokens lead tokens / token_logprobs / top_logprobs (the first
    has no logprob: null), text_offset runs on over prompt and completion, and the
    stream's first chunk carries the same; max_tokens 0 scores the prompt alone."""
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2,
            "return_token_ids": True}
    r = send(server, "completions", body)
    c, lp = r.choice, r.choice["logprobs"]
    n_prompt = len(c["prompt_token_ids"])
    assert r.sp.prompt_logprobs == 2 and c["text"].startswith(PROMPT)
    assert len(lp["tokens"]) == n_prompt + 3 and "".join(lp["tokens"]) == c["text"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
    assert all(1 <= len(t) <= 3 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    # the prompt's logprobs are the prompt_logprobs field's (which echo asked for)
    plp = send(server, "completions", {**body, "echo": False, "prompt_logprobs": 2}).choice["prompt_logprobs"]
    ids = c["prompt_token_ids"]
    assert lp["token_logprobs"][1:n_prompt] == [e[str(t)]["logprob"] for e, t in zip(plp[1:], ids[1:])]
    streamed = send(server, "completions", {**body, "stream": True})
    chunks = [json.loads(e)["choices"][0] for e in streamed.events[:-1]]
    assert "".join(ch["text"] for ch in chunks) == c["text"]
    assert [t for ch in chunks if ch["logprobs"] for t in ch["logprobs"]["tokens"]] == lp["tokens"]
    first = chunks[0]["logprobs"]  # the prompt and the first token (later offsets count the text streamed)
    assert first["text_offset"] == lp["text_offset"][:len(first["tokens"])] and len(first["tokens"]) > n_prompt
    scored = send(server, "completions", {**body, "max_tokens": 0}).choice
    assert scored["text"] == PROMPT and scored["logprobs"]["tokens"] == lp["tokens"][:n_prompt]
    assert scored["logprobs"]["token_logprobs"] == lp["token_logprobs"][:n_prompt]
    server.wait_idle()


def test_cache_salt_keeps_the_prefix_cache_apart(server):
    """As vLLM's: a salt starts the block hash chain, so only requests with the same salt share blocks."""
    prompt = list(range(10, 60))  # 3 full blocks of 16
    body = {"prompt": prompt, "max_tokens": 1}

    def hits(**kw) -> int:
        before = server.stats()["prefix_cache_hits"]
        assert send(server, "completions", {**body, **kw}).status == 200
        return server.stats()["prefix_cache_hits"] - before
    assert hits(cache_salt="a") == 0 and hits(cache_salt="a") == 48
    assert hits(cache_salt="b") == 0 and hits() == 0 and hits() == 48
    server.wait_idle()


def test_sampling_fields_offline(tiny_model):
    """allowed_token_ids, bad_words and truncate_prompt_tokens as SamplingParams (LLM's way in)."""
    llm = LLM(str(tiny_model), dtype="float32", num_kv_blocks=32, max_model_len=128)
    tok = llm.get_tokenizer()
    word = tok.encode(" main", add_special_tokens=False)
    assert len(word) == len(tok.encode("main", add_special_tokens=False)) == 1, "one token each, in the test vocabulary"

    def run(**kw):
        params = SamplingParams(**{"temperature": 0, "max_tokens": 4, "ignore_eos": True,
                                   "logit_bias": {word[0]: 100}, **kw})
        return llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert run().outputs[0].token_ids == word * 4  # the bias forces it...
    assert word[0] not in run(bad_words=["main"]).outputs[0].token_ids  # ...a bad word bans it, spaced too
    assert set(run(allowed_token_ids=[7, 8]).outputs[0].token_ids) <= {7, 8}
    ids = tok.encode(PROMPT)
    out = run(truncate_prompt_tokens=2)
    assert out.prompt_token_ids == ids[-2:] and out.prompt == tok.decode(ids[-2:])
    rid = llm.engine.add_request(PROMPT, SamplingParams(max_tokens=1, truncate_prompt_tokens=2))  # vLLM's engine way in
    assert llm.engine.scheduler.requests[rid].prompt_token_ids == ids[-2:]
    llm.engine.abort_request(rid)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens=129 cannot be greater than max_model_len = 128\."):
        run(truncate_prompt_tokens=129)  # vLLM's TokenizeParams: it was taken, as if no truncation was asked
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="bad_words"):  # not the tokenizer's TypeError, and before queueing any
        llm.generate([PROMPT] * 2, [SamplingParams(), SamplingParams(bad_words=["a\ud800"])], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_bad_words_are_tokenized_once_per_offline_request(tiny_model, monkeypatch):
    """LLM.generate tokenized each request's bad_words twice (the first-token check, then the
    request): once now, into nothing kept on the caller's SamplingParams (another LLM, another tokenizer)."""
    llm = LLM(str(tiny_model), dtype="float32", num_kv_blocks=32, max_model_len=128)
    tokenizer, words = llm.get_tokenizer(), []
    encode = tokenizer.encode

    def counted_encode(text, **kw):
        words.extend([text] * ("zebra" in text))
        return encode(text, **kw)
    monkeypatch.setattr(tokenizer, "encode", counted_encode)
    params = SamplingParams(max_tokens=1, bad_words=["zebra"])
    assert len(llm.generate([PROMPT] * 2, params, use_tqdm=False)) == 2
    assert sorted(words) == [" zebra"] * 2 + ["zebra"] * 2  # the word, and with a space: once per request
    words.clear()
    llm.engine.abort_request(llm.engine.add_request(PROMPT, params))  # vLLM's engine way in
    assert sorted(words) == [" zebra", "zebra"] and params._bad_words_token_ids is None


def test_bad_words_ban_a_words_last_token_after_the_rest():
    """vLLM's rule: a one-token word is always banned; a longer one's last token once the output ends in the rest."""
    req = Request("r", None, [1, 2], SamplingParams(), 10, frozenset(), None, bad_words_token_ids=[[283, 90], [5]])
    assert req.sample_request().banned_token_ids == [5]
    req.output_token_ids += [283, 7]
    assert req.sample_request().banned_token_ids == [5]
    req.output_token_ids.append(283)
    assert sorted(req.sample_request().banned_token_ids) == [5, 90]


def test_request_id_in_the_body(server):
    """vLLM's request_id field names the request unless X-Request-Id does; a duplicate is a 400 naming it."""
    body = {**BASE["completions"], "request_id": "body-id"}
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "header-id"}, timeout=60)
    assert r.json()["id"] == "cmpl-header-id" and r.headers["x-request-id"] == "header-id"
    release, execute = threading.Event(), server.engine.runner.execute
    server.engine.runner.execute = lambda seqs: release.wait(60) and execute(seqs)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, server.url + "/v1/completions", json={**body, "request_id": "dup"},
                                timeout=60)
            deadline = time.monotonic() + 10
            while not server.async_llm.queues and time.monotonic() < deadline:
                time.sleep(0.01)
            r = httpx.post(server.url + "/v1/completions", json={**body, "request_id": "dup"}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text
            release.set()
            assert first.result().json()["id"] == "cmpl-dup"
    finally:
        release.set()
        server.engine.runner.execute = execute
    for bad_id in ("a\nb", "a\x1b[31mb", " a", "x" * 1025, ""):  # what a log line or X-Request-Id cannot carry
        bad = httpx.post(server.url + "/v1/completions", json={**body, "request_id": bad_id}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id", (bad_id, bad.text)
    for any_id in ("a b", "résumé#1/x", "y" * 1024):  # any other string, as vLLM
        r = httpx.post(server.url + "/v1/completions", json={**body, "request_id": any_id}, timeout=60)
        assert r.json()["id"] == "cmpl-" + any_id and dict(r.headers.raw)[b"x-request-id"] == any_id.encode()
    server.wait_idle()


def test_chat_echo_streams_the_last_message_first(server):
    """As vLLM: with echo, the reply starts with the last message's content when
    it has the reply's role; a stream sends it in each choice's first content."""
    body = {**CHAT_ONLY["echo"][1], "max_tokens": 3, "temperature": 1.0, "echo": True, "stream": True, "n": 2}
    r = send(server, "chat", body)
    assert r.params[0].prompt_logprobs is None  # a stream has no room for them
    firsts = {}
    for e in r.events[:-1]:
        for c in json.loads(e)["choices"]:
            if c["delta"].get("content"):
                firsts.setdefault(c["index"], c["delta"]["content"])
    assert sorted(firsts) == [0, 1] and all(t.startswith("Sure,") for t in firsts.values())
    plain = send(server, "chat", {**BASE["chat"], "echo": True})  # a user message last: nothing to echo
    assert plain.status == 200 and plain.text == send(server, "chat", BASE["chat"]).text
    server.wait_idle()


# vLLM's pydantic models are lax: a value that stands for the field's type is that value.
LAX = [  # endpoint, fields, check(result)
    ("completions", {"max_tokens": 5.0}, lambda r: r.sp.max_tokens == 5),
    ("completions", {"max_tokens": "5"}, lambda r: r.sp.max_tokens == 5),
    ("completions", {"temperature": "0.5", "seed": "7"}, lambda r: (r.sp.temperature, r.sp.seed) == (0.5, 7)),
    ("completions", {"stream": 1}, lambda r: r.events[-1] == "[DONE]"),
    ("completions", {"logprobs": True}, lambda r: r.sp.logprobs == 1 and r.choice["logprobs"] is not None),
    ("completions", {"stop_token_ids": ["7"], "logit_bias": {"5": "1.5"}},
     lambda r: r.sp.stop_token_ids == [7] and r.sp.logit_bias == {5: 1.5}),
    ("completions", {"use_beam_search": "false", "priority": 0.0, "length_penalty": "1"}, lambda r: r.sp),
    ("chat", {"logprobs": "true", "top_logprobs": "2", "echo": 0}, lambda r: r.sp.logprobs == 2),
    # structured_outputs is vLLM's typed dataclass: json_object 0 asks for no JSON object (it once did)
    ("completions", {"structured_outputs": {"regex": "a+", "json_object": 0, "disable_any_whitespace": "false"}},
     lambda r: r.sp.structured_outputs.given() == ["regex"] and r.text.strip("a") == ""),
]


@pytest.mark.parametrize("endpoint,fields,check", LAX, ids=[f"{e}-{'-'.join(f)}" for e, f, _ in LAX])
def test_lax_types_as_vllms_pydantic(server, endpoint, fields, check):
    r = send(server, endpoint, {**BASE[endpoint], **fields})
    assert r.status == 200, r.body
    assert check(r), r.body or r.events
    server.wait_idle()


def test_lax_types_still_refuse_what_is_not_the_type(server):
    for endpoint, fields in (("completions", {"n": 2.5}), ("completions", {"max_tokens": "5.5"}),
                             ("completions", {"stream": "maybe"}), ("completions", {"stop_token_ids": True}),
                             ("completions", {"prompt": [1, "a"]}), ("completions", {"temperature": "inf"}),
                             ("completions", {"user": 5}), ("completions", {"priority": True}),
                             ("chat", {"logprobs": 2}), ("completions", {"structured_outputs": {"regex": 5}}),
                             ("completions", {"structured_outputs": {"json_object": "no"}}),
                             ("completions", {"structured_outputs": {"regex": "a", "disable_any_whitespace": "x"}})):
        r = send(server, endpoint, {**BASE[endpoint], **fields})
        assert r.status == 400 and r.body["error"]["param"] == next(iter(fields)), (fields, r.body)


def test_what_vllm_takes_and_the_template_sees(server):
    """vLLM's ways with a chat body: "model": "" is unset and a response names the first served
    name; logit_bias is clamped to [-100, 100]; stream_options {} without stream asks for nothing;
    tools [] is refused; an assistant's reasoning (or reasoning_content) reaches the template under
    both names; the request's chat_template_kwargs win over what reasoning_effort sets."""
    names = server.app.state.server.model_names
    names.append("alias")
    try:
        for model in ("", "alias"):
            r = send(server, "chat", {**BASE["chat"], "model": model})
            assert r.status == 200 and r.body["model"] == names[0], r.body
    finally:
        names.remove("alias")
    r = send(server, "chat", {**BASE["chat"], **SAMPLED, "logit_bias": {"5": 150, "6": -1e9}})
    assert r.status == 200 and r.sp.logit_bias == {5: 100.0, 6: -100.0}, r.body
    assert send(server, "completions", {**BASE["completions"], "stream_options": {}}).status == 200
    r = send(server, "chat", {**BASE["chat"], "tools": []})
    assert r.status == 400 and r.body["error"]["param"] == "tools", r.body
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a", "reasoning_content": "r"},
               {"role": "assistant", "content": "b", "reasoning": "s"}, {"role": "user", "content": "q"}]
    template = "{% for m in messages %}{{ m.reasoning }}{{ m.reasoning_content }},{% endfor %}{{ enable_thinking }}"
    r = send(server, "chat", {**BASE["chat"], "messages": history, "chat_template": template,
                              "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}})
    assert r.status == 200 and r.process[0][1] == ",rr,ss,,True", (r.body, r.process)
    r = send(server, "chat", {**BASE["chat"], "messages": [{"role": "assistant", "content": "", "reasoning": 5}]})
    assert r.status == 400 and "messages[0].reasoning must be a string" in r.body["error"]["message"], r.body
    server.wait_idle()


def test_max_tokens_null(server):
    """As vLLM: completions' explicit null is its default 16 (normalize_null_max_tokens), as a
    left-out max_tokens is; chat's null or absence both mean up to the context."""
    prompt = list(range(10, 246))  # 236 of max_model_len 256: room for 20
    for body in ({"max_tokens": None}, {}, {"max_tokens": None, "echo": True}):
        r = send(server, "completions", {"prompt": prompt, "ignore_eos": True, **body})
        assert r.status == 200 and r.sp.max_tokens == 16 and r.body["usage"]["completion_tokens"] == 16, r.body
    for body in ({}, {"max_tokens": None}, {"max_completion_tokens": None}):
        assert send(server, "chat", {"messages": BASE["chat"]["messages"], **body}).sp.max_tokens is None
    server.wait_idle()


def test_logprob_rules_as_vllms(server):
    """vLLM refuses only top_logprobs > 0 without logprobs, and prompt_logprobs > 0 in a stream; a stream
    with prompt_logprobs 0 carries none (as vLLM's chunks), and computes none."""
    r = send(server, "chat", {**BASE["chat"], "logprobs": False, "top_logprobs": 0})
    assert r.status == 200 and r.sp.logprobs is None and r.choice["logprobs"] is None, r.body
    for endpoint in ("completions", "chat"):
        r = send(server, endpoint, {**BASE[endpoint], "prompt_logprobs": 0, "stream": True})
        assert r.status == 200 and r.events[-1] == "[DONE]" and r.sp.prompt_logprobs is None
        assert not any("prompt_logprobs" in e for e in r.events)
        for value in (1, -1):
            r = send(server, endpoint, {**BASE[endpoint], "prompt_logprobs": value, "stream": True})
            assert r.status == 400 and r.body["error"]["param"] == "prompt_logprobs", r.body
    for fields in ({"top_logprobs": 1}, {"top_logprobs": -1}, {"logprobs": True, "top_logprobs": -1}):
        r = send(server, "chat", {**BASE["chat"], **fields})
        assert r.status == 400 and r.body["error"]["param"] == "top_logprobs", (fields, r.body)
    server.wait_idle()


def test_messages_as_vllms_chat_utils(server):
    """Any role reaches the chat template (which decides); parts vLLM reads as text are text, joined by
    newlines; a part without a type, or of another type, is a 400 naming messages (as vLLM's "Missing
    'type' field")."""
    parts = [{"type": "input_text", "text": "a"}, {"type": "refusal", "refusal": "b"}, "c",
             {"type": "thinking", "thinking": "d"}, {"type": "output_text", "text": "e"}, {"type": "text", "text": "f"}]
    r = send(server, "chat", {**BASE["chat"], "messages": [{"role": "function", "name": "f", "content": "x"},
                                                           {"role": "user", "content": parts}]})
    assert r.status == 200 and r.process[0][1].startswith("<|im_start|>function\nx<|im_end|>\n<|im_start|>user\n"
                                                          "a\nb\nc\nd\ne\nf<|im_end|>"), r.body or r.process
    template = '{% if messages[0].role not in ["user", "assistant"] %}{{ raise_exception("bad role") }}{% endif %}'
    r = send(server, "chat", {**BASE["chat"], "chat_template": template,
                              "messages": [{"role": "narrator", "content": "x"}]})
    assert r.status == 400 and "bad role" in r.body["error"]["message"], r.body
    for content in ([{"text": "a"}], [{"type": "image_url", "image_url": {"url": "http://x"}}], [{"type": "text"}],
                    [{"type": ["text"], "text": "a"}]):
        r = send(server, "chat", {**BASE["chat"], "messages": [{"role": "user", "content": content}]})
        assert r.status == 400 and r.body["error"]["param"] == "messages", (content, r.body)
    # null content: only an assistant's (vLLM's message types); a message without content is taken
    for role, status in (("user", 400), ("system", 400), ("tool", 400), ("assistant", 200)):
        r = send(server, "chat", {**BASE["chat"], "messages": [{"role": "user"}, {"role": role, "content": None}]})
        assert r.status == status, (role, r.body)
        assert status == 200 or "messages[1].content" in r.body["error"]["message"], r.body
    server.wait_idle()
