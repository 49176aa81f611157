"""Kernels layer: paged attention and the decoder's other per-token ops.

This module owns functions and nothing else (no state). Each op exists as a
pure-torch reference, the oracle of every faster version and the path of the
last resort, and where it pays as a Triton kernel:

* ``store_kvcache`` writes a step's new K and V into the paged KV cache at
  ``slot_mapping`` (a slot of -1 is padding and is skipped);
* ``paged_attention`` is one unified kernel for prefill chunks and decodes:
  query token ``j`` of a sequence whose step has ``q_len`` tokens sits at
  position ``seq_len - q_len + j`` and attends to positions ``0 .. that`` through
  the sequence's block table (causal inside the chunk, full over the prefix);
  GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``;
  V may be narrower than K (DeepSeek's MLA: ``v_cache`` is the first kv_lora_rank dims
  of the latent's one tensor, ``k_cache`` all of it): scores over K's width, the
  output V's width; per layer, optionally a sliding window, Gemma 2's soft cap on the
  scores and gpt-oss's attention sinks;
* ``rms_norm``, ``rotary``, ``silu_and_mul``, and Gemma's ``gelu_tanh_and_mul`` and
  ``gemma_rms_norm``: the pointwise work between the decoder's matmuls (torch
  references and Triton kernels; the CPU's live behind the seam);
* ``argmax``: greedy sampling; ``top_k_top_p``: the sampler's top-k/top-p mask (its reference is
  model.py's ``apply_top_k_top_p``, beside the rest of the sampler);
* ``fused_moe``: a mixture-of-experts MLP after routing, as one grouped GEMM per
  projection over the tokens sorted by expert (vLLM's fused_moe; Triton's is capture-safe),
  with gpt-oss's expert biases and clamped SwiGLU (``swigluoai``) where the backend takes them;
* ``wna16_matmul``: x @ an int4/int8 weight-only weight kept packed (GPTQ, AWQ, compressed-tensors W4A16/W8A16),
  dequantized a tile at a time (``wna16_matmul_triton``; its twin ``wna16_matmul_torch`` dequantizes it whole);
  ``fused_moe`` on experts kept so (``PackedExperts``): the same grouped GEMMs reading the codes
  (``fused_moe_triton``; its twin ``fused_moe_wna16_torch`` dequantizes the routed experts). Both are
  called by model.py's packed layers (WNA16Weight, FusedMoE), not through ``Backend``.

On a request's path: model.py's ``Attention.forward`` (and ``MLAAttention.forward``) calls
``store_kvcache`` then ``paged_attention`` through the ``Backend`` the model was built with,
and goes on to ``o_proj`` with the output; the sampler calls ``argmax`` and ``top_k_top_p``.
Read top to bottom: ``Backend`` -> the torch references -> the Triton kernels -> their
launchers (``*_triton``) -> ``probe_triton`` -> the two backends, ``TORCH`` and ``TRITON``.

The seam is ``Backend``: one object holding one implementation of each op.
model.py's ``select_backend`` picks one, called once at start-up by the engine
(and by each tensor-parallel worker); the model hands it to its layers; nothing
else chooses. ``TORCH`` is the references, ``TRITON`` the Triton kernels (CUDA
tensors; on the CPU under ``TRITON_INTERPRET=1`` in the tests). The CPU's
speed-ups (C kernels, torch.compile'd twins) are other ``Backend`` instances,
built in ``cpu_backend.py``; this file never needs them.

Shapes (vLLM's names):
  query            [num_tokens, num_heads, head_dim]
  k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim] (v_cache's last dim may be
                   narrower: MLA's kv_lora_rank of head_dim = kv_lora_rank + qk_rope_head_dim)
  block_tables     int32 [num_seqs, max_blocks]
  seq_lens         int32 [num_seqs]      context length after this step
  query_start_loc  int32 [num_seqs + 1]  where each sequence's tokens start in query
  slot_mapping     int64 [num_tokens]    block_id * block_size + offset, -1 = skip
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

try:  # Triton is optional on a CPU-only install; the torch references always work.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None


def weights_as_loaded(model: torch.nn.Module) -> int:
    """The references' and Triton's ``prepare_model``: nothing to change, no bytes added."""
    return 0


def nothing_to_compile(num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, max_context: int,
                       logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> None:
    """The references' ``warm_up``: eager torch compiles nothing."""


def no_moe_to_compile(w13: torch.Tensor, w2: torch.Tensor, top_k: int, **moe_kwargs) -> None:
    """The references' ``warm_up_moe``: nothing to compile either."""


