"""Sampling tests: every stage of nanoserve.model.Sampler against an independent
implementation, seeded sampling under batching, preemption and chunking, a
frequency test of temperature sampling, and the validation of every
SamplingParams field.

References: transformers' logits processors where they define the same thing
(repetition penalty, top-k, top-p, min-p, min new tokens, sequence bias),
OpenAI's published formula for the presence and frequency penalties
(logit - count * frequency_penalty - (count > 0) * presence_penalty), and
softmax(logits / T) for the distribution.

nanoserve's order is vLLM's: logit bias and min_tokens -> penalties ->
temperature -> min_p -> top-k/top-p -> sample. The repetition penalty sees
prompt + output tokens, the frequency and presence penalties output tokens only.

"Which tokens can still be sampled" is read off the real Sampler with a probe:
`_draw` (the inverse-CDF draw from the final probabilities) is replaced by one
that returns token j iff its final probability is > 0.
"""
from __future__ import annotations

import logging
import math
import re

import pytest
import torch

from conftest import VOCAB, hf_model
from nanoserve import LLM, SamplingParams, StructuredOutputsParams, cpu_backend, kernels
from nanoserve.engine import Request
from nanoserve.model import NO_TOKEN, TOP_K_WITHOUT_SORT, SampleRequest, Sampler, apply_top_k_top_p

try:
    from scipy.stats import chi2 as _scipy_chi2
except ImportError:  # not a dependency: fall back to a table
    _scipy_chi2 = None

# Upper 0.1% critical values of the chi-square distribution, by degrees of freedom.
CHI2_CRIT_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458,
                 7: 24.322, 8: 26.124, 9: 27.877, 10: 29.588}


def chi2_critical(dof: int) -> float:
    if _scipy_chi2 is not None:
        return float(_scipy_chi2.ppf(0.999, dof))
    return CHI2_CRIT_999[dof]


def rand_logits(rows: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def rand_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def row(params: SamplingParams, prompt=(), output=(), banned=()) -> SampleRequest:
    return SampleRequest(params, list(prompt), list(output), list(banned))


class _ProbeSampler(Sampler):
    """Row i of the batch draws token ``probe[i]`` iff its final probability is
    positive (else -1, no token)."""

    def __init__(self, probe: list[int]):
        super().__init__(0)
        self.probe = probe

    def _draw(self, probs, u):
        t = torch.tensor(self.probe)
        return torch.where(probs[torch.arange(probs.shape[0]), t] > 0, t, -1)


def possible_tokens(logits_row: torch.Tensor, params: SamplingParams, prompt=(), output=()) -> set[int]:
    """The tokens the real Sampler can return for this row with these params."""
    V = logits_row.shape[-1]
    sampler = _ProbeSampler(list(range(V)))
    rows = [row(params, prompt, output) for _ in range(V)]
    tokens = [r.token_id for r in sampler(logits_row.expand(V, V).clone(), rows)]
    return {j for j in range(V) if tokens[j] == j}


def finite_set(t: torch.Tensor) -> set[int]:
    return set(torch.isfinite(t).nonzero().flatten().tolist())


# =========================================================================== penalties

@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.5])
def test_repetition_penalty_matches_transformers(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor
    R, V = 6, 48
    logits = rand_logits(R, V, seed=1)
    rows, want = [], []
    for i in range(R):
        prompt, output = rand_ids(7, V, 10 + i), rand_ids(5 + i, V, 20 + i)
        rows.append(row(SamplingParams(repetition_penalty=penalty), prompt, output))
        ids = torch.tensor([prompt + output])
        want.append(RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[i:i + 1].clone())[0])
    got = Sampler()._apply_penalties(logits.clone(), rows)
    torch.testing.assert_close(got, torch.stack(want), rtol=0, atol=1e-6)
    if penalty != 1.0:  # the test can fail: the prompt's tokens were penalized too
        assert not torch.equal(got, logits)


def _openai_penalties(logits_row, output, frequency, presence):
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits_row.shape[-1])
    counts = counts.to(logits_row.dtype)
    return logits_row - counts * frequency - (counts > 0).to(logits_row.dtype) * presence


@pytest.mark.parametrize("frequency,presence", [(0.5, 0.0), (0.0, 1.5), (1.2, -0.7), (-2.0, 2.0)])
def test_frequency_presence_penalties_follow_openai_formula(frequency, presence):
    R, V = 5, 40
    logits = rand_logits(R, V, seed=2)
    rows, want = [], []
    for i in range(R):
        prompt = rand_ids(9, V, 30 + i)           # must not count: output tokens only
        output = rand_ids(3 * i + 2, V, 40 + i)    # with repeats
        rows.append(row(SamplingParams(frequency_penalty=frequency, presence_penalty=presence),
                        prompt, output))
        want.append(_openai_penalties(logits[i], output, frequency, presence))
    got = Sampler()._apply_penalties(logits.clone(), rows)
    torch.testing.assert_close(got, torch.stack(want), rtol=0, atol=1e-6)


def test_penalties_compose_per_row_in_vllm_order():
    """Mixed rows in one batch: repetition (prompt + output) first, then
    frequency/presence (output only); a row without penalties is untouched."""
    from transformers import RepetitionPenaltyLogitsProcessor
    V = 32
    logits = rand_logits(4, V, seed=3)
    settings = [dict(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2),
                dict(),
                dict(repetition_penalty=0.8, frequency_penalty=-0.5),
                dict(presence_penalty=1.0)]
    rows, want = [], []
    for i, kw in enumerate(settings):
        p = SamplingParams(**kw)
        prompt, output = rand_ids(6, V, 50 + i), rand_ids(8, V, 60 + i)
        rows.append(row(p, prompt, output))
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(
            torch.tensor([prompt + output]), logits[i:i + 1].clone())[0]
        want.append(_openai_penalties(x, output, p.frequency_penalty, p.presence_penalty))
    got = Sampler()._apply_penalties(logits.clone(), rows)
    torch.testing.assert_close(got, torch.stack(want), rtol=0, atol=1e-6)
    torch.testing.assert_close(got[1], logits[1], rtol=0, atol=0)


