"""The decode path that CUDA graphs replay: decode-only steps padded to the next
captured batch size and run through the runner's persistent input buffers
(padding rows store no KV and attend to one token of block 0). On the CPU the
same path runs eagerly: it must give the unpadded path's outputs and write no
KV slot but the real ones. On a GPU (skipped elsewhere) the captured graphs
must replay exactly what the eager forward computes."""
from __future__ import annotations

import dataclasses
import logging
import os
import re

import pytest
import torch

from conftest import TRITON_INTERPRETER_CLASH, VOCAB, make_model
from nanoserve import LLM, SamplingParams, kernels
from nanoserve.model import SeqInput, cudagraph_capture_sizes

_rng = torch.Generator().manual_seed(5)
PROMPTS = [torch.randint(1, VOCAB, (n,), generator=_rng).tolist() for n in (40, 7, 19, 1, 60, 3, 23)]
SIZES = [1, 2, 4, 8]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, model_root):
    return make_model(model_root, request.param)


def make_llm(model, **kw) -> LLM:
    # the CPU unless a test asks for CUDA: on a GPU machine the default device is the GPU
    return LLM(str(model), **{"dtype": "float32", "device": "cpu", "max_model_len": 128, "num_kv_blocks": 96, **kw})


def run(llm, params):
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def same_outputs(a, b):
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb
        for ea, eb in zip(la or [], lb or []):
            assert ea.keys() == eb.keys()
            assert all(abs(ea[t].logprob - eb[t].logprob) < 1e-4 for t in ea)


def test_default_sizes_are_vllms():
    assert cudagraph_capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert cudagraph_capture_sizes(5) == [1, 2, 4, 5]
    assert cudagraph_capture_sizes(1000)[-1] == 512


def test_no_graphs_on_cuda_with_kernels_that_sync():
    """On CUDA, only a capture-safe backend (Triton's) gets graphs, asked for or by
    default: the torch references read seq_lens on the host, which capture forbids."""
    from types import SimpleNamespace

    from nanoserve import kernels
    from nanoserve.engine import EngineConfig, LLMEngine
    for sizes in (None, [1, 2]):
        config = EngineConfig("unused", max_num_seqs=16, cudagraph_capture_sizes=sizes)
        engine = SimpleNamespace(config=config, device=torch.device("cuda"), backend=kernels.TORCH)
        assert not kernels.TORCH.capture_safe and LLMEngine._decode_sizes(engine) == []
        engine.backend = dataclasses.replace(kernels.TORCH, capture_safe=True)  # as Triton's
        assert LLMEngine._decode_sizes(engine) == (sizes or cudagraph_capture_sizes(16))
    # vLLM's --max-cudagraph-capture-size caps the default list (a list given is taken as it is)
    from nanoserve.entry import engine_config, parse_args
    engine.config = engine_config(parse_args(["--max-num-seqs", "64", "--max-cudagraph-capture-size", "20"]))
    assert LLMEngine._decode_sizes(engine) == [1, 2, 4, 8, 16, 20]
    # as vLLM's, an unset max_num_seqs follows a small token budget down, and the list with it
    engine.config = EngineConfig("unused", max_num_batched_tokens=12)
    assert LLMEngine._decode_sizes(engine) == [1, 2, 4, 8, 12]
    engine.config.max_cudagraph_capture_size = 0
    with pytest.raises(ValueError, match="max_cudagraph_capture_size must be >= 1"):
        LLMEngine._decode_sizes(engine)


