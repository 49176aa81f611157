"""Async scheduling (vLLM's --async-scheduling): step N+1 is scheduled and launched
before step N's sampled ids reach the host. On the CPU nothing overlaps, but the
bookkeeping is the same as on a GPU, so the outputs must be the normal mode's:
token ids, text, finish and stop reasons, logprobs (to fp32 rounding: a wasted row
of a request that just finished changes the batch), over batches that finish at
different lengths, chunked prefill with requests arriving mid-stream, preemption,
n > 1 with seeds, stop strings, stop tokens and EOS, aborts, the requests that
cannot run ahead (penalties, bad_words, structured outputs, prompt logprobs), the
padded decode path, a failed step, and the server. Each async run also checks that
steps did overlap (a launch while the step before it was in flight)."""
from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from conftest import VOCAB
from nanoserve import LLM, SamplingParams
from nanoserve.engine import EngineConfig
from nanoserve.entry import engine_config, parse_args

_rng = torch.Generator().manual_seed(22)
PROMPTS = [torch.randint(1, VOCAB, (n,), generator=_rng).tolist() for n in (40, 7, 19, 1, 60, 3, 23)]
TEXTS = ["The quick brown fox", "import os, sys; print", "hello world", "def main(): return"]
EOS = 0  # conftest: the config's eos_token_id and the tokenizer's <|endoftext|>
_llms: dict = {}


def make(model, async_scheduling: bool, **kw) -> LLM:
    """One LLM per (mode, settings) for the whole module. Each records, at each
    launch, how many steps were in flight (the one launched included) and which
    requests the one before it samples for."""
    key = (async_scheduling, tuple(sorted(kw.items())))
    if key not in _llms:
        kw = {k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()}
        llm = LLM(str(model), **{"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 64, **kw},
                  async_scheduling=async_scheduling)
        engine, launch = llm.engine, llm.engine.runner.execute_model
        llm.launches = []

        def recording(seqs):
            # never a position past the last one a request needs (Request.max_num_tokens)
            assert all(s.start + s.num_new_tokens < s.request.max_num_tokens
                       for s in engine.in_flight[-1].sched.scheduled)
            ahead = [s.request for f in engine.in_flight[:-1] for s in f.sched.scheduled if s.will_sample]
            llm.launches.append((len(engine.in_flight), ahead))
            return launch(seqs)
        engine.runner.execute_model = recording
        _llms[key] = llm
    llm = _llms[key]
    llm.launches.clear()
    return llm


def both(model, prompts, params, **kw):
    """The outputs of the normal and the async mode, and the async LLM."""
    sync, asyn = make(model, False, **kw), make(model, True, **kw)
    before = [llm.stats()["generation_tokens"] for llm in (sync, asyn)]
    a = sync.generate(prompts, params, use_tqdm=False)
    b = asyn.generate(prompts, params, use_tqdm=False)
    for llm in (sync, asyn):
        assert_idle(llm)
    assert_same(a, b)
    # nothing appended past a stop (a discarded row counts no token)
    assert sync.stats()["generation_tokens"] - before[0] == asyn.stats()["generation_tokens"] - before[1]
    return a, b, asyn


def assert_same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x.outputs) == len(y.outputs)
        assert (x.prompt_logprobs is None) == (y.prompt_logprobs is None)
        for px, py in zip(x.prompt_logprobs or [], y.prompt_logprobs or [], strict=True):
            assert (px is None) == (py is None) and (px or {}).keys() == (py or {}).keys()
            assert all(abs(px[t].logprob - py[t].logprob) < 1e-4 and px[t].rank == py[t].rank for t in px or {})
        for c, d in zip(x.outputs, y.outputs):
            assert (c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) == \
                (d.index, d.token_ids, d.text, d.finish_reason, d.stop_reason)
            assert (c.logprobs is None) == (d.logprobs is None)
            for ec, ed in zip(c.logprobs or [], d.logprobs or []):
                assert ec.keys() == ed.keys() and all(abs(ec[t].logprob - ed[t].logprob) < 1e-4 for t in ec)
            if c.cumulative_logprob is not None:
                assert abs(c.cumulative_logprob - d.cumulative_logprob) < 1e-3


def assert_idle(llm) -> None:
    engine, s = llm.engine, llm.stats()
    assert not engine.in_flight and not engine.has_unfinished_requests()
    assert s["num_free_blocks"] == s["num_total_blocks"]


def overlapped(llm) -> int:
    """How many steps were launched while the step before them was in flight."""
    return sum(n == 2 for n, _ in llm.launches)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