# =========================================================================== logit bias, min_tokens

def test_logit_bias_matches_transformers_sequence_bias():
    from transformers import SequenceBiasLogitsProcessor
    R, V = 3, 40
    logits = rand_logits(R, V, seed=4)
    biases = [{3: 5.0, 17: -2.5, 39: 100.0}, {}, {2: -100.0, 1: 0.25}]  # transformers 5.17 refuses id 0
    rows = [row(SamplingParams(logit_bias=b or None)) for b in biases]
    got = Sampler()._apply_bias_and_bans(logits.clone(), rows)
    for i, b in enumerate(biases):
        want = logits[i:i + 1].clone()
        if b:
            proc = SequenceBiasLogitsProcessor(sequence_bias=[[[t], v] for t, v in b.items()])
            want = proc(torch.tensor([[5, 6]]), want)
        torch.testing.assert_close(got[i], want[0], rtol=0, atol=1e-5)


def test_logit_bias_decides_greedy_and_sampled_tokens():
    V = 40
    logits = rand_logits(2, V, seed=5)
    target = int(logits[0].argmin())
    greedy = SamplingParams(temperature=0, logit_bias={target: 1000.0})
    sampled = SamplingParams(temperature=1.0, seed=3, logit_bias={target: 1000.0})
    out = Sampler()(logits.clone(), [row(greedy), row(sampled)])
    assert [r.token_id for r in out] == [target, target]
    banned = int(logits[0].argmax())  # a bias of -inf bans the argmax
    out = Sampler()(logits[:1].clone(), [row(SamplingParams(temperature=0, logit_bias={banned: -math.inf}))])
    assert out[0].token_id != banned


def test_a_row_left_without_a_token_is_flagged_not_given_id_0():
    """Rows whose bans cover their allowed_token_ids, whose bitmask allows only a banned token, or
    whose bias is -inf everywhere come back NO_TOKEN, greedy or sampled, with logprobs or not; their
    ids on the device (the next step's input under async scheduling) stay real ids. The rows beside
    them sample what they sample without them."""
    V = 40
    logits = rand_logits(6, V, seed=11)
    only_5 = torch.tensor([1 << 5, 0], dtype=torch.int32)  # a grammar's bitmask: token 5 alone
    stuck = [row(SamplingParams(temperature=0, allowed_token_ids=[3, 4]), banned=[3, 4]),
             SampleRequest(SamplingParams(temperature=1.0, seed=2, logprobs=2), [], [], [5], only_5),
             row(SamplingParams(temperature=0.7, logit_bias={t: -math.inf for t in range(V)}))]
    fine = [row(SamplingParams(temperature=0, logprobs=1)), row(SamplingParams(temperature=1.0, seed=9), banned=[7]),
            row(SamplingParams(temperature=0, allowed_token_ids=[3, 4]))]
    for with_logprobs in (True, False):
        if not with_logprobs:
            fine[0], stuck[1] = row(SamplingParams(temperature=0)), SampleRequest(
                SamplingParams(temperature=1.0, seed=2), [], [], [5], only_5)
        out = Sampler().sample(logits.clone(), [fine[0], stuck[0], fine[1], stuck[1], fine[2], stuck[2]])
        got = out.results()
        assert [got[i].token_id for i in (1, 3, 5)] == [NO_TOKEN] * 3
        assert bool(((out.token_ids >= 0) & (out.token_ids < V)).all())
        alone = Sampler()(logits[[0, 2, 4]].clone(), fine)
        assert [r.token_id for r in alone] == [got[i].token_id for i in (0, 2, 4)]
        assert (alone[0].logprob is None) == (not with_logprobs)
        if with_logprobs:
            assert got[0].logprob == pytest.approx(alone[0].logprob) and len(got[0].top_logprobs) == 1


@pytest.mark.parametrize("backend", ["torch", "c"])
def test_bf16_logits_sample_as_their_fp32_copies(backend):
    """The runner hands the sampler the model's bf16 logits. Plain greedy rows
    take the backend's argmax of them (the C kernel where it builds); every other
    step works on an fp32 copy. Either way the tokens and logprobs are those
    of the fp32 copy."""
    argmax = kernels.argmax_torch
    if backend == "c":
        from nanoserve import cpu_kernels
        try:
            cpu_kernels.row_ops_library()
        except RuntimeError as e:
            pytest.skip(str(e))
        argmax = cpu_kernels.argmax
    V = 300
    logits = rand_logits(4, V, seed=9).bfloat16()
    logits[1, 7] = logits[1, 250] = 50.0  # a tie: the first index
    sampler = Sampler(argmax=argmax)
    cases = [[SamplingParams(temperature=0)] * 4,
             [SamplingParams(temperature=0, logprobs=2)] * 4,
             [SamplingParams(temperature=0, presence_penalty=1.0)] * 4,
             [SamplingParams(temperature=0, logit_bias={3: 5.0})] * 4]
    for params in cases:
        rows = [row(p, output=[7, 7, 250]) for p in params]
        got = sampler(logits, rows)
        want = Sampler()(logits.float(), rows)
        assert [(r.token_id, r.logprob, r.top_logprobs) for r in got] == \
            [(r.token_id, r.logprob, r.top_logprobs) for r in want]
    assert Sampler()(logits, [row(SamplingParams(temperature=0))] * 4)[1].token_id == 7


def _request(params, prompt, output, eos=frozenset({0, 5})) -> Request:
    req = Request("r", None, list(prompt), params, 100, eos, None)
    req.output_token_ids = list(output)
    req.token_ids = list(prompt) + list(output)
    return req


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_bans_eos_and_stop_ids_like_transformers(ignore_eos):
    """MinNewTokensLengthLogitsProcessor with the "stop" ids: EOS (unless
    ignore_eos, as vLLM) and stop_token_ids are impossible until min_tokens."""
    from transformers import MinNewTokensLengthLogitsProcessor
    V, min_tokens = 24, 3
    params = SamplingParams(min_tokens=min_tokens, stop_token_ids=[7], ignore_eos=ignore_eos,
                            logit_bias={0: 50.0, 7: 50.0})  # also: a bias does not lift the ban
    stop_ids = [7] if ignore_eos else [0, 5, 7]
    prompt = rand_ids(6, V, 70)
    logits = rand_logits(1, V, seed=6)
    for n_out in range(min_tokens + 2):
        output = rand_ids(n_out, 4, 80 + n_out)  # tokens 0..3 only: never 5 or 7 again
        sample = _request(params, prompt, output).sample_request()
        got = Sampler()._apply_bias_and_bans(logits.clone(), [sample])[0]
        biased = logits.clone()
        biased[0, 0] += 50.0
        biased[0, 7] += 50.0
        proc = MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, stop_ids)
        want = proc(torch.tensor([prompt + output]), biased)[0]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert (finite_set(got) >= {0, 5, 7}) == (n_out >= min_tokens)


