"""Custom logits processors, vLLM's interface (nanoserve.LogitsProcessor): the rows a
processor is told of follow the batch as requests come, go and move; each kind of
processor acts where vLLM applies it; rows that do not ask are untouched; and bad
processors or requests get a clear error (a 400 from the server)."""
import random

import httpx
import pytest
import torch

from nanoserve import (LLM, AdapterLogitsProcessor, BatchUpdate, LogitsProcessor, MoveDirectionality,
                       SamplingParams, process_dict_updates)
from nanoserve.engine import InvalidInput
from nanoserve.model import LogitsProcessorBatch, LogitsProcessorFailed, SampleRequest

from test_server import ServerThread


class TargetToken(LogitsProcessor):
    """vLLM's example (DummyLogitsProcessor): a row whose extra_args name a target_token
    may sample only that token."""

    @classmethod
    def validate_params(cls, params):
        target = (params.extra_args or {}).get("target_token")
        if target is not None and (not isinstance(target, int) or target < 0):
            raise ValueError(f"target_token must be a token id, got {target!r}")

    def __init__(self, config, device, is_pin_memory):
        self.targets: dict[int, int] = {}

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        process_dict_updates(self.targets, batch_update,
                             lambda params, _prompt, _out: (params.extra_args or {}).get("target_token"))

    def apply(self, logits):
        for row, target in self.targets.items():
            keep = logits[row, target].clone()
            logits[row] = float("-inf")
            logits[row, target] = keep
        return logits


class Sharpen(LogitsProcessor):
    """Argmax-invariant: multiplies a row's (tempered) logits by extra_args' scale."""

    def __init__(self, config, device, is_pin_memory):
        self.scales: dict[int, float] = {}

    def is_argmax_invariant(self):
        return True

    def update_state(self, batch_update):
        process_dict_updates(self.scales, batch_update, lambda params, _p, _o: (params.extra_args or {}).get("scale"))

    def apply(self, logits):
        for row, scale in self.scales.items():
            logits[row] *= scale
        return logits


class NoRepeat(AdapterLogitsProcessor):
    """Per request (vLLM's AdapterLogitsProcessor): bans the token just sampled, or with
    extra_args' "no_prompt" every prompt token (the three-argument form)."""

    def is_argmax_invariant(self):
        return False

    def new_req_logits_processor(self, params):
        args = params.extra_args or {}
        if args.get("no_prompt"):
            def ban_prompt(prompt_ids, output_ids, row):
                row[prompt_ids] = float("-inf")
                return row
            return ban_prompt
        if args.get("no_repeat"):
            def ban_last(output_ids, row):
                if output_ids:
                    row[output_ids[-1]] = float("-inf")
                return row
            return ban_last
        return None


class Broken(TargetToken):
    def __init__(self, config, device, is_pin_memory):
        raise RuntimeError("no GPU here")


class Picky(TargetToken):
    """Checks its argument as processors often do, without a type check first: a string raises TypeError."""

    @classmethod
    def validate_params(cls, params):
        if (params.extra_args or {}).get("floor", 0) < 0:
            raise ValueError("floor must be >= 0")


# ---------------------------------------------------------------- the rows' bookkeeping

def _rows(ids):
    return [SampleRequest(SamplingParams(extra_args={"owner": rid}), [], [], serial=rid) for rid in ids]


class Recorder(LogitsProcessor):
    def __init__(self, config=None, device=None, is_pin_memory=False):
        self.owners: dict[int, str] = {}
        self.updates: list[BatchUpdate | None] = []

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        self.updates.append(batch_update)
        process_dict_updates(self.owners, batch_update, lambda params, _p, _o: params.extra_args["owner"])

    def apply(self, logits):
        return logits


def test_every_row_is_its_request_whatever_comes_goes_and_moves():
    """Random steps over 12 request ids, in random orders and subsets: after each update
    every row's state is its request's, rows past the batch hold none, a removed row is
    never one an added request takes, and an unchanged batch is told None."""
    rng = random.Random(0)
    rec = Recorder()
    batch = LogitsProcessorBatch([rec])
    pool = list(range(12))
    most = 0
    for _ in range(400):
        ids = rng.sample(pool, rng.randint(0, 8)) if rng.random() < 0.8 else list(batch.rows)
        most = max(most, len(ids))
        batch.update(_rows(ids))
        update = rec.updates[-1]
        assert rec.owners == dict(enumerate(ids))
        if update is None:
            assert ids == batch.rows
            continue
        assert update.batch_size == len(ids)
        assert not set(update.removed) & {i for i, *_ in update.added}
        touched = [*update.removed, *(i for i, *_ in update.added), *(x for a, b, _ in update.moved for x in (a, b))]
        assert all(0 <= i < max(most, 1) for i in touched)
        assert all(d == MoveDirectionality.SWAP for *_, d in update.moved)