def test_greedy_batch_with_logprobs_and_length_caps(model):
    """Requests that end at different lengths (1 token: the first sampled is the
    last, so the next step must skip it; one ended by max_model_len)."""
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2)
              for m in (1, 2, 5, 9, 16, 3, 12)] + [SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)]
    a, b, asyn = both(model, PROMPTS + [PROMPTS[4] * 2], params)
    assert [len(o.outputs[0].token_ids) for o in a] == [1, 2, 5, 9, 16, 3, 12, 8]
    assert a[-1].outputs[0].finish_reason == "length"
    assert overlapped(asyn) >= 10


GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=1)
SEEDED = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=14, ignore_eos=True) for i in range(7)]


def test_preemption_with_a_token_in_flight(model):
    """A tiny KV cache: requests are preempted while their token is on the device
    (it lands into the preempted request), greedy and seeded."""
    for params in (GREEDY, SEEDED):
        a, b, asyn = both(model, PROMPTS, params, num_kv_blocks=8)
        assert overlapped(asyn) >= 5
    assert make(model, True, num_kv_blocks=8).stats()["num_preemptions"] > 0


def test_padded_decode_reads_the_token_in_flight(model):
    """The padded decode path (CUDA graphs' path, run eagerly on the CPU) writes the
    inputs still on the device into its static buffer: greedy and seeded."""
    asyn = make(model, True, cudagraph_capture_sizes=(1, 2, 4, 8))
    runner, padded, used = asyn.engine.runner, asyn.engine.runner._run_decode_padded, []
    runner._run_decode_padded = lambda seqs: used.append(any(s.prev_sample_row is not None for s in seqs)) \
        or padded(seqs)
    try:
        for params in (GREEDY, SEEDED):
            a, b, asyn = both(model, PROMPTS, params, cudagraph_capture_sizes=(1, 2, 4, 8))
            assert overlapped(asyn) >= 5
    finally:
        del runner._run_decode_padded
    assert any(used), "no padded step read its input from the step in flight"


def test_n_seeded_stops_and_eos(model):
    """n > 1 with seeds; a stop string, a stop token and EOS after min_tokens end
    requests whose next step is already launched: its row is discarded."""
    ref = make(model, False).generate(TEXTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                      use_tqdm=False)
    text, ids = ref[0].outputs[0].text, ref[1].outputs[0].token_ids
    stop = text[len(text) // 2:len(text) // 2 + 2]
    params = [SamplingParams(temperature=0, max_tokens=24, stop=[stop], logprobs=1),
              SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ids[6]]),
              SamplingParams(temperature=0, max_tokens=24, min_tokens=3, logit_bias={EOS: 50.0}),
              SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, stop=[stop], include_stop_str_in_output=True)]
    a, b, asyn = both(model, TEXTS, params)
    assert a[0].outputs[0].finish_reason == a[1].outputs[0].finish_reason == "stop"
    assert a[0].outputs[0].stop_reason == stop and a[1].outputs[0].stop_reason == ids[6]
    assert a[1].outputs[0].token_ids == ids[:ids.index(ids[6]) + 1]  # nothing past the stop token
    assert a[2].outputs[0].finish_reason == "stop" and len(a[2].outputs[0].token_ids) == 4  # EOS at min_tokens
    assert len({tuple(c.token_ids) for c in a[3].outputs}) > 1
    assert overlapped(asyn) >= 5


def test_requests_that_need_the_host_land_first(model, monkeypatch):
    """Penalties, bad_words, structured outputs and prompt logprobs need the step
    in flight on the host: no step is launched ahead of one in which they sample (or
    bring prompt logprobs back), and their outputs and everyone else's stay the same."""
    pytest.importorskip("xgrammar")
    bad = make(model, False).generate([TEXTS[0]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    bad_word = make(model, False).get_tokenizer().decode(bad[0].outputs[0].token_ids[2:3]).strip() or "x"
    needy = [SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.5),
             SamplingParams(temperature=0, max_tokens=7, presence_penalty=1.0, frequency_penalty=0.5),
             SamplingParams(temperature=0, max_tokens=6, bad_words=[bad_word]),
             SamplingParams(temperature=1.0, seed=3, max_tokens=30,
                            structured_outputs={"choice": ["red fox", "blue dog"]})]
    plain = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1),
             SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)]
    a, b, asyn = both(model, TEXTS + TEXTS[:2], needy + plain)
    assert a[3].outputs[0].text in ("red fox", "blue dog")
    assert a[5].prompt_logprobs is not None
    assert all(r.can_run_ahead for n, ahead in asyn.launches for r in ahead)
    assert overlapped(asyn) >= 5  # once they finished, the plain request ran ahead


