"""Speculative decoding with n-gram drafts (vLLM's speculative_config): the proposer's matches,
the config's checks, greedy tokens equal to the engine's without drafts (while drafts are
accepted and rejected, cut by stops, preempted), vLLM's dynamic schedule of drafts by batch size,
the rejection sampler's distribution, and vLLM's spec-decode counters (per draft position too) on
/metrics and its periodic log line."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from conftest import VOCAB, make_model
from nanoserve import LLM, SamplingParams
from nanoserve.engine import EngineConfig, RequestOutputKind
from nanoserve.model import SampleRequest, Sampler
from nanoserve.engine import NgramProposer, SpeculativeConfig, build_dynamic_sd_schedule_lookup

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
_rng = torch.Generator().manual_seed(7)
PATTERN = torch.randint(1, VOCAB, (7,), generator=_rng).tolist()
# Prompts that repeat (their continuation is often in them) beside one that does not
PROMPTS = [PATTERN * 5, torch.randint(1, VOCAB, (20,), generator=_rng).tolist(), (PATTERN[:3] + [5, 6]) * 4]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def make_llm(model, **kw) -> LLM:
    return LLM(str(model), **{"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64, **kw})


def token_ids(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def model(model_root):
    return make_model(model_root, "llama")  # its greedy outputs vary more than the default tiny model's


@pytest.fixture(scope="module")
def plain(model):
    return make_llm(model)


@pytest.fixture(scope="module")
def reference(plain):
    return token_ids(plain.generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.fixture(scope="module")
def spec_llm(model):
    return make_llm(model, speculative_config=NGRAM)


def assert_all_blocks_free(llm: LLM) -> None:
    s = llm.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"] and s["num_running"] == s["num_waiting"] == 0


# ---------------------------------------------------------------- the proposer and the config

def test_ngram_proposer_takes_the_longest_match_at_its_earliest_place():
    def propose(tokens, k=4, lo=2, hi=3):
        return NgramProposer(SpeculativeConfig("ngram", k, hi, lo)).propose(tokens, k)
    assert propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]  # vLLM's example: [4, 2, 3] is not found, [2, 3] is
    assert propose([1, 2, 3, 9, 7, 2, 3, 8, 7, 2, 3]) == [8, 7, 2, 3]  # [7, 2, 3] beats the earlier [2, 3]
    assert propose([5, 1, 2, 6, 1, 2, 7, 1, 2], k=1) == [6]  # the earliest of equal matches, k tokens at most
    assert propose([1, 2, 3, 4]) == [] and propose([3, 3]) == [] and propose([1, 2, 1, 2], k=0) == []
    assert propose([5, 5, 5]) == [5]  # a match may overlap the n-gram itself
    # a match starts on a token's edge: 256, 0 are bytes 00 01 00 00 00 00 00 00, 1 is 01 00 00 00
    assert propose([256, 0, 7, 1], lo=1, hi=1) == [] and propose([256, 0, 1, 7, 1], k=1, lo=1, hi=1) == [7]


@pytest.mark.parametrize("config, why", [
    ({"method": "eagle", "model": "some/draft", "num_speculative_tokens": 3}, "draft models are not supported"),
    ({"model": "some/draft", "num_speculative_tokens": 3}, "draft models are not supported"),
    ({"method": "magic", "num_speculative_tokens": 3}, "method must be one of ngram, got 'magic'"),
    ({"num_speculative_tokens": 3}, "method must be one of ngram, got None"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1, got 0"),
    ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1, got None"),
    ({**NGRAM, "prompt_lookup_min": 5}, "prompt_lookup_min (5) must be <= prompt_lookup_max (4)"),
    ({**NGRAM, "prompt_lookup_max": 0, "prompt_lookup_min": 0}, "prompt_lookup_min must be an integer >= 1"),
    ({**NGRAM, "disable_by_batch_size": 4}, "'disable_by_batch_size' not supported"),
    # vLLM's dynamic speculative decoding schedule, refused with vLLM's messages
    ({**NGRAM, "num_speculative_tokens_per_batch_size": []}, "num_speculative_tokens_per_batch_size must not be empty"),
    ({**NGRAM, "num_speculative_tokens_per_batch_size": 3}, "must be a non-empty list of (range_start, range_end"),
    ({**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 4]]}, "entry must be a 3-item sequence"),
    ({**NGRAM, "num_speculative_tokens_per_batch_size": [[0, 4, 1]]}, "Batch-size range (0, 4) must be positive"),
    ({**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 4, 1], [6, 5, 1]]}, "start must be <= end for (6, 5, 1)"),
    ({**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 4, -1]]}, "values must be >= 0"),
    ({**NGRAM, "num_speculative_tokens_per_batch_size": [[5, 9, 0], [1, 5, 3]]}, "must be non-overlapping and sorted"),
    ({**NGRAM, "num_speculative_tokens_per_batch_size": [[2, 9, 1]]}, "The first batch-size range must start at 1"),
    ({**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 2.5, 1]]}, "entries must be integers, got [1, 2.5, 1]"),
    ("ngram", "speculative_config must be a JSON object"),
])
def test_bad_speculative_configs_are_refused_in_one_line(config, why):
    with pytest.raises(ValueError, match="^speculative_config") as e:
        EngineConfig("m", speculative_config=config)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_speculative_config_as_vllm_takes_it(tiny_model, capsys, caplog):
    from nanoserve.entry import engine_config, parse_args
    config = engine_config(parse_args(["--model", "m", "--speculative-config", '{"method": "ngram", '
                                       '"num_speculative_tokens": 2, "prompt_lookup_max": 3}']))
    assert config.speculative_config == SpeculativeConfig("ngram", 2, 3, 3)  # one bound stands for both
    config = engine_config(parse_args(["--model", "m", "--speculative-config", '{"method": "ngram", '
                                       '"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": '
                                       '[[1, 4, 2], [5, 256, 0]]}']))
    assert config.speculative_config.num_speculative_tokens_per_batch_size == ((1, 4, 2), (5, 256, 0))
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, '
                                                            '"num_speculative_tokens_per_batch_size": [[2, 4, 1]]}'])
    assert "The first batch-size range must start at 1" in capsys.readouterr().err
    assert EngineConfig("m", speculative_config={"model": "[ngram]", "num_speculative_tokens": 1}
                        ).speculative_config == SpeculativeConfig("ngram", 1, 5, 5)  # vLLM's older spelling
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--speculative-config", '{"method": "eagle3", "model": "d", '
                                                            '"num_speculative_tokens": 3}'])
    assert "draft models are not supported" in capsys.readouterr().err
    with caplog.at_level(logging.WARNING, logger="nanoserve.engine"):
        assert not EngineConfig("m", async_scheduling=True, speculative_config=NGRAM).async_scheduling
    assert "async_scheduling is turned off" in caplog.text
    with pytest.raises(ValueError, match="speculative_config: draft models are not supported"):
        LLM(str(tiny_model), speculative_config={"method": "draft_model", "model": "x", "num_speculative_tokens": 2})


def test_a_dynamic_schedule_is_looked_up_as_vllms():
    """A batch size's k: its range's, capped at num_speculative_tokens; a gap between ranges and the
    sizes past the last range carry the range before them; ranges may come unsorted."""
    assert build_dynamic_sd_schedule_lookup([(32, 128, 2), (1, 16, 3)], 40, 3) == [0] + [3] * 31 + [2] * 9
    assert build_dynamic_sd_schedule_lookup([(1, 1, 5), (2, 3, 0)], 6, 4) == [0, 4, 0, 0, 0, 0, 0]
    assert build_dynamic_sd_schedule_lookup([(1, 64, 2)], 2, 3) == [0, 2, 2]
    config = EngineConfig("m", speculative_config={**NGRAM, "num_speculative_tokens_per_batch_size": [[3, 9, 0],
                                                                                                       [1, 2, 3]]})
    assert config.speculative_config.num_speculative_tokens_per_batch_size == ((1, 2, 3), (3, 9, 0))


# ---------------------------------------------------------------- same tokens as without drafts

def test_greedy_tokens_equal_the_engine_without_drafts(spec_llm, reference):
    before = dict(spec_llm.stats())
    assert token_ids(spec_llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    s = spec_llm.stats()
    drafts, drafted, accepted = (s[k] - before[k] for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                                             "spec_decode_num_accepted_tokens"))
    assert drafts > 0 and 0 < accepted < drafted  # drafts were accepted, and rejected
    assert s["generation_tokens"] - before["generation_tokens"] == sum(map(len, reference))
    assert_all_blocks_free(spec_llm)


def test_preempted_and_chunked_speculation_gives_the_same_tokens(model, reference):
    # 6 blocks of 16 (96 tokens): not the three contexts at once; a budget of 3 cuts drafts short
    llm = make_llm(model, max_model_len=96, num_kv_blocks=6, speculative_config=NGRAM)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert llm.stats()["num_preemptions"] > 0 and llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_all_blocks_free(llm)
    llm = make_llm(model, max_num_batched_tokens=3, max_num_seqs=2, block_size=8, speculative_config=NGRAM)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert_all_blocks_free(llm)


def test_steps_without_drafts_still_take_the_padded_decode_path(model, reference):
    """Decode sizes given (CUDA graphs' path, run eagerly on the CPU): a step without drafts takes it, one
    with drafts runs eagerly, the tokens are the same."""
    llm = make_llm(model, cudagraph_capture_sizes=[1, 2, 4], speculative_config=NGRAM)
    runner, padded = llm.engine.runner, []
    run_padded = runner._run_decode_padded
    runner._run_decode_padded = lambda seqs: padded.append(len(seqs)) or run_padded(seqs)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert padded and llm.stats()["spec_decode_num_accepted_tokens"] > 0


def known_continuations(reference):
    """A proposer's propose that drafts the greedy continuation itself: every draft is accepted."""
    futures = {tuple(p): r for p, r in zip(PROMPTS, reference)}

    def known(token_ids, k):
        for prompt, ref in futures.items():
            if tuple(token_ids[:len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                return ref[done:done + k]
        return []
    return known


def spec_counts(llm: LLM, before: dict) -> tuple[int, int]:
    s = llm.stats()
    return s["spec_decode_num_drafts"] - before["spec_decode_num_drafts"], \
        s["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]


def test_a_dynamic_schedule_drafts_alone_and_not_beside_others(model, reference):
    """Batch size 1 -> 3 drafts, 2 to 64 -> none: one request alone speculates, three together (admitted
    in one step, finishing in one) never do; greedy tokens are the engine's without speculation."""
    llm = make_llm(model, speculative_config={**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 1, 3],
                                                                                                  [2, 64, 0]]})
    before = llm.stats()
    assert token_ids(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == reference[:1]
    drafts, drafted = spec_counts(llm, before)
    assert drafts > 0 and drafted > drafts  # drafts of more than one token
    before = llm.stats()
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert spec_counts(llm, before) == (0, 0)
    assert_all_blocks_free(llm)


def test_the_scheduler_picks_k_by_the_steps_batch_size(model, reference):
    """As vLLM's scheduler: a step's num_spec_tokens_to_schedule is the schedule's k for the requests that
    step computes, and the drafts proposed once it lands (run by the next step) are at most that many."""
    table = {1: 3, 2: 1}  # 3 and more: 0
    llm = make_llm(model, speculative_config={**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 1, 3],
                                                                                                  [2, 2, 1],
                                                                                                  [3, 8, 0]]})
    engine, steps, finished = llm.engine, [], {}
    schedule = engine.scheduler.schedule
    engine.proposer.propose = known_continuations(reference)  # drafts as long as k allows, every step

    def recorded():
        out = schedule()
        steps.append((len(out.scheduled), out.num_spec_tokens_to_schedule,
                      max((len(s.spec_token_ids) for s in out.scheduled), default=0)))
        return out
    engine.scheduler.schedule = recorded
    try:
        for i, (prompt, num_steps) in enumerate(((PROMPTS[0], 3), (PROMPTS[2], 3), (PROMPTS[1], None))):
            engine.add_request(prompt, GREEDY, request_id=str(i))  # they join one by one
            for _ in range(num_steps or 10**6):
                finished.update({o.request_id: o for o in engine.step() if o.finished})
                if not engine.has_unfinished_requests():
                    break
    finally:
        del engine.scheduler.schedule
    assert [token_ids([finished[str(i)]])[0] for i in range(3)] == [reference[0], reference[2], reference[1]]
    assert all(k == table.get(batch, 0) for batch, k, _ in steps), steps
    assert all(longest <= k for (_, k, _), (_, _, longest) in zip(steps, steps[1:])), steps
    # (batch size, k, longest draft run): alone 3 drafts, at two requests 1, at three none; a step runs the
    # drafts the step before it allowed (the first at two requests, those proposed when one ran alone)
    assert steps[:8] == [(1, 3, 0), (1, 3, 3), (1, 3, 3), (2, 1, 3), (2, 1, 1), (2, 1, 1), (3, 0, 1), (3, 0, 0)]
    assert all(longest == 0 for (batch, _, _), (_, _, longest) in zip(steps, steps[1:]) if batch >= 3), steps
    # the counters with k varying: per position up to the largest k; every draft was accepted (the oracle's)
    s = llm.stats()
    per_pos = s["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 3 and per_pos[0] == s["spec_decode_num_drafts"] > per_pos[1] > per_pos[2] > 0
    assert sum(per_pos) == s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"]


def test_random_rows_take_the_rejection_path(spec_llm, reference):
    """top_k=1 makes each distribution one-hot: the random path (accept with p(t), else draw from p
    less t) must then emit the greedy tokens, for every one of n > 1 samples."""
    params = SamplingParams(n=2, temperature=0.8, top_k=1, max_tokens=40, ignore_eos=True)
    before = spec_llm.stats()["spec_decode_num_accepted_tokens"]
    outs = spec_llm.generate(PROMPTS, params, use_tqdm=False)
    assert token_ids(outs) == [t for t in reference for _ in range(2)]
    assert spec_llm.stats()["spec_decode_num_accepted_tokens"] > before


@pytest.fixture
def oracle(spec_llm, reference):
    """Drafts of the greedy continuation itself: every one is accepted, so stops fall inside runs."""
    engine = spec_llm.engine
    engine.proposer.propose, propose = known_continuations(reference), engine.proposer.propose
    yield
    engine.proposer.propose = propose


def mid_run_stops(ref: list[int], tokenizer) -> tuple[int, str]:
    """With the oracle's drafts, output tokens 1-4, 5-8, ... come a step each: a stop token and a
    stop string that first come in the middle of such a run (past the first)."""
    token = next(ref[i] for i in range(5, len(ref)) if i % 4 and ref[i] not in ref[:i])
    for i in (i for i in range(5, len(ref)) if i % 4):
        before, after = tokenizer.decode(ref[:i]), tokenizer.decode(ref[:i + 1])
        piece = after[len(before):]
        if after.startswith(before) and piece.strip() and piece.isprintable() and piece not in before:
            return token, piece
    raise AssertionError("no stop string in the middle of a run: choose other prompts")


def test_stops_inside_an_accepted_run(spec_llm, plain, reference, oracle):
    prompt = PROMPTS[2]
    stop_token, stop = mid_run_stops(reference[2], plain.get_tokenizer())
    cases = [SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),  # 1 + 4 + 2: one draft left at the end
             SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token]),
             SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
             SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)]
    before = spec_llm.stats()
    for params in cases:
        want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        got = spec_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (want.token_ids, want.text, want.finish_reason, want.stop_reason)
        assert want.finish_reason == ("stop" if params.stop or params.stop_token_ids else "length")
        if params.logprobs:
            assert [list(e) for e in got.logprobs] == [list(e) for e in want.logprobs]
            for g, w in zip(got.logprobs, want.logprobs):
                assert all(g[t].logprob == pytest.approx(w[t].logprob, abs=1e-4) and g[t].rank == w[t].rank
                           for t in w)
            assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)
    s = spec_llm.stats()
    assert s["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"] == \
        s["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"] > 0  # the oracle's: all
    assert_all_blocks_free(spec_llm)


