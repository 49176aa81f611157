"""Structured outputs (xgrammar): with a tiny random model sampling at
temperature 1, the constraint, not the model, must make every output valid: JSON
that parses and fits its schema, a regex's full match, one of the choices, a
sentence of an EBNF grammar; also with n > 1, under preemption, and beside
unconstrained requests, whose outputs do not change. With a reasoning parser the
constraint starts after </think>, as vLLM's."""
from __future__ import annotations

import json
import re
import shutil
import time

import pytest

from conftest import make_model
from nanoserve import LLM, SamplingParams, StructuredOutputsParams
from nanoserve.engine import THINK_TAGS, StructuredOutputManager

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


def test_a_choice_beyond_the_bmp_is_its_own_text(llm):
    """A choice is its text's UTF-8: an emoji was the bytes of its two UTF-16 surrogates (ASCII-escaped into the
    grammar), six bytes no decoder reads, where vLLM's grammar has the emoji."""
    choices = ["😀", "é🙂 x", 'a"\\\n']
    assert set(sample(llm, StructuredOutputsParams(choice=choices))) <= set(choices)


def test_the_eos_that_completes_a_grammar_stays_out_of_the_text(llm):
    """Also where ignore_eos keeps the EOS from stopping the request: the grammar's end stops it, and the
    EOS's text (kept special tokens) stays out as it does when the EOS stops it."""
    texts = {}
    for kw in ({}, {"ignore_eos": True}):
        p = SamplingParams(temperature=0, max_tokens=20, skip_special_tokens=False,
                           structured_outputs=StructuredOutputsParams(choice=["yes", "no"]), **kw)
        (c,) = llm.generate(["hello"], p, use_tqdm=False)[0].outputs
        texts[str(kw)] = (c.text, c.finish_reason, c.token_ids[-1] in llm.engine.eos_token_ids)
    assert set(texts.values()) == {(texts["{}"][0], "stop", True)} and texts["{}"][0] in ("yes", "no"), texts


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
    (dict(structural_tag="{not json"), "structured_outputs.structural_tag cannot be compiled"),
    (dict(structural_tag={"type": "structural_tag", "format": {"type": "nope"}}),
     "structured_outputs.structural_tag cannot be compiled"),
    (dict(structural_tag={"structures": [{"begin": "<f>"}], "triggers": []}), 'the older form is {"structures"'),
])
def test_bad_specs_are_clear_errors(llm, spec, match):
    with pytest.raises(ValueError, match=re.escape(match)) as e:  # behind a good request: nothing is queued
        llm.generate(["ok", "hi"], [SamplingParams(max_tokens=2),
                                    SamplingParams(structured_outputs=StructuredOutputsParams(**spec))], use_tqdm=False)
    assert getattr(e.value, "param", None) == "structured_outputs"
    assert "/cpp/" not in str(e.value) and "Check failed" not in str(e.value)  # xgrammar's log prefix: not for clients
    assert llm.stats()["num_running"] == llm.stats()["num_waiting"] == 0


COLOURS = ["red", "green", "blue"]
TAG = {"type": "structural_tag", "format": {"type": "tag", "begin": "<f>", "end": "</f>",  # a JSON root has no spaces
                                            "content": {"type": "json_schema", "json_schema": {"enum": COLOURS}}}}
TAG_TEXTS = {f'<f>"{c}"</f>' for c in COLOURS}
LEGACY_TAG = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
              "triggers": ["<f"]}


def test_structural_tags_in_both_forms(llm):
    """xgrammar's form (here one tag, so every output is it) as JSON text or a dict; vLLM's older
    structures/triggers form: free text, and after a trigger its structure's begin, schema and end."""
    import xgrammar as xgr
    for tag in (json.dumps(TAG), TAG):
        texts = sample(llm, StructuredOutputsParams(structural_tag=tag))
        assert set(texts) <= TAG_TEXTS and len(set(texts)) > 1, texts
    compiled = llm.engine.structured_outputs.compile(StructuredOutputsParams(structural_tag=json.dumps(LEGACY_TAG)))
    good = json.dumps({"name": "ab", "ok": True, "tag": "red"})
    for text, accepted in ((f"any text <f>{good}</f> more", True), ("any text", True),
                           ('any text <f>{"name": 5}</f>', False), ("<f>plain</f>", False)):
        assert xgr.GrammarMatcher(compiled).accept_string(text) is accepted, text


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
    ("response_format", {"type": "structural_tag", "structures": "no"}, "response_format"),
    ("response_format", {"type": "structural_tag"}, "response_format"),
])
def test_http_bad_constraints_are_400s_naming_them(server, field, value, param):
    from test_server import _check_error
    _check_error(_post(server, "/v1/chat/completions", {**CHAT, field: value}), 400, param)


