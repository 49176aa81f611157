"""Kernels layer: the attention kernels, in Triton and in pure torch.

This module owns these functions and nothing else (no state):

* ``store_kvcache`` writes the step's new K and V into the paged KV cache at
  ``slot_mapping`` (a slot of -1 is padding and is skipped);
* ``paged_attention`` is one unified kernel for prefill chunks and decodes:
  query token ``j`` of a sequence whose step has ``q_len`` tokens sits at
  position ``seq_len - q_len + j`` and attends to positions ``0 .. that`` through
  the sequence's block table (causal inside the chunk, full over the prefix).
* ``argmax`` is greedy sampling's argmax over each row of logits (on the CPU
  in bf16, a small C kernel; elsewhere torch's argmax).
* ``rms_norm``, ``qk_norm_rope`` and ``silu_and_mul`` are C kernels (CPU, bf16)
  of the decoder layer's elementwise ops; their oracle, bit for bit, is
  model.py's eager torch code, which runs wherever they do not.

The first two each have a Triton kernel and a pure-torch twin that computes the same function.
The twin is the test oracle and the CPU execution path; the Triton kernels run
on CUDA tensors (and on the CPU under ``TRITON_INTERPRET=1`` in the tests).
``backend=None`` is the one dispatch point: Triton for CUDA tensors, torch else.
``backend="inductor"`` is the torch twin with its decode attention compiled by
``torch.compile``; ``backend="avx512"`` runs decodes, prefill chunks and the KV
writes through small C kernels (bf16, a CPU with AVX-512 BF16; cascade attention for decodes that
share a prefix), built on first use. On the CPU the engine takes
the C kernel where it builds, else the compiled twin; ``enforce_eager`` turns both off.

Shapes (vLLM's names):
  query            [num_tokens, num_heads, head_dim]
  k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
  block_tables     int32 [num_seqs, max_blocks]
  seq_lens         int32 [num_seqs]      context length after this step
  query_start_loc  int32 [num_seqs + 1]  where each sequence's tokens start in query
  slot_mapping     int64 [num_tokens]    block_id * block_size + offset, -1 = skip
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

try:  # Triton is optional on a CPU-only install; the torch twins always work.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None


def _pick(backend: str | None, t: torch.Tensor) -> str:
    if backend is None:
        return "triton" if t.is_cuda and triton is not None else "torch"
    if backend not in ("triton", "torch", "inductor", "avx512"):
        raise ValueError(f"backend must be 'triton', 'torch', 'inductor', 'avx512' or None, "
                         f"got {backend!r}")
    if backend == "triton" and triton is None:
        raise RuntimeError("backend='triton' needs the triton package (pip install triton)")
    return backend


# --------------------------------------------------------------------------- torch twins

def store_kvcache_torch(key, value, k_cache, v_cache, slot_mapping) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    k_flat.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[..., n_blocks] block ids -> [..., n_blocks * block_size, kv_heads, head_dim].
    One index_select over the flattened table: markedly cheaper on the CPU than
    advanced indexing of a 2-D table."""
    blocks = cache.index_select(0, block_table.reshape(-1).long())
    return blocks.view(*block_table.shape[:-1], -1, *cache.shape[2:])


def paged_attention_torch(query, k_cache, v_cache, block_tables, seq_lens,
                          query_start_loc, scale, decode_kernel: str | None = None) -> torch.Tensor:
    """Reference paged attention. Decodes (q_len == 1) run as a few batched SDPA
    calls over contexts padded within length buckets, or as one call of a
    ``decode_kernel``: "inductor" (the compiled _decode_attention_fused) or
    "avx512" (the C kernel, _run_c_decode, which takes the multi-token chunks
    too); otherwise each multi-token chunk runs through SDPA on its own. The
    Python loop is per bucket or chunk, never per token."""
    if decode_kernel == "avx512":
        query = query.contiguous()  # the C kernel indexes rows directly
        if torch.equal(query_start_loc, torch.arange(len(seq_lens) + 1, dtype=query_start_loc.dtype)):
            # every q_len is 1, row i is sequence i: one C call over the batch as it
            # stands, without the per-layer regrouping below (W0's decode step: ~0.2
            # ms a layer of Python and small tensor ops)
            return _run_c_decode(query, k_cache, v_cache, block_tables, seq_lens, scale)
    out = torch.empty_like(query)
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    # A decode kernel takes every decode in one call: each extra call costs
    # ~0.1 ms per layer, more than its padding saves (W0's decode step of 8
    # sequences: 13.8 ms with length buckets, 12.2 ms without; no change at 64).
    for bucket in _length_buckets(decodes, lens, max_buckets=1 if decode_kernel else 4):
        _decode_attention(query, k_cache, v_cache, block_tables, starts, lens,
                          bucket, scale, block_size, out, decode_kernel)
    if decode_kernel == "avx512" and any(n > 1 for n in q_lens):  # the C kernel takes them all at once
        _run_c_chunks(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out)
        return out
    for i, q_len in enumerate(q_lens):
        if q_len > 1:
            _chunk_attention(query, k_cache, v_cache, block_tables[i], starts[i],
                             q_len, lens[i], scale, block_size, out)
    return out


def _length_buckets(seqs: list[int], lens: list[int], waste: float = 1.25,
                    max_buckets: int = 4) -> list[list[int]]:
    """Group decodes of similar context length. Padding every decode to the
    longest context reads up to ~2x the KV a batch really has (W1's prompts run
    64..512 tokens); a new bucket starts where padding would pass ``waste``."""
    order = sorted(seqs, key=lambda i: lens[i], reverse=True)
    buckets: list[list[int]] = []
    for i in order:
        if buckets and (len(buckets) == max_buckets or lens[buckets[-1][0]] <= waste * lens[i]):
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


def _decode_attention(query, k_cache, v_cache, block_tables, starts, lens, seqs,
                      scale, block_size, out, decode_kernel: str | None) -> None:
    n, num_kv_heads, head_dim = len(seqs), k_cache.shape[2], k_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    idx = torch.tensor(seqs, device=query.device)
    ctx = torch.tensor([lens[i] for i in seqs], dtype=torch.int32, device=query.device)
    n_blocks = (lens[seqs[0]] + block_size - 1) // block_size  # seqs[0] is the longest
    table = block_tables[idx, :n_blocks]
    rows = torch.tensor([starts[i] for i in seqs], device=query.device)
    if decode_kernel == "avx512":
        out[rows] = _run_c_decode(query[rows], k_cache, v_cache, table, ctx, scale)
        return
    if decode_kernel == "inductor":
        o = _run_compiled_decode(query[rows], k_cache, v_cache, table, ctx, scale)
        if o is not None:
            out[rows] = o
            return
    k = _gather_kv(k_cache, table).transpose(1, 2)            # [n, kvh, ctx, d]
    v = _gather_kv(v_cache, table).transpose(1, 2)
    # Fold each KV head's query-head group into the query-length axis: one query
    # of `group` rows per KV head. CPU SDPA runs this several times faster than
    # with enable_gqa=True, and it never copies K/V per query head.
    q = query[rows].view(n, num_kv_heads, group, head_dim)
    key_pos = torch.arange(k.shape[2], device=query.device)
    mask = (key_pos[None, :] < ctx[:, None])[:, None, None, :]  # [n, 1, 1, ctx]
    o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
    out[rows] = o.reshape(n, -1, head_dim)


def _decode_attention_fused(query, k_cache, v_cache, block_tables, seq_lens, scale):
    """Decode attention (one query token per sequence, ``query`` [seqs, kv_heads,
    group, head_dim] -> the same shape) as plain reductions over the
    paged cache, written for torch.compile. Run eagerly it would materialise a
    [seqs, ctx, kv_heads, group, head_dim] product; compiled, inductor turns the
    block-table lookup into addressing inside its dot-product loops, so K and V are
    read straight from the cache: no gathered copy and no tiny GEMM per (sequence,
    head), which is where the SDPA path spends its time in a decode batch. Scores,
    softmax and the weighted sum stay in fp32 (SDPA rounds the weights to bf16)."""
    width = block_tables.shape[1]
    block_size = k_cache.shape[1]
    blocks = block_tables.long()
    q = query[:, None, None].float()                                 # [n, 1, 1, kvh, group, d]
    k = k_cache[blocks].float()                                      # [n, W, bs, kvh, d]
    s = (q * k[..., None, :]).sum(-1) * scale                        # [n, W, bs, kvh, group]
    pos = torch.arange(width * block_size, device=query.device).view(width, block_size, 1, 1)
    s = s.masked_fill(pos >= seq_lens.view(-1, 1, 1, 1, 1), float("-inf"))
    p = torch.exp(s - s.amax((1, 2), keepdim=True))
    v = v_cache[blocks].float()
    o = (p[..., None] * v[..., None, :]).sum((1, 2)) / p.sum((1, 2))[..., None]  # [n, kvh, group, d]
    return o.to(query.dtype)


@functools.cache
def _compiled_decode():
    # dynamic=False keeps head_dim, heads and block_size constants: inductor then
    # unrolls and vectorises the head_dim loop (9.6 ms per W1 layer, against 15.7
    # with every size symbolic). The batch, table and cache sizes are marked
    # unbacked in _run_compiled_decode, so one graph serves every batch, 1 included
    # (dynamo would specialise a size of 1), and scale comes as a tensor so that
    # it is no constant either: one model shape compiles once.
    return torch.compile(_decode_attention_fused, dynamic=False, fullgraph=True)


