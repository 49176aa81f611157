"""The entry layer against a real uvicorn server on a loopback port: the openai
SDK, raw SSE (httpx, curl), concurrency, disconnects, backpressure, bad input,
/metrics, logs, and shutdown. The model is the tiny random Qwen3 of conftest."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import nanoserve
from conftest import run_request
from nanoserve import LLM, SamplingParams
from nanoserve.engine import AsyncLLM, LLMEngine
from nanoserve.entry import (Server, bind_socket, build_app, default_model_path, engine_config, make_arg_parser,
                            parse_args, start_engine)

BASE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256", "--port", "0",
              "--disable-log-stats"]
GREEDY = dict(temperature=0.0)


class ServerThread:
    """build_app + uvicorn in a background thread (its own loop), as main() runs it."""

    def __init__(self, model_dir: Path, *flags: str, graceful: float | None = None):
        self.args = parse_args(["--model", str(model_dir), *BASE_FLAGS, *flags])
        self.engine = start_engine(engine_config(self.args), self.args.lora_modules)
        # A test makes the model step slow (on the worker thread) by setting .delay,
        # so that prefill and decode take long enough to act in the middle of them.
        self.delay = 0.0
        execute = self.engine.runner.execute

        def slow_execute(seqs):
            time.sleep(self.delay)
            return execute(seqs)
        self.engine.runner.execute = slow_execute
        self.async_llm = AsyncLLM(self.engine)
        app = self.app = build_app(self.async_llm, self.args)
        self.sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        if graceful is not None:
            self.args.shutdown_timeout = graceful
        self.args.disable_uvicorn_access_log = True
        self.server = Server(app, self.args)  # as serve() runs it
        self.server.config.log_config = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()

    def stats(self) -> dict:
        return self.engine.stats()

    def wait_idle(self, timeout: float = 5.0) -> dict:
        """Nothing running or waiting, every KV block free (the invariant), and
        nothing left behind in the entry layer or AsyncLLM."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if (s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]
                    and not self.async_llm.queues and not self.app.state.server.generations):
                return s
            assert time.monotonic() < deadline, f"engine not idle: {s}"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def server(tiny_model):
    with ServerThread(tiny_model, "--max-request-body-bytes", "65536") as s:
        yield s


@pytest.fixture(scope="module")
def slow_server(tiny_model):
    """Two running at most, two waiting at most, prefill in chunks of 32 tokens."""
    with ServerThread(tiny_model, "--max-num-seqs", "2", "--max-queue-len", "2",
                      "--max-num-batched-tokens", "32") as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLM(str(tiny_model), dtype="float32", num_kv_blocks=64, max_model_len=256)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="anything", max_retries=0)


def offline_text(llm: LLM, prompt, **kw) -> tuple[str, list[int], int]:
    out = llm.generate([prompt], SamplingParams(**{**GREEDY, **kw}), use_tqdm=False)[0]
    return out.outputs[0].text, out.outputs[0].token_ids, len(out.prompt_token_ids)


def sse_events(raw: str) -> list[str]:
    """Split an SSE body into its data payloads, checking the framing."""
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    events = raw.split("\n\n")
    assert events[-1] == ""
    payloads = []
    for e in events[:-1]:
        assert e.startswith("data: ") and "\n" not in e, repr(e)
        payloads.append(e[len("data: "):])
    return payloads


# =========================================================================== the openai SDK

def test_sdk_completion_matches_offline(client, offline):
    prompt = "The quick brown fox"
    r = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=12,
                                  temperature=0)
    text, ids, n_prompt = offline_text(offline, prompt, max_tokens=12)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (n_prompt, len(ids), n_prompt + len(ids))


def test_sdk_completion_stream_matches_offline(client, offline):
    prompt = "import os, sys"
    chunks = list(client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                            max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text, ids, n_prompt = offline_text(offline, prompt, max_tokens=20)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)


def test_sdk_chat_matches_offline(client, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                       max_completion_tokens=10, temperature=0)
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids) == 10


def test_sdk_chat_stream_matches_offline(client, offline):
    messages = [{"role": "user", "content": "the lazy dog"}]
    chunks = list(client.chat.completions.create(
        model=client.models.list().data[0].id, messages=messages, max_tokens=15, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=15), use_tqdm=False)[0]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 15


def test_sdk_maps_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=client.models.list().data[0].id, prompt="hi", max_tokens=5,
                                  temperature=-1)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=5)