def test_a_stream_gets_several_tokens_a_step(spec_llm, reference, oracle):
    engine = spec_llm.engine
    rid = engine.add_request(PROMPTS[0], GREEDY, output_kind=RequestOutputKind.DELTA)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [o.outputs[0].token_ids for o in engine.step() if o.request_id == rid]
    assert sum(deltas, []) == reference[0] and max(map(len, deltas)) == 1 + NGRAM["num_speculative_tokens"]


def test_accepted_tokens_per_position(spec_llm, reference):
    """vLLM's per-position counter: drafts of the greedy continuation whose token at position 0, 1, 2,
    then none is wrong, in turn; a draft whose first wrong token is at i counts at positions 0 to i - 1."""
    engine, prompt, ref = spec_llm.engine, PROMPTS[2], reference[2]
    accepted = []  # each draft's accepted length, as the reference decides it

    def propose(token_ids, k):
        done = len(token_ids) - len(prompt)
        draft, wrong = ref[done:done + k], len(accepted) % 4
        if wrong < len(draft):
            draft[wrong] = (draft[wrong] + 1) % VOCAB
        if draft:
            accepted.append(min(wrong, len(draft)))
        return draft
    before = spec_llm.stats()
    engine.proposer.propose, original = propose, engine.proposer.propose
    try:
        assert token_ids(spec_llm.generate([prompt], GREEDY, use_tqdm=False)) == [ref]
    finally:
        engine.proposer.propose = original
    s = spec_llm.stats()
    per_pos = [n - m for n, m in zip(s["spec_decode_num_accepted_tokens_per_pos"],
                                     before["spec_decode_num_accepted_tokens_per_pos"])]
    want = [sum(a > i for a in accepted) for i in range(NGRAM["num_speculative_tokens"])]
    assert per_pos == want and want[0] > want[1] > want[2] > 0, (per_pos, want)
    assert s["spec_decode_num_drafts"] - before["spec_decode_num_drafts"] == len(accepted)
    assert sum(per_pos) == s["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert_all_blocks_free(spec_llm)


def test_requests_speculation_cannot_serve_run_without_drafts(spec_llm, plain):
    """Penalties and min_tokens change the distribution from one position to the next: no drafts (as vLLM)."""
    before = spec_llm.stats()["spec_decode_num_drafts"]
    for params in (SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=20, presence_penalty=0.5, ignore_eos=True)):
        assert token_ids(spec_llm.generate(PROMPTS, params, use_tqdm=False)) == \
            token_ids(plain.generate(PROMPTS, params, use_tqdm=False))
    assert spec_llm.stats()["spec_decode_num_drafts"] == before
    # min_tokens: drafts only once it is reached
    params = SamplingParams(temperature=0, max_tokens=30, min_tokens=20)
    assert token_ids(spec_llm.generate(PROMPTS, params, use_tqdm=False)) == \
        token_ids(plain.generate(PROMPTS, params, use_tqdm=False))