def _run_compiled_decode(query, k_cache, v_cache, block_tables, seq_lens, scale):
    """The compiled decode, or None when dynamo refuses to compile yet another
    shape (its recompile_limit: a process that has run many different models);
    the caller then takes the eager path."""
    import torch._dynamo
    from torch._dynamo.decorators import mark_unbacked
    n, num_heads, head_dim = query.shape
    # [n, kv_heads, group, d]: with the group a static size, inductor unrolls the
    # query heads that share a K/V row (W1 layer 22 -> 12 ms; split from a symbolic
    # batch size inside the graph, the group was symbolic too).
    q = query.view(n, k_cache.shape[2], -1, head_dim)
    for t, dims in ((q, (0,)), (k_cache, (0,)), (v_cache, (0,)), (block_tables, (0, 1)),
                    (seq_lens, (0,))):
        for dim in dims:
            mark_unbacked(t, dim)
    scale = torch.tensor(scale, dtype=torch.float32, device=query.device)
    try:
        o = _compiled_decode()(q, k_cache, v_cache, block_tables, seq_lens, scale)
        return o.view(n, num_heads, head_dim)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        warnings.warn("torch.compile's recompile limit is reached: decode attention runs eager "
                      "SDPA for this model", RuntimeWarning, stacklevel=2)
        return None


def _chunk_attention(query, k_cache, v_cache, block_table, start, q_len, seq_len,
                     scale, block_size, out) -> None:
    n_blocks = (seq_len + block_size - 1) // block_size
    # 4-D [1, heads, tokens, d] inputs: CPU SDPA takes its fastest path for them.
    k = _gather_kv(k_cache, block_table[:n_blocks])[:seq_len].transpose(0, 1)[None]  # [1, kvh, ctx, d]
    v = _gather_kv(v_cache, block_table[:n_blocks])[:seq_len].transpose(0, 1)[None]
    q = query[start:start + q_len].transpose(0, 1)[None]                             # [1, h, q, d]
    if q_len == seq_len:  # fresh prefill: plain causal attention
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True,
                                           scale=scale, enable_gqa=True)
    else:  # a chunk after a cached prefix: query j sees keys 0 .. seq_len - q_len + j
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                           scale=scale, enable_gqa=True)
    out[start:start + q_len] = o[0].transpose(0, 1)


# --------------------------------------------------------------------------- C attention kernels (CPU, bf16)
#
# Decode: a decode step reads every sequence's whole K/V context once per layer,
# so its speed is memory bandwidth. The compiled twin above reads it at ~11 GB/s
# on a 2-core EPYC (W1's decode batch: 64 sequences, contexts 164..612, 8.2 ms
# per layer), where a plain sum reads ~39 GB/s: inductor walks one KV head at a
# time, and a KV head's rows sit 2 KB apart in the [block, slot, kv_head, d]
# layout, a stride the hardware prefetcher does not follow. decode_attention:
#   * one task per (sequence, run of kv heads): a token's K row is read once,
#     contiguously across those heads, for all the query heads that share it;
#   * each block's rows are prefetched while the previous block is being used
#     (the blocks of a sequence are scattered; rows inside one are not), and
#     the block after that into L2, so more reads are in flight: on the 2-core
#     Zen 4, A B A B, bit-identical, 4.09 -> 3.42 and 3.89 -> 3.22 ms per layer
#     (W0 shape), 6.90 -> 6.33 and 6.97 -> 6.61 ms (W1 shape). The L2 prefetch
#     goes a row at a time beside the L1 one, not as one burst per block (the
#     burst stalled the core; with both K and V read from L1 instead of memory the
#     kernel was only 12-25% faster, so it is not the bandwidth): 5.23 -> 4.06,
#     5.33 -> 4.19 ms (W1 shape), 2.24 -> 2.13, 2.29 -> 2.03 ms (W0 shape);
#   * q.k as AVX-512 BF16 dot products (bf16 pairs, fp32 sums); scores, softmax
#     and the weighted sum of V in fp32, rounded to bf16 once at the end;
#   * the softmax's exp is glibc's expf in 16 lanes (the same bits for all 2^32
#     inputs), its sum rides along in pass 2: A B A B, bit-identical, 2.49 ->
#     2.09 ms per layer (W0 shape), 5.36 -> 4.77 ms (W1 shape).
# Same batch, A B A B: 8.2 -> 3.2 ms per layer (W1 shape), 8.3 -> 2.4 ms (W0
# shape: 256 sequences, d 64).
# Prefill: CPU SDPA runs causal attention at ~60 GFLOP/s here, a fifth of a
# W1 prefill step. chunk_attention is a flash-attention tile loop: 32 query rows
# (tokens x the heads sharing a kv head) in the lanes of two vectors, keys in
# tiles of 16 with an online softmax, q.k as bf16 dot products, softmax and P.V
# in fp32. W1's prompts as one 8076-token step, one layer: 183 -> 38 ms (306
# GFLOP/s); W0's: 39 -> 9.8 ms; closer to the float64 truth than SDPA (which
# rounds the softmax weights to bf16).
# Cascade (vLLM's name for it): requests behind one long prompt prefix share its
# KV blocks through the prefix cache, yet decode_attention reads those blocks once
# per sequence, two query rows at a time. prefix_attention runs chunk_attention's
# tile loop (attend_tile) over the shared blocks with the rows of 16 sequences in
# the lanes, and decode_attention takes each sequence's own tail and merges the two
# softmaxes. W2's decode batch (64 sequences behind 1024 shared tokens), one layer,
# 2-core Zen 4: 8.75 -> 3.62 ms; W2 end to end 49.1 -> 41.1 s (A B A B). Taken only
# where enough sequences share enough tokens (_CASCADE_MIN_SEQS/_TOKENS); elsewhere
# the decode path is bit for bit what it was.
# All are built on first use with the system C compiler (cached on disk) and
# need bf16 and a CPU with AVX-512 BF16; elsewhere the engine keeps the twin
# (model.py ModelRunner.warmup). The twin stays the oracle: tests/test_kernels.py
# checks these kernels against the float64 truth and against it.

_C_PRELUDE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if !defined(__AVX512F__)
#error "this CPU has no AVX-512"
#endif

static inline __m512 load_bf16x16(const uint16_t *p) {  /* bf16 -> fp32: the high half */
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline float bf16_to_f32(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
"""

_ATTENTION_C = _C_PRELUDE + r"""
#if !defined(__AVX512BF16__)
#error "this CPU has no AVX-512 BF16"
#endif
/* GROUP (query heads per kv head) and HEAD_DIM (a multiple of 32) come as -D flags:
   constant sizes let the compiler keep a K/V row in registers. */
#define C32 (HEAD_DIM / 32)
#define C16 (HEAD_DIM / 16)

static inline uint16_t to_bf16(float f) {  /* round to nearest even, as torch's .to() */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* Blocks sit anywhere in the cache, so the hardware prefetcher cannot guess the
   next one: while row j of a block is used, row j of the next block is fetched
   into L1 and row j of the block after that into L2. One row at a time, not a
   block in one burst: a burst fills the miss queue and the core stalls on the
   prefetch instructions themselves (perf: a fifth of the kernel's samples). */
static inline void prefetch_row(const uint16_t *p, int64_t n) {
    for (int64_t l = 0; l < n; l += 32) _mm_prefetch((const char *)(p + l), _MM_HINT_T0);
}
static inline void prefetch_row_l2(const uint16_t *p, int64_t n) {
    for (int64_t l = 0; l < n; l += 32) _mm_prefetch((const char *)(p + l), _MM_HINT_T1);
}

/* e^x for 16 lanes, bit for bit glibc's expf (2.28 on, its FMA build: e_expf.c),
   which the softmax below called once per score: x = (k + r) ln2 / 32 in double,
   2^(k/32) from a 32-entry table, 2^(r/32) from a cubic. Lanes with |x| >= 88 or
   NaN take libm's expf itself. tests/test_kernels.py compares with libm. */
static const uint64_t EXP2F_TAB[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540};

static inline __m256 expf8_glibc(__m256 x) {
    const __m512d invln2n = _mm512_set1_pd(0x1.71547652b82fep+0 * 32), shift = _mm512_set1_pd(0x1.8p+52);
    const __m512d xd = _mm512_cvtps_pd(x);
    const __m512d kshift = _mm512_fmadd_pd(invln2n, xd, shift);  /* k + shift: k in the low bits */
    const __m512i k = _mm512_castpd_si512(kshift);
    const __m512d r = _mm512_fmsub_pd(invln2n, xd, _mm512_sub_pd(kshift, shift));
    const __m512i i = _mm512_and_si512(k, _mm512_set1_epi64(31));
    __m512i t = _mm512_mask_blend_epi64(
        _mm512_test_epi64_mask(i, _mm512_set1_epi64(16)),
        _mm512_permutex2var_epi64(_mm512_loadu_si512(EXP2F_TAB), i, _mm512_loadu_si512(EXP2F_TAB + 8)),
        _mm512_permutex2var_epi64(_mm512_loadu_si512(EXP2F_TAB + 16), i, _mm512_loadu_si512(EXP2F_TAB + 24)));
    t = _mm512_add_epi64(t, _mm512_slli_epi64(k, 47));           /* 2^(k/32) */
    const __m512d z = _mm512_fmadd_pd(r, _mm512_set1_pd(0x1.c6af84b912394p-5 / 32 / 32 / 32),
                                      _mm512_set1_pd(0x1.ebfce50fac4f3p-3 / 32 / 32));
    const __m512d y = _mm512_fmadd_pd(r, _mm512_set1_pd(0x1.62e42ff0c52d6p-1 / 32), _mm512_set1_pd(1.0));
    return _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_fmadd_pd(z, _mm512_mul_pd(r, r), y), _mm512_castsi512_pd(t)));
}

static inline __m512 expf16_glibc(__m512 x) {
    __m512 e = _mm512_insertf32x8(_mm512_castps256_ps512(expf8_glibc(_mm512_castps512_ps256(x))),
                                  expf8_glibc(_mm512_extractf32x8_ps(x, 1)), 1);
    const __m512i top = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 20), _mm512_set1_epi32(0x7ff));
    const __mmask16 special = _mm512_cmpgt_epi32_mask(top, _mm512_set1_epi32(0x42a));
    if (special) {
        float xs[16], es[16];
        _mm512_storeu_ps(xs, x);
        _mm512_storeu_ps(es, e);
        for (int l = 0; l < 16; l++) if (special >> l & 1) es[l] = expf(xs[l]);
        e = _mm512_loadu_ps(es);
    }
    return e;
}

