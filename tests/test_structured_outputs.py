"""Structured outputs (xgrammar): with a tiny random model sampling at
temperature 1, the constraint, not the model, must make every output valid: JSON
that parses and fits its schema, a regex's full match, one of the choices, a
sentence of an EBNF grammar; also with n > 1, under preemption, and beside
unconstrained requests, whose outputs do not change."""
from __future__ import annotations

import json
import re

import pytest

from conftest import make_model
from nanoserve import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "tag"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                         "tag": {"enum": ["red", "green", "blue"]}}}
SEEDS = range(6)


def parse(text: str):
    """JSON as xgrammar's grammar (and so vLLM's) defines it: control characters
    other than CR and LF may stand unescaped inside strings."""
    return json.loads(text, strict=False)


@pytest.fixture(scope="module")
def llm(model_root):
    return LLM(str(make_model(model_root, "qwen3")), dtype="float32", max_model_len=256, num_kv_blocks=128)


def sample(llm, spec: StructuredOutputsParams, prompt="The quick brown", n=1, all_stop=True) -> list[str]:
    """Texts of the outputs that the constraint ended (finish_reason "stop"); with
    ``all_stop`` every output must have ended so within max_tokens."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=120, n=n, structured_outputs=spec)
              for s in SEEDS]
    outs = [c for o in llm.generate([prompt] * len(params), params, use_tqdm=False) for c in o.outputs]
    stopped = [c.text for c in outs if c.finish_reason == "stop"]
    assert len(stopped) == len(outs) if all_stop else len(stopped) >= 2, [c.finish_reason for c in outs]
    return stopped


def fits_schema(doc) -> bool:
    return (isinstance(doc, dict) and set(doc) == {"name", "ok", "tag"} and isinstance(doc["name"], str)
            and len(doc["name"]) <= 6 and isinstance(doc["ok"], bool) and doc["tag"] in ("red", "green", "blue"))


def test_json_schema(llm):
    texts = sample(llm, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    assert all(fits_schema(parse(t)) for t in texts), texts
    assert len(set(texts)) > 1  # the model did sample: the outputs differ


def test_json_object_regex_choice_and_grammar(llm):
    # any JSON object has no length bound: a random model may still be inside one at max_tokens
    assert all(isinstance(parse(t), dict) for t in sample(llm, StructuredOutputsParams(json_object=True),
                                                          all_stop=False))
    assert all(re.fullmatch(r"[a-c]{2,5}", t) for t in sample(llm, StructuredOutputsParams(regex=r"[a-c]{2,5}")))
    choices = ["yes", "no", "maybe later"]
    assert all(t in choices for t in sample(llm, StructuredOutputsParams(choice=choices)))
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]'
    assert all(re.fullmatch(r"\(\d(\+\d)*\)", t) for t in sample(llm, StructuredOutputsParams(grammar=grammar)))


def test_n_and_the_dict_form(llm):
    texts = sample(llm, {"json": SCHEMA, "disable_any_whitespace": True}, n=3)
    assert len(texts) == 3 * len(SEEDS) and all(fits_schema(parse(t)) for t in texts)


def test_preempted_constrained_requests_end_valid(model_root):
    """8 blocks of 16 tokens for 6 requests of ~60: the batch preempts."""
    small = LLM(str(make_model(model_root, "qwen3")), dtype="float32", max_model_len=128, num_kv_blocks=8)
    texts = sample(small, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), prompt="x " * 12)
    assert small.stats()["num_preemptions"] > 0
    assert all(fits_schema(parse(t)) for t in texts)


def test_unconstrained_neighbours_are_unchanged(llm):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = ["hello world", "def main():", "The lazy dog"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    constrained = SamplingParams(temperature=1.0, seed=0, max_tokens=60,
                                 structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    mixed = llm.generate(prompts + ["x"], [greedy] * 3 + [constrained], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    assert mixed[3].outputs[0].text in ("a", "b")


@pytest.mark.parametrize("spec, match", [
    (dict(json="{not json"), "structured_outputs.json cannot be compiled"),
    (dict(grammar="root ::= "), "structured_outputs.grammar cannot be compiled"),
    (dict(regex="(unclosed"), "structured_outputs.regex cannot be compiled"),
    (dict(json=SCHEMA, regex="a"), "exactly one of"),
    (dict(), "exactly one of"),
    (dict(choice=[]), "choice must be a non-empty list of strings"),
])
def test_bad_specs_are_clear_errors(llm, spec, match):
    with pytest.raises(ValueError, match=re.escape(match)) as e:  # behind a good request: nothing is queued
        llm.generate(["ok", "hi"], [SamplingParams(max_tokens=2),
                                    SamplingParams(structured_outputs=StructuredOutputsParams(**spec))], use_tqdm=False)
    assert getattr(e.value, "param", None) == "structured_outputs"
    assert llm.stats()["num_running"] == llm.stats()["num_waiting"] == 0


def test_empty_constraints_are_constraints_as_in_vllm(llm):
    """vLLM tests each kind for None: json {} is any JSON value, regex "" the empty text."""
    texts = sample(llm, StructuredOutputsParams(json={}), all_stop=False)
    assert all(parse(t) is not None or t == "null" for t in texts)
    assert sample(llm, StructuredOutputsParams(regex="")) == [""] * len(SEEDS)


def test_compiled_grammars_are_cached_within_a_byte_bound(model_root):
    """Each distinct schema costs memory: the cache keeps the most recent ones up to its bound."""
    from nanoserve.engine import RECENT_GRAMMARS, StructuredOutputManager
    llm = LLM(str(make_model(model_root, "qwen3")), dtype="float32", max_model_len=64, num_kv_blocks=8)
    so = StructuredOutputManager(llm.engine.tokenizer, llm.engine.model_config.vocab_size, frozenset([0]),
                                 cache_bytes=100_000)
    assert so.compile(None) is None
    first = so.compile(StructuredOutputsParams(regex=r"[ab]{3}"))
    size = so.compiler.get_cache_size_bytes()
    assert so.compile(StructuredOutputsParams(regex=r"[ab]{3}")) is first  # a hit: nothing new kept
    assert 0 < size == so.compiler.get_cache_size_bytes()
    for i in range(60):
        so.compile(StructuredOutputsParams(json={"type": "object", "properties": {f"k{i}": {"type": "integer"}}}))
    assert so.compiler.get_cache_size_bytes() <= 110_000  # xgrammar's bound may be passed a little
    # the few most recent are held here too, whatever xgrammar's cache dropped (the server compiles
    # ahead on its grammar thread; the event loop's add_request must then find it, not compile again)
    assert len(so.recent) == RECENT_GRAMMARS and first not in so.recent.values()
    last = StructuredOutputsParams(json={"type": "object", "properties": {"k59": {"type": "integer"}}})
    assert so.compile(last) is so.recent[last.key()]


# ---------------------------------------------------------------- over HTTP

@pytest.fixture(scope="module")
def server(model_root):
    from test_server import ServerThread
    with ServerThread(make_model(model_root, "qwen3")) as s:
        yield s


def _post(server, path: str, body: dict):
    import httpx
    return httpx.post(server.url + path, json=body, timeout=120)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "max_tokens": 120}


def test_http_response_format_json_schema_and_json_object(server):
    for seed in SEEDS:
        r = _post(server, "/v1/chat/completions", {**CHAT, "seed": seed, "response_format": {
            "type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and fits_schema(parse(choice["message"]["content"]))
    r = _post(server, "/v1/completions", {"prompt": "x", "seed": 1, "max_tokens": 120, "temperature": 1.0,
                                          "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(parse(r.json()["choices"][0]["text"]), dict)


def test_http_vllm_fields_and_a_stream(server):
    import httpx
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 20, "temperature": 1.0, "seed": 3,
                                          "structured_outputs": {"regex": "[a-c]{2,5}"}})
    assert r.status_code == 200 and re.fullmatch(r"[a-c]{2,5}", r.json()["choices"][0]["text"]), r.text
    r = _post(server, "/v1/chat/completions", {**CHAT, "guided_choice": ["yes", "no"], "n": 3})
    assert r.status_code == 200 and all(c["message"]["content"] in ("yes", "no") for c in r.json()["choices"])
    body = {**CHAT, "seed": 2, "stream": True, "structured_outputs": {"json": SCHEMA}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    text = "".join(json.loads(x)["choices"][0]["delta"].get("content", "") for x in lines[:-1]
                   if json.loads(x)["choices"])
    assert fits_schema(parse(text))


@pytest.mark.parametrize("field, value, param", [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}},
     "response_format"),
    ("response_format", {"type": "json_schema"}, "response_format"),
    ("structured_outputs", {"regex": "a", "choice": ["b"]}, "structured_outputs"),
    ("structured_outputs", {"pattern": "a"}, "structured_outputs"),
    ("guided_grammar", "root ::= ", "guided_grammar"),
])
def test_http_bad_constraints_are_400s_naming_them(server, field, value, param):
    from test_server import _check_error
    _check_error(_post(server, "/v1/chat/completions", {**CHAT, field: value}), 400, param)


def test_a_slow_compile_does_not_hold_up_other_requests(server, monkeypatch):
    """A grammar compiles on a thread of its own: a request without one is tokenized and
    answered while a large constraint is still compiling."""
    import threading
    so, entered, release = server.engine.structured_outputs, threading.Event(), threading.Event()
    compile_ = so.compile

    def slow(spec):  # slow on the server's grammar thread (the engine's own call then hits the cache)
        if spec is not None and spec.regex == "slow[0-9]" and threading.current_thread().name.startswith(
                "nanoserve-grammar"):
            entered.set()
            assert release.wait(60)
        return compile_(spec)
    monkeypatch.setattr(so, "compile", slow)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", _post(server, "/v1/completions", {
        "prompt": "hi", "structured_outputs": {"regex": "slow[0-9]"}, "max_tokens": 10})))
    t.start()
    try:
        assert entered.wait(60)
        r = _post(server, "/v1/completions", {"prompt": "hello there", "max_tokens": 3})  # while it compiles
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert t.is_alive(), result["r"].text  # still compiling
    finally:
        release.set()
        t.join(60)
    assert re.fullmatch("slow[0-9]", result["r"].json()["choices"][0]["text"])
