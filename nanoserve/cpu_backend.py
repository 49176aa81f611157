"""CPU backend: the fastest ``kernels.Backend`` this CPU can run, chosen once.

Platform code beside the reading path, as gpt-fast keeps ``quantize.py`` beside
its ``model.py``: the engine (and each tensor-parallel worker) calls
model.py ``select_backend`` once at start-up, which calls ``build_cpu_backend``
on a CPU, and hands the result to the layers; nothing else
here is needed to follow a request. Per op, in order of preference:

* attention and the KV store: the C kernels (``cpu_kernels.py``, bf16 on a CPU
  with AVX-512), else decode attention compiled by ``torch.compile``
  (inductor), else the torch references;
* RMSNorm, rotary, SiLU-and-mul (bf16 only): the C kernels if they give the
  torch references' results bit for bit on this model's shapes (checked here,
  every start-up), else inductor-fused copies (steps of 256+ tokens), else eager;
  Gemma's GELU-and-mul: the C kernel (the same check), else eager; Gemma's RMSNorm: eager;
* greedy argmax: the C kernel over bf16 logits, else torch's;
* top-k/top-p: most top-p rows decided from their largest logits, without the reference's sort
  (``top_k_top_p_by_candidates``; the same masks, also under --enforce-eager);
* a mixture-of-experts layer's experts: ``fused_moe_cpu``, the reference's result bit for
  bit in fewer, larger ops (the reference's under --enforce-eager), unless ``prepare_model``
  replaced them (below).

A candidate that cannot be built or checked here is logged, with why, and the
next one is taken. Each CPU backend's ``prepare_model`` packs bf16 linear weights
in oneDNN's layout (``pack_linear_weights``; also under --enforce-eager: a layout
with F.linear's results, not another kernel), except on a CPU with no bf16 matrix
instructions (AVX-512 BF16, AMX), where oneDNN emulates them at several times an
fp32 GEMM's cost (RESULTS.md): there the C linear kernel keeps them bf16 and
multiplies in fp32 (``WidenedLinear``), else (no AVX-512, no C compiler) they are
held in fp32 (``Fp32Linear``); with the C linear kernel the experts' weights are
packed for it too (``WidenedMoE``, one call per projection for all the experts). Where the
CPU has them, each expert's weights are packed for oneDNN (``PackedMoE``) with a ``WidenedMoE``
copy for decode-sized steps, at which oneDNN's GEMM is slower than the C linear. Also
here, applied by the engine: the process-wide allocator settings (``tune_process``) and
``trim_heap``.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import itertools
import logging
import os
import sys
import types
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve import cpu_kernels, kernels
from nanoserve.kernels import Backend
from nanoserve.kvcache import available_cpu_memory
# no cycle: model imports this file only inside functions
from nanoserve.model import TOP_K_WITHOUT_SORT, apply_top_k_top_p, first_line, sort_rows_for_thresholds, to_device

logger = logging.getLogger("nanoserve.model")

# Below this many tokens a compiled call's fixed cost (guards, ~25 us) is more
# than the memory passes it saves, so decode steps of small batches stay eager.
COMPILED_ELEMENTWISE_MIN_ROWS = 256
# GEMM primitives oneDNN (and ideep, again) keep: a step's ~5 weight shapes for the last
# couple of dozen step sizes; building one that fell out costs ~0.3 ms.
ONEDNN_CACHE_CAPACITY = 128
# PackedMoE's steps of at most this many (token, choice) rows an expert on average run the C
# linear (WidenedMoE), faster than oneDNN's bf16 GEMM at so few rows even with bf16 hardware.
WIDENED_MAX_ROWS = 16


def build_cpu_backend(cfg, dtype: torch.dtype, block_size: int, enforce_eager: bool = False) -> Backend:
    """``cfg`` is the model's ``ModelConfig`` (heads, sizes: the shapes to build
    and check for); ``enforce_eager``: the torch references, nothing built (but top-p by candidates
    and the weights packed, where they can be: the references' results in eager torch)."""
    if enforce_eager:
        packs = can_pack_linear_weights(dtype, torch.device("cpu"))
        return dataclasses.replace(kernels.TORCH, prepare_model=pack_model if packs else kernels.weights_as_loaded,
                                   top_k_top_p=top_k_top_p_by_candidates)
    attention, store, attend = _pick_attention(cfg, dtype, block_size)
    elementwise, (rms_norm, rotary, silu_and_mul) = _pick_elementwise(cfg, dtype)
    gelu_tanh_and_mul = _pick_gelu_tanh_and_mul(cfg, dtype)
    argmax_name, argmax = _pick_argmax(dtype)
    name = f"cpu (attention: {attention}, elementwise ops: {elementwise}, argmax: {argmax_name})"
    return Backend(name, store, attend, rms_norm, kernels.add_rms_norm(rms_norm), rotary, silu_and_mul,
                   gelu_tanh_and_mul, kernels.gemma_rms_norm_torch, kernels.add_rms_norm(kernels.gemma_rms_norm_torch),
                   argmax, fused_moe_cpu, prepare_model, top_k_top_p=top_k_top_p_by_candidates)


def _first_that_works(what: str, candidates, fallback):
    """The first (name, make) whose make() returns without raising, else fallback."""
    for name, make in candidates:
        try:
            return name, make()
        except Exception as e:  # noqa: BLE001 - any build or check failure means: try the next one
            log = logger.info if name == "c" else logger.warning
            log("[kernels] %s %r is not available here (--enforce-eager skips the attempt): %s", what, name,
                first_line(e))
    return fallback


# --------------------------------------------------------------------------- attention

def _pick_attention(cfg, dtype, block_size):
    if getattr(cfg, "attn_logit_softcapping", None) is not None:  # neither the C nor the compiled attention caps
        logger.info("[kernels] attention: the torch reference, which soft-caps the scores (Gemma 2)")
        return "torch", kernels.store_kvcache_torch, kernels.paged_attention_torch
    if getattr(cfg, "attention_sinks", False):  # nor do they take sinks
        logger.info("[kernels] attention: the torch reference, which takes attention sinks (gpt-oss)")
        return "torch", kernels.store_kvcache_torch, kernels.paged_attention_torch

    def c():
        return _smoke(cfg, dtype, block_size, cpu_kernels.store_kvcache, cpu_kernels.paged_attention)

    def inductor():
        return _smoke(cfg, dtype, block_size, kernels.store_kvcache_torch, paged_attention_compiled)
    candidates = ([("c", c)] if dtype == torch.bfloat16 else []) + [("inductor", inductor)]
    name, (store, attend) = _first_that_works(
        "attention backend", candidates,
        ("torch", (kernels.store_kvcache_torch, kernels.paged_attention_torch)))
    if getattr(cfg, "kv_lora_rank", 0) and name != "torch":  # the reference takes MLA's narrower V itself
        attend = value_as_whole_latent(attend)
    return name, store, attend


def value_as_whole_latent(paged_attention):
    """An attention whose kernels take V as wide as K, given MLA's V (the first kv_lora_rank dims of K's
    tensor, a view): it attends with all of K as V and keeps V's dims of the output (the rope dims'
    share of the weighted sum, 64 of 576 for the released models, is computed and dropped)."""
    def attend(query, k_cache, v_cache, *args, **kwargs):
        if v_cache.shape[3] == k_cache.shape[3]:
            return paged_attention(query, k_cache, v_cache, *args, **kwargs)
        if not kernels.value_in_key(k_cache, v_cache):
            raise ValueError("a V narrower than K must be K's own first dims here (MLA's latent)")
        return paged_attention(query, k_cache, k_cache, *args, **kwargs)[..., :v_cache.shape[3]]
    return attend


def _smoke(cfg, dtype, block_size, store, attend):
    """Build (and, for inductor, compile) by one decode over a one-block cache,
    made as the engine makes its caches (outside inference mode: dynamo guards on it)."""
    k_cache, v_cache = (torch.zeros(1, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype) for _ in "kv")
    with torch.inference_mode():
        kv = torch.zeros(1, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
        store(kv, kv, k_cache, v_cache, torch.full((1,), -1, dtype=torch.int64))  # slot -1: written nowhere
        query = torch.zeros(1, cfg.num_heads, cfg.head_dim, dtype=dtype)
        one = torch.ones(1, dtype=torch.int32)
        attend(query, k_cache, v_cache, torch.zeros(1, 1, dtype=torch.int32), one,
               torch.tensor([0, 1], dtype=torch.int32), 1.0)
    return store, attend


def paged_attention_compiled(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                             sliding_window: int | None = None, logits_soft_cap: float | None = None):
    """All-decode steps through the compiled decode attention; steps with
    prefill chunks, a sliding window that masks a key (or once dynamo refuses
    another graph) through the reference. No soft cap: a soft-capped model runs on the
    reference itself, by that name (_pick_attention)."""
    if logits_soft_cap is not None:
        raise ValueError("the compiled decode attention does not soft-cap attention scores (Gemma 2)")
    if not cpu_kernels.window_masks(seq_lens, sliding_window) and cpu_kernels.is_decode_only(query_start_loc):
        out = _run_compiled_decode(query, k_cache, v_cache, block_tables, seq_lens, scale)
        if out is not None:
            return out
    return kernels.paged_attention_torch(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                         sliding_window)


def decode_attention_fused(query, k_cache, v_cache, block_tables, seq_lens, scale):
    """Decode attention (``query`` [seqs, kv_heads, group, head_dim] -> the same) as
    plain reductions over the paged cache, written for torch.compile: inductor
    turns the block-table lookup into addressing inside its dot-product loops, so
    K and V are read straight from the cache, with no gathered copy and no tiny
    GEMM per (sequence, head). Eagerly it would materialise a huge product.
    Scores, softmax and the weighted sum stay in fp32."""
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
def compiled_decode_attention(shape_key: tuple):
    """decode_attention_fused compiled for one shape key (the sizes and dtypes its
    graph keeps constant), on a code object of its own: dynamo counts its
    recompile_limit (8) per code object, so one compile shared by every shape
    turned eager at the ninth model shape in a process: which path a step took
    depended on what had run before it. Cached per key, as cpu_kernels.attention_library is."""
    # dynamic=False keeps head_dim, heads and block_size constants (inductor then
    # unrolls and vectorises the head_dim loop); the batch, table and cache sizes
    # are marked unbacked in _run_compiled_decode, so one graph serves every batch.
    return torch.compile(with_own_code(decode_attention_fused), dynamic=False, fullgraph=True)


def with_own_code(fn):
    """A copy of ``fn`` on a new code object: dynamo keeps its graphs, and their
    count against the recompile limit, per code object."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _run_compiled_decode(query, k_cache, v_cache, block_tables, seq_lens, scale):
    """The compiled decode, or None when dynamo refuses to compile yet another
    graph for this shape key (its recompile_limit: guards other than the shapes)."""
    import torch._dynamo
    from torch._dynamo.decorators import mark_unbacked
    n, num_heads, head_dim = query.shape
    # [n, kv_heads, group, d]: a static group lets inductor unroll the query heads
    # that share a K/V row.
    q = query.reshape(n, k_cache.shape[2], -1, head_dim)
    compiled = compiled_decode_attention((*q.shape[1:], k_cache.shape[1], q.dtype, k_cache.dtype))
    width = -(-int(seq_lens.max()) // k_cache.shape[1])
    table = block_tables[:, :width].clone(memory_format=torch.contiguous_format)  # never a view: one graph
    for t, dims in ((q, (0,)), (k_cache, (0,)), (v_cache, (0,)), (table, (0, 1)), (seq_lens, (0,))):
        for dim in dims:
            mark_unbacked(t, dim)
    scale = torch.tensor(scale, dtype=torch.float32, device=query.device)  # a tensor: no constant to recompile on
    try:
        return compiled(q, k_cache, v_cache, table, seq_lens, scale).view(n, num_heads, head_dim)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        warnings.warn("torch.compile's recompile limit is reached: decode attention runs eager "
                      "SDPA for this model", RuntimeWarning, stacklevel=2)
        return None


# --------------------------------------------------------------------------- elementwise ops

def _pick_elementwise(cfg, dtype):
    references = (kernels.rms_norm_torch, kernels.rotary_torch, kernels.silu_and_mul_torch)
    if dtype != torch.bfloat16:  # fp32, the tests' oracle dtype, stays eager
        return "torch", references

    def c():
        ops = (c_or_reference(cpu_kernels.rms_norm, kernels.rms_norm_torch, lambda x: x.shape[-1]),
               cpu_kernels.rotary,
               c_or_reference(cpu_kernels.silu_and_mul, kernels.silu_and_mul_torch, lambda g: g.shape[-1] // 2))
        return check_same_as_torch(ops, cfg)

    def inductor():
        shapes = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        return check_same_as_torch(compiled_elementwise_ops(shapes), cfg)
    return _first_that_works("elementwise ops", [("c", c), ("inductor", inductor)], ("torch", references))


def c_or_reference(c_op, reference, width):
    """c_op where the C kernel takes the input's ``width(x)`` (a multiple of 16), else the reference: a layer
    of another width than those checked at start-up may call the op (a shared expert's MLP, OLMoE's norm over
    all of k's heads, each split across tensor-parallel ranks, 48 wide into 24)."""
    @functools.wraps(c_op)
    def op(x, *args):
        return c_op(x, *args) if width(x) % 16 == 0 else reference(x, *args)
    return op


def check_same_as_torch(ops, cfg, num_tokens: int = COMPILED_ELEMENTWISE_MIN_ROWS + 1):
    """Return ``ops`` (rms_norm, rotary, silu_and_mul) if they compute the torch
    references' results bit for bit on random bf16 inputs of this model's shapes,
    laid out as the layers pass them (q and k as views of one projection); raise
    otherwise. The C kernels copy ATen's summation order, which a future torch
    might change; this is what keeps outputs from moving then."""
    rms_norm, rotary, silu_and_mul = ops
    gen = torch.Generator().manual_seed(0)
    T, hq, hk, d = num_tokens, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rand = lambda *shape: (torch.randn(*shape, generator=gen) * 3).bfloat16()  # noqa: E731
    x, w, gate_up = rand(T, cfg.hidden_size), rand(cfg.hidden_size), rand(T, 2 * cfg.intermediate_size)
    qkv, qw, kw = rand(T, (hq + 2 * hk) * d), rand(d), rand(d)
    q, k = qkv[:, :hq * d].view(T, hq, d), qkv[:, hq * d:(hq + hk) * d].view(T, hk, d)
    positions = torch.randint(0, 64, (T,), generator=gen)
    r = cfg.rotary_dim  # the model's rotary dims (partial rotary: fewer than d)
    cos, sin = torch.randn(64, r, generator=gen), torch.randn(64, r, generator=gen)
    pairs = [(rms_norm(x, w, 1e-6), kernels.rms_norm_torch(x, w, 1e-6)),
             (silu_and_mul(gate_up), kernels.silu_and_mul_torch(gate_up))]
    if cfg.qk_norm:  # Qwen3: per-head norms, then rotary of their (contiguous) outputs
        pairs += [(rms_norm(q, qw, 1e-6), kernels.rms_norm_torch(q, qw, 1e-6)),
                  (rms_norm(k, kw, 1e-6), kernels.rms_norm_torch(k, kw, 1e-6))]
        q, k = kernels.rms_norm_torch(q, qw, 1e-6), kernels.rms_norm_torch(k, kw, 1e-6)
    pairs += zip(rotary(q, k, positions, cos, sin), kernels.rotary_torch(q, k, positions, cos, sin))
    if not all(torch.equal(a, b) for a, b in pairs):
        raise RuntimeError("their results differ from the torch references' on this machine")
    return ops


def _mean_square(x: torch.Tensor) -> torch.Tensor:
    return x.float().pow(2).mean(-1, keepdim=True)


def _rms_scale(x: torch.Tensor, ms: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x.float() * torch.rsqrt(ms + eps)).to(x.dtype)


@functools.cache
def compiled_elementwise_ops(shape_key: tuple):
    """Inductor's fused copies of (rms_norm, rotary, silu_and_mul) for one model's
    shapes, each with its own recompile limit (as compiled_decode_attention). Eager torch
    runs each pointwise op as its own pass over memory, which at prefill sizes
    costs more than the arithmetic. emulate_precision_casts rounds each bf16
    intermediate where eager torch does, so outputs stay eager's bit for bit.
    RMSNorm's mean of squares stays eager, outside: inductor sums the squares
    in another order than ATen, which moved outputs."""
    rms_scale = compile_rows(_rms_scale, 2)

    def rms_norm(x, weight, eps):
        return rms_scale(x, _mean_square(x), weight, eps)
    return rms_norm, compile_rows(kernels.rotary_torch, 3), compile_rows(kernels.silu_and_mul_torch, 1)


def compile_rows(fn, row_args: int):
    """torch.compile(fn) with dim 0 (the tokens) of its first ``row_args``
    arguments unbacked: one graph per model shape serves every step size, while
    the other sizes stay constants for inductor to vectorise. Short steps, and
    any call once dynamo's recompile limit is reached, run ``fn`` eagerly."""
    compiled = torch.compile(with_own_code(fn), dynamic=False, fullgraph=True,
                             options={"emulate_precision_casts": True})

    def run(*args):
        import torch._dynamo
        from torch._dynamo.decorators import mark_unbacked
        if args[0].shape[0] < COMPILED_ELEMENTWISE_MIN_ROWS:
            return fn(*args)
        for t in args[:row_args]:
            mark_unbacked(t, 0)
        try:
            return compiled(*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            warnings.warn(f"torch.compile's recompile limit is reached: {fn.__name__} runs eager "
                          "for this model", RuntimeWarning, stacklevel=2)
            return fn(*args)
    return run


def _pick_gelu_tanh_and_mul(cfg, dtype):
    """Gemma's activation (built only for a model that uses it): in bf16 the C kernel if it gives
    the reference's results bit for bit on this model's width, else the reference."""
    def c():
        gate_up = (torch.randn(COMPILED_ELEMENTWISE_MIN_ROWS + 1, 2 * cfg.intermediate_size,
                               generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
        if not torch.equal(cpu_kernels.gelu_tanh_and_mul(gate_up), kernels.gelu_tanh_and_mul_torch(gate_up)):
            raise RuntimeError("its results differ from the torch reference's on this machine")
        return cpu_kernels.gelu_tanh_and_mul
    if dtype != torch.bfloat16 or kernels.act_and_mul_name(cfg) != "gelu_tanh_and_mul":
        return kernels.gelu_tanh_and_mul_torch
    return _first_that_works("gelu_tanh_and_mul", [("c", c)], ("torch", kernels.gelu_tanh_and_mul_torch))[1]


# --------------------------------------------------------------------------- argmax

def _pick_argmax(dtype):
    def c():
        cpu_kernels.argmax(torch.zeros(1, 16, dtype=torch.bfloat16))
        return cpu_kernels.argmax
    if dtype != torch.bfloat16:
        return "torch", kernels.argmax_torch
    return _first_that_works("argmax", [("c", c)], ("torch", kernels.argmax_torch))


# --------------------------------------------------------------------------- top-k/top-p

def top_k_top_p_by_candidates(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """model.apply_top_k_top_p's masks, bit for bit, with most top-p rows decided without a sort:
    a large vocabulary's sort is many times slower than its topk on the CPU (RESULTS.md, "top-p
    from the largest logits"). Each row's nucleus is read from its TOP_K_WITHOUT_SORT largest
    logits and, without top-k, the row's log-normalizer over the whole vocabulary; a row they
    cannot decide (its nucleus, or the ties of its k-th logit, run past them; or its k does) is
    sorted, as the reference sorts it. Top-k alone is the reference's already (topk)."""
    if all(p >= 1.0 for p in top_p):
        return apply_top_k_top_p(logits, top_k, top_p)
    V = logits.shape[-1]
    top_k = [k if 0 < k < V else 0 for k in top_k]
    K = min(V, TOP_K_WITHOUT_SORT)
    # every row takes K candidates, whatever its k: which rows a batch holds must not change a
    # row's candidates (seeded rows are batch-invariant)
    candidates = logits.topk(K, dim=-1).values
    # a row without top-k needs its whole vocabulary's normalizer, which its candidates do not give
    row_lse = logits.logsumexp(dim=-1, keepdim=True) if K < V else None
    threshold, undecided = _candidate_thresholds(candidates, top_k, top_p, row_lse)
    sort = sorted({i for i, k in enumerate(top_k) if k > K} | set(undecided.nonzero().flatten().tolist()))
    if sort:
        sort_rows_for_thresholds(logits, sort, top_k, top_p, threshold)
    return logits.masked_fill(logits < threshold, float("-inf"))


def _candidate_thresholds(largest: torch.Tensor, top_k: list[int], top_p: list[float],
                          row_lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """model.top_k_top_p_thresholds from each row's largest logits (descending) and ``row_lse``
    (None: the candidates are the whole row), and whether the candidates were too few to
    decide a top-p row. (A row whose k is past them is given a wrong threshold: it is sorted.)"""
    dev, K = largest.device, largest.shape[-1]
    k = to_device(top_k, dev)[:, None]
    kth = largest.gather(1, (k - 1).clamp(0, K - 1)).masked_fill(k == 0, float("-inf"))
    p = to_device(top_p, dev, largest.dtype)[:, None]
    if any(top_k):
        largest = largest.masked_fill(largest < kth, float("-inf"))
    probs = largest.softmax(dim=-1)  # over a row's top-k: all among the candidates unless undecided
    if row_lse is not None:
        probs = torch.where(k > 0, probs, (largest - row_lse).exp())
    n = torch.searchsorted(probs.cumsum(dim=-1), p) + 1
    least = largest.gather(1, n.clamp(max=K) - 1).masked_fill(p >= 1.0, float("-inf"))
    undecided = torch.zeros(len(top_k), dtype=torch.bool, device=dev)
    if row_lse is not None:  # a top-k row's k-th logit tied to the last candidate, or a nucleus past them
        undecided = (torch.where(k > 0, largest[:, -1:] >= kth, n > K) & (p < 1.0)).squeeze(1)
    return torch.maximum(kth, least), undecided


# --------------------------------------------------------------------------- model and process

class PackedLinear(nn.Module):
    """A linear layer whose weight oneDNN holds in its own blocked layout, packed
    once at load instead of by F.linear on every call; bit for bit F.linear's
    results in bf16."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int = 64, tp=None):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        self.bias = bias
        self.tp = tp  # a RowParallelLinear's group: its partial products still need their all-reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out if self.tp is None else self.tp.all_reduce(out)


def can_pack_linear_weights(dtype: torch.dtype, device: torch.device) -> bool:
    # an fp32 model stays unpacked: F.linear's fp32 path is MKL's, and packed results differ in the last bit
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Fp32Linear(PackedLinear):
    """A bf16 model's linear layer computed in fp32, for a CPU without bf16 matrix
    instructions: the weight packed for oneDNN in fp32 (exactly the bf16 values;
    oneDNN's fp32 GEMM is faster than MKL's F.linear at all but the smallest
    steps, RESULTS.md), the input widened, the output rounded back to bf16 (under tensor
    parallelism after the all-reduce). The same products as a bf16 GEMM, which
    also accumulates in fp32; only the order of the sums may differ."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp=None):
        super().__init__(weight.detach().float(), None if bias is None else bias.detach().float(), tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float()).to(x.dtype)


class WidenedLinear(nn.Module):
    """A bf16 model's linear layer for a CPU with AVX-512 but no bf16 matrix
    instructions: the weight stays bf16, packed for csrc/linear.c, which widens
    each weight in a register and multiplies in fp32 (the same products as a bf16
    GEMM, summed in one fixed order); the output is rounded to bf16, under tensor
    parallelism after the all-reduce. Half the bytes of Fp32Linear's weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp=None):
        super().__init__()
        self.out_features = weight.shape[0]
        self.packed = cpu_kernels.pack_linear_weight(weight.detach())
        self.bias = None
        if bias is not None:  # fp32, zeros past the last output: the kernel reads whole panels
            self.bias = torch.zeros(self.packed.shape[0] * cpu_kernels.LINEAR_PANEL)
            self.bias[:len(bias)] = bias.detach()
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return cpu_kernels.linear(x, self.packed, self.out_features, self.bias)
        partial = cpu_kernels.linear(x, self.packed, self.out_features, self.bias, torch.float32)
        return self.tp.all_reduce(partial).to(x.dtype)


def linear_in_order(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What csrc/linear.c computes, in torch (slowly: one op per input): fp32 sums
    over k in order, from the bias. A product of two bf16 is exact in fp32, so
    each add rounds once, as the kernel's FMA does."""
    acc = torch.zeros(x.shape[0], weight.shape[0]) if bias is None else bias.float().expand(x.shape[0], -1)
    for k in range(x.shape[1]):
        acc = acc + x[:, k, None].float() * weight[:, k].float()
    return acc.to(x.dtype)


def check_c_linear() -> type[nn.Module]:
    """WidenedLinear, if csrc/linear.c builds here and gives linear_in_order's results
    bit for bit (a row tail, a panel tail and a bias included); raises otherwise."""
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=gen).bfloat16() for shape in ((13, 64), (40, 64), (40,)))
    layer = WidenedLinear(w, b)
    if not torch.equal(layer(x), linear_in_order(x, w, b)):
        raise RuntimeError("its results differ from the reference's on this machine")
    return WidenedLinear


# --------------------------------------------------------------------------- mixture of experts

def fused_moe_cpu(x, w13, w2, topk_weights, topk_ids, silu_and_mul=kernels.silu_and_mul_torch) -> torch.Tensor:
    """kernels.fused_moe_torch with fewer, larger ops, bit for bit its result: the rows
    gathered once, in expert order (moe_order), each expert's F.linear over its slice,
    their weighted fp32 outputs summed per token by moe_combine. Weights of another dtype
    than x (Fp32MoE's fp32 for a bf16 model) multiply x widened to theirs, and each
    projection's output is rounded to x's dtype, as the reference's."""
    rows, order, weights, counts = moe_order(x, topk_weights, topk_ids, w13.shape[0])
    ys = torch.empty(rows.shape[0], x.shape[1], dtype=torch.float32)
    start = 0
    for e, n in enumerate(counts):
        if n:
            h = silu_and_mul(F.linear(rows[start:start + n].to(w13.dtype), w13[e]).to(x.dtype))
            ys[start:start + n] = F.linear(h.to(w2.dtype), w2[e]).to(x.dtype).float()
            start += n
    return moe_combine(ys, order, weights, topk_ids.shape[1]).to(x.dtype)


def moe_order(x, topk_weights, topk_ids, num_experts: int):
    """(rows, order, weights, counts): the (token, choice) pairs' rows of x [T*k, H] grouped by
    expert (one stable sort; expert e's are the counts[e] rows after the earlier experts'),
    ``order`` their (token, choice) index and ``weights`` their routing weights, in that
    order. Each token's choices are first put in increasing expert order, which
    moe_combine's sum then follows, as the reference's index_add_ adds them."""
    k = topk_ids.shape[1]
    ids, choice = topk_ids.sort(dim=1, stable=True)
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    weights = topk_weights.gather(1, choice).reshape(-1)[order]
    return x[order // k], order, weights, torch.bincount(flat, minlength=num_experts).tolist()


def moe_combine(ys: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, k: int) -> torch.Tensor:
    """fp32 [T, H]: the experts' outputs ys [T*k, H] (fp32, in moe_order's order) weighted,
    copied to their (token, choice) rows, and summed over each token's choices in expert
    order: one copy and one sum for all the experts, where the reference adds each
    expert's rows in an op of its own (RESULTS.md)."""
    ys.mul_(weights[:, None].float())
    return torch.empty_like(ys).index_copy_(0, order, ys).view(ys.shape[0] // k, k, ys.shape[1]).sum(1)


class WidenedMoE(nn.Module):
    """A bf16 model's FusedMoE for a CPU with AVX-512 but no bf16 matrix instructions, as
    WidenedLinear for its linear layers: each expert's w13 and w2 stay bf16, packed for
    csrc/linear.c, which multiplies them in fp32; each projection is one C call for all
    the experts (cpu_kernels.moe_linear) over the rows in moe_order's order, its output
    rounded to bf16 as a bf16 F.linear's is: only the order of the fp32 sums differs
    from the reference's (fused_moe_torch)."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        w13, w2 = moe.w13_weight.detach(), moe.w2_weight.detach()
        self.tp, self.silu_and_mul = moe.tp, moe.backend.silu_and_mul
        self.num_experts, self.n13, self.n2 = w13.shape[0], w13.shape[1], w2.shape[1]
        self.packed13 = torch.stack([cpu_kernels.pack_linear_weight(w) for w in w13])
        self.packed2 = torch.stack([cpu_kernels.pack_linear_weight(w) for w in w2])

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        rows, order, weights, counts = moe_order(x, topk_weights, topk_ids, self.num_experts)
        offsets = torch.tensor([0, *counts]).cumsum(0)
        h = self.silu_and_mul(cpu_kernels.moe_linear(rows, self.packed13, self.n13, offsets))
        ys = cpu_kernels.moe_linear(h, self.packed2, self.n2, offsets).float()
        return self.tp.all_reduce(moe_combine(ys, order, weights, topk_ids.shape[1])).to(x.dtype)


class PackedMoE(nn.Module):
    """A bf16 model's FusedMoE on a CPU with bf16 matrix instructions, as PackedLinear for its
    linear layers: each expert's w13 and w2 packed for oneDNN once at load (a bf16 F.linear over
    the weights as loaded reorders them on every call), with fused_moe_cpu's order and sums
    around them: bit for bit the reference's (fused_moe_torch) result. oneDNN's GEMM costs
    ~0.2 ms a call at a few rows, though, streaming the expert's weights at a third of the C
    linear's rate (RESULTS.md), so ``widened`` (a WidenedMoE of the same experts, their
    weights held twice) runs the steps of at most WIDENED_MAX_ROWS rows an expert on average:
    decode steps, whose sums are then in the C linear's order."""

    def __init__(self, moe: nn.Module, widened: WidenedMoE | None = None, batch_hint: int = 64):
        super().__init__()
        self.tp, self.silu_and_mul, self.widened = moe.tp, moe.backend.silu_and_mul, widened
        pack = torch.ops.mkldnn._reorder_linear_weight
        self.packed13 = [pack(w, batch_hint) for w in moe.w13_weight.detach()]
        self.packed2 = [pack(w, batch_hint) for w in moe.w2_weight.detach()]

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.widened is not None and topk_ids.numel() <= WIDENED_MAX_ROWS * len(self.packed13):
            return self.widened(x, topk_weights, topk_ids)
        if not x.shape[0]:
            return x.clone()
        rows, order, weights, counts = moe_order(x, topk_weights, topk_ids, len(self.packed13))
        linear = torch.ops.mkldnn._linear_pointwise
        bounds = [(e, s - n, s) for e, (n, s) in enumerate(zip(counts, itertools.accumulate(counts))) if n]
        # silu_and_mul works row by row: one call over every expert's rows is each call's result
        h = self.silu_and_mul(torch.cat([linear(rows[a:b], self.packed13[e], None, "none", [], "")
                                         for e, a, b in bounds]))
        ys = torch.cat([linear(h[a:b], self.packed2[e], None, "none", [], "") for e, a, b in bounds]).float()
        return self.tp.all_reduce(moe_combine(ys, order, weights, topk_ids.shape[1])).to(x.dtype)


class Fp32MoE(nn.Module):
    """A bf16 model's FusedMoE computed in fp32, as Fp32Linear for its linear layers (a CPU
    without bf16 matrix instructions where the C linear cannot run): the experts' weights
    held in fp32 (exactly the bf16 values), fused_moe_cpu over them."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.tp, self.silu_and_mul = moe.tp, moe.backend.silu_and_mul
        self.w13_weight, self.w2_weight = moe.w13_weight.detach().float(), moe.w2_weight.detach().float()

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(fused_moe_cpu(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                                                self.silu_and_mul))


def has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX); without,
    oneDNN's bf16 GEMM emulates it, several times slower than an fp32 GEMM (RESULTS.md)."""
    cpu = torch.cpu
    if not hasattr(cpu, "_is_avx512_bf16_supported"):  # another torch: assume it does, as before
        return True
    return cpu._is_avx512_bf16_supported() or getattr(cpu, "_is_amx_tile_supported", lambda: False)()


def prepare_model(model: nn.Module) -> int:
    """The CPU backends' ``prepare_model``: where the CPU has no bf16 matrix
    instructions, bf16 linear weights (and experts) for the C linear kernel, else in fp32 where
    the memory allows; otherwise packed where oneDNN can, the experts too (PackedMoE). Returns
    the bytes added to the weights' memory."""
    weight = model.model.embed_tokens.weight
    if can_pack_linear_weights(weight.dtype, weight.device) and not has_bf16_matmul():
        _, layer = _first_that_works("linear kernel", [("c", check_c_linear)], ("fp32", Fp32Linear))
        if layer is WidenedLinear:  # the same bytes, but for the panels' padding
            embedding = model.model.embed_tokens
            before = sum(m.weight.numel() * 2 for _, _, m in _linears(model)) + embedding.weight.numel() * 2
            experts_before = _expert_bytes(model)
            tied = model.lm_head is None
            count = pack_linear_weights(model, WidenedLinear)
            widened_moes = widen_experts(model)
            if tied:  # the lookup reads the head's packed copy: one copy of the table, not two
                embedding.rows = functools.partial(cpu_kernels.packed_rows, model.lm_head.packed)
                embedding.weight = nn.Parameter(embedding.weight.new_empty(0, embedding.weight.shape[1]),
                                                requires_grad=False)  # its device and dtype, for who asks
            trim_heap()  # the weights as loaded are freed, but glibc keeps them unless asked
            logger.info("[kernels] no bf16 matrix instructions on this CPU (AVX-512 BF16, AMX): %d linear weights "
                        "%skept in bf16 for the C linear kernel, which multiplies them in fp32%s", count,
                        f"and {widened_moes} layers' experts " if widened_moes else "",
                        " (the embedding lookup reads the tied head's copy)" if tied else "")
            return sum(m.packed.numel() * 2 for m in model.modules() if isinstance(m, WidenedLinear)) \
                + embedding.weight.numel() * 2 - before + _expert_bytes(model) - experts_before
        extra = _upcast_bytes(model)
        avail = available_cpu_memory()
        if avail is None or extra < avail // 2:  # room to spare for the KV cache and the steps
            count = pack_linear_weights(model, Fp32Linear)
            for parent, name, moe in _fused_moes(model):
                setattr(parent, name, Fp32MoE(moe))
            trim_heap()  # the fp32 copies oneDNN packed from are freed, but glibc keeps them unless asked
            logger.info("[kernels] no bf16 matrix instructions on this CPU (AVX-512 BF16, AMX): %d linear weights "
                        "held in fp32, whose GEMMs are faster here (+%.2f GiB)", count, extra / 2**30)
            return extra
        logger.warning("[kernels] no bf16 matrix instructions on this CPU: fp32 linear weights would be faster, but "
                       "need %.2f GiB more than the %.2f GiB available; bf16 it is", extra / 2**30, avail / 2**30)
    added = pack_model(model)
    if can_pack_linear_weights(weight.dtype, weight.device):
        added += pack_experts(model)
    return added


def pack_model(model: nn.Module) -> int:
    """bf16 linear weights packed for oneDNN (the same bytes, another layout); 0 bytes added."""
    weight = model.model.embed_tokens.weight
    if can_pack_linear_weights(weight.dtype, weight.device):
        logger.debug("[kernels] %d linear weights packed for oneDNN", pack_linear_weights(model))
    return 0


def _children(model: nn.Module, cls: type) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, name, child) of every module of type cls, so that it can be replaced."""
    return [(parent, name, child) for parent in list(model.modules())
            for name, child in list(parent.named_children()) if isinstance(child, cls)]


def _linears(model: nn.Module):
    """Every model.Linear, as _children gives them, but those holding an int weight packed (model.WNA16Weight:
    the torch twin's, which has no C kernel here)."""
    from nanoserve.model import Linear
    return [c for c in _children(model, Linear) if c[2].wna16 is None]


def _fused_moes(model: nn.Module):
    """Every mixture-of-experts layer's experts (model.FusedMoE), as _children gives them, but those kept
    packed (model.WNA16Experts: the torch twin's, which has no C kernel here)."""
    from nanoserve.model import FusedMoE
    return [c for c in _children(model, FusedMoE) if c[2].w13_packed is None]


def _expert_bytes(model: nn.Module) -> int:
    """The experts' bf16 weights: a WidenedMoE's packed copies, a FusedMoE's as loaded (one
    widen_experts leaves, whose width the C linear does not take)."""
    from nanoserve.model import FusedMoE
    return sum(t.numel() * 2 for m in model.modules()
               for t in ((m.packed13, m.packed2) if isinstance(m, WidenedMoE) else
                         (m.w13_weight, m.w2_weight) if isinstance(m, FusedMoE) and m.w13_packed is None
                         else ()))


def _c_linear_takes(moe: nn.Module) -> bool:
    """Whether the C linear takes these experts: it packs K (hidden, intermediate) in pairs."""
    return moe.w2_weight.shape[1] % 2 == 0 and moe.w2_weight.shape[2] % 2 == 0


def widen_experts(model: nn.Module) -> int:
    """Replace every FusedMoE by a WidenedMoE of its weights, which are freed; returns how many
    (none where the C linear cannot take them: an odd hidden or intermediate size)."""
    moes = [m for m in _fused_moes(model) if _c_linear_takes(m[2])]
    for parent, name, child in moes:
        setattr(parent, name, WidenedMoE(child))
    return len(moes)


def pack_experts(model: nn.Module) -> int:
    """Replace every FusedMoE by a PackedMoE of its weights, with a WidenedMoE copy for the small
    steps where the C linear builds here and takes them, and the copy (the experts held twice)
    fits in half the memory available, as the fp32 weights' rule; returns the bytes it adds."""
    moes = _fused_moes(model)
    if not moes:
        return 0
    c = _first_that_works("linear kernel for the experts' small steps", [("c", check_c_linear)], (None, None))[1]
    copied = [moe for _, _, moe in moes if c and _c_linear_takes(moe)]
    need, avail = sum((m.w13_weight.numel() + m.w2_weight.numel()) * 2 for m in copied), available_cpu_memory()
    if copied and avail is not None and need >= avail // 2:
        logger.info("[kernels] the experts get no C linear copy for small steps: it would need %.2f GiB of the "
                    "%.2f GiB available", need / 2**30, avail / 2**30)
        copied = []
    added = 0
    for parent, name, moe in moes:
        widened = WidenedMoE(moe) if any(moe is m for m in copied) else None
        setattr(parent, name, PackedMoE(moe, widened))
        added += 0 if widened is None else (widened.packed13.numel() + widened.packed2.numel()) * 2
    logger.info("[kernels] %d layers' experts packed for oneDNN%s", len(moes),
                f", and for the C linear for steps of <= {WIDENED_MAX_ROWS} rows an expert "
                f"(+{added / 2**20:.1f} MiB)" if added else "")
    return added


def _upcast_bytes(model: nn.Module) -> int:
    """What Fp32Linear and Fp32MoE layers add: 2 more bytes a weight, 4 for a tied head's own copy."""
    weights = [m.weight for _, _, m in _linears(model)] + [
        w for _, _, m in _fused_moes(model) for w in (m.w13_weight, m.w2_weight)]
    tied = model.model.embed_tokens.weight.numel() * 4 if model.lm_head is None else 0
    return sum(w.numel() * 2 for w in weights) + tied


def pack_linear_weights(model: nn.Module, layer: type[nn.Module] = PackedLinear) -> int:
    """Replace every ``model.Linear`` by a ``layer`` (PackedLinear, Fp32Linear or WidenedLinear) of
    its weight, which is freed; a tied LM head gets a copy of the embedding, which
    stays as loaded for the lookup. Returns the number of weights packed."""
    from nanoserve.model import RowParallelLinear
    count = 0
    for parent, name, child in _linears(model):
        setattr(parent, name, layer(child.weight, child.bias,
                                    tp=child.tp if isinstance(child, RowParallelLinear) else None))
        count += 1
    if model.lm_head is None:
        model.lm_head = layer(model.model.embed_tokens.weight, None)
        count += 1
    return count


def tune_process() -> list[str]:
    """Process-wide memory settings that make CPU steps faster; returns what was set.

    * ``THP_MEM_ALLOC_ENABLE=1`` (unless already set): torch backs its large CPU
      tensors with transparent huge pages, so fewer page faults and TLB misses.
      It takes effect for allocations after this, so it runs before the weights load.
    * glibc malloc: no mmap, one arena, no trimming. Every step allocates and
      frees hundreds of MB of activations; by default glibc serves each with a
      fresh mmap() and trims the heap on free, so each step page-faults them in
      again. The cost: memory freed after a large step stays in the process.
    * oneDNN's primitive cache and ideep's LRU cache of them (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``,
      ``LRU_CACHE_CAPACITY``, unless already set) hold ONEDNN_CACHE_CAPACITY entries, not
      1,024 each: every new step size builds new GEMM primitives, and 2 x 1,024 of them
      are hundreds of MB that a server keeps for ever. Both are read at the process's
      first oneDNN call, so this runs before the weights are packed.
    The speed-ups and memory are measured in benchmarks/RESULTS.md ("allocator", issue 23)."""
    done = []
    for name, value in (("THP_MEM_ALLOC_ENABLE", 1), ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE_CAPACITY),
                        ("LRU_CACHE_CAPACITY", ONEDNN_CACHE_CAPACITY)):
        if name not in os.environ:
            os.environ[name] = str(value)
            done.append(f"{name}={value}")
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6")
        except OSError:
            return done
        M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's <malloc.h>
        if libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_ARENA_MAX, 1) and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1):
            done.append("glibc malloc: no mmap, one arena, no trimming")
    return done


def trim_heap() -> bool:
    """glibc's malloc_trim: the heap's free pages back to the system. tune_process
    turned glibc's own trimming off for the steps' sake; the server's engine calls
    this when it goes idle, so a transient big step does not keep its memory."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):  # not glibc
        return False


__all__ = ["build_cpu_backend", "prepare_model", "pack_model", "pack_linear_weights", "can_pack_linear_weights",
           "has_bf16_matmul", "check_c_linear", "fused_moe_cpu", "moe_order", "moe_combine", "WidenedMoE",
           "PackedMoE", "Fp32MoE", "widen_experts", "pack_experts", "linear_in_order", "tune_process", "trim_heap",
           "check_same_as_torch", "compiled_elementwise_ops", "paged_attention_compiled"]