# =========================================================================== top-k, top-p, min-p

TOPKP = [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.5), (10, 0.8), (100, 0.9), (3, 0.05), (7, 0.999)]
# Backend.top_k_top_p: the reference (it sorts each top-p row) and the CPU backend's (candidates)
TOP_K_TOP_P = {"reference": apply_top_k_top_p, "cpu": cpu_backend.top_k_top_p_by_candidates}


def _hf_top_k_top_p(x: torch.Tensor, k: int, p: float) -> torch.Tensor:
    from transformers import TopKLogitsWarper, TopPLogitsWarper
    x = x[None].clone()
    if k > 0:
        x = TopKLogitsWarper(k)(None, x)
    if p < 1.0:
        x = TopPLogitsWarper(p)(None, x)
    return x[0]


@pytest.mark.parametrize("impl", TOP_K_TOP_P)
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("top_k", [[0, 1, 5, 49, 50, 500, -1, 3], [3, 1500, 0, 7]], ids=["topk", "sorted"])
def test_top_k_alone_matches_transformers(ties, top_k, impl):
    """Top-k without top-p takes each row's k-th largest from topk, not a sort of the vocabulary
    (up to model.TOP_K_WITHOUT_SORT; the second set is past it): the same tokens kept."""
    top_k_top_p = TOP_K_TOP_P[impl]
    V = 2000
    logits = rand_logits(len(top_k), V, seed=3)
    if ties:
        logits = logits.round()
    logits[1, :100] = float("-inf")  # a row with top-k and tokens banned already
    assert (max(top_k) <= TOP_K_WITHOUT_SORT) == (top_k[1] == 1)
    got = top_k_top_p(logits.clone(), top_k, [1.0] * len(top_k))
    for i, k in enumerate(top_k):
        want = _hf_top_k_top_p(logits[i], k if 0 < k < V else 0, 1.0)
        assert finite_set(got[i]) == finite_set(want), k
        keep = torch.isfinite(want)
        torch.testing.assert_close(got[i][keep], want[keep], rtol=0, atol=0)


def _with_ties(x: torch.Tensor, kept: set[int]) -> set[int]:
    """``kept`` and every token tied with the least logit in it: transformers' top-p keeps
    whichever of equal logits its sort put first; nanoserve keeps them all."""
    least = min(x[i] for i in kept)
    return set((x >= least).nonzero().flatten().tolist())


@pytest.mark.parametrize("impl", TOP_K_TOP_P)
@pytest.mark.parametrize("ties", [False, True])
def test_top_k_top_p_match_transformers(ties, impl):
    top_k_top_p = TOP_K_TOP_P[impl]
    V = 50
    logits = rand_logits(len(TOPKP), V, seed=7)
    if ties:  # many equal logits: the k-th value's ties are all kept, as transformers
        logits = logits.round()
    got = top_k_top_p(logits.clone(), [k for k, _ in TOPKP], [p for _, p in TOPKP])
    for i, (k, p) in enumerate(TOPKP):
        want = _hf_top_k_top_p(logits[i], k, p)
        assert finite_set(got[i]) == _with_ties(logits[i], finite_set(want)), (k, p)
        keep = torch.isfinite(got[i])
        torch.testing.assert_close(got[i][keep], logits[i][keep], rtol=0, atol=0)
    if ties:  # ties changed some rows' sets, or the test would not show they are kept
        assert any(finite_set(got[i]) != finite_set(_hf_top_k_top_p(logits[i], k, p))
                   for i, (k, p) in enumerate(TOPKP))
    assert len(finite_set(got[1])) == (int((logits[1] == logits[1].max()).sum()))


def _peaked(rows: int, V: int, seed: int) -> torch.Tensor:
    """Logits as a language model's look: a few dozen likely tokens over a long flat tail."""
    x = rand_logits(rows, V, seed)
    x[:, :40] += 12 + torch.arange(40, 0, -1) / 4
    return x[:, torch.randperm(V, generator=torch.Generator().manual_seed(seed))]


def test_top_p_candidates_decide_or_the_row_is_sorted(monkeypatch):
    """The CPU's top_k_top_p: past TOP_K_WITHOUT_SORT tokens, a row's nucleus comes from its largest
    logits (topk) when it ends among them, else from a sort of the row: either way the set
    transformers keeps. Checked with the sort spied on, so that both paths are known to run."""
    V = 3 * TOP_K_WITHOUT_SORT
    flat = rand_logits(4, V, seed=11, scale=0.5)  # the nucleus runs past the candidates
    logits = torch.cat([_peaked(4, V, seed=12), flat])
    top_k = [0, 20, 0, 2000, 0, 0, 30, 0]
    top_p = [0.9, 0.7, 0.999, 0.95, 0.9, 0.3, 0.9, 1.0]
    sorted_rows = []
    real_sort = torch.Tensor.sort

    def spy(x, *a, **kw):
        sorted_rows.extend(int((logits == row).all(dim=-1).nonzero()) for row in x)
        return real_sort(x, *a, **kw)
    monkeypatch.setattr(torch.Tensor, "sort", spy)
    got = cpu_backend.top_k_top_p_by_candidates(logits.clone(), top_k, top_p)
    # row 3's k is past TOP_K_WITHOUT_SORT; row 4's nucleus (top-p alone over a flat row) runs past
    # the candidates, row 5's small one does not; rows 1 and 6 have their top-k; row 7 neither
    assert sorted_rows == [3, 4]
    for i, (k, p) in enumerate(zip(top_k, top_p)):
        want = finite_set(_hf_top_k_top_p(logits[i], k, p))
        assert finite_set(got[i]) == want, i
    assert 1 < len(finite_set(got[0])) < 40 and len(finite_set(got[4])) > TOP_K_WITHOUT_SORT
    assert 100 < len(finite_set(got[5])) < TOP_K_WITHOUT_SORT and finite_set(got[7]) == set(range(V))