def test_an_added_row_hands_over_the_request_s_own_lists():
    rec = Recorder()
    row = SampleRequest(SamplingParams(extra_args={"owner": 0}), [7, 8], [9], serial=0)
    LogitsProcessorBatch([rec]).update([row])
    (index, params, prompt_ids, output_ids), = rec.updates[-1].added
    assert index == 0 and params is row.params and prompt_ids is row.prompt_token_ids
    assert output_ids is row.output_token_ids  # the live list: a processor sees it grow


class FailsOnce(Recorder):
    """Raises at its second update."""
    def update_state(self, batch_update):
        if len(self.updates) == 1 and not getattr(self, "failed", False):
            self.failed = True
            raise RuntimeError("a bug in a processor")
        super().update_state(batch_update)


def test_a_processor_that_raises_leaves_none_out_of_step():
    """The update fails, naming the processor; the next one removes every row and adds them again, for every
    processor, those that saw the failed update and those that did not."""
    first, flaky, last = Recorder(), FailsOnce(), Recorder()
    batch = LogitsProcessorBatch([first, flaky, last])
    batch.update(_rows([0, 1, 2]))
    with pytest.raises(LogitsProcessorFailed, match="the logits processor FailsOnce failed: RuntimeError: a bug"):
        batch.update(_rows([3, 1, 2, 4]))
    batch.update(_rows([1, 4]))
    assert first.owners == flaky.owners == last.owners == {0: 1, 1: 4}


# ---------------------------------------------------------------- through the engine

@pytest.fixture(scope="module")
def plain(tiny_model):
    return LLM(str(tiny_model), dtype="float32", num_kv_blocks=64, max_model_len=256)


def _llm(tiny_model, *processors, **kw):
    kw = {"num_kv_blocks": 64, "max_model_len": 256, **kw}
    return LLM(str(tiny_model), dtype="float32", logits_processors=list(processors), **kw)


PROMPTS = [[5, 9, 11, 3], [40, 41, 42], [100, 7, 7, 7, 7, 2], [17] * 30]


def _tokens(llm, params):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("kw", [{}, {"async_scheduling": True},
                                {"num_kv_blocks": 7, "block_size": 8, "max_model_len": 48},
                                {"max_num_batched_tokens": 16, "max_num_seqs": 2}],
                         ids=["plain", "async", "preempting", "chunked"])
def test_a_batch_processor_acts_on_the_rows_that_ask_only(tiny_model, plain, kw):
    """Half the rows name a target token: they sample only it; the others sample what they
    would without the processor, greedy and seeded, under async scheduling, preemption
    (7 blocks of 8 for 13: rows leave the batch and come back) and chunked prefill."""
    llm = _llm(tiny_model, TargetToken, **kw)
    greedy = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                             extra_args={"target_token": 77} if i % 2 else None) for i in range(4)]
    seeded = [SamplingParams(temperature=0.9, seed=i, max_tokens=12, ignore_eos=True,
                             extra_args={"target_token": 200} if i % 2 == 0 else None) for i in range(4)]
    for params, want_target, target in ((greedy, 1, 77), (seeded, 0, 200)):
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        free = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
        for i, (g, f) in enumerate(zip(got, free)):
            assert g == ([target] * 12 if i % 2 == want_target else f), i
    if "num_kv_blocks" in kw:
        assert llm.stats()["num_preemptions"] > 0


def test_an_argmax_invariant_processor_runs_after_temperature_and_not_for_greedy_rows(tiny_model, plain):
    """Logits / 0.5 x 0.5 is logits / 1.0 bit for bit: a seeded row with the processor's scale 0.5
    at temperature 0.5 draws what it draws at temperature 1.0 without it. Greedy rows skip it."""
    llm = _llm(tiny_model, Sharpen)
    scaled = SamplingParams(temperature=0.5, seed=3, max_tokens=16, ignore_eos=True, extra_args={"scale": 0.5})
    want = plain.generate(PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True),
                          use_tqdm=False)
    got = llm.generate(PROMPTS, scaled, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    unscaled = plain.generate(PROMPTS, SamplingParams(temperature=0.5, seed=3, max_tokens=16, ignore_eos=True),
                              use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] != [o.outputs[0].token_ids for o in unscaled]
    greedy = SamplingParams(temperature=0, max_tokens=8, extra_args={"scale": -1.0})  # would flip the argmax
    assert _tokens(llm, greedy) == _tokens(plain, greedy)


def test_per_request_functions_through_the_adapter(tiny_model, plain):
    llm = _llm(tiny_model, NoRepeat)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, extra_args=x)
              for x in ({"no_repeat": True}, None, {"no_prompt": True}, {"no_repeat": True})]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    free = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    assert got[1] == free[1]
    for i in (0, 3):
        assert all(a != b for a, b in zip(got[i], got[i][1:]))
    assert not set(got[2]) & set(PROMPTS[2])
    # the model repeats itself (greedy, tiny): the bans had something to do
    assert any(a == b for f in (free[0], free[3]) for a, b in zip(f, f[1:])) or set(free[2]) & set(PROMPTS[2])