/* for the tests: out[i] = expf16_glibc(x[i]) */
void expf_glibc(const float *x, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, expf16_glibc(_mm512_loadu_ps(x + i)));
    for (; i < n; i++) out[i] = expf(x[i]);
}

/* q, out [n, kvh * GROUP, HEAD_DIM]; k_cache, v_cache [blocks, bs, kvh, HEAD_DIM];
   block_tables [n, bt_stride]; each task owns one sequence and hb kv heads.
   Keys start .. seq_len-1 (start a multiple of bs); with start > 0, o_pre, m_pre
   and l_pre [n * heads (* HEAD_DIM)] hold what prefix_attention computed over keys
   0 .. start-1, and each row's two parts are merged at the end. */
void decode_attention(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                      const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                      uint16_t *out, int64_t n, int64_t kvh, int64_t bs, float scale,
                      int64_t hb, int64_t start, const float *o_pre, const float *m_pre,
                      const float *l_pre, int nthreads) {
    const int64_t heads = kvh * GROUP, row = kvh * HEAD_DIM, blk = bs * row, runs = kvh / hb;
    const int64_t rows = hb * GROUP, width = hb * HEAD_DIM;
    #pragma omp parallel num_threads(nthreads)
    {
        float *s = NULL, *acc = aligned_alloc(64, rows * HEAD_DIM * sizeof(float));
        int64_t cap = 0;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < n * runs; task++) {
            const int64_t i = task / runs, h0 = task % runs * hb, len = seq_lens[i], span = len - start;
            const int32_t *bt = block_tables + i * bt_stride;
            const uint16_t *qi = q + (i * heads + h0 * GROUP) * HEAD_DIM;
            if (rows * span > cap) { free(s); cap = 2 * rows * span; s = malloc(cap * sizeof(float)); }
            /* pass 1: s[r * span + t - start] = scale * q_r . k_t, r = head * GROUP + g */
            for (int64_t t0 = start; t0 < len; t0 += bs) {
                const uint16_t *kb = k_cache + bt[t0 / bs] * blk + h0 * HEAD_DIM;
                const uint16_t *next = t0 + bs < len ? k_cache + bt[t0 / bs + 1] * blk + h0 * HEAD_DIM : NULL;
                const uint16_t *next2 = t0 + 2 * bs < len ? k_cache + bt[t0 / bs + 2] * blk + h0 * HEAD_DIM : NULL;
                for (int64_t j = 0; j < bs && t0 + j < len; j++) {
                    if (next) prefetch_row(next + j * row, width);
                    if (next2) prefetch_row_l2(next2 + j * row, width);
                    for (int64_t h = 0; h < hb; h++) {
                        __m512i k[C32];
                        for (int c = 0; c < C32; c++) k[c] = _mm512_loadu_si512(kb + j * row + h * HEAD_DIM + 32 * c);
                        for (int g = 0; g < GROUP; g++) {
                            const uint16_t *qr = qi + (h * GROUP + g) * HEAD_DIM;
                            __m512 a = _mm512_setzero_ps();
                            for (int c = 0; c < C32; c++)
                                a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qr + 32 * c), (__m512bh)k[c]);
                            s[(h * GROUP + g) * span + t0 - start + j] = _mm512_reduce_add_ps(a) * scale;
                        }
                    }
                }
            }
            /* softmax of each row, left unnormalised: out = acc / sum at the end */
            float inv[rows], mx[rows], sm[rows];
            for (int64_t r = 0; r < rows; r++) {
                float *sr = s + r * span;
                int64_t t = 0;
                __m512 vm = _mm512_set1_ps(-INFINITY);
                for (; t + 16 <= span; t += 16) vm = _mm512_max_ps(_mm512_loadu_ps(sr + t), vm);  /* NaN: skipped */
                float m = _mm512_reduce_max_ps(vm);
                for (; t < span; t++) m = sr[t] > m ? sr[t] : m;
                for (t = 0; t + 16 <= span; t += 16)
                    _mm512_storeu_ps(sr + t, expf16_glibc(_mm512_sub_ps(_mm512_loadu_ps(sr + t), _mm512_set1_ps(m))));
                for (; t < span; t++) sr[t] = expf(sr[t] - m);
                mx[r] = m;
                sm[r] = 0.f;  /* summed in pass 2, in the same order, off the critical path */
            }
            /* pass 2: acc[r] = sum_t p[r, t] * v_t */
            memset(acc, 0, rows * HEAD_DIM * sizeof(float));
            for (int64_t t0 = start; t0 < len; t0 += bs) {
                const uint16_t *vb = v_cache + bt[t0 / bs] * blk + h0 * HEAD_DIM;
                const uint16_t *next = t0 + bs < len ? v_cache + bt[t0 / bs + 1] * blk + h0 * HEAD_DIM : NULL;
                const uint16_t *next2 = t0 + 2 * bs < len ? v_cache + bt[t0 / bs + 2] * blk + h0 * HEAD_DIM : NULL;
                for (int64_t j = 0; j < bs && t0 + j < len; j++) {
                    if (next) prefetch_row(next + j * row, width);
                    if (next2) prefetch_row_l2(next2 + j * row, width);
                    for (int64_t h = 0; h < hb; h++) {
                        __m512 v[C16];
                        for (int c = 0; c < C16; c++) v[c] = load_bf16x16(vb + j * row + h * HEAD_DIM + 16 * c);
                        for (int g = 0; g < GROUP; g++) {
                            const float pr = s[(h * GROUP + g) * span + t0 - start + j];
                            const __m512 p = _mm512_set1_ps(pr);
                            float *ar = acc + (h * GROUP + g) * HEAD_DIM;
                            sm[h * GROUP + g] += pr;
                            for (int c = 0; c < C16; c++)
                                _mm512_store_ps(ar + 16 * c, _mm512_fmadd_ps(p, v[c], _mm512_load_ps(ar + 16 * c)));
                        }
                    }
                }
            }
            for (int64_t r = 0; r < rows; r++) inv[r] = 1.f / sm[r];
            uint16_t *o = out + (i * heads + h0 * GROUP) * HEAD_DIM;
            if (o_pre == NULL) {
                for (int64_t r = 0; r < rows; r++)
                    for (int d = 0; d < HEAD_DIM; d++) o[r * HEAD_DIM + d] = to_bf16(acc[r * HEAD_DIM + d] * inv[r]);
            } else {  /* softmax over both parts: rescale each to the larger max */
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t pr = i * heads + h0 * GROUP + r;
                    const float m = mx[r] > m_pre[pr] ? mx[r] : m_pre[pr];
                    const float a = expf(mx[r] - m), b = expf(m_pre[pr] - m);
                    const float norm = 1.f / (sm[r] * a + l_pre[pr] * b);
                    const float *op = o_pre + pr * HEAD_DIM;
                    for (int d = 0; d < HEAD_DIM; d++)
                        o[r * HEAD_DIM + d] = to_bf16((acc[r * HEAD_DIM + d] * a + op[d] * b) * norm);
                }
            }
        }
        free(s);
        free(acc);
    }
}

/* e^x for 16 lanes: Cephes' expf polynomial on x - n ln2, scaled by 2^n (~1 ulp) */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

/* Prefill chunks: sequence i's q_len = query_start_loc[i+1] - query_start_loc[i]
   tokens (those with q_len > 1; decodes go to decode_attention) at positions
   seq_len - q_len .. seq_len - 1, causal over the paged context. A task owns one
   kv head and a tile of up to 32 / GROUP query tokens: its 32 query rows (token,
   group head) sit in the lanes of two vectors, so scores, the running max and the
   softmax are lane-wise, and q.k is a bf16 dot product of each row with a
   broadcast pair of K values. */
#define ROWS 32
#define TILE_Q (ROWS / GROUP)
#define TILE_K 16
/* A tile's query rows r = token * GROUP + g (nq tokens from q0, their heads
   heads apart) as bf16 pairs in qt, [d/2][ROWS]; rows past them get q = 0. */
static void pack_rows(uint32_t *qt, const uint16_t *q0, int64_t nq, int64_t heads) {
    for (int r = 0; r < ROWS; r++) {
        const int tq = r / GROUP, g = r % GROUP, live = r < TILE_Q * GROUP && tq < nq;
        const uint32_t *qr = (const uint32_t *)(q0 + (tq * heads + g) * HEAD_DIM);
        for (int p = 0; p < HEAD_DIM / 2; p++) qt[p * ROWS + r] = live ? qr[p] : 0;
    }
}

/* One tile: ROWS query rows (their q as bf16 pairs in qt, [d/2][ROWS]) against keys
   0 .. end-1 of kv head h through a block table, key t visible to row r when
   t <= pos[r]. Leaves each row's unnormalised output in o [ROWS][HEAD_DIM] and its
   running max and sum in m and l; vt and pt are scratch. */