@pytest.mark.parametrize("impl", TOP_K_TOP_P)
def test_top_k_ties_past_the_candidates_are_sorted(impl):
    """A top-p row whose k-th logit has ties past the candidates: its top-k probabilities
    need them all, so the row is sorted. Here the candidates alone would give the largest
    token 0.00265 of the mass and keep it alone; the whole row gives it 0.00241 < top_p."""
    top_k_top_p = TOP_K_TOP_P[impl]
    V = 2 * TOP_K_WITHOUT_SORT
    logits = rand_logits(1, V, seed=5, scale=0.5)  # all below 3
    logits[0, :TOP_K_WITHOUT_SORT + 100] = 3.0  # 1124 tokens tied at the 10th largest logit
    logits[0, 0] = 4.0
    got = top_k_top_p(logits.clone(), [10], [0.0025])
    want = _with_ties(logits[0], finite_set(_hf_top_k_top_p(logits[0], 10, 0.0025)))
    assert finite_set(got[0]) == want == set(range(TOP_K_WITHOUT_SORT + 100))


@pytest.mark.parametrize("impl", TOP_K_TOP_P)
def test_top_k_top_p_rows_are_batch_invariant(impl):
    """A row's mask is the same alone and beside rows that take other paths (a k past
    TOP_K_WITHOUT_SORT, top-k alone, a sorted top-p row): seeded requests depend on it."""
    top_k_top_p = TOP_K_TOP_P[impl]
    V = 3 * TOP_K_WITHOUT_SORT
    logits = torch.cat([_peaked(3, V, seed=21), rand_logits(2, V, seed=22, scale=0.5)])
    top_k = [0, 40, TOP_K_WITHOUT_SORT + 5, 5, 0]
    top_p = [0.8, 0.95, 0.9, 1.0, 0.6]
    together = top_k_top_p(logits.clone(), top_k, top_p)
    for i in range(len(top_k)):
        alone = top_k_top_p(logits[i:i + 1].clone(), top_k[i:i + 1], top_p[i:i + 1])
        assert torch.equal(alone[0], together[i]), i


@pytest.mark.parametrize("seed", [0, 1])
def test_the_cpu_top_k_top_p_masks_as_the_reference(seed, monkeypatch):
    """The CPU backend's top_k_top_p against the reference, bit for bit: logits with and without
    ties (peaked and flat rows), top-k alone, top-p alone, both, a k past the candidates, nuclei
    inside and past them, in one batch, in batches of one setting and each row alone. The sort is
    spied on: the CPU's must decide some top-p rows from its candidates and sort others."""
    K = TOP_K_WITHOUT_SORT
    V = 4 * K
    logits = torch.cat([_peaked(7, V, seed=30 + seed), rand_logits(7, V, seed=40 + seed, scale=0.5)])
    logits[1::2] = (logits[1::2] * 4).round() / 4  # every other row full of ties
    settings = [(0, 0.9), (0, 0.3), (50, 1.0), (50, 0.9), (K + 100, 1.0), (K + 100, 0.95), (0, 1.0)]
    top_k, top_p = [k for k, _ in settings] * 2, [p for _, p in settings] * 2
    sorted_rows = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda x, *a, **kw: sorted_rows.append(len(x)) or real_sort(x, *a, **kw))

    def both(x, ks, ps):
        want = apply_top_k_top_p(x.clone(), ks, ps)
        sorted_rows.clear()
        got = cpu_backend.top_k_top_p_by_candidates(x.clone(), ks, ps)
        assert torch.equal(got, want), (ks, ps)
        return got
    together = both(logits, top_k, top_p)
    nucleus = [len(finite_set(together[i])) for i in range(len(top_k))]
    assert 0 < sum(sorted_rows) < sum(p < 1.0 for p in top_p)  # both ways ran
    assert max(nucleus[i] for i in (7, 8)) > K and max(nucleus[i] for i in (0, 1)) < K  # top-p alone: past K, inside
    for chosen in ([1.0] * len(top_p), top_p):  # top-k alone; top-p with top-k where set
        both(logits, top_k, chosen)
    both(logits, [0] * len(top_k), top_p)  # top-p alone
    for i in range(len(top_k)):
        assert torch.equal(both(logits[i:i + 1], top_k[i:i + 1], top_p[i:i + 1])[0], together[i]), i


