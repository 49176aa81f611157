"""Offline engine tests: greedy outputs do not depend on how the engine got
them (preemption, chunked prefill, one sequence at a time, prefix-cache hits
or none, any block size), every block is free afterwards, outputs come back
in input order with vLLM's fields, and bad inputs fail with a clear
ValueError before anything is queued."""
from __future__ import annotations

import json
import logging
import os
import platform
import re
import shutil
import sys

import pytest
import torch

from conftest import VOCAB, make_model
from nanoserve import LLM, RequestOutput, SamplingParams
from nanoserve.engine import RequestOutputKind

MAX_LEN = 128
_rng = torch.Generator().manual_seed(99)


def _rand(n: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=_rng).tolist()


SHARED = _rand(40)  # a long common prefix: 2 full blocks of 16 (5 of 8, 1 of 32)
PROMPTS = [SHARED + _rand(5), _rand(7), SHARED + _rand(9), _rand(1), _rand(60), SHARED + _rand(2), _rand(23)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model(model_root):
    return make_model(model_root, "llama")


def make_llm(model, **kw) -> LLM:
    kw = {"dtype": "float32", "max_model_len": MAX_LEN, "num_kv_blocks": 256, **kw}
    return LLM(str(model), **kw)


def token_ids(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_all_blocks_free(llm: LLM) -> None:
    s = llm.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]
    assert s["num_running"] == s["num_waiting"] == 0
    assert all(b.ref_cnt == 0 for b in llm.engine.scheduler.block_manager.blocks)


def check_tokens_survive_preemption_chunks_and_prefix_hits(path) -> None:
    """The all-constraints run (preempted while chunked, prefix blocks shared) gives the unconstrained
    run's greedy tokens, and ends with every block free: a new model family's check."""
    ref = make_llm(path).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = make_llm(path, block_size=8, num_kv_blocks=17, max_num_batched_tokens=8, max_num_seqs=3)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outs) == token_ids(ref)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def reference(model):
    """The unconstrained run: everything fits, one step prefills all prompts."""
    llm = make_llm(model)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(t) == 16 for t in token_ids(outs))
    assert len(set(map(tuple, token_ids(outs)))) > 1  # the prompts do lead to different outputs
    assert_all_blocks_free(llm)
    return token_ids(outs), llm.stats()


# ---------------------------------------------------------------- output invariance

@pytest.mark.parametrize("kw, forced", [
    # 8 blocks of 16 hold one max_model_len request: the batch must preempt.
    ({"num_kv_blocks": 8}, "preempt"),
    ({"max_num_batched_tokens": 8}, "chunk"),
    ({"max_num_seqs": 1}, None),
    ({"enable_prefix_caching": False}, None),
    ({"block_size": 8}, None),
    ({"block_size": 32, "num_kv_blocks": 64}, None),
    # All at once: preemption while chunking, with a small block and few sequences.
    ({"block_size": 8, "num_kv_blocks": 17, "max_num_batched_tokens": 8, "max_num_seqs": 3}, "preempt"),
], ids=["preempt", "chunked", "one-seq", "no-prefix-cache", "block8", "block32", "all-constraints"])
def test_greedy_outputs_do_not_depend_on_scheduling(model, reference, kw, forced):
    llm = make_llm(model, **kw)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference[0]
    assert_all_blocks_free(llm)
    stats = llm.stats()
    if forced == "preempt":
        assert stats["num_preemptions"] > 0
    if not kw.get("enable_prefix_caching", True):
        assert stats["prefix_cache_hits"] == 0
    assert stats["num_finished"] == len(PROMPTS)


@pytest.mark.parametrize("kw", [{"num_kv_blocks": 8}, {"max_num_batched_tokens": 8},
                                {"block_size": 8, "num_kv_blocks": 17, "max_num_batched_tokens": 8,
                                 "max_num_seqs": 3}], ids=["preempt", "chunked", "all-constraints"])