def test_a_request_id_used_again_is_a_new_row(tiny_model):
    """Rows are keyed by the engine's own serial: a finished request's id, reused, does not inherit
    the processor's state for it."""
    engine = _llm(tiny_model, TargetToken).engine

    def run(extra_args):
        engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                      extra_args=extra_args), "x")
        outs = [o for _ in range(40) if engine.has_unfinished_requests() for o in engine.step() if o.finished]
        return outs[-1].outputs[0].token_ids
    assert run({"target_token": 42}) == [42] * 4
    assert run(None) != [42] * 4


def test_logprobs_stay_the_raw_model_s(tiny_model, plain):
    """As vLLM's raw_logprobs: a processor changes what is sampled, not the logprobs reported."""
    llm = _llm(tiny_model, TargetToken)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=3, extra_args={"target_token": 77})
    got = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    free = plain.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=1, logprobs=3),
                          use_tqdm=False)[0].outputs[0]
    assert got.token_ids == [77]
    top = {t: lp.logprob for t, lp in free.logprobs[0].items()}
    assert all(abs(got.logprobs[0][t].logprob - v) < 1e-5 for t, v in top.items())


class BanAll(TargetToken):
    def apply(self, logits):
        for row in self.targets:
            logits[row] = float("-inf")
        return logits


