"""A `vllm serve` command line and deployment against nanoserve: vLLM's flags
(taken, taken without effect and logged, or refused in one line), the API key
from $VLLM_API_KEY, CORS, X-Request-Id taken as it is sent, and /ping. Servers
are the tiny random Qwen3 of conftest on a loopback port (tests/test_server.py's
ServerThread)."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from nanoserve import entry
from nanoserve.entry import VLLM_FLAGS, configure_logging, engine_config, parse_args
from test_server import ServerThread, _check_error, server, sse_events  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(120)

KEY, ORIGIN = "vllm-s3cret", "https://ok.example"


@pytest.fixture(scope="module")
def vllm_server(tiny_model):
    """The key from $VLLM_API_KEY, one allowed origin with credentials, vLLM's request
    logging, logprobs without a cap (-1: the 384-token vocabulary), token ids as
    logprobs' tokens, one request running with two waiting at most, and usage's
    prompt_tokens_details."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("NANOSERVE_API_KEY", raising=False)
        mp.setenv("VLLM_API_KEY", KEY)
        s = ServerThread(tiny_model, "--allowed-origins", f'["{ORIGIN}"]', "--allow-credentials",
                         "--enable-log-requests", "--max-log-len", "5", "--max-logprobs", "-1",
                         "--return-tokens-as-token-ids", "--max-num-seqs", "1", "--max-queue-len", "2",
                         "--enable-prompt-tokens-details")
    with s:
        yield s


AUTH = {"Authorization": f"Bearer {KEY}"}


def _post(url: str, body: dict, path: str = "/v1/completions", **headers) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


# =========================================================================== the API key