static void attend_tile(const uint32_t *qt, const int32_t *pos, const uint16_t *k_cache,
                        const uint16_t *v_cache, const int32_t *bt, int64_t end, int64_t h,
                        int64_t bs, int64_t row, float scale, float *o, float *vt, float *pt,
                        float *m, float *l) {
    const int64_t blk = bs * row;
    const __m512i pos0 = _mm512_loadu_si512(pos), pos1 = _mm512_loadu_si512(pos + 16);
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, l0 = _mm512_setzero_ps(), l1 = l0;
    memset(o, 0, ROWS * HEAD_DIM * 4);
    for (int64_t k0 = 0; k0 < end; k0 += TILE_K) {
        const int64_t nk = end - k0 < TILE_K ? end - k0 : TILE_K;
        const uint32_t *kr[TILE_K];
        for (int j = 0; j < nk; j++) {
            const int64_t t = k0 + j, b = bt[t / bs];
            kr[j] = (const uint32_t *)(k_cache + b * blk + (t % bs) * row + h * HEAD_DIM);
            const uint16_t *vr = v_cache + b * blk + (t % bs) * row + h * HEAD_DIM;
            for (int c = 0; c < HEAD_DIM / 16; c++) _mm512_store_ps(vt + j * HEAD_DIM + 16 * c, load_bf16x16(vr + 16 * c));
        }
        __m512 s0[TILE_K], s1[TILE_K];
        for (int j = 0; j < TILE_K; j += 4) {
            __m512 a[8];
            for (int u = 0; u < 8; u++) a[u] = _mm512_setzero_ps();
            if (j < nk) {
                const uint32_t *k_a = kr[j], *k_b = kr[j + 1 < nk ? j + 1 : j];
                const uint32_t *k_c = kr[j + 2 < nk ? j + 2 : j], *k_d = kr[j + 3 < nk ? j + 3 : j];
                for (int p = 0; p < HEAD_DIM / 2; p++) {
                    const __m512bh qa = (__m512bh)_mm512_load_si512(qt + p * ROWS);
                    const __m512bh qb = (__m512bh)_mm512_load_si512(qt + p * ROWS + 16);
                    const __m512bh ka = (__m512bh)_mm512_set1_epi32(k_a[p]), kb = (__m512bh)_mm512_set1_epi32(k_b[p]);
                    const __m512bh kc = (__m512bh)_mm512_set1_epi32(k_c[p]), kd = (__m512bh)_mm512_set1_epi32(k_d[p]);
                    a[0] = _mm512_dpbf16_ps(a[0], qa, ka); a[1] = _mm512_dpbf16_ps(a[1], qb, ka);
                    a[2] = _mm512_dpbf16_ps(a[2], qa, kb); a[3] = _mm512_dpbf16_ps(a[3], qb, kb);
                    a[4] = _mm512_dpbf16_ps(a[4], qa, kc); a[5] = _mm512_dpbf16_ps(a[5], qb, kc);
                    a[6] = _mm512_dpbf16_ps(a[6], qa, kd); a[7] = _mm512_dpbf16_ps(a[7], qb, kd);
                }
            }
            for (int u = 0; u < 4; u++) {  /* scale; -inf where the key is in a row's future */
                const __m512i kp = _mm512_set1_epi32((int32_t)(k0 + j + u));
                const __mmask16 ok0 = j + u < nk ? _mm512_cmple_epi32_mask(kp, pos0) : 0;
                const __mmask16 ok1 = j + u < nk ? _mm512_cmple_epi32_mask(kp, pos1) : 0;
                s0[j + u] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), ok0, a[2 * u], _mm512_set1_ps(scale));
                s1[j + u] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), ok1, a[2 * u + 1], _mm512_set1_ps(scale));
            }
        }
        __m512 n0 = m0, n1 = m1;  /* online softmax: new running max, rescale what came before */
        for (int j = 0; j < nk; j++) { n0 = _mm512_max_ps(n0, s0[j]); n1 = _mm512_max_ps(n1, s1[j]); }
        const __m512 alpha0 = exp16(_mm512_sub_ps(m0, n0)), alpha1 = exp16(_mm512_sub_ps(m1, n1));
        l0 = _mm512_mul_ps(l0, alpha0); l1 = _mm512_mul_ps(l1, alpha1);
        for (int j = 0; j < nk; j++) {
            const __m512 e0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s0[j], _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), exp16(_mm512_sub_ps(s0[j], n0)));
            const __m512 e1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s1[j], _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), exp16(_mm512_sub_ps(s1[j], n1)));
            l0 = _mm512_add_ps(l0, e0); l1 = _mm512_add_ps(l1, e1);
            _mm512_store_ps(pt + j * ROWS, e0); _mm512_store_ps(pt + j * ROWS + 16, e1);
        }
        float al[ROWS];
        _mm512_storeu_ps(al, alpha0); _mm512_storeu_ps(al + 16, alpha1);
        m0 = n0; m1 = n1;
        for (int r = 0; r < ROWS; r++) {
            __m512 acc[HEAD_DIM / 16];
            const __m512 ar = _mm512_set1_ps(al[r]);
            for (int c = 0; c < HEAD_DIM / 16; c++) acc[c] = _mm512_mul_ps(ar, _mm512_load_ps(o + r * HEAD_DIM + 16 * c));
            for (int j = 0; j < nk; j++) {
                const __m512 pj = _mm512_set1_ps(pt[j * ROWS + r]);
                for (int c = 0; c < HEAD_DIM / 16; c++) acc[c] = _mm512_fmadd_ps(pj, _mm512_load_ps(vt + j * HEAD_DIM + 16 * c), acc[c]);
            }
            for (int c = 0; c < HEAD_DIM / 16; c++) _mm512_store_ps(o + r * HEAD_DIM + 16 * c, acc[c]);
        }
    }
    _mm512_storeu_ps(m, m0); _mm512_storeu_ps(m + 16, m1);
    _mm512_storeu_ps(l, l0); _mm512_storeu_ps(l + 16, l1);
}

void chunk_attention(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                     const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                     const int32_t *query_start_loc, uint16_t *out, int64_t n, int64_t kvh,
                     int64_t bs, float scale, int nthreads) {
    const int64_t heads = kvh * GROUP, row = kvh * HEAD_DIM;
    int64_t *first = malloc((n + 1) * sizeof(int64_t));   /* first tile of each sequence */
    first[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t q_len = query_start_loc[i + 1] - query_start_loc[i];
        first[i + 1] = first[i] + (q_len > 1 ? (q_len + TILE_Q - 1) / TILE_Q : 0);
    }
    const int64_t tasks = first[n] * kvh;
    #pragma omp parallel num_threads(nthreads)
    {
        uint32_t *qt = aligned_alloc(64, HEAD_DIM / 2 * ROWS * 4);   /* q pairs, [d/2][row] */
        float *o = aligned_alloc(64, ROWS * HEAD_DIM * 4);           /* unnormalised output */
        float *vt = aligned_alloc(64, TILE_K * HEAD_DIM * 4);        /* the tile's V, fp32 */
        float *pt = aligned_alloc(64, TILE_K * ROWS * 4);            /* softmax weights [key][row] */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t tile = task / kvh, h = task % kvh;
            int64_t i = 0;
            while (first[i + 1] <= tile) i++;
            const int64_t len = seq_lens[i], q_len = query_start_loc[i + 1] - query_start_loc[i];
            const int64_t t0 = (tile - first[i]) * TILE_Q, nq = q_len - t0 < TILE_Q ? q_len - t0 : TILE_Q;
            const int64_t p0 = len - q_len + t0;                 /* position of the tile's first token */
            const int32_t *bt = block_tables + i * bt_stride;
            const uint16_t *qrow0 = q + ((query_start_loc[i] + t0) * heads + h * GROUP) * HEAD_DIM;
            /* rows past the tile's tokens see everything (their q is 0) */
            int32_t pos[ROWS];
            for (int r = 0; r < ROWS; r++)
                pos[r] = r < TILE_Q * GROUP && r / GROUP < nq ? (int32_t)(p0 + r / GROUP) : (int32_t)len;
            pack_rows(qt, qrow0, nq, heads);
            float mv[ROWS], lv[ROWS];
            attend_tile(qt, pos, k_cache, v_cache, bt, p0 + nq, h, bs, row, scale, o, vt, pt, mv, lv);
            for (int r = 0; r < TILE_Q * GROUP; r++) {
                const int tq = r / GROUP, g = r % GROUP;
                if (tq >= nq) break;
                uint16_t *orow = out + ((query_start_loc[i] + t0 + tq) * heads + h * GROUP + g) * HEAD_DIM;
                for (int d = 0; d < HEAD_DIM; d++) orow[d] = to_bf16(o[r * HEAD_DIM + d] / lv[r]);
            }
        }
        free(qt); free(o); free(vt); free(pt);
    }
    free(first);
}

/* Cascade attention's shared part (vLLM's name): when every sequence of a decode
   batch begins with the same prefix_len tokens in the same blocks (prefix_table),
   the n queries attend to that prefix together, ROWS (sequence, head) rows to a
   tile, so a prefix K/V row is read once per tile rather than once per sequence and
   its dot products fill whole vectors. Leaves each row's unnormalised output, max
   and sum in o_pre, m_pre, l_pre [n * heads (* HEAD_DIM)] for decode_attention,
   which attends to the rest of each context and merges the two. */