def _hf_pipeline(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' warpers composed in nanoserve's (vLLM's) order."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper
    x = TemperatureLogitsWarper(p.temperature)(None, x[None].clone())
    if p.min_p > 0:
        x = MinPLogitsWarper(p.min_p)(None, x)
    return _hf_top_k_top_p(x[0], p.top_k, p.top_p)


PIPELINES = [dict(temperature=1.0), dict(temperature=0.7, min_p=0.1), dict(temperature=2.0, min_p=0.3),
             dict(temperature=1.0, min_p=1.0), dict(temperature=0.5, top_k=4),
             dict(temperature=1.3, top_p=0.6), dict(temperature=0.9, min_p=0.05, top_k=12, top_p=0.7)]


@pytest.mark.parametrize("kw", PIPELINES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_possible_tokens_after_masking_match_transformers(kw):
    V = 40
    p = SamplingParams(**kw)
    logits = rand_logits(3, V, seed=8)
    for i in range(3):
        want = finite_set(_hf_pipeline(logits[i], p))
        assert possible_tokens(logits[i], p) == want
    if kw.get("min_p") == 1.0:
        assert want == {int(logits[2].argmax())}


def test_probe_sees_every_token_without_truncation():
    """The probe itself: with no truncation every token must be possible."""
    V = 30
    logits = rand_logits(1, V, seed=9)[0]
    assert possible_tokens(logits, SamplingParams(temperature=1.0)) == set(range(V))
    assert possible_tokens(logits, SamplingParams(temperature=0.8, top_k=3)) == \
        set(logits.topk(3).indices.tolist())


# =========================================================================== distribution

def _sample_counts(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int) -> torch.Tensor:
    rows = [row(params) for _ in range(n)]
    out = Sampler(seed)(logits_row.expand(n, -1).clone(), rows)
    return torch.bincount(torch.tensor([r.token_id for r in out]), minlength=logits_row.shape[-1])


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    support = probs > 0
    assert int(counts[~support].sum()) == 0, "sampled a token of probability 0"
    expected = probs[support].double() * counts.sum()
    observed = counts[support].double()
    return float(((observed - expected) ** 2 / expected).sum()), int(support.sum()) - 1


LOGITS8 = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0, 1.5, 0.7])


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_temperature_sampling_frequencies_chi_square(temperature):
    n = 20000
    counts = _sample_counts(LOGITS8, SamplingParams(temperature=temperature), n, seed=1234)
    stat, dof = _chi2(counts, torch.softmax(LOGITS8 / temperature, -1))
    assert stat < chi2_critical(dof), (stat, counts.tolist())
    # The test can fail: the same counts reject a wrong temperature.
    for wrong in (temperature * 0.75, temperature * 1.33):
        bad, _ = _chi2(counts, torch.softmax(LOGITS8 / wrong, -1))
        assert bad > chi2_critical(dof), (wrong, bad)


def test_truncated_sampling_frequencies_chi_square():
    """The whole pipeline: temperature, min_p, top-k and top-p renormalize to the
    distribution transformers' warpers give."""
    p = SamplingParams(temperature=0.8, min_p=0.02, top_k=6, top_p=0.9)
    counts = _sample_counts(LOGITS8, p, 20000, seed=99)
    probs = torch.softmax(_hf_pipeline(LOGITS8, p), -1)
    assert int((probs > 0).sum()) < 6  # something was truncated
    stat, dof = _chi2(counts, probs)
    assert stat < chi2_critical(dof), (stat, counts.tolist())
    untruncated = torch.softmax(LOGITS8 / p.temperature, -1)  # would be rejected
    assert int(counts[probs == 0].sum()) == 0 and bool((untruncated[probs == 0] > 0.01).any())


def test_draw_never_returns_a_token_of_probability_zero():
    """The inverse-CDF draw at its edges: u = 1 (the whole mass) lands on the last token with
    probability > 0, the smallest u on the first; zeros between and around are never drawn."""
    probs = torch.tensor([[0.0, 0.0, 0.25, 0.0, 0.5, 0.25, 0.0, 0.0]] * 4)
    u = torch.tensor([1.0, 2.0 ** -53, 0.5, 0.75], dtype=torch.float64)
    assert Sampler._draw(probs, u).tolist() == [5, 2, 4, 4]
    nan_row = torch.full((1, 8), float("nan"))  # nothing left to sample: an index, flagged by the caller
    assert 0 <= int(Sampler._draw(nan_row, u[:1])) < 8


def test_seeded_row_ignores_its_batch():
    """A seeded row samples the same token alone or amid other rows, and a
    different seed changes the draw for some position."""
    V = 50
    logits = rand_logits(1, V, seed=10, scale=0.5)[0]
    seeded = SamplingParams(temperature=1.0, seed=77)
    alone = [Sampler(0)(logits[None].clone(), [row(seeded, output=[1] * k)])[0].token_id for k in range(8)]
    crowd = []
    for k in range(8):
        rows = [row(SamplingParams(temperature=0.5)), row(SamplingParams(temperature=0)),
                row(seeded, output=[1] * k), row(SamplingParams(temperature=1.0, seed=5))]
        crowd.append(Sampler(k + 100)(logits.expand(4, V).clone(), rows)[2].token_id)
    assert alone == crowd
    other = [Sampler(0)(logits[None].clone(), [row(SamplingParams(temperature=1.0, seed=78),
                                                    output=[1] * k)])[0].token_id for k in range(8)]
    assert other != alone


# =========================================================================== end to end

PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model), dtype="float32", num_kv_blocks=96, seed=0)


@pytest.fixture(scope="module")
def hf(tiny_model):
    return hf_model(tiny_model)


def tokens(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _ref_greedy(hf, prompt_ids, p: SamplingParams, eos: set[int]) -> list[int]:
    """Greedy decoding with transformers' forward and logits processors (plus
    OpenAI's formula for frequency/presence): the independent oracle."""
    from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor
    ids, out = list(prompt_ids), []
    stop_ids = ([] if p.ignore_eos else sorted(eos)) + list(p.stop_token_ids)
    for _ in range(p.max_tokens):
        with torch.no_grad():
            x = hf(torch.tensor([ids])).logits[:, -1].float()
        for t, b in (p.logit_bias or {}).items():
            x[0, t] += b
        if p.min_tokens:
            x = MinNewTokensLengthLogitsProcessor(len(prompt_ids), p.min_tokens, stop_ids)(torch.tensor([ids]), x)
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([ids]), x)
        x = _openai_penalties(x[0], out, p.frequency_penalty, p.presence_penalty)
        t = int(x.argmax())
        ids.append(t)
        out.append(t)
        if t in stop_ids:
            break
    return out


GREEDY_CASES = [dict(), dict(repetition_penalty=1.4), dict(repetition_penalty=0.7),
                dict(frequency_penalty=0.1), dict(frequency_penalty=0.4), dict(presence_penalty=0.6),
                dict(frequency_penalty=0.1, presence_penalty=0.1, repetition_penalty=1.05),
                dict(logit_bias={66: 1.5, 123: 0.5}),
                dict(logit_bias={123: 1.0}, repetition_penalty=1.3),   # bias before the penalty
                dict(logit_bias={0: 40.0}, min_tokens=4),               # EOS wanted, banned until 4
                dict(logit_bias={9: 40.0}, stop_token_ids=[9], min_tokens=3)]