def test_http_structural_tags(server):
    """response_format {"type": "structural_tag", ...} in either form, as vLLM takes it."""
    for seed in SEEDS[:3]:
        r = _post(server, "/v1/chat/completions", {**CHAT, "seed": seed, "response_format": TAG})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] in TAG_TEXTS, r.text
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 8, "response_format": LEGACY_TAG})
    assert r.status_code == 200, r.text


def _streamed(server, path: str, body: dict) -> tuple[str, list[int], str, dict]:
    """A stream's text (or content), token ids (return_token_ids), last finish_reason and usage."""
    import httpx
    with httpx.stream("POST", server.url + path, json={**body, "stream": True, "stream_options": {
            "include_usage": True}}, timeout=120) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    text = "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in choices)
    return text, [t for c in choices for t in c.get("token_ids") or []], choices[-1]["finish_reason"], \
        chunks[-1]["usage"]


def test_http_a_request_left_without_a_token_stops_there(server):
    """Over HTTP, streamed and not: a grammar that has ended under min_tokens (chat), and
    allowed_token_ids whose next token would complete a bad word (completions), end with "stop"
    and only the tokens they allow: no EOS (id 0) before min_tokens, no token outside the list."""
    tok = server.engine.tokenizer
    (x,) = tok.encode("x", add_special_tokens=False)
    enum_a = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"enum": ["a"]}}}
    cases = [("/v1/chat/completions", {**CHAT, "temperature": 0, "max_tokens": 10, "min_tokens": 8,
                                       "response_format": enum_a}, tok.encode('"a"', add_special_tokens=False)),
             ("/v1/completions", {"prompt": "hello", "temperature": 0, "max_tokens": 8, "allowed_token_ids": [x],
                                  "bad_words": ["xx"]}, [x])]
    for path, body, want in cases:
        r = _post(server, path, {**body, "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        got = (text, choice["token_ids"], choice["finish_reason"], r.json()["usage"]["completion_tokens"])
        assert got == (tok.decode(want), want, "stop", len(want)), path
        text, ids, finish, usage = _streamed(server, path, {**body, "return_token_ids": True})
        assert (text, ids, finish, usage["completion_tokens"]) == got, path


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": "x", "bad_words": ["x"]}),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [0], "min_tokens": 2}),
    ("/v1/chat/completions", {**CHAT, "allowed_token_ids": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"enum": ["a"]}}}}),
])
def test_http_constraints_that_leave_no_first_token_are_400s(server, path, body):
    from test_server import _check_error
    if body["allowed_token_ids"] == "x":
        body = {**body, "allowed_token_ids": server.engine.tokenizer.encode("x", add_special_tokens=False)}
    err = _check_error(_post(server, path, body), 400, "allowed_token_ids")
    assert "leave no token to sample" in err["message"]
    assert server.engine.stats()["num_running"] == server.engine.stats()["num_waiting"] == 0


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



def test_a_compile_past_its_limit_is_a_400_and_holds_up_no_other(server, monkeypatch):
    """xgrammar cannot stop a compile, and a small schema can take minutes ({"pattern": "a{50000}"}: the time
    grows as the count squared). Past the limit the request is a 400 naming its field and the compile finishes on its
    own thread, while the next one compiles; two left running, a constraint is a 503 until one ends. The stuck
    compiles are held on an Event; the limit is tiny only while one of them is sent."""
    import threading
    from test_server import _check_error
    from nanoserve import entry
    so, state, release = server.engine.structured_outputs, server.app.state.server, threading.Event()
    compile_ = so.compile

    def held(spec):
        if spec is not None and (spec.regex or "").startswith("stuck"):
            assert release.wait(120)
        return compile_(spec)
    monkeypatch.setattr(so, "compile", held)

    def post(regex: str, limit: float):
        monkeypatch.setattr(entry, "GRAMMAR_COMPILE_TIMEOUT_S", limit)  # read as each request compiles
        return _post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 4, "guided_regex": regex})
    try:
        for i in range(entry.MAX_OVERDUE_COMPILES):
            assert post(f"fine{i}", 60).status_code == 200  # not behind those stuck before it
            err = _check_error(post(f"stuck{i}", 0.01), 400, "guided_regex")
            assert "guided_regex did not compile within 0.01 s" in err["message"], err
        assert state.compiles.overdue == entry.MAX_OVERDUE_COMPILES
        busy = post("fine", 60)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text
        assert post("fine0", 60).status_code == 200  # compiled before: no compile to wait for, so no 503
        assert _post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 2}).status_code == 200
    finally:
        release.set()
    deadline = time.monotonic() + 60
    while state.compiles.overdue:  # the stuck compiles end once released: a deadline, not a timing
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert post("fine", 60).status_code == 200
    assert threading.active_count() < 50  # each compile's thread has ended