void prefix_attention(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                      const int32_t *prefix_table, int64_t prefix_len, float *o_pre, float *m_pre,
                      float *l_pre, int64_t n, int64_t kvh, int64_t bs, float scale, int nthreads) {
    const int64_t heads = kvh * GROUP, row = kvh * HEAD_DIM, tasks = (n + TILE_Q - 1) / TILE_Q * kvh;
    #pragma omp parallel num_threads(nthreads)
    {
        uint32_t *qt = aligned_alloc(64, HEAD_DIM / 2 * ROWS * 4);
        float *o = aligned_alloc(64, ROWS * HEAD_DIM * 4);
        float *vt = aligned_alloc(64, TILE_K * HEAD_DIM * 4);
        float *pt = aligned_alloc(64, TILE_K * ROWS * 4);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t s0 = task / kvh * TILE_Q, h = task % kvh, ns = n - s0 < TILE_Q ? n - s0 : TILE_Q;
            /* the tile's tokens are ns sequences' decode tokens, each seeing the whole prefix */
            int32_t pos[ROWS];
            for (int r = 0; r < ROWS; r++) pos[r] = (int32_t)prefix_len;
            pack_rows(qt, q + (s0 * heads + h * GROUP) * HEAD_DIM, ns, heads);
            float mv[ROWS], lv[ROWS];
            attend_tile(qt, pos, k_cache, v_cache, prefix_table, prefix_len, h, bs, row, scale, o, vt, pt, mv, lv);
            for (int r = 0; r < TILE_Q * GROUP && r / GROUP < ns; r++) {
                const int64_t pr = (s0 + r / GROUP) * heads + h * GROUP + r % GROUP;
                m_pre[pr] = mv[r];
                l_pre[pr] = lv[r];
                memcpy(o_pre + pr * HEAD_DIM, o + r * HEAD_DIM, HEAD_DIM * 4);
            }
        }
        free(qt); free(o); free(vt); free(pt);
    }
}
"""


def _cache_dir() -> Path:
    return Path(os.environ.get("NANOSERVE_CACHE_DIR") or Path.home() / ".cache" / "nanoserve")


def _cpu_flags() -> str:
    """-march=native builds for this CPU, so the built library is keyed by it."""
    try:
        return next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def _build_c_library(name: str, source: str, defines: list[str]) -> ctypes.CDLL:
    """Build (once per source, flags and CPU, cached on disk) and load a C library.
    Raises RuntimeError saying why when it cannot be built here."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", *defines]
    key = hashlib.sha256("\0".join([source, cc, *flags, _cpu_flags()]).encode()).hexdigest()[:16]
    path = _cache_dir() / f"{name}_{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            src, so = Path(tmp) / f"{name}.c", Path(tmp) / "out.so"
            src.write_text(source)
            r = subprocess.run([cc, *flags, str(src), "-o", str(so), "-lm"], capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"building the C kernel {name} failed: {r.stderr.strip()[:500]}")
            os.replace(so, path)  # atomic: another process may be building the same file
    # libgomp is already loaded by torch under the same soname, so the kernel's
    # OpenMP threads are torch's own pool, not a second one competing for cores.
    return ctypes.CDLL(str(path))


@functools.cache
def _c_attention_library(group: int, head_dim: int):
    """The C attention kernels for one head shape."""
    if head_dim % 32:
        raise RuntimeError(f"the C decode kernel needs head_dim % 32 == 0, got {head_dim}")
    lib = _build_c_library("decode_attention", _ATTENTION_C, [f"-DGROUP={group}", f"-DHEAD_DIM={head_dim}"])
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    f32, i32 = ctypes.c_float, ctypes.c_int
    lib.decode_attention.argtypes = [p, p, p, p, i64, p, p, i64, i64, i64, f32, i64, i64, p, p, p, i32]
    lib.chunk_attention.argtypes = [p, p, p, p, i64, p, p, p, i64, i64, i64, f32, i32]
    lib.prefix_attention.argtypes = [p, p, p, p, i64, p, p, p, i64, i64, i64, f32, i32]
    lib.expf_glibc.argtypes = [p, p, i64]
    lib.decode_attention.restype = lib.chunk_attention.restype = lib.prefix_attention.restype = None
    lib.expf_glibc.restype = None
    return lib


# Cascade attention pays where many sequences share a long prefix; a few, or a
# short one, stay on one pass. Measured, Qwen3-0.6B heads, tails of 48-111 tokens
# (2-core Zen 4, ms one pass -> cascade): 64 sequences behind 1024 shared tokens
# (W2's decode batch) 8.75 -> 3.62, behind 256 2.96 -> 1.59; 16 behind 1024 3.39 ->
# 0.97; 8 behind 256 0.34 -> 0.32 (even); 4 behind 1024 0.70 -> 0.82 (a loss).
_CASCADE_MIN_SEQS = 8
_CASCADE_MIN_TOKENS = 256


def _heads_per_task(num_seqs: int, num_kv_heads: int, threads: int) -> int:
    """Most kv heads per task (longest contiguous reads) that still leaves every
    thread a few tasks: a batch of one sequence is split across its heads."""
    for hb in range(num_kv_heads, 0, -1):
        if num_kv_heads % hb == 0 and num_seqs * (num_kv_heads // hb) >= 2 * threads:
            return hb
    return 1


def _check_c_inputs(query, k_cache, v_cache) -> None:
    if query.dtype != torch.bfloat16 or k_cache.dtype != torch.bfloat16 or v_cache.dtype != torch.bfloat16:
        raise ValueError("the avx512 attention kernels take bf16 query and caches")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the avx512 attention kernels need contiguous caches")


def _run_c_decode(query, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """Decode attention through the C kernels: query [seqs, heads, d] bf16 -> the same.
    Where the sequences share a long enough prefix, cascade attention: the shared
    part once for all (prefix_attention), then each one's own tail, merged."""
    n, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    _check_c_inputs(query, k_cache, v_cache)
    lib = _c_attention_library(num_heads // num_kv_heads, head_dim)
    query = query.contiguous()
    table = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    threads = torch.get_num_threads()
    start, partials = 0, (None, None, None)
    shared = _shared_prefix_blocks(table, lens, block_size) if n >= _CASCADE_MIN_SEQS else 0
    if shared * block_size >= _CASCADE_MIN_TOKENS:
        start = shared * block_size
        o_pre = torch.empty(n, num_heads, head_dim, dtype=torch.float32)
        m_pre, l_pre = torch.empty(n, num_heads), torch.empty(n, num_heads)
        prefix_table = table[0, :shared].contiguous()  # held: C reads it through a raw pointer
        lib.prefix_attention(query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                             prefix_table.data_ptr(), start, o_pre.data_ptr(),
                             m_pre.data_ptr(), l_pre.data_ptr(), n, num_kv_heads, block_size,
                             float(scale), threads)
        partials = (o_pre.data_ptr(), m_pre.data_ptr(), l_pre.data_ptr())
    lib.decode_attention(query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(),
                         table.stride(0), lens.data_ptr(), out.data_ptr(), n, num_kv_heads, block_size,
                         float(scale), _heads_per_task(n, num_kv_heads, threads), start, *partials, threads)
    return out


def _run_c_store(key, value, k_cache, v_cache, slot_mapping) -> None:
    """store_kvcache's rows as memcpys in C: the torch twin's validity check and
    two index_copy_ calls cost ~0.1 ms a layer at W0's sizes."""
    _check_kv(key, value, k_cache, v_cache)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if not (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and key.stride()[1:] == value.stride()[1:] == (head_dim, 1)):
        raise ValueError("the avx512 store_kvcache takes bf16 key/value with contiguous heads and contiguous caches")
    slots = slot_mapping.to(torch.int64).contiguous()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    bad = _c_row_ops_library().store_kvcache(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                                 k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                                                 key.shape[0], num_kv_heads * head_dim, num_slots)
    if bad:
        raise IndexError(f"store_kvcache: {bad} slots outside the cache's {num_slots} (or below -1)")


def _shared_prefix_blocks(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> int:
    """How many leading blocks every sequence's table has in common (the prefix
    cache hands one physical block to all requests with the same prefix), leaving
    each sequence at least its last token of its own."""
    same = (block_tables == block_tables[:1]).all(0)
    common = int(same.to(torch.int32).cumprod(0).sum())
    return min(common, (int(seq_lens.min()) - 1) // block_size)


def _run_c_chunks(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out) -> None:
    """The multi-token chunks of a step (q_len > 1) through the C kernel, written into
    ``out``; query and out [num_tokens, heads, d] bf16, contiguous."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    _check_c_inputs(query, k_cache, v_cache)
    lib = _c_attention_library(num_heads // num_kv_heads, head_dim)
    table = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    qsl = query_start_loc.to(torch.int32).contiguous()
    lib.chunk_attention(query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(),
                        table.stride(0), lens.data_ptr(), qsl.data_ptr(), out.data_ptr(), lens.shape[0],
                        num_kv_heads, block_size, float(scale), torch.get_num_threads())


# --------------------------------------------------------------------------- C elementwise ops (CPU, bf16)
#
# Between the matmuls a decoder layer runs RMSNorms, Qwen3's per-head q/k norms
# with the rotary embedding, and SiLU-and-mul. model.py writes them as eager
# torch (rms_scale, qk_norm_rope, silu_and_mul), where each op is its own pass
# over memory and, at decode sizes, its own ~10 us of dispatch: W1's 64-token
# decode step spends ~0.7 ms a layer on them, ~20 ms of its ~400. These three C
# functions do each in one pass and compute bit for bit what the eager ops do
# (tests/test_kernels.py checks torch.equal), so outputs cannot move:
#   * every bf16 intermediate eager torch stores is rounded here too (round_bf16);
#   * RMSNorm's mean of squares adds in the order of ATen's CPU sum over a
#     contiguous row (aten_row_sum), not in a faster one;
#   * SiLU looks its value up in a table of torch's own F.silu over all 65536
#     bf16 values, so it carries torch's exp whatever libm this is.

_ELEMENTWISE_C = _C_PRELUDE + r"""
/* fp32 -> nearest-even bf16 -> fp32, as ATen converts (a NaN becomes 0xffff) */
static inline __m512 round_bf16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32((int)0xffff0000u));
    return _mm512_castsi512_ps(r);
}
static inline void store_bf16x16(uint16_t *p, __m512 exact) {  /* exact: already a bf16 value */
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(exact), 16)));
}
static inline __m256 square_bf16x8(const uint16_t *p) {  /* exact in fp32 */
    const __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_mul_ps(f, f);
}