def test_multi_prompt_token_ids_and_n(server, offline):
    ids = offline.get_tokenizer().encode("hello world")
    first, _, p0 = offline_text(offline, "The quick", max_tokens=6)
    second, _, p1 = offline_text(offline, ids, max_tokens=6)
    sampled = dict(max_tokens=6, n=2, temperature=1.0, seed=7)  # n > 1 samples: greedy takes n=1, as vLLM's
    choices = [c for p in ("The quick", ids) for c in offline.generate(
        [p], SamplingParams(**sampled), use_tqdm=False)[0].outputs]  # seeded: the same draws in any batch
    body = {"prompt": [offline.get_tokenizer().encode("The quick"), ids], **sampled}
    r = httpx.post(server.url + "/v1/completions", json=body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in r["choices"]] == [c.text for c in choices]
    assert r["usage"] == {"prompt_tokens": p0 + p1, "completion_tokens": sum(len(c.token_ids) for c in choices),
                          "total_tokens": p0 + p1 + sum(len(c.token_ids) for c in choices),
                          "prompt_tokens_details": None, "completion_tokens_details": None}  # vLLM's nulls
    with httpx.stream("POST", server.url + "/v1/completions", json={
            "prompt": ["The quick", "hello world"], "max_tokens": 6, "temperature": 0, "stream": True}) as s:
        chunks = [json.loads(p) for p in sse_events(s.read().decode())[:-1]]
    texts = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in (0, 1)]
    assert texts == [first, second]


def test_stop_string_echo_and_extras(server, offline):
    text, _, _ = offline_text(offline, "The quick brown", max_tokens=12)
    stop = text[4:6]
    r = httpx.post(server.url + "/v1/completions", json={
        "prompt": "The quick brown", "max_tokens": 12, "temperature": 0, "stop": [stop], "echo": True,
        "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.0, "seed": 3}).json()
    ref, _, _ = offline_text(offline, "The quick brown", max_tokens=12, stop=[stop])
    assert r["choices"][0]["text"] == "The quick brown" + ref
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["stop_reason"] == stop


def test_logprobs_shapes(server):
    r = httpx.post(server.url + "/v1/completions", json={
        "prompt": "hello", "max_tokens": 4, "temperature": 0, "logprobs": 3}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    # keyed by token text, as OpenAI's legacy shape is: tokens that decode alike share a key
    assert all(1 <= len(t) <= 4 and all(v <= 0 for v in t.values()) for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
        "logprobs": True, "top_logprobs": 2}).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"} and len(item["top_logprobs"]) == 2
        assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"]
        assert item["logprob"] <= item["top_logprobs"][0]["logprob"] + 1e-6  # greedy: the top one
    # streamed logprobs cover every token exactly once
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
            "stream": True, "logprobs": True}) as resp:
        payloads = sse_events(resp.read().decode())
    items = [i for p in payloads[:-1] for c in json.loads(p)["choices"] if c["logprobs"]
             for i in c["logprobs"]["content"]]
    assert len(items) == 5