def test_seeded_sampling_does_not_depend_on_scheduling(model, kw):
    # A seeded request draws the same tokens however it was batched, chunked or
    # preempted and recomputed; its logprobs come out the same too.
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=10, ignore_eos=True, logprobs=2)
              for i in range(len(PROMPTS))]
    ref = make_llm(model).generate(PROMPTS, params, use_tqdm=False)
    llm = make_llm(model, **kw)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert token_ids(got) == token_ids(ref)
    assert [o.outputs[0].cumulative_logprob for o in got] == pytest.approx(
        [o.outputs[0].cumulative_logprob for o in ref], abs=1e-4)
    assert_all_blocks_free(llm)


def test_shared_prefix_hits_the_cache_in_the_same_batch(model, reference):
    llm = make_llm(model)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outs) == reference[0]
    assert llm.stats()["prefix_cache_hits"] >= 2 * 32  # the 2nd and 3rd SHARED prompts, 2 blocks each
    assert outs[0].num_cached_tokens == 0
    assert outs[2].num_cached_tokens == 32 and outs[5].num_cached_tokens == 32
    assert_all_blocks_free(llm)


def test_a_second_generate_hits_blocks_the_first_left_cached(model, reference):
    llm = make_llm(model, num_kv_blocks=24)  # small enough that the second run also evicts
    first = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    hits = llm.stats()["prefix_cache_hits"]
    second = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert first == token_ids(second) == reference[0]
    assert llm.stats()["prefix_cache_hits"] > hits
    assert second[0].num_cached_tokens == 32  # its own cached prefix from the first run
    assert_all_blocks_free(llm)


def test_prompts_added_one_by_one_match_the_batch(model, reference):
    # Requests arriving while others decode must not change anyone's tokens.
    llm = make_llm(model, num_kv_blocks=12)
    engine, ids, done = llm.engine, [], {}
    for prompt in PROMPTS:
        ids.append(engine.add_request(prompt, GREEDY))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [done[i].outputs[0].token_ids for i in ids] == reference[0]
    assert_all_blocks_free(llm)


def test_final_only_requests_report_once_when_finished(model):
    """LLM.generate's requests (vLLM's FINAL_ONLY): no per-step outputs, one final
    one with every token; n > 1 children each report as they finish."""
    llm = make_llm(model)
    engine = llm.engine
    streamed = engine.add_request(PROMPTS[1], GREEDY)
    final = engine.add_request(PROMPTS[1], GREEDY, output_kind=RequestOutputKind.FINAL_ONLY)
    family = engine.add_request(PROMPTS[3], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6),
                                output_kind=RequestOutputKind.FINAL_ONLY)
    seen: dict[str, list[RequestOutput]] = {streamed: [], final: [], family: []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen[streamed]) == 16 and [o.finished for o in seen[streamed]] == [False] * 15 + [True]
    assert len(seen[final]) == 1 and seen[final][0].finished
    assert seen[final][0].outputs[0].token_ids == seen[streamed][-1].outputs[0].token_ids
    assert len(seen[final][0].outputs[0].token_ids) == 16
    kids = [c for o in seen[family] for c in o.outputs]
    assert sorted(c.index for c in kids) == [0, 1] and all(len(c.token_ids) == 6 for c in kids)
    assert seen[family][-1].finished and not any(o.finished for o in seen[family][:-1])
    assert_all_blocks_free(llm)


# ---------------------------------------------------------------- outputs and prompt forms

def test_stats_report_the_kv_slots_unused_at_the_peak(model):
    """All prompts fit at once (prefix caching off: no sharing), so the peak is
    the last decode step, when request i holds ceil((len_i + 15) / 16) blocks
    and leaves the tail of the last one empty."""
    llm = make_llm(model, block_size=16, enable_prefix_caching=False)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    s = llm.stats()
    held = [len(p) + GREEDY.max_tokens - 1 for p in PROMPTS]   # the last token is never written
    blocks = sum(-(-n // 16) for n in held)
    assert s["peak_kv_blocks"] == blocks
    assert s["kv_unused_fraction_at_peak"] == pytest.approx(1 - sum(held) / (16 * blocks))
    assert llm.engine.scheduler.block_manager.unused_slots == 0


def test_outputs_come_back_in_input_order(model):
    llm = make_llm(model)
    # The first prompt runs longest and finishes last; the last finishes first.
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 6, 3, 1)]
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == PROMPTS[:4]
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 6, 3, 1]
    assert len({o.request_id for o in outs}) == 4