def test_given_sizes_above_the_token_budget_are_dropped(caplog):
    """As vLLM's _set_cudagraph_sizes: a given list loses its sizes above max_num_batched_tokens, with a
    warning, and a max_cudagraph_capture_size given beside it must be the largest size left. The same
    on the CPU, where the sizes pad decode steps eagerly."""
    from types import SimpleNamespace

    from nanoserve.engine import LLMEngine
    from nanoserve.entry import engine_config, parse_args
    flags = ["--max-num-seqs", "8", "--max-num-batched-tokens", "16", "--cudagraph-capture-sizes", "64", "1", "4",
             "16", "32", "4"]
    for device in ("cpu", "cuda"):
        engine = SimpleNamespace(config=engine_config(parse_args(flags)), device=torch.device(device),
                                 backend=dataclasses.replace(kernels.TORCH, capture_safe=True))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="nanoserve.engine"):
            assert LLMEngine._decode_sizes(engine) == [1, 4, 16]
        assert "[32, 64] dropped, above max_num_batched_tokens (16)" in caplog.text, caplog.text
        engine.config = engine_config(parse_args([*flags, "--max-cudagraph-capture-size", "16"]))
        assert LLMEngine._decode_sizes(engine) == [1, 4, 16]
        engine.config = engine_config(parse_args([*flags, "--max-cudagraph-capture-size", "32"]))
        with pytest.raises(ValueError, match=re.escape("max_cudagraph_capture_size (32) must be the largest of "
                                                       "cudagraph_capture_sizes (16)")):
            LLMEngine._decode_sizes(engine)


@pytest.mark.parametrize("kw", [{}, {"num_kv_blocks": 8}, {"max_num_batched_tokens": 16}],
                         ids=["plain", "preempt", "chunked"])
def test_padded_decode_gives_the_unpadded_outputs(model, kw):
    """Greedy tokens and their logprobs, and seeded samples, are the same with the
    padded static-buffer path as without it (7 prompts: batches of 7 padded to 8,
    then smaller ones as requests finish)."""
    plain, padded = make_llm(model, **kw), make_llm(model, cudagraph_capture_sizes=SIZES, **kw)
    assert plain.engine.runner.decode_sizes == [] and padded.engine.runner.decode_sizes == SIZES
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    seeded = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True)
              for i in range(len(PROMPTS))]
    for params in (greedy, seeded):
        same_outputs(run(plain, params), run(padded, params))
    for llm in (plain, padded):
        s = llm.stats()
        assert s["num_free_blocks"] == s["num_total_blocks"]
    if kw.get("num_kv_blocks"):
        assert padded.stats()["num_preemptions"] > 0