def test_requests_without_drafts_keep_their_penalties_grammars_and_bans_beside_drafting_ones(spec_llm, plain):
    """A step where some rows verify drafts samples the others with the whole sampler: a penalty, a
    grammar, min_tokens and bad words still act on them (the fuzz test's seeds 126 and 145 found
    them sampled without their penalty)."""
    from nanoserve import StructuredOutputsParams
    others = [SamplingParams(temperature=0, max_tokens=20, presence_penalty=0.5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12,
                             structured_outputs=StructuredOutputsParams(regex="[a-e]{4,9}")),
              SamplingParams(temperature=0, max_tokens=20, min_tokens=15),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, bad_words=["a", "b", "c"])]
    prompts, params = PROMPTS + [PROMPTS[0]] * len(others), [GREEDY] * len(PROMPTS) + others
    before = spec_llm.stats()["spec_decode_num_accepted_tokens"]
    assert token_ids(spec_llm.generate(prompts, params, use_tqdm=False)) == \
        token_ids(plain.generate(prompts, params, use_tqdm=False))
    assert spec_llm.stats()["spec_decode_num_accepted_tokens"] > before  # the greedy rows did draft beside them


# ---------------------------------------------------------------- the rejection sampler

def test_rejection_sampling_keeps_the_target_distribution():
    """Each emitted token has p's distribution, whatever the draft: a draft t is accepted with p(t),
    else the token comes from p less t. (Drawing from all of p there would give t p(t) (2 - p(t)).)"""
    n, logits = 20000, torch.tensor([1.0, 2.0, 0.5, 1.5])
    p = logits.softmax(-1)
    row = SampleRequest(SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, logit_bias=None,
                                        allowed_token_ids=None, logprobs=None, logprob_token_ids=None), [1], [])
    for draft in (1, 2):
        out = Sampler(seed=draft).sample_speculative(logits.repeat(2 * n, 1), [row] * n, [[draft]] * n)
        first = torch.tensor([r.token_id for r in out.results()])
        freq = torch.bincount(first, minlength=4) / n
        assert torch.allclose(freq, p, atol=0.015), (freq, p)  # 0.015: over 4 standard deviations
        accepted = sum(len(r.following) for r in out.results()) / n
        assert accepted == pytest.approx(p[draft].item(), abs=0.015)