def test_request_output_fields(model):
    llm = make_llm(model)
    tok = llm.get_tokenizer()
    prompt = "The quick brown fox"
    out, = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert isinstance(out, RequestOutput) and out.finished
    assert out.prompt == prompt and out.prompt_token_ids == tok.encode(prompt)
    c, = out.outputs
    assert c.index == 0 and len(c.token_ids) == 5 and c.finish_reason == "length"
    assert tok.decode(c.token_ids, skip_special_tokens=True) == c.text and c.text
    assert c.cumulative_logprob is None and c.logprobs is None  # not asked for
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time


def test_finished_text_is_the_decode_of_all_its_tokens(model):
    llm = make_llm(model)
    tok = llm.get_tokenizer()
    # A byte-level token that ends in a UTF-8 lead byte: text, then an incomplete character.
    partial = next(i for i in range(VOCAB) if len(tok.decode([i])) > 1 and tok.decode([i]).endswith("\ufffd"))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={partial: 100.0})
    c = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0]
    assert c.token_ids == [partial] * 3
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


def test_eos_stops_only_after_min_tokens(model):
    llm = make_llm(model)
    eos_always = SamplingParams(temperature=0, max_tokens=8, min_tokens=3, logit_bias={0: 100.0})
    c = llm.generate([PROMPTS[1]], eos_always, use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) == 4 and 0 not in c.token_ids[:3] and c.token_ids[-1] == 0
    assert c.finish_reason == "stop"


@pytest.mark.parametrize("prompts, n, first_prompt", [
    ("The quick brown fox", 1, "The quick brown fox"),
    ([5, 6, 7], 1, None),
    (["hello world", [5, 6, 7]], 2, "hello world"),
    ([[5, 6, 7], [8, 9]], 2, None),
])
def test_prompt_forms(model, prompts, n, first_prompt):
    llm = make_llm(model)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(outs) == n and outs[0].prompt == first_prompt
    if n == 2:
        assert outs[1].prompt_token_ids == ([5, 6, 7] if first_prompt else [8, 9])
    assert_all_blocks_free(llm)


def test_greedy_text_prompt_equals_its_token_ids(model):
    llm = make_llm(model)
    text = "import os, sys; print('hello world')"
    by_text, by_ids = llm.generate([text, llm.get_tokenizer().encode(text)], GREEDY, use_tqdm=False)
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == by_ids.outputs[0].text


def test_skip_tokenizer_init_gives_the_same_tokens_and_no_text(model, reference):
    """vLLM's skip_tokenizer_init (the benchmarks run with it): no tokenizer is
    loaded; token-id prompts get the tokens a run with one gets, and no text;
    a text prompt is a clear error."""
    llm = make_llm(model, skip_tokenizer_init=True)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.get_tokenizer() is None
    assert token_ids(outs) == reference[0]
    assert all(o.prompt is None and o.outputs[0].text == "" for o in outs)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):  # they would never match: no text
        llm.generate(PROMPTS[:1], SamplingParams(stop=["a"]), use_tqdm=False)
    assert_all_blocks_free(llm)


# ---------------------------------------------------------------- bad inputs

@pytest.fixture(scope="module")
def small(model):
    return make_llm(model, max_model_len=32, num_kv_blocks=8)


