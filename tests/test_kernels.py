"""Kernel tests: both backends of store_kvcache and paged_attention against a
naive dense attention written here (per-sequence loop, explicit causal mask,
softmax in float64), on random fp32 data.

The Triton kernels run on the CPU through Triton's interpreter, which must be
switched on before triton is first imported (it decides at @triton.jit time),
hence the environment line above every import. The interpreter only does fp32
and is slow, so shapes stay small.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from conftest import TRITON_INTERPRETER_CLASH  # noqa: E402
from nanoserve import kernels  # noqa: E402

HAS_TRITON = kernels.triton is not None


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(kernels._paged_attention_kernel, InterpretedFunction)


# If some module imported triton before the line above ran (another test file
# collected first), its kernels were compiled for a GPU; on a CPU-only machine
# they cannot run. That is a setup error: test_triton_runs_interpreted_on_cpu
# fails and says so, the other Triton cases skip.
TRITON_RUNNABLE = HAS_TRITON and (_interpreted() or torch.cuda.is_available()) and not TRITON_INTERPRETER_CLASH
DEVICE = "cuda" if HAS_TRITON and not _interpreted() and torch.cuda.is_available() else "cpu"
_NO_TRITON = "triton is not installed" if not HAS_TRITON else TRITON_INTERPRETER_CLASH or \
    "triton was imported before TRITON_INTERPRET=1 was set and there is no GPU"
triton_only = pytest.mark.skipif(not TRITON_RUNNABLE, reason=_NO_TRITON)
BACKENDS = ["torch", pytest.param("triton", marks=triton_only)]
# Triton must never read outside the block table or past seq_len, so its caches
# are poisoned with NaN. The torch twin gathers whole blocks by design and masks
# afterwards (0 * NaN would still be NaN), so it gets a large finite poison that
# shows up in the output if it is ever given any weight.
POISON = {"torch": 1e4, "triton": float("nan")}
ATOL = RTOL = 1e-4

# (block_size, head_dim, num_heads, num_kv_heads): GQA ratios 1, 2, 3, 4, 8.
CONFIGS = [(8, 32, 4, 4), (16, 64, 4, 2), (32, 128, 8, 2), (16, 32, 8, 1), (8, 64, 6, 2)]
# Each sequence of a batch as (cached context before this step, tokens this step).
SCENARIOS = {
    "decode": [(4, 1), (16, 1), (37, 1), (0, 1)],
    "prefill": [(0, 5), (0, 19)],
    "chunked": [(16, 7), (9, 12)],
    "mixed": [(12, 1), (0, 6), (20, 9), (33, 1)],
    # a sequence with no tokens this step: num_tokens == num_seqs although one
    # sequence has a 2-token chunk, so the "all decodes" tile shape must still be right
    "idle_seq": [(5, 0), (3, 2), (9, 1)],
}


# --------------------------------------------------------------------------- helpers

def make_batch(specs, block_size, head_dim, num_heads, num_kv_heads, poison, extra_blocks=3):
    """Random queries and a paged cache holding each sequence's full context.

    Block 0 is a poisoned null block that pads every table row; the other blocks
    are handed out in a random order, a few stay unused (poisoned), and so do the
    slots past seq_len in each sequence's last block."""
    seq_lens = [ctx + q for ctx, q in specs]
    n_blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(n_blocks) + extra_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, poison, device=DEVICE)
    v_cache = torch.full(shape, poison, device=DEVICE)
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()
    block_tables = torch.zeros(len(specs), max(n_blocks) + 1, dtype=torch.int32)
    for i, (seq_len, nb) in enumerate(zip(seq_lens, n_blocks)):
        block_tables[i, :nb] = torch.tensor(perm[:nb])
        perm = perm[nb:]
        pos = torch.arange(seq_len)
        blocks = block_tables[i, pos // block_size].long()
        for cache in (k_cache, v_cache):
            cache[blocks, pos % block_size] = torch.randn(seq_len, num_kv_heads, head_dim,
                                                          device=DEVICE)
    q_lens = [q for _, q in specs]
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    query = torch.randn(sum(q_lens), num_heads, head_dim, device=DEVICE)
    return (query, k_cache, v_cache, block_tables.to(DEVICE),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), query_start_loc.to(DEVICE))