# ---------------------------------------------------------------- metrics

def test_metrics_carry_vllms_spec_decode_counters():
    from prometheus_client import generate_latest

    from nanoserve.entry import ServerMetrics
    stats = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "prefix_cache_queries": 0,
             "prefix_cache_hits": 0, "num_preemptions": 0, "prompt_tokens": 5, "generation_tokens": 9}
    spec = {"spec_decode_num_drafts": 3, "spec_decode_num_draft_tokens": 9, "spec_decode_num_accepted_tokens": 4}
    text = generate_latest(ServerMetrics(SimpleNamespace(engine=SimpleNamespace(stats=lambda: stats)), "m").exposed)
    assert b"spec_decode" not in text  # off: no series
    engine = SimpleNamespace(stats=lambda: {**stats, **spec})
    text = generate_latest(ServerMetrics(SimpleNamespace(engine=engine), "m").exposed).decode()
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 4.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 9.0' in text
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'spec_decode_num_accepted_tokens_per_pos' not in text  # vLLM's per-position series: with them only
    engine.stats = lambda: {**stats, **spec, "spec_decode_num_accepted_tokens_per_pos": [3, 1, 0]}
    text = generate_latest(ServerMetrics(SimpleNamespace(engine=engine), "m").exposed).decode()
    for pos, n in enumerate((3, 1, 0)):
        assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{pos}"}} {n}.0' in text