@pytest.mark.parametrize("logprobs", [1, None])
def test_stream_of_deltas_adds_up_to_the_response(server, logprobs):
    """Streams are built from DELTA outputs (each step's new text, token ids and
    logprobs only): per choice they add up to the non-streamed response, also
    while a stop string that never completes holds all the text back (the token
    ids and logprobs still come step by step, in chunks with empty text)."""
    body = {"prompt": "The quick brown", "max_tokens": 8, "temperature": 1.0, "seed": 5, "ignore_eos": True, "n": 2,
            "logprobs": logprobs, "return_token_ids": True}  # seeded: the same choices each time
    texts = [c["text"] for c in httpx.post(server.url + "/v1/completions", json=body).json()["choices"]]
    body["stop"] = [text + "\ue000" for text in texts]  # each choice's whole text is a prefix of one until the end
    whole = httpx.post(server.url + "/v1/completions", json=body).json()
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        chunks = [json.loads(p) for p in sse_events(s.read().decode())[:-1]]
    # the usage chunk has no details keys, vLLM's (whose response has them null)
    assert {**chunks[-1]["usage"], "prompt_tokens_details": None, "completion_tokens_details": None} == \
        whole["usage"] and whole["usage"]["completion_tokens"] == 16
    for want in whole["choices"]:
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == want["index"]]
        assert "".join(c["text"] for c in mine) == want["text"] == texts[want["index"]]
        assert [t for c in mine for t in c["token_ids"]] == want["token_ids"]
        if logprobs:
            assert [t for c in mine for t in c["logprobs"]["tokens"]] == want["logprobs"]["tokens"]
        assert [c["text"] for c in mine[:-1]] == [""] * 7 and mine[-1]["finish_reason"] == "length"
    server.wait_idle()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": ["The quick brown", "import os"], "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "n": 2}),
])
def test_stream_options_usage_as_vllm(server, path, body):
    """vLLM's StreamOptions: an object asks for the final usage chunk unless include_usage
    is false; continuous_usage_stats puts each choice's usage so far on every chunk."""
    body = {**body, "max_tokens": 5, "temperature": 1.0, "seed": 1, "stream": True, "ignore_eos": True}

    def chunks(opts):
        with httpx.stream("POST", server.url + path, json={**body, "stream_options": opts}) as s:
            return [json.loads(p) for p in sse_events(s.read().decode())[:-1]]
    plain = chunks({})
    total = len(body.get("prompt", [None])) * 2 * 5  # prompts x n x max_tokens
    assert plain[-1]["choices"] == [] and plain[-1]["usage"]["completion_tokens"] == total
    assert all("usage" not in c for c in plain[:-1])
    assert all("usage" not in c for c in chunks({"include_usage": False}))
    assert all("usage" not in c for c in chunks({"include_usage": None}))  # vLLM keeps the null: no usage
    each = chunks({"continuous_usage_stats": True})
    assert each[-1]["usage"] == plain[-1]["usage"]
    counts: dict[int, int] = {}
    for c in each[:-1]:
        (choice,), usage = c["choices"], c["usage"]
        counts[choice["index"]] = usage["completion_tokens"]  # never falls, ends at max_tokens
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    assert counts == {i: 5 for i in range(total // 5)}
    server.wait_idle()


def test_chat_message_shape_and_role_as_vllm(server):
    """A chat message without tool calls has no tool_calls key (vLLM's ChatMessage drops an empty
    list); with add_generation_prompt false the reply takes the last message's role (vLLM's
    get_chat_request_role)."""
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "temperature": 0}
    message = httpx.post(server.url + "/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["role"] == "assistant" and "tool_calls" not in message
    body["add_generation_prompt"] = False
    message = httpx.post(server.url + "/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["role"] == "user"
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}) as s:
        first = json.loads(sse_events(s.read().decode())[0])
    assert first["choices"][0]["delta"]["role"] == "user"


# The keys vLLM 0.32's response models serialize (measured with benchmarks/api_diff.py against its server)
VLLM_KEYS = {
    "cmpl": {"id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
             "kv_transfer_params", "ec_transfer_params", "metrics"},
    "cmpl.choice": {"index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_logprobs",
                    "prompt_token_ids", "routed_experts"},
    "usage": {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details",
              "completion_tokens_details"},
    "chat.choice": {"index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts"},
    "message": {"role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"},
}


def test_response_keys_as_vllms(server):
    """Every key vLLM's answer has is there (null where nothing was asked), and no other."""
    cmpl = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json()
    assert set(cmpl) == VLLM_KEYS["cmpl"] and set(cmpl["choices"][0]) == VLLM_KEYS["cmpl.choice"]
    assert set(cmpl["usage"]) == VLLM_KEYS["usage"] and cmpl["choices"][0]["token_ids"] is None
    assert cmpl["system_fingerprint"].startswith("nanoserve-") and cmpl["kv_transfer_params"] is None
    chat = httpx.post(server.url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).json()
    assert set(chat) == VLLM_KEYS["cmpl"] | {"prompt_logprobs", "prompt_token_ids", "prompt_text"}
    assert set(chat["choices"][0]) == VLLM_KEYS["chat.choice"] and set(chat["usage"]) == VLLM_KEYS["usage"]
    message = chat["choices"][0]["message"]
    assert set(message) == VLLM_KEYS["message"] and message["refusal"] is None
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "hi"}).json()
    assert tok["token_strs"] is None


def _chunks(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True, "max_tokens": 3,
                                                       "ignore_eos": True}) as s:
        return [json.loads(p) for p in sse_events(s.read().decode())[:-1]]


@pytest.mark.parametrize("usage", [False, True])
def test_stream_chunk_keys_as_vllms(server, usage):
    """A completions chunk's choice has null token ids; a chat chunk's has stop_reason only where it finishes,
    and its role chunk null prompt fields; the fingerprint rides the finishing chunk, or the usage chunk after."""
    opts = {"stream_options": {"include_usage": True}} if usage else {}
    cmpl = _chunks(server, "/v1/completions", {"prompt": "hi", **opts})
    assert all(set(c["choices"][0]) == {"index", "text", "logprobs", "finish_reason", "stop_reason",
                                        "prompt_token_ids", "token_ids"} for c in cmpl if c["choices"])
    chat = _chunks(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **opts})
    role, *deltas = [c for c in chat if c["choices"]]
    assert role["prompt_token_ids"] is None and role["prompt_text"] is None
    assert deltas and deltas[-1]["choices"][0]["finish_reason"] == "length"
    assert [set(c["choices"][0]) for c in deltas] == [{"index", "delta", "logprobs", "finish_reason", "token_ids"} |
                                                      ({"stop_reason"} if c["choices"][0]["finish_reason"] else set())
                                                      for c in deltas]
    assert all("stop_reason" not in c["choices"][0] for c in deltas[:-1])
    for chunks in (cmpl, chat):
        marked = [i for i, c in enumerate(chunks) if "system_fingerprint" in c]
        assert marked == [len(chunks) - 1]  # the usage chunk, or the last (finishing) one
        assert (chunks[-1]["choices"] == []) == usage