/* The sum of the squares of n bf16 values in ATen's order for a contiguous row
   (SumKernel.cpp, row_sum/multi_row_sum): 8-lane vectors into four interleaved
   accumulators, folded every 16 rounds through a cascade of levels, the four
   added in order, then the tail and the 8 lanes one by one. */
static float aten_sum_of_squares(const uint16_t *x, int64_t n) {
    const int64_t nv = n / 8, rounds = nv / 4, step = 16;  /* 16: ATen's level_step below 2^19 rounds */
    __m256 acc[4][4];
    for (int j = 0; j < 4; j++)
        for (int k = 0; k < 4; k++) acc[j][k] = _mm256_setzero_ps();
    int64_t i = 0;
    while (i + step <= rounds) {
        for (int64_t e = i + step; i < e; i++)
            for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], square_bf16x8(x + (4 * i + k) * 8));
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < 4; k++) {
                acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
                acc[j - 1][k] = _mm256_setzero_ps();
            }
            if (i & ((step - 1) << (4 * j))) break;
        }
    }
    for (; i < rounds; i++)
        for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], square_bf16x8(x + (4 * i + k) * 8));
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
    for (int64_t v = rounds * 4; v < nv; v++) acc[0][0] = _mm256_add_ps(acc[0][0], square_bf16x8(x + v * 8));
    __m256 sum = acc[0][0];
    for (int k = 1; k < 4; k++) sum = _mm256_add_ps(sum, acc[0][k]);
    float total = 0.f, lanes[8];
    for (int64_t t = nv * 8; t < n; t++) total += bf16_to_f32(x[t]) * bf16_to_f32(x[t]);
    _mm256_storeu_ps(lanes, sum);
    for (int l = 0; l < 8; l++) total += lanes[l];
    return total;
}

/* model.py's rms_scale(x, mean_square(x), w, eps) for one row of n (n % 16 == 0):
   weight * bf16(x * 1/sqrt(mean + eps)), kept as exact bf16 values in fp32 */
static inline void rms_norm_row(const uint16_t *x, const uint16_t *w, int64_t n, float eps, float *y) {
    const float r = 1.f / sqrtf(aten_sum_of_squares(x, n) / (float)n + eps);
    const __m512 vr = _mm512_set1_ps(r);
    for (int64_t c = 0; c < n; c += 16)
        _mm512_storeu_ps(y + c, round_bf16(_mm512_mul_ps(load_bf16x16(w + c),
                                                         round_bf16(_mm512_mul_ps(load_bf16x16(x + c), vr)))));
}

/* x [rows, n] (row stride ld) -> out [rows, n] contiguous */
void rms_norm(const uint16_t *x, int64_t ld, const uint16_t *w, uint16_t *out, int64_t rows, int64_t n,
              float eps, int nthreads) {
    #pragma omp parallel num_threads(nthreads)
    {
        float *y = aligned_alloc(64, n * sizeof(float));
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; t++) {
            rms_norm_row(x + t * ld, w, n, eps, y);
            for (int64_t c = 0; c < n; c += 16) store_bf16x16(out + t * n + c, _mm512_loadu_ps(y + c));
        }
        free(y);
    }
}

/* model.py's qk_norm_rope for q [rows, hq, d] and k [rows, hk, d] (row strides
   ldq, ldk; heads contiguous) into contiguous outputs: each head's RMSNorm (if
   qw), then neox rope: out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)),
   cos and sin rounded to bf16 first, as eager torch does. */
void qk_norm_rope(const uint16_t *q, int64_t ldq, const uint16_t *k, int64_t ldk, uint16_t *q_out,
                  uint16_t *k_out, int64_t rows, int64_t hq, int64_t hk, int64_t d, const int64_t *positions,
                  const float *cos_cache, const float *sin_cache, const uint16_t *qw, const uint16_t *kw,
                  float eps, int nthreads) {
    const int64_t half = d / 2;
    #pragma omp parallel num_threads(nthreads)
    {
        float *y = aligned_alloc(64, 3 * d * sizeof(float)), *cs = y + d, *sn = y + 2 * d;
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; t++) {
            for (int64_t c = 0; c < d; c += 16) {  /* this position's cos and sin, as bf16 */
                _mm512_storeu_ps(cs + c, round_bf16(_mm512_loadu_ps(cos_cache + positions[t] * d + c)));
                _mm512_storeu_ps(sn + c, round_bf16(_mm512_loadu_ps(sin_cache + positions[t] * d + c)));
            }
            for (int64_t h = 0; h < hq + hk; h++) {
                const int is_q = h < hq;
                const uint16_t *x = is_q ? q + t * ldq + h * d : k + t * ldk + (h - hq) * d;
                const uint16_t *w = is_q ? qw : kw;
                uint16_t *o = is_q ? q_out + (t * hq + h) * d : k_out + (t * hk + h - hq) * d;
                if (w != NULL) rms_norm_row(x, w, d, eps, y);
                else for (int64_t c = 0; c < d; c += 16) _mm512_storeu_ps(y + c, load_bf16x16(x + c));
                for (int64_t c = 0; c < d; c += 16) {
                    const __m512 v = _mm512_loadu_ps(y + c);
                    const __m512 rot = c < half ? _mm512_sub_ps(_mm512_setzero_ps(), _mm512_loadu_ps(y + c + half))
                                                : _mm512_loadu_ps(y + c - half);
                    const __m512 a = round_bf16(_mm512_mul_ps(v, _mm512_loadu_ps(cs + c)));
                    const __m512 b = round_bf16(_mm512_mul_ps(rot, _mm512_loadu_ps(sn + c)));
                    store_bf16x16(o + c, round_bf16(_mm512_add_ps(a, b)));
                }
            }
        }
        free(y);
    }
}

/* kernels.store_kvcache: key, value [n, row] (row = kv heads x head_dim; row
   strides ldk, ldv) into the caches' num_slots slots, a slot of -1 being
   padding; returns how many slots were out of range (and not written) */
int64_t store_kvcache(const uint16_t *key, int64_t ldk, const uint16_t *value, int64_t ldv, uint16_t *k_cache,
                      uint16_t *v_cache, const int64_t *slots, int64_t n, int64_t row, int64_t num_slots) {
    int64_t bad = 0;
    for (int64_t t = 0; t < n; t++) {
        if (slots[t] == -1) continue;
        if (slots[t] < 0 || slots[t] >= num_slots) { bad++; continue; }
        memcpy(k_cache + slots[t] * row, key + t * ldk, row * sizeof(uint16_t));
        memcpy(v_cache + slots[t] * row, value + t * ldv, row * sizeof(uint16_t));
    }
    return bad;
}

/* model.py's silu_and_mul: gate_up [rows, 2n] -> bf16(silu(gate) * up) [rows, n];
   silu_table[bits] is the fp32 value of torch's bf16 F.silu of those bf16 bits */
void silu_and_mul(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t n, const float *silu_table,
                  int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const uint16_t *g = gate_up + t * 2 * n, *u = g + n;
        for (int64_t c = 0; c < n; c += 16) {
            const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(g + c)));
            const __m512 s = _mm512_i32gather_ps(bits, silu_table, 4);
            store_bf16x16(out + t * n + c, round_bf16(_mm512_mul_ps(s, load_bf16x16(u + c))));
        }
    }
}
"""


@functools.cache
def _c_row_ops_library():
    """The shape-free C kernels in one library: the elementwise ops, the KV
    store (_run_c_store) and argmax."""
    lib = _build_c_library("row_ops", _ELEMENTWISE_C + _ARGMAX_C, [])
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.argmax_rows.argtypes = [p, i64, i64, i64, p, i32]
    lib.argmax_rows.restype = None
    lib.rms_norm.argtypes = [p, i64, p, p, i64, i64, f32, i32]
    lib.qk_norm_rope.argtypes = [p, i64, p, i64, p, p, i64, i64, i64, i64, p, p, p, p, p, f32, i32]
    lib.silu_and_mul.argtypes = [p, p, i64, i64, p, i32]
    lib.store_kvcache.argtypes = [p, i64, p, i64, p, p, p, i64, i64, i64]
    lib.store_kvcache.restype = i64
    lib.rms_norm.restype = lib.qk_norm_rope.restype = lib.silu_and_mul.restype = None
    return lib


@functools.cache
def _silu_table() -> torch.Tensor:
    """fp32 [65536]: torch's bf16 F.silu of every bf16 bit pattern, by index."""
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return F.silu(bits).float()


def _rows_ok(t: torch.Tensor, n: int) -> bool:
    """bf16, unit stride within a row of n (a multiple of 16), any row stride."""
    return t.dtype == torch.bfloat16 and t.stride(-1) == 1 and n % 16 == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """model.py's rms_scale(x, mean_square(x), weight, eps) for x [rows, n], in C."""
    rows, n = x.shape
    if not (_rows_ok(x, n) and weight.dtype == torch.bfloat16 and weight.is_contiguous()):
        raise ValueError("the C rms_norm takes bf16 [rows, n] rows with n % 16 == 0")
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    _c_row_ops_library().rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), rows, n,
                                      eps, torch.get_num_threads())
    return out


