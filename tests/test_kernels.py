"""Kernel tests: the torch references and the Triton kernels (kernels.TORCH,
kernels.TRITON) of store_kvcache and paged_attention against a naive dense
attention written here (per-sequence loop, explicit causal mask, softmax in
float64), on random fp32 data. The CPU backend's kernels: test_cpu_kernels.py.

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

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

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
BACKENDS = [pytest.param(kernels.TORCH, id="torch"),
            pytest.param(kernels.TRITON, id="triton", marks=triton_only)]
# Triton must never read outside the block table or past seq_len, so its caches
# are poisoned with NaN. The torch reference gathers whole blocks by design and
# masks afterwards (0 * NaN would still be NaN), so it gets a large finite poison
# that shows up in the output if it is ever given any weight.
POISON = {"torch": 1e4, "triton": float("nan")}
ATOL = RTOL = 1e-4

# (block_size, head_dim, num_heads, num_kv_heads): GQA ratios 1, 2, 3, 4, 8; head_dim 96
# (Phi-3-mini's), which the Triton tile pads to 128.
CONFIGS = [(8, 32, 4, 4), (16, 64, 4, 2), (32, 128, 8, 2), (16, 32, 8, 1), (8, 64, 6, 2), (16, 96, 6, 2)]
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


def naive_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window=None,
                    soft_cap=None, sinks=None):
    """Dense float64 attention, one sequence at a time, straight from the definition
    (with a sliding window W, a query at p sees keys p - W + 1 .. p, as transformers';
    with a soft cap c, each score s is c * tanh(s / c) before the mask, as Gemma 2's;
    with sinks, gpt-oss's, one more column of logit sinks[h] in each softmax, dropped after it)."""
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
        if sliding_window is not None:
            allowed &= pos[None, :] > q_pos[:, None] - sliding_window
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.double()[:, None, None].expand(-1, q_len, 1)
            probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def check_attention(backend: kernels.Backend, batch, sliding_window=None, **kw):
    query = batch[0]
    scale = query.shape[-1] ** -0.5
    expected = naive_attention(*batch, scale, sliding_window, kw.get("logits_soft_cap"), kw.get("sinks"))
    got = backend.paged_attention(*batch, scale, sliding_window, **kw)
    assert got.dtype == query.dtype and got.shape == query.shape
    torch.testing.assert_close(got.double(), expected, atol=ATOL, rtol=RTOL)


# --------------------------------------------------------------------------- store_kvcache

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim",
                         [(8, 2, 32), (16, 3, 64), (32, 1, 128), (8, 2, 96), (16, 1, 80), (8, 2, 576)])
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
    backend.store_kvcache(key, value, k_cache, v_cache, slots.to(DEVICE))

    k_expected, v_expected = k_before.view(-1, num_kv_heads, head_dim).clone(), \
        v_before.view(-1, num_kv_heads, head_dim).clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_expected[slot], v_expected[slot] = key[t], value[t]
    # exact: a copy, and every row not named by a valid slot is untouched
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim), k_expected)
    assert torch.equal(v_cache.view(-1, num_kv_heads, head_dim), v_expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", [64, 576])
def test_store_kvcache_writes_one_tensor_once(backend, width):
    """K and V one tensor (MLA's latent cache; 576: the released models', 512 + 64): the key is written,
    the value argument never read into it."""
    cache = torch.zeros(2, 8, 1, width, device=DEVICE)
    key = torch.randn(3, 1, width, device=DEVICE)
    backend.store_kvcache(key, torch.full_like(key, float("nan")), cache, cache, torch.tensor([5, -1, 9], device=DEVICE))
    assert torch.equal(cache.view(-1, 1, width)[[5, 9]], key[[0, 2]])
    assert cache.view(-1, width).sum(-1).ne(0).sum() == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_kvcache_all_padding_and_empty(backend):
    k_cache = torch.randn(2, 8, 1, 32, device=DEVICE)
    before = k_cache.clone()
    key = torch.randn(3, 1, 32, device=DEVICE)
    backend.store_kvcache(key, key, k_cache, k_cache, torch.full((3,), -1, device=DEVICE))
    backend.store_kvcache(key[:0], key[:0], k_cache, k_cache, torch.empty(0, dtype=torch.long, device=DEVICE))
    assert torch.equal(k_cache, before)


# --------------------------------------------------------------------------- paged_attention

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "bs{}-d{}-h{}-kv{}".format(*c))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_paged_attention(backend, config, scenario):
    torch.manual_seed(10 * CONFIGS.index(config) + list(SCENARIOS).index(scenario))
    check_attention(backend, make_batch(SCENARIOS[scenario], *config, poison=POISON[backend.name]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_after_store(backend):
    """The model's order of calls: store the step's K/V, then attend. A prefix of
    21 tokens is cached, a chunk of 10 and a decode arrive."""
    torch.manual_seed(1)
    block_size, head_dim, num_heads, num_kv_heads = 8, 32, 4, 2
    specs = [(21, 10), (13, 1)]
    query, k_cache, v_cache, block_tables, seq_lens, qsl = make_batch(
        specs, block_size, head_dim, num_heads, num_kv_heads, POISON[backend.name])
    # Take the step's tokens out of the cache, poison their slots, store them back.
    slots = []
    for i, (ctx, q_len) in enumerate(specs):
        pos = torch.arange(ctx, ctx + q_len)
        blocks = block_tables[i, pos // block_size].long().cpu()
        slots.append(blocks * block_size + pos % block_size)
    slots = torch.cat(slots).to(DEVICE)
    key = k_cache.view(-1, num_kv_heads, head_dim)[slots].clone()
    value = v_cache.view(-1, num_kv_heads, head_dim)[slots].clone()
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = POISON[backend.name]
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = POISON[backend.name]
    backend.store_kvcache(key, value, k_cache, v_cache, slots)
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
    check_attention(kernels.TRITON, batch)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", CONFIGS[1:3], ids=lambda c: "bs{}-d{}-h{}-kv{}".format(*c))
@pytest.mark.parametrize("scenario", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("window", [1, 6, 17])
def test_paged_attention_sliding_window(backend, config, scenario, window):
    """A sliding window: each query sees its last `window` positions (1: itself only),
    in decodes, prompts longer than the window, and chunks over a cached prefix."""
    torch.manual_seed(11)
    batch = make_batch(SCENARIOS[scenario], *config, POISON[backend.name])
    scale = batch[0].shape[-1] ** -0.5
    assert not torch.allclose(naive_attention(*batch, scale, window), naive_attention(*batch, scale))
    check_attention(backend, batch, window)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scenario", ["decode", "mixed"])
@pytest.mark.parametrize("window", [None, 6])
def test_paged_attention_soft_cap(backend, scenario, window):
    """Gemma 2's soft cap, cap * tanh(score / cap) before the mask and softmax: a cap of 2 bends
    the scores of these random heads (up to ~4 at scale 1/8) away from the uncapped attention."""
    torch.manual_seed(13)
    batch = make_batch(SCENARIOS[scenario], 16, 64, 4, 2, POISON[backend.name])
    query = batch[0] * 4  # sharper scores, which the cap clips
    batch = (query, *batch[1:])
    scale = query.shape[-1] ** -0.5
    capped = naive_attention(*batch, scale, window, 2.0)
    assert not torch.allclose(capped, naive_attention(*batch, scale, window), atol=1e-2)
    check_attention(backend, batch, window, logits_soft_cap=2.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scenario", ["decode", "mixed"])
@pytest.mark.parametrize("window", [None, 6])
def test_paged_attention_sinks(backend, scenario, window):
    """gpt-oss's attention sinks: a logit a head in each softmax, with no value. Sinks near the
    scores' size take a good share of the mass, so attention that ignored them would fail."""
    torch.manual_seed(15)
    batch = make_batch(SCENARIOS[scenario], 16, 64, 8, 2, POISON[backend.name])
    sinks = torch.linspace(-2.0, 3.0, 8, device=DEVICE)
    scale = batch[0].shape[-1] ** -0.5
    assert not torch.allclose(naive_attention(*batch, scale, window, sinks=sinks),
                              naive_attention(*batch, scale, window), atol=1e-2)
    check_attention(backend, batch, window, sinks=sinks)


@triton_only
@pytest.mark.parametrize("soft_cap", [None, 3.0])
def test_split_kv_sinks(monkeypatch, soft_cap):
    """Sinks in split-KV's partials: split 0 starts from the sink, the others from nothing, so
    the reduce counts it once; a sequence with an empty split too."""
    monkeypatch.setattr(kernels, "_SPLIT_KV_MIN_PARTITION", 32)
    torch.manual_seed(16)
    batch = make_batch([(200, 1), (40, 1), (129, 1)], 16, 32, 4, 1, POISON["triton"])
    assert kernels._num_kv_splits(True, 3, 1, batch[3].shape[1] * 16) > 2
    check_attention(kernels.TRITON, batch, logits_soft_cap=soft_cap, sinks=torch.tensor([-1.0, 0.5, 2.0, 4.0]))


@triton_only
def test_split_kv_soft_cap(monkeypatch):
    """The soft cap in split-KV's partials: the reduce merges capped scores' sums."""
    monkeypatch.setattr(kernels, "_SPLIT_KV_MIN_PARTITION", 32)
    torch.manual_seed(14)
    batch = make_batch([(200, 1), (40, 1), (129, 1)], 16, 32, 4, 1, POISON["triton"])
    batch = (batch[0] * 4, *batch[1:])
    assert kernels._num_kv_splits(True, 3, 1, batch[3].shape[1] * 16) > 2
    check_attention(kernels.TRITON, batch, logits_soft_cap=3.0)


@triton_only
@pytest.mark.parametrize("head_dim,window", [(96, None), (80, 70)])
def test_split_kv_padded_head(monkeypatch, head_dim, window):
    """A head_dim no power of two through split-KV's partials and reduce, with a window too:
    the padded dims are neither read (NaN poison) nor written."""
    monkeypatch.setattr(kernels, "_SPLIT_KV_MIN_PARTITION", 32)
    torch.manual_seed(12)
    batch = make_batch([(200, 1), (40, 1), (129, 1)], 16, head_dim, 4, 1, POISON["triton"])
    assert kernels._num_kv_splits(True, 3, 1, batch[3].shape[1] * 16) > 2
    check_attention(kernels.TRITON, batch, window)


@triton_only
@pytest.mark.parametrize("window", [70, 260])
def test_split_kv_long_decode_sliding_window(monkeypatch, window):
    """Split-KV partitions cover only a decode's window: the splits start at its first key."""
    monkeypatch.setattr(kernels, "_SPLIT_KV_MIN_PARTITION", 32)
    torch.manual_seed(5)
    batch = make_batch([(300, 1), (40, 1), (129, 1)], 16, 32, 4, 1, POISON["triton"])
    assert kernels._num_kv_splits(True, 3, 1, batch[3].shape[1] * 16) > 2
    check_attention(kernels.TRITON, batch, window)


@triton_only
def test_prefill_tile_sliding_window():
    """The 128 x 64 prefill tiles with a window shorter than a tile's span of queries."""
    torch.manual_seed(9)
    batch = make_batch([(0, 300), (40, 260)], 16, 32, 4, 2, POISON["triton"])
    check_attention(kernels.TRITON, batch, 50)


@triton_only
def test_split_kv_default_thresholds():
    """With the shipped thresholds a ~1k-token decode already splits."""
    torch.manual_seed(3)
    batch = make_batch([(1100, 1)], 32, 32, 4, 1, POISON["triton"])
    assert kernels._num_kv_splits(True, 1, 1, batch[3].shape[1] * 32) >= 2
    check_attention(kernels.TRITON, batch)


def test_split_kv_heuristic():
    """Split until ~1024 programs, never below 512-token partitions, never for
    prefill (the thresholds benchmarks/triton_gpu.py measured on an H200), and
    only into a power of two (the variants warm-up compiles)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    assert kernels._num_kv_splits(True, 64, 8, 16384) == 2      # 512 programs -> 1024
    assert kernels._num_kv_splits(True, 16, 8, 4096) == 8       # capped by 4096 // 512
    assert kernels._num_kv_splits(True, 16, 8, 3000) == 4       # 5 partitions fit: the power of 2 below
    assert kernels._num_kv_splits(True, 24, 8, 16384) == 8      # 6 wanted: the power of 2 above
    assert kernels._num_kv_splits(True, 1, 8, 16384) == 32      # capped by _SPLIT_KV_MAX_SPLITS
    assert kernels._num_kv_splits(True, 256, 8, 16384) == 1     # 2048 programs already
    assert kernels._num_kv_splits(True, 4, 2, 300) == 1         # too short to split
    assert kernels._num_kv_splits(False, 1, 8, 16384) == 1      # a prefill chunk in the batch
    counts = {kernels._num_kv_splits(True, n, h, c) for n in range(1, 300) for h in (1, 2, 8) for c in (1, 700, 5000, 40960)}
    assert counts == {1, 2, 4, 8, 16, 32}


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
    for all_decodes in (True, False):  # MLA's 512-wide latent: 16 rows, 16 of its 128 heads a program
        assert kernels._tile_shape(all_decodes, 8192, 8, 512, 128) == (16, 32)
    assert kernels._tile_heads(16, 128) == 16 and kernels._tile_heads(16, 4) == 4 and kernels._tile_heads(32, 32) == 32


@triton_only
def test_prefill_tile_long_prompt():
    """A batch whose sequences average >= 256 tokens takes the 128 x 64 tiles."""
    torch.manual_seed(8)
    specs = [(0, 300), (40, 260)]
    batch = make_batch(specs, 16, 32, 4, 2, POISON["triton"])
    assert kernels._tile_shape(False, 560, 2, 32, 2) == (128, 64)
    check_attention(kernels.TRITON, batch)


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
                                    block_q=8, num_splits=num_splits, block_n=8, min_partition=8)
    torch.testing.assert_close(got.double(), naive_attention(*batch, scale), atol=ATOL, rtol=RTOL)


@triton_only
def test_triton_warm_up_runs_every_variant_and_writes_no_kv():
    """The backend's warm-up launches each tile and split count (here run by the
    interpreter) on one token of block 0, and leaves the KV cache as it was."""
    torch.manual_seed(5)
    k_cache, v_cache = (torch.randn(3, 8, 2, 32, device=DEVICE) for _ in range(2))
    before = k_cache.clone(), v_cache.clone()
    kernels.TRITON.warm_up(4, k_cache, v_cache, 4096)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    kernels.TORCH.warm_up(4, k_cache, v_cache, 4096)  # the references compile nothing


@triton_only
@pytest.mark.parametrize("num_splits", [2, 8])
def test_split_kv_splits_each_context_of_a_graph_wide_table(num_splits):
    """A captured graph's block tables span max_model_len; each sequence still
    splits its own context (short ones into fewer, minimum-size partitions),
    and the poisoned blocks past every context are never read."""
    torch.manual_seed(6)
    batch = list(make_batch([(95, 1), (1, 1), (30, 1), (63, 1)], 8, 32, 4, 2, POISON["triton"]))
    width = 64  # 512 tokens of table, most of it block 0
    batch[3] = torch.cat([batch[3], batch[3].new_zeros(4, width - batch[3].shape[1])], 1)
    query = batch[0]
    scale = query.shape[-1] ** -0.5
    got = kernels._launch_attention(*batch, scale, torch.empty_like(query), block_m=16, block_q=8,
                                    num_splits=num_splits, block_n=8, min_partition=16)
    torch.testing.assert_close(got.double(), naive_attention(*batch, scale), atol=ATOL, rtol=RTOL)


# --------------------------------------------------------------------------- MLA's latent: V narrower than K

def make_latent_batch(specs, latent, rope, num_heads, poison):
    """make_batch's paged cache as MLA's one tensor of latent + rope dims (one KV head), and V its first
    ``latent`` dims, a view (MLAAttention's attention_caches)."""
    query, cache, _, *rest = make_batch(specs, 16, latent + rope, num_heads, 1, poison)
    return (query, cache, cache[..., :latent], *rest)


def latent_reference(batch):
    """kernels.paged_attention_torch over the one tensor as both K and V (its poison made finite: the
    reference gathers whole blocks), the output's first latent dims: attention in MLA's absorbed form."""
    query, cache, v_cache, *rest = batch
    cache = torch.nan_to_num(cache, nan=POISON["torch"])
    out = kernels.paged_attention_torch(query, cache, cache, *rest, query.shape[-1] ** -0.5)
    return out[..., :v_cache.shape[-1]]


def check_latent(backend, batch, v_apart=False):
    """v_apart: V a tensor of its own, the latent's first dims times -0.5 (so the output is the latent
    output times -0.5): the kernel must read it, not K's tile."""
    query, cache, v_cache, *rest = batch
    v_cache = (v_cache * -0.5) if v_apart else v_cache
    got = backend.paged_attention(query, cache, v_cache, *rest, query.shape[-1] ** -0.5)
    assert got.shape == (*query.shape[:2], v_cache.shape[-1])
    torch.testing.assert_close(got, latent_reference(batch) * (-0.5 if v_apart else 1), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scenario", ["decode", "chunked", "mixed"])
@pytest.mark.parametrize("v_apart", [False, True], ids=["v-in-k", "v-apart"])
def test_latent_attention_splits_main_and_rope(backend, scenario, v_apart):
    """A 32 + 16 latent (the released 512 + 64's shape, small): scores over all 48 dims, values and
    output the first 32 (Triton: two dots, 32 and 16 padded to tl.dot's 16), in decodes and chunks;
    V a view of K's first dims (Triton's ONE_CACHE: the K tile serves as V) or a tensor of its own."""
    torch.manual_seed(20)
    batch = make_latent_batch(SCENARIOS[scenario], 32, 16, 4, POISON[backend.name])
    assert kernels.value_in_key(batch[1], batch[2]) and not kernels.value_in_key(batch[1], batch[2] * 1)
    check_latent(backend, batch, v_apart)


@triton_only
def test_latent_attention_split_kv_and_head_blocks(monkeypatch):
    """Split-KV's partials and reduce at V's width; and a group of 6 heads in blocks of 4 (as 128 heads
    take blocks of 16 on the 512-wide latent), the second block half empty, in a decode and a chunk."""
    monkeypatch.setattr(kernels, "_SPLIT_KV_MIN_PARTITION", 32)
    torch.manual_seed(21)
    batch = make_latent_batch([(200, 1), (40, 1), (129, 1)], 32, 16, 4, POISON["triton"])
    assert kernels._num_kv_splits(True, 3, 1, batch[3].shape[1] * 16) > 2
    check_latent(kernels.TRITON, batch)
    batch = make_latent_batch([(12, 1), (20, 9)], 32, 16, 6, POISON["triton"])
    query = batch[0]
    got = kernels._launch_attention(*batch, query.shape[-1] ** -0.5, query.new_empty(10, 6, 32), block_m=16,
                                    block_q=4, num_splits=2, block_n=16, min_partition=16, heads=4)
    torch.testing.assert_close(got, latent_reference(batch), atol=ATOL, rtol=RTOL)


@triton_only
def test_latent_attention_at_the_released_models_512_plus_64():
    """DeepSeek-V2/V3's 576-wide latent, 32 heads (two blocks of 16 in a 16 x 32 tile), a decode beside a
    chunk over a cached prefix, and a decode whose context splits: the reference's latent output."""
    torch.manual_seed(22)
    batch = make_latent_batch([(20, 1), (9, 3)], 512, 64, 32, POISON["triton"])
    assert kernels._tile_shape(False, 4, 2, 512, 32) == (16, 32) and kernels._tile_heads(16, 32) == 16
    check_latent(kernels.TRITON, batch)
    query = batch[0]
    got = kernels._launch_attention(*batch[:1], *batch[1:], query.shape[-1] ** -0.5, query.new_empty(4, 32, 512),
                                    block_m=16, block_q=1, num_splits=2, min_partition=16)
    torch.testing.assert_close(got, latent_reference(batch), atol=ATOL, rtol=RTOL)


@triton_only
def test_latent_warm_up_and_probe_take_the_576_latent():
    """The warm-up compiles the split's variants (and writes no KV); probe_triton no longer refuses a
    released model's latent (kv_lora_rank 512 + qk_rope_head_dim 64), which sent it to the references."""
    from types import SimpleNamespace
    cache = torch.randn(2, 16, 1, 576, device=DEVICE)
    before = cache.clone()
    kernels.TRITON.warm_up(16, cache, cache[..., :512], 2048)
    assert torch.equal(cache, before)
    cfg = SimpleNamespace(num_heads=16, num_kv_heads=1, head_dim=576, kv_lora_rank=512, rotary_dim=64,
                          hidden_size=64, intermediate_size=64, hidden_act="silu", gemma=False, num_experts=0,
                          attn_logit_softcapping=None)
    kernels.probe_triton(cfg, torch.float32, torch.device(DEVICE), 16)
    with pytest.raises(ValueError, match=r"multiple of 8 from 16 to 256, or a larger power of two, got 576"):
        kernels.probe_triton(SimpleNamespace(**{**vars(cfg), "kv_lora_rank": 0}), torch.float32,
                             torch.device(DEVICE), 16)


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
    q = torch.randn(2, 4, 44)  # no multiple of 8
    cache = torch.randn(3, 8, 2, 44)
    seq = dict(block_tables=torch.zeros(2, 1, dtype=torch.int32),
               seq_lens=torch.ones(2, dtype=torch.int32),
               query_start_loc=torch.arange(3, dtype=torch.int32), scale=1.0)
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.paged_attention_triton(q, cache, cache, **seq)
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.store_kvcache_triton(q[:, :2], q[:, :2], cache, cache, torch.zeros(2, dtype=torch.long))
    cache = torch.randn(3, 8, 3, 32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        kernels.paged_attention_triton(torch.randn(2, 4, 32), cache, cache, **seq)
    cache = torch.randn(3, 8, 1, 48)  # V narrower than K: MLA's latent, whose rope part must be a multiple of 8
    with pytest.raises(ValueError, match="V's head_dim at most K's"):
        kernels.paged_attention_triton(torch.randn(2, 4, 32), cache[..., :32], cache, **seq)
    with pytest.raises(ValueError, match="qk_rope_head_dim.* multiple of 8 up to V's 16, got 28"):
        kernels.paged_attention_triton(torch.randn(2, 4, 44), cache[..., :44], cache[..., :16], **seq)


# --------------------------------------------------------------------------- the other references

def test_decode_reference_equals_the_chunk_reference():
    """A decode is a chunk of one token: the batched decode path of the reference
    and its per-sequence chunk path agree."""
    torch.manual_seed(9)
    query, k_cache, v_cache, block_tables, seq_lens, qsl = make_batch(SCENARIOS["decode"], 8, 32, 4, 2, 0.0)
    batched = kernels.decode_attention_torch(query, k_cache, v_cache, block_tables, seq_lens, 32 ** -0.5)
    for i, n in enumerate(seq_lens.tolist()):
        one = kernels.chunk_attention_torch(query[i:i + 1], k_cache, v_cache, block_tables[i], n, 32 ** -0.5)
        torch.testing.assert_close(batched[i:i + 1], one, atol=1e-6, rtol=1e-6)


def test_rms_norm_and_rotary_references_match_transformers():
    """The references the backends are checked against are transformers' own math."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb
    torch.manual_seed(0)
    x, w = torch.randn(5, 3, 64).bfloat16(), torch.randn(64).bfloat16()
    hf = LlamaRMSNorm(64, eps=1e-6).bfloat16()
    hf.weight.data.copy_(w)
    assert torch.equal(kernels.rms_norm_torch(x, w, 1e-6), hf(x))
    q, k = torch.randn(5, 4, 32), torch.randn(5, 2, 32)
    cos, sin, positions = torch.randn(16, 32), torch.randn(16, 32), torch.tensor([0, 3, 3, 15, 7])
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          cos[positions][None], sin[positions][None])
    got_q, got_k = kernels.rotary_torch(q, k, positions, cos, sin)
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))


def test_gemma_references_match_transformers():
    """Gemma's norm (its weight held as 1 + w, in fp32) and GELU-and-mul: transformers' bit for bit in bf16."""
    from transformers.activations import ACT2FN
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    torch.manual_seed(0)
    x, w = torch.randn(5, 3, 64).bfloat16(), torch.randn(64).bfloat16()
    hf = Gemma3RMSNorm(64, eps=1e-6).bfloat16()
    hf.weight.data.copy_(w)
    assert torch.equal(kernels.gemma_rms_norm_torch(x, w.float() + 1, 1e-6), hf(x))
    gate_up = (torch.randn(5, 128) * 3).bfloat16()
    want = ACT2FN["gelu_pytorch_tanh"](gate_up[:, :64]) * gate_up[:, 64:]
    assert torch.equal(kernels.gelu_tanh_and_mul_torch(gate_up), want)


# --------------------------------------------------------------------------- the decoder's pointwise ops

@triton_only
@pytest.mark.parametrize("heads", [None, 3])
def test_triton_gemma_rms_norm_and_fused_add(heads):
    """Gemma's norm: rows, or heads of a strided view (its q/k norms), and the residual add fused in front."""
    torch.manual_seed(23)
    T, n = 5, 48
    w = torch.randn(n, device=DEVICE) + 1
    x = torch.randn(T, (heads or 0) * n + n, device=DEVICE)
    x = x[:, :n] if heads is None else x[:, :heads * n].view(T, heads, n)
    torch.testing.assert_close(kernels.gemma_rms_norm_triton(x, w, 1e-6), kernels.gemma_rms_norm_torch(x, w, 1e-6))
    if heads is None:
        r = torch.randn(T, n, device=DEVICE)
        got = kernels.gemma_fused_add_rms_norm_triton(x, r, w, 1e-6)
        want = kernels.TORCH.gemma_fused_add_rms_norm(x, r, w, 1e-6)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])


@triton_only
@pytest.mark.parametrize("heads", [None, 3])
def test_triton_rms_norm_and_fused_add(heads):
    """Rows of a 2-D tensor or heads of a strided 3-D view (q out of a qkv
    projection), and the residual add fused in front."""
    torch.manual_seed(21)
    T, n = 5, 48  # n not a power of two: the masked tail
    w = torch.randn(n, device=DEVICE)
    if heads is None:
        x = torch.randn(T, n, device=DEVICE)
    else:
        x = torch.randn(T, (heads + 2) * n, device=DEVICE)[:, :heads * n].view(T, heads, n)
    torch.testing.assert_close(kernels.rms_norm_triton(x, w, 1e-6), kernels.rms_norm_torch(x, w, 1e-6))
    if heads is None:
        r = torch.randn(T, n, device=DEVICE)
        got, want = kernels.fused_add_rms_norm_triton(x, r, w, 1e-6), kernels.TORCH.fused_add_rms_norm(x, r, w, 1e-6)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])


@triton_only
@pytest.mark.parametrize("d,r", [(32, 32), (32, 24), (128, 96), (96, 96)],
                         ids=["full", "partial-24", "partial-96", "full-96"])
def test_triton_rotary_silu_and_gelu_and_mul(d, r):
    """r < d: partial rotary (Phi-4-mini: 96 of 128), the first r dims turn, half of r no power of two."""
    torch.manual_seed(22)
    T, hq, hk = 6, 4, 2
    qkv = torch.randn(T, (hq + 2 * hk) * d, device=DEVICE)
    q, k = qkv[:, :hq * d].view(T, hq, d), qkv[:, hq * d:(hq + hk) * d].view(T, hk, d)
    cos, sin = torch.randn(64, r, device=DEVICE), torch.randn(64, r, device=DEVICE)
    positions = torch.randint(0, 64, (T,), device=DEVICE)
    for got, want in zip(kernels.rotary_triton(q, k, positions, cos, sin),
                         kernels.rotary_torch(q, k, positions, cos, sin)):
        torch.testing.assert_close(got, want)
    gate_up = torch.randn(T, 2 * 40, device=DEVICE)
    torch.testing.assert_close(kernels.silu_and_mul_triton(gate_up), kernels.silu_and_mul_torch(gate_up))
    gate_up[0, :4] = torch.tensor([-1e4, -30.0, 30.0, 1e4])  # tanh's ends: exp over- and underflows
    torch.testing.assert_close(kernels.gelu_tanh_and_mul_triton(gate_up), kernels.gelu_tanh_and_mul_torch(gate_up))


def test_cuda_argmax_picks_the_references_index():
    # bf16 logits with ties (few distinct values): the first maximal index, as the fp32 copy's
    logits = (torch.randn(64, 1000, generator=torch.Generator().manual_seed(3)) * 4).round().bfloat16()
    assert (logits == logits.amax(-1, keepdim=True)).sum(-1).gt(1).any()  # ties do occur
    assert torch.equal(kernels.argmax_cuda(logits.to(DEVICE)).cpu(), kernels.argmax_torch(logits))


@triton_only
@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_a_decoder_on_the_triton_backend_matches_the_references(model_root, arch):
    """The whole forward (prefill, then a decode of each prompt) with every op
    from kernels.TRITON gives kernels.TORCH's logits (fp32, the interpreter);
    Gemma 2: its soft caps, and a 20-token prompt past its 16-token window;
    Qwen2-MoE: fused_moe_triton as its sparse layer calls it (router, shared expert, a dense layer beside);
    DeepSeek-V3: MLA's MQA over one latent cache tensor, written once;
    gpt-oss: attention sinks, and its experts (biases, clamped SwiGLU) through fused_moe_triton."""
    from conftest import make_model, step_logits
    from nanoserve.kvcache import KVCacheSpec, allocate_kv_cache
    from nanoserve.model import ModelConfig, ModelRunner, SeqInput, load_model
    tiny_model = make_model(model_root, arch)
    cfg = ModelConfig.from_dir(tiny_model)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 300, (n,), generator=gen).tolist() for n in (9, 20)]
    logits = []
    for backend in (kernels.TORCH, kernels.TRITON):
        model, _ = load_model(tiny_model, torch.float32, torch.device(DEVICE), backend)
        spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, 16, bool(cfg.kv_lora_rank))
        runner = ModelRunner(model, allocate_kv_cache(spec, 8, torch.device(DEVICE)), 16, torch.device(DEVICE),
                             backend)
        tables = [[1, 2], [3, 4]]
        logits.append([step_logits(runner, step) for step in (
            [SeqInput(p, 0, t, None) for p, t in zip(prompts, tables)],
            [SeqInput([7], len(p), t, None) for p, t in zip(prompts, tables)])])
    for a, b in zip(*logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("T,E,k", [(1, 4, 2), (7, 8, 2), (5, 3, 3)])
def test_fused_moe_reference_is_each_tokens_weighted_experts(T, E, k):
    """The seam's MoE op against the definition, token by token: every chosen
    expert's gated MLP, weighted by its routing weight; unchosen experts add nothing."""
    g = torch.Generator().manual_seed(T * 100 + E)
    H, I = 16, 24
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    topk_weights = torch.rand(T, k, generator=g)
    want = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            e = int(topk_ids[t, j])
            gate, up = (w13[e] @ x[t]).split(I)
            want[t] += topk_weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    got = kernels.fused_moe_torch(x, w13, w2, topk_weights, topk_ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_the_mlp_s_activation_is_chosen_in_one_place(tiny_model, act):
    """kernels.act_and_mul_name decides the gated MLP's activation; the MLP takes that op of its backend
    (probe_triton and the CPU backend's GELU pick read the same name)."""
    import dataclasses

    from nanoserve.model import MLP, ModelConfig, TPGroup
    cfg = dataclasses.replace(ModelConfig.from_dir(tiny_model), hidden_act=act)
    name = kernels.act_and_mul_name(cfg)
    assert name == {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul"}[act]
    assert MLP(cfg, kernels.TORCH, TPGroup()).act_and_mul is getattr(kernels.TORCH, name)


# --------------------------------------------------------------------------- fused MoE (Triton)

def moe_case(T, E, k, H, I, routing="random", seed=0, ids_dtype=torch.int64):
    """x, w13, w2, topk_weights, topk_ids of a tiny MoE layer. Routings: "random" (k distinct
    experts a token), "skewed" (only the first k + 1 experts are ever chosen), "same" (every
    token chooses experts 0 .. k - 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * H ** -0.5, torch.randn(E, H, I, generator=g) * I ** -0.5
    chosen_from = {"random": E, "skewed": min(k + 1, E), "same": k}[routing]
    ids = torch.stack([torch.randperm(chosen_from, generator=g)[:k] for _ in range(T)])
    if routing == "same":
        ids = ids.sort(dim=1).values
    return x, w13, w2, torch.rand(T, k, generator=g), ids.to(ids_dtype)


class RecordedKernel:
    """Stands in for a Triton kernel: records each launch's grid and constants, runs nothing."""

    def __init__(self, name, launches):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **constants: self.launches.append((self.name, tuple(grid), constants))


def record_moe_launches(monkeypatch) -> list:
    launches = []
    for name in ("_fused_moe_kernel", "_silu_and_mul_kernel"):
        monkeypatch.setattr(kernels, name, RecordedKernel(name, launches))
    return launches


class NoHostSync(TorchDispatchMode):
    """Fails on each aten op that reads a tensor's data on the host or sizes its output by
    the data (each a device sync on CUDA, which a CUDA graph's capture refuses). .tolist()
    and .numpy() read the data without an aten op: they are patched to fail too."""
    SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "bincount", "unique_consecutive", "_unique",
             "_unique2", "unique_dim", "repeat_interleave", "histc"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        bool_index = name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1])
        if name in self.SYNCS or bool_index:
            raise AssertionError(f"{func} syncs with the host")
        return func(*args, **(kwargs or {}))


def no_host_sync(monkeypatch):
    def refuse(self, *args, **kwargs):
        raise AssertionError("a tensor's data was read on the host")
    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    monkeypatch.setattr(torch.Tensor, "numpy", refuse)
    return NoHostSync()


@triton_only
@pytest.mark.parametrize("T,E,k,H,I,routing", [
    (1, 4, 2, 16, 24, "random"),     # one token (a decode)
    (7, 8, 2, 40, 20, "skewed"),     # experts nobody chose; H, I not multiples of the tiles
    (5, 3, 3, 16, 16, "random"),     # every expert chosen by every token
    (20, 6, 2, 24, 16, "same"),      # every token on the same 2 experts: each group spans 2 blocks
    (13, 5, 1, 16, 40, "random"),    # k = 1
    (70, 2, 2, 32, 48, "random"),    # 140 pairs over 2 experts: 64-row tiles, the last partly padding
], ids=["T1", "unchosen", "all-experts", "same-experts", "k1", "block64"])
def test_fused_moe_triton_equals_the_reference(T, E, k, H, I, routing):
    x, w13, w2, topk_weights, topk_ids = moe_case(T, E, k, H, I, routing, ids_dtype=torch.int32)
    got = kernels.fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    want = kernels.fused_moe_torch(x, w13, w2, topk_weights, topk_ids)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("T,E,k,block_m,routing", [
    (1, 4, 2, 16, "random"), (7, 8, 2, 16, "skewed"), (9, 6, 2, 4, "same"), (50, 3, 2, 16, "random"),
    (70, 2, 2, 64, "random")])
def test_moe_align_block_size_pads_each_experts_group(T, E, k, block_m, routing):
    """Every (token, choice) pair appears once, in its expert's group of whole blocks, the
    groups in expert order; padding (T * k) only at a group's end; blocks past the last
    group marked -1 and all padding; the buffers' shapes depend on T, k, E alone."""
    ids = moe_case(T, E, k, 16, 16, routing)[4]
    sorted_ids, expert_ids = kernels.moe_align_block_size(ids, E, block_m)
    n = T * k
    max_blocks = min(n, -(-(n + E * (block_m - 1)) // block_m))
    assert sorted_ids.shape == (max_blocks * block_m,) and expert_ids.shape == (max_blocks,)
    assert sorted(sorted_ids[sorted_ids < n].tolist()) == list(range(n))
    assert ((sorted_ids < n) | (sorted_ids == n)).all()
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    used = expert_ids[expert_ids >= 0]
    assert used.tolist() == sorted(used.tolist()) and (expert_ids[len(used):] == -1).all()
    for e in range(E):
        assert (used == e).sum() == -(-int(counts[e]) // block_m)
    blocks = sorted_ids.view(max_blocks, block_m)
    assert (blocks[len(used):] == n).all()
    flat = torch.cat([ids.reshape(-1), torch.tensor([-1])])  # the padding's "expert"
    for b, e in enumerate(used.tolist()):
        real = blocks[b] < n
        assert real[0] and (flat[blocks[b][real]] == e).all()
        assert real.tolist() == sorted(real.tolist(), reverse=True)  # padding last


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fused_moe_triton_never_syncs_and_launches_the_same_grid_for_any_routing(monkeypatch):
    """What a CUDA graph needs (checked here on the CPU, kernels recorded rather than run): no
    op reads the routing on the host, and the launches (grids, tiles) and the output follow
    from (T, k, E) alone, so that one captured graph serves every routing. The guard itself
    is checked on the reference, which reads the routing on the host."""
    launches = record_moe_launches(monkeypatch)
    guard = no_host_sync(monkeypatch)
    seen = []
    for T, E, k in [(1, 4, 2), (70, 2, 2), (33, 16, 4)]:
        for routing in ("random", "same", "skewed"):
            launches.clear()
            case = moe_case(T, E, k, 16, 24, routing)
            with guard:
                out = kernels.fused_moe_triton(*case)
            assert out.shape == (T, 16)
            seen.append(((T, E, k), [(name, grid, sorted(c.items())) for name, grid, c in launches]))
        assert seen[-1] == seen[-2] == seen[-3] and len(seen[-1][1]) == 3
    assert seen[0][1] != seen[-1][1]
    with pytest.raises(AssertionError, match="host"), guard:
        kernels.fused_moe_torch(*moe_case(3, 4, 2, 16, 24))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fused_moe_warm_up_launches_both_tiles(monkeypatch):
    launches = record_moe_launches(monkeypatch)
    _, w13, w2, _, _ = moe_case(1, 6, 2, 16, 24)
    kernels.warm_up_fused_moe_triton(w13, w2, top_k=2)
    tiles = {(c["BLOCK_M"], c["MUL_ROUTED_WEIGHT"]) for name, _, c in launches if name == "_fused_moe_kernel"}
    assert tiles == {(16, False), (16, True), (64, False), (64, True)}


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fused_moe_warm_up_compiles_the_variants_a_bf16_model_launches(monkeypatch):
    """Triton compiles a variant per pointer dtype as well as per constant: the launches of a bf16
    model's steps, its routing weights fp32 (Mixtral's) or bf16 (Qwen's), both tiles, are the ones
    warm-up launched, so that no long prefill compiles in the middle of traffic."""
    launches = []

    class Recorded:
        def __getitem__(self, grid):
            return lambda *args, **constants: launches.append(
                (tuple(a.dtype for a in args if isinstance(a, torch.Tensor)), tuple(sorted(constants.items()))))
    monkeypatch.setattr(kernels, "_fused_moe_kernel", Recorded())
    monkeypatch.setattr(kernels, "_silu_and_mul_kernel", RecordedKernel("silu", []))
    _, w13, w2, _, _ = moe_case(1, 4, 2, 16, 24)
    w13, w2 = w13.bfloat16(), w2.bfloat16()
    kernels.warm_up_fused_moe_triton(w13, w2, top_k=2)
    warm = set(launches)
    for weights_dtype in (torch.float32, torch.bfloat16):
        for T in (1, 130):  # the 16-row tile and the 64-row one
            launches.clear()
            x, _, _, topk_weights, topk_ids = moe_case(T, 4, 2, 16, 24)
            kernels.fused_moe_triton(x.bfloat16(), w13, w2, topk_weights.to(weights_dtype), topk_ids)
            assert len(launches) == 2 and set(launches) <= warm, (weights_dtype, T)


@triton_only
def test_fused_moe_triton_bad_shapes_raise_and_no_tokens():
    x, w13, w2, topk_weights, topk_ids = moe_case(3, 4, 2, 16, 24)
    for bad in [(x[None], w13, w2), (x, w13[:, :-1], w2), (x, w13, w2[:, :-1]), (x, w13[:-1], w2)]:
        with pytest.raises(ValueError, match="w13"):
            kernels.fused_moe_triton(*bad, topk_weights, topk_ids)
    with pytest.raises(ValueError, match="topk_ids"):
        kernels.fused_moe_triton(x, w13, w2, topk_weights[:, :1], topk_ids)
    with pytest.raises(ValueError, match="dtype"):
        kernels.fused_moe_triton(x, w13.double(), w2, topk_weights, topk_ids)
    assert kernels.fused_moe_triton(x[:0], w13, w2, topk_weights[:0], topk_ids[:0]).shape == (0, 16)
    assert not kernels.fused_moe_triton(x, w13, w2, topk_weights[:, :0], topk_ids[:, :0]).any()


# TRITON_INTERPRET=1 copies every kernel argument to the host, which graph capture forbids:
# run on a GPU with TRITON_INTERPRET=0 (benchmarks/gpu.py's cuda_tests part does).
cuda_only = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                               reason="needs a GPU and compiled Triton (TRITON_INTERPRET=0)")


@cuda_only
def test_fused_moe_triton_on_cuda_in_bf16_and_graph_replay():
    """The compiled kernel in bf16 at a Qwen3-30B-A3B layer's widths (128 experts, 8 a token):
    no further from the fp32 reference than torch's bf16 reference is (twice, in norm), at
    both tiles; then captured in a CUDA graph and replayed on other routings and inputs,
    each replay equal to an eager call (the graph baked in no routing)."""
    E, H, I = 128, 2048, 768
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5
    w2 = torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5
    check_fused_moe_on_cuda(w13.bfloat16(), w2.bfloat16(), 8, g, (1, 7, 64, 1100))  # 1100 * 8 >= 64 * 128


@cuda_only
def test_gpt_oss_fused_moe_triton_on_cuda_in_bf16_and_graph_replay():
    """The same at gpt-oss-20b's widths (32 experts, 4 a token, H = I = 2880) as GptOssExperts calls it:
    transformers' [E, H, 2I] and [E, I, H] read transposed, biases, swigluoai with its limit reached."""
    E, H, I = 32, 2880, 2880
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(E, H, 2 * I, device="cuda", generator=g) * 3 * H ** -0.5).bfloat16()
    down = (torch.randn(E, I, H, device="cuda", generator=g) * I ** -0.5).bfloat16()
    biases = dict(w13_bias=torch.randn(E, 2 * I, device="cuda", generator=g).bfloat16(),
                  w2_bias=torch.randn(E, H, device="cuda", generator=g).bfloat16())
    check_fused_moe_on_cuda(gate_up.transpose(1, 2), down.transpose(1, 2), 4, g, (1, 7, 64, 600),  # 600 * 4 >= 64 * 32
                            **biases, activation="swigluoai", swiglu_alpha=1.702, swiglu_limit=7.0)


def check_fused_moe_on_cuda(w13, w2, k, g, token_counts, **moe_kwargs) -> None:
    """fused_moe_triton on bf16 weights (and moe_kwargs' biases and activation): within twice torch's
    bf16 reference's error (in norm) of the fp32 reference at each token count and routing; then a
    batch of 8 captured and replayed on other routings and inputs, each replay equal to an eager call."""
    dev, dt, (E, H) = w13.device, w13.dtype, (w13.shape[0], w13.shape[2])
    fp32_kwargs = {name: v.float() if isinstance(v, torch.Tensor) else v for name, v in moe_kwargs.items()}

    def inputs(T, routing):
        ids = torch.arange(k, device=dev).expand(T, k) if routing == "same" else \
            torch.rand(T, E, device=dev, generator=g).topk(k).indices
        weights = torch.rand(T, k, device=dev, generator=g).softmax(-1)
        return torch.randn(T, H, device=dev, generator=g).to(dt), weights, ids.to(torch.int32)

    def error(out, want):
        return float((out.float() - want).norm() / want.norm())

    for T in token_counts:
        for routing in ("random", "same"):
            x, weights, ids = inputs(T, routing)
            want = kernels.fused_moe_torch(x.float(), w13.float(), w2.float(), weights, ids, **fp32_kwargs)
            bf16 = error(kernels.fused_moe_torch(x, w13, w2, weights, ids, **moe_kwargs), want)
            got = error(kernels.fused_moe_triton(x, w13, w2, weights, ids, **moe_kwargs), want)
            assert got <= max(2 * bf16, 1e-3), (T, routing, got, bf16)

    x, weights, ids = inputs(8, "random")
    side = torch.cuda.Stream()  # warm up (compile) off the capture, as torch.cuda.graph's docs do
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kernels.fused_moe_triton(x, w13, w2, weights, ids, **moe_kwargs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.fused_moe_triton(x, w13, w2, weights, ids, **moe_kwargs)
    for routing in ("same", "random", "same"):
        for buf, new in zip((x, weights, ids), inputs(8, routing)):
            buf.copy_(new)
        graph.replay()
        eager = kernels.fused_moe_triton(x, w13, w2, weights, ids, **moe_kwargs)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)


@cuda_only
@pytest.mark.parametrize("heads", [16, 128])
def test_latent_attention_on_cuda_in_bf16_and_graph_replay(heads):
    """The compiled MLA attention at the released models' 512 + 64 latent (V2-Lite's 16 heads, V3's 128 in
    head blocks of 16), bf16: no further from the fp32 reference than torch's bf16 reference is (twice, in
    norm), decodes (split-KV) and a mixed step; then a decode step (store, attention) captured in a CUDA
    graph with a max_model_len-wide table and replayed on other contexts, each replay equal to an eager call."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    num_blocks, bs, width = 300, 16, 256
    cache = torch.randn(num_blocks, bs, 1, 576, device=dev, generator=g).to(dt)
    # 4096 tokens a row (blocks shared between rows, as a prefix's are), each row's first block its own
    table = torch.randint(5, num_blocks, (4, width), device=dev, generator=g, dtype=torch.int32)
    table[:, 0] = torch.arange(1, 5, device=dev)

    def step(seq_lens, q_lens):
        qsl = torch.tensor([0, *q_lens], device=dev).cumsum(0).to(torch.int32)
        query = torch.randn(int(qsl[-1]), heads, 576, device=dev, generator=g).to(dt)
        return query, cache, cache[..., :512], table[:len(seq_lens)], torch.tensor(seq_lens, dtype=torch.int32,
                                                                                  device=dev), qsl

    def error(out, want):
        return float((out.float() - want).norm() / want.norm())

    for seq_lens, q_lens in (([1200, 40, 700, 1], [1, 1, 1, 1]), ([300, 50, 9], [1, 50, 3])):
        batch = step(seq_lens, q_lens)
        want = kernels.paged_attention_torch(batch[0].float(), cache.float(), cache[..., :512].float(), *batch[3:],
                                             0.07)
        bf16 = error(kernels.paged_attention_torch(*batch, 0.07), want)
        assert error(kernels.paged_attention_triton(*batch, 0.07), want) <= max(2 * bf16, 1e-3)

    query, _, _, tables, seq_lens, qsl = step([1200, 40, 700, 1], [1, 1, 1, 1])
    kv = torch.randn(4, 1, 576, device=dev, generator=g).to(dt)
    slots = torch.zeros(4, dtype=torch.int64, device=dev)

    def decode():
        kernels.store_kvcache_triton(kv, kv, cache, cache, slots)
        return kernels.paged_attention_triton(query, cache, cache[..., :512], tables, seq_lens, qsl, 0.07)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode()
    for lens in ([5, 4000, 33, 2], [1200, 40, 700, 1]):
        seq_lens.copy_(torch.tensor(lens, device=dev))
        slots.copy_(tables[:, 0].long() * bs + 1)  # position 1 of each sequence's first block
        for buf in (query, kv):
            buf.copy_(torch.randn(buf.shape, device=dev, generator=g))
        graph.replay()
        torch.testing.assert_close(out, decode(), rtol=0, atol=0)