# ---------------------------------------------------------------- after the reasoning (--reasoning-parser)

TAGGED = {"type": "object", "additionalProperties": False, "required": ["tag"],
          "properties": {"tag": {"enum": ["red", "blue"]}}}
YES_NO = StructuredOutputsParams(choice=["yes", "no"])
TAGGED_SPEC = StructuredOutputsParams(json=TAGGED, disable_any_whitespace=True)


@pytest.fixture(scope="module")
def think_model(model_root):
    """The tiny model with <think> and </think> as tokens of their own (added, not special: the text keeps
    them, as Qwen3's tokenizer does) and a template that closes the thought in the prompt when
    enable_thinking is false, as Qwen3's."""
    from transformers import AutoTokenizer
    out = model_root / "qwen3-think"
    if not out.exists():
        shutil.copytree(make_model(model_root, "qwen3"), out)
        tok = AutoTokenizer.from_pretrained(out)
        tok.add_tokens(list(THINK_TAGS))
        assert len(tok) <= 384  # the model's vocab_size: its embedding has rows for them already
        tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking "
                             "is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
        tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def think_llm(think_model):
    return LLM(str(think_model), dtype="float32", max_model_len=256, num_kv_blocks=64, reasoning_parser="deepseek_r1")


def tag_ids(engine) -> tuple[int, int]:
    """(</think>, x): logit_bias {x: 60, </think>: 30} with frequency_penalty 2 makes a greedy thought of
    x's (each one lowers the next x's score by 2) that ends with </think> once x falls under it."""
    tok = engine.tokenizer
    return tok.convert_tokens_to_ids(THINK_TAGS[1]), tok.encode("x")[0]