def top_k_top_p_reference(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """The references' ``top_k_top_p``: the sampler's own, which sorts each top-p row."""
    from nanoserve.model import apply_top_k_top_p  # read with the Sampler; model.py imports this file
    return apply_top_k_top_p(logits, top_k, top_p)


@dataclass(frozen=True)
class Backend:
    """One implementation of every op a model step calls, and what it needs of
    the loaded weights (``prepare_model``, once, after loading; it returns the
    bytes it added to the weights' memory). Signatures:

    store_kvcache(key, value, k_cache, v_cache, slot_mapping) -> None
    paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                    sliding_window=None, logits_soft_cap=None, sinks=None) -> out
      (out [num_tokens, num_heads, v_cache's head_dim]: MLA's V is the first kv_lora_rank dims of
      the latent, a view of K's tensor, so its output is that wide;
      a window: each query sees its last sliding_window positions; a soft cap, Gemma 2's:
      each score s = scale * q.k becomes cap * tanh(s / cap) before the mask and softmax;
      sinks, gpt-oss's [heads]: a logit a head each softmax takes mass for, with no value;
      a backend whose kernel has no sinks is not chosen for a model with them)
    rms_norm(x [..., n], weight [n], eps) -> normalised x
    fused_add_rms_norm(x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)
    rotary(q [T, hq, d], k [T, hk, d], positions [T], cos_cache, sin_cache [max_positions, r]) -> (q, k)
      (r <= d: the first r dims of each head turn, the rest pass through: partial rotary)
    silu_and_mul(gate_up [T, 2n]) -> [T, n]
    gelu_tanh_and_mul(gate_up [T, 2n]) -> [T, n]  (Gemma's MLP: GELU, tanh approximation)
    gemma_rms_norm(x [..., n], weight [n] fp32, eps) -> Gemma's: x / rms(x) * weight in fp32, rounded once
    gemma_fused_add_rms_norm(x, residual, weight, eps) -> (gemma_rms_norm(x + residual), x + residual)
    argmax(logits [rows, vocab]) -> int64 [rows]
    top_k_top_p(logits [rows, vocab] fp32, top_k: list[int], top_p: list[float]) -> the logits with
      each row's tokens outside its top-k and top-p set to -inf (model.apply_top_k_top_p's masks, bit for bit)
    fused_moe(x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k],
              w13_bias=None [E, 2I], w2_bias=None [E, H], activation="silu", swiglu_alpha=1.702,
              swiglu_limit=7.0)
      -> [T, H]: a mixture-of-experts MLP once the router has chosen (vLLM's fused_experts);
      capture-safe in TRITON (ids are not range-checked: that would sync). The biases, and an
      activation other than silu (MOE_ACTIVATIONS: gpt-oss's swigluoai), only where
      ``fused_moe_biases`` (the CPU's fused_moe takes neither)

    ``warm_up(num_heads, k_cache, v_cache, max_context, logits_soft_cap=None, sinks=None)`` builds, before traffic,
    the attention variants that a step's shape alone would not reach in a
    throwaway step (Triton's split-KV counts, which grow with the context).
    ``warm_up_moe(w13, w2, top_k, **moe_kwargs)`` the same for a mixture-of-experts layer's fused_moe
    (Triton's large tile, which only a long prefill reaches), with the layer's biases and activation.

    ``capture_safe``: no op syncs with the host or allocates by the data, so a CUDA
    graph can capture a forward (the torch references read seq_lens on the host).
    """
    name: str
    store_kvcache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    gelu_tanh_and_mul: Callable[[torch.Tensor], torch.Tensor]
    gemma_rms_norm: Callable[..., torch.Tensor]
    gemma_fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    argmax: Callable[[torch.Tensor], torch.Tensor]
    fused_moe: Callable[..., torch.Tensor]
    prepare_model: Callable[[torch.nn.Module], int] = weights_as_loaded
    warm_up: Callable[..., None] = nothing_to_compile
    warm_up_moe: Callable[..., None] = no_moe_to_compile
    top_k_top_p: Callable[..., torch.Tensor] = top_k_top_p_reference
    capture_safe: bool = False
    fused_moe_biases: bool = False  # fused_moe takes the biases and activations of gpt-oss's experts


# =========================================================================== torch references

def store_kvcache_torch(key, value, k_cache, v_cache, slot_mapping) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    k_flat.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    if v_cache is not k_cache:  # one tensor for both (MLA's latent): written once
        v_flat.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[..., n_blocks] block ids -> [..., n_blocks * block_size, kv_heads, head_dim]."""
    blocks = cache.index_select(0, block_table.reshape(-1).long())
    return blocks.view(*block_table.shape[:-1], -1, *cache.shape[2:])


def gather_kv_pair(k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gather_kv of K and of V; where V is K itself (MLA's latent, paged_attention_torch), one gather."""
    k = gather_kv(k_cache, block_table)
    return k, (k[..., :v_cache.shape[3]] if value_in_key(k_cache, v_cache) else gather_kv(v_cache, block_table))


def value_in_key(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether V is K's own first dims (MLA's latent, or K itself): the same memory, laid out alike."""
    return (v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride()
            and v_cache.dtype == k_cache.dtype)


def paged_attention_torch(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                          scale, sliding_window: int | None = None,
                          logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: the step's decodes (q_len 1) in one batched SDPA call, each
    multi-token chunk in one of its own. With a sliding window a query at position
    p sees keys p - sliding_window + 1 .. p (transformers' and vLLM's window). With a
    soft cap or sinks (gpt-oss's, one logit a head: attend), the same written out. A V
    narrower than K gives an output as narrow: SDPA takes a value width of its own. MLA's (V the latent's
    first dims) attends with the whole latent as V and keeps V's dims: one gather, and SDPA's kernels for
    one width (a V gathered through the strided view took a CPU decode a quarter longer, a prefill more)."""
    if v_cache.shape[3] < k_cache.shape[3] and value_in_key(k_cache, v_cache):
        return paged_attention_torch(query, k_cache, k_cache, block_tables, seq_lens, query_start_loc, scale,
                                     sliding_window, logits_soft_cap, sinks)[..., :v_cache.shape[3]]
    out = query.new_empty(*query.shape[:2], v_cache.shape[3])
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    if decodes:
        rows = torch.tensor([starts[i] for i in decodes], device=query.device)
        idx = torch.tensor(decodes, device=query.device)
        out[rows] = decode_attention_torch(query[rows], k_cache, v_cache, block_tables[idx],
                                           seq_lens[idx], scale, sliding_window, logits_soft_cap, sinks)
    for i, q_len in enumerate(q_lens):
        if q_len > 1:
            chunk = slice(starts[i], starts[i] + q_len)
            out[chunk] = chunk_attention_torch(query[chunk], k_cache, v_cache, block_tables[i],
                                               lens[i], scale, sliding_window, logits_soft_cap, sinks)
    return out


def first_window_block(first_query: int, sliding_window: int | None, block_size: int) -> int:
    """The first block a window reads from a query at ``first_query`` on (0 without a window): those
    before hold keys no query sees, and may have gone back to the pool (kvcache's null block)."""
    return 0 if sliding_window is None else max(first_query - sliding_window + 1, 0) // block_size


def decode_attention_torch(query, k_cache, v_cache, block_tables, seq_lens, scale,
                           sliding_window: int | None = None, logits_soft_cap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [seqs, heads, d], one token per sequence at its last position: every
    context padded to the longest, the padding masked."""
    n, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    width = -(-int(seq_lens.max()) // block_size)
    first = first_window_block(int(seq_lens.min()) - 1, sliding_window, block_size)
    k, v = (x.transpose(1, 2)  # [n, kv_heads, ctx, d]
            for x in gather_kv_pair(k_cache, v_cache, block_tables[:, first:width]))
    # Each KV head's group of query heads as its rows of queries: one SDPA call
    # without copying K and V per query head.
    q = query.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    key_pos = torch.arange(first * block_size, width * block_size, device=query.device)[None, :]
    visible = key_pos < seq_lens[:, None]
    if sliding_window is not None:  # the query is at seq_len - 1
        visible &= key_pos >= seq_lens[:, None] - sliding_window
    sinks = None if sinks is None else sinks.view(num_kv_heads, num_heads // num_kv_heads, 1)  # q's rows
    o = attend(q, k.to(q.dtype), v.to(q.dtype), visible[:, None, None, :], scale, logits_soft_cap, sinks)
    return o.reshape(n, num_heads, v_cache.shape[3])


def chunk_attention_torch(query, k_cache, v_cache, block_table, seq_len: int, scale,
                          sliding_window: int | None = None, logits_soft_cap: float | None = None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [q_len, heads, d]: the last q_len tokens of a sequence of seq_len,
    causal among themselves, seeing all of the cached prefix (in the window)."""
    q_len, block_size = query.shape[0], k_cache.shape[1]
    n_blocks = -(-seq_len // block_size)
    first = first_window_block(seq_len - q_len, sliding_window, block_size)
    start = first * block_size
    k, v = (x[:seq_len - start].transpose(0, 1)[None]  # [1, kv_heads, ctx, d]
            for x in gather_kv_pair(k_cache, v_cache, block_table[first:n_blocks]))
    q = query.transpose(0, 1)[None]                                                  # [1, heads, q_len, d]
    plain = logits_soft_cap is None and sinks is None and (sliding_window is None or seq_len <= sliding_window)
    if q_len == seq_len and plain:  # plain causal: SDPA's fastest
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True, scale=scale,
                                           enable_gqa=True)
    else:
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        key_pos = torch.arange(start, seq_len, device=query.device)[None, :]
        visible = key_pos <= q_pos[:, None]
        if sliding_window is not None:
            visible &= key_pos > q_pos[:, None] - sliding_window
        o = attend(q, k.to(q.dtype), v.to(q.dtype), visible, scale, logits_soft_cap,
                   None if sinks is None else sinks.view(-1, 1, 1))
    return o[0].transpose(0, 1)


def attend(q, k, v, visible, scale, logits_soft_cap: float | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over q [..., heads, q_len, d] and k, v [..., kv_heads, ctx, d] (heads a multiple of
    kv_heads), ``visible`` a mask broadcast to the scores. SDPA has no soft cap: with one, the
    scores are written out as transformers' eager Gemma 2 attention computes them (in q's
    dtype, capped before the mask, the softmax in fp32). Nor sinks (gpt-oss's: ``sinks``
    broadcast to [..., heads, q_len, 1], a logit each row's softmax takes mass for but no value):
    with them, written out as transformers' eager GptOssAttention, the sink an extra column."""
    if logits_soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale,
                                              enable_gqa=q.shape[-3] != k.shape[-3])
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    s = q @ k.transpose(-1, -2) * scale
    if logits_soft_cap is not None:
        s = torch.tanh(s / logits_soft_cap) * logits_soft_cap
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is None:
        return s.softmax(-1, dtype=torch.float32).to(q.dtype) @ v
    sink = sinks.to(s.dtype).expand(*s.shape[:-1], 1)
    p = torch.cat([s, sink], dim=-1).softmax(-1, dtype=torch.float32)[..., :-1]
    return p.to(q.dtype) @ v


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' RMSNorm: normalise in fp32, scale in the model's dtype."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def gemma_rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' Gemma3RMSNorm: normalise and scale in fp32 (``weight`` holds 1 + w, in
    fp32), then round to the model's dtype once."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def add_rms_norm(rms_norm: Callable[..., torch.Tensor]) -> Callable:
    """A backend's fused_add_rms_norm from its rms_norm: the residual stream's sum
    in the model's dtype, then the norm of it (vLLM's fused_add_rms_norm)."""
    def fused_add_rms_norm(x, residual, weight, eps):
        residual = x + residual
        return rms_norm(residual, weight, eps), residual
    return fused_add_rms_norm


def rotary_torch(q, k, positions, cos_cache, sin_cache):
    """The neox-style rotary embedding (rotate halves) at each token's position;
    cos/sin tables [max_positions, rotary_dim] in fp32, applied in q's dtype. A
    rotary_dim below head_dim (Phi-4-mini's partial rotary) turns the first
    rotary_dim dims of each head and passes the rest through, as transformers does."""
    r = cos_cache.shape[-1]
    if r < q.shape[-1]:
        (q_rot, q_pass), (k_rot, k_pass) = (x.split([r, x.shape[-1] - r], dim=-1) for x in (q, k))
        q_rot, k_rot = rotary_torch(q_rot, k_rot, positions, cos_cache, sin_cache)
        return torch.cat((q_rot, q_pass), dim=-1), torch.cat((k_rot, k_pass), dim=-1)
    cos = cos_cache[positions].to(q.dtype).unsqueeze(1)  # [T, 1, head_dim]
    sin = sin_cache[positions].to(q.dtype).unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation: silu(gate) * up, gate and up side by side."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def act_and_mul_name(cfg) -> str:
    """The gated MLP's activation, as the Backend field that computes it: GELU's tanh approximation for
    hidden_act gelu_pytorch_tanh (Gemma's), else SiLU. The one place that decides it: the MLP takes that op,
    probe_triton launches it and the CPU backend builds a C kernel for it."""
    return "gelu_tanh_and_mul" if cfg.hidden_act == "gelu_pytorch_tanh" else "silu_and_mul"


def gelu_tanh_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma's gated MLP: gelu(gate) * up, GELU's tanh approximation (transformers' gelu_pytorch_tanh)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def swigluoai_and_mul_torch(gate_up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU (vLLM's swigluoai_and_mul, transformers' GptOssExperts._apply_gate): gate and
    up interleaved (columns 2j, 2j + 1), gate clamped above at limit, up both ways, then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


MOE_ACTIVATIONS = ("silu", "gelu_tanh", "swigluoai")  # fused_moe's (vLLM's names; gelu_tanh: Gemma's GELU)


def moe_act_torch(gate_up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """fused_moe_torch's activation, by its MOE_ACTIVATIONS name."""
    if activation == "swigluoai":
        return swigluoai_and_mul_torch(gate_up, alpha, limit)
    return gelu_tanh_and_mul_torch(gate_up) if activation == "gelu_tanh" else silu_and_mul_torch(gate_up)


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                    activation: str = "silu", swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> torch.Tensor:
    """The experts of a mixture-of-experts MLP, after routing: token t's output is
    sum_j topk_weights[t, j] * expert_e(x[t]) over its chosen e = topk_ids[t, j], each
    expert a gated MLP, w2[e] @ act(w13[e] @ x + w13_bias[e]) + w2_bias[e]; act silu(gate) * up
    over vLLM's w13 (gate rows, then up rows), or another of MOE_ACTIVATIONS (swigluoai: gpt-oss's,
    gate and up rows interleaved). Each expert runs once, on the tokens that chose it,
    and the weighted outputs are summed in fp32. Not capture-safe: which tokens
    chose which expert is read on the host."""
    _check_moe_options(w13, w2, w13_bias, w2_bias, activation)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)        # the (token, choice) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    tokens = order // topk_ids.shape[1]
    weights = topk_weights.reshape(-1)[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        h = moe_act_torch(F.linear(x[rows], w13[e], None if w13_bias is None else w13_bias[e]), activation,
                          swiglu_alpha, swiglu_limit)
        y = F.linear(h, w2[e], None if w2_bias is None else w2_bias[e])
        out.index_add_(0, rows, y.float() * weights[start:start + n, None].float())
        start += n
    return out.to(x.dtype)


def argmax_torch(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().argmax(dim=-1)  # on the CPU the fp32 copy + argmax beats a bf16 argmax


def argmax_cuda(logits: torch.Tensor) -> torch.Tensor:
    # no fp32 copy of [rows, vocab]: an upcast is exact, so the index (first of ties) is the same
    return logits.argmax(dim=-1)


# Weight-only int4/int8 linear (vLLM's WNA16: GPTQ, AWQ, compressed-tensors W4A16/W8A16), in the one layout
# model.WNA16Linear converts all three formats to at load:
#   qweight int32 [ceil(K / p), N], p = 32 // bits codes a word along K (GPTQ's): the code of weight (k, n)
#           is bits [(k % p) * bits, (k % p + 1) * bits) of word [k // p, n], unsigned;
#   scales  [G, N] (fp16 where the checkpoint's scales are exact in it, else fp32) and zeros [G, N] (unsigned
#           codes, uint8 or int16: GPTQ v1's 8-bit zero may be 256; a symmetric scheme's midpoint stored too);
#   group   of input row k: g_idx[k] where given (act-order), else (k + k_off) // group_size (k_off: where a
#           tensor-parallel shard's first column falls inside its group).
# The weight is (code - zero) * scale in fp32, rounded once to x's dtype (the dequantized path's value, so
# the two paths compute with the same weights); the products are summed in fp32.

def wna16_unpack(qweight: torch.Tensor, bits: int, K: int) -> torch.Tensor:
    """The codes [K, N] (int32) of a qweight."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    codes = (qweight.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)
    return codes.flatten(0, 1)[:K]


def wna16_groups(K: int, group_size: int, k_off: int, g_idx: torch.Tensor | None, device) -> torch.Tensor:
    return g_idx.long() if g_idx is not None else (torch.arange(K, device=device) + k_off) // group_size


def wna16_weight_torch(qweight, scales, zeros, g_idx, bits: int, group_size: int, k_off: int, K: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """The dequantized weight [K, N] in ``dtype``."""
    g = wna16_groups(K, group_size, k_off, g_idx, qweight.device)
    return ((wna16_unpack(qweight, bits, K).float() - zeros[g].float()) * scales[g].float()).to(dtype)


def wna16_matmul_torch(x, qweight, scales, zeros, g_idx, bits: int, group_size: int, k_off: int) -> torch.Tensor:
    """x [M, K] @ the dequantized weight: the Triton kernel's oracle, and the CPU's packed path (it
    dequantizes the whole weight every call: memory-lean between calls, not fast)."""
    return x @ wna16_weight_torch(qweight, scales, zeros, g_idx, bits, group_size, k_off, x.shape[-1], x.dtype)


@dataclass(frozen=True)
class PackedExperts:
    """One projection of a mixture-of-experts layer's experts kept packed: each expert's weight [N, K] in the
    layout above, stacked over the E experts: ``qweight`` int32 [E, ceil(K / p), N], ``scales`` and ``zeros``
    [E, G, N] (contiguous), input row k's group (k + k_off) // group_size for every expert. No act-order
    (g_idx): vLLM's fused MoE refuses it, and model.py keeps such experts dequantized."""
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    k_off: int
    in_features: int  # K: the last word's codes past it are padding

    @property
    def shape(self) -> tuple[int, int, int]:
        """[E, N, K], the shape of the dequantized stack (fused_moe's w13 or w2) it stands for."""
        return self.qweight.shape[0], self.qweight.shape[2], self.in_features

    def dequantize(self, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The weights [len(experts), N, K] of these experts in ``dtype`` (wna16_weight_torch's, transposed)."""
        return torch.stack([wna16_weight_torch(self.qweight[e], self.scales[e], self.zeros[e], None, self.bits,
                                               self.group_size, self.k_off, self.in_features, dtype).T
                            for e in experts.tolist()]) if experts.numel() else \
            torch.empty(0, *self.shape[1:], dtype=dtype, device=self.qweight.device)


def fused_moe_wna16_torch(x: torch.Tensor, w13: PackedExperts, w2: PackedExperts, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """fused_moe_torch on packed experts: the experts some token chose dequantized (only those: the memory
    of k experts, not E), renumbered, then fused_moe_torch. fused_moe_triton's oracle on PackedExperts, and
    the CPU's packed path (it dequantizes every call: memory-lean between calls, not fast)."""
    _check_moe(x, w13, w2, topk_weights, topk_ids)
    used, ids = torch.unique(topk_ids, return_inverse=True)
    return fused_moe_torch(x, w13.dequantize(used, x.dtype), w2.dequantize(used, x.dtype), topk_weights,
                           ids.view(topk_ids.shape), activation=activation)


# =========================================================================== Triton kernels
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
#
# Tile sizes and split-KV thresholds were tuned on an H200 in bf16
# (benchmarks/triton_gpu.py; the measurements are in benchmarks/RESULTS.md,
# "Triton kernels on an H200").
_BLOCK_N_DECODE = 32        # key positions per inner-loop step, all-decode batches
_BLOCK_M_DECODE = 16        # rows of a tile when the batch is all decodes (tl.dot minimum)
# Batches with multi-token chunks: 64 x 32 tiles, or 128 x 64 where the sequences
# average >= 256 tokens this step (big tiles win on long chunks, lose where decodes
# fill the batch). head_dim 256 keeps 64 x 32: a 128-row fp32 accumulator would not
# fit in registers.
_BLOCK_M_CHUNK, _BLOCK_N_CHUNK = 64, 32
_BLOCK_M_PREFILL, _BLOCK_N_PREFILL = 128, 64
_PREFILL_TILE_MIN_TOKENS_PER_SEQ = 256
# Heads wider than 256 (MLA's 512-wide latent): vLLM's tile for it (BLOCK_H 16, BLOCK_N 32), every
# batch; untuned here (no GPU run has measured it).
_BLOCK_M_WIDE, _BLOCK_N_WIDE = 16, 32
# Split-KV: an all-decode batch has only num_seqs * num_kv_heads programs, each
# walking its whole context; too few leave most SMs idle. Splitting each context
# into partitions multiplies the programs (a reduce kernel merges them): split
# until there are ~1024 programs, never finer than 512 tokens a partition. Split
# counts are powers of two, so warm-up can compile every one before traffic.
_SPLIT_KV_MIN_PARTITION = 512   # never split a context finer than this (tokens)
_SPLIT_KV_MAX_SPLITS = 32
_SPLIT_KV_TARGET_PROGRAMS = 1024
_NO_WINDOW = 2**30  # the kernel's window without a sliding window: past any context (an int32)
# Fused MoE (vLLM's fused_moe): tiles of BLOCK_M (token, choice) pairs of one expert times
# BLOCK_N output columns, BLOCK_K deep. Untuned: vLLM's default shapes for bf16 on an H100,
# not measured here. 64-row tiles once the average expert has 64 pairs to fill one (a large
# prefill); 16 rows (tl.dot's least) otherwise, where most of a tile would be padding.
_MOE_BLOCK_M_SMALL, _MOE_BLOCK_M_LARGE = 16, 64
_MOE_BLOCK_N, _MOE_BLOCK_K = 64, 32
# The WNA16 matmul: 16-row tiles (tl.dot's least) up to 16 rows of x (decodes), 64 beyond; 64 output columns
# and 32 input rows a step. Untuned: no GPU run has measured it.
_WNA16_BLOCK_M_SMALL, _WNA16_BLOCK_M_LARGE, _WNA16_BLOCK_N, _WNA16_BLOCK_K = 16, 64, 64, 32

if triton is not None:

    @triton.jit
    def _store_kvcache_kernel(
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
        k_stride_t, k_stride_h, k_stride_d,
        v_stride_t, v_stride_h, v_stride_d,
        kc_stride_b, kc_stride_s, kc_stride_h, kc_stride_d,
        vc_stride_b, vc_stride_s, vc_stride_h, vc_stride_d,
        num_kv_heads, block_size,
        HEADS_PAD: tl.constexpr, MAIN: tl.constexpr, MAIN_PAD: tl.constexpr, REST: tl.constexpr,
        REST_PAD: tl.constexpr, ONE_CACHE: tl.constexpr,
    ):
        """One program per token: copy its [num_kv_heads, MAIN + REST] K and V rows (ONE_CACHE: K's
        only, the caches being one tensor, MLA's latent). A row is copied in the parts _head_parts
        splits it into, each padded to a power of two (*_PAD): MLA's 576 as 512 + 64, not 1024."""
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        if slot < 0:  # padding token: write nothing
            return
        block, offset = slot // block_size, slot % block_size
        k_src, v_src = key_ptr + t * k_stride_t, value_ptr + t * v_stride_t
        k_dst = k_cache_ptr + block * kc_stride_b + offset * kc_stride_s
        v_dst = v_cache_ptr + block * vc_stride_b + offset * vc_stride_s
        _copy_heads(k_src, k_dst, num_kv_heads, k_stride_h, k_stride_d, kc_stride_h, kc_stride_d, 0, MAIN,
                    MAIN_PAD, HEADS_PAD)
        if REST > 0:
            _copy_heads(k_src, k_dst, num_kv_heads, k_stride_h, k_stride_d, kc_stride_h, kc_stride_d, MAIN, REST,
                        REST_PAD, HEADS_PAD)
        if not ONE_CACHE:
            _copy_heads(v_src, v_dst, num_kv_heads, v_stride_h, v_stride_d, vc_stride_h, vc_stride_d, 0, MAIN,
                        MAIN_PAD, HEADS_PAD)
            if REST > 0:
                _copy_heads(v_src, v_dst, num_kv_heads, v_stride_h, v_stride_d, vc_stride_h, vc_stride_d, MAIN,
                            REST, REST_PAD, HEADS_PAD)

    @triton.jit
    def _copy_heads(src, dst, num_heads, s_stride_h, s_stride_d, d_stride_h, d_stride_d, FIRST: tl.constexpr,
                    WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr, HEADS_PAD: tl.constexpr):
        """dims FIRST .. FIRST + WIDTH of each head's row, src to dst (cast to dst's dtype). The mask has the
        full [heads, dims] shape even where (d < ...) is always true: the CPU interpreter needs that."""
        h = tl.arange(0, HEADS_PAD)[:, None]
        d = FIRST + tl.arange(0, WIDTH_PAD)[None, :]
        mask = (h < num_heads) & (d < FIRST + WIDTH)
        x = tl.load(src + h * s_stride_h + d * s_stride_d, mask=mask)
        tl.store(dst + h * d_stride_h + d * d_stride_d, x.to(dst.dtype.element_ty), mask=mask)

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

    def _paged_attention_kernel(
        out_ptr, query_ptr, k_cache_ptr, v_cache_ptr,
        block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        m_part_ptr, l_part_ptr, acc_part_ptr, sinks_ptr,
        scale, num_seqs, num_heads, block_size, min_partition, window, soft_cap,
        q_stride_t, q_stride_h, q_stride_d,
        o_stride_t, o_stride_h, o_stride_d,
        kc_stride_b, kc_stride_s, kc_stride_h, kc_stride_d,
        vc_stride_b, vc_stride_s, vc_stride_h, vc_stride_d,
        bt_stride_s, bt_stride_b,
        GROUP: tl.constexpr, HEADS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, SOFT_CAP: tl.constexpr = False,
        SINKS: tl.constexpr = False, ROPE_DIM: tl.constexpr = 0, ROPE_PAD: tl.constexpr = 16,
        ONE_CACHE: tl.constexpr = False,
    ):
        """Grid (query tiles, kv heads x head blocks, splits). A program's rows are BLOCK_Q
        tokens times HEADS of its KV head's GROUP query heads (HEADS = GROUP but for MLA's many
        heads on one wide latent, which take blocks of HEADS). With NUM_SPLITS == 1 a program
        walks its tile's whole visible context and writes the output; otherwise it
        walks partition `split` of it only and writes its running max / sum /
        accumulator for _split_kv_reduce_kernel to merge. A query at position p sees
        keys p - window + 1 .. p (window: the sliding window, else past any context).

        The tile's head dimension is HEAD_DIM_PAD, HEAD_DIM's next power of two (tl.arange's
        and tl.dot's need): a padded head (Phi-3's 96 in 128) loads zeros past HEAD_DIM, which
        add nothing to q.k, and stores nothing there. PADDED is a constexpr branch, so a
        power of two compiles with no mask along the head.

        SOFT_CAP (Gemma 2's): each score s = scale * q.k becomes soft_cap * tanh(s / soft_cap) before
        the mask; a constexpr, so that other models' kernels are compiled without it.

        SINKS (gpt-oss's): a logit a head (sinks_ptr, fp32) that each row's softmax takes mass for but
        no value: the running max and sum start from it (m = sink, l = 1) in split 0 only, so the
        reduce counts it once.

        ROPE_DIM (MLA's qk_rope_head_dim, vLLM's BLOCK_DPE): K and the query are HEAD_DIM + ROPE_DIM
        wide, V HEAD_DIM: q.k = q[:HEAD_DIM].k[:HEAD_DIM] + q[HEAD_DIM:].k[HEAD_DIM:], two dots whose
        widths are powers of two (512 + 64 rather than 576 padded to 1024; ROPE_PAD: the rope part's
        power of two, at least tl.dot's 16), and the accumulator and output HEAD_DIM wide.

        ONE_CACHE (MLA's latent): V is the first HEAD_DIM dims of K's own tensor, so the K tile's main
        part, transposed, is the V tile: read once, not twice (compiled for sm_90 by Triton 3.9, the
        512 + 64 tile then takes 53 KB of shared memory rather than 84, and its 4 warps spill no registers,
        where 368 to 432 bytes spilled)."""
        PADDED: tl.constexpr = HEAD_DIM_PAD != HEAD_DIM
        HEAD_BLOCKS: tl.constexpr = (GROUP + HEADS - 1) // HEADS
        tile = tl.program_id(0)
        kv_head = tl.program_id(1) // HEAD_BLOCKS
        first_head = tl.program_id(1) % HEAD_BLOCKS * HEADS  # of the group's
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
        q_idx = q_tile_start + rows // HEADS                   # token within this step
        in_group = first_head + rows % HEADS
        head = kv_head * GROUP + in_group
        row_ok = (rows < BLOCK_Q * HEADS) & (q_idx < q_len) & (in_group < GROUP)
        q_pos = context_len + q_idx                            # its position in the sequence
        token = (q_start + q_idx).to(tl.int64)
        d = tl.arange(0, HEAD_DIM_PAD)
        q_mask = row_ok[:, None]
        if PADDED:
            q_mask = q_mask & (d[None, :] < HEAD_DIM)
        q = tl.load(query_ptr + token[:, None] * q_stride_t + head[:, None] * q_stride_h
                    + d[None, :] * q_stride_d, mask=q_mask, other=0.0)
        if ROPE_DIM > 0:
            dr = HEAD_DIM + tl.arange(0, ROPE_PAD)
            rope_ok = dr < HEAD_DIM + ROPE_DIM
            q_rope = tl.load(query_ptr + token[:, None] * q_stride_t + head[:, None] * q_stride_h
                             + dr[None, :] * q_stride_d, mask=row_ok[:, None] & rope_ok[None, :], other=0.0)

        # Keys first_key .. (last query of the tile's position) are visible to some row.
        num_keys = context_len + tl.minimum(q_tile_start + BLOCK_Q, q_len)
        first_key = tl.maximum(context_len + q_tile_start - window + 1, 0)
        # Each tile splits its own keys evenly (whole BLOCK_N steps, at least
        # min_partition): a CUDA graph's block table spans max_model_len, and a
        # split of that width would leave a short context wholly in split 0.
        partition = tl.maximum(tl.cdiv(tl.cdiv(num_keys - first_key, NUM_SPLITS), BLOCK_N) * BLOCK_N, min_partition)
        lo = first_key + split * partition
        hi = tl.minimum(num_keys, lo + partition)

        qk_scale = scale * 1.4426950408889634  # softmax in base 2: exp2 is cheaper than exp
        # A finite floor instead of -inf keeps fully masked rows at exp2(-inf - m) = 0
        # rather than NaN, without a branch.
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        if SINKS:
            if split == 0:
                m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634
                l_i = tl.where(row_ok, 1.0, 0.0)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        kv_off_h = kv_head.to(tl.int64)
        for start in range(lo, hi, BLOCK_N):
            k_pos = start + tl.arange(0, BLOCK_N)
            k_ok = k_pos < hi  # never read past seq_len: the rest of a block is garbage
            block = tl.load(block_tables_ptr + seq.to(tl.int64) * bt_stride_s
                            + (k_pos // block_size) * bt_stride_b,
                            mask=k_ok, other=0).to(tl.int64)
            offset = k_pos % block_size
            k_mask, v_mask = k_ok[None, :], k_ok[:, None]
            if PADDED:
                k_mask, v_mask = k_mask & (d[:, None] < HEAD_DIM), v_mask & (d[None, :] < HEAD_DIM)
            k = tl.load(k_cache_ptr + block[None, :] * kc_stride_b + offset[None, :] * kc_stride_s
                        + kv_off_h * kc_stride_h + d[:, None] * kc_stride_d,
                        mask=k_mask, other=0.0)                 # [HEAD_DIM_PAD, BLOCK_N]
            if ONE_CACHE:
                v = tl.trans(k)
            else:
                v = tl.load(v_cache_ptr + block[:, None] * vc_stride_b + offset[:, None] * vc_stride_s
                            + kv_off_h * vc_stride_h + d[None, :] * vc_stride_d,
                            mask=v_mask, other=0.0)             # [BLOCK_N, HEAD_DIM_PAD]
            qk = tl.dot(q, k.to(q.dtype), input_precision=PRECISION)
            if ROPE_DIM > 0:
                k_rope = tl.load(k_cache_ptr + block[None, :] * kc_stride_b + offset[None, :] * kc_stride_s
                                 + kv_off_h * kc_stride_h + dr[:, None] * kc_stride_d,
                                 mask=k_ok[None, :] & rope_ok[:, None], other=0.0)  # [ROPE_PAD, BLOCK_N]
                qk += tl.dot(q_rope, k_rope.to(q.dtype), input_precision=PRECISION)
            if SOFT_CAP:  # tanh(y) = 1 - 2 / (exp(2y) + 1), y clamped where tanh is +-1 in fp32
                y = qk * (scale / soft_cap)
                y = tl.minimum(tl.maximum(y, -15.0), 15.0)
                s = (soft_cap * 1.4426950408889634) * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))
            else:
                s = qk * qk_scale
            visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        out_mask = row_ok[:, None]
        if PADDED:
            out_mask = out_mask & (d[None, :] < HEAD_DIM)
        if NUM_SPLITS == 1:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i is 0 only on unused rows
            tl.store(out_ptr + token[:, None] * o_stride_t + head[:, None] * o_stride_h
                     + d[None, :] * o_stride_d, o.to(out_ptr.dtype.element_ty),
                     mask=out_mask)
        else:  # partials are contiguous [num_tokens, num_heads, NUM_SPLITS(, HEAD_DIM)]
            part = (token * num_heads + head) * NUM_SPLITS + split
            tl.store(m_part_ptr + part, m_i, mask=row_ok)
            tl.store(l_part_ptr + part, l_i, mask=row_ok)
            tl.store(acc_part_ptr + part[:, None] * HEAD_DIM + d[None, :], acc,
                     mask=out_mask)

    # Triton compiles a variant per integer argument that is 1 or a multiple of
    # 16; the first two change from step to step, so they stay unspecialised: a new
    # batch shape compiles nothing during traffic (nor a layer with a window).
    _paged_attention_kernel = triton.jit(_paged_attention_kernel,
                                         do_not_specialize=["num_seqs", "bt_stride_s", "window"])

    @triton.jit
    def _split_kv_reduce_kernel(
        out_ptr, m_part_ptr, l_part_ptr, acc_part_ptr,
        o_stride_t, o_stride_h, o_stride_d, num_heads,
        NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
    ):
        """One program per (token, head): rescale each split's partial sums to the
        global max and add them up (a padded head as in _paged_attention_kernel)."""
        PADDED: tl.constexpr = HEAD_DIM_PAD != HEAD_DIM
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        sp = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, HEAD_DIM_PAD)
        part = (token * num_heads + head) * NUM_SPLITS + sp
        ok = sp < NUM_SPLITS
        acc_mask = ok[:, None]
        if PADDED:
            acc_mask = acc_mask & (d[None, :] < HEAD_DIM)
        m = tl.load(m_part_ptr + part, mask=ok, other=-1.0e30)
        l = tl.load(l_part_ptr + part, mask=ok, other=0.0)
        acc = tl.load(acc_part_ptr + part[:, None] * HEAD_DIM + d[None, :],
                      mask=acc_mask, other=0.0)
        w = tl.exp2(m - tl.max(m, 0))  # splits that saw no key have m = -1e30: weight 0
        o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        if PADDED:
            tl.store(out_ptr + token * o_stride_t + head * o_stride_h + d * o_stride_d,
                     o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
        else:
            tl.store(out_ptr + token * o_stride_t + head * o_stride_h + d * o_stride_d,
                     o.to(out_ptr.dtype.element_ty))


    # The decoder's pointwise work on CUDA: one launch each instead of eager
    # torch's several, rounding to the model's dtype where torch's ops do.

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, heads, x_stride_t, x_stride_h,
                         r_stride_t, n, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                         GEMMA: tl.constexpr = False):
        """One program per (token, head) row of n: [x + residual ->] RMSNorm (GEMMA: Gemma's,
        scaled by the fp32 weight before rounding)."""
        row = tl.program_id(0).to(tl.int64)
        t, h = row // heads, row % heads
        cols = tl.arange(0, BLOCK)
        ok = cols < n
        x = tl.load(x_ptr + t * x_stride_t + h * x_stride_h + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:  # the sum is rounded to the model's dtype first, as torch's x + residual is
            x = (x.to(tl.float32) + tl.load(res_ptr + t * r_stride_t + cols, mask=ok, other=0.0).to(tl.float32)
                 ).to(out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * n + cols, x, mask=ok)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, 0) / n
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        if GEMMA:
            y = xf * tl.math.rsqrt(var + eps) * w
        else:
            y = w * (xf * tl.math.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * n + cols, y.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rotate_head(src, dst, cos_row, sin_row, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_PASS: tl.constexpr):
        """One head: dst = src * cos + rotate_half(src) * sin (neox) over its first 2 * HALF
        dims; the rest (partial rotary) copied. BLOCK_*: powers of two for tl.arange."""
        d = tl.arange(0, BLOCK_HALF)
        ok = d < HALF
        dt = dst.dtype.element_ty
        x1, x2 = tl.load(src + d, mask=ok).to(tl.float32), tl.load(src + HALF + d, mask=ok).to(tl.float32)
        cos1 = tl.load(cos_row + d, mask=ok).to(dt).to(tl.float32)
        cos2 = tl.load(cos_row + HALF + d, mask=ok).to(dt).to(tl.float32)
        sin1 = tl.load(sin_row + d, mask=ok).to(dt).to(tl.float32)
        sin2 = tl.load(sin_row + HALF + d, mask=ok).to(dt).to(tl.float32)
        tl.store(dst + d, ((x1 * cos1).to(dt).to(tl.float32) + (-x2 * sin1).to(dt).to(tl.float32)).to(dt), mask=ok)
        tl.store(dst + HALF + d, ((x2 * cos2).to(dt).to(tl.float32) + (x1 * sin2).to(dt).to(tl.float32)).to(dt),
                 mask=ok)
        if HEAD_DIM > 2 * HALF:
            p = 2 * HALF + tl.arange(0, BLOCK_PASS)
            tl.store(dst + p, tl.load(src + p, mask=p < HEAD_DIM), mask=p < HEAD_DIM)

    @triton.jit
    def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr, q_heads, k_heads,
                       q_stride_t, q_stride_h, k_stride_t, k_stride_h, HALF: tl.constexpr,
                       BLOCK_HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_PASS: tl.constexpr):
        """One program per (token, head), q's heads then k's: both in one launch."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos_row, sin_row = cos_ptr + pos * 2 * HALF, sin_ptr + pos * 2 * HALF
        if h < q_heads:
            _rotate_head(q_ptr + t * q_stride_t + h * q_stride_h, q_out_ptr + (t * q_heads + h) * HEAD_DIM,
                         cos_row, sin_row, HALF, BLOCK_HALF, HEAD_DIM, BLOCK_PASS)
        else:
            h -= q_heads
            _rotate_head(k_ptr + t * k_stride_t + h * k_stride_h, k_out_ptr + (t * k_heads + h) * HEAD_DIM,
                         cos_row, sin_row, HALF, BLOCK_HALF, HEAD_DIM, BLOCK_PASS)

    @triton.jit
    def _silu_and_mul_kernel(gate_up_ptr, out_ptr, n, BLOCK: tl.constexpr):
        """Grid (tokens, column blocks): out = silu(gate) * up."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n
        dt = out_ptr.dtype.element_ty
        g = tl.load(gate_up_ptr + t * 2 * n + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gate_up_ptr + t * 2 * n + n + cols, mask=ok, other=0.0).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + t * n + cols, (silu * u).to(dt), mask=ok)

    @triton.jit
    def _gelu_tanh_and_mul_kernel(gate_up_ptr, out_ptr, n, BLOCK: tl.constexpr):
        """Grid (tokens, column blocks): out = gelu_tanh(gate) * up, tanh(y) as 1 - 2 / (exp(2y) + 1)
        (no tanh in tl.math), y clamped to +-15, where tanh is +-1 in fp32 (and exp does not overflow)."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n
        dt = out_ptr.dtype.element_ty
        g = tl.load(gate_up_ptr + t * 2 * n + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gate_up_ptr + t * 2 * n + n + cols, mask=ok, other=0.0).to(tl.float32)
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) (g + 0.044715 g^3)
        y = tl.minimum(tl.maximum(y, -15.0), 15.0)
        gelu = (0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))).to(dt).to(tl.float32)
        tl.store(out_ptr + t * n + cols, (gelu * u).to(dt), mask=ok)

    @triton.jit
    def _swigluoai_and_mul_kernel(gate_up_ptr, out_ptr, n, alpha, limit, BLOCK: tl.constexpr):
        """Grid (tokens, column blocks): gpt-oss's clamped SwiGLU, gate and up interleaved (columns 2j,
        2j + 1), (up + 1) * gate * sigmoid(alpha * gate), rounded to the output's dtype where the torch
        twin's steps round."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n
        dt = out_ptr.dtype.element_ty
        g = tl.load(gate_up_ptr + t * 2 * n + 2 * cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gate_up_ptr + t * 2 * n + 2 * cols + 1, mask=ok, other=0.0).to(tl.float32)
        g = tl.minimum(g, limit).to(dt).to(tl.float32)  # clamped to limit as the dtype holds it, as torch's
        u = tl.minimum(tl.maximum(u, -limit), limit).to(dt).to(tl.float32)
        sigmoid = (1.0 / (1.0 + tl.exp(-(g * alpha).to(dt).to(tl.float32)))).to(dt).to(tl.float32)
        glu = (g * sigmoid).to(dt).to(tl.float32)
        tl.store(out_ptr + t * n + cols, ((u + 1.0).to(dt).to(tl.float32) * glu).to(dt), mask=ok)

    # num_pairs (T * k) changes with the batch: unspecialised, so a new batch compiles nothing.
    @triton.jit(do_not_specialize=["num_pairs"])
    def _fused_moe_kernel(a_ptr, w_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, bias_ptr,
                          scales_ptr, zeros_ptr, N, K, num_pairs, a_stride_m, a_stride_k, w_stride_e, w_stride_n,
                          w_stride_k, c_stride_m, c_stride_n, bias_stride_e, bias_stride_n, s_stride_e, s_stride_g,
                          group_size, k_off, PAIRS_PER_ROW: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
                          HAS_BIAS: tl.constexpr, WNA16_BITS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          PRECISION: tl.constexpr):
        """Grid (blocks of sorted pairs, blocks of N): one expert's grouped GEMM on one tile,
        c[pair] = a[pair // PAIRS_PER_ROW] @ w[expert]^T (+ bias[expert]) (times the pair's routing weight).
        The first launch reads x (a token's row serves its k pairs: PAIRS_PER_ROW = k), the
        second the activations (one row a pair). A block past the last expert's exits: the grid is sized
        for the worst routing, so that it never depends on the data. WNA16_BITS 4 or 8: w is PackedExperts'
        qweight (w_stride_k steps a word row of 32 // WNA16_BITS input rows), each BLOCK_K x BLOCK_N tile
        dequantized as _wna16_matmul_kernel's, (code - zero) * scale in fp32 rounded to a's dtype; 0: w
        holds the weights (and scales_ptr, zeros_ptr, group_size, k_off are unread)."""
        expert = tl.load(expert_ids_ptr + tl.program_id(0)).to(tl.int64)
        if expert < 0:
            return
        pair = tl.load(sorted_ids_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        pair_ok = pair < num_pairs  # padding points past the last pair
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        rows = a_ptr + (pair // PAIRS_PER_ROW)[:, None] * a_stride_m
        cols = w_ptr + expert * w_stride_e + n[None, :] * w_stride_n
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            kn_ok = k_ok[:, None] & n_ok[None, :]
            a = tl.load(rows + k[None, :] * a_stride_k, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
            if WNA16_BITS:
                PACK: tl.constexpr = 32 // WNA16_BITS
                words = tl.load(cols + (k // PACK)[:, None] * w_stride_k, mask=kn_ok, other=0)
                codes = (words >> ((k % PACK) * WNA16_BITS)[:, None]) & ((1 << WNA16_BITS) - 1)
                at = expert * s_stride_e + ((k + k_off) // group_size)[:, None].to(tl.int64) * s_stride_g \
                    + n[None, :]
                scale = tl.load(scales_ptr + at, mask=kn_ok, other=0.0).to(tl.float32)
                zero = tl.load(zeros_ptr + at, mask=kn_ok, other=0).to(tl.float32)
                w = ((codes.to(tl.float32) - zero) * scale).to(a_ptr.dtype.element_ty)
            else:
                w = tl.load(cols + k[:, None] * w_stride_k, mask=kn_ok, other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if HAS_BIAS:  # added to the fp32 sum before its one rounding, as F.linear's bias
            bias = tl.load(bias_ptr + expert * bias_stride_e + n * bias_stride_n, mask=n_ok, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        dt = c_ptr.dtype.element_ty
        if MUL_ROUTED_WEIGHT:  # the expert's output rounded to the model's dtype first, as the reference's
            weight = tl.load(topk_weights_ptr + pair, mask=pair_ok, other=0.0).to(tl.float32)
            acc = acc.to(dt).to(tl.float32) * weight[:, None]
        tl.store(c_ptr + pair[:, None] * c_stride_m + n[None, :] * c_stride_n, acc.to(dt),
                 mask=pair_ok[:, None] & n_ok[None, :])


    # M (the tokens) changes with the batch: unspecialised, so a new batch compiles nothing.
    @triton.jit(do_not_specialize=["M"])
    def _wna16_matmul_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, out_ptr, M, N, K, k_off,
                             group_size, x_stride_m, x_stride_k, out_stride_m, BITS: tl.constexpr,
                             HAS_G_IDX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """Grid (blocks of M, blocks of N): out = x @ W for one tile, W dequantized a BLOCK_K x BLOCK_N tile at a
        time from the packed codes (the layout above wna16_unpack), each element (code - zero) * scale in fp32
        rounded to x's dtype, the products summed in fp32."""
        PACK: tl.constexpr = 32 // BITS
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = m < M, n < N
        dt = x_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            kn_ok = k_ok[:, None] & n_ok[None, :]
            x = tl.load(x_ptr + m[:, None].to(tl.int64) * x_stride_m + k[None, :] * x_stride_k,
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            words = tl.load(qweight_ptr + (k // PACK)[:, None].to(tl.int64) * N + n[None, :], mask=kn_ok, other=0)
            codes = (words >> ((k % PACK) * BITS)[:, None]) & ((1 << BITS) - 1)
            if HAS_G_IDX:  # act-order: each row's group read
                g = tl.load(g_idx_ptr + k, mask=k_ok, other=0)
            else:
                g = (k + k_off) // group_size
            at = g[:, None].to(tl.int64) * N + n[None, :]
            scale = tl.load(scales_ptr + at, mask=kn_ok, other=0.0).to(tl.float32)
            zero = tl.load(zeros_ptr + at, mask=kn_ok, other=0).to(tl.float32)
            w = ((codes.to(tl.float32) - zero) * scale).to(dt)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        tl.store(out_ptr + m[:, None].to(tl.int64) * out_stride_m + n[None, :], acc.to(dt),
                 mask=m_ok[:, None] & n_ok[None, :])


def _check_head_dim(head_dim: int, rope_dim: int = 0) -> None:
    """A power of two >= 16 (tl.dot's least), or a multiple of 8 from 16 to 256 (Phi-3's 96, 80,
    160, 192: vLLM's sizes), which the kernels pad to the next power of two with masks; past 256
    padding would double a tile that no GPU run has checked. ``rope_dim``: how much wider K is than
    V (MLA's qk_rope_head_dim past kv_lora_rank, its own dot), a multiple of 8 up to head_dim."""
    power_of_two = not head_dim & (head_dim - 1)
    if head_dim < 16 or head_dim % 8 or (head_dim > 256 and not power_of_two):
        raise ValueError(f"the Triton kernels need head_dim to be a multiple of 8 from 16 to 256, "
                         f"or a larger power of two, got {head_dim}")
    if rope_dim % 8 or not 0 <= rope_dim <= head_dim:
        raise ValueError(f"the Triton kernels need K's dims past V's (MLA's qk_rope_head_dim) to be a "
                         f"multiple of 8 up to V's {head_dim}, got {rope_dim}")


def _head_parts(head_dim: int) -> tuple[int, int]:
    """A cache row's width as the parts the store copies: itself where _check_head_dim takes it,
    else (MLA's latent, 576) the largest power of two below it and the rest (512 + 64)."""
    if head_dim <= 256 or not head_dim & (head_dim - 1):
        return head_dim, 0
    main = 1 << (head_dim.bit_length() - 1)
    return main, head_dim - main


def _check_kv(key, value, k_cache, v_cache) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if key.shape != value.shape or key.dim() != 3 or key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"key and value must be [num_tokens, {k_cache.shape[2]}, "
                         f"{k_cache.shape[3]}], got {tuple(key.shape)} and {tuple(value.shape)}")
    _check_head_dim(*_head_parts(k_cache.shape[3]))


def _check_attention_caches(k_cache, v_cache) -> None:
    """K and V alike but for V's width, which may be less than K's (MLA's kv_lora_rank of the
    latent's kv_lora_rank + qk_rope_head_dim): the rest of K is the rope part of the scores."""
    if k_cache.dim() != 4 or v_cache.dim() != 4 or v_cache.shape[:3] != k_cache.shape[:3] \
            or v_cache.shape[3] > k_cache.shape[3]:
        raise ValueError(f"k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"V's head_dim at most K's, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _check_head_dim(v_cache.shape[3], k_cache.shape[3] - v_cache.shape[3])


def store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping) -> None:
    _check_kv(key, value, k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    main, rest = _head_parts(head_dim)
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        num_kv_heads, k_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), MAIN=main, MAIN_PAD=triton.next_power_of_2(main),
        REST=rest, REST_PAD=triton.next_power_of_2(max(rest, 1)), ONE_CACHE=v_cache is k_cache,
    )


def _tile_shape(all_decodes: bool, num_tokens: int, num_seqs: int, head_dim: int,
                group: int) -> tuple[int, int]:
    """(BLOCK_M rows, BLOCK_N keys) of the attention tiles for this batch; head_dim: V's, the
    accumulator's. Rows cover a KV head's whole group of query heads, except on a head wider than
    256 (MLA's 512-wide latent): there 16 rows (vLLM's BLOCK_H) already hold a 32 KB fp32
    accumulator, and a group of more heads (DeepSeek's 16 to 128 on one latent) takes more programs,
    16 heads each (_tile_heads), not taller tiles."""
    if head_dim > 256:
        return _BLOCK_M_WIDE, _BLOCK_N_WIDE
    if all_decodes:
        block_m, block_n = _BLOCK_M_DECODE, _BLOCK_N_DECODE
    elif head_dim <= 128 and num_tokens >= _PREFILL_TILE_MIN_TOKENS_PER_SEQ * num_seqs:
        block_m, block_n = _BLOCK_M_PREFILL, _BLOCK_N_PREFILL
    else:
        block_m, block_n = _BLOCK_M_CHUNK, _BLOCK_N_CHUNK
    return max(block_m, triton.next_power_of_2(group)), block_n


def _tile_heads(block_m: int, group: int) -> int:
    """How many of a group's query heads a tile's rows take: all (the rows are tokens x group),
    or, for a group taller than the tile (MLA's many heads on a wide latent), BLOCK_M at a time."""
    return min(group, block_m)


def _num_kv_splits(all_decodes: bool, num_seqs: int, programs_per_seq: int,
                   max_context: int) -> int:
    """How many partitions to split each context into (1 = no split-KV), a
    power of two: enough for ~_SPLIT_KV_TARGET_PROGRAMS programs, and no more
    than the longest context could fill with minimum-size partitions.
    max_context is the block table's capacity, a host-side bound: reading the
    real seq_lens would cost a device sync per layer."""
    if not all_decodes:
        return 1
    wanted = triton.next_power_of_2(-(-_SPLIT_KV_TARGET_PROGRAMS // (num_seqs * programs_per_seq)))
    fits = 1 << max(0, (max_context // _SPLIT_KV_MIN_PARTITION).bit_length() - 1)  # largest power of 2 <=
    return min(wanted, _SPLIT_KV_MAX_SPLITS, fits)


def paged_attention_triton(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                           sliding_window: int | None = None, logits_soft_cap: float | None = None,
                           sinks: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out``, if given, receives the result (benchmarks/triton_gpu.py passes one
    filled with NaN to check that every element is written). A v_cache narrower than k_cache
    (MLA's: the latent's first kv_lora_rank dims) gives an output that wide."""
    _check_attention_caches(k_cache, v_cache)
    if query.dim() != 3 or query.shape[2] != k_cache.shape[3]:
        raise ValueError(f"query must be [num_tokens, num_heads, {k_cache.shape[3]}], "
                         f"got {tuple(query.shape)}")
    num_tokens, num_heads, head_dim = *query.shape[:2], v_cache.shape[3]
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
    out = query.new_empty(num_tokens, num_heads, head_dim) if out is None else out
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    # num_tokens == num_seqs means every q_len is 1 (each sequence has >= 1 token);
    # the kernel is correct for any tile shape, this only picks the cheaper one.
    all_decodes = num_tokens == num_seqs
    block_m, block_n = _tile_shape(all_decodes, num_tokens, num_seqs, head_dim, group)
    heads = _tile_heads(block_m, group)
    block_q = block_m // heads
    num_splits = _num_kv_splits(all_decodes, num_seqs, num_kv_heads * -(-group // heads),
                                block_tables.shape[1] * block_size)
    return _launch_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                             out, block_m, block_q, num_splits, block_n, sliding_window=sliding_window,
                             logits_soft_cap=logits_soft_cap, sinks=sinks)


def warm_up_paged_attention_triton(num_heads: int, k_cache, v_cache, max_context: int,
                                   logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> None:
    """Compile every attention variant a step can launch (Triton compiles one on
    its first launch, in the middle of traffic otherwise): the decode tile at
    each split-KV count a table of max_context tokens allows, and the chunk and
    prefill tiles, with the model's soft cap or without (and MLA's split, where v_cache is
    narrower). One sequence of one token, reading block 0, does for each."""
    num_kv_heads, head_dim = k_cache.shape[2], v_cache.shape[3]
    group, dev = num_heads // num_kv_heads, k_cache.device
    query = torch.zeros(1, num_heads, k_cache.shape[3], dtype=k_cache.dtype, device=dev)
    table = torch.zeros(1, 1, dtype=torch.int32, device=dev)
    seq_lens = torch.ones(1, dtype=torch.int32, device=dev)
    query_start_loc = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    most = _num_kv_splits(True, 1, 1, max_context)  # one sequence of one head: the most splits
    variants = [(_tile_shape(True, 1, 1, head_dim, group), 1 << i) for i in range(most.bit_length())]
    variants += [(_tile_shape(False, n, 1, head_dim, group), 1) for n in (2, _PREFILL_TILE_MIN_TOKENS_PER_SEQ)]
    for (block_m, block_n), num_splits in variants:
        _launch_attention(query, k_cache, v_cache, table, seq_lens, query_start_loc, 1.0,
                          query.new_empty(1, num_heads, head_dim), block_m, block_m // _tile_heads(block_m, group),
                          num_splits, block_n, logits_soft_cap=logits_soft_cap, sinks=sinks)


def _launch_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                      scale, out, block_m, block_q, num_splits, block_n: int = _BLOCK_N_DECODE,
                      min_partition: int | None = None, sliding_window: int | None = None,
                      logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                      heads: int | None = None, **launch_options) -> torch.Tensor:
    """``block_n`` and ``launch_options`` (Triton's num_warps, num_stages) are
    the knobs benchmarks/triton_gpu.py sweeps; the engine keeps the defaults. ``heads``: the
    query heads a tile takes (_tile_heads' unless given; block_q * heads <= block_m)."""
    num_tokens, num_heads, head_dim = *query.shape[:2], v_cache.shape[3]
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    group = num_heads // num_kv_heads
    heads = _tile_heads(block_m, group) if heads is None else heads
    rope_dim = k_cache.shape[3] - head_dim  # MLA's: K's (and the query's) dims past V's
    if min_partition is None:
        min_partition = _SPLIT_KV_MIN_PARTITION
    if num_splits > 1:
        m_part = query.new_empty((num_tokens, num_heads, num_splits), dtype=torch.float32)
        l_part = torch.empty_like(m_part)
        acc_part = query.new_empty((num_tokens, num_heads, num_splits, head_dim),
                                   dtype=torch.float32)
    else:  # unused by the kernel; any tensor will do as a pointer
        m_part = l_part = acc_part = out
    grid = (num_tokens // block_q + num_seqs, num_kv_heads * -(-group // heads), num_splits)
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        m_part, l_part, acc_part, out if sinks is None else sinks.float().contiguous(),
        float(scale), num_seqs, num_heads, k_cache.shape[1], min_partition,
        _NO_WINDOW if sliding_window is None else sliding_window,
        1.0 if logits_soft_cap is None else float(logits_soft_cap),
        *query.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
        *block_tables.stride(),
        GROUP=group, HEADS=heads, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        NUM_SPLITS=num_splits, ROPE_DIM=rope_dim, ROPE_PAD=max(16, triton.next_power_of_2(max(rope_dim, 1))),
        ONE_CACHE=value_in_key(k_cache, v_cache),
        # fp32 inputs get exact fp32 products, not TF32: fp32 is the precise path.
        PRECISION="ieee" if query.dtype == torch.float32 else None,
        SOFT_CAP=logits_soft_cap is not None, SINKS=sinks is not None,
        **launch_options,
    )
    if num_splits > 1:
        _split_kv_reduce_kernel[(num_tokens, num_heads)](
            out, m_part, l_part, acc_part, *out.stride(), num_heads,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        )
    return out


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """x [T, n] or [T, heads, n] with unit stride along n and contiguous heads:
    (T, heads, token stride, head stride)."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), x.shape[1]
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError(f"expected heads of unit stride, got strides {x.stride()}")
    return x.shape[0], x.shape[1], x.stride(0), x.stride(1)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    T, heads, stride_t, stride_h = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if T:
        n = x.shape[-1]
        _rms_norm_kernel[(T * heads,)](x, x, weight, out, out, heads, stride_t, stride_h, 0, n, eps,
                                       HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(n), GEMMA=gemma)
    return out


def fused_add_rms_norm_triton(x, residual, weight, eps, gemma: bool = False):
    T, n = x.shape
    if x.stride(1) != 1 or residual.stride(1) != 1:
        raise ValueError("fused_add_rms_norm takes rows of unit stride")
    out, res_out = torch.empty_like(x), torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if T:
        _rms_norm_kernel[(T,)](x, residual, weight, out, res_out, 1, x.stride(0), n, residual.stride(0), n, eps,
                               HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(n), GEMMA=gemma)
    return out, res_out


def gemma_rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_triton(x, weight, eps, gemma=True)


def gemma_fused_add_rms_norm_triton(x, residual, weight, eps):
    return fused_add_rms_norm_triton(x, residual, weight, eps, gemma=True)


def rotary_triton(q, k, positions, cos_cache, sin_cache):
    (T, q_heads, q_stride_t, q_stride_h), (_, k_heads, k_stride_t, k_stride_h) = _rows(q), _rows(k)
    q_out, k_out = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k))
    if T:
        d, half = q.shape[-1], cos_cache.shape[-1] // 2  # half: of the rotary dims (partial rotary: < d / 2)
        _rotary_kernel[(T, q_heads + k_heads)](q, k, q_out, k_out, positions, cos_cache, sin_cache, q_heads, k_heads,
                                               q_stride_t, q_stride_h, k_stride_t, k_stride_h, HALF=half,
                                               BLOCK_HALF=triton.next_power_of_2(half), HEAD_DIM=d,
                                               BLOCK_PASS=triton.next_power_of_2(max(d - 2 * half, 1)))
    return q_out, k_out


def _act_and_mul_triton(kernel, gate_up: torch.Tensor, *args) -> torch.Tensor:
    """act(gate) * up with ``kernel`` (SiLU's, GELU's, or swigluoai's, its ``args`` alpha and limit):
    one program per token and column block."""
    gate_up = gate_up.contiguous()
    T, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(T, n, dtype=gate_up.dtype, device=gate_up.device)
    if T:
        block = min(1024, triton.next_power_of_2(n))
        kernel[(T, triton.cdiv(n, block))](gate_up, out, n, *args, BLOCK=block)
    return out


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    return _act_and_mul_triton(_silu_and_mul_kernel, gate_up)


def gelu_tanh_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    return _act_and_mul_triton(_gelu_tanh_and_mul_kernel, gate_up)


def swigluoai_and_mul_triton(gate_up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    return _act_and_mul_triton(_swigluoai_and_mul_kernel, gate_up, float(alpha), float(limit))


def moe_act_triton(gate_up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """fused_moe_triton's activation, by its MOE_ACTIVATIONS name (moe_act_torch's twin)."""
    if activation == "swigluoai":
        return swigluoai_and_mul_triton(gate_up, alpha, limit)
    return gelu_tanh_and_mul_triton(gate_up) if activation == "gelu_tanh" else silu_and_mul_triton(gate_up)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's moe_align_block_size with torch ops on the device: no host sync, every shape
    from topk_ids' shape alone, so a CUDA graph can capture it. The T * k (token, choice)
    pairs, numbered t * k + j, sorted by expert, each expert's group padded to a multiple
    of block_m: ``sorted_ids`` int64 [max_blocks * block_m] (padding: T * k, past every pair)
    and ``expert_ids`` int64 [max_blocks], the expert of each block of block_m (-1: past the
    last expert's group). max_blocks bounds every routing: an expert with c pairs takes
    ceil(c / block_m) blocks, which is at most c and at most (c + block_m - 1) / block_m, so
    all of them take at most min(T * k, (T * k + E * (block_m - 1)) / block_m); the first
    bound keeps a decode's grid at T * k blocks however many experts there are. No
    torch.bincount: on CUDA it reads the ids' max on the host to size its output."""
    ids = topk_ids.reshape(-1).long()
    num_pairs, dev = ids.numel(), ids.device
    max_blocks = min(num_pairs, -(-(num_pairs + num_experts * (block_m - 1)) // block_m))
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    order = ids.argsort(stable=True)  # pairs by expert, in pair order within one
    expert = ids[order]
    # the i-th pair of the sorted order is its expert's (i - the expert's first place)-th
    rank = torch.arange(num_pairs, device=dev) - (counts.cumsum(0) - counts)[expert]
    sorted_ids = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.long, device=dev)
    sorted_ids.scatter_(0, (padded_ends - padded)[expert] + rank, order)
    # a block's expert: the first whose padded group ends past the block's start (empty ones end before)
    block_starts = torch.arange(0, max_blocks * block_m, block_m, device=dev)
    expert_ids = torch.searchsorted(padded_ends, block_starts, right=True)
    return sorted_ids, torch.where(expert_ids < num_experts, expert_ids, -1)


def _check_moe(x, w13, w2, topk_weights, topk_ids) -> None:
    """Shapes only: that every id is in [0, E) would need a host sync to check (an id out
    of range is a device-side assert on CUDA, an IndexError on the CPU). w13 and w2 are tensors or
    PackedExperts (both packed, or neither: the two launches share one variant's arguments)."""
    s13, s2 = tuple(w13.shape), tuple(w2.shape)
    if x.dim() != 2 or len(s13) != 3 or len(s2) != 3 or s13[2] != x.shape[1] \
            or s13[1] != 2 * s2[2] or s2[:2] != (s13[0], x.shape[1]):
        raise ValueError(f"need x [T, H], w13 [E, 2I, H] and w2 [E, H, I], got {tuple(x.shape)}, {s13} and {s2}")
    if isinstance(w13, PackedExperts) != isinstance(w2, PackedExperts):
        raise ValueError("w13 and w2 must both be PackedExperts or both tensors")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"need topk_weights and topk_ids [{x.shape[0]}, k], got {tuple(topk_weights.shape)} "
                         f"and {tuple(topk_ids.shape)}")
    if not isinstance(w13, PackedExperts) and not x.dtype == w13.dtype == w2.dtype:  # tl.dot: one dtype
        raise ValueError(f"x, w13 and w2 must share a dtype, got {x.dtype}, {w13.dtype} and {w2.dtype}")


def _check_moe_options(w13, w2, w13_bias, w2_bias, activation: str) -> None:
    """The biases' shapes and dtypes, and the activation's name (a typo would otherwise run SiLU)."""
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"unknown MoE activation {activation!r}: one of {', '.join(MOE_ACTIVATIONS)}")
    for name, bias, shape in (("w13_bias", w13_bias, w13.shape[:2]), ("w2_bias", w2_bias, w2.shape[:2])):
        if bias is not None and (bias.shape != shape or bias.dtype != w13.dtype):
            raise ValueError(f"need {name} {tuple(shape)} in {w13.dtype} (the weights'), got {tuple(bias.shape)} "
                             f"in {bias.dtype}")


def _moe_block_m(num_tokens: int, top_k: int, num_experts: int) -> int:
    """BLOCK_M of the grouped GEMMs: fixed by the shapes, so by a captured graph's batch."""
    large = num_tokens * top_k >= _MOE_BLOCK_M_LARGE * num_experts
    return _MOE_BLOCK_M_LARGE if large else _MOE_BLOCK_M_SMALL


def _grouped_gemm(a, w, out, topk_weights, bias, sorted_ids, expert_ids, pairs_per_row: int, block_m: int) -> None:
    """out [T * k, N] = the grouped GEMM of each pair's row of ``a`` with its expert's w [E, N, K]
    (any strides: gpt-oss's are transformers' [E, K, N] read transposed), plus its bias [E, N]; or with
    PackedExperts' codes (no bias)."""
    N, K = w.shape[1], w.shape[2]
    grid = (expert_ids.shape[0], triton.cdiv(N, _MOE_BLOCK_N))
    weights = out if topk_weights is None else topk_weights  # unread without weights; any tensor is a pointer
    bias_or_w = out if bias is None else bias  # so for the bias (then unread, and its strides 0)
    if isinstance(w, PackedExperts):  # qweight [E, words, N]: a word row is the k stride
        codes, scales, zeros = w.qweight, w.scales, w.zeros
        packed = (*codes.stride()[::2], codes.stride(1), scales.stride(0), scales.stride(1), w.group_size, w.k_off)
    else:  # scales and zeros unread: any pointer
        codes, scales, zeros, packed = w, out, out, (*w.stride(), 0, 0, 1, 0)
    w_stride_e, w_stride_n, w_stride_k, s_stride_e, s_stride_g, group_size, k_off = packed
    _fused_moe_kernel[grid](a, codes, out, weights, sorted_ids, expert_ids, bias_or_w, scales, zeros, N, K,
                            out.shape[0], *a.stride(), w_stride_e, w_stride_n, w_stride_k, *out.stride(),
                            *(bias.stride() if bias is not None else (0, 0)), s_stride_e, s_stride_g, group_size,
                            k_off, PAIRS_PER_ROW=pairs_per_row, MUL_ROUTED_WEIGHT=topk_weights is not None,
                            HAS_BIAS=bias is not None, WNA16_BITS=w.bits if isinstance(w, PackedExperts) else 0,
                            BLOCK_M=block_m, BLOCK_N=_MOE_BLOCK_N, BLOCK_K=_MOE_BLOCK_K,
                            PRECISION="ieee" if a.dtype == torch.float32 else None)


def fused_moe_triton(x, w13, w2, topk_weights, topk_ids, w13_bias=None, w2_bias=None, activation: str = "silu",
                     swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> torch.Tensor:
    """vLLM's fused_experts: align the pairs to experts' blocks, x @ w13[e]^T + w13_bias[e] for each
    pair, the activation (silu(gate) * up, or another of MOE_ACTIVATIONS), @ w2[e]^T + w2_bias[e] times
    the routing weight, then each token's k rows summed in fp32 (fused_moe_torch's result). w13 and w2 may
    be PackedExperts (int4/int8 codes, dequantized a tile at a time in the kernel: fused_moe_wna16_torch's
    result; no biases). Capture-safe: no host sync, and every shape and grid follows from (T, k, E) alone."""
    _check_moe(x, w13, w2, topk_weights, topk_ids)
    if isinstance(w13, PackedExperts) and (w13_bias is not None or w2_bias is not None):
        raise ValueError("packed experts (PackedExperts) take no biases")
    _check_moe_options(w13, w2, w13_bias, w2_bias, activation)
    (T, H), (E, I), k = x.shape, (w2.shape[0], w2.shape[2]), topk_ids.shape[1]
    if T == 0 or k == 0:  # no pair: an empty grid, which Triton refuses
        return torch.zeros_like(x)
    block_m = _moe_block_m(T, k, E)
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, E, block_m)
    gate_up = x.new_empty(T * k, 2 * I)  # one row a pair: pair t * k + j reads x[t]
    _grouped_gemm(x, w13, gate_up, None, w13_bias, sorted_ids, expert_ids, k, block_m)
    down = x.new_empty(T * k, H)
    # the routing weights as fp32 whatever the router left them in (Mixtral fp32, Qwen the model's dtype): a
    # pointer's dtype is part of a Triton variant, so one variant serves every model, the one warm-up compiled
    weights = topk_weights.reshape(-1).to(torch.float32)
    h = moe_act_triton(gate_up, activation, swiglu_alpha, swiglu_limit)
    _grouped_gemm(h, w2, down, weights, w2_bias, sorted_ids, expert_ids, 1, block_m)
    return down.view(T, k, H).sum(1, dtype=torch.float32).to(x.dtype)


def warm_up_fused_moe_triton(w13, w2, top_k: int, dtype: torch.dtype | None = None, **moe_kwargs) -> None:
    """Compile both tiles of fused_moe_triton for these weights (tensors, or PackedExperts with the
    activations' ``dtype``), and the layer's biases and activation (``moe_kwargs``, fused_moe_triton's),
    before traffic (Triton compiles a variant on its first launch; a CUDA graph's capture cannot): a token,
    and a batch just large enough for the 64-row tile, all routed to expert 0."""
    E, H = w13.shape[0], w13.shape[2]
    device = w13.qweight.device if isinstance(w13, PackedExperts) else w13.device
    dtype = dtype or w13.dtype
    for T in (1, -(-_MOE_BLOCK_M_LARGE * E // top_k)):
        ids = torch.zeros(T, top_k, dtype=torch.int32, device=device)
        fused_moe_triton(torch.zeros(T, H, dtype=dtype, device=device), w13, w2,
                         torch.ones(T, top_k, device=device), ids, **moe_kwargs)


def wna16_matmul_triton(x, qweight, scales, zeros, g_idx, bits: int, group_size: int, k_off: int) -> torch.Tensor:
    """x [M, K] @ the packed weight (wna16_matmul_torch's result) in one kernel. Capture-safe: no host sync,
    nothing allocated but the output, and the tile follows from M alone."""
    M, K = x.shape
    N = qweight.shape[1]
    out = x.new_empty(M, N)
    if M == 0 or N == 0:
        return out
    block_m = _WNA16_BLOCK_M_SMALL if M <= _WNA16_BLOCK_M_SMALL else _WNA16_BLOCK_M_LARGE
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, _WNA16_BLOCK_N))
    _wna16_matmul_kernel[grid](x, qweight, scales, zeros, qweight if g_idx is None else g_idx, out, M, N, K, k_off,
                               group_size, *x.stride(), out.stride(0), BITS=bits, HAS_G_IDX=g_idx is not None,
                               BLOCK_M=block_m, BLOCK_N=_WNA16_BLOCK_N, BLOCK_K=_WNA16_BLOCK_K,
                               PRECISION="ieee" if x.dtype == torch.float32 else None)
    return out


def probe_triton(cfg, dtype: torch.dtype, device: torch.device, block_size: int) -> None:
    """Raise where the Triton kernels cannot run here, before a model is built on
    them: a head_dim they do not take, a tile larger than this GPU's shared memory,
    no C compiler for Triton's launchers. Launches every op once on one token at
    the model's (a rank's) widths, which fix what Triton compiles; the attention
    through its warm-up at a context that also splits (the reduce kernel). MLA (cfg.kv_lora_rank):
    the latent's one tensor as K, its first kv_lora_rank dims as V, and rope on the rope dims."""
    v_dim = cfg.kv_lora_rank or cfg.head_dim
    _check_head_dim(v_dim, cfg.head_dim - v_dim)
    zeros = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
    q, k = zeros(1, cfg.num_heads, cfg.head_dim), zeros(1, cfg.num_kv_heads, cfg.head_dim)
    cache, x = zeros(1, block_size, *k.shape[1:]), zeros(1, cfg.hidden_size)
    first = torch.zeros(1, dtype=torch.long, device=device)  # slot 0, position 0
    store_kvcache_triton(k, k, cache, cache, first)
    warm_up_paged_attention_triton(cfg.num_heads, cache, cache[..., :v_dim], 2 * _SPLIT_KV_MIN_PARTITION,
                                   cfg.attn_logit_softcapping,
                                   zeros(cfg.num_heads) if getattr(cfg, "attention_sinks", False) else None)
    fused_add_rms_norm_triton(rms_norm_triton(x, x[0], 1e-6), x, x[0], 1e-6)
    rms_norm_triton(q, q[0, 0], 1e-6)  # Qwen3's q/k norm: one row a head
    if cfg.gemma:  # its norms: an fp32 weight
        gemma_fused_add_rms_norm_triton(gemma_rms_norm_triton(x, x[0].float(), 1e-6), x, x[0].float(), 1e-6)
        gemma_rms_norm_triton(q, q[0, 0].float(), 1e-6)
    table = zeros(1, cfg.rotary_dim).float()  # the model's rotary dims
    if cfg.kv_lora_rank:  # MLA turns q_pe and k_pe, rotary_dim wide
        q, k = zeros(1, cfg.num_heads, cfg.rotary_dim), zeros(1, cfg.num_kv_heads, cfg.rotary_dim)
    rotary_triton(q, k, first, table, table)
    getattr(TRITON, act_and_mul_name(cfg))(zeros(1, 2 * cfg.intermediate_size))
    if cfg.num_experts:  # one expert stands for all (the widths and top_k fix what compiles, not E)
        H, I, top_k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        w13, w2, moe_kwargs = zeros(1, 2 * I, H), zeros(1, H, I), {}
        if cfg.moe_activation == "swigluoai":  # gpt-oss's experts: biases, transformers' layout read transposed
            w13, w2 = zeros(1, H, 2 * I).transpose(1, 2), zeros(1, I, H).transpose(1, 2)
            moe_kwargs = dict(w13_bias=zeros(1, 2 * I), w2_bias=zeros(1, H), activation="swigluoai")
        fused_moe_triton(x, w13, w2, zeros(1, top_k), torch.zeros(1, top_k, dtype=torch.int32, device=device),
                         **moe_kwargs)
    quant = getattr(cfg, "quantization", None)
    if getattr(quant, "method", None) in ("gptq", "awq", "compressed-tensors"):  # int weights, packed on CUDA
        _probe_wna16(x, quant.bits, quant.group_size, quant.desc_act)
        if cfg.num_experts and cfg.moe_activation != "swigluoai":  # FusedMoE's experts, kept packed
            _probe_wna16_moe(x, quant.bits, quant.group_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok)
    if device.type == "cuda":  # a launch's failure may surface only at the next sync
        torch.cuda.synchronize(device)


def _probe_wna16(x: torch.Tensor, bits: int, group_size: int, act_order: bool) -> None:
    """The packed int matmul once, on one column of a weight [hidden, 1] as model.WNA16Weight holds one
    (fp16 scales, zeros uint8 for int4 and int16 for int8; act-order's g_idx all group 0). Every group the
    kernel reads has its row of scales and zeros: one row for K // group_size groups would be read past."""
    K, device = x.shape[1], x.device
    group_size = group_size if group_size > 0 and not act_order else K
    groups = -(-K // group_size)
    qweight = torch.zeros(-(-K // (32 // bits)), 1, dtype=torch.int32, device=device)
    scales = torch.zeros(groups, 1, dtype=torch.float16, device=device)
    zeros = torch.zeros(groups, 1, dtype=torch.uint8 if bits == 4 else torch.int16, device=device)
    g_idx = torch.zeros(K, dtype=torch.int32, device=device) if act_order else None
    wna16_matmul_triton(x, qweight, scales, zeros, g_idx, bits, group_size, 0)


def packed_experts_of_zeros(E: int, N: int, K: int, bits: int, group_size: int, device) -> PackedExperts:
    """E experts [N, K] of zero codes, scales and zeros (fp16 scales, zeros uint8 for int4 and int16 for int8,
    as model.WNA16Experts holds them), a group of rows for every group the kernel reads."""
    group_size = group_size if group_size > 0 else K
    groups = -(-K // group_size)
    return PackedExperts(torch.zeros(E, -(-K // (32 // bits)), N, dtype=torch.int32, device=device),
                         torch.zeros(E, groups, N, dtype=torch.float16, device=device),
                         torch.zeros(E, groups, N, dtype=torch.uint8 if bits == 4 else torch.int16, device=device),
                         bits, group_size, 0, K)


def _probe_wna16_moe(x: torch.Tensor, bits: int, group_size: int, intermediate: int, top_k: int) -> None:
    """fused_moe on one expert kept packed, at the model's widths (act-order experts are not kept packed: a
    group of all of K stands for them)."""
    H = x.shape[1]
    w13 = packed_experts_of_zeros(1, 2 * intermediate, H, bits, group_size, x.device)
    w2 = packed_experts_of_zeros(1, H, intermediate, bits, group_size, x.device)
    fused_moe_triton(x, w13, w2, torch.zeros(1, top_k, dtype=x.dtype, device=x.device),
                     torch.zeros(1, top_k, dtype=torch.int32, device=x.device))


# =========================================================================== the backends

TORCH = Backend("torch", store_kvcache_torch, paged_attention_torch, rms_norm_torch,
                add_rms_norm(rms_norm_torch), rotary_torch, silu_and_mul_torch, gelu_tanh_and_mul_torch,
                gemma_rms_norm_torch, add_rms_norm(gemma_rms_norm_torch), argmax_torch, fused_moe_torch,
                fused_moe_biases=True)
TRITON = None if triton is None else Backend(
    "triton", store_kvcache_triton, paged_attention_triton, rms_norm_triton, fused_add_rms_norm_triton,
    rotary_triton, silu_and_mul_triton, gelu_tanh_and_mul_triton, gemma_rms_norm_triton,
    gemma_fused_add_rms_norm_triton, argmax_cuda, fused_moe_triton,
    warm_up=warm_up_paged_attention_triton, warm_up_moe=warm_up_fused_moe_triton, capture_safe=True,
    fused_moe_biases=True)