@pytest.mark.parametrize("kw", GREEDY_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "plain")
def test_greedy_with_penalties_bias_min_tokens_matches_transformers(llm, hf, kw):
    p = SamplingParams(temperature=0, max_tokens=12, **kw)
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    got = tokens(llm, [PROMPT], p)[0]
    want = _ref_greedy(hf, prompt_ids, p, set(llm.engine.eos_token_ids))
    assert got == want
    if "min_tokens" in kw:  # stopped right after min_tokens
        assert len(got) == kw["min_tokens"] + 1


def test_logit_bias_and_allowed_ids_become_tensors_once_per_request(llm, monkeypatch):
    """A step used to read every row's logit_bias dict into Python tuples: 4,096 entries with n=128
    held the whole batch for a second a step. The engine now keeps them as tensors from the first step
    on (one make per request, not per step), and the tokens are what the dict gave."""
    from nanoserve.model import SamplingTensors
    made, of = [], SamplingTensors.of
    monkeypatch.setattr(SamplingTensors, "of", classmethod(lambda cls, p: made.append(p) or of(p)))
    bias = {t: (t % 7) / 10 for t in range(VOCAB // 2)} | {123: 50.0}
    p = SamplingParams(temperature=0.5, seed=0, max_tokens=6, ignore_eos=True, n=3, logit_bias=bias,
                       allowed_token_ids=list(range(100, 200)))
    outs = llm.generate([PROMPT], p, use_tqdm=False)[0].outputs
    assert [o.token_ids for o in outs] == [[123] * 6] * 3 and len(made) == 3  # 3 children x 6 steps: 3 makes


@pytest.fixture(scope="module")
def greedy_two(llm):
    return tokens(llm, [PROMPT, "def main():"], SamplingParams(temperature=0, max_tokens=10))


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_single_token_truncation_equals_greedy(llm, greedy_two, kw):
    greedy = greedy_two
    sampled = tokens(llm, [PROMPT, "def main():"], SamplingParams(temperature=1.5, max_tokens=10, **kw))
    assert sampled == greedy


SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=14, ignore_eos=True)
OTHER_SEEDED = SamplingParams(temperature=0.8, seed=7, top_p=0.9, max_tokens=10, ignore_eos=True)


def test_seeded_sampling_is_reproducible_and_seeds_differ(llm):
    a = tokens(llm, [PROMPT], SEEDED)[0]
    assert a == tokens(llm, [PROMPT], SEEDED)[0]
    seeds = [tokens(llm, [PROMPT], SamplingParams(temperature=1.0, seed=s, max_tokens=14,
                                                  ignore_eos=True))[0] for s in (1235, 99)]
    assert all(s != a for s in seeds) and seeds[0] != seeds[1]
    unseeded = tokens(llm, [PROMPT] * 2, SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True))
    assert unseeded[0] != unseeded[1]


def _mixed_batch(tok):
    prompts, params = [], []
    other = [SamplingParams(temperature=0, max_tokens=9),
             SamplingParams(temperature=1.0, max_tokens=5),
             SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=12),
             SamplingParams(temperature=1.2, top_p=0.8, max_tokens=16, presence_penalty=1.0),
             SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=7),
             SamplingParams(temperature=0.9, min_p=0.1, seed=12, max_tokens=3, frequency_penalty=0.4)]
    for i in range(16):
        prompts.append(f"request {i}: import os, sys; " + "x" * i)
        params.append(other[i % len(other)])
    prompts[5], params[5] = PROMPT, SEEDED
    prompts[11], params[11] = "def main(): return 0", OTHER_SEEDED
    return prompts, params


def test_seeded_sampling_same_in_a_mixed_batch_of_16(llm):
    alone = tokens(llm, [PROMPT], SEEDED)[0]
    alone_other = tokens(llm, ["def main(): return 0"], OTHER_SEEDED)[0]
    prompts, params = _mixed_batch(llm.get_tokenizer())
    got = tokens(llm, prompts, params)
    assert got[5] == alone
    assert got[11] == alone_other


def test_seeded_sampling_same_under_preemption(tiny_model, llm):
    small = LLM(str(tiny_model), dtype="float32", num_kv_blocks=12, block_size=8, max_model_len=96)
    prompts = [PROMPT] + [f"long request {i} with a few tokens" for i in range(5)]
    params = [SEEDED] + [SamplingParams(temperature=1.0, seed=i, max_tokens=30, ignore_eos=True)
                         for i in range(5)]
    got = tokens(small, prompts, params)
    assert small.stats()["num_preemptions"] > 0
    assert small.stats()["num_free_blocks"] == 12
    assert got[0] == tokens(llm, [PROMPT], SEEDED)[0]
    assert got[3] == tokens(llm, [prompts[3]], params[3])[0]


def test_seeded_sampling_same_under_chunked_prefill(tiny_model, llm):
    chunky = LLM(str(tiny_model), dtype="float32", num_kv_blocks=32, max_num_batched_tokens=5)
    long_prompt = PROMPT + " the lazy dog; zebra quilts vex jumpy wizards 12345"
    assert len(chunky.get_tokenizer().encode(long_prompt)) > 4 * 5  # prefilled in >= 5 chunks
    got = tokens(chunky, [long_prompt, PROMPT], [SEEDED, OTHER_SEEDED])
    assert got[0] == tokens(llm, [long_prompt], SEEDED)[0]
    assert got[1] == tokens(llm, [PROMPT], OTHER_SEEDED)[0]


# =========================================================================== no token left to sample

EOS = 0  # conftest: the config's eos_token_id and the tokenizer's <|endoftext|>


def one_token(llm, word: str) -> int:
    (t,) = llm.get_tokenizer().encode(word, add_special_tokens=False)
    return t