def test_api_key_precedence_flag_then_nanoserve_then_vllm(monkeypatch):
    monkeypatch.delenv("NANOSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert parse_args([]).api_key is None
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert (parse_args([]).api_key, parse_args([]).api_key_from) == (["v"], "$VLLM_API_KEY")
    monkeypatch.setenv("NANOSERVE_API_KEY", "")  # empty is unset, as vLLM treats it
    assert parse_args([]).api_key == ["v"]
    monkeypatch.setenv("NANOSERVE_API_KEY", "n")
    assert (parse_args([]).api_key, parse_args([]).api_key_from) == (["n"], "$NANOSERVE_API_KEY")
    args = parse_args(["--api-key", "f"])
    assert (args.api_key, args.api_key_from) == (["f"], "--api-key")
    assert parse_args(["--api-key", "f", "g"]).api_key == ["f", "g"]  # vLLM's list: any of them


def test_vllm_api_key_is_required(vllm_server):
    url = vllm_server.url
    _check_error(_post(url, {"prompt": "hi", "max_tokens": 1}), 401, None)
    _check_error(httpx.get(url + "/v1/models"), 401, None)
    assert httpx.get(url + "/v1/models", headers=AUTH).status_code == 200
    for path in ("/health", "/ping", "/metrics", "/version"):
        assert httpx.get(url + path).status_code == 200, path


# =========================================================================== CORS

def _preflight(url: str, origin: str, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.options(url + path, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                              "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_preflight_and_headers_by_default(server):
    r = _preflight(server.url, "https://any.example")
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.get(server.url + "/v1/models", headers={"Origin": "https://any.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    r = _post(server.url, {"prompt": 5}, Origin="https://any.example")
    _check_error(r, 400, "prompt")
    assert r.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-origin" not in httpx.get(server.url + "/v1/models").headers  # no Origin


def test_credentials_for_every_origin_are_warned_of(caplog):
    caplog.set_level(logging.WARNING, logger="nanoserve")
    entry.cors_middleware(parse_args(["--allow-credentials", "--allowed-origins", '["https://ok.example"]']))
    assert not caplog.records
    entry.cors_middleware(parse_args(["--allow-credentials"]))  # "*", the default
    assert "any web site may make credentialed requests" in caplog.text


def test_cors_with_an_api_key_and_one_allowed_origin(vllm_server):
    url = vllm_server.url
    r = _preflight(url, ORIGIN)  # no key: a browser's preflight never has one
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert r.headers["access-control-allow-credentials"] == "true"
    assert _preflight(url, "https://evil.example").status_code == 400
    # the 401 of a request without the key carries the CORS headers, so that a page can read it
    r = _post(url, {"prompt": "hi", "max_tokens": 1}, Origin=ORIGIN)
    _check_error(r, 401, None)
    assert r.headers["access-control-allow-origin"] == ORIGIN and r.headers["x-request-id"]
    r = _post(url, {"prompt": "hi", "logprobs": "x"}, Origin=ORIGIN, **AUTH)
    _check_error(r, 400, "logprobs")
    assert r.headers["access-control-allow-origin"] == ORIGIN
    r = _post(url, {"prompt": "hi", "max_tokens": 1}, Origin=ORIGIN, **AUTH)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = _post(url, {"prompt": "hi", "max_tokens": 1}, Origin="https://evil.example", **AUTH)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    # an OPTIONS that is not a preflight passes the key check too, as in vLLM: the route has no OPTIONS
    _check_error(httpx.options(url + "/v1/completions"), 405, None)


def test_cors_headers_on_a_429(vllm_server):
    """Of two prompts one runs (its step held), one waits: two more do not fit."""
    s = vllm_server
    release, execute = threading.Event(), s.engine.runner.execute
    s.engine.runner.execute = lambda seqs: release.wait(60) and execute(seqs)
    try:
        with httpx.Client(timeout=60) as c, c.stream("POST", s.url + "/v1/completions", headers=AUTH, json={
                "prompt": ["a", "b"], "max_tokens": 1, "stream": True}) as r:
            deadline = time.monotonic() + 30
            while s.stats()["num_waiting"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            busy = _post(s.url, {"prompt": ["c", "d"], "max_tokens": 1}, Origin=ORIGIN, **AUTH)
            _check_error(busy, 429, None)
            assert busy.headers["access-control-allow-origin"] == ORIGIN
            release.set()
            assert sse_events(r.read().decode())
    finally:
        release.set()
        s.engine.runner.execute = execute
    s.wait_idle()


# =========================================================================== X-Request-Id

ODD_IDS = [b"a/b", b"abc#1", b"Root=1-65f0a1b2-abc;Parent=53995c3f;Sampled=1", b"x" * 500, b"has space",
           "\u00fcn\u00efc\u00f6d\u00e9".encode("latin-1"), b"\x1b[31mred\x85"]


@pytest.mark.parametrize("given", ODD_IDS, ids=range(len(ODD_IDS)))
def test_any_x_request_id_is_taken_and_echoed(server, given, caplog):
    caplog.set_level(logging.DEBUG, logger="nanoserve")
    headers = {b"X-Request-Id": given}
    for path in ("/health", "/ping", "/metrics", "/v1/models", "/version"):
        r = httpx.get(server.url + path, headers=headers)
        assert r.status_code == 200 and dict(r.headers.raw)[b"x-request-id"] == given, (path, r.headers.raw)
    r = httpx.post(server.url + "/v1/completions", headers=headers, json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert dict(r.headers.raw)[b"x-request-id"] == given
    shown = entry.esc(given.decode("latin-1"))  # what the engine and the logs name it
    assert r.json()["id"] == "cmpl-" + shown
    lines = [rec.getMessage() for rec in caplog.records]
    assert any(shown in line and "finished" in line for line in lines), lines
    assert all(line.isprintable() for line in lines), [line for line in lines if not line.isprintable()]
    server.wait_idle()


def test_an_x_request_id_over_1024_characters_is_a_400(server):
    """It would stand in every log line of the request: refused, naming the header, on any path."""
    assert httpx.get(server.url + "/health", headers={"X-Request-Id": "x" * entry.MAX_REQUEST_ID}).status_code == 200
    for path in ("/health", "/v1/completions"):
        r = httpx.request("GET" if path == "/health" else "POST", server.url + path, json={"prompt": "hi"},
                          headers={"X-Request-Id": "x" * (entry.MAX_REQUEST_ID + 1)})
        _check_error(r, 400, "X-Request-Id")
        assert len(r.headers["x-request-id"]) == 32  # one made for it, not the one refused


def test_an_id_with_hash_cannot_take_a_childs_place(server):
    """The engine names n's children id#i: "fam#1" running, "fam" with n=2 is a 400, not a 500, and leaves
    nothing behind."""
    server.delay = 0.01
    try:
        with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/completions", headers={
                "X-Request-Id": "fam#1"}, json={"prompt": "hi", "max_tokens": 200, "ignore_eos": True,
                                                "stream": True}) as first:
            lines = first.iter_lines()
            next(lines)  # in flight now
            r = _post(server.url, {"prompt": "hi", "max_tokens": 2, "n": 2}, **{"X-Request-Id": "fam"})
            err = _check_error(r, 400, None)
            assert "fam" in err["message"] and "in use" in err["message"]
    finally:
        server.delay = 0.0
    server.wait_idle()
    assert _post(server.url, {"prompt": "hi", "max_tokens": 2, "n": 2}, **{"X-Request-Id": "fam"}).status_code == 200


# =========================================================================== /ping

def test_ping_get_and_post(vllm_server):
    for method in ("GET", "POST"):
        r = httpx.request(method, vllm_server.url + "/ping")
        assert r.status_code == 200, (method, r.text)


def test_invocations_serve_chat_and_completions_without_the_key(vllm_server):
    """SageMaker's /invocations, as vLLM's: the body says which endpoint it is; no key asked for (SageMaker's
    InvokeEndpoint sends no Authorization header), as vLLM guards only /v1."""
    url = vllm_server.url + "/invocations"
    assert httpx.post(url, json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "temperature": 0}, headers=AUTH)
    assert r.json()["object"] == "text_completion" and r.json()["usage"]["completion_tokens"] == 2
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(url, json=chat, headers=AUTH)
    assert r.json()["object"] == "chat.completion" and r.json()["usage"]["completion_tokens"] == 2
    with httpx.stream("POST", url, json={**chat, "stream": True}, headers=AUTH) as s:
        assert sse_events(s.read().decode())[-1] == "[DONE]"
    _check_error(httpx.post(url, json={"input": "hi"}, headers=AUTH), 400, None)
    vllm_server.wait_idle()


# =========================================================================== flags that act

def test_max_logprobs_is_the_servers_limit_capped_by_the_vocabulary(vllm_server, server):
    r = _post(vllm_server.url, {"prompt": "hi", "max_tokens": 2, "logprobs": 25}, **AUTH)
    assert r.status_code == 200, r.text
    assert all(len(top) in (25, 26) for top in r.json()["choices"][0]["logprobs"]["top_logprobs"])  # + the chosen
    r = _post(vllm_server.url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                "logprobs": True, "top_logprobs": 30}, path="/v1/chat/completions", **AUTH)
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 30
    err = _check_error(_post(vllm_server.url, {"prompt": "hi", "logprobs": 500}, **AUTH), 400, "logprobs")
    assert "384" in err["message"]  # the vocabulary: there are no more tokens to rank
    err = _check_error(_post(vllm_server.url, {"prompt": "hi", "prompt_logprobs": 385}, **AUTH), 400,
                       "prompt_logprobs")
    # as vLLM's: -1 asks for the whole vocabulary (the sampled token's entry, outside the top, would add one)
    r = _post(vllm_server.url, {"prompt": "hi", "max_tokens": 1, "logprobs": -1, "prompt_logprobs": -1}, **AUTH)
    assert [len(top) for top in r.json()["choices"][0]["logprobs"]["top_logprobs"]] == [384], r.text
    assert {len(e) for e in r.json()["choices"][0]["prompt_logprobs"][1:]} == {384}
    r = _post(vllm_server.url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True,
                                "top_logprobs": -1}, path="/v1/chat/completions", **AUTH)
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 384, r.text
    r = _post(vllm_server.url, {"input": "hi", "max_output_tokens": 1, "include": ["message.output_text.logprobs"],
                                "top_logprobs": -1}, path="/v1/responses", **AUTH)  # vLLM's Responses takes it too
    part = r.json()["output"][-1]["content"][0]
    assert len(part["logprobs"][0]["top_logprobs"]) == 384 and r.json()["top_logprobs"] == -1, r.text  # echoed as sent
    _check_error(_post(vllm_server.url, {"prompt": "hi", "logprobs": -2}, **AUTH), 400, "logprobs")
    err = _check_error(_post(server.url, {"prompt": "hi", "logprobs": 21}), 400, "logprobs")
    assert "20" in err["message"]  # vLLM's default
    vllm_server.wait_idle()


def test_return_tokens_as_token_ids_is_the_default_a_request_may_change(vllm_server):
    body = {"prompt": "hi", "max_tokens": 3, "logprobs": 2}
    tokens = _post(vllm_server.url, body, **AUTH).json()["choices"][0]["logprobs"]["tokens"]
    assert tokens and all(t.startswith("token_id:") for t in tokens), tokens
    tokens = _post(vllm_server.url, {**body, "return_tokens_as_token_ids": False},
                   **AUTH).json()["choices"][0]["logprobs"]["tokens"]
    assert not any(t.startswith("token_id:") for t in tokens), tokens


def test_prompt_tokens_details_count_the_prefix_cache_hits(vllm_server, server):
    """As vLLM's --enable-prompt-tokens-details: cached_tokens, when some prompt tokens were
    cached (whole blocks of 16); without the flag, never."""
    body = {"prompt": list(range(1, 41)), "max_tokens": 2}
    first = _post(vllm_server.url, body, **AUTH).json()["usage"]
    assert first["prompt_tokens"] == 40 and first["prompt_tokens_details"] is None
    again = _post(vllm_server.url, body, **AUTH).json()["usage"]
    assert again["prompt_tokens_details"] == {"cached_tokens": 32}
    with httpx.stream("POST", vllm_server.url + "/v1/completions", headers=AUTH,
                      json={**body, "stream": True, "stream_options": {}}) as s:
        last = json.loads(sse_events(s.read().decode())[-2])
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    for _ in range(2):
        assert _post(server.url, body).json()["usage"]["prompt_tokens_details"] is None
    vllm_server.wait_idle()


def test_enable_log_requests_logs_the_prompt_up_to_max_log_len(vllm_server, caplog):
    caplog.set_level(logging.INFO, logger="nanoserve")
    r = _post(vllm_server.url, {"prompt": "hello world\nforged", "max_tokens": 1, "temperature": 0.5},
              **{**AUTH, "X-Request-Id": "logged-1"})
    assert r.status_code == 200
    line = next(rec.getMessage() for rec in caplog.records if "logged-1: prompt 0" in rec.getMessage())
    assert '"hello"' in line and "world" not in line and "temperature=0.5" in line, line
    assert "prompt_token_ids: [" in line


def test_disable_access_log_for_endpoints():
    """vLLM's --disable-access-log-for-endpoints: no access line for the paths named (their query aside)."""
    paths = parse_args(["--disable-access-log-for-endpoints", "/health, /metrics"]).disable_access_log_for_endpoints
    assert paths == {"/health", "/metrics"}  # spaces after the commas are not part of a path
    behind_proxy = parse_args(["--disable-access-log-for-endpoints", "/health", "--root-path", "/api"])
    assert behind_proxy.disable_access_log_for_endpoints == {"/health", "/api/health"}  # as the access line has it
    access = logging.getLogger("uvicorn.access")

    def logged(path: str) -> bool:
        record = access.makeRecord("uvicorn.access", logging.INFO, __file__, 0, '%s - "%s %s HTTP/%s" %d',
                                   ("127.0.0.1:1", "GET", path, "1.1", 200), None)
        return access.filter(record)
    configure_logging("info", None, paths)
    try:
        assert not logged("/health") and not logged("/metrics?x=1") and logged("/v1/models") and logged("/healthz")
    finally:
        configure_logging("info")
    assert logged("/health")


def test_uvicorn_trace_level():
    configure_logging("info", parse_args(["--uvicorn-log-level", "trace"]).uvicorn_log_level)
    try:
        assert logging.getLogger("uvicorn").level == 5
    finally:
        configure_logging("info")


# =========================================================================== flags taken without effect, or refused

TAKEN = [["--quantization", "fp8"], ["--quantization", "awq"], ["--trust-remote-code"], ["--no-trust-remote-code"],
         ["--enable-chunked-prefill"],
         ["--optimization-level", "3"], ["--no-enable-chunked-prefill"], ["--kv-cache-dtype", "auto"],
         ["--load-format", "safetensors"],
         ["--pipeline-parallel-size", "1"], ["--distributed-executor-backend", "mp"], ["--disable-custom-all-reduce"],
         ["--swap-space", "4.5"], ["--disable-log-requests"], ["--disable-fastapi-docs"],
         ["--enable-request-id-headers"], ["--disable-frontend-multiprocessing"], ["--tokenizer-mode", "auto"],
         ["--response-role", "assistant"],
         ["--data-parallel-size", "1"], ["--api-server-count", "1"],
         ["--enable-log-outputs"], ["--logprobs-mode", "raw_logprobs"],
         ["--cpu-offload-gb", "0.0"], ["--use-v2-block-manager"],
         ["--max-seq-len-to-capture", "8192"], ["--disable-async-output-proc"],
         ["--no-fully-sharded-loras"],
         ["--lora-dtype", "auto"]]
REFUSED = [["--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "fp8_e5m2"], ["--quantization", "bitsandbytes"],
           ["-q", "gguf"], ["--load-format", "pt"], ["-pp", "2"],
           ["--distributed-executor-backend", "ray"], ["--tokenizer-mode", "mistral"],
           ["--response-role", "bot"], ["-dp", "2"],
           ["--api-server-count", "4"], ["--logprobs-mode", "processed_logprobs"],
           ["--cpu-offload-gb", "2.5"],
           ["--tokenizer-revision", "v2"], ["--fully-sharded-loras"], ["--lora-dtype", "float16"]]


def test_scheduling_policy_priority_over_http(tiny_model, monkeypatch):
    """--scheduling-policy priority reaches the engine, and a body's priority its requests (each prompt's)."""
    with ServerThread(tiny_model, "--scheduling-policy", "priority") as s:
        assert s.engine.config.scheduling_policy == "priority"
        seen, add = [], s.engine.add_request
        monkeypatch.setattr(s.engine, "add_request", lambda *a: seen.append(a[4]) or add(*a))
        r = httpx.post(s.url + "/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2, "priority": -3})
        assert r.status_code == 200 and seen == [-3, -3], r.text
        r = httpx.post(s.url + "/v1/responses", json={"input": "a", "max_output_tokens": 2, "priority": 4})
        assert r.status_code == 200 and seen[-1] == 4, r.text  # vLLM's Responses body has it too
        s.wait_idle()


def test_stream_interval_flag(capsys):
    """vLLM's --stream-interval reaches the engine (it was taken only at 1); 0 is the CLI's one-line error."""
    assert engine_config(parse_args(["--model", "m", "--stream-interval", "4"])).stream_interval == 4
    assert engine_config(parse_args(["--model", "m"])).stream_interval == 1
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--stream-interval", "0"])
    assert "--stream-interval must be >= 1" in capsys.readouterr().err


def test_every_vllm_flag_of_the_table_is_tested():
    tested = {f for flags in TAKEN + REFUSED for f in flags if f.startswith("-")}
    assert {flag for flag, *_ in VLLM_FLAGS} <= tested


@pytest.mark.parametrize("flags", TAKEN, ids=[" ".join(f) for f in TAKEN])
def test_vllm_flags_taken_with_a_note(flags):
    args = parse_args(flags)
    assert len(args.vllm_notes) == 1 and args.vllm_notes[0].startswith(" ".join(flags) + " (a vLLM flag) does "
                                                                       "nothing here: "), args.vllm_notes


@pytest.mark.parametrize("flags", REFUSED, ids=[" ".join(f) for f in REFUSED])
def test_vllm_flags_refused_in_one_line(flags, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and f"{flags[-1]} is not supported: " in err, err


def test_vllm_flags_that_act_or_already_exist_parse():
    args = parse_args(["--enable-prefix-caching", "--generation-config", "vllm", "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes", "--uvicorn-log-level", "warning", "--max-logprobs", "5",
                       "--return-tokens-as-token-ids", "--enable-log-requests", "--max-log-len", "100",
                       "--allowed-origins", '["https://a.example"]', "--allowed-methods", '["GET", "POST"]',
                       "--allowed-headers", '["*"]', "--allow-credentials"])
    assert args.vllm_notes == [] and args.max_logprobs == 5 and args.allowed_methods == ["GET", "POST"]
    assert entry.engine_config(args).max_logprobs == 5


def test_hf_overrides_reach_the_model_config(tiny_model, caplog):
    """vLLM's --hf-overrides / LLM(hf_overrides=...): config.json keys laid over the
    checkpoint's, for rank 0, the other ranks' specs and the CLI alike; logged."""
    import torch

    from nanoserve import LLM
    from nanoserve.engine import worker_specs
    from nanoserve.model import ModelConfig
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256}
    given = '{"rope_scaling": %s, "eos_token_id": 7}' % json.dumps(yarn)
    config = entry.engine_config(parse_args(["--hf-overrides", given, "--model", str(tiny_model)]))
    assert config.hf_overrides == {"rope_scaling": yarn, "eos_token_id": 7}
    with caplog.at_level(logging.INFO, logger="nanoserve"):
        llm = LLM(str(tiny_model), dtype="float32", num_kv_blocks=64, hf_overrides=config.hf_overrides)
    mc = llm.engine.model_config
    assert mc.rope_scaling["rope_type"] == "yarn" and mc.eos_token_ids == [7] and llm.engine.max_model_len == 512
    # the checkpoint has transformers 5's rope_parameters: the override in 4's form replaces them, theta kept
    assert "rope_parameters" in json.loads((tiny_model / "config.json").read_text())
    assert mc.rope_theta == ModelConfig.from_dir(tiny_model).rope_theta
    assert caplog.text.count("config.json overridden (hf_overrides)") == 1
    assert worker_specs(config, "tcp://127.0.0.1:1", torch.device("cpu"), torch.float32)[0].hf_overrides == \
        config.hf_overrides


def test_hf_overrides_that_break_the_config_are_one_line(tiny_model, capsys):
    from nanoserve import LLM
    from nanoserve.model import ModelLoadError
    with pytest.raises(ModelLoadError, match="with --hf-overrides cannot be read as a model config: KeyError"):
        LLM(str(tiny_model), hf_overrides={"rope_scaling": {"rope_type": "linear"}, "rope_parameters": None})
    for key, value, what in (("rope_scaling", 5, "an object"), ("rms_norm_eps", "x", "a positive number"),
                             ("rms_norm_eps", -1, "a positive number"), ("rope_theta", [1], "a positive number"),
                             ("tie_word_embeddings", "yes", "true or false"), ("sliding_window", "x",
                                                                                "a non-negative integer"),
                             ("hidden_act", 5, "a string")):
        with pytest.raises(ModelLoadError, match=rf"config.json's {key} {re.escape(repr(value))} must be {what}$"):
            LLM(str(tiny_model), hf_overrides={key: value})  # rms_norm_eps "x" was taken, and failed in a forward
    with pytest.raises(ModelLoadError, match="unsupported rope type 'dynamic'"):
        LLM(str(tiny_model), hf_overrides={"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    for bad in ({"vocab_size": -1}, {"num_hidden_layers": 0}, {"hidden_size": 64.0}, {"head_dim": True}):
        with pytest.raises(ModelLoadError, match=rf"{next(iter(bad))} .*: sizes must be positive integers"):
            LLM(str(tiny_model), hf_overrides=bad)  # vocab_size -1 was torch's RuntimeError from the embedding
    with pytest.raises(SystemExit) as e:
        parse_args(["--hf-overrides", "[1]"])
    assert e.value.code == 2 and "argument --hf-overrides: expected a JSON object" in capsys.readouterr().err


def test_vllm_spellings_of_flags_and_token_counts():
    """vLLM's parser takes --a_b for --a-b, and token counts as human_readable_int: 32k is 32,000,
    32K is 32,768; --max-model-len auto (or -1) is the default."""
    a = parse_args(["--max_model_len=32k", "--max_num_batched_tokens", "2K", "--override-generation-config",
                    '{"temperature": 0.5}', "--default_chat_template_kwargs", '{"enable_thinking": false}',
                    "--enable-force-include-usage"])
    assert (a.max_model_len, a.max_num_batched_tokens, a.enable_force_include_usage) == (32000, 2048, True)
    assert entry.engine_config(a).override_generation_config == {"temperature": 0.5}
    assert a.default_chat_template_kwargs == {"enable_thinking": False} and a.host == "0.0.0.0"  # vLLM's: all
    for text, want in (("4096", 4096), ("1.5M", 1572864), ("25.6k", 25600), ("auto", None), ("-1", None)):
        assert parse_args(["--max-model-len", text]).max_model_len == want, text
    assert entry.engine_config(parse_args(["--num-gpu-blocks-override", "64"])).num_kv_blocks == 64  # vLLM's name


def test_compilation_config_and_O_flags(capsys):
    """vLLM's --compilation-config (-cc; a JSON object, or a level) is read by the function that reads
    LLM(compilation_config=...); -O3, -O 3 and -O=3 are vLLM's --optimization-level, taken with a note."""
    from nanoserve.engine import VLLM_ENGINE_ARGS
    given = '{"cudagraph_capture_sizes": [1, 2, 4, 8], "max_cudagraph_capture_size": 8, "level": 3}'
    for flag in ("--compilation-config", "-cc", "--compilation_config"):
        c = entry.engine_config(parse_args([flag, given]))
        assert (c.cudagraph_capture_sizes, c.max_cudagraph_capture_size) == ([1, 2, 4, 8], 8), flag
    assert entry.engine_config(parse_args(["-cc", "3", "-O3"])).cudagraph_capture_sizes is None
    note = f"--optimization-level 3 (a vLLM flag) does nothing here: {VLLM_ENGINE_ARGS['optimization_level'][2]}"
    for flags in (["-O3"], ["-O", "3"], ["-O=3"], ["--optimization-level", "3"]):
        assert parse_args(flags).vllm_notes == [note], flags
    for flags, why in ((["-cc", '{"cudagraph_mode": "FULL"}'], "compilation_config['cudagraph_mode'] is not supported"),
                       (["-cc", '{"cudagraph_capture_sizes": [1]}', "--cudagraph-capture-sizes", "2"],
                        "cudagraph_capture_sizes is given twice"),
                       (["-cc", "[1]"], "argument --compilation-config/-cc: expected a JSON object"),
                       (["-Ofast"], "argument -O/--optimization-level: invalid int value: 'fast'")):
        with pytest.raises(SystemExit) as e:
            parse_args(flags)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and why in err, err


def test_token_budget_below_max_num_seqs(capsys):
    """As vLLM's SchedulerConfig: max_num_batched_tokens < max_num_seqs is refused (chunked prefill or
    not; a step has a token of each running request), by LLM() and the CLI alike; an unset
    max_num_seqs follows a small budget down instead (vLLM's default), an unset budget a large max_num_seqs up."""
    from nanoserve import LLM
    from nanoserve.engine import EngineConfig
    why = "max_num_batched_tokens (12) must be >= max_num_seqs (64)"
    for chunked in (True, False):  # before any loading: the model is not looked at
        with pytest.raises(ValueError) as e:
            LLM("no/such-model", max_num_seqs=64, max_num_batched_tokens=12, enable_chunked_prefill=chunked)
        assert why in str(e.value), str(e.value)
    with pytest.raises(SystemExit) as e:
        parse_args(["--max-num-seqs", "64", "--max-num-batched-tokens", "12"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and why in err, err
    for kw, want in (({}, (256, 8192)), ({"max_num_batched_tokens": 12}, (12, 12)),
                     ({"max_num_seqs": 12, "max_num_batched_tokens": 12}, (12, 12)),
                     ({"max_num_seqs": 9000}, (9000, 9000))):
        c = EngineConfig("m", **kw)
        assert (c.max_num_seqs, c.max_num_batched_tokens) == want, kw
    a = parse_args(["--max-num-batched-tokens", "32"])
    assert entry.engine_config(a).max_num_seqs == 32


def test_forced_usage_rides_every_stream(server):
    """--enable-force-include-usage: a stream that asks for nothing still carries usage, in each
    chunk and in a last chunk of its own (vLLM's should_include_usage)."""
    state = server.app.state.server
    state.force_include_usage = True
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True})
    finally:
        state.force_include_usage = False
    events = [json.loads(e) for e in sse_events(r.text)[:-1]]  # [DONE] last
    assert all("usage" in e for e in events) and events[-1]["choices"] == [], events
    assert events[-1]["usage"]["completion_tokens"] == 3
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True})
    assert not any("usage" in e for e in sse_events(r.text))


@pytest.mark.parametrize("flags", [["--allowed-origins", "*"], ["--allowed-origins", '"*"'],
                                   ["--allowed-headers", "[1]"], ["--max-logprobs", "-2"],
                                   ["--max-model-len", "32q"], ["--override-generation-config", "[1]"],
                                   ["--ssl-keyfile", "key.pem"], ["--ssl-certfile", "/no/such/cert.pem"]])
def test_bad_values_are_one_line_errors(flags, capsys):
    with pytest.raises(SystemExit):
        parse_args(flags)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flags[0] in err, err


def test_https_with_vllms_ssl_flags(tiny_model, tmp_path):
    """--ssl-certfile and --ssl-keyfile, as vLLM's: the server speaks HTTPS (and plain HTTP no more)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a self-signed certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    with ServerThread(tiny_model, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)) as s:
        url = s.url.replace("http://", "https://")
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       verify=ssl.create_default_context(cafile=cert), timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        with pytest.raises(httpx.HTTPError):
            httpx.get(s.url + "/health", timeout=10)


def test_root_path_behind_a_proxy(tiny_model):
    """--root-path, as vLLM's (FastAPI's root_path): a proxy that keeps the prefix and one that strips it
    both reach the API, and the key is asked for under the prefix too; the prefix goes only once."""
    with ServerThread(tiny_model, "--root-path", "/llm/", "--api-key", KEY) as s:
        for path in ("/llm/v1/models", "/v1/models"):
            _check_error(httpx.get(s.url + path), 401, None)
            assert httpx.get(s.url + path, headers=AUTH).json()["data"][0]["id"] == s.args.model, path
        r = httpx.post(s.url + "/llm/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        assert httpx.get(s.url + "/llm/health").status_code == 200
        for path in ("/llm/llm/v1/models", "/llmv1/models"):
            assert httpx.get(s.url + path, headers=AUTH).status_code == 404, path
    assert parse_args(["--root-path", "/"]).root_path is None
    with pytest.raises(SystemExit):
        parse_args(["--root-path", "llm"])


@pytest.fixture(scope="module")
def cli_servers(tiny_model, tmp_path_factory):
    """The two `python -m nanoserve` processes of the tests below, started at once: each spends its start-up
    importing on one core while this process waits, so side by side they take the cores together. Each test
    stops its own; any still running at the end is killed. {"uds": (proc, socket path), "serve": (proc, None)}."""
    path = str(tmp_path_factory.mktemp("uds") / "nanoserve.sock")
    stale = socket.socket(socket.AF_UNIX)  # a previous run's socket file, which --uds replaces
    stale.bind(path)
    stale.close()
    uds = subprocess.Popen([sys.executable, "-m", "nanoserve", str(tiny_model), "--uds", path, "--dtype", "float32",
                            "--num-kv-blocks", "64", "--max-model-len", "256", "--uvicorn-log-level", "warning",
                            "--enforce-eager"],  # no decode attention compiled in the fresh process: ~4 s
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_API_KEY": KEY}
    env.pop("NANOSERVE_API_KEY", None)
    serve = subprocess.Popen(  # as a deployment runs it: `serve MODEL` and vLLM's flags, the key in $VLLM_API_KEY
        [sys.executable, "-m", "nanoserve", "serve", str(tiny_model), "--port", "0",  # vLLM's host: all interfaces
         "--dtype", "float32", "--num-kv-blocks", "64", "--max_model_len", "256", "--trust-remote-code",
         "--disable-log-requests", "--enable-chunked-prefill", "--kv-cache-dtype", "auto", "--swap-space", "4",
         "--gpu-memory-utilization", "0.9", "--uvicorn-log-level", "warning", "--disable-log-stats",
         "--enforce-eager"],  # vLLM's flag too; the fresh process compiles no decode attention (~4 s)
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    yield {"uds": (uds, path), "serve": (serve, None)}
    for proc in (uds, serve):
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def stop_with_sigterm(proc: subprocess.Popen) -> str:
    """SIGTERM, then the exit: 0 (a clean shutdown); returns stderr."""
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return err


def test_a_unix_socket_with_vllms_uds(cli_servers):
    """--uds PATH, as vLLM's: the server listens there instead of on a port (a stale socket file, a previous
    run's, is replaced)."""
    proc, path = cli_servers["uds"]
    try:
        url = next((line.split()[1] for line in proc.stdout if line.strip().startswith("URL")), None)
        assert url == f"unix:{path}", proc.stderr.read()
        with httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://localhost", timeout=60) as c:
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        with pytest.raises(OSError, match="Address already in use"):  # a socket a server still answers on is kept
            entry.bind_socket("", 0, path)
    finally:
        stop_with_sigterm(proc)


def test_a_copied_vllm_serve_line_runs(cli_servers):
    """As a deployment runs it: `serve MODEL` and vLLM's flags, the key in $VLLM_API_KEY."""
    proc, _ = cli_servers["serve"]
    try:
        url = None
        for line in proc.stdout:
            if line.strip().startswith("URL"):
                url = line.split()[1]
                break
        assert url, proc.stderr.read()
        assert httpx.get(url + "/ping").status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers=AUTH).status_code == 200
    finally:
        err = stop_with_sigterm(proc)
    assert "an API key (from $VLLM_API_KEY) is required" in err and KEY not in err
    for flag in ("--trust-remote-code", "--disable-log-requests", "--enable-chunked-prefill",
                 "--kv-cache-dtype auto", "--swap-space 4.0"):
        assert f"WARNING [entry] {flag} (a vLLM flag) does nothing here" in err, (flag, err)


# =========================================================================== LLM(): the same vLLM arguments offline

# a vLLM offline script's LLM(...) keywords: every one of VLLM_ENGINE_ARGS at a value that asks for what
# nanoserve does, beside the ones it honours (None: the default, as vLLM's Optional arguments)
VLLM_LLM_KWARGS = dict(
    dtype="float32", gpu_memory_utilization=0.9, swap_space=4, enable_chunked_prefill=True, disable_log_stats=True,
    quantization=None, kv_cache_dtype="auto", max_model_len=256, trust_remote_code=False, enforce_eager=False,
    seed=None, tokenizer_mode="auto", tensor_parallel_size=1, max_num_seqs=None, max_num_batched_tokens=None,
    block_size=None, enable_prefix_caching=None, revision=None, tokenizer=None, download_dir=None,
    generation_config="vllm", max_logprobs=5, disable_custom_all_reduce=False, distributed_executor_backend=None,
    compilation_config={"level": 3, "cudagraph_capture_sizes": [1, 2]}, cpu_offload_gb=0, load_format="auto",
    max_seq_len_to_capture=8192, use_v2_block_manager=True, disable_async_output_proc=False, tokenizer_revision=None,
    hf_overrides={}, scheduling_policy="fcfs", logprobs_mode="raw_logprobs", runner="auto", task="generate",
    pipeline_parallel_size=1, data_parallel_size=1, num_gpu_blocks_override=64, device="auto", optimization_level=3,
    max_loras=1, max_cpu_loras=None, fully_sharded_loras=False, lora_dtype="auto")


def test_a_vllm_offline_script_runs_on_llm(tiny_model, caplog):
    """(a) honoured (vLLM's names and Optional None included), (b) taken with one note each, and the
    outputs are those of the same engine built with nanoserve's own arguments."""
    from nanoserve import LLM, SamplingParams
    from nanoserve.engine import VLLM_ENGINE_ARGS
    assert set(VLLM_ENGINE_ARGS) <= set(VLLM_LLM_KWARGS)
    with caplog.at_level(logging.INFO, logger="nanoserve.engine"):
        llm = LLM(str(tiny_model), **VLLM_LLM_KWARGS)
    cfg = llm.engine.config
    assert (cfg.seed, cfg.max_num_seqs, cfg.block_size, cfg.enable_prefix_caching, cfg.enforce_eager) == \
        (0, 256, 16, True, False)  # None: the default
    assert (cfg.num_kv_blocks, cfg.cudagraph_capture_sizes, cfg.max_logprobs, cfg.device) == (64, [1, 2], 5, None)
    for name in VLLM_ENGINE_ARGS:
        notes = [m for m in caplog.messages if m.startswith(f"[engine] {name}=")]
        assert len(notes) == 1 and " (a vLLM argument) does nothing here: " in notes[0], (name, notes)
    assert sum("compilation_config's level=3" in m for m in caplog.messages) == 1
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = LLM(str(tiny_model), dtype="float32", max_model_len=256, num_kv_blocks=64, max_logprobs=5,
                generation_config="vllm", cudagraph_capture_sizes=[1, 2])
    outs = [m.generate(["The quick brown", "hello"], greedy, use_tqdm=False) for m in (llm, plain)]
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]
    # vLLM's LLM methods: reset_prefix_cache is honoured; the ones nanoserve lacks say so (they were bare
    # AttributeErrors, "'LLM' object has no attribute 'encode'")
    long = ["The quick brown fox jumps over the lazy dog. " * 4]
    warm = [plain.generate(long, greedy, use_tqdm=False)[0] for _ in range(2)][1]
    assert warm.num_cached_tokens > 0 and plain.reset_prefix_cache() is True
    cold = plain.generate(long, greedy, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0 and cold.outputs[0].token_ids == warm.outputs[0].token_ids
    for name, why in (("reward", "no reward head"), ("sleep", "no sleep mode"), ("llm_engine", "LLM.engine")):
        with pytest.raises(AttributeError, match=f"LLM.{name} is vLLM's, and nanoserve does not have it: .*{why}"):
            getattr(plain, name)
    assert not hasattr(plain, "no_such_thing")


@pytest.mark.parametrize("kwargs, why", [
    ({"quantization": "bitsandbytes"}, "quantization='bitsandbytes' is not supported: nanoserve reads an FP8, GPTQ"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype='fp8' is not supported: the KV cache has the model's dtype"),
    ({"load_format": "pt"}, "load_format='pt' is not supported: "),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2 is not supported: nanoserve has no pipeline"),
    ({"distributed_executor_backend": "ray"}, "distributed_executor_backend='ray' is not supported: "),
    ({"cpu_offload_gb": 4}, "cpu_offload_gb=4 is not supported: nanoserve keeps every weight on the device"),
    ({"tokenizer_mode": "mistral"}, "tokenizer_mode='mistral' is not supported: "),
    ({"task": "reward"}, "task must be one of auto, generate, embed, embedding, classify, score, got 'reward'"),
    ({"compilation_config": {"cudagraph_mode": "FULL"}}, "compilation_config['cudagraph_mode'] is not supported"),
    ({"compilation_config": "3"}, "compilation_config must be an int (a level) or a dict, got str"),
    ({"num_kv_blocks": 8, "num_gpu_blocks_override": 8}, "num_kv_blocks is given twice"),
    ({"compilation_config": {"max_cudagraph_capture_size": 8}, "max_cudagraph_capture_size": 8},
     "max_cudagraph_capture_size is given twice"),
    ({"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4], "max_cudagraph_capture_size": 8}},
     "max_cudagraph_capture_size (8) must be the largest of cudagraph_capture_sizes (4)"),
    ({"kv_transfer_config": {}, "enable_sleep_mode": True},
     "nanoserve does not have: enable_sleep_mode, kv_transfer_config;"),
    ({"max_model_len": "128"}, "max_model_len must be an integer, got '128'"),  # a TypeError from a comparison
    ({"max_model_len": 12.5}, "max_model_len must be an integer, got 12.5"),  # served "12.5 tokens"
    ({"seed": 2**70}, "seed must be in [-2**63, 2**64), got 1180591620717411303424"),  # failed at the first request
    ({"seed": "x"}, "seed must be an integer, got 'x'"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1, got 0"),  # was taken as unset
    ({"enable_lora": "yes"}, "enable_lora must be true or false, got 'yes'"),  # taken as true, as was "false"
    ({"enforce_eager": 1}, "enforce_eager must be true or false, got 1"),
    ({"enable_prefix_caching": "false"}, "enable_prefix_caching must be true or false, got 'false'"),
    ({"trust_remote_code": "no"}, "trust_remote_code must be true or false, got 'no'"),  # a vLLM argument's
    ({"device": "tpu"}, "device must be 'auto', 'cpu' or 'cuda' (or 'cuda:N'), got 'tpu'"),
    pytest.param({"device": "cuda"}, "device='cuda', but this torch sees no CUDA GPU",  # torch's AssertionError
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")),
], ids=lambda v: str(v)[:40] if isinstance(v, dict) else "")
def test_vllm_arguments_llm_cannot_honour_are_refused(tiny_model, kwargs, why):
    """(c) a ValueError naming the argument and why, before any loading; never a TypeError."""
    from nanoserve import LLM
    with pytest.raises(ValueError) as e:
        LLM(str(tiny_model), dtype="float32", **kwargs)
    assert why in str(e.value), str(e.value)
