"""The CPU backend's kernels (nanoserve/cpu_kernels.py, nanoserve/cpu_backend.py)
against the float64 truth and the torch references of kernels.py.

The C kernels are built on first use; on a CPU without AVX-512 (or with no
C compiler) they cannot be, and their tests skip, saying why. The compiled
(inductor) decode attention runs wherever torch.compile does.
"""
import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from nanoserve import cpu_backend, cpu_kernels, kernels
from test_kernels import ATOL, CONFIGS, POISON, RTOL, SCENARIOS, make_batch, naive_attention

def check_attention(attend, batch):
    scale = batch[0].shape[-1] ** -0.5
    got = attend(*batch, scale)
    assert got.dtype == batch[0].dtype and got.shape == batch[0].shape
    torch.testing.assert_close(got.double(), naive_attention(*batch, scale), atol=ATOL, rtol=RTOL)


# --------------------------------------------------------------------------- compiled decode
# All-decode steps through decode attention compiled by torch.compile; steps with
# prefill chunks through the reference. One compile per shape key; each test starts
# from a reset (so it compiles, and counts, its own graphs) and checks that the
# compiled kernel itself ran (not the eager fallback).

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
    check_attention(cpu_backend.paged_attention_compiled, batch)
    # the decodes alone, straight through the compiled kernel
    query, k_cache, v_cache, block_tables, seq_lens, qsl = batch
    decodes = [i for i in range(len(seq_lens)) if qsl[i + 1] - qsl[i] == 1]
    rows = qsl[decodes].long()
    got = cpu_backend._run_compiled_decode(query[rows], k_cache, v_cache, block_tables[decodes],
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
        check_attention(cpu_backend.paged_attention_compiled, make_batch(specs, 8, 32, 4, 2, poison=POISON["torch"]))
    assert counters["stats"]["unique_graphs"] == 1


def test_compiled_decode_never_runs_out_of_recompiles():
    """More model shapes in one process than dynamo's recompile_limit (lowered to 2
    here, to compile fewer): each shape compiles once, for every backend on it, and
    none falls back to the reference (which did hung on what had run before in the
    process; the fallback warns: an error here)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    shapes = [(2, 1, 16), (4, 2, 16), (6, 2, 16)]  # (heads, kv_heads, head_dim)
    batches = [make_batch([(9, 1), (0, 1), (20, 1)], 8, d, h, kv, poison=POISON["torch"]) for h, kv, d in shapes]
    cpu_backend.compiled_decode_attention.cache_clear()  # each shape compiles here, whatever ran before
    before = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        backends = [cpu_backend.build_cpu_backend(SimpleNamespace(num_heads=h, num_kv_heads=kv, head_dim=d),
                                                  torch.float32, 8) for h, kv, d in shapes]
        with torch.inference_mode():
            # as the engine's: the caches made outside inference mode, a step's inputs in it (dynamo guards on it)
            batches = [(q.clone(), k, v, t.clone(), lens.clone(), qsl.clone()) for q, k, v, t, lens, qsl in batches]
            for _ in range(2):  # the second time round, every shape's graph is still there
                for backend, one_batch in zip(backends, batches):
                    assert "attention: inductor" in backend.name
                    check_attention(backend.paged_attention, one_batch)
    assert counters["stats"]["unique_graphs"] - before == len(shapes)


def test_compiled_decode_bf16(fresh_dynamo):
    """bf16, as the engine runs it on the CPU: within bf16 rounding of the float64 truth,
    and no further from it than the eager SDPA twin."""
    torch.manual_seed(5)
    batch = make_batch([(70, 1), (5, 1), (33, 1)], 16, 64, 8, 2, poison=POISON["torch"])
    batch = (batch[0].bfloat16(), batch[1].bfloat16(), batch[2].bfloat16(), *batch[3:])
    scale = 64 ** -0.5
    truth = naive_attention(*batch, scale)
    got = cpu_backend.paged_attention_compiled(*batch, scale)
    eager = kernels.paged_attention_torch(*batch, scale)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), truth, atol=2e-2, rtol=2e-2)
    assert (got.double() - truth).abs().max() <= (eager.double() - truth).abs().max() * 1.01


def test_compiled_decode_falls_back_at_recompile_limit(monkeypatch):
    """When dynamo will not compile another shape the decode runs eager, with a warning."""
    import torch._dynamo

    def refuse(*args):
        raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile_limit reached")
    monkeypatch.setattr(cpu_backend, "compiled_decode_attention", lambda shape_key: refuse)
    torch.manual_seed(6)
    with pytest.warns(RuntimeWarning, match="recompile limit"):
        check_attention(cpu_backend.paged_attention_compiled,
                        make_batch(SCENARIOS["decode"], 8, 32, 4, 2, poison=POISON["torch"]))


# --------------------------------------------------------------------------- C decode kernel (CPU, bf16)
# cpu_kernels.paged_attention: decodes through decode_attention, chunks through chunk_attention.

def _c_kernel_or_skip(group=2, head_dim=64):
    try:
        cpu_kernels.attention_library(group, head_dim)
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
    got = cpu_kernels.paged_attention(*batch, scale)
    assert got.dtype == torch.bfloat16 and got.shape == batch[0].shape
    torch.testing.assert_close(got.double(), truth, atol=2e-2, rtol=2e-2)
    if scenario != "decode":  # (the SDPA twin reads whole blocks, so NaN poison would reach it)
        eager = kernels.paged_attention_torch(*batch, scale)
        assert (got.double() - truth).abs().max() <= (eager.double() - truth).abs().max() * 1.01


def test_a_sliding_window_layer_runs_the_reference_in_the_compiled_decode(monkeypatch):
    """The compiled decode has no sliding window: a step where the window masks a key gets
    the torch reference's output exactly; one whose sequences all fit in the window runs as
    without it."""
    attend = cpu_backend.paged_attention_compiled
    torch.manual_seed(17)
    scale = 64 ** -0.5
    for scenario in ("decode", "mixed"):
        batch = _bf16(make_batch(SCENARIOS[scenario], 16, 64, 8, 4, poison=POISON["torch"]))
        want = kernels.paged_attention_torch(*batch, scale, 5)
        assert not torch.equal(want, kernels.paged_attention_torch(*batch, scale))
        assert torch.equal(attend(*batch, scale, 5), want)
        longest = int(batch[4].max())
        assert torch.equal(attend(*batch, scale, longest), attend(*batch, scale))
    decodes = _bf16(make_batch(SCENARIOS["decode"], 16, 64, 8, 4, poison=POISON["torch"]))
    monkeypatch.setattr(kernels, "paged_attention_torch", None)  # not called when the window masks nothing
    attend(*decodes, scale, int(decodes[4].max()))


def test_c_attention_with_a_sliding_window_runs_in_c(monkeypatch):
    """Decodes and prefill chunks both have the window in C: a mixed step where it masks keys
    never calls the torch reference, and lands within bf16 rounding of the float64 truth; a
    window no sequence outgrows gives the output without one, bit for bit."""
    _c_kernel_or_skip(2, 64)
    torch.manual_seed(17)
    scale = 64 ** -0.5
    batch = _bf16(make_batch(SCENARIOS["mixed"], 16, 64, 8, 4, poison=POISON["torch"]))
    longest = int(batch[4].max())
    without = cpu_kernels.paged_attention(*batch, scale)
    monkeypatch.setattr(kernels, "paged_attention_torch", None)
    assert torch.equal(cpu_kernels.paged_attention(*batch, scale, longest), without)
    got = cpu_kernels.paged_attention(*batch, scale, 5)
    torch.testing.assert_close(got.double(), naive_attention(*batch, scale, 5), atol=2e-2, rtol=2e-2)
    assert not torch.equal(got, without)


# Chunks of several lengths (within one query tile and across several, for every GROUP)
# over cached prefixes of several lengths, beside decodes and an idle sequence.
WINDOW_STEP = [(0, 19), (16, 7), (9, 12), (37, 1), (45, 40), (3, 1), (70, 2), (5, 0), (21, 70)]


def _poison_before_windows(k, v, tables, lens, qsl, window, bs):
    """As the block manager leaves a windowed sequence's cache: every key before its first
    query's window NaN, and the blocks wholly before it the (NaN) null block in its table."""
    tables = tables.clone()
    for i, n in enumerate(lens.tolist()):
        first = n - int(qsl[i + 1] - qsl[i])  # the position of the step's first query
        gone = max(first - window + 1, 0)
        before = torch.arange(gone)
        k[tables[i, before // bs].long(), before % bs] = float("nan")
        v[tables[i, before // bs].long(), before % bs] = float("nan")
        tables[i, :gone // bs] = 0
    return tables


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "bs{}-d{}-h{}-kv{}".format(*c))
@pytest.mark.parametrize("window", [1, 3, 5, 13, 19, 33, 60])
def test_c_chunk_attention_with_a_sliding_window(config, window):
    """A query at p sees keys p - window + 1 .. p, windows shorter and longer than the chunks
    and beginning anywhere in a block, decodes in the same step: within bf16 rounding of the
    float64 truth, with every key before a sequence's windows and the null block NaN (a key
    read there, even masked, would make the output NaN). The truth differs from the one
    without the window, so a kernel that ignored it would fail."""
    _c_kernel_or_skip(config[2] // config[3], config[1])
    torch.manual_seed(29 + CONFIGS.index(config) + window)
    query, k, v, tables, lens, qsl = _bf16(make_batch(WINDOW_STEP, *config, poison=float("nan")))
    scale, bs = config[1] ** -0.5, config[0]
    truth = naive_attention(query, k, v, tables, lens, qsl, scale, window)
    assert (truth - naive_attention(query, k, v, tables, lens, qsl, scale)).abs().max() > 0.1
    tables = _poison_before_windows(k, v, tables, lens, qsl, window, bs)
    got = cpu_kernels.paged_attention(query, k, v, tables, lens, qsl, scale, window)
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    torch.testing.assert_close(got.double(), truth, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "bs{}-d{}-h{}-kv{}".format(*c))
@pytest.mark.parametrize("window", [5, 19])
def test_c_decode_attention_with_a_sliding_window(config, window):
    """Each sequence sees its last ``window`` keys, from anywhere in a block: within bf16
    rounding of the float64 truth, with every key before the windows NaN and the blocks
    wholly before them the (NaN) null block in the tables, as the block manager leaves them."""
    _c_kernel_or_skip(config[2] // config[3], config[1])
    torch.manual_seed(23 + CONFIGS.index(config))
    query, k, v, tables, lens, qsl = _bf16(make_batch(SCENARIOS["decode"], *config, poison=float("nan")))
    scale, bs = config[1] ** -0.5, config[0]
    truth = naive_attention(query, k, v, tables, lens, qsl, scale, window)
    tables = tables.clone()
    for i, n in enumerate(lens.tolist()):
        before = torch.arange(max(n - window, 0))
        k[tables[i, before // bs].long(), before % bs] = float("nan")
        v[tables[i, before // bs].long(), before % bs] = float("nan")
        tables[i, :max(n - window, 0) // bs] = 0
    got = cpu_kernels.paged_attention(query, k, v, tables, lens, qsl, scale, window)
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    torch.testing.assert_close(got.double(), truth, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("scenario", ["decode", "mixed", "chunked"])
def test_c_attention_without_avx512_bf16(monkeypatch, scenario):
    """The dot products a CPU without AVX-512 BF16 computes with two FMAs (built here with
    -mno-avx512bf16, so that a CPU with the instruction runs the emulation too): within
    bf16 rounding of the truth, and at most a bf16 step from this CPU's own build (where
    it has the instruction; the emulation adds in the instruction's order)."""
    _c_kernel_or_skip(2, 64)
    torch.manual_seed(13)
    batch = _bf16(make_batch(SCENARIOS[scenario], 16, 64, 8, 4, poison=POISON["torch"]))
    scale = 64 ** -0.5
    native = cpu_kernels.paged_attention(*batch, scale)
    build = cpu_kernels.attention_library
    monkeypatch.setattr(cpu_kernels, "attention_library", lambda g, d: build(g, d, ("-mno-avx512bf16",)))
    emulated = cpu_kernels.paged_attention(*batch, scale)
    torch.testing.assert_close(emulated.double(), naive_attention(*batch, scale), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(emulated, native, atol=0, rtol=2 ** -7)  # at most one bf16 step apart


def test_c_decode_attention_long_contexts_and_many_sequences():
    """Many blocks per sequence (the prefetch of the next block), more tasks than
    threads, and a batch of one split across its kv heads."""
    _c_kernel_or_skip(2, 128)
    torch.manual_seed(12)
    for specs in ([(300, 1), (17, 1), (129, 1), (64, 1)] * 4, [(450, 1)]):
        batch = _bf16(make_batch(specs, 16, 128, 8, 4, poison=float("nan")))
        truth = naive_attention(*batch, 128 ** -0.5)
        got = cpu_kernels.paged_attention(*batch, 128 ** -0.5)
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
    monkeypatch.setattr(cpu_kernels, "CASCADE_MIN_SEQS", 2)   # small shapes: always take it
    monkeypatch.setattr(cpu_kernels, "CASCADE_MIN_TOKENS", 1)
    calls = []
    real = cpu_kernels.shared_prefix_blocks
    monkeypatch.setattr(cpu_kernels, "shared_prefix_blocks", lambda *a: calls.append(real(*a)) or calls[-1])
    batch = _bf16(_share_prefix(make_batch(specs, *config, poison=float("nan")), shared))
    scale = head_dim ** -0.5
    truth = naive_attention(*batch, scale)
    got = cpu_kernels.paged_attention(*batch, scale)
    assert calls == [shared]  # the cascade path ran, over exactly the shared blocks
    torch.testing.assert_close(got.double(), truth, atol=2e-2, rtol=2e-2)
    finite = (batch[0], batch[1].nan_to_num(0.0), batch[2].nan_to_num(0.0), *batch[3:])
    eager = kernels.paged_attention_torch(*finite, scale)
    assert (got.double() - truth).abs().max() <= (eager.double() - truth).abs().max() * 1.01


def test_shared_prefix_blocks():
    t = torch.tensor([[4, 5, 6, 9], [4, 5, 6, 7], [4, 5, 8, 1]], dtype=torch.int32)
    lens = torch.tensor([60, 60, 60], dtype=torch.int32)
    assert cpu_kernels.shared_prefix_blocks(t, lens, 16) == 2
    assert cpu_kernels.shared_prefix_blocks(t[:2], lens[:2], 16) == 3
    # each sequence keeps at least its last token to itself: a 48-token one shares 2 blocks at most
    assert cpu_kernels.shared_prefix_blocks(t[:2], torch.tensor([48, 60], dtype=torch.int32), 16) == 2
    t[2, 0] = 3
    assert cpu_kernels.shared_prefix_blocks(t, lens, 16) == 0


def test_c_decode_heads_per_task():
    assert cpu_kernels.heads_per_task(64, 8, 2) == 8   # many sequences: a task reads whole K/V rows
    assert cpu_kernels.heads_per_task(2, 8, 2) == 4    # few: split so each thread has two tasks
    assert cpu_kernels.heads_per_task(1, 4, 2) == 1
    assert cpu_kernels.heads_per_task(1, 6, 2) == 1
    assert cpu_kernels.heads_per_task(2, 6, 2) == 3    # only divisors of the kv heads


def test_c_store_kvcache_is_the_references():
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
    cpu_kernels.store_kvcache(key, value, *caches, slots)
    kernels.store_kvcache_torch(key, value, *want, slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    with pytest.raises(ValueError, match="bf16"):
        cpu_kernels.store_kvcache(key.float(), value.float(), *[c.float() for c in caches], slots)
    slots[0] = 6 * 8  # one past the end: an error, as the twin's index_copy_ raises, not a write
    with pytest.raises(IndexError, match="outside the cache"):
        cpu_kernels.store_kvcache(key, value, *caches, slots)


def _expf_library(tmp_path):
    """csrc/expf.h's expf16_glibc over an array, built for this test only."""
    import ctypes
    src = tmp_path / "expf_all.c"
    src.write_text('#include "expf.h"\n'
                   "void expf16_all(const float *x, float *out, int64_t n) {\n"
                   "    int64_t i = 0;\n"
                   "    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, expf16_glibc(_mm512_loadu_ps(x + i)));\n"
                   "    for (; i < n; i++) out[i] = expf(x[i]);\n"
                   "}\n")
    lib = cpu_kernels.build_library(src)
    lib.expf16_all.argtypes, lib.expf16_all.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    return lib


def test_c_softmax_exp_is_libms_expf(tmp_path):
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
    _expf_library(tmp_path).expf16_all(x.data_ptr(), got.data_ptr(), x.numel())
    want = torch.tensor([libm.expf(v) for v in x.tolist()])
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    assert same.all(), x[~same][:5].tolist()


def test_c_decode_rejects_what_it_cannot_run():
    with pytest.raises(RuntimeError, match="head_dim % 32 == 0"):
        cpu_kernels.attention_library(2, 48)
    _c_kernel_or_skip(2, 32)
    batch = make_batch(SCENARIOS["decode"], 8, 32, 4, 2, poison=POISON["torch"])
    with pytest.raises(ValueError, match="bf16"):
        cpu_kernels.paged_attention(*batch, 1.0)  # fp32
    batch = make_batch(SCENARIOS["prefill"], 8, 32, 4, 2, poison=POISON["torch"])
    with pytest.raises(ValueError, match="bf16"):
        cpu_kernels.paged_attention(*batch, 1.0)  # fp32 chunks


# --------------------------------------------------------------------------- C elementwise ops (CPU, bf16)
# Their oracle is kernels.py's torch references, bit for bit (torch.equal):
# RMSNorm's mean of squares must add in ATen's order, every bf16 intermediate
# must round where torch rounds, SiLU must carry torch's exp.

def _c_row_ops_or_skip():  # the elementwise ops, the KV store and argmax: one library
    try:
        cpu_kernels.row_ops_library()
    except RuntimeError as e:
        pytest.skip(str(e))


def _rand_bf16(gen, *shape, scale=3.0):
    return (torch.randn(*shape, generator=gen) * scale).bfloat16()


@pytest.mark.parametrize("rows, n", [(1, 64), (5, 128), (37, 512), (3, 896), (9, 1024), (4, 4096)])
def test_c_rms_norm_is_eagers(rows, n):
    """Row lengths up to 4096 take every branch of ATen's summation cascade (16
    rounds of 4 x 8 lanes fold into the next level); x may be a strided view."""
    _c_row_ops_or_skip()
    gen = torch.Generator().manual_seed(n)
    wide, w = _rand_bf16(gen, rows, n + 32), _rand_bf16(gen, n)
    x = wide[:, 16:16 + n]
    x[0, : n // 2] = 0.0
    assert torch.equal(cpu_kernels.rms_norm(x, w, 1e-6), kernels.rms_norm_torch(x, w, 1e-6))


@pytest.mark.parametrize("hq, hk, d", [(4, 2, 32), (8, 4, 64), (16, 8, 128), (14, 2, 64)])
def test_c_per_head_rms_norm_and_rotary_are_eagers(hq, hk, d):
    """q and k as views of one qkv projection, as the attention layer passes them:
    Qwen3's per-head norms, and the rotary embedding of both the views (Llama:
    no norms) and the norms' contiguous outputs."""
    from nanoserve.model import RotaryEmbedding
    _c_row_ops_or_skip()
    gen = torch.Generator().manual_seed(hq * d)
    T = 29
    qkv = _rand_bf16(gen, T, (hq + 2 * hk) * d)
    q, k = qkv[:, :hq * d].view(T, hq, d), qkv[:, hq * d:(hq + hk) * d].view(T, hk, d)
    rope = RotaryEmbedding(d, 4096, 1e6, None, kernels.TORCH)
    positions = torch.randint(0, 4096, (T,), generator=gen)
    qw, kw = _rand_bf16(gen, d), _rand_bf16(gen, d)
    normed = []
    for x, w in ((q, qw), (k, kw)):
        got, want = cpu_kernels.rms_norm(x, w, 1e-6), kernels.rms_norm_torch(x, w, 1e-6)
        assert got.shape == x.shape and torch.equal(got, want)
        normed.append(want)
    for q_in, k_in in ((q, k), tuple(normed)):
        got = cpu_kernels.rotary(q_in, k_in, positions, rope.cos, rope.sin)
        want = kernels.rotary_torch(q_in, k_in, positions, rope.cos, rope.sin)
        assert got[0].shape == (T, hq, d) and got[1].shape == (T, hk, d)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("d, r", [(128, 96), (64, 32)])
def test_c_partial_rotary_is_eagers(d, r):
    """Partial rotary (Phi-4-mini: 96 of 128 dims turn): tables r wide, the other dims copied."""
    from nanoserve.model import RotaryEmbedding
    _c_row_ops_or_skip()
    gen = torch.Generator().manual_seed(d + r)
    T, hq, hk = 19, 6, 2
    qkv = _rand_bf16(gen, T, (hq + 2 * hk) * d)
    q, k = qkv[:, :hq * d].view(T, hq, d), qkv[:, hq * d:(hq + hk) * d].view(T, hk, d)
    rope, positions = RotaryEmbedding(r, 512, 1e4, None, kernels.TORCH), torch.randint(0, 512, (T,), generator=gen)
    got = cpu_kernels.rotary(q, k, positions, rope.cos, rope.sin)
    want = kernels.rotary_torch(q, k, positions, rope.cos, rope.sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0][..., r:], q[..., r:]) and not torch.equal(got[0][..., :r], q[..., :r])
    with pytest.raises(ValueError, match="rotary dims"):  # a half that is no whole vector: inductor's then
        cpu_kernels.rotary(q, k, positions, rope.cos[:, :r - 16].contiguous(), rope.sin[:, :r - 16].contiguous())


@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])
def test_c_act_and_mul_is_eagers(op):
    """Every bf16 gate value (all 65536 bit patterns but NaNs) times random up values;
    bit patterns compared, as silu(-inf) and gelu(-inf) are NaN. Gemma's GELU is the
    C silu_and_mul over a table of torch's GELU."""
    _c_row_ops_or_skip()
    gen = torch.Generator().manual_seed(1)
    gate = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(256, 256)
    gate = torch.where(gate.isnan(), torch.zeros((), dtype=torch.bfloat16), gate)
    gate_up = torch.cat([gate, _rand_bf16(gen, 256, 256)], dim=1)
    assert torch.equal(getattr(cpu_kernels, op)(gate_up).view(torch.int16),
                       getattr(kernels, op + "_torch")(gate_up).view(torch.int16))


def test_c_row_ops_alone_or_in_a_team():
    """Small ops run on the calling thread (cpu_kernels.PARALLEL_MIN_ELEMENTS), large
    ones on torch's threads: row by row alone and all rows at once in a team, the
    same bits as eager torch."""
    from nanoserve.model import RotaryEmbedding
    _c_row_ops_or_skip()
    gen = torch.Generator().manual_seed(5)
    rows, n, heads, d = 48, 1024, 8, 128
    x, w, gate_up = _rand_bf16(gen, rows, n), _rand_bf16(gen, n), _rand_bf16(gen, rows, 2 * n)
    q, k = _rand_bf16(gen, rows, heads, d), _rand_bf16(gen, rows, heads // 2, d)
    rope, positions = RotaryEmbedding(d, 512, 1e6, None, kernels.TORCH), torch.randint(0, 512, (rows,), generator=gen)
    assert cpu_kernels._threads(x.numel()) == torch.get_num_threads() and cpu_kernels._threads(n) == 1
    ops = {"rms_norm": (lambda i: cpu_kernels.rms_norm(x[i], w, 1e-6), kernels.rms_norm_torch(x, w, 1e-6)),
           "silu_and_mul": (lambda i: cpu_kernels.silu_and_mul(gate_up[i]), kernels.silu_and_mul_torch(gate_up)),
           "rotary q": (lambda i: cpu_kernels.rotary(q[i], k[i], positions[i], rope.cos, rope.sin)[0],
                        kernels.rotary_torch(q, k, positions, rope.cos, rope.sin)[0])}
    for name, (op, want) in ops.items():
        alone = torch.cat([op(slice(i, i + 1)) for i in range(rows)])
        assert torch.equal(op(slice(None)), want) and torch.equal(alone, want), name


def test_c_elementwise_ops_reject_what_they_cannot_run():
    _c_row_ops_or_skip()
    with pytest.raises(ValueError, match="n % 16 == 0"):
        cpu_kernels.rms_norm(torch.randn(2, 40).bfloat16(), torch.randn(40).bfloat16(), 1e-6)
    with pytest.raises(ValueError, match="n % 16 == 0"):
        cpu_kernels.silu_and_mul(torch.randn(2, 64))  # fp32
    q = torch.randn(3, 2, 32)
    with pytest.raises(ValueError, match="bf16 q, k"):
        cpu_kernels.rotary(q, q, torch.zeros(3, dtype=torch.long), torch.ones(8, 32), torch.ones(8, 32))


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
    got = cpu_kernels.argmax(x)
    assert got.dtype == torch.int64
    assert got.tolist() == x.float().argmax(dim=-1).tolist()
    assert kernels.argmax_torch(x).tolist() == got.tolist()


def test_c_argmax_rejects_what_it_cannot_run():
    _c_row_ops_or_skip()
    with pytest.raises(ValueError, match="bf16"):
        cpu_kernels.argmax(torch.randn(2, 40))
    with pytest.raises(ValueError, match="unit stride"):
        cpu_kernels.argmax(torch.randn(40, 2).bfloat16().t())


# --------------------------------------------------------------------------- C linear (CPU, bf16 weights, fp32 math)
# For a CPU without bf16 matrix instructions. Its oracle is cpu_backend.linear_in_order
# (fp32 sums over k in order, from the bias), bit for bit, and the float64 truth.

def _c_linear_or_skip():
    try:
        cpu_kernels.linear_library()
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 25, 300])
@pytest.mark.parametrize("k, n", [(64, 32), (96, 70), (256, 33), (34, 1)])
def test_c_linear_sums_in_order(rows, k, n):
    """Every row count around the 12-row tile, panel tails (n not a multiple of 32),
    with and without a bias, bf16 and fp32 outputs: the in-order fp32 sums exactly,
    and within fp32 rounding of the float64 truth."""
    _c_linear_or_skip()
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x, w, b = _rand_bf16(gen, rows, k), _rand_bf16(gen, n, k), _rand_bf16(gen, n)
    for bias in (None, b):
        layer = cpu_backend.WidenedLinear(w, bias)
        assert torch.equal(layer(x), cpu_backend.linear_in_order(x, w, bias))
        wide = cpu_kernels.linear(x, layer.packed, n, layer.bias, torch.float32)
        truth = x.double() @ w.double().T + (0 if bias is None else bias.double())
        torch.testing.assert_close(wide.double(), truth, atol=1e-3, rtol=1e-5)
        assert torch.equal(wide.bfloat16(), layer(x))


def test_c_linear_rows_do_not_see_each_other():
    """A row's result is the same alone, in a batch of 300 and under any thread count
    (batch invariance), and leading dimensions pass through."""
    _c_linear_or_skip()
    gen = torch.Generator().manual_seed(3)
    x, w = _rand_bf16(gen, 300, 128), _rand_bf16(gen, 200, 128)
    layer = cpu_backend.WidenedLinear(w, None)
    batch = layer(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([layer(x[i:i + 1]) for i in (0, 11, 12, 299)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, batch[[0, 11, 12, 299]])
    assert torch.equal(layer(x.view(3, 100, 128)), batch.view(3, 100, 200))
    assert layer(x[:0]).shape == (0, 200)


def test_c_linear_rejects_what_it_cannot_run():
    _c_linear_or_skip()
    with pytest.raises(ValueError, match="K even"):
        cpu_kernels.pack_linear_weight(torch.zeros(4, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="K even"):
        cpu_kernels.pack_linear_weight(torch.zeros(4, 8))  # fp32
    packed = cpu_kernels.pack_linear_weight(torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16"):
        cpu_kernels.linear(torch.zeros(2, 8), packed, 4)  # fp32 input
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\]"):
        cpu_kernels.linear(torch.zeros(2, 6, dtype=torch.bfloat16), packed, 4)
    with pytest.raises(ValueError, match="bias padded to 32"):
        cpu_kernels.linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed, 4, torch.zeros(4))


# --------------------------------------------------------------------------- soft cap (Gemma 2)

def test_soft_capped_attention_runs_the_reference_on_the_cpu(caplog):
    """Neither the C attention nor the compiled decode soft-caps: each refuses a cap (rather than
    ignore it), so the backend picks the torch reference for a soft-capped model outright, with an
    info line and no warning, and the reference's capped attention is the float64 truth's."""
    import logging
    with pytest.raises(ValueError, match="do not soft-cap"):
        cpu_kernels.paged_attention(*make_batch([(3, 1)], 16, 32, 4, 2, poison=0.0), 1.0, None, logits_soft_cap=5.0)
    with pytest.raises(ValueError, match="does not soft-cap"):
        cpu_backend.paged_attention_compiled(*make_batch([(3, 1)], 16, 32, 4, 2, poison=0.0), 1.0,
                                             logits_soft_cap=5.0)
    cfg = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=32, attn_logit_softcapping=5.0)
    with caplog.at_level(logging.INFO, logger="nanoserve"):
        name, _, attend = cpu_backend._pick_attention(cfg, torch.bfloat16, 16)
    assert (name, attend) == ("torch", kernels.paged_attention_torch)
    assert "soft-caps the scores" in caplog.text and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    torch.manual_seed(15)
    batch = make_batch(SCENARIOS["mixed"], 16, 32, 4, 2, poison=POISON["torch"])
    batch = (batch[0] * 4, *batch[1:])
    scale = batch[0].shape[-1] ** -0.5
    got = attend(*batch, scale, None, logits_soft_cap=2.0)
    torch.testing.assert_close(got.double(), naive_attention(*batch, scale, None, 2.0), atol=ATOL, rtol=RTOL)