@pytest.mark.parametrize("prompt, match", [
    ([1] * 40, r"^This model's maximum context length is 32 tokens. However, your prompt contains 40 input tokens, "
               r"which exceeds this limit even without any output tokens"),
    ([1] * 32, r"^max_tokens must be at least 1, got 0\. \(The prompt's 32 tokens fill max_model_len"),  # no room left
    ([], r"empty"),
    ("", r"empty"),
    ([1, VOCAB, 2], rf"\[0, {VOCAB}\)"),
    ([1, -1], rf"\[0, {VOCAB}\)"),
])
def test_bad_prompts_raise_value_error(small, prompt, match):
    with pytest.raises(ValueError, match=match):
        small.generate([prompt], use_tqdm=False)
    assert not small.engine.has_unfinished_requests()


def test_longest_allowed_prompt_runs(small):
    out, = small.generate([[1] * 31], SamplingParams(max_tokens=5), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def test_one_bad_prompt_queues_none_of_the_batch(small):
    with pytest.raises(ValueError, match="empty"):
        small.generate([[1, 2, 3], []], use_tqdm=False)
    assert not small.engine.has_unfinished_requests()
    assert len(small.generate([[1, 2, 3]], SamplingParams(max_tokens=1), use_tqdm=False)) == 1


def test_a_request_id_cannot_take_a_childs(small):
    """Any string names a request (as vLLM), "#" too: n's children are id#i, so a request
    "a#0" and a family "a" (n=2) cannot both be in flight, whichever came first."""
    engine = small.engine
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), "a#1")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=1, n=2), "a")
    assert list(engine.scheduler.requests) == ["a#1"]  # no child "a#0" left behind
    engine.abort_request("a#1")
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=1, n=2, seed=2**63 - 1), "a")  # the seeds wrap
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), "a#1")
    assert sorted(engine.scheduler.requests) == ["a#0", "a#1"]
    engine.abort_request("a")
    assert not engine.has_unfinished_requests()


def test_empty_prompt_list_raises(small):
    with pytest.raises(ValueError, match="non-empty"):
        small.generate([], use_tqdm=False)


@pytest.mark.parametrize("kw, match", [
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"max_tokens": -3}, "max_tokens must be >= 1"),
    ({"temperature": -1.0}, "temperature"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"seed": 2**63}, r"seed must be in \[-2\*\*63"),  # vLLM's range: a torch.long
    ({"seed": -2**63 - 1}, "seed"),
])
def test_bad_sampling_params_raise_value_error(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_missing_model_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "no-such-model"), dtype="float32")


