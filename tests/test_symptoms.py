"""The README's "Symptom -> layer" table, row by row: each test reproduces one
symptom on the tiny model of conftest and asserts that the log line, /metrics
series or error message the table names really shows it. A test's docstring is
its row's symptom; keep the two in step."""
from __future__ import annotations

import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nanoserve import entry
from test_server import BASE_FLAGS, ServerThread, _metrics

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def server(tiny_model):
    """BASE_FLAGS: 64 blocks of 16 tokens, --max-model-len 256."""
    with ServerThread(tiny_model) as s:
        yield s


@pytest.fixture
def logs(caplog):
    """The nanoserve log lines (the server thread's too), as a function that returns them."""
    caplog.set_level(logging.DEBUG, logger="nanoserve")
    return lambda: [r.getMessage() for r in caplog.records if r.name.startswith("nanoserve")]


def _bucket(url: str, name: str, le: str) -> float:
    """The cumulative count of histogram ``name`` at bucket ``le``."""
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name + "_bucket" and sample.labels.get("le") == le:
                return sample.value
    raise KeyError((name, le))


def _poll(url: str, done, timeout: float = 10.0) -> list[dict]:
    """Scrape /metrics until ``done(all scrapes so far)``; return the scrapes."""
    seen, deadline = [], time.monotonic() + timeout
    while True:
        seen.append(_metrics(url))
        if done(seen):
            return seen
        assert time.monotonic() < deadline, seen[-1]
        time.sleep(0.02)


def _post(url: str, body: dict, request_id: str | None = None) -> httpx.Response:
    headers = {"X-Request-Id": request_id} if request_id else {}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30)


# =========================================================================== the rows