def qk_norm_rope(q, k, positions, cos_cache, sin_cache, q_weight, k_weight, eps: float):
    """model.py's qk_norm_rope (with mean_square of q and k when the weights are
    given) for q [rows, hq, d], k [rows, hk, d] whose heads are contiguous, in C."""
    rows, hq, d = q.shape
    hk = k.shape[1]
    if not (_rows_ok(q, d) and _rows_ok(k, d) and q.stride(1) == d and k.stride(1) == d
            and cos_cache.dtype == torch.float32 and cos_cache.is_contiguous() and sin_cache.is_contiguous()):
        raise ValueError("the C qk_norm_rope takes bf16 q, k with contiguous heads, head_dim % 16 == 0, "
                         "and fp32 cos/sin tables")
    q_out = torch.empty(rows, hq, d, dtype=torch.bfloat16)
    k_out = torch.empty(rows, hk, d, dtype=torch.bfloat16)
    pos = positions.to(torch.int64).contiguous()
    qw = q_weight.data_ptr() if q_weight is not None else None
    kw = k_weight.data_ptr() if k_weight is not None else None
    _c_row_ops_library().qk_norm_rope(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), q_out.data_ptr(),
                                          k_out.data_ptr(), rows, hq, hk, d, pos.data_ptr(), cos_cache.data_ptr(),
                                          sin_cache.data_ptr(), qw, kw, eps, torch.get_num_threads())
    return q_out, k_out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """model.py's silu_and_mul for gate_up [rows, 2n] contiguous, in C."""
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    if not (_rows_ok(gate_up, n) and gate_up.is_contiguous()):
        raise ValueError("the C silu_and_mul takes contiguous bf16 [rows, 2n] with n % 16 == 0")
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    _c_row_ops_library().silu_and_mul(gate_up.data_ptr(), out.data_ptr(), rows, n, _silu_table().data_ptr(),
                                          torch.get_num_threads())
    return out


# --------------------------------------------------------------------------- C argmax (CPU, bf16)
#
# Greedy sampling is an argmax over each row of logits. torch's argmax reads
# fp32 logits at ~4 GB/s here and bf16 ones at a third of that, and the fp32
# copy of bf16 logits is itself a pass over memory. The argmax of bf16 values is
# the argmax of their (exact) fp32 copies, so argmax_rows reads the model's bf16
# logits once, 16 lanes at a time, with torch's rules: the first index of the
# largest value, the first NaN where a row has one.
# Measured (2-core Zen 4, medians, outputs equal): W0's 256 x 32000 logits,
# .float().argmax() 5.59 ms -> 0.55 ms; W1's 64 x 151936, 6.06 -> 0.64 ms.

_ARGMAX_C = r"""
void argmax_rows(const uint16_t *x, int64_t rows, int64_t n, int64_t ld, int64_t *out, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *p = x + r * ld;
        /* per lane: the largest value so far and its first index */
        __m512 best = _mm512_set1_ps(-INFINITY);
        __m512i best_i = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8,
                                                                        9, 10, 11, 12, 13, 14, 15);
        __mmask16 nan = 0;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            const __m512 v = load_bf16x16(p + i);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            best = _mm512_mask_mov_ps(best, gt, v);
            best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
        }
        /* across lanes: the largest value, the smallest index that holds it */
        float m = _mm512_reduce_max_ps(best);
        int64_t arg = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ),
                                                   best_i);
        if (m == -INFINITY) arg = 0;  /* no lane moved: every value so far is -inf */
        for (; i < n; i++) {  /* the ragged end */
            const float f = bf16_to_f32(p[i]);
            if (f != f) { nan = 1; break; }
            if (f > m) { m = f; arg = i; }
        }
        if (nan)  /* torch's argmax takes NaN as the largest: the first one wins */
            for (i = 0; i < n; i++)
                if ((p[i] & 0x7fff) > 0x7f80) { arg = i; break; }
        out[r] = arg;
    }
}
"""


def _run_c_argmax(logits: torch.Tensor) -> torch.Tensor:
    if logits.dtype != torch.bfloat16 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("the avx512 argmax takes a bf16 [rows, vocab] tensor with unit stride over the vocab")
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _c_row_ops_library().argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0),
                                    out.data_ptr(), torch.get_num_threads())
    return out


# --------------------------------------------------------------------------- Triton kernels
#
# The attention kernel walks the context in tiles of BLOCK_N key positions and
# looks up each position's physical block in the block table, instead of taking
# one KV block per step: tl.dot needs every dimension >= 16, so a block_size of 8
# could not be a tile on its own, and this way the tile size is a tuning knob that
# does not depend on the cache layout.
#
# One program owns a tile of BLOCK_Q query tokens of one sequence times the
# GROUP (= num_heads // num_kv_heads) query heads that share a KV head, flattened
# to BLOCK_M rows (row r = token r // GROUP, head r % GROUP). Each K/V tile is
# thus loaded once for all heads of its group, and the same code serves a
# prefill chunk (many tokens) and a decode (one token, GROUP rows).

# Tile sizes and split-KV thresholds, measured on an H200 in bf16 (benchmarks/
# triton_gpu.py, RESULTS.md "Triton kernels on an H200"):
_BLOCK_N_DECODE = 32        # key positions per inner-loop step, all-decode batches
_BLOCK_M_DECODE = 16        # rows of a tile when the batch is all decodes (tl.dot minimum)
# Batches with multi-token chunks: tiles of 64 rows x 32 keys, or 128 x 64 where
# the sequences average >= 256 tokens this step. Measured (Qwen3-0.6B heads):
# 128 x 64 wins on long chunks (a 16k-token prompt 5.02 -> 4.24 ms; 8 x 1024-token
# chunks 0.82 -> 0.73 ms) but loses where decodes fill the batch, each decode
# wasting most of a big tile (64 decodes + one 2048-token chunk 0.50 -> 0.62 ms;
# 256 decodes + one chunk 0.98 -> 1.45 ms); the two tie at ~400 tokens a sequence.
# head_dim 256 keeps 64 x 32: a 128-row fp32 accumulator would not fit in registers.
_BLOCK_M_CHUNK, _BLOCK_N_CHUNK = 64, 32
_BLOCK_M_PREFILL, _BLOCK_N_PREFILL = 128, 64
_PREFILL_TILE_MIN_TOKENS_PER_SEQ = 256
# Split-KV: an all-decode batch has only num_seqs * num_kv_heads programs, each
# walking its whole context; too few leave most of the GPU's 132 SMs idle.
# Splitting each context into partitions multiplies the programs (a reduce kernel
# merges them). Measured over 1..256 sequences x 1k..16k contexts, splits 1..32:
# splitting until there are ~1024 programs (~8 per SM) was within 2% of the best
# split wherever the batch held >= 268 MB of KV (64 seqs x 16k: 1.36 -> 1.17 ms
# with 2 splits; 1 seq x 16k: 0.78 -> 0.07 ms with 32), and 256 seqs (2048
# programs) gain nothing from a split. Below ~0.15 ms a call is launch-bound.
_SPLIT_KV_MIN_PARTITION = 512   # never split a context finer than this (tokens)
_SPLIT_KV_MAX_SPLITS = 32
_SPLIT_KV_TARGET_PROGRAMS = 1024