def test_requests_left_without_a_token_end_alike(model):
    """A request its constraints leave without a token (a finished grammar under min_tokens;
    allowed_token_ids whose next token completes a bad word) stops in the step that finds it, in
    both modes; the requests that run ahead beside it get the normal mode's tokens."""
    pytest.importorskip("xgrammar")
    tok = make(model, False).get_tokenizer()
    (x,) = tok.encode("x", add_special_tokens=False)
    stuck = [SamplingParams(temperature=0, max_tokens=9, min_tokens=7, structured_outputs={"json": {"enum": ["a"]}}),
             SamplingParams(temperature=1.0, seed=2, max_tokens=8, allowed_token_ids=[x], bad_words=["xx"])]
    plain = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1),
             SamplingParams(temperature=1.0, seed=6, max_tokens=20, ignore_eos=True)]
    a, b, asyn = both(model, TEXTS, stuck + plain)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in a[:2]] == \
        [(tok.encode('"a"', add_special_tokens=False), "stop"), ([x], "stop")]
    assert overlapped(asyn) >= 5  # once they ended, the plain ones ran ahead


def test_chunked_prefill_arrivals_and_aborts(model):
    """The engine driven by hand, as the server does: requests arrive and are
    aborted between steps, prompts prefill in chunks of 16 tokens. The aborted
    request's tokens are a prefix of its normal-mode ones; all others are equal."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    arrivals = {0: [0, 1, 2], 2: [3, 4], 5: [5], 9: [6]}

    def drive(llm):
        engine, outs, step = llm.engine, {}, 0
        while step <= max(arrivals) or engine.has_unfinished_requests():
            for i in arrivals.get(step, []):
                engine.add_request(PROMPTS[i], greedy, request_id=f"r{i}")
            if step == 7:
                engine.abort_request("r1")
            for out in engine.step():
                outs.setdefault(out.request_id, []).append(out)
            step += 1
        assert_idle(llm)
        return outs

    sync, asyn = make(model, False, max_num_batched_tokens=16), make(model, True, max_num_batched_tokens=16)
    a, b = drive(sync), drive(asyn)
    assert a.keys() == b.keys() and "r1" in a
    for rid in a:
        if rid != "r1":
            assert_same([a[rid][-1]], [b[rid][-1]])
    a1, b1 = a["r1"][-1].outputs[0].token_ids, b["r1"][-1].outputs[0].token_ids
    assert not a["r1"][-1].finished and b1 == a1[:len(b1)]
    assert overlapped(asyn) >= 5


def test_a_failed_step_ends_the_requests_of_both_steps(model):
    """A launch that raises while a step is in flight ends the requests of both;
    the engine carries on, and its next outputs are the normal mode's."""
    asyn = make(model, True, num_kv_blocks=48)
    engine, launch, calls = asyn.engine, asyn.engine.runner.execute_model, []

    def broken(seqs):
        calls.append(len(engine.in_flight))
        if len(calls) == 4:
            raise RuntimeError("boom")
        return launch(seqs)
    engine.runner.execute_model = broken
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            asyn.generate(PROMPTS[:3], params, use_tqdm=False)
    finally:
        engine.runner.execute_model = launch
    assert calls[-1] == 2  # it failed beside a step in flight
    assert_idle(asyn)
    ref = make(model, False, num_kv_blocks=48).generate(PROMPTS[:3], params, use_tqdm=False)
    assert_same(ref, asyn.generate(PROMPTS[:3], params, use_tqdm=False))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_request_whose_inputs_fail_while_built_ends_alone(model, async_scheduling, monkeypatch):
    """A request whose step inputs cannot be built (here its sampling row raises) had
    moved on in the scheduler: it must end with an error, not stay running with nothing
    left to compute (the server's client would wait forever); the other in its step runs
    on as without it. Offline the error reaches the caller; the server's client gets it."""
    from nanoserve.engine import AsyncLLM, Request, RequestFailedError
    real, armed = Request.sample_request, [True]

    def flaky(req):  # once armed, the first sampling row of PROMPTS[1] raises
        if armed and req.prompt_token_ids == PROMPTS[1]:
            armed.clear()
            raise RuntimeError("boom while building the step")
        return real(req)
    monkeypatch.setattr(Request, "sample_request", flaky)
    llm = make(model, async_scheduling)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def serve():
        front = AsyncLLM(engine)
        front.start()
        try:
            qa, qb = asyncio.Queue(), asyncio.Queue()
            front.add_request(PROMPTS[0], params, "a", qa)
            front.add_request(PROMPTS[1], params, "b", qb)
            results = []
            for q in (qa, qb):
                while not isinstance(item := await asyncio.wait_for(q.get(), 60), BaseException) \
                        and not item.finished:
                    pass
                results.append(item)
            return results
        finally:
            await front.shutdown()
    a, b = asyncio.run(serve())
    assert not armed and isinstance(b, RequestFailedError)
    assert a.outputs[0].token_ids == llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    assert_idle(llm)
    armed.append(True)  # offline: the error reaches generate's caller, and nothing is left running
    with pytest.raises(RequestFailedError, match="building this request's step inputs failed"):
        llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert not armed
    assert_idle(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_shutdown_mid_step_leaves_the_engine_reusable(model, async_scheduling):
    """The server's engine loop cancelled while a step runs on the model thread
    (shutdown): no step stays in flight, so the engine can be driven again."""
    import threading

    from nanoserve.engine import AsyncLLM
    llm = make(model, async_scheduling)
    engine, launch = llm.engine, llm.engine.runner.execute_model
    entered, release = threading.Event(), threading.Event()

    def held(seqs):
        entered.set()
        release.wait(60)  # until shutdown has cancelled the loop
        return launch(seqs)

    async def serve():
        front = AsyncLLM(engine)
        front.start()
        front.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6), "a", asyncio.Queue())
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 60)
        closing = asyncio.ensure_future(front.shutdown())
        await asyncio.sleep(0)  # the loop task is cancelled; the launch still holds the model thread
        release.set()
        await closing
    engine.runner.execute_model = held
    try:
        asyncio.run(serve())
    finally:
        engine.runner.execute_model = launch
    assert entered.is_set()
    assert_idle(llm)
    ref = make(model, not async_scheduling).generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=5),
                                                     use_tqdm=False)
    assert_same(ref, llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False))