def test_a_request_its_constraints_leave_without_a_token_stops_there(llm, caplog):
    """Where the constraints leave nothing to sample after some tokens, the request ends there with
    finish_reason "stop" (stop_reason None: no stop string or token did it), never with a token they
    ban: a finished grammar under min_tokens (EOS held back: the grammar wins), allowed_token_ids
    whose next token would complete a bad word, a grammar whose next token is a bad word. Greedy,
    seeded, with logprobs; the requests in the same batch get what they get alone."""
    x = one_token(llm, "x")
    enum_a = StructuredOutputsParams(json={"enum": ["a"]})
    quoted_a = llm.get_tokenizer().encode('"a"', add_special_tokens=False)
    stuck = [  # (params, the output's tokens)
        (SamplingParams(temperature=0, max_tokens=9, min_tokens=6, structured_outputs=enum_a), quoted_a),
        (SamplingParams(temperature=1.0, seed=4, max_tokens=9, min_tokens=9, logprobs=1, structured_outputs=enum_a),
         quoted_a),
        (SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=[x], bad_words=["xx"]), [x]),
        (SamplingParams(temperature=0.8, seed=1, max_tokens=8, allowed_token_ids=[x], bad_words=["xx"], logprobs=2),
         [x]),
        (SamplingParams(temperature=0, max_tokens=8, bad_words=["a"], structured_outputs=StructuredOutputsParams(
            choice=["xa"])), [x]),
    ]
    neighbours = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1),
                  SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)]
    alone = llm.generate([PROMPT, "def main():"], neighbours, use_tqdm=False)
    with caplog.at_level(logging.WARNING, logger="nanoserve.engine"):
        outs = llm.generate([PROMPT] + ["hello"] * len(stuck) + ["def main():"],
                            [neighbours[0]] + [p for p, _ in stuck] + [neighbours[1]], use_tqdm=False)
    for out, (p, want) in zip(outs[1:-1], stuck):
        (c,) = out.outputs
        assert (c.token_ids, c.finish_reason, c.stop_reason) == (want, "stop", None), p
        assert c.text == llm.get_tokenizer().decode(want) and (c.logprobs is None or len(c.logprobs) == len(want))
    for a, b in zip(alone, [outs[0], outs[-1]]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].text == b.outputs[0].text
    # the unexpected dead ends say why in the log; a grammar that has ended is no news
    assert len([r for r in caplog.records if "no token is left to sample" in r.message]) == 3
    assert not llm.engine.has_unfinished_requests() and llm.stats()["num_free_blocks"] == 96


def test_constraints_that_leave_no_first_token_are_refused_naming_them(llm):
    """Knowable from the request: a ValueError naming the fields (param: the first), before anything
    is queued. Near misses are served."""
    x, hello = one_token(llm, "x"), one_token(llm, "hello")
    yes_no = StructuredOutputsParams(choice=["yes", "no"])
    refused = [
        (dict(allowed_token_ids=[hello], bad_words=["hello"]), "allowed_token_ids and bad_words leave"),
        (dict(allowed_token_ids=[EOS], min_tokens=2), "allowed_token_ids and min_tokens (which holds back EOS"),
        (dict(allowed_token_ids=[x, 7], stop_token_ids=[7], min_tokens=1, logit_bias={x: -math.inf}),
         "allowed_token_ids and logit_bias and min_tokens"),
        (dict(allowed_token_ids=[hello, x], bad_words=["hello", "x"], min_tokens=1),  # min_tokens bans neither
         "allowed_token_ids and bad_words leave"),
        (dict(min_tokens=1, logit_bias={t: -math.inf for t in range(1, VOCAB)}), "logit_bias and min_tokens"),
        (dict(allowed_token_ids=[x], structured_outputs=yes_no),
         "allowed_token_ids leave no token to sample as the first one that the structured output allows"),
        (dict(allowed_token_ids=[x, EOS], structured_outputs=StructuredOutputsParams(regex="x?"), bad_words=["x"],
              min_tokens=1), "allowed_token_ids and bad_words and min_tokens"),
    ]
    for kw, message in refused:
        with pytest.raises(ValueError, match=re.escape(message)) as e:
            llm.generate([PROMPT, "ok"], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=4, **kw)],
                         use_tqdm=False)
        assert e.value.param == message.split()[0]
        assert not llm.engine.has_unfinished_requests()
    served = [dict(allowed_token_ids=[hello, x], bad_words=["hello"]),  # x is left
              dict(allowed_token_ids=[EOS], min_tokens=1, ignore_eos=True),  # EOS is not held back
              dict(allowed_token_ids=[x, EOS], min_tokens=1, structured_outputs=StructuredOutputsParams(regex="x?")),
              dict(allowed_token_ids=[x], logit_bias={x: -1e30})]  # a bias in fp32's range is no ban
    for kw in served:
        (c,) = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3, **kw), use_tqdm=False)[0].outputs
        assert c.token_ids and set(c.token_ids) <= set(kw["allowed_token_ids"]), kw


# =========================================================================== validation

INVALID = [
    ("n", dict(n=0)), ("n", dict(n=-1)), ("n", dict(n=1.5)), ("n", dict(n="2")),
    ("temperature", dict(temperature=-0.1)), ("temperature", dict(temperature="1")),
    ("temperature", dict(temperature=math.nan)),
    ("top_p", dict(top_p=0.0)), ("top_p", dict(top_p=1.1)), ("top_p", dict(top_p=math.nan)),
    ("top_p", dict(top_p=1.5, temperature=0)),
    ("top_k", dict(top_k=-2)), ("top_k", dict(top_k=2.5)), ("top_k", dict(top_k="5")),
    ("min_p", dict(min_p=-0.1)), ("min_p", dict(min_p=1.01)),
    ("presence_penalty", dict(presence_penalty=2.5)), ("presence_penalty", dict(presence_penalty=-2.01)),
    ("frequency_penalty", dict(frequency_penalty=3)), ("frequency_penalty", dict(frequency_penalty=math.nan)),
    ("repetition_penalty", dict(repetition_penalty=0)), ("repetition_penalty", dict(repetition_penalty=-1.0)),
    ("repetition_penalty", dict(repetition_penalty=5e-324)), ("repetition_penalty", dict(repetition_penalty=1e-31)),
    ("repetition_penalty", dict(repetition_penalty=1e31)),
    ("logit_bias", dict(logit_bias={"a": 1.0})), ("logit_bias", dict(logit_bias={1: "x"})),
    ("logit_bias", dict(logit_bias={1: None})), ("logit_bias", dict(logit_bias=[1, 2])),
    ("logit_bias", dict(logit_bias={1: math.nan})), ("logit_bias", dict(logit_bias={1: math.inf})),
    ("logit_bias", dict(logit_bias={1: 1e39})), ("logit_bias", dict(logit_bias={1: -1e39})),
    ("stop", dict(stop="")), ("stop", dict(stop=[""])), ("stop", dict(stop=["ok", ""])),
    ("stop", dict(stop=[1])),
    ("stop", dict(stop=5)),
    ("stop_token_ids", dict(stop_token_ids=[1.5])), ("stop_token_ids", dict(stop_token_ids=["a"])),
    ("stop_token_ids", dict(stop_token_ids=[True])),
    ("stop_token_ids", dict(stop_token_ids=5)),
    ("max_tokens", dict(max_tokens=0)), ("max_tokens", dict(max_tokens=-3)), ("max_tokens", dict(max_tokens=2.0)),
    ("min_tokens", dict(min_tokens=5, max_tokens=4)), ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=1.5)),
    ("logprobs", dict(logprobs=-2)), ("logprobs", dict(logprobs=2.5)),
    ("n must be 1 when using greedy", dict(n=2, temperature=0)),  # as vLLM's: n copies of one argmax
    ("seed", dict(seed="1")), ("seed", dict(seed=1.5)),
    ("logprob_token_ids", dict(logprob_token_ids=list(range(129)))), ("logprob_token_ids", dict(logprob_token_ids=5)),
    ("logprob_token_ids", dict(logprob_token_ids=[1.5])),
    ("logprobs must be None or the number of logprob_token_ids", dict(logprob_token_ids=[1, 2], logprobs=3)),
]