def naive_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    """Dense float64 attention, one sequence at a time, straight from the definition."""
    out = torch.empty(query.shape, dtype=torch.float64, device=query.device)
    block_size = k_cache.shape[1]
    group = query.shape[1] // k_cache.shape[2]
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = query_start_loc[i].item(), query_start_loc[i + 1].item()
        q_len = end - start
        pos = torch.arange(seq_len, device=query.device)
        blocks = block_tables[i, pos // block_size].long()
        # query head h reads KV head h // group
        k = k_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1)  # [ctx,h,d]
        v = v_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1)
        q = query[start:end].double()                                                 # [q, h, d]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        allowed = pos[None, :] <= q_pos[:, None]                                      # [q, ctx]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def check_attention(backend, batch, **kw):
    query = batch[0]
    scale = query.shape[-1] ** -0.5
    expected = naive_attention(*batch, scale)
    got = kernels.paged_attention(*batch, scale, backend=backend, **kw)
    assert got.dtype == query.dtype and got.shape == query.shape
    torch.testing.assert_close(got.double(), expected, atol=ATOL, rtol=RTOL)


# --------------------------------------------------------------------------- store_kvcache

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim",
                         [(8, 2, 32), (16, 3, 64), (32, 1, 128)])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_store_kvcache(backend, block_size, num_kv_heads, head_dim, layout):
    torch.manual_seed(0)
    num_blocks, num_tokens = 6, 11
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=DEVICE)
    v_cache = torch.randn(shape, device=DEVICE)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    if layout == "contiguous":
        key = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE)
        value = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE)
    else:  # views into a fused buffer, head_dim stride 2: the kernel must use strides
        fused = torch.randn(num_tokens, 2, num_kv_heads, 2 * head_dim, device=DEVICE)
        key, value = fused[:, 0, :, ::2], fused[:, 1, :, 1::2]
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[1, 4, 10]] = -1  # padding tokens
    kernels.store_kvcache(key, value, k_cache, v_cache, slots.to(DEVICE), backend=backend)

    k_expected, v_expected = k_before.view(-1, num_kv_heads, head_dim).clone(), \
        v_before.view(-1, num_kv_heads, head_dim).clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_expected[slot], v_expected[slot] = key[t], value[t]
    # exact: a copy, and every row not named by a valid slot is untouched
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim), k_expected)
    assert torch.equal(v_cache.view(-1, num_kv_heads, head_dim), v_expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_kvcache_all_padding_and_empty(backend):
    k_cache = torch.randn(2, 8, 1, 32, device=DEVICE)
    before = k_cache.clone()
    key = torch.randn(3, 1, 32, device=DEVICE)
    kernels.store_kvcache(key, key, k_cache, k_cache, torch.full((3,), -1, device=DEVICE),
                          backend=backend)
    kernels.store_kvcache(key[:0], key[:0], k_cache, k_cache,
                          torch.empty(0, dtype=torch.long, device=DEVICE), backend=backend)
    assert torch.equal(k_cache, before)


# --------------------------------------------------------------------------- paged_attention

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "bs{}-d{}-h{}-kv{}".format(*c))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_paged_attention(backend, config, scenario):
    torch.manual_seed(10 * CONFIGS.index(config) + list(SCENARIOS).index(scenario))
    check_attention(backend, make_batch(SCENARIOS[scenario], *config, poison=POISON[backend]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_after_store(backend):
    """The model's order of calls: store the step's K/V, then attend. A prefix of
    21 tokens is cached, a chunk of 10 and a decode arrive."""
    torch.manual_seed(1)
    block_size, head_dim, num_heads, num_kv_heads = 8, 32, 4, 2
    specs = [(21, 10), (13, 1)]
    query, k_cache, v_cache, block_tables, seq_lens, qsl = make_batch(
        specs, block_size, head_dim, num_heads, num_kv_heads, POISON[backend])
    # Take the step's tokens out of the cache, poison their slots, store them back.
    slots = []
    for i, (ctx, q_len) in enumerate(specs):
        pos = torch.arange(ctx, ctx + q_len)
        blocks = block_tables[i, pos // block_size].long().cpu()
        slots.append(blocks * block_size + pos % block_size)
    slots = torch.cat(slots).to(DEVICE)
    key = k_cache.view(-1, num_kv_heads, head_dim)[slots].clone()
    value = v_cache.view(-1, num_kv_heads, head_dim)[slots].clone()
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = POISON[backend]
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = POISON[backend]
    kernels.store_kvcache(key, value, k_cache, v_cache, slots, backend=backend)
    check_attention(backend, (query, k_cache, v_cache, block_tables, seq_lens, qsl))


# --------------------------------------------------------------------------- split-KV

@triton_only
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads", [(16, 4, 1), (32, 8, 2)])
def test_split_kv_long_decode(monkeypatch, block_size, num_heads, num_kv_heads):
    """A long-context decode batch takes the split-KV path (partials + reduce);
    the short sequence leaves most of its partitions empty."""
    monkeypatch.setattr(kernels, "_SPLIT_KV_MIN_PARTITION", 64)  # keep the interpreter quick
    torch.manual_seed(2)
    batch = make_batch([(300, 1), (40, 1), (129, 1)], block_size, 32, num_heads, num_kv_heads,
                       POISON["triton"])
    max_context = batch[3].shape[1] * block_size
    assert kernels._num_kv_splits(True, 3, num_kv_heads, max_context) > 2
    check_attention("triton", batch)


@triton_only
def test_split_kv_default_thresholds():
    """With the shipped thresholds a ~1k-token decode already splits."""
    torch.manual_seed(3)
    batch = make_batch([(1100, 1)], 32, 32, 4, 1, POISON["triton"])
    assert kernels._num_kv_splits(True, 1, 1, batch[3].shape[1] * 32) >= 2
    check_attention("triton", batch)


def test_split_kv_heuristic():
    """Split until ~1024 programs, never below 512-token partitions, never for
    prefill (the thresholds benchmarks/triton_gpu.py measured on an H200)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    assert kernels._num_kv_splits(True, 64, 8, 16384) == 2      # 512 programs -> 1024
    assert kernels._num_kv_splits(True, 16, 8, 4096) == 8       # capped by 4096 // 512
    assert kernels._num_kv_splits(True, 1, 8, 16384) == 32      # capped by _SPLIT_KV_MAX_SPLITS
    assert kernels._num_kv_splits(True, 256, 8, 16384) == 1     # 2048 programs already
    assert kernels._num_kv_splits(True, 4, 2, 300) == 1         # too short to split
    assert kernels._num_kv_splits(False, 1, 8, 16384) == 1      # a prefill chunk in the batch


def test_tile_shape_heuristic():
    """Decode tiles for all-decode batches; big tiles only where the sequences
    average >= 256 tokens and head_dim <= 128 (measured on an H200)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    assert kernels._tile_shape(True, 64, 64, 128, 2) == (16, 32)
    assert kernels._tile_shape(True, 4, 4, 64, 32) == (32, 32)       # a 32-head group needs 32 rows
    assert kernels._tile_shape(False, 2112, 65, 128, 2) == (64, 32)   # 64 decodes + one 2048 chunk
    assert kernels._tile_shape(False, 8192, 8, 128, 2) == (128, 64)   # long prompts
    assert kernels._tile_shape(False, 8192, 8, 256, 8) == (64, 32)    # head_dim 256


@triton_only
def test_prefill_tile_long_prompt():
    """A batch whose sequences average >= 256 tokens takes the 128 x 64 tiles."""
    torch.manual_seed(8)
    specs = [(0, 300), (40, 260)]
    batch = make_batch(specs, 16, 32, 4, 2, POISON["triton"])
    assert kernels._tile_shape(False, 560, 2, 32, 2) == (128, 64)
    check_attention("triton", batch)


@triton_only
@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_kv_any_batch(num_splits):
    """The split path is exact for prefill chunks too, so the heuristic that
    picks it can only cost speed, never correctness."""
    torch.manual_seed(4)
    batch = make_batch(SCENARIOS["mixed"], 8, 32, 4, 2, POISON["triton"])
    query = batch[0]
    scale = query.shape[-1] ** -0.5
    got = kernels._launch_attention(*batch, scale, torch.empty_like(query), block_m=16,
                                    block_q=8, num_splits=num_splits)
    torch.testing.assert_close(got.double(), naive_attention(*batch, scale), atol=ATOL, rtol=RTOL)


# --------------------------------------------------------------------------- plumbing

@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_runs_interpreted_on_cpu():
    assert DEVICE == "cuda" or _interpreted(), (
        "the Triton kernels are compiled for a GPU, not interpreted: set TRITON_INTERPRET=1 "
        "before anything imports triton (e.g. at the top of tests/conftest.py)")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_interpreter_works_with_this_numpy():
    """One clear failure, with the fix, instead of every Triton case failing inside
    the interpreter (those skip)."""
    assert TRITON_INTERPRETER_CLASH is None, TRITON_INTERPRETER_CLASH


@triton_only
def test_bad_shapes_raise():
    q = torch.randn(2, 4, 48)
    cache = torch.randn(3, 8, 2, 48)
    seq = dict(block_tables=torch.zeros(2, 1, dtype=torch.int32),
               seq_lens=torch.ones(2, dtype=torch.int32),
               query_start_loc=torch.arange(3, dtype=torch.int32), scale=1.0)
    with pytest.raises(ValueError, match="power of two"):
        kernels.paged_attention(q, cache, cache, backend="triton", **seq)
    with pytest.raises(ValueError, match="power of two"):
        kernels.store_kvcache(q[:, :2], q[:, :2], cache, cache, torch.zeros(2, dtype=torch.long),
                              backend="triton")
    cache = torch.randn(3, 8, 3, 32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        kernels.paged_attention(torch.randn(2, 4, 32), cache, cache, backend="triton", **seq)


# --------------------------------------------------------------------------- compiled decode (CPU)
# backend="inductor" is the torch twin with its decode attention compiled by
# torch.compile; prefill chunks keep SDPA. dynamo keeps one graph per model shape
# and stops compiling after its recompile limit, so each test starts from a reset
# and checks that the compiled kernel itself ran (not the eager fallback).

@pytest.fixture
def fresh_dynamo():
    import torch._dynamo
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("config", CONFIGS[:3], ids=lambda c: "bs{}-d{}-h{}-kv{}".format(*c))
@pytest.mark.parametrize("scenario", ["decode", "mixed", "idle_seq"])
def test_compiled_decode_attention(fresh_dynamo, config, scenario):
    torch.manual_seed(7 + CONFIGS.index(config))
    batch = make_batch(SCENARIOS[scenario], *config, poison=POISON["torch"])
    check_attention("inductor", batch)
    # the decodes alone, straight through the compiled kernel
    query, k_cache, v_cache, block_tables, seq_lens, qsl = batch
    decodes = [i for i in range(len(seq_lens)) if qsl[i + 1] - qsl[i] == 1]
    rows = qsl[decodes].long()
    got = kernels._run_compiled_decode(query[rows], k_cache, v_cache, block_tables[decodes],
                                       seq_lens[decodes], query.shape[-1] ** -0.5)
    assert got is not None
    expected = naive_attention(*batch, query.shape[-1] ** -0.5)[rows]
    torch.testing.assert_close(got.double(), expected, atol=ATOL, rtol=RTOL)


def test_compiled_decode_one_graph_for_all_batch_sizes(fresh_dynamo):
    """Batch and table sizes are symbolic (1 included) and scale is a tensor:
    one model compiles once, whatever the batch."""
    from torch._dynamo.utils import counters
    counters.clear()
    for specs in ([(4, 1)], [(40, 1), (3, 1), (17, 1)], [(0, 1), (100, 1)]):
        check_attention("inductor", make_batch(specs, 8, 32, 4, 2, poison=POISON["torch"]))
    assert counters["stats"]["unique_graphs"] == 1


def test_compiled_decode_bf16(fresh_dynamo):
    """bf16, as the engine runs it on the CPU: within bf16 rounding of the float64 truth,
    and no further from it than the eager SDPA twin."""
    torch.manual_seed(5)
    batch = make_batch([(70, 1), (5, 1), (33, 1)], 16, 64, 8, 2, poison=POISON["torch"])
    batch = (batch[0].bfloat16(), batch[1].bfloat16(), batch[2].bfloat16(), *batch[3:])
    scale = 64 ** -0.5
    truth = naive_attention(*batch, scale)
    got = kernels.paged_attention(*batch, scale, backend="inductor")
    eager = kernels.paged_attention(*batch, scale, backend="torch")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), truth, atol=2e-2, rtol=2e-2)
    assert (got.double() - truth).abs().max() <= (eager.double() - truth).abs().max() * 1.01


def test_compiled_decode_falls_back_at_recompile_limit(monkeypatch):
    """When dynamo will not compile another shape the decode runs eager, with a warning."""
    import torch._dynamo

    def refuse(*args):
        raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile_limit reached")
    monkeypatch.setattr(kernels, "_compiled_decode", lambda: refuse)
    torch.manual_seed(6)
    with pytest.warns(RuntimeWarning, match="recompile limit"):
        check_attention("inductor", make_batch(SCENARIOS["decode"], 8, 32, 4, 2, poison=POISON["torch"]))


# --------------------------------------------------------------------------- C decode kernel (CPU, bf16)
# backend="avx512": decodes through the C kernel, chunks through the SDPA twin.
# It is built on first use; on a CPU without AVX-512 BF16 (or with no C compiler)
# it cannot be, and these tests skip, saying why.

def _c_kernel_or_skip(group=2, head_dim=64):
    try:
        kernels._c_attention_library(group, head_dim)
    except RuntimeError as e:
        pytest.skip(str(e))


def _bf16(batch):
    return (batch[0].bfloat16(), batch[1].bfloat16(), batch[2].bfloat16(), *batch[3:])


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "bs{}-d{}-h{}-kv{}".format(*c))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_c_attention(config, scenario):
    """Within bf16 rounding of the float64 truth and no further from it than the
    eager SDPA twin. In the all-decode batch the caches are poisoned with NaN:
    the kernel must read nothing past seq_len or outside the block table."""
    _c_kernel_or_skip(config[2] // config[3], config[1])
    torch.manual_seed(11 + CONFIGS.index(config))
    poison = float("nan") if scenario == "decode" else POISON["torch"]
    batch = _bf16(make_batch(SCENARIOS[scenario], *config, poison=poison))
    scale = config[1] ** -0.5
    truth = naive_attention(*batch, scale)
    got = kernels.paged_attention(*batch, scale, backend="avx512")
    assert got.dtype == torch.bfloat16 and got.shape == batch[0].shape
    torch.testing.assert_close(got.double(), truth, atol=2e-2, rtol=2e-2)
    if scenario != "decode":  # (the SDPA twin reads whole blocks, so NaN poison would reach it)
        eager = kernels.paged_attention(*batch, scale, backend="torch")
        assert (got.double() - truth).abs().max() <= (eager.double() - truth).abs().max() * 1.01


def test_c_decode_attention_long_contexts_and_many_sequences():
    """Many blocks per sequence (the prefetch of the next block), more tasks than
    threads, and a batch of one split across its kv heads."""
    _c_kernel_or_skip(2, 128)
    torch.manual_seed(12)
    for specs in ([(300, 1), (17, 1), (129, 1), (64, 1)] * 4, [(450, 1)]):
        batch = _bf16(make_batch(specs, 16, 128, 8, 4, poison=float("nan")))
        truth = naive_attention(*batch, 128 ** -0.5)
        got = kernels.paged_attention(*batch, 128 ** -0.5, backend="avx512")
        torch.testing.assert_close(got.double(), truth, atol=2e-2, rtol=2e-2)


def _share_prefix(batch, blocks: int):
    """Point every sequence's first `blocks` table entries at sequence 0's, as the
    prefix cache does for requests that start with the same tokens."""
    table = batch[3].clone()
    table[:, :blocks] = table[0, :blocks]
    return (*batch[:3], table, *batch[4:])


@pytest.mark.parametrize("config", [(16, 128, 16, 8), (16, 64, 14, 2), (8, 32, 4, 4)],
                         ids=lambda c: "bs{}-d{}-h{}-kv{}".format(*c))
@pytest.mark.parametrize("num_seqs", [4, 19])
def test_c_cascade_decode(monkeypatch, config, num_seqs):
    """Decodes that share a prefix take cascade attention (prefix_attention for the
    shared blocks, decode_attention for each tail, merged): within bf16 rounding of
    the float64 truth, no further from it than the SDPA twin, and reading nothing
    outside the tables (NaN everywhere else). Tails of 1 to 40 tokens; 19 sequences
    leave the last tile of rows part empty."""
    bs, head_dim, heads, kv_heads = config
    _c_kernel_or_skip(heads // kv_heads, head_dim)
    torch.manual_seed(13 + num_seqs)
    shared = 5
    specs = [(shared * bs + (i * 7) % 40, 1) for i in range(num_seqs)]
    monkeypatch.setattr(kernels, "_CASCADE_MIN_SEQS", 2)   # small shapes: always take it
    monkeypatch.setattr(kernels, "_CASCADE_MIN_TOKENS", 1)
    calls = []
    real = kernels._shared_prefix_blocks
    monkeypatch.setattr(kernels, "_shared_prefix_blocks", lambda *a: calls.append(real(*a)) or calls[-1])
    batch = _bf16(_share_prefix(make_batch(specs, *config, poison=float("nan")), shared))
    scale = head_dim ** -0.5
    truth = naive_attention(*batch, scale)
    got = kernels.paged_attention(*batch, scale, backend="avx512")
    assert calls == [shared]  # the cascade path ran, over exactly the shared blocks
    torch.testing.assert_close(got.double(), truth, atol=2e-2, rtol=2e-2)
    finite = (batch[0], batch[1].nan_to_num(0.0), batch[2].nan_to_num(0.0), *batch[3:])
    eager = kernels.paged_attention(*finite, scale, backend="torch")
    assert (got.double() - truth).abs().max() <= (eager.double() - truth).abs().max() * 1.01


def test_shared_prefix_blocks():
    t = torch.tensor([[4, 5, 6, 9], [4, 5, 6, 7], [4, 5, 8, 1]], dtype=torch.int32)
    lens = torch.tensor([60, 60, 60], dtype=torch.int32)
    assert kernels._shared_prefix_blocks(t, lens, 16) == 2
    assert kernels._shared_prefix_blocks(t[:2], lens[:2], 16) == 3
    # each sequence keeps at least its last token to itself: a 48-token one shares 2 blocks at most
    assert kernels._shared_prefix_blocks(t[:2], torch.tensor([48, 60], dtype=torch.int32), 16) == 2
    t[2, 0] = 3
    assert kernels._shared_prefix_blocks(t, lens, 16) == 0


def test_c_decode_heads_per_task():
    assert kernels._heads_per_task(64, 8, 2) == 8   # many sequences: a task reads whole K/V rows
    assert kernels._heads_per_task(2, 8, 2) == 4    # few: split so each thread has two tasks
    assert kernels._heads_per_task(1, 4, 2) == 1
    assert kernels._heads_per_task(1, 6, 2) == 1
    assert kernels._heads_per_task(2, 6, 2) == 3    # only divisors of the kv heads


def test_c_store_kvcache_is_the_twins():
    """The C store writes what store_kvcache_torch writes, skips slots of -1, and
    takes value as a strided view of the qkv projection, as the layer passes it."""
    _c_row_ops_or_skip()
    gen = torch.Generator().manual_seed(4)
    T, kvh, d = 11, 2, 32
    qkv = torch.randn(T, (4 + 2 * kvh) * d, generator=gen).bfloat16()
    key = torch.randn(T, kvh, d, generator=gen).bfloat16()
    value = qkv[:, (4 + kvh) * d:].view(T, kvh, d)
    slots = torch.randperm(6 * 8, generator=gen)[:T]
    slots[[2, 7]] = -1
    caches = [torch.randn(6, 8, kvh, d, generator=gen).bfloat16() for _ in range(2)]
    want = [c.clone() for c in caches]
    kernels.store_kvcache(key, value, *caches, slots, backend="avx512")
    kernels.store_kvcache_torch(key, value, *want, slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    with pytest.raises(ValueError, match="bf16"):
        kernels.store_kvcache(key.float(), value.float(), *[c.float() for c in caches], slots, backend="avx512")
    slots[0] = 6 * 8  # one past the end: an error, as the twin's index_copy_ raises, not a write
    with pytest.raises(IndexError, match="outside the cache"):
        kernels.store_kvcache(key, value, *caches, slots, backend="avx512")


def test_c_softmax_exp_is_libms_expf():
    """decode_attention's vectorised exp reproduces glibc's expf bit for bit (the
    softmax called expf once per score before): random scores of every scale,
    and the edges (0, the overflow and underflow limits, infinities, NaN).
    All 2^32 inputs were checked once on glibc 2.36 (benchmarks/RESULTS.md)."""
    import ctypes
    import ctypes.util
    _c_kernel_or_skip()
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.expf.restype, libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([-torch.rand(4000, generator=gen) * 10 ** torch.randint(-8, 3, (4000,), generator=gen),
                   torch.randn(1000, generator=gen) * 30,
                   torch.tensor([0.0, -0.0, 88.0, 88.72, 89.0, -87.3, -103.0, -103.97, -104.0, -150.0,
                                 1e-30, -1e-45, math.inf, -math.inf, math.nan])])
    got = torch.empty_like(x)
    kernels._c_attention_library(2, 64).expf_glibc(x.data_ptr(), got.data_ptr(), x.numel())
    want = torch.tensor([libm.expf(v) for v in x.tolist()])
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    assert same.all(), x[~same][:5].tolist()


def test_c_decode_rejects_what_it_cannot_run():
    with pytest.raises(RuntimeError, match="head_dim % 32 == 0"):
        kernels._c_attention_library(2, 48)
    _c_kernel_or_skip(2, 32)
    batch = make_batch(SCENARIOS["decode"], 8, 32, 4, 2, poison=POISON["torch"])
    with pytest.raises(ValueError, match="bf16"):
        kernels.paged_attention(*batch, 1.0, backend="avx512")  # fp32
    batch = make_batch(SCENARIOS["prefill"], 8, 32, 4, 2, poison=POISON["torch"])
    with pytest.raises(ValueError, match="bf16"):
        kernels.paged_attention(*batch, 1.0, backend="avx512")  # fp32 chunks


# --------------------------------------------------------------------------- C elementwise ops (CPU, bf16)
# Their oracle is model.py's eager torch, bit for bit (torch.equal): RMSNorm's
# mean of squares must add in ATen's order, every bf16 intermediate must round
# where torch rounds, SiLU must carry torch's exp.

def _c_row_ops_or_skip():  # the elementwise ops, the KV store and argmax: one library
    try:
        kernels._c_row_ops_library()
    except RuntimeError as e:
        pytest.skip(str(e))


def _rand_bf16(gen, *shape, scale=3.0):
    return (torch.randn(*shape, generator=gen) * scale).bfloat16()


@pytest.mark.parametrize("rows, n", [(1, 64), (5, 128), (37, 512), (3, 896), (9, 1024), (4, 4096)])
def test_c_rms_norm_is_eagers(rows, n):
    """Row lengths up to 4096 take every branch of ATen's summation cascade (16
    rounds of 4 x 8 lanes fold into the next level); x may be a strided view."""
    from nanoserve.model import mean_square, rms_scale
    _c_row_ops_or_skip()
    gen = torch.Generator().manual_seed(n)
    wide, w = _rand_bf16(gen, rows, n + 32), _rand_bf16(gen, n)
    x = wide[:, 16:16 + n]
    x[0, : n // 2] = 0.0
    assert torch.equal(kernels.rms_norm(x, w, 1e-6), rms_scale(x, mean_square(x), w, 1e-6))


@pytest.mark.parametrize("hq, hk, d", [(4, 2, 32), (8, 4, 64), (16, 8, 128), (14, 2, 64)])
@pytest.mark.parametrize("norms", [True, False], ids=["qk-norm", "rope-only"])
def test_c_qk_norm_rope_is_eagers(hq, hk, d, norms):
    """q and k as views of one qkv projection, as the attention layer passes them."""
    from nanoserve.model import RotaryEmbedding, mean_square, qk_scale_rope
    _c_row_ops_or_skip()
    gen = torch.Generator().manual_seed(hq * d)
    T = 29
    qkv = _rand_bf16(gen, T, (hq + 2 * hk) * d)
    q, k = qkv[:, :hq * d].view(T, hq, d), qkv[:, hq * d:(hq + hk) * d].view(T, hk, d)
    rope = RotaryEmbedding(d, 4096, 1e6, None)
    positions = torch.randint(0, 4096, (T,), generator=gen)
    qw, kw = (_rand_bf16(gen, d), _rand_bf16(gen, d)) if norms else (None, None)
    ms = (mean_square(q), mean_square(k)) if norms else (None, None)
    want = qk_scale_rope(q, k, *ms, positions, rope.cos, rope.sin, qw, kw, 1e-6)
    got = kernels.qk_norm_rope(q, k, positions, rope.cos, rope.sin, qw, kw, 1e-6)
    assert got[0].shape == (T, hq, d) and got[1].shape == (T, hk, d)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_c_silu_and_mul_is_eagers():
    """Every bf16 gate value (all 65536 bit patterns but NaNs) times random up
    values; bit patterns compared, as silu(-inf) is NaN."""
    from nanoserve.model import silu_and_mul
    _c_row_ops_or_skip()
    gen = torch.Generator().manual_seed(1)
    gate = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(256, 256)
    gate = torch.where(gate.isnan(), torch.zeros((), dtype=torch.bfloat16), gate)
    gate_up = torch.cat([gate, _rand_bf16(gen, 256, 256)], dim=1)
    assert torch.equal(kernels.silu_and_mul(gate_up).view(torch.int16), silu_and_mul(gate_up).view(torch.int16))


def test_c_elementwise_ops_reject_what_they_cannot_run():
    _c_row_ops_or_skip()
    with pytest.raises(ValueError, match="n % 16 == 0"):
        kernels.rms_norm(torch.randn(2, 40).bfloat16(), torch.randn(40).bfloat16(), 1e-6)
    with pytest.raises(ValueError, match="n % 16 == 0"):
        kernels.silu_and_mul(torch.randn(2, 64))  # fp32
    q = torch.randn(3, 2, 32)
    with pytest.raises(ValueError, match="bf16 q, k"):
        kernels.qk_norm_rope(q, q, torch.zeros(3, dtype=torch.long), torch.ones(8, 32), torch.ones(8, 32),
                             None, None, 1e-6)


# --------------------------------------------------------------------------- C argmax (CPU, bf16)

@pytest.mark.parametrize("width", [1, 15, 16, 17, 100, 32000])
def test_c_argmax_is_torchs_argmax(width):
    """Every row's index equals torch's fp32 argmax of the same values, with its
    rules for ties (the first), NaN (the first NaN) and rows of -inf (index 0);
    rows may sit in a wider tensor (row stride > width)."""
    _c_row_ops_or_skip()
    torch.manual_seed(width)
    wide = torch.randn(12, width + 5).bfloat16()
    x = wide[:, :width]
    x[1] = 1.0                                   # all equal: the first
    x[2] = -math.inf                             # all -inf: index 0
    x[3, width // 2] = 100.0
    x[3, -1] = 100.0                             # a tie between a lane and the ragged end
    x[4, width // 3] = math.inf
    x[5, -1] = math.nan                          # NaN in the ragged end
    x[6, width // 2] = math.nan
    x[6, -1] = math.nan                          # two NaNs: the first
    x[7] = x[7].round()                          # many ties in a few values
    x[8, :] = -math.inf
    x[8, -1] = -1e30                             # the only finite value is the last
    x[9, 0] = math.nan                           # NaN first
    x[10] = -0.0
    x[10, -1] = 0.0                              # -0 == +0: the first
    got = kernels.argmax(x, "avx512")
    assert got.dtype == torch.int64
    assert got.tolist() == x.float().argmax(dim=-1).tolist()
    assert kernels.argmax(x, "torch").tolist() == got.tolist()


def test_c_argmax_rejects_what_it_cannot_run():
    _c_row_ops_or_skip()
    with pytest.raises(ValueError, match="bf16"):
        kernels.argmax(torch.randn(2, 40), "avx512")
    with pytest.raises(ValueError, match="unit stride"):
        kernels.argmax(torch.randn(40, 2).bfloat16().t(), "avx512")


def test_unknown_backend_is_a_clear_error():
    cache = torch.randn(3, 8, 2, 32)
    with pytest.raises(ValueError, match="'triton', 'torch', 'inductor', 'avx512' or None"):
        kernels.paged_attention(torch.randn(1, 4, 32), cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                torch.ones(1, dtype=torch.int32), torch.arange(2, dtype=torch.int32),
                                1.0, backend="cuda")