def test_stream_echo_sends_the_prompts_ids_first(server):
    """As vLLM's: a completions stream that echoes sends the prompt's token ids in its first chunk."""
    chunks = _chunks(server, "/v1/completions", {"prompt": [5, 6, 7], "echo": True})
    assert chunks[0]["choices"][0]["prompt_token_ids"] == [5, 6, 7]
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in chunks[1:])


def test_chat_stream_sends_the_prompts_ids_with_the_role(server):
    """As vLLM's: return_token_ids puts the prompt's ids on the role chunk, and no other."""
    body = {"messages": [{"role": "user", "content": "hi"}], "return_token_ids": True}
    whole = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 3}).json()
    role, *rest = _chunks(server, "/v1/chat/completions", body)
    assert role["choices"][0]["delta"]["role"] == "assistant" and role["prompt_token_ids"] == whole["prompt_token_ids"]
    assert rest and all("prompt_token_ids" not in c for c in rest)


# =========================================================================== raw SSE

def test_sse_framing_with_httpx(server):
    with httpx.stream("POST", server.url + "/v1/completions", headers={"X-Request-Id": "sse-frame-1"},
                      json={"prompt": "hello", "max_tokens": 8, "stream": True, "temperature": 0,
                            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"] == "sse-frame-1"
        raw = r.read().decode()
    payloads = sse_events(raw)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["id"] == "cmpl-sse-frame-1" and c["object"] == "text_completion" and "created" in c
               and "model" in c for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_curl_stream(server, offline):
    body = json.dumps({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6,
                       "temperature": 0, "stream": True})
    out = subprocess.run(["curl", "-sSN", "-X", "POST", server.url + "/v1/chat/completions",
                          "-H", "Content-Type: application/json", "-d", body],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    payloads = sse_events(out.stdout)
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    ref = offline.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=6),
                       use_tqdm=False)[0].outputs[0].text
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == ref


# =========================================================================== small endpoints

def test_models_health_version_tokenize(server, offline):
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == str(server.args.model)
    assert models["data"][0]["max_model_len"] == 256
    perm = models["data"][0]["permission"]  # vLLM's ModelCard always has one ModelPermission
    assert len(perm) == 1 and perm[0]["object"] == "model_permission" and perm[0]["id"].startswith("modelperm-")
    assert (perm[0]["allow_sampling"], perm[0]["allow_logprobs"], perm[0]["allow_fine_tuning"]) == (True, True, False)
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "hello world"}).json()
    assert tok["tokens"] == offline.get_tokenizer().encode("hello world") and tok["count"] == len(tok["tokens"])
    assert httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "hello world"}
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 3