def test_unknown_architecture(model, tmp_path):
    bad = tmp_path / "gpt2-ish"
    shutil.copytree(model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        LLM(str(bad), dtype="float32")


@pytest.mark.parametrize("kw, knob", [
    ({"num_kv_blocks": 3}, r"num[-_]kv[-_]blocks to at least 4"),
    ({"kv_cache_memory_bytes": 3 * 8192}, r"kv[-_]cache[-_]memory[-_]bytes to at least 32768"),  # 8 KiB a block
])
def test_kv_cache_too_small_for_max_model_len(model, kw, knob):
    # max_model_len 64 at block_size 16 needs 4 blocks.
    with pytest.raises(ValueError, match="KV cache too small") as e:
        LLM(str(model), dtype="float32", max_model_len=64, **kw)
    assert "max-model-len" in str(e.value) or "max_model_len" in str(e.value)
    assert re.search(knob, str(e.value)), str(e.value)


def test_kv_budget_below_one_block_without_max_model_len(model):
    # No max_model_len: the engine sizes it from the blocks, and zero blocks must
    # be an error that names the knob (it was a ZeroDivisionError).
    with pytest.raises(ValueError, match=r"buys no block.*kv-cache-memory-bytes"):
        LLM(str(model), dtype="float32", kv_cache_memory_bytes=4096)


def test_model_larger_than_memory_is_a_clear_error(model):
    # An explicit KV budget beyond this machine's memory fails before loading, naming the knobs.
    with pytest.raises(ValueError, match=r"not enough memory.*--kv-cache-memory-bytes"):
        LLM(str(model), dtype="float32", kv_cache_memory_bytes=2**50)


# ---------------------------------------------------------------- GPU sizing (faked)
def test_profile_run_counts_the_lora_ops(model, monkeypatch):
    """With LoRA layers, the profiling forward runs every row through every adapter slot (the
    padded path's ops), so that the KV cache leaves room for a step with adapter rows (its
    deltas are as wide as the layers' outputs) and for the graphs' LoRA variants; the mask is
    gone after it."""
    from nanoserve.model import LoRAConfig, LoRALinear, load_model, profile_activation_bytes, wrap_lora_layers
    m, _ = load_model(model, torch.float32, torch.device("cpu"))
    wrap_lora_layers(m, LoRAConfig(max_loras=2, max_lora_rank=4))
    for name in ("synchronize", "reset_peak_memory_stats", "memory_allocated", "max_memory_allocated",
                 "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: 0)
    masks, real = [], LoRALinear._add_masked
    monkeypatch.setattr(LoRALinear, "_add_masked", lambda self, x, y, mask: masks.append(tuple(mask.shape))
                        or real(self, x, y, mask))
    profile_activation_bytes(m, 8, 8, 16, sample=False)
    assert masks and set(masks) == {(8, 2)}
    assert m.model.layers[0].mlp.down_proj.step.mask is None



def test_profile_run_measures_one_full_step(model, monkeypatch):
    """On a GPU the KV cache gets what a profiling forward of a full step leaves
    (vLLM's profile run). The CUDA memory counters are faked here; the forward
    itself runs on the CPU, through the one-block throwaway cache."""
    from nanoserve import model as model_mod
    from nanoserve.model import load_model, profile_activation_bytes
    m, _ = load_model(model, torch.float32, torch.device("cpu"))
    events, rows = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: events.append("reset"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 100)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 350)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty"))
    real = m.compute_logits
    monkeypatch.setattr(m, "compute_logits", lambda h: rows.append(h.shape[0]) or real(h))
    # the profile samples its rows the costliest way: the top-k/top-p sort, penalties, top logprobs
    sorts, logprobs = [], []
    real_sort, real_logprobs = model_mod.apply_top_k_top_p, model_mod.logprob_rows
    monkeypatch.setattr(model_mod, "apply_top_k_top_p", lambda x, k, p: sorts.append((x.shape, k[0], p[0]))
                        or real_sort(x, k, p))
    monkeypatch.setattr(model_mod, "logprob_rows", lambda x, t, k, *listed: logprobs.append((x.shape[0], k))
                        or real_logprobs(x, t, k, *listed))
    assert profile_activation_bytes(m, MAX_LEN + 50, 7, 16) == 250  # longer than any position: wraps
    assert events == ["reset", "empty"] and rows == [7]
    assert sorts == [((7, m.config.vocab_size), 50, 0.9)] and logprobs == [(7, model_mod.MAX_LOGPROBS)]
    # the CUDA graphs' pool holds a forward only: no sampling counted
    assert profile_activation_bytes(m, 8, 8, 16, sample=False) == 250 and len(sorts) == 1
    # --max-logprobs raised: the profile's rows ask for that many (at most the vocabulary)
    profile_activation_bytes(m, 8, 3, 16, logprobs=10**6)
    assert logprobs[-1] == (3, m.config.vocab_size)
    from nanoserve.engine import EngineConfig, cache_config
    assert cache_config(EngineConfig(model="m", max_logprobs=100)).profile_logprobs == 100
    profile_activation_bytes(m, 8, 3, 16, logprobs=cache_config(EngineConfig(model="m", max_logprobs=-1))
                             .profile_logprobs)  # -1, no cap: the whole vocabulary
    assert logprobs[-1] == (3, m.config.vocab_size)
    with pytest.raises(ValueError, match=r"max_logprobs must be >= 0, or -1 .*, got -2"):
        EngineConfig(model="m", max_logprobs=-2)


def test_a_sliding_window_model_serves_past_its_window(model_root):
    """A sliding-window checkpoint serves its whole context (test_parity checks its logits), and
    vLLM's --disable-sliding-window makes the window max_model_len's default and its limit."""
    path = make_model(model_root, "mistral", sliding_window=32)
    kw = dict(dtype="float32", num_kv_blocks=16, enforce_eager=True)
    llm = LLM(str(path), **kw)
    assert llm.engine.max_model_len == 16 * 16  # the KV blocks', past the window
    out = llm.generate([[5] * 60], SamplingParams(max_tokens=8, min_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    assert LLM(str(path), disable_sliding_window=True, **kw).engine.max_model_len == 32
    assert LLM(str(path), max_model_len=24, disable_sliding_window=True, **kw).engine.max_model_len == 24
    with pytest.raises(ValueError, match=r"--disable-sliding-window keeps max_model_len within .* \(32\)"):
        LLM(str(path), max_model_len=64, disable_sliding_window=True, **kw)


def test_priority_scheduling_serves_lower_values_first(tiny_model):
    """vLLM's --scheduling-policy priority: one request at a time, they finish in (priority, arrival)
    order; LLM.generate takes a priority per prompt. Under FCFS a priority other than 0 is refused."""
    llm = LLM(str(tiny_model), dtype="float32", num_kv_blocks=32, max_num_seqs=1, scheduling_policy="priority")
    engine, finished = llm.engine, []
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for rid, priority in (("a", 3), ("b", 0), ("c", -1), ("d", 0)):
        engine.add_request([5, 6, 7], params, rid, priority=priority)
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["c", "b", "d", "a"]
    outs = llm.generate([[5, 6], [7, 8]], params, priority=[1, 0], use_tqdm=False)
    assert [o.request_id for o in outs] == sorted(o.request_id for o in outs)  # in the prompts' order
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate([[5], [6]], params, priority=[1], use_tqdm=False)
    fcfs = LLM(str(tiny_model), dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match=r"priority 2 needs the priority scheduling policy") as e:
        fcfs.generate([[5]], params, priority=[2], use_tqdm=False)
    assert e.value.param == "priority"
    with pytest.raises(ValueError, match="priority must be an integer"):
        fcfs.engine.add_request([5], params, priority=1.5)
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        LLM(str(tiny_model), scheduling_policy="lifo")


def test_repetition_detection_ends_a_repeating_output(tiny_model):
    """vLLM's repetition_detection: the output's last 1..max_pattern_size tokens repeated min_count times
    in a row end it, finish_reason "repetition" and stop_reason "repetition_detected" (not before
    min_tokens); max_tokens comes first if it is reached on the same token."""
    from nanoserve.engine import RepetitionDetectionParams as Rep
    assert Rep(3, 0, 3).found([9, 1, 2, 3, 1, 2, 3, 1, 2, 3]) and Rep(3, 0, 3).found([1, 2, 1, 2, 1, 2])
    assert not Rep(3, 0, 3).found([1, 2, 3, 1, 2, 4, 1, 2, 3]) and not Rep(3, 2, 3).found([7, 7, 7])
    assert not Rep().found([7] * 10)  # all zeros: off
    llm = LLM(str(tiny_model), dtype="float32", num_kv_blocks=32)
    five = dict(temperature=0, logit_bias={5: 100}, max_tokens=20)
    out = llm.generate([[1, 2]], SamplingParams(**five, repetition_detection={"max_pattern_size": 2, "min_count": 4}),
                       use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([5] * 4, "repetition", "repetition_detected")
    later = SamplingParams(**five, min_tokens=7, repetition_detection=Rep(1, 0, 2))
    assert len(llm.generate([[1, 2]], later, use_tqdm=False)[0].outputs[0].token_ids) == 7
    capped = SamplingParams(**{**five, "max_tokens": 4}, repetition_detection=Rep(1, 0, 4))
    assert llm.generate([[1, 2]], capped, use_tqdm=False)[0].outputs[0].finish_reason == "length"
    for bad in ((2, 3, 2), (2, 0, 1), (-1, 0, 0), (2, 0, "3")):
        with pytest.raises(ValueError, match="repetition_detection") as e:
            SamplingParams(repetition_detection=Rep(*bad))
        assert e.value.param == "repetition_detection"