def test_a_processor_that_leaves_no_token_ends_the_request(tiny_model):
    """As the sampler's own bans: the row is flagged on the device, the request ends with what it has."""
    llm = _llm(tiny_model, BanAll)
    outs = llm.generate([PROMPTS[0]] * 2, [SamplingParams(max_tokens=5, extra_args={"target_token": 1}),
                                           SamplingParams(max_tokens=5, ignore_eos=True)], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [] and outs[0].outputs[0].finish_reason == "stop"
    assert len(outs[1].outputs[0].token_ids) == 5


# ---------------------------------------------------------------- a processor that raises

class Boom(TargetToken):
    """Raises in apply where a row's extra_args ask it to (a processor's bug, met by some requests only)."""

    def __init__(self, config, device, is_pin_memory):
        super().__init__(config, device, is_pin_memory)
        self.booms: dict[int, bool] = {}

    def update_state(self, batch_update):
        super().update_state(batch_update)
        process_dict_updates(self.booms, batch_update, lambda params, _p, _o: (params.extra_args or {}).get("boom"))

    def apply(self, logits):
        if self.booms:
            raise RuntimeError("secret-internal-detail")
        return super().apply(logits)


class ForgetsToReturn(Boom):
    """Returns None where a row's extra_args ask it to (its bug: it forgot its return there)."""

    def apply(self, logits):
        return None if self.booms else TargetToken.apply(self, logits)


class BoomPerRequest(AdapterLogitsProcessor):
    """Per request: "bad_index" indexes past the row (IndexError in apply), "bad_arity" gives a function
    of one argument (ValueError in update_state)."""

    def is_argmax_invariant(self):
        return False

    def new_req_logits_processor(self, params):
        args = params.extra_args or {}
        if args.get("bad_index"):
            return lambda output_ids, row: row[10 ** 9]
        if args.get("bad_arity"):
            return lambda row: row
        return None


def _run_engine(engine, prompts, params):
    """Every request to its end, in one batch: the outputs of those that finish, and why each that failed did."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(prompt, p, f"r{i}")
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    failed, engine.failed_requests = engine.failed_requests, {}
    return outs, failed


@pytest.mark.parametrize("processor, bad, error", [
    (Boom, {"boom": True}, "RuntimeError: secret-internal-detail"),
    (BoomPerRequest, {"bad_index": 1}, "IndexError: index 1000000000 is out of bounds"),
    (BoomPerRequest, {"bad_arity": 1}, "ValueError: a request's logits processor takes"),
    (ForgetsToReturn, {"boom": True}, "TypeError: apply returned None, not logits of shape (1, ")],
                         ids=["apply", "adapter", "update", "returns-none"])
def test_a_processor_that_raises_fails_only_the_requests_it_raises_for(tiny_model, plain, processor, bad, error,
                                                                       caplog):
    """One request of four makes the processor raise: it alone fails, named by the processor (its error in the
    log only, as a failed step's); the others, greedy and seeded, sample what they do in a batch without it;
    the engine serves on."""
    engine = _llm(tiny_model, processor).engine
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, extra_args=bad),
              SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)]
    outs, failed = _run_engine(engine, PROMPTS, params)
    assert failed == {"r1": f"the logits processor {processor.__name__} failed for this request; the server log "
                            f"has the details"}
    assert f"r1: the logits processor {processor.__name__} failed: {error}" in caplog.text
    keep = [0, 2, 3]
    want = plain.generate([PROMPTS[i] for i in keep], [params[i] for i in keep], use_tqdm=False)
    assert [outs[f"r{i}"] for i in keep] == [o.outputs[0].token_ids for o in want]
    again, failed = _run_engine(engine, PROMPTS[:1], params[:1])  # and it serves the next ones
    assert again == {"r0": outs["r0"]} and not failed


def test_a_raising_processor_is_the_llm_s_request_failed_error_and_the_server_s_500(tiny_model):
    from nanoserve.engine import RequestFailedError
    llm = _llm(tiny_model, Boom)
    with pytest.raises(RequestFailedError, match=r"the logits processor Boom failed for this request"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, extra_args={"boom": True}), use_tqdm=False)
    assert len(llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) == 3
    with ServerThread(tiny_model, "--logits-processors", "test_logits_processors:Boom") as s:
        body = {"model": str(tiny_model), "prompt": [5, 9, 11], "max_tokens": 4, "temperature": 0}
        bad = httpx.post(s.url + "/v1/completions", json={**body, "vllm_xargs": {"boom": True}},
                         timeout=60)
        assert bad.status_code == 500 and "the logits processor Boom failed" in bad.json()["error"]["message"]
        assert "secret" not in bad.text and "RuntimeError" not in bad.text
        ok = httpx.post(s.url + "/v1/completions", json={**body, "vllm_xargs": {"target_token": 77},
                                                         "return_token_ids": True}, timeout=60)
        assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == [77] * 4
        s.wait_idle()


# ---------------------------------------------------------------- loading and refusing

def test_processors_by_name_and_what_is_refused(tiny_model):
    llm = _llm(tiny_model, "test_logits_processors:TargetToken", "test_logits_processors.NoRepeat", Picky)
    assert [type(p).__name__ for p in llm.engine.runner.sampler.custom.processors] == ["TargetToken", "NoRepeat",
                                                                                      "Picky"]
    with pytest.raises(InvalidInput, match=r"extra_args refused by the logits processor TargetToken: target_token"):
        llm.generate([PROMPTS[0]], SamplingParams(extra_args={"target_token": "x"}), use_tqdm=False)
    with pytest.raises(InvalidInput, match=r"extra_args refused by the logits processor Picky: '<' not supported"):
        llm.generate([PROMPTS[0]], SamplingParams(extra_args={"floor": "x"}), use_tqdm=False)  # its TypeError
    for bad, why in (("no_such_module:X", "cannot import it"), ("test_logits_processors:Nope", "cannot import it"),
                     ("random:Random", "is not a subclass"), (int, "is not a subclass")):
        with pytest.raises(ValueError, match=why):
            _llm(tiny_model, bad)
    with pytest.raises(ValueError, match=r"logits processor Broken failed to start: RuntimeError: no GPU here"):
        _llm(tiny_model, Broken)


def test_the_server_loads_them_and_answers_400_for_what_they_refuse(tiny_model):
    with ServerThread(tiny_model, "--logits-processors", "test_logits_processors:TargetToken") as s:
        body = {"model": str(tiny_model), "prompt": [5, 9, 11], "max_tokens": 4, "temperature": 0}
        ok = httpx.post(s.url + "/v1/completions", json={**body, "vllm_xargs": {"target_token": 77}}, timeout=60)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None
        ids = httpx.post(s.url + "/v1/completions", json={**body, "vllm_xargs": {"target_token": 77},
                                                         "return_token_ids": True}, timeout=60).json()
        assert ids["choices"][0]["token_ids"] == [77] * 4
        bad = httpx.post(s.url + "/v1/completions", json={**body, "vllm_xargs": {"target_token": -3}}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "vllm_xargs"
        assert "TargetToken: target_token must be a token id, got -3" in bad.json()["error"]["message"]
        per_request = httpx.post(s.url + "/v1/completions", json={**body, "logits_processors": ["x.Y"]}, timeout=60)
        assert per_request.status_code == 400 and "--logits-processors" in per_request.json()["error"]["message"]
        s.wait_idle()