def test_padding_rows_write_no_kv(model):
    """A decode step of 3 sequences padded to 4: exactly the 3 real slots of every
    layer's K and V change."""
    llm = make_llm(model, cudagraph_capture_sizes=SIZES)
    runner = llm.engine.runner
    gen = torch.Generator().manual_seed(0)
    for k, v in runner.kv_caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    tables = [[3, 4], [7], [9, 10, 11]]
    starts = [20, 5, 40]  # positions of the new tokens
    seqs = [SeqInput([11 + i], p, t, None) for i, (p, t) in enumerate(zip(starts, tables))]
    assert runner._is_padded_decode(seqs)
    runner.execute(seqs)
    bs = runner.block_size
    written = sorted(t[p // bs] * bs + p % bs for t, p in zip(tables, starts))
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches):
        for old, new in ((k0, k1), (v0, v1)):
            changed = (old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
            assert changed == written


def test_enforce_eager_and_bad_sizes(model):
    assert make_llm(model, cudagraph_capture_sizes=SIZES, enforce_eager=True).engine.runner.decode_sizes == []
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        make_llm(model, cudagraph_capture_sizes=[0, 4])


# ---------------------------------------------------------------- on a GPU

# TRITON_INTERPRET=1 (conftest's default) copies every kernel argument to the host,
# which graph capture forbids: on a GPU, run these with TRITON_INTERPRET=0.
cuda_only = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                               reason="CUDA graphs need a GPU and compiled Triton (TRITON_INTERPRET=0)")


@cuda_only
def test_graph_replay_equals_eager_for_every_captured_size(model):
    eager = make_llm(model, device="cuda", enforce_eager=True)
    graphs = make_llm(model, device="cuda", cudagraph_capture_sizes=SIZES)
    assert sorted(graphs.engine.runner.graphs) == SIZES
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    for n in range(1, len(PROMPTS) + 1):  # every size, padded or exact
        prompts = PROMPTS[:n]
        a = eager.generate(prompts, greedy, use_tqdm=False)
        b = graphs.generate(prompts, greedy, use_tqdm=False)
        same_outputs([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in a],
                     [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in b])


@cuda_only
def test_graph_padding_rows_write_no_kv(model):
    llm = make_llm(model, device="cuda", cudagraph_capture_sizes=SIZES)
    runner = llm.engine.runner
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    seqs = [SeqInput([11], 20, [3, 4], None), SeqInput([12], 5, [7], None), SeqInput([13], 40, [9, 10, 11], None)]
    runner.execute(seqs)
    bs = runner.block_size
    written = sorted([4 * bs + 4, 7 * bs + 5, 11 * bs + 8])
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches):
        for old, new in ((k0, k1), (v0, v1)):
            assert (old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist() == written


@cuda_only
@pytest.mark.parametrize("kw", [{}, {"num_kv_blocks": 8}], ids=["plain", "preempt"])
def test_async_scheduling_with_graphs_gives_the_normal_outputs(model, kw):
    """Async scheduling on CUDA: inputs copied from pinned memory without a sync,
    each in-flight token written into the graphs' input buffer on the device, the
    results copied back behind an event. Greedy (with logprobs), seeded, min_tokens
    and logit_bias rows, all of which run ahead, give the normal mode's outputs."""
    kinds = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
             SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=3, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0, min_tokens=6, max_tokens=12),
             SamplingParams(temperature=0, logit_bias={5: 3.0}, max_tokens=12, ignore_eos=True)]
    params = [kinds[i % len(kinds)] for i in range(len(PROMPTS))]
    runs = []
    for async_scheduling in (False, True):
        llm = make_llm(model, device="cuda", cudagraph_capture_sizes=SIZES, async_scheduling=async_scheduling, **kw)
        assert sorted(llm.engine.runner.graphs) == SIZES
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs)
                     for o in llm.generate(PROMPTS, params, use_tqdm=False)])
    same_outputs(*runs)



@pytest.mark.skipif(kernels.TRITON is None or TRITON_INTERPRETER_CLASH is not None,
                    reason=TRITON_INTERPRETER_CLASH or "triton is not installed")
def test_padded_decode_on_triton_splits_each_long_context(tiny_model, monkeypatch):
    """The GPU's decode path on the CPU: Triton's attention (interpreted) through
    the padded buffers, whose block tables span max_model_len. With partitions of
    at least 32 tokens (512 on a GPU; fewer keep the interpreter quick) a decode
    padded to 4 rows splits each context into up to 4 of its own; greedy tokens
    and logprobs are the torch references' on the unpadded path. (The pointwise
    ops stay the references': interpreted, they would take most of a minute.)"""
    from nanoserve import engine
    monkeypatch.setattr(kernels, "_SPLIT_KV_MIN_PARTITION", 32)
    triton_attention = dataclasses.replace(kernels.TORCH, name="triton-attention",
                                           store_kvcache=kernels.TRITON.store_kvcache,
                                           paged_attention=kernels.TRITON.paged_attention)
    prompts = [torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (100, 50, 3)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    outs = []
    for backend, sizes in ((kernels.TORCH, None), (triton_attention, [1, 2, 4])):
        monkeypatch.setattr(engine, "select_backend", lambda *a, backend=backend, **k: backend)
        llm = make_llm(tiny_model, cudagraph_capture_sizes=sizes)
        assert llm.engine.runner.backend is backend
        outs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs)
                     for o in llm.generate(prompts, params, use_tqdm=False)])
    assert kernels._num_kv_splits(True, 4, 2, llm.engine.runner.static["block_tables"].shape[1] * 16) == 4
    same_outputs(*outs)
