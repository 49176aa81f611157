"""prompt_logprobs (vLLM's SamplingParams.prompt_logprobs) against transformers:
every prompt token's logprob, rank and top-N equal log_softmax(model(ids).logits)
at the position before it, in one prefill, in chunks, with a shared prefix
already in the prefix cache (which the request must not take), for n > 1, and
under tensor parallelism (gloo: the vocabulary rows are gathered on rank 0).
Requests that do not ask are unchanged, bit for bit, by one that does."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import VOCAB, hf_model, make_model
from nanoserve import LLM, SamplingParams, model
from nanoserve.engine import Logprob, RequestOutputKind

_rng = torch.Generator().manual_seed(7)
PREFIX = torch.randint(1, VOCAB - 1, (40,), generator=_rng).tolist()  # 2 full blocks of 16 + 8
PROMPTS = [PREFIX + [5, 6, 7], torch.randint(1, VOCAB - 1, (23,), generator=_rng).tolist(), [9]]
BASE = dict(dtype="float32", num_kv_blocks=64, max_model_len=256, enforce_eager=True)


@pytest.fixture(scope="module")
def hf(tiny_model):
    return hf_model(tiny_model)


def hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check(ref: torch.Tensor, ids: list[int], got, k: int, tok=None) -> None:
    """``got`` (vLLM's shape: None, then {token id: Logprob} per prompt token) against ``ref``."""
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        row, entry, t = ref[i - 1], got[i], ids[i]
        top = row.topk(k).indices.tolist() if k else []
        assert list(entry)[0] == t and set(entry) == set(top) | {t}  # the prompt token first, then the top k
        for tid, lp in entry.items():
            assert isinstance(lp, Logprob) and lp.logprob == pytest.approx(float(row[tid]), abs=1e-5)
            # rank (vLLM's): how many are at least as likely; the top k by position (fp32 rounding room either way)
            assert int((row > row[tid] + 1e-4).sum()) + 1 <= lp.rank <= int((row > row[tid] - 1e-4).sum()) + 1
            if tok is not None:
                assert lp.decoded_token == tok.decode([tid])
        assert [e.rank for tid, e in entry.items() if tid in top] == sorted(e.rank for tid, e in entry.items()
                                                                           if tid in top)


@pytest.mark.parametrize("budget,slice_rows", [(None, 256), (8, 256), (None, 5)],
                         ids=["one-prefill", "chunks-of-8", "head-slices-of-5"])
def test_prompt_logprobs_equal_transformers(tiny_model, hf, budget, slice_rows, monkeypatch):
    monkeypatch.setattr(model, "PROMPT_LOGPROB_ROWS", slice_rows)
    llm = LLM(str(tiny_model), max_num_batched_tokens=budget, **BASE)
    for k in (0, 3):
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k), use_tqdm=False)
        for ids, out in zip(PROMPTS, outs):
            check(hf_prompt_logprobs(hf, ids), ids, out.prompt_logprobs, k, llm.get_tokenizer())
            assert out.outputs[0].logprobs is None  # only what was asked
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(tiny_model, hf):
    """A request that asks takes no prefix-cache hit (its positions need their
    logits); one that does not still hits; what the first computed is cached."""
    llm = LLM(str(tiny_model), max_num_batched_tokens=16, **BASE)
    plain = SamplingParams(temperature=0, max_tokens=4)
    llm.generate([PREFIX + [1]], plain, use_tqdm=False)  # caches PREFIX's 2 full blocks
    ids = PREFIX + [2, 3]
    asks, other = llm.generate([ids, PREFIX + [1]], [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2),
                                                    plain], use_tqdm=False)
    assert asks.num_cached_tokens == 0 and other.num_cached_tokens == 32
    check(hf_prompt_logprobs(hf, ids), ids, asks.prompt_logprobs, 2)
    assert other.prompt_logprobs is None
    assert llm.generate([ids], plain, use_tqdm=False)[0].num_cached_tokens == 32


def test_a_step_samples_the_same_with_prompt_logprobs_in_it(tiny_model):
    """The sampled rows' logits are computed as without prompt logprobs (their
    rows go through the head on their own): the same results, bit for bit."""
    engine = LLM(str(tiny_model), **BASE).engine
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1, logprobs=3, prompt_logprobs=2))
    engine.add_request(PROMPTS[1], SamplingParams(temperature=1.0, seed=5, max_tokens=1, logprobs=3))
    flight, inputs = engine.schedule_step()
    sched = flight.sched
    assert [len(s.prompt_logprob_ids or ()) for s in inputs] == [len(PROMPTS[0]) - 1, 0]
    asked = engine.runner.execute(inputs)
    plain = engine.runner.execute([dataclasses.replace(s, prompt_logprob_ids=None) for s in inputs])
    assert asked.sampled == plain.sampled and set(asked.prompt_logprobs) == {0} and not plain.prompt_logprobs
    outs = engine.postprocess(sched, asked.sampled, asked.prompt_logprobs)
    assert [len(o.prompt_logprobs or ()) for o in outs] == [len(PROMPTS[0]), 0]