def test_logprob_token_ids_give_those_tokens_logprobs(llm):
    """vLLM's logprob_token_ids: each position has the sampled token's logprob and those of the
    listed ids (up to 128, past max_logprobs), the same numbers the whole vocabulary's (logprobs=-1
    under a raised cap) has there; beside rows asking for their top ones."""
    listed = [7, 3, 200, 3]  # a repeat has one entry
    whole = LLM(llm.engine.config.model, dtype="float32", max_model_len=256, num_kv_blocks=64, max_logprobs=-1)
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprob_token_ids=listed),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)]
    ids_row, top_row = (o.outputs[0] for o in llm.generate([PROMPT, PROMPT], params, use_tqdm=False))
    ref = whole.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=-1),
                         use_tqdm=False)[0].outputs[0]
    assert ids_row.token_ids == ref.token_ids == top_row.token_ids
    for token, got, want, top in zip(ids_row.token_ids, ids_row.logprobs, ref.logprobs, top_row.logprobs):
        assert set(got) == {token, 7, 3, 200}
        assert all(got[t].logprob == pytest.approx(want[t].logprob, abs=1e-5) for t in got)
        assert set(top) == {token} | {t for t, lp in want.items() if lp.rank <= 2}
    many = SamplingParams(max_tokens=1, logprob_token_ids=list(range(100)))  # past max_logprobs (20)
    assert len(llm.generate([PROMPT], many, use_tqdm=False)[0].outputs[0].logprobs[0]) >= 100


@pytest.mark.parametrize("name,kw", INVALID, ids=[f"{c[0] if isinstance(c, tuple) else c.values[0]}-{i}"
                                                  for i, c in enumerate(INVALID)])
def test_invalid_sampling_params_name_the_parameter(name, kw):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kw)


def test_repetition_penalty_edges_sample_valid_tokens(llm):
    """A penalty of 5e-324 (> 0, as the only rule was) is 0 in fp32: the sampler's seen logits became inf and
    NaN, and every token drawn was the unused id 383, even past a grammar (the API fuzz found it). The range
    now taken stays finite: at both its ends every token is one of the tokenizer's, and a grammar holds."""
    tokenizer_ids = len(llm.engine.tokenizer)
    for penalty in (1e-30, 1e30):
        for so in (None, StructuredOutputsParams(choice=["hello world"])):
            params = SamplingParams(temperature=1.0, repetition_penalty=penalty, max_tokens=6, n=3, seed=1,
                                    structured_outputs=so)
            for c in llm.generate([PROMPT + " fox fox fox"], params, use_tqdm=False)[0].outputs:
                assert all(t < tokenizer_ids for t in c.token_ids), (penalty, c.token_ids)
                assert so is None or "hello world".startswith(c.text), (penalty, c.text)


def test_valid_edges_are_accepted():
    for kw in (dict(n=3), dict(temperature=0), dict(top_p=1.0), dict(top_k=-1), dict(top_k=0),
               dict(min_p=1.0), dict(presence_penalty=-2, frequency_penalty=2), dict(repetition_penalty=0.1),
               dict(logit_bias={"5": "1.5"}), dict(logit_bias={5: -math.inf, 6: -3e38}), dict(stop="x"), dict(stop_token_ids=[0]), dict(max_tokens=None),
               dict(min_tokens=4, max_tokens=4), dict(logprobs=0), dict(logprobs=20), dict(seed=-5),
               dict(logprobs=-1, prompt_logprobs=-1), dict(n=2, temperature=0.005)):  # 0.005: not greedy
        SamplingParams(**kw)
    assert SamplingParams(logit_bias={"5": "1.5"}).logit_bias == {5: 1.5}
    assert SamplingParams(top_k=-1).top_k == 0


@pytest.mark.parametrize("name,kw", [("logit_bias", dict(logit_bias={VOCAB: 1.0})),
                                     ("logit_bias", dict(logit_bias={-1: 1.0})),
                                     ("stop_token_ids", dict(stop_token_ids=[VOCAB + 5])),
                                     ("logprobs", dict(logprobs=21)),  # the engine's max_logprobs (20)
                                     ("logprobs", dict(logprobs=-1)),  # the whole vocabulary: above it too
                                     ("prompt_logprobs", dict(prompt_logprobs=21)),
                                     ("logprob_token_ids", dict(logprob_token_ids=[3, VOCAB]))])
def test_out_of_vocab_ids_rejected_by_generate(llm, name, kw):
    with pytest.raises(ValueError, match=name):
        llm.generate([PROMPT, "ok"], [SamplingParams(), SamplingParams(**kw)], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing half-queued