def greedy(llm, spec, bias, prompt="hello world", **kw):
    params = SamplingParams(**{"temperature": 0, "max_tokens": 60, "logit_bias": bias, "structured_outputs": spec, **kw})
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def test_the_grammar_waits_for_the_end_of_the_reasoning(think_llm, model_root):
    """The engine's hook: no bitmask and nothing fed to the grammar until </think> (itself not fed); the
    prompt's last think tag says whether it has already ended; without a parser, or without the tags
    as tokens, the grammar holds from the first token."""
    so, tok = think_llm.engine.structured_outputs, think_llm.get_tokenizer()
    start, end = so.think_ids
    compiled = so.compile(YES_NO)
    state = so.grammar_state(compiled, tok.encode("hi"))
    for t in tok.encode("hello <think>no"):  # text the grammar would refuse, and its own words: not fed
        assert state.next_token_bitmask() is None
        state.accept(t)
    state.accept(end)
    mask = state.next_token_bitmask()

    def allowed(t: int) -> bool:
        return bool(mask[t // 32] >> (t % 32) & 1)
    assert allowed(tok.encode("yes")[0]) and allowed(tok.encode("no")[0])
    assert not allowed(end) and not allowed(tok.encode("x")[0])
    for t in tok.encode("yes") + [tok.eos_token_id]:
        assert not state.is_terminated()
        state.accept(t)
    assert state.is_terminated()
    for prompt, waits in [("hi", True), ("<think>\n\n</think>\n\n", False), ("a</think>b<think>c", True),
                          ("<think>a</think>b", False)]:
        assert (so.grammar_state(compiled, tok.encode(prompt)).next_token_bitmask() is None) == waits, prompt
    vocab, eos = think_llm.engine.model_config.vocab_size, think_llm.engine.eos_token_ids
    assert StructuredOutputManager(tok, vocab, eos).grammar_state(compiled, [1]).next_token_bitmask() is not None
    from transformers import AutoTokenizer
    untagged = AutoTokenizer.from_pretrained(make_model(model_root, "qwen3"))
    assert StructuredOutputManager(untagged, vocab, eos, reasoning_parser="qwen3").think_ids is None
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, openai_gptoss, qwen3, got 'granite'"):
        LLM(str(make_model(model_root, "qwen3")), reasoning_parser="granite")


def test_reasoning_then_the_constrained_answer(think_llm, think_model):
    """deepseek_r1: the model thinks unconstrained, the answer after </think> fits the constraint (its mask
    beats the bias); a thought that never ends ends with length; a prompt that ended the thought is
    constrained from its first token. Without a parser the same requests are constrained throughout."""
    end, x = tag_ids(think_llm.engine)
    out = greedy(think_llm, YES_NO, {end: 100})
    assert out.token_ids[0] == end and out.text.partition(THINK_TAGS[1])[2] in ("yes", "no")
    for spec, fits in ((YES_NO, lambda t: t in ("yes", "no")), (TAGGED_SPEC, lambda t: parse(t)["tag"] in
                                                                    ("red", "blue"))):
        out = greedy(think_llm, spec, {x: 60, end: 30}, frequency_penalty=2.0)
        thought, tag, answer = out.text.partition(THINK_TAGS[1])
        assert re.fullmatch("x+", thought) and tag and fits(answer) and out.finish_reason == "stop", out.text
    out = greedy(think_llm, YES_NO, {x: 100}, max_tokens=5)
    assert (out.text, out.finish_reason) == ("xxxxx", "length")
    chat = SamplingParams(temperature=0, max_tokens=30, logit_bias={end: 100}, structured_outputs=YES_NO)
    (o,) = think_llm.chat([{"role": "user", "content": "hi"}], chat, chat_template_kwargs={"enable_thinking": False},
                          use_tqdm=False)
    assert end in o.prompt_token_ids and o.outputs[0].text in ("yes", "no")
    plain = LLM(str(think_model), dtype="float32", max_model_len=256, num_kv_blocks=64)
    assert greedy(plain, YES_NO, {end: 100}).text in ("yes", "no")
    assert greedy(plain, YES_NO, {x: 60, end: 30}, frequency_penalty=2.0).text in ("yes", "no")
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)  # unconstrained: as without a parser
    assert [o.outputs[0].token_ids for o in think_llm.generate(["hi", "def main():"], free, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in plain.generate(["hi", "def main():"], free, use_tqdm=False)]


def test_a_preempted_thought_resumes_where_it_was(think_llm, think_model):
    """8 blocks of 16 tokens for 6 requests of ~50: the batch preempts, mid-thought or mid-answer; each
    recomputed request goes on from its state: the same tokens as with room for all."""
    small = LLM(str(think_model), dtype="float32", max_model_len=128, num_kv_blocks=8, reasoning_parser="deepseek_r1")
    end, x = tag_ids(small.engine)
    prompts = [f"x {i} " * 8 for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=60, logit_bias={x: 60, end: 30}, frequency_penalty=2.0,
                            structured_outputs=TAGGED_SPEC)
    outs = [o.outputs[0] for o in small.generate(prompts, params, use_tqdm=False)]
    assert small.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == [o.outputs[0].token_ids for o in think_llm.generate(prompts, params,
                                                                                             use_tqdm=False)]
    assert all(re.fullmatch(r'x+</think>\{"tag": ?"(red|blue)"\}', o.text) for o in outs), [o.text for o in outs]


def test_thinking_token_budget_forces_the_end_of_the_thought(think_llm, llm):
    """vLLM's thinking_token_budget: after that many tokens since the last <think> (the prompt's
    included), </think> is the only token; the answer after it follows the grammar, as usual. No
    <think>: no count. Without a reasoning parser it is refused, naming the field."""
    end, x = tag_ids(think_llm.engine)
    start = think_llm.get_tokenizer().convert_tokens_to_ids(THINK_TAGS[0])
    for prompt, budget, at in (("hello <think>", 5, 5), ("hello <think>", 0, 0), ("hello <think>x x", 4, 1)):
        out = greedy(think_llm, None, {x: 100}, prompt=prompt, max_tokens=12, ignore_eos=True,
                     thinking_token_budget=budget)
        assert out.token_ids.index(end) == at and out.token_ids.count(end) == 1, (prompt, out.token_ids)
    out = greedy(think_llm, YES_NO, {x: 100}, prompt="hello <think>", thinking_token_budget=3)
    thought, tag, answer = out.text.partition(THINK_TAGS[1])
    assert thought == "xxx" and tag and answer in ("yes", "no"), out.text
    out = greedy(think_llm, None, {x: 100}, max_tokens=8, ignore_eos=True, thinking_token_budget=2)
    assert end not in out.token_ids  # "hello world": no thought to cut short
    out = greedy(think_llm, None, {x: 100, start: 200}, max_tokens=3, ignore_eos=True, thinking_token_budget=0,
                 prompt="hi </think>")
    assert out.token_ids == [start, end, start]  # each <think> opens a thought of 0 tokens
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None  # vLLM's "no budget"
    with pytest.raises(ValueError, match="thinking_token_budget needs a reasoning parser") as e:
        llm.generate(["hi"], SamplingParams(thinking_token_budget=4), use_tqdm=False)
    assert e.value.param == "thinking_token_budget"
    with pytest.raises(ValueError, match="thinking_token_budget must be"):
        SamplingParams(thinking_token_budget=-2)


@pytest.fixture(scope="module")
def think_server(think_model):
    from test_server import ServerThread
    with ServerThread(think_model, "--reasoning-parser", "deepseek_r1") as s:
        yield s


def test_http_thinking_token_budget(think_server):
    end, x = tag_ids(think_server.engine)
    r = _post(think_server, "/v1/completions", {"prompt": "hello <think>", "max_tokens": 6, "temperature": 0,
                                                 "logit_bias": {str(x): 100}, "thinking_token_budget": 2,
                                                 "return_token_ids": True})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"][2] == end, r.text


def test_http_reasoning_content_then_constrained_content(think_server):
    """reasoning_content holds the thought, content (or a forced call's arguments) the constrained answer,
    whole and streamed alike."""
    import httpx
    end, x = tag_ids(think_server.engine)
    thinking = {**CHAT, "temperature": 0, "max_tokens": 60, "logit_bias": {str(x): 60, str(end): 30},
                "frequency_penalty": 2.0}
    schema = {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": TAGGED}}}
    tool = {"tools": [{"type": "function", "function": {"name": "paint", "parameters": TAGGED}}],
            "tool_choice": {"type": "function", "function": {"name": "paint"}}}
    for extra in (schema, {"guided_choice": ["yes", "no"]}, tool):
        r = _post(think_server, "/v1/chat/completions", {**thinking, **extra})
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        msg = choice["message"]
        answer = msg["tool_calls"][0]["function"]["arguments"] if extra is tool else msg["content"]
        assert re.fullmatch("x+", msg["reasoning_content"]) and choice["finish_reason"] == "stop", msg
        assert answer in ("yes", "no") if "guided_choice" in extra else parse(answer)["tag"] in ("red", "blue")
        with httpx.stream("POST", think_server.url + "/v1/chat/completions", json={**thinking, **extra, "stream": True},
                          timeout=120) as r:
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                      if line.startswith("data: {") and json.loads(line[6:])["choices"]]
        streamed = ["".join(d.get(k) or "" for d in deltas) for k in ("reasoning_content", "content")]
        args = "".join(c["function"].get("arguments") or "" for d in deltas for c in d.get("tool_calls") or [])
        assert streamed == [msg["reasoning_content"], msg["content"] or ""] and args == (answer if extra is tool else "")
        if extra is tool:  # as vLLM's parse_delta: the call's first delta once the thought has ended, none before
            first = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
            assert not any(d.get("reasoning_content") for d in deltas[first + 1:]), deltas


def test_http_a_prompt_that_ended_the_thought_gives_content(think_server):
    """deepseek_r1 starts a reply in the reasoning, but where the prompt's last think tag is </think> (Qwen3's
    template with enable_thinking false) the grammar holds from the first token and the reply is content, as
    current vLLM reads it: not a JSON answer filed as reasoning with no content."""
    schema = {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": TAGGED}}}
    body = {**CHAT, "temperature": 0, "max_tokens": 60, "frequency_penalty": 2.0,  # no whitespace run
            "chat_template_kwargs": {"enable_thinking": False}, **schema}
    msg = _post(think_server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert msg["reasoning_content"] is None and parse(msg["content"])["tag"] in ("red", "blue"), msg


def test_http_reasoning_tokens_are_counted(think_server):
    """As vLLM's count_reasoning_tokens: the output tokens inside the thought (here the three before </think>;
    the tag itself not counted) are chat's completion_tokens_details.reasoning_tokens and the Responses API's
    output_tokens_details.reasoning_tokens, whole and streamed; without a parser chat has no such details."""
    import httpx
    end, x = tag_ids(think_server.engine)
    y, z = (think_server.engine.tokenizer.encode(c)[0] for c in "yz")
    # each token once (repetition_penalty halves a seen one's biased logit): x, y, z, </think>, then the answer
    bias = {str(x): 70, str(y): 65, str(z): 60, str(end): 50}
    same = {"temperature": 0, "logit_bias": bias, "repetition_penalty": 2.0,
            "structured_outputs": {"choice": ["yes", "no"]}}
    body = {**CHAT, **same, "max_tokens": 60}
    r = _post(think_server, "/v1/chat/completions", {**body, "return_token_ids": True}).json()
    ids, usage = r["choices"][0]["token_ids"], r["usage"]
    assert ids[:4] == [x, y, z, end] and len(ids) > 4, ids
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 3}
    with httpx.stream("POST", think_server.url + "/v1/chat/completions", timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert {**chunks[-1]["usage"], "prompt_tokens_details": None} == usage  # a stream's usage has no null details
    responses = {"input": "hi", **same, "max_output_tokens": 60}
    whole = _post(think_server, "/v1/responses", responses).json()
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message"]
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
    streamed = _post(think_server, "/v1/responses", {**responses, "stream": True}).text
    final = json.loads(streamed.rstrip().rpartition("data: ")[2])
    assert final["type"] == "response.completed" and final["response"]["usage"] == whole["usage"]
    state = think_server.app.state.server
    state.reasoning_parser = None
    try:
        assert _post(think_server, "/v1/chat/completions", body).json()["usage"]["completion_tokens_details"] is None
    finally:
        state.reasoning_parser = "deepseek_r1"


@pytest.mark.parametrize("name,prompt,tokens,want", [
    ("deepseek_r1", None, "xx/yy", 2), ("qwen3", None, "xx/yy", 0),  # R1 starts in the thought, qwen3 at <think>
    ("qwen3", None, "a<xx/y", 2), ("deepseek_r1", None, "<xx/y<z/", 2),  # after </think> all is content
    ("qwen3", "open", "xx/y", 2), ("deepseek_r1", "ended", "xx/y", 0), ("qwen3", None, "<x<x", 2),
    ("deepseek_r1", None, "", 0)])
def test_reasoning_tokens_as_the_parser_splits(name, prompt, tokens, want):
    """"<" and "/" stand for the <think> and </think> token ids: the tags are not counted, a <think> inside the
    thought changes nothing, the prompt's state is where counting starts; fed all at once or a token at a time."""
    from nanoserve.entry import ReasoningParser
    ids = [{"<": 1, "/": 2}.get(t, 3) for t in tokens]
    whole, stepped = (ReasoningParser(name, prompt=prompt, think_ids=(1, 2)) for _ in range(2))
    whole.count(ids)
    for t in ids:
        stepped.count([t])
    assert whole.num_reasoning_tokens == stepped.num_reasoning_tokens == want
    assert ReasoningParser(name, think_ids=None).num_reasoning_tokens == 0


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_the_reasoning_parser_starts_where_the_prompt_left_the_thought(name):
    """As the engine's prompt_reasoning says: "open" (a template that opens <think>, as Qwen3-Thinking-2507's)
    starts in the reasoning with either parser, "ended" makes all content; whole and streamed alike."""
    from nanoserve.entry import ReasoningParser
    text = 'plan</think>{"tag": "red"}'
    for prompt, want in (("open", ("plan", '{"tag": "red"}')), ("ended", (None, text))):
        assert ReasoningParser(name, prompt=prompt).extract(text) == want
        parser, parts = ReasoningParser(name, prompt=prompt), []
        parts = [parser.feed(text[i:i + 3], i + 3 >= len(text)) for i in range(0, len(text), 3)]
        assert ["".join(p[k] for p in parts) for k in (0, 1)] == [want[0] or "", want[1]]
    assert ReasoningParser("qwen3").extract(text) == (None, text)  # no tag in the prompt: qwen3 needs both