def test_the_periodic_spec_decode_line_is_vllms():
    from nanoserve.entry import spec_decode_line
    last = {"spec_decode_num_drafts": 1, "spec_decode_num_draft_tokens": 3, "spec_decode_num_accepted_tokens": 1,
            "spec_decode_num_accepted_tokens_per_pos": [1, 0, 0]}
    now = {"spec_decode_num_drafts": 5, "spec_decode_num_draft_tokens": 15, "spec_decode_num_accepted_tokens": 9,
           "spec_decode_num_accepted_tokens_per_pos": [4, 3, 2]}
    assert spec_decode_line(last, now, 2.0) == (
        "SpecDecoding metrics: Mean acceptance length: 3.00, Accepted throughput: 4.00 tokens/s, Drafted throughput: "
        "6.00 tokens/s, Accepted: 8 tokens, Drafted: 12 tokens, Per-position acceptance rate: 0.750, 0.750, 0.500, "
        "Avg Draft acceptance rate: 66.7%")
    assert spec_decode_line(now, now, 2.0) is None  # no drafts in the interval: no line
    assert spec_decode_line({}, {"prompt_tokens": 1}, 2.0) is None  # speculation off


def test_the_server_warns_once_that_async_scheduling_is_off(monkeypatch, caplog, capsys, tmp_path):
    """parse_args checks the engine config and serve() builds it again: the warning comes from the second only."""
    from nanoserve import entry
    monkeypatch.setattr(entry, "configure_logging", lambda *levels: None)  # leave pytest's handlers alone
    no_socket = str(tmp_path / "missing" / "s.sock")  # the server stops at its socket, before loading a model
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        assert entry.main(["--model", "m", "--uds", no_socket, "--async-scheduling",
                           "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']) == 1
    assert caplog.text.count("async_scheduling is turned off") == 1, caplog.text
    assert "cannot listen on" in capsys.readouterr().err