if triton is not None:

    @triton.jit
    def _store_kvcache_kernel(
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
        k_stride_t, k_stride_h, k_stride_d,
        v_stride_t, v_stride_h, v_stride_d,
        kc_stride_b, kc_stride_s, kc_stride_h, kc_stride_d,
        vc_stride_b, vc_stride_s, vc_stride_h, vc_stride_d,
        num_kv_heads, block_size,
        HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        """One program per token: copy its [num_kv_heads, head_dim] K and V rows."""
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        if slot < 0:  # padding token: write nothing
            return
        block, offset = slot // block_size, slot % block_size
        h = tl.arange(0, HEADS_PAD)[:, None]
        d = tl.arange(0, HEAD_DIM)[None, :]
        # (d < HEAD_DIM) is always true; it gives the mask the full [heads, dim]
        # shape, which Triton's CPU interpreter needs for a masked load.
        mask = (h < num_kv_heads) & (d < HEAD_DIM)
        k = tl.load(key_ptr + t * k_stride_t + h * k_stride_h + d * k_stride_d, mask=mask)
        v = tl.load(value_ptr + t * v_stride_t + h * v_stride_h + d * v_stride_d, mask=mask)
        kc = (k_cache_ptr + block * kc_stride_b + offset * kc_stride_s
              + h * kc_stride_h + d * kc_stride_d)
        vc = (v_cache_ptr + block * vc_stride_b + offset * vc_stride_s
              + h * vc_stride_h + d * vc_stride_d)
        tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
        """The sequence owning query tile `tile`. Sequence i owns tiles from
        query_start_loc[i] // BLOCK_Q + i on: that numbering needs no host sync
        (a grid of num_tokens // BLOCK_Q + num_seqs always covers every sequence's
        ceil(q_len / BLOCK_Q) tiles) and is strictly increasing, so a binary search
        finds the last sequence whose first tile is <= tile."""
        lo = tl.full([], 0, tl.int32)  # tensors, not constexprs: they are loop-carried
        hi = lo + num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            if first <= tile:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @triton.jit
    def _paged_attention_kernel(
        out_ptr, query_ptr, k_cache_ptr, v_cache_ptr,
        block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        m_part_ptr, l_part_ptr, acc_part_ptr,
        scale, num_seqs, num_heads, block_size, partition_size,
        q_stride_t, q_stride_h, q_stride_d,
        o_stride_t, o_stride_h, o_stride_d,
        kc_stride_b, kc_stride_s, kc_stride_h, kc_stride_d,
        vc_stride_b, vc_stride_s, vc_stride_h, vc_stride_d,
        bt_stride_s, bt_stride_b,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Grid (query tiles, kv heads, splits). With NUM_SPLITS == 1 a program
        walks its tile's whole visible context and writes the output; otherwise it
        walks partition `split` only and writes its running max / sum / accumulator
        for _split_kv_reduce_kernel to merge."""
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq = _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        q_tile_start = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
        if q_tile_start >= q_len:  # spare program of the over-sized grid
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - q_len  # tokens cached before this step

        rows = tl.arange(0, BLOCK_M)
        q_idx = q_tile_start + rows // GROUP                   # token within this step
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
        q_pos = context_len + q_idx                            # its position in the sequence
        token = (q_start + q_idx).to(tl.int64)
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(query_ptr + token[:, None] * q_stride_t + head[:, None] * q_stride_h
                    + d[None, :] * q_stride_d, mask=row_ok[:, None], other=0.0)

        # Keys 0 .. (last query of the tile's position) are visible to some row.
        num_keys = context_len + tl.minimum(q_tile_start + BLOCK_Q, q_len)
        lo = split * partition_size
        hi = tl.minimum(num_keys, lo + partition_size)

        qk_scale = scale * 1.4426950408889634  # softmax in base 2: exp2 is cheaper than exp
        # A finite floor instead of -inf keeps fully masked rows at exp2(-inf - m) = 0
        # rather than NaN, without a branch.
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        kv_off_h = kv_head.to(tl.int64)
        for start in range(lo, hi, BLOCK_N):
            k_pos = start + tl.arange(0, BLOCK_N)
            k_ok = k_pos < hi  # never read past seq_len: the rest of a block is garbage
            block = tl.load(block_tables_ptr + seq.to(tl.int64) * bt_stride_s
                            + (k_pos // block_size) * bt_stride_b,
                            mask=k_ok, other=0).to(tl.int64)
            offset = k_pos % block_size
            k = tl.load(k_cache_ptr + block[None, :] * kc_stride_b + offset[None, :] * kc_stride_s
                        + kv_off_h * kc_stride_h + d[:, None] * kc_stride_d,
                        mask=k_ok[None, :], other=0.0)          # [HEAD_DIM, BLOCK_N]
            v = tl.load(v_cache_ptr + block[:, None] * vc_stride_b + offset[:, None] * vc_stride_s
                        + kv_off_h * vc_stride_h + d[None, :] * vc_stride_d,
                        mask=k_ok[:, None], other=0.0)          # [BLOCK_N, HEAD_DIM]
            s = tl.dot(q, k.to(q.dtype), input_precision=PRECISION) * qk_scale
            visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        if NUM_SPLITS == 1:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i is 0 only on unused rows
            tl.store(out_ptr + token[:, None] * o_stride_t + head[:, None] * o_stride_h
                     + d[None, :] * o_stride_d, o.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None])
        else:  # partials are contiguous [num_tokens, num_heads, NUM_SPLITS(, HEAD_DIM)]
            part = (token * num_heads + head) * NUM_SPLITS + split
            tl.store(m_part_ptr + part, m_i, mask=row_ok)
            tl.store(l_part_ptr + part, l_i, mask=row_ok)
            tl.store(acc_part_ptr + part[:, None] * HEAD_DIM + d[None, :], acc,
                     mask=row_ok[:, None])

    @triton.jit
    def _split_kv_reduce_kernel(
        out_ptr, m_part_ptr, l_part_ptr, acc_part_ptr,
        o_stride_t, o_stride_h, o_stride_d, num_heads,
        NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        """One program per (token, head): rescale each split's partial sums to the
        global max and add them up."""
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        sp = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, HEAD_DIM)
        part = (token * num_heads + head) * NUM_SPLITS + sp
        ok = sp < NUM_SPLITS
        m = tl.load(m_part_ptr + part, mask=ok, other=-1.0e30)
        l = tl.load(l_part_ptr + part, mask=ok, other=0.0)
        acc = tl.load(acc_part_ptr + part[:, None] * HEAD_DIM + d[None, :],
                      mask=ok[:, None], other=0.0)
        w = tl.exp2(m - tl.max(m, 0))  # splits that saw no key have m = -1e30: weight 0
        o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(out_ptr + token * o_stride_t + head * o_stride_h + d * o_stride_d,
                 o.to(out_ptr.dtype.element_ty))


def _check_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"the Triton kernels need head_dim to be a power of two >= 16 "
                         f"(tl.arange and tl.dot), got {head_dim}")


def _check_kv(key, value, k_cache, v_cache) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if key is not None and (key.shape != value.shape or key.dim() != 3
                            or key.shape[1:] != k_cache.shape[2:]):
        raise ValueError(f"key and value must be [num_tokens, {k_cache.shape[2]}, "
                         f"{k_cache.shape[3]}], got {tuple(key.shape)} and {tuple(value.shape)}")
    _check_head_dim(k_cache.shape[3])


def store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping) -> None:
    _check_kv(key, value, k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        num_kv_heads, k_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
    )


def _tile_shape(all_decodes: bool, num_tokens: int, num_seqs: int, head_dim: int,
                group: int) -> tuple[int, int]:
    """(BLOCK_M rows, BLOCK_N keys) of the attention tiles for this batch."""
    if all_decodes:
        block_m, block_n = _BLOCK_M_DECODE, _BLOCK_N_DECODE
    elif head_dim <= 128 and num_tokens >= _PREFILL_TILE_MIN_TOKENS_PER_SEQ * num_seqs:
        block_m, block_n = _BLOCK_M_PREFILL, _BLOCK_N_PREFILL
    else:
        block_m, block_n = _BLOCK_M_CHUNK, _BLOCK_N_CHUNK
    return max(block_m, triton.next_power_of_2(group)), block_n


def _num_kv_splits(all_decodes: bool, num_seqs: int, num_kv_heads: int,
                   max_context: int) -> int:
    """How many partitions to split each context into (1 = no split-KV): enough
    for ~_SPLIT_KV_TARGET_PROGRAMS programs, none shorter than the minimum.
    max_context is the block table's capacity, a host-side bound: reading the
    real seq_lens would cost a device sync per layer."""
    if not all_decodes:
        return 1
    wanted = -(-_SPLIT_KV_TARGET_PROGRAMS // (num_seqs * num_kv_heads))
    return max(1, min(wanted, _SPLIT_KV_MAX_SPLITS, max_context // _SPLIT_KV_MIN_PARTITION))


def paged_attention_triton(query, k_cache, v_cache, block_tables, seq_lens,
                           query_start_loc, scale, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out``, if given, receives the result (benchmarks/triton_gpu.py passes one
    filled with NaN to check that every element is written)."""
    _check_kv(None, None, k_cache, v_cache)
    if query.dim() != 3 or query.shape[2] != k_cache.shape[3]:
        raise ValueError(f"query must be [num_tokens, num_heads, {k_cache.shape[3]}], "
                         f"got {tuple(query.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of "
                         f"num_kv_heads ({num_kv_heads})")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.dim() != 2 \
            or block_tables.shape[0] != num_seqs:
        raise ValueError(f"need block_tables [{num_seqs}, max_blocks] and query_start_loc "
                         f"[{num_seqs + 1}], got {tuple(block_tables.shape)} and "
                         f"{tuple(query_start_loc.shape)}")
    out = torch.empty_like(query) if out is None else out
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    # num_tokens == num_seqs means every q_len is 1 (each sequence has >= 1 token);
    # the kernel is correct for any tile shape, this only picks the cheaper one.
    all_decodes = num_tokens == num_seqs
    block_m, block_n = _tile_shape(all_decodes, num_tokens, num_seqs, head_dim, group)
    block_q = block_m // group
    num_splits = _num_kv_splits(all_decodes, num_seqs, num_kv_heads,
                                block_tables.shape[1] * block_size)
    return _launch_attention(query, k_cache, v_cache, block_tables, seq_lens,
                             query_start_loc, scale, out, block_m, block_q, num_splits, block_n)


def _launch_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                      scale, out, block_m, block_q, num_splits, block_n: int = _BLOCK_N_DECODE,
                      **launch_options) -> torch.Tensor:
    """``block_n`` and ``launch_options`` (Triton's num_warps, num_stages) are
    the knobs benchmarks/triton_gpu.py sweeps; the engine keeps the defaults."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    max_context = block_tables.shape[1] * k_cache.shape[1]
    # Partitions are whole BLOCK_N tiles so only the last one has a ragged end.
    partition = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
    if num_splits > 1:
        m_part = query.new_empty((num_tokens, num_heads, num_splits), dtype=torch.float32)
        l_part = torch.empty_like(m_part)
        acc_part = query.new_empty((num_tokens, num_heads, num_splits, head_dim),
                                   dtype=torch.float32)
    else:  # unused by the kernel; any tensor will do as a pointer
        m_part = l_part = acc_part = out
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        m_part, l_part, acc_part,
        float(scale), num_seqs, num_heads, k_cache.shape[1], partition,
        *query.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
        *block_tables.stride(),
        GROUP=num_heads // num_kv_heads, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
        # fp32 inputs get exact fp32 products, not TF32: fp32 is the precise path.
        PRECISION="ieee" if query.dtype == torch.float32 else None,
        **launch_options,
    )
    if num_splits > 1:
        _split_kv_reduce_kernel[(num_tokens, num_heads)](
            out, m_part, l_part, acc_part, *out.stride(), num_heads,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
        )
    return out


# --------------------------------------------------------------------------- dispatch

def store_kvcache(key, value, k_cache, v_cache, slot_mapping, backend=None) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into the caches."""
    picked = _pick(backend, key)
    if picked == "triton":
        store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping)
    elif picked == "avx512":
        _run_c_store(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kvcache_torch(key, value, k_cache, v_cache, slot_mapping)


def argmax(logits: torch.Tensor, backend=None) -> torch.Tensor:
    """Greedy sampling: each row's index of its largest logit (int64 [rows]);
    ``backend="avx512"`` reads bf16 logits in C, else torch's argmax, the twin."""
    if _pick(backend, logits) == "avx512":
        return _run_c_argmax(logits)
    return logits.float().argmax(dim=-1)  # torch's bf16 argmax is 3x slower than the copy + fp32's


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                    scale, backend=None) -> torch.Tensor:
    """Attention of each query token over its sequence's paged context."""
    if _pick(backend, query) == "triton":
        return paged_attention_triton(query, k_cache, v_cache, block_tables, seq_lens,
                                      query_start_loc, scale)
    return paged_attention_torch(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                 scale, decode_kernel=backend if backend in ("inductor", "avx512") else None)