def test_request_id_echoed_and_duplicates_rejected(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert len(r.headers["x-request-id"]) >= 16 and r.json()["id"] == "cmpl-" + r.headers["x-request-id"]
    server.delay = 0.01
    try:
        with httpx.Client() as c:
            with c.stream("POST", server.url + "/v1/completions", headers={"X-Request-Id": "dup-1"},
                          json={"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}) as first:
                lines = first.iter_lines()  # (keep it: a dropped iterator closes the response)
                next(lines)  # in flight now
                second = httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": "dup-1"},
                                    json={"prompt": "hi", "max_tokens": 2})
                assert second.status_code == 400 and "dup-1" in second.json()["error"]["message"]
                assert second.headers["x-request-id"] == "dup-1"
    finally:
        server.delay = 0.0
    server.wait_idle()
    again = httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": "dup-1"},
                       json={"prompt": "hi", "max_tokens": 2})
    assert again.status_code == 200 and again.json()["id"] == "cmpl-dup-1"


# =========================================================================== concurrency

def test_32_concurrent_streams_match_offline(server, offline):
    prompts = [f"prompt number {i}: the quick brown fox" for i in range(32)]
    refs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    async def one(prompt: str) -> str:
        stream = await aclient.completions.create(model=str(server.args.model), prompt=prompt, max_tokens=12,
                                                  temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()
    texts = asyncio.run(all_of_them())
    assert texts == [r.outputs[0].text for r in refs]
    server.wait_idle()


# =========================================================================== disconnects

def test_disconnect_mid_stream_frees_blocks(server):
    with httpx.Client() as c:
        with c.stream("POST", server.url + "/v1/completions",
                      json={"prompt": "hello", "max_tokens": 240, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            assert server.stats()["num_running"] == 1
    s = server.wait_idle(timeout=2)
    assert s["generation_tokens"] > 0


def test_disconnect_mid_prefill_frees_blocks(slow_server):
    slow_server.delay = 0.15
    try:
        prompt = list(range(10, 210))  # 200 tokens: 7 chunks of 32 at 0.15 s each
        before = slow_server.stats()["generation_tokens"]
        for stream in (True, False):
            with httpx.Client() as c:
                if stream:
                    with c.stream("POST", slow_server.url + "/v1/completions",
                                  json={"prompt": prompt, "max_tokens": 16, "stream": True}):
                        time.sleep(0.4)
                        s = slow_server.stats()
                        assert s["num_running"] == 1 and s["num_free_blocks"] < s["num_total_blocks"]
                else:
                    with pytest.raises(httpx.ReadTimeout):
                        c.post(slow_server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 16},
                               timeout=httpx.Timeout(5, read=0.4))
            slow_server.wait_idle(timeout=1.0)  # within a step or two of the disconnect
        assert slow_server.stats()["generation_tokens"] == before  # aborted before its first token
    finally:
        slow_server.delay = 0.0


def test_health_answers_during_long_prefill(slow_server):
    slow_server.delay = 0.5
    try:
        with httpx.Client() as c:
            with c.stream("POST", slow_server.url + "/v1/completions",
                          json={"prompt": list(range(10, 70)), "max_tokens": 1, "stream": True}) as r:
                time.sleep(0.2)
                t = time.monotonic()
                assert httpx.get(slow_server.url + "/health").status_code == 200
                assert time.monotonic() - t < 0.3  # the step runs on the worker thread
                assert sse_events(r.read().decode())
    finally:
        slow_server.delay = 0.0
    slow_server.wait_idle()


def test_backpressure_429(slow_server):
    slow_server.delay = 0.1

    async def flood():
        async with httpx.AsyncClient(base_url=slow_server.url, timeout=30) as c:
            async def one():
                return await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            results = await asyncio.gather(*(one() for _ in range(8)))
            health = await c.get("/health")
            return results, health
    try:
        results, health = asyncio.run(flood())
    finally:
        slow_server.delay = 0.0
    codes = sorted(r.status_code for r in results)
    assert set(codes) == {200, 429} and codes.count(200) >= 2, codes
    for r in results:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == 429 and "max-queue-len" in r.json()["error"]["message"]
    assert health.status_code == 200
    slow_server.wait_idle()


# =========================================================================== bad input

LONG_PROMPT = list(range(1, 260))
BAD_REQUESTS = [
    # (path, body: dict | str | bytes, status, param)
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", b"\xff\xfe\x00garbage", 400, None),
    ("/v1/completions", "", 400, None),
    ("/v1/completions", "[1, 2]", 400, None),
    ("/v1/completions", '"a string"', 400, None),
    ("/v1/completions", "[" * 30000 + "]" * 30000, 400, None),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, "a"]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, True]}, 400, "prompt"),  # not vLLM's lax [1, 1]: ids are checked after
    ("/v1/completions", {"prompt": [1, 2.5]}, 400, "prompt"),   # the length, by the engine, uncoerced
    ("/v1/completions", {"prompt": [99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 1}, 400, "input_tokens"),  # vLLM 0.32's param
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 100000}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 2.5}, 400, "n"),  # lax, as vLLM's pydantic: 2.0 would be 2
    ("/v1/completions", {"prompt": "hi", "n": 2, "temperature": 0}, 400, "n"),  # as vLLM's: greedy takes n=1
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3, "temperature": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": True}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 1.5}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -2}, 400, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": -2}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": ["a"]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [100000]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"100000": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": [1]}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "seed": "x"}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**63}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "stream": "maybe"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "echo": "x"}, 400, "echo"),
    ("/v1/completions", {"prompt": "hi", "ignore_eos": 2}, 400, "ignore_eos"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "model": 5}, 400, "model"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "x" * 70000}, 413, None),
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": ["hi"]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": 5, "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 30}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": "maybe"},
     400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300},
     400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 300},
     400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],  # once a 500
                              "response_format": {"type": "json_schema", "json_schema": "x"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": 5}}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the quick brown fox " * 80}]},
     400, "input_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
     400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": 2},
     400, "add_generation_prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "prompt"),  # once: messages
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


def _check_error(r: httpx.Response, status: int, param) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{row[0].rsplit('/', 1)[-1]}-{row[3]}" for i, row in enumerate(BAD_REQUESTS)])
def test_bad_requests(server, path, body, status, param):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    r = httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"})
    err = _check_error(r, status, param)
    if param is not None and status == 400:
        assert param.split(".")[0] in err["message"] or param in ("prompt", "messages", "input_tokens"), err
    if param == "max_tokens" and "max-model-len" in err["message"]:
        assert "256" in err["message"]  # says both numbers