def test_flag_and_tensor_parallel_refusal(model, capsys):
    assert engine_config(parse_args(["--model", str(model), "--async-scheduling"])).async_scheduling
    assert not engine_config(parse_args(["--model", str(model)])).async_scheduling
    with pytest.raises(ValueError, match="tensor_parallel_size > 1.*sampled token ids"):
        EngineConfig(str(model), tensor_parallel_size=2, async_scheduling=True)
    with pytest.raises(SystemExit):  # the CLI's one-line error, not a traceback
        parse_args(["--model", str(model), "--async-scheduling", "--tensor-parallel-size", "2"])
    assert "--async-scheduling does not work with --tensor-parallel-size > 1" in capsys.readouterr().err


def test_server_streams_the_same(model):
    """`--async-scheduling` through HTTP: concurrent streams (greedy, a stop string,
    seeded) add up to the normal mode's outputs, and its steps overlapped."""
    from test_server import ServerThread
    prompts = [f"prompt number {i}: the quick brown fox" for i in range(6)]
    offline = LLM(str(model), dtype="float32", num_kv_blocks=64, max_model_len=256)
    text = offline.generate(prompts[1], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    params = [dict(temperature=0, max_tokens=12), dict(temperature=0, max_tokens=12, stop=[text[5:7]]),
              dict(temperature=1.0, seed=4, max_tokens=9)] * 2
    refs = offline.generate(prompts, [SamplingParams(**p) for p in params], use_tqdm=False)
    server = ServerThread(model, "--async-scheduling")
    engine, launch, launches = server.engine, server.engine.runner.execute_model, []
    server.engine.runner.execute_model = lambda seqs: launches.append(len(engine.in_flight)) or launch(seqs)
    with server:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

        async def one(prompt, p):
            stream = await aclient.completions.create(model=str(server.args.model), prompt=prompt, stream=True, **p)
            chunks = [c.choices[0] async for c in stream]
            return "".join(c.text for c in chunks), chunks[-1].finish_reason

        async def all_of_them():
            try:
                return await asyncio.gather(*(one(pr, p) for pr, p in zip(prompts, params)))
            finally:
                await aclient.close()
        got = asyncio.run(all_of_them())
        server.wait_idle()
    assert got == [(r.outputs[0].text, r.outputs[0].finish_reason) for r in refs]
    assert any(r.outputs[0].finish_reason == "stop" for r in refs)
    assert 2 in launches
