"""Kernels layer: the attention kernels, in Triton and in pure torch.

This module owns two functions and nothing else (no state):

* ``store_kvcache`` writes the step's new K and V into the paged KV cache at
  ``slot_mapping`` (a slot of -1 is padding and is skipped);
* ``paged_attention`` is one unified kernel for prefill chunks and decodes:
  query token ``j`` of a sequence whose step has ``q_len`` tokens sits at
  position ``seq_len - q_len + j`` and attends to positions ``0 .. that`` through
  the sequence's block table (causal inside the chunk, full over the prefix).

Each has a Triton kernel and a pure-torch twin that computes the same function.
The twin is the test oracle and the CPU execution path; the Triton kernels run
on CUDA tensors (and on the CPU under ``TRITON_INTERPRET=1`` in the tests).
``backend=None`` is the one dispatch point: Triton for CUDA tensors, torch else.

Shapes (vLLM's names):
  query            [num_tokens, num_heads, head_dim]
  k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
  block_tables     int32 [num_seqs, max_blocks]
  seq_lens         int32 [num_seqs]      context length after this step
  query_start_loc  int32 [num_seqs + 1]  where each sequence's tokens start in query
  slot_mapping     int64 [num_tokens]    block_id * block_size + offset, -1 = skip
"""
from __future__ import annotations

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
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'triton', 'torch' or None, got {backend!r}")
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
    """[..., n_blocks] block ids -> [..., n_blocks * block_size, kv_heads, head_dim]."""
    blocks = cache[block_table.long()]
    return blocks.flatten(-4, -3)


def paged_attention_torch(query, k_cache, v_cache, block_tables, seq_lens,
                          query_start_loc, scale) -> torch.Tensor:
    """Reference paged attention. Decodes (q_len == 1) run as one batched
    matmul over a padded context; each multi-token chunk runs on its own. The
    Python loop is per prefill chunk, never per token."""
    out = torch.empty_like(query)
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    if decodes:
        _decode_attention(query, k_cache, v_cache, block_tables, starts, lens,
                          decodes, scale, block_size, out)
    for i, q_len in enumerate(q_lens):
        if q_len > 1:
            _chunk_attention(query, k_cache, v_cache, block_tables[i], starts[i],
                             q_len, lens[i], scale, block_size, out)
    return out


def _decode_attention(query, k_cache, v_cache, block_tables, starts, lens, seqs,
                      scale, block_size, out) -> None:
    idx = torch.tensor(seqs, device=query.device)
    ctx = torch.tensor([lens[i] for i in seqs], device=query.device)
    n_blocks = (int(ctx.max()) + block_size - 1) // block_size
    table = block_tables[idx, :n_blocks]
    k = _gather_kv(k_cache, table).transpose(1, 2)          # [n, kvh, ctx, d]
    v = _gather_kv(v_cache, table).transpose(1, 2)
    rows = torch.tensor([starts[i] for i in seqs], device=query.device)
    q = query[rows].unsqueeze(2)                              # [n, h, 1, d]
    key_pos = torch.arange(k.shape[2], device=query.device)
    mask = (key_pos[None, :] < ctx[:, None])[:, None, None, :]  # [n, 1, 1, ctx]
    o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                       scale=scale, enable_gqa=True)
    out[rows] = o.squeeze(2)


def _chunk_attention(query, k_cache, v_cache, block_table, start, q_len, seq_len,
                     scale, block_size, out) -> None:
    n_blocks = (seq_len + block_size - 1) // block_size
    k = _gather_kv(k_cache, block_table[:n_blocks])[:seq_len].transpose(0, 1)  # [kvh, ctx, d]
    v = _gather_kv(v_cache, block_table[:n_blocks])[:seq_len].transpose(0, 1)
    q = query[start:start + q_len].transpose(0, 1)                             # [h, q, d]
    if q_len == seq_len:  # fresh prefill: plain causal attention
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True,
                                           scale=scale, enable_gqa=True)
    else:  # a chunk after a cached prefix: query j sees keys 0 .. seq_len - q_len + j
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                           scale=scale, enable_gqa=True)
    out[start:start + q_len] = o.transpose(0, 1)


# --------------------------------------------------------------------------- Triton kernels
# (filled in below; see store_kvcache_triton / paged_attention_triton)


def store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping) -> None:
    raise NotImplementedError


def paged_attention_triton(query, k_cache, v_cache, block_tables, seq_lens,
                           query_start_loc, scale) -> torch.Tensor:
    raise NotImplementedError


# --------------------------------------------------------------------------- dispatch

def store_kvcache(key, value, k_cache, v_cache, slot_mapping, backend=None) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into the caches."""
    if _pick(backend, key) == "triton":
        store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kvcache_torch(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                    scale, backend=None) -> torch.Tensor:
    """Attention of each query token over its sequence's paged context."""
    if _pick(backend, query) == "triton":
        return paged_attention_triton(query, k_cache, v_cache, block_tables, seq_lens,
                                      query_start_loc, scale)
    return paged_attention_torch(query, k_cache, v_cache, block_tables, seq_lens,
                                 query_start_loc, scale)