def test_more_bad_requests(server):
    # the message of an over-long request names both numbers
    err = _check_error(httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1000}),
                       400, "max_tokens")
    assert "256" in err["message"] and "1000" in err["message"]
    # a chunked body over the limit, without Content-Length
    r = httpx.post(server.url + "/v1/completions", content=(b"x" * 8192 for _ in range(10)))
    _check_error(r, 413, None)
    _check_error(httpx.get(server.url + "/v1/completions"), 405, None)
    _check_error(httpx.get(server.url + "/no/such/path"), 404, None)
    # unknown fields are ignored (and logged), as vLLM does
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "frobnicate": 1})
    assert r.status_code == 200
    # a streaming request with bad input is a plain 400, not a stream
    _check_error(httpx.post(server.url + "/v1/chat/completions", json={"messages": [], "stream": True}),
                 400, "messages")
    assert httpx.get(server.url + "/health").status_code == 200
    server.wait_idle()


def test_api_key(tiny_model):
    with ServerThread(tiny_model, "--api-key", "s3cret", "other") as s:  # vLLM's list: any of them
        url = s.url + "/v1/completions"
        body = {"prompt": "hi", "max_tokens": 2}
        _check_error(httpx.post(url, json=body), 401, None)
        _check_error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401, None)
        _check_error(httpx.get(s.url + "/v1/models", headers={"Authorization": "s3cret"}), 401, None)
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.post(url, json=body, headers={"Authorization": "bearer s3cret"}).status_code == 200
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer other"}).status_code == 200
        # as vLLM's: every path under /v1 (an unknown one too: 401 before 404); /tokenize, /detokenize,
        # /health, /metrics and /version stay open
        _check_error(httpx.get(s.url + "/v1/no/such/path"), 401, None)
        _check_error(httpx.post(s.url + "/v1beta/models"), 401, None)
        assert httpx.post(s.url + "/tokenize", json={"prompt": "hi"}).json()["count"] > 0
        assert httpx.post(s.url + "/detokenize", json={"tokens": [1]}).status_code == 200
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(s.url + path).status_code == 200, path
        assert _metrics(s.url)["nanoserve:request_rejected_total{code=401}"] == 5
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert c.completions.create(model=str(s.args.model), prompt="hi", max_tokens=2).choices[0].text is not None
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0).models.list()


# =========================================================================== metrics and logs

def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items())
                                        if k not in ("model_name", "le"))
            if "le" not in sample.labels:
                values[key] = sample.value
    return values


VLLM_REQUEST_SERIES = ("prefill_time_seconds", "decode_time_seconds", "inference_time_seconds",
                       "time_per_output_token_seconds", "prompt_tokens", "generation_tokens", "params_n",
                       "params_max_tokens")


def test_metrics_move(server):
    before = _metrics(server.url)
    for name in ("nanoserve:num_requests_running", "nanoserve:num_requests_waiting",
                 "nanoserve:kv_cache_usage_perc", "nanoserve:prefix_cache_queries_total",
                 "nanoserve:prefix_cache_hits_total", "nanoserve:num_preemptions_total",
                 "nanoserve:prompt_tokens_total", "nanoserve:generation_tokens_total",
                 "nanoserve:time_to_first_token_seconds_count", "nanoserve:inter_token_latency_seconds_count",
                 "nanoserve:e2e_request_latency_seconds_count", "nanoserve:request_queue_time_seconds_count",
                 *(f"nanoserve:request_{s}_count" for s in VLLM_REQUEST_SERIES)):
        assert name in before, name
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 7})
    usage = r.json()["usage"]
    server.delay = 0.01
    try:
        with httpx.stream("POST", server.url + "/v1/completions",  # then one cut short
                          json={"prompt": "hello there" * 3, "max_tokens": 200, "ignore_eos": True,
                                "stream": True}) as s:
            lines = s.iter_lines()
            next(lines)
            during = _metrics(server.url)
    finally:
        server.delay = 0.0
    server.wait_idle()
    after = _metrics(server.url)
    assert during["nanoserve:num_requests_running"] == 1 and during["nanoserve:kv_cache_usage_perc"] > 0
    assert after["nanoserve:num_requests_running"] == 0
    assert after["nanoserve:generation_tokens_total"] >= before["nanoserve:generation_tokens_total"] + 8
    assert after["nanoserve:prompt_tokens_total"] >= before["nanoserve:prompt_tokens_total"] + usage["prompt_tokens"]
    assert after["nanoserve:prefix_cache_queries_total"] > before["nanoserve:prefix_cache_queries_total"]
    key = "nanoserve:request_success_total{finished_reason=length}"
    assert after[key] == before.get(key, 0) + 1
    assert after["nanoserve:request_success_total{finished_reason=abort}"] >= 1
    assert after["nanoserve:time_to_first_token_seconds_count"] == before["nanoserve:time_to_first_token_seconds_count"] + 2
    assert after["nanoserve:inter_token_latency_seconds_count"] >= before["nanoserve:inter_token_latency_seconds_count"] + 6
    assert after["nanoserve:e2e_request_latency_seconds_count"] == before["nanoserve:e2e_request_latency_seconds_count"] + 1
    # vLLM's per-request series: one observation for the request that finished, with its token counts
    for series in VLLM_REQUEST_SERIES:
        key = f"nanoserve:request_{series}_count"
        assert after[key] == before[key] + 1, series
    grew = {k: after[f"nanoserve:request_{k}_sum"] - before[f"nanoserve:request_{k}_sum"]
            for k in ("prompt_tokens", "generation_tokens", "params_n", "params_max_tokens")}
    assert grew == {"prompt_tokens": usage["prompt_tokens"], "generation_tokens": usage["completion_tokens"],
                    "params_n": 1, "params_max_tokens": 7}, grew
    # max_tokens as the request ran, as vLLM records it: clamped to the room its prompt leaves (250 of 256)
    before = after
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [5] * 250, "max_tokens": 100})
    assert r.status_code == 200, r.text
    server.wait_idle()
    after = _metrics(server.url)
    assert after["nanoserve:request_params_max_tokens_sum"] - before["nanoserve:request_params_max_tokens_sum"] == 6
    # each series again under vLLM's prefix, for dashboards and autoscalers built for vLLM
    ours = {k: v for k, v in after.items() if k.startswith("nanoserve:")}
    assert len(ours) > 20 and {k.replace("nanoserve:", "vllm:", 1): v for k, v in ours.items()} == \
        {k: v for k, v in after.items() if k.startswith("vllm:")}