def test_server_wont_start_or_out_of_memory_at_startup(tiny_model, monkeypatch, capsys):
    """Server won't start / out of memory at start-up."""
    monkeypatch.setattr(entry, "configure_logging", lambda *levels: None)  # leave pytest's handlers alone
    base = ["--model", str(tiny_model), "--port", "0", "--disable-log-stats"]
    # the KV cache cannot hold one request of --max-model-len
    assert entry.main([*base, "--num-kv-blocks", "4", "--max-model-len", "256"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot serve {tiny_model}: KV cache too small: 4 blocks hold 64 tokens"), err
    assert "--max-model-len to at most 64" in err and "--num-kv-blocks to at least 16" in err
    # more memory than this machine has: refused before the weights load
    assert entry.main([*base, "--kv-cache-memory-bytes", "1024TiB"]) == 1
    err = capsys.readouterr().err
    assert "not enough memory" in err and "--kv-cache-memory-bytes" in err and "Traceback" not in err


def test_prompt_rejected(server, logs):
    """Prompt rejected (400)."""
    # a prompt longer than --max-model-len by itself: vLLM 0.32's words and param
    r = _post(server.url, {"prompt": list(range(1, 301)), "max_tokens": 1}, "long-prompt-1")
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "input_tokens", err
    assert err["message"] == ("This model's maximum context length is 256 tokens. However, your prompt contains 300 "
                              "input tokens, which exceeds this limit even without any output tokens. Please reduce "
                              "the length of the input prompt.")
    # exactly --max-model-len: max_tokens is clamped to the room, none (vLLM's SamplingParams check)
    r = _post(server.url, {"prompt": list(range(1, 257)), "max_tokens": 5}, "long-prompt-2")
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_tokens", err
    assert err["message"].startswith("max_tokens must be at least 1, got 0."), err
    # max_tokens past --max-model-len whatever the prompt (vLLM's TokenizeParams check), chat's own field named
    r = _post(server.url, {"prompt": "hi", "max_tokens": 257}, "long-prompt-3")
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_tokens", err
    assert err["message"] == "max_tokens=257 cannot be greater than max_model_len=256. Please request fewer output tokens."
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text
    assert r.json()["error"]["message"].startswith("max_completion_tokens=1000 cannot be greater than max_model_len=256.")
    # min_tokens the room cannot hold (vLLM builds SamplingParams with the clamped max_tokens)
    r = _post(server.url, {"prompt": list(range(1, 251)), "max_tokens": 20, "min_tokens": 10})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "min_tokens", err
    assert err["message"].startswith("min_tokens must be less than or equal to max_tokens=6, got 10."), err
    lines = logs()
    assert any(line.startswith("[entry] long-prompt-1: POST /v1/completions -> 400: This model's maximum context length")
               for line in lines), lines
    assert any(line.startswith("[entry] long-prompt-3: POST /v1/completions -> 400: max_tokens=257 cannot")
               for line in lines), lines


def test_concurrency_wont_rise(tiny_model, caplog):
    """Concurrency won't rise."""
    caplog.set_level(logging.INFO, logger="nanoserve")
    with ServerThread(tiny_model, "--num-kv-blocks", "16") as s:  # max-num-seqs stays 256
        plan = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[kvcache] weights")]
        assert plan and plan[-1].endswith("16 blocks, 256 tokens; max concurrency at max_model_len=256: 1.00x")
        assert "concurrency  1.00x at max-model-len 256" in entry.banner(s.engine, s.args, s.url)
        s.delay = 0.05
        try:
            with ThreadPoolExecutor(1) as pool:  # 200-token prompts: 13 of the 16 blocks each, in one body
                future = pool.submit(_post, s.url, {"prompt": [list(range(1 + i, 201 + i)) for i in range(3)],
                                                    "max_tokens": 8, "ignore_eos": True})  # (all three wait at once)
                seen = _poll(s.url, lambda m: m[-1]["nanoserve:num_requests_waiting"] == 2
                             and m[-1]["nanoserve:num_requests_running"] == 1)
                assert future.result().status_code == 200
        finally:
            s.delay = 0.0
        assert seen[-1]["nanoserve:kv_cache_usage_perc"] >= 13 / 16
        s.wait_idle()


def test_requests_wait_long_before_the_first_token(tiny_model):
    """Requests wait long before the first token."""
    with ServerThread(tiny_model, "--max-num-seqs", "1") as s:
        s.delay = 0.05  # each request: a prefill and 5 decodes, 0.3 s
        try:
            with ThreadPoolExecutor(1) as pool:  # three prompts in one body: queued together whatever the load
                future = pool.submit(_post, s.url, {"prompt": [f"request {i}" for i in range(3)], "max_tokens": 6,
                                                    "ignore_eos": True})
                _poll(s.url, lambda m: m[-1]["nanoserve:num_requests_running"] == 1
                      and m[-1]["nanoserve:num_requests_waiting"] >= 1)
                assert future.result().status_code == 200
        finally:
            s.delay = 0.0
        s.wait_idle()
        m = _metrics(s.url)
        assert m["nanoserve:request_queue_time_seconds_count"] == 3
        # the last one in line waited for the two before it
        assert _bucket(s.url, "nanoserve:request_queue_time_seconds", "0.25") <= 2
        assert _bucket(s.url, "nanoserve:time_to_first_token_seconds", "0.25") <= 2


def test_latency_spikes_while_others_prefill_long_prompts(tiny_model, logs):
    """Latency spikes while others prefill long prompts."""
    with ServerThread(tiny_model, "--max-num-batched-tokens", "32") as s:
        s.delay = 0.02
        try:
            with httpx.stream("POST", s.url + "/v1/completions", headers={"X-Request-Id": "short-1"}, timeout=30,
                              json={"prompt": "hello", "max_tokens": 40, "ignore_eos": True, "stream": True}) as r:
                lines = r.iter_lines()
                next(lines)  # short-1 is decoding
                assert _post(s.url, {"prompt": list(range(1, 201)), "max_tokens": 2}, "long-1").status_code == 200
                rest = list(lines)
        finally:
            s.delay = 0.0
        assert "data: [DONE]" in rest  # short-1 ran to its end meanwhile
        s.wait_idle()
    admits = [line for line in logs() if line.startswith("[scheduler] admit long-1:")]
    m = re.fullmatch(r"\[scheduler\] admit long-1: 200 tokens, 0 prefix-cached, chunk (\d+)", admits[0])
    assert m and int(m.group(1)) < 32  # the first chunk: what the budget leaves after short-1's decode
    # the decode and a prefill chunk share a step of at most 32 tokens
    assert "[model] step: 2 sequences, 32 tokens, 1 sampled" in logs()


def test_output_cut_short(server, logs):
    """Output cut short."""
    before = _metrics(server.url)
    r = _post(server.url, {"prompt": "hello", "ignore_eos": True}, "cut-default").json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 16  # OpenAI's default
    r = _post(server.url, {"prompt": "hello", "max_tokens": 5, "ignore_eos": True}, "cut-5").json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 5
    # chat without max_tokens: what --max-model-len leaves after the prompt
    messages = [{"role": "user", "content": "the quick brown fox " * 52}]
    n_prompt = httpx.post(server.url + "/tokenize", json={"messages": messages,
                                                           "add_generation_prompt": True}).json()["count"]
    assert 200 < n_prompt < 256
    r = httpx.post(server.url + "/v1/chat/completions", headers={"X-Request-Id": "cut-chat"}, timeout=30,
                   json={"messages": messages, "ignore_eos": True}).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] == 256
    # max_tokens past the room the prompt leaves: served, clamped to it (vLLM 0.32's get_max_tokens)
    r = _post(server.url, {"prompt": list(range(1, 201)), "max_tokens": 100, "ignore_eos": True}, "cut-room").json()
    assert r["choices"][0]["finish_reason"] == "length", r
    assert (r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"], r["usage"]["total_tokens"]) == (200, 56, 256)
    r = httpx.post(server.url + "/v1/chat/completions", headers={"X-Request-Id": "cut-chat-room"}, timeout=30,
                   json={"messages": messages, "max_tokens": 200, "ignore_eos": True}).json()
    assert r["choices"][0]["finish_reason"] == "length", r
    assert r["usage"]["prompt_tokens"] == n_prompt and r["usage"]["completion_tokens"] == 256 - n_prompt, r["usage"]
    r = httpx.post(server.url + "/v1/responses", timeout=30,
                   json={"input": messages, "max_output_tokens": 200, "ignore_eos": True}).json()
    assert r["status"] == "incomplete" and r["max_output_tokens"] == 256 - n_prompt, r  # as applied, as vLLM's
    assert r["usage"]["input_tokens"] == n_prompt and r["usage"]["output_tokens"] == 256 - n_prompt, r["usage"]
    r = httpx.post(server.url + "/v1/messages", timeout=30,
                   json={"model": server.args.served_model_name[0], "messages": messages, "max_tokens": 200,
                         "ignore_eos": True}).json()
    assert r["stop_reason"] == "max_tokens", r
    assert r["usage"]["input_tokens"] == n_prompt and r["usage"]["output_tokens"] == 256 - n_prompt, r["usage"]
    key = "nanoserve:request_success_total{finished_reason=length}"
    assert _metrics(server.url)[key] == before.get(key, 0) + 7
    for rid in ("cut-default", "cut-5", "cut-chat", "cut-room", "cut-chat-room"):
        assert any(line.startswith(f"[entry] {rid}: finished (length) in ") for line in logs()), rid
    # beam search's max_tokens too (vLLM's to_beam_search_params takes the clamped one)
    r = _post(server.url, {"prompt": list(range(1, 251)), "max_tokens": 50, "use_beam_search": True, "n": 2,
                           "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * 2 and r.json()["usage"]["prompt_tokens"] == 250


def test_throughput_drops_under_load_preemptions(tiny_model, logs):
    """Throughput drops under load (preemptions)."""
    with ServerThread(tiny_model, "--num-kv-blocks", "16") as s:
        # Three prompts in one body run together whatever the machine's load (three clients might
        # not overlap): 3 blocks each at admission, 7 each by the end: 21 > 16
        r = _post(s.url, {"prompt": [list(range(1 + i, 41 + i)) for i in range(3)], "max_tokens": 60,
                          "ignore_eos": True}).json()
        assert len(r["choices"]) == 3 and all(c["finish_reason"] == "length" for c in r["choices"])
        assert r["usage"]["completion_tokens"] == 180  # preempted requests are recomputed, not lost
        assert _metrics(s.url)["nanoserve:num_preemptions_total"] > 0
        s.wait_idle()
    assert any(re.fullmatch(r"\[scheduler\] preempt \S+ \(recompute \d+ tokens later\)", line) for line in logs())


def test_memory_keeps_growing(server):
    """Memory keeps growing."""
    prompts = ["def main(): return 0", "import os, sys", "def main(): return 0"]  # shared prefixes hit the cache
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: _post(server.url, {"prompt": prompts[i % 3] * (1 + i % 4),
                                                             "max_tokens": 4 + i % 5, "n": 1 + i % 2}),
                                range(24)))
    assert all(r.status_code == 200 for r in results)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,  # and one left mid-stream
                      json={"prompt": prompts[0], "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
        next(r.iter_lines())
    s = server.wait_idle()
    m = _metrics(server.url)
    assert m["nanoserve:kv_cache_usage_perc"] == 0 and s["num_free_blocks"] == s["num_total_blocks"] == 64
    assert m["nanoserve:prefix_cache_hits_total"] > 0  # cached blocks stay reusable, yet count as free
    assert m["nanoserve:num_requests_running"] == m["nanoserve:num_requests_waiting"] == 0


def test_memory_default_kv_cache_is_what_the_limits_can_use(tiny_model, caplog):
    """Memory keeps growing (the KV cache's share: sized once, by default to
    what --max-num-seqs requests of --max-model-len can use)."""
    caplog.set_level(logging.INFO, logger="nanoserve")
    flags = [f for f in BASE_FLAGS if f not in ("--num-kv-blocks", "64")]
    engine = entry.LLMEngine(entry.engine_config(entry.parse_args(["--model", str(tiny_model), *flags,
                                                                    "--max-num-seqs", "3"])))
    assert engine.stats()["num_total_blocks"] == 3 * 16  # --max-model-len 256: 16 blocks a request
    plans = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[kvcache] weights")]
    assert plans[-1].endswith("48 blocks, 768 tokens; max concurrency at max_model_len=256: 3.00x"), plans


def test_the_first_request_or_a_new_step_size_is_slow(tiny_model, logs):
    """The first request, or the first step of a new size, is slow. (How slow
    depends on the machine: what is checked is where to look.)"""
    with ServerThread(tiny_model) as s:
        for rid, prompt in (("size-1", list(range(1, 6))), ("size-2", list(range(1, 40)))):
            assert _post(s.url, {"prompt": prompt, "max_tokens": 2}, rid).status_code == 200
        m = _metrics(s.url)
    assert m["nanoserve:time_to_first_token_seconds_count"] == 2
    steps = [line for line in logs() if line.startswith("[model] step: ")]
    assert "[model] step: 1 sequences, 5 tokens, 1 sampled" in steps
    assert "[model] step: 1 sequences, 39 tokens, 1 sampled" in steps  # a new size
    built = [line for line in logs() if line.startswith("[engine] kernels: ")]
    assert len(built) == 1 and s.engine.backend.name in built[0]  # at start-up, before any request waits on it


def test_a_request_fails_with_500_the_model_step_failed(tiny_model, logs):
    """A request fails with 500 (the model step failed)."""
    with ServerThread(tiny_model) as s:
        execute = s.engine.runner.execute

        def flaky(seqs):
            if any(x.token_ids[:3] == [9, 9, 9] for x in seqs):
                raise RuntimeError("simulated device failure")
            return execute(seqs)
        s.engine.runner.execute = flaky
        r = _post(s.url, {"prompt": [9, 9, 9, 9], "max_tokens": 2}, "step-fails-1")
        assert r.status_code == 500 and "model step" in r.json()["error"]["message"]
        assert _post(s.url, {"prompt": [1, 2, 3], "max_tokens": 2}, "step-ok-1").status_code == 200
        m = _metrics(s.url)
        assert m["nanoserve:request_rejected_total{code=500}"] == 1
        assert httpx.get(s.url + "/health").status_code == 200
        s.wait_idle()
    assert any(line == "[engine] the model step failed (1 in a row); ending its 1 request(s): step-fails-1"
               for line in logs()), logs()


def test_streaming_stalls_or_never_ends_after_a_client_leaves(server, logs):
    """Streaming stalls or never ends after a client leaves."""
    before = _metrics(server.url).get("nanoserve:request_success_total{finished_reason=abort}", 0)
    server.delay = 0.02
    try:
        with httpx.stream("POST", server.url + "/v1/completions", headers={"X-Request-Id": "leave-1"}, timeout=30,
                          json={"prompt": "hello", "max_tokens": 240, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()  # (keep it: a dropped iterator closes the response)
            next(lines)
            assert _metrics(server.url)["nanoserve:num_requests_running"] == 1
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
            httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": "leave-2"},
                       json={"prompt": "hello", "max_tokens": 240, "ignore_eos": True},
                       timeout=httpx.Timeout(5, read=0.3))
        server.wait_idle(timeout=2)
    finally:
        server.delay = 0.0
    m = _metrics(server.url)
    assert m["nanoserve:num_requests_running"] == 0 and m["nanoserve:kv_cache_usage_perc"] == 0
    assert m["nanoserve:request_success_total{finished_reason=abort}"] == before + 2
    lines = logs()
    assert any(line.startswith("[entry] leave-1: aborted 1 choice(s) (client disconnected mid-stream) in ")
               for line in lines), lines
    assert any(line.startswith("[entry] leave-2: aborted 1 choice(s) (client disconnected) in ")
               for line in lines), lines