def test_n_children_share_one_prompt_logprobs(tiny_model, hf):
    llm = LLM(str(tiny_model), **BASE)
    out = llm.generate([PROMPTS[1]], SamplingParams(n=3, max_tokens=3, seed=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert len(out.outputs) == 3
    check(hf_prompt_logprobs(hf, PROMPTS[1]), PROMPTS[1], out.prompt_logprobs, 1)


def test_prompt_logprobs_are_checked():
    for bad in (-2, 1.5, True):  # above max_logprobs (21): the engine's check, in test_sampling.py
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_minus_one_is_each_engines_whole_vocabulary_and_the_callers_params_keep_it(tiny_model, model_root):
    """One SamplingParams(logprobs=-1) on two engines of different vocabularies:
    each gives its own whole vocabulary, the caller's params still say -1, and an
    engine whose max_logprobs refuses -1 quotes the -1 the caller sent."""
    p = SamplingParams(temperature=0, max_tokens=1, logprobs=-1, prompt_logprobs=-1)
    other = make_model(model_root, "qwen2", vocab_size=VOCAB - 1, tie_word_embeddings=True)
    for path, vocab in ((tiny_model, VOCAB), (other, VOCAB - 1), (tiny_model, VOCAB)):
        out = LLM(str(path), max_logprobs=-1, **BASE).generate([PROMPTS[2] + [5]], p, use_tqdm=False)[0]
        assert len(out.outputs[0].logprobs[0]) == vocab and len(out.prompt_logprobs[1]) == vocab
        assert (p.logprobs, p.prompt_logprobs) == (-1, -1)
    with pytest.raises(ValueError, match=r"logprobs must be None or in \[0, 20\].*got -1$"):
        LLM(str(tiny_model), **BASE).generate([[9]], p, use_tqdm=False)


def test_prompt_logprobs_under_tensor_parallelism(model_root):
    """Two ranks (a padded vocabulary of 383 rows over 2), chunked: rank 0 gathers
    the rows and computes them; the worker joins every gather."""
    path = make_model(model_root, "qwen2", vocab_size=VOCAB - 1, tie_word_embeddings=True)
    llm = LLM(str(path), tensor_parallel_size=2, max_num_batched_tokens=16, **BASE)
    try:
        outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    hf = hf_model(path)
    for ids, out in zip(PROMPTS[:2], outs):
        check(hf_prompt_logprobs(hf, ids), ids, out.prompt_logprobs, 2)


def test_prompt_logprobs_survive_preemption(tiny_model, hf):
    """Few blocks for five requests prefilled in chunks: some are preempted and
    recomputed; each prompt's logprobs still come out whole and right."""
    prompts = [torch.randint(1, VOCAB - 1, (n,), generator=_rng).tolist() for n in (1, 7, 16, 23, 40)]
    llm = LLM(str(tiny_model), **{**BASE, "num_kv_blocks": 10, "max_model_len": 128},
              max_num_batched_tokens=32, max_num_seqs=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, min_tokens=20, prompt_logprobs=1),
                        use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for ids, out in zip(prompts, outs):
        check(hf_prompt_logprobs(hf, ids), ids, out.prompt_logprobs, 1)


def test_a_prompt_preempted_mid_prefill_recomputes_its_logprobs(tiny_model, hf):
    """Preempted after its first chunk, the request starts over from position 0:
    the chunks it recomputes replace what they cover, nothing is doubled."""
    from nanoserve.scheduler import SchedulerOutput
    engine = LLM(str(tiny_model), max_num_batched_tokens=16, **BASE).engine
    ids = PROMPTS[0]
    rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                             output_kind=RequestOutputKind.FINAL_ONLY)
    engine.step()
    req = engine.scheduler.requests[rid]
    assert len(req.prompt_logprobs) == 17  # positions 0..16 after the first chunk of 16
    engine.scheduler._preempt(req, SchedulerOutput())
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    check(hf_prompt_logprobs(hf, ids), ids, outs[-1].prompt_logprobs, 2)


def test_ranks_on_ties_are_vllms():
    """vLLM counts the tokens at least as likely (a tie takes the worse rank), and
    numbers the top k by position: bf16 logits tie often."""
    (row,) = model.gather_logprobs(torch.tensor([[1.0, 2.0, 2.0, 0.5]]), torch.tensor([2]), k=3)
    assert (row.token_id, row.rank) == (2, 2) and [t for t, _ in row.top][0] in (1, 2)
    all_tied = model.gather_logprobs(torch.tensor([[0.0, 0.0, 0.0]]), torch.tensor([0]), k=0)
    assert all_tied[0].rank == 3