def test_debug_logs_follow_the_request_through_the_layers(tiny_model, caplog):
    caplog.set_level(logging.DEBUG, logger="nanoserve")
    with ServerThread(tiny_model) as s:
        r = httpx.post(s.url + "/v1/completions", headers={"X-Request-Id": "trace-me"},
                       json={"prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200
    lines = [rec.getMessage() for rec in caplog.records]
    mine = [line for line in lines if "trace-me" in line]
    for tag in ("[entry]", "[engine]", "[scheduler]"):
        assert any(line.startswith(tag) for line in mine), (tag, mine)


def test_periodic_stats_line(tiny_model, caplog):
    caplog.set_level(logging.INFO, logger="nanoserve")
    flags = [f for f in BASE_FLAGS if f != "--disable-log-stats"]
    args = parse_args(["--model", str(tiny_model), *flags, "--log-stats-interval", "0.2"])
    engine = LLMEngine(engine_config(args))

    async def run():
        from nanoserve.entry import log_stats_periodically, ServerState, ServerMetrics
        async_llm = AsyncLLM(engine)
        async_llm.start()
        state = ServerState(async_llm, ["m"], {}, None, None, 1000, ServerMetrics(async_llm, "m"))
        task = asyncio.create_task(log_stats_periodically(state, 0.2))
        await run_request(async_llm, "hello", SamplingParams(max_tokens=3), "stats-1")
        await asyncio.sleep(0.3)
        task.cancel()
        await async_llm.shutdown()
    asyncio.run(run())
    stats = [rec.getMessage() for rec in caplog.records if "generation throughput" in rec.getMessage()]
    assert stats and "running" in stats[0] and "KV cache usage" in stats[0] and "prefix cache hit rate" in stats[0]


# =========================================================================== CLI, start-up and shutdown

def test_help_is_grouped_with_defaults():
    text = make_arg_parser().format_help()
    for group in ("model:", "scheduler:", "KV cache:", "server:", "logging:"):
        assert group in text
    for flag in ("--host", "--port", "--served-model-name", "--dtype", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--block-size", "--kv-cache-memory-bytes", "--num-kv-blocks",
                 "--no-enable-prefix-caching", "--seed", "--api-key", "--max-queue-len", "--log-level",
                 "--shutdown-timeout", "--enforce-eager"):
        assert flag in text, flag
    assert "(default: 0.0.0.0)" in text and "(default: 8000)" in text and "(default: 30.0)" in text
    # no --model: the demo model packaged at nanoserve/demo_model, served under its path
    demo = Path(nanoserve.__file__).resolve().parent / "demo_model"
    assert (demo / "config.json").is_file()
    assert default_model_path() == str(demo)
    args = parse_args([])
    assert args.model == str(demo) and args.served_model_name == [str(demo)]
    args = parse_args(["--model", "m", "--kv-cache-memory-bytes", "2GiB", "--no-enable-prefix-caching"])
    assert args.kv_cache_memory_bytes == 2 * 2**30 and args.enable_prefix_caching is False
    assert args.served_model_name == ["m"]
    assert parse_args([]).enforce_eager is False and parse_args(["--enforce-eager"]).enforce_eager is True
    assert LLMEngine(engine_config(parse_args(["--model", str(demo), "--enforce-eager"]))).config.enforce_eager


def _start_cli(*flags: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve", *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    banner = []
    for line in proc.stdout:
        banner.append(line)
        if line.strip().startswith("URL"):
            return proc, "".join(banner)
        assert time.monotonic() < deadline
    proc.kill()
    raise AssertionError(f"no banner: {''.join(banner)} {proc.stderr.read()}")


def test_sigterm_drains_the_stream_and_exits_0(tiny_model):
    # The drain waits only as long as the stream needs: a long --shutdown-timeout
    # keeps a slow, loaded machine from cutting it (that is the next test's case).
    # --enforce-eager: the fresh process skips compiling the decode attention (~4 s), which the drain does not need
    proc, banner = _start_cli("--model", str(tiny_model), "--dtype", "float32", "--num-kv-blocks", "64",
                              "--max-model-len", "512", "--port", "0", "--shutdown-timeout", "600", "--enforce-eager")
    try:
        for word in ("Qwen3ForCausalLM", "float32", "cpu", "weights", "64 blocks", "1024 tokens",
                     "2.00x at max-model-len 512", "http://127.0.0.1:"):
            assert word in banner, (word, banner)
        url = banner.split("URL", 1)[1].split()[0]
        with httpx.stream("POST", url + "/v1/completions", timeout=600, headers={"X-Request-Id": "drain-1"}, json={
                "prompt": "hello", "max_tokens": 480, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            lines = r.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            raw = first + "\n" + "\n".join(lines) + "\n"
        payloads = [line[len("data: "):] for line in raw.splitlines() if line]
        assert payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["usage"]["completion_tokens"] == 480
        assert proc.wait(timeout=600) == 0
        err = proc.stderr.read()
        # the signal came while the request was in flight, and the request finished
        assert err.index("SIGTERM: no new connections; draining") < err.index("[entry] drain-1: finished"), err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_shutdown_timeout_ends_the_rest_with_an_error_event(tiny_model, caplog):
    """At the drain timeout a stream still running gets an error event and
    [DONE] (200 tokens at 0.05 s a step cannot finish in the 0.5 s drain)."""
    caplog.set_level(logging.INFO)
    s = ServerThread(tiny_model, graceful=0.5)
    with s:
        s.delay = 0.05
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", s.url + "/v1/completions",
                          json={"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
                lines = r.iter_lines()
                next(lines)
                threading.Thread(target=s.stop).start()
                rest = [line for line in lines if line]
        s.thread.join(30)
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]
    st = s.stats()
    assert st["num_running"] == 0 and st["num_waiting"] == 0 and st["num_free_blocks"] == st["num_total_blocks"]
    messages = [rec.getMessage() for rec in caplog.records]
    assert any("shutdown: aborting 1 request(s) still in flight" in m for m in messages), messages
    assert not any(rec.exc_info or "Traceback" in rec.getMessage() for rec in caplog.records), messages
    with pytest.raises(httpx.ConnectError):  # no longer accepting
        httpx.get(s.url + "/health", timeout=2)


def test_fuzzed_bodies_never_5xx(server):
    """Random values for every known field: a 2xx or a 4xx in the error shape, never a 5xx."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.integers(), st.floats(),
                        st.text(max_size=8))
    values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(st.text(max_size=3), scalars, max_size=2),
                       st.lists(st.integers(0, 400), min_size=1, max_size=5))
    fields = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed", "logprobs",
              "echo", "logit_bias", "stop_token_ids", "min_tokens", "presence_penalty", "repetition_penalty",
              "ignore_eos", "stream", "stream_options", "messages", "top_logprobs", "max_completion_tokens"]
    body_strategy = st.fixed_dictionaries({}, optional={f: values for f in fields})

    @settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "60")), deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=body_strategy, chat=st.booleans(), base=st.booleans())
    def check(body, chat, base):
        if base:  # mostly valid requests with one odd field, to get past the first check
            body = {**({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}),
                    "max_tokens": 3, **{k: v for k, v in list(body.items())[:1]}}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        r = httpx.post(server.url + path, content=json.dumps(body), timeout=30)  # Infinity, NaN too
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            _check_error(r, r.status_code, None)
        elif body.get("stream") is True:
            sse_events(r.text)
    check()
    server.wait_idle()


def test_a_body_of_many_prompts_lets_the_loop_serve_others_between_them(server, monkeypatch):
    """Prompts x n engine requests are queued a prompt at a time with the loop free in between
    (a body of thousands of prompts once held it for seconds): a ticker task on the loop runs
    between any two of them."""
    ticks, seen, stop = [], [], []
    add = server.async_llm.add_request

    async def ticker():
        while not stop:
            ticks.append(1)
            await asyncio.sleep(0)

    def add_request(*args, **kwargs):
        if not seen:
            asyncio.get_running_loop().create_task(ticker())
        seen.append(len(ticks))
        return add(*args, **kwargs)
    monkeypatch.setattr(server.async_llm, "add_request", add_request)
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": ["a", "b", "c", "d"], "max_tokens": 1})
    finally:
        stop.append(1)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    assert len(seen) == 4 and all(b > a for a, b in zip(seen, seen[1:])), seen
    server.wait_idle()
