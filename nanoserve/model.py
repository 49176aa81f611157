"""Model execution layer: weights, the forward pass, and sampling.

This module owns
* ``ModelConfig``: a Hugging Face ``config.json`` read into the few numbers a
  decoder needs (both transformers 4's ``rope_theta``/``rope_scaling`` keys and
  transformers 5's ``rope_parameters``);
* the Llama / Qwen2 / Qwen3 / Mistral decoder, written once: q/k/v and gate/up
  are fused at load time, Qwen2's q/k/v bias and Qwen3's q/k RMSNorm are flags;
* loading ``*.safetensors`` (one file or a sharded index) into it;
* ``ModelRunner``: turns one scheduled step (plain lists) into tensors, runs the
  forward over the flattened tokens of all requests (no padding to a
  rectangle), computes logits only for the rows that are sampled, and samples.

It knows nothing of queues or HTTP. The KV tensors it writes come from
``kvcache``; the attention it runs comes from ``kernels``.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import json
import logging
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve import kernels
from nanoserve.kvcache import slot_mapping as compute_slot_mapping

logger = logging.getLogger("nanoserve.model")

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}


class ModelLoadError(ValueError):
    """A model directory nanoserve cannot serve; the message says why."""


# =========================================================================== config

@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool          # Qwen2: bias on q/k/v
    qk_norm: bool                 # Qwen3: RMSNorm on q and k per head
    sliding_window: int | None    # only set when the checkpoint would really use it
    checkpoint_dtype: str
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_dir():
            raise ModelLoadError(f"model directory {str(path)!r} does not exist (pass --model DIR, "
                                 f"a Hugging Face model directory with config.json)")
        cfg_file = path / "config.json"
        if not cfg_file.exists():
            raise ModelLoadError(f"{str(path)!r} has no config.json: not a Hugging Face model directory")
        return cls.from_dict(json.loads(cfg_file.read_text()))

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> "ModelConfig":
        archs = c.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(f"unsupported architecture {arch!r}; nanoserve supports "
                                 f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        num_heads = c["num_attention_heads"]
        theta, scaling = _rope_from_config(c)
        eos = c.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=c.get("num_key_value_heads") or num_heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // num_heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(c.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=_active_sliding_window(arch, c),
            checkpoint_dtype=str(c.get("dtype") or c.get("torch_dtype") or "float32"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )

    def check_max_model_len(self, max_model_len: int) -> None:
        if self.sliding_window is not None and self.sliding_window < max_model_len:
            raise ModelLoadError(
                f"this checkpoint uses sliding-window attention (window {self.sliding_window}), which "
                f"nanoserve does not implement; use --max-model-len {self.sliding_window} or less so "
                f"that the window never takes effect")


def _rope_from_config(c: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = c.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    if params is None:
        params = dict(c.get("rope_scaling") or {})
        params.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    params = dict(params)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope type {rope_type!r}; nanoserve supports "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    theta = float(params.pop("rope_theta", c.get("rope_theta", 10000.0)))
    params["rope_type"] = rope_type
    return theta, (None if rope_type == "default" else params)


def _active_sliding_window(arch: str, c: dict[str, Any]) -> int | None:
    window = c.get("sliding_window")
    if window is None:
        return None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        uses = c.get("use_sliding_window", False) or "sliding_attention" in (c.get("layer_types") or [])
        return int(window) if uses else None
    return int(window)


def num_parameters(cfg: ModelConfig) -> int:
    """Parameter count from the config alone, to check memory before loading."""
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * D
    layer = H * qkv + cfg.num_heads * D * H + 3 * H * I + 2 * H
    layer += qkv if cfg.attention_bias else 0
    layer += 2 * D if cfg.qk_norm else 0
    heads = 1 if cfg.tie_word_embeddings else 2
    return heads * cfg.vocab_size * H + cfg.num_layers * layer + H


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, config: ModelConfig) -> torch.dtype:
    """``auto``: the checkpoint's dtype on a GPU, bf16 on the CPU (fp16 matmuls are
    slow there and fp32 doubles the bytes every step reads)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.bfloat16
        ckpt = DTYPES.get(config.checkpoint_dtype.replace("torch.", ""), torch.bfloat16)
        return torch.bfloat16 if ckpt == torch.float32 else ckpt
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return DTYPES[dtype]


# =========================================================================== layers

# The pointwise work between the matmuls, written as plain functions so that
# set_elementwise_ops() can give the layers other copies of them: inductor-
# compiled ones, or kernels.py's C ones. RMSNorm is split in two: mean_square
# (a reduction, always eager where the ops are compiled) and rms_scale (pointwise).

def mean_square(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm's fp32 mean of squares, always eager (compiled_elementwise_ops says why)."""
    return x.float().pow(2).mean(-1, keepdim=True)


def rms_scale(x: torch.Tensor, ms: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers does: normalise in fp32, scale in the model dtype.
    return weight * (x.float() * torch.rsqrt(ms + eps)).to(x.dtype)


def qk_scale_rope(q, k, q_ms, k_ms, positions, cos_cache, sin_cache, q_weight, k_weight, eps: float):
    """Qwen3's per-head RMSNorm of q and k (when the weights are given, with their
    mean_square q_ms, k_ms), then the neox-style rotary embedding (rotate halves)
    at each token's position."""
    if q_weight is not None:
        q, k = rms_scale(q, q_ms, q_weight, eps), rms_scale(k, k_ms, k_weight, eps)
    cos = cos_cache[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D]
    sin = sin_cache[positions].to(q.dtype).unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class ElementwiseOps:
    """The three elementwise functions every decoder layer calls:
    rms_norm(x, weight, eps), qk_norm_rope(q, k, positions, cos_cache, sin_cache,
    q_weight, k_weight, eps) -> (q, k), silu_and_mul(gate_up)."""
    rms_norm: Any
    qk_norm_rope: Any
    silu_and_mul: Any


def with_mean_squares(rms_scale_fn, qk_scale_rope_fn, silu_and_mul_fn) -> ElementwiseOps:
    """The layers' ops from bodies that take the mean squares, computed here eagerly."""
    def rms_norm(x, weight, eps):
        return rms_scale_fn(x, mean_square(x), weight, eps)

    def qk_norm_rope(q, k, positions, cos_cache, sin_cache, q_weight, k_weight, eps):
        q_ms, k_ms = (mean_square(q), mean_square(k)) if q_weight is not None else (None, None)
        return qk_scale_rope_fn(q, k, q_ms, k_ms, positions, cos_cache, sin_cache, q_weight, k_weight, eps)
    return ElementwiseOps(rms_norm, qk_norm_rope, silu_and_mul_fn)


EAGER_OPS = with_mean_squares(rms_scale, qk_scale_rope, silu_and_mul)
# bf16 on a CPU with AVX-512: one C pass per op, bit for bit eager's (kernels.py
# says how; W1's 64-token decode step, one layer: ~0.7 -> ~0.2 ms)
C_OPS = ElementwiseOps(kernels.rms_norm, kernels.qk_norm_rope, kernels.silu_and_mul)


@functools.cache
def compiled_elementwise_ops() -> ElementwiseOps:
    """Inductor's fused copies of the three. Eager torch runs each pointwise op
    as its own pass over memory (RMSNorm's upcast, rsqrt, two muls and downcast
    are five), which at prefill sizes costs more than the arithmetic. Measured on
    W1 (2-core EPYC, bf16, 2026-12-04): 57.5 s -> 52.4 s, all of it in the three
    prefill steps. emulate_precision_casts rounds each bf16 intermediate where
    eager torch does, so the outputs stay eager's bit for bit (without it a
    quarter of the elements differed in the last bit). mean_square stays
    eager, outside: inductor sums the squares in another order than ATen, and
    compiled whole RMSNorm changed ~5 outputs per million by one bf16 step and
    W1's greedy tokens with them (50.7 s, but not the same outputs)."""
    return with_mean_squares(_compile_rows(rms_scale, 2), _compile_rows(qk_scale_rope, 5),
                             _compile_rows(silu_and_mul, 1))


# Below this many tokens a compiled call's fixed cost (guards, ~25 us) is more
# than the passes it saves (W1's shapes: SiLU-and-mul 0.005 ms eager vs 0.029
# compiled at 1 row, 0.047 vs 0.071 at 64; RMSNorm even at 256), so decode
# steps of small batches stay eager.
COMPILED_ELEMENTWISE_MIN_ROWS = 256


def _compile_rows(fn, row_args: int):
    """torch.compile(fn) with dim 0 (the tokens) of its first ``row_args``
    arguments unbacked: one graph per model shape serves every step size, while
    the other sizes stay constants for inductor to vectorise. Steps of fewer than
    COMPILED_ELEMENTWISE_MIN_ROWS tokens, and any call once dynamo's recompile
    limit is reached (a process that ran many models; with a warning), run
    ``fn`` eagerly."""
    compiled = torch.compile(fn, dynamic=False, fullgraph=True,
                             options={"emulate_precision_casts": True})

    def run(*args):
        import torch._dynamo
        from torch._dynamo.decorators import mark_unbacked
        if args[0].shape[0] < COMPILED_ELEMENTWISE_MIN_ROWS:
            return fn(*args)
        for t in args[:row_args]:
            if t is not None:  # q_ms, k_ms of a model without q/k norms
                mark_unbacked(t, 0)
        try:
            return compiled(*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            warnings.warn(f"torch.compile's recompile limit is reached: {fn.__name__} runs eager "
                          "for this model", RuntimeWarning, stacklevel=2)
            return fn(*args)
    return run


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.ops = EAGER_OPS  # set_elementwise_ops may swap in others

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class Linear(nn.Module):
    """nn.Linear without the random init (the checkpoint overwrites it anyway,
    and initialising 0.6B parameters costs seconds on a CPU)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # oneDNN's blocked copy of weight (pack_linear_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return _packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def can_pack_linear_weights(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_linear_weights(model: "CausalLM", batch_hint: int = 64) -> int:
    """bf16 on the CPU: hand every linear weight to oneDNN in its blocked layout
    once, instead of F.linear re-packing it on every call (the weight copy then
    replaces the dense one, so memory stays flat). The results are bit-identical
    to F.linear's in bf16 (F.linear's fp32 path is MKL's, whose results differ
    in the last bit, so fp32 stays unpacked). Measured on W1's 113 matmuls of a
    step (28 layers + lm_head, 2-core EPYC, A B A B): 0.64x the time for 1 row,
    0.71x for 16, 0.88x for 64, the same for prefill-sized batches. A tied head
    gets its own packed copy of the embedding (which stays dense for the lookup).
    Returns the number of weights packed."""
    reorder = torch.ops.mkldnn._reorder_linear_weight
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    for m in linears:
        m.packed = reorder(m.weight.detach(), batch_hint)
        m.weight.data = m.weight.data.new_empty(0)  # free the dense copy
    if model.lm_head is None:
        model.head_packed = reorder(model.model.embed_tokens.weight.detach(), batch_hint)
    return len(linears) + (model.lm_head is None)


def set_elementwise_ops(model: "CausalLM", ops: ElementwiseOps) -> None:
    """Give every layer these elementwise ops: C_OPS, compiled_elementwise_ops()
    (they compile on first use, which ModelRunner.warmup makes happen before
    any request) or EAGER_OPS."""
    for m in model.modules():
        if isinstance(m, (RMSNorm, Attention, MLP)):
            m.ops = ops


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return (inv_freq / factor).float()
    # llama3: long wavelengths are slowed by `factor`, short ones kept, smooth in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(mid, blended, scaled).float()


class RotaryEmbedding(nn.Module):
    """The rotary embedding's cos/sin tables, cached for all positions (applied
    by qk_norm_rope)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)


@dataclass(slots=True)
class AttentionMetadata:
    """What every attention layer of one step needs (vLLM's names)."""
    slot_mapping: torch.Tensor     # int64 [num_tokens]
    block_tables: torch.Tensor     # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor         # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    backend: str | None = None     # kernels' backend: None picks by device (see ModelRunner)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5
        self.eps = cfg.rms_norm_eps
        self.ops = EAGER_OPS  # set_elementwise_ops may swap in others

    def forward(self, x, positions, rope: RotaryEmbedding, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q_w, k_w = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
        q, k = self.ops.qk_norm_rope(q, k, positions, rope.cos, rope.sin, q_w, k_w, self.eps)
        k_cache, v_cache = kv_cache
        kernels.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, meta.backend)
        o = kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, self.scale, meta.backend)
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.ops = EAGER_OPS  # set_elementwise_ops may swap in others

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, rope, meta, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """The body shared by every supported architecture (HF's ``model.`` prefix)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(
            cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.head_packed: torch.Tensor | None = None  # a tied head's packed copy (pack_linear_weights)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                    cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, positions, self.rope, meta, kv_cache)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype (the sampler takes fp32 copies where it needs them)."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if self.head_packed is not None:
            return _packed_linear(hidden, self.head_packed, None)
        return F.linear(hidden, self.model.embed_tokens.weight)


# =========================================================================== loading

# checkpoint name fragment -> (fused parameter fragment, shard index)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _shard_sizes(cfg: ModelConfig, fused: str) -> list[int]:
    if fused == "qkv_proj":
        return [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
    return [cfg.intermediate_size] * 2


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"sharded checkpoint is missing files: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{str(path)!r} has no *.safetensors weights (nanoserve loads safetensors only)")
    return files


@torch.no_grad()
def load_weights(model: CausalLM, path: Path) -> int:
    """Copy every checkpoint tensor into its (possibly fused) parameter; returns
    the weight bytes. Every parameter must be filled exactly once."""
    from safetensors import safe_open

    cfg = model.config
    params = dict(model.named_parameters())
    pending = _expected_shards(params, cfg)
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                target, shard = _target_param(name, cfg)
                if target is None:
                    continue
                if target not in params:
                    raise ModelLoadError(f"unexpected tensor {name!r} in {file.name}")
                _copy_shard(params[target], f.get_tensor(name), shard, cfg, target, name)
                pending.discard((target, max(shard, 0)))
    if pending:
        missing = sorted({n for n, _ in pending})
        raise ModelLoadError(f"checkpoint is missing weights for {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))
    return sum(p.numel() * p.element_size() for p in params.values())


def _expected_shards(params: dict[str, torch.Tensor], cfg: ModelConfig) -> set[tuple[str, int]]:
    want = set()
    for name in params:
        fused = name.split(".")[-2]
        n = len(_shard_sizes(cfg, fused)) if fused in ("qkv_proj", "gate_up_proj") else 1
        want |= {(name, s) for s in range(n)}
    return want


def _target_param(name: str, cfg: ModelConfig) -> tuple[str | None, int]:
    if "rotary_emb" in name:
        return None, -1
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None, -1  # tied: the embedding is the head
    for part, (fused, shard) in _FUSED.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    return name, -1


def _copy_shard(param: torch.Tensor, tensor: torch.Tensor, shard: int, cfg: ModelConfig,
                target: str, name: str) -> None:
    if shard < 0:
        dest = param
    else:
        sizes = _shard_sizes(cfg, target.split(".")[-2])
        dest = param.narrow(0, sum(sizes[:shard]), sizes[shard])
    if dest.shape != tensor.shape:
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(dest.shape)} from config.json")
    dest.copy_(tensor)


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Uninitialised parameters created directly in ``dtype`` on ``device`` (no
    fp32 copy of a large model first); the cos/sin tables stay fp32."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.rope.float()
    return model


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device) -> tuple[CausalLM, int]:
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    model = build_model(cfg, dtype, device)
    weight_bytes = load_weights(model, path)
    model.eval()
    logger.info("[model] %s: %d layers, hidden %d, %d/%d heads, head_dim %d, %s on %s, %.1f MiB weights",
                cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                cfg.head_dim, str(dtype).replace("torch.", ""), device, weight_bytes / 2**20)
    return model, weight_bytes


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many kinds; name the directory
        raise ModelLoadError(f"cannot load the tokenizer from {str(path)!r}: {e}") from None


# =========================================================================== sampling

class SamplingOptions(Protocol):
    """The fields of engine.SamplingParams the sampler reads (model.py does not
    import the engine layer)."""
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: dict[int, float] | None
    logprobs: int | None


@dataclass(slots=True)
class SampleRequest:
    """One row to sample: its parameters and the token history penalties need."""
    params: SamplingOptions
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: list[int] = field(default_factory=list)  # min_tokens not reached yet


@dataclass(slots=True)
class SampleResult:
    token_id: int
    logprob: float | None = None                     # of the sampled token (raw logits)
    top_logprobs: list[tuple[int, float]] | None = None


class Sampler:
    """Batched sampling, in vLLM's order: logit bias and min_tokens -> penalties ->
    greedy or temperature -> min_p -> top-k/top-p -> sample. Per-request
    parameters become tensors; nothing loops over requests on the hot path
    except building those tensors. Logprobs come from the raw logits."""

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)
        self.argmax_backend: str | None = None  # kernels.argmax's; the runner's warmup sets it

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, rows: list[SampleRequest]) -> list[SampleResult]:
        """logits [rows, vocab] in the model's dtype; every step but a greedy one
        without bias or penalties works on an fp32 copy."""
        raw = logits
        ps = [r.params for r in rows]
        greedy = [p.temperature == 0.0 for p in ps]
        if all(greedy) and not _has_bias_or_bans(rows) and not _has_penalties(ps):
            # the common case, and a pass over memory less: argmax of the model's own logits
            tokens = kernels.argmax(logits, self.argmax_backend)
        else:
            logits = self._apply_penalties(self._apply_bias_and_bans(logits.float(), rows), rows)
            tokens = logits.argmax(dim=-1) if all(greedy) else self._sample(logits, rows, greedy)
        return self._results(raw, tokens, ps)

    def _apply_bias_and_bans(self, logits, rows):
        if not _has_bias_or_bans(rows):
            return logits
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.params.logit_bias:
                ids = torch.tensor(list(r.params.logit_bias.keys()))
                logits[i, ids] += torch.tensor(list(r.params.logit_bias.values()), dtype=logits.dtype)
            if r.banned_token_ids:
                logits[i, r.banned_token_ids] = float("-inf")
        return logits

    def _apply_penalties(self, logits, rows):
        ps = [r.params for r in rows]
        if not _has_penalties(ps):
            return logits
        R, V = logits.shape
        counts = torch.zeros(R, V, dtype=logits.dtype)
        seen = torch.zeros(R, V, dtype=torch.bool)
        for i, r in enumerate(rows):
            if r.output_token_ids:
                out = torch.tensor(r.output_token_ids)
                counts[i].index_add_(0, out, torch.ones(len(out), dtype=logits.dtype))
            if r.prompt_token_ids and ps[i].repetition_penalty != 1:
                seen[i, torch.tensor(r.prompt_token_ids)] = True
        seen |= counts > 0
        rep = torch.tensor([p.repetition_penalty for p in ps], dtype=logits.dtype)[:, None]
        # repetition (CTRL): divide positive logits, multiply negative ones, for seen tokens
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        freq = torch.tensor([p.frequency_penalty for p in ps], dtype=logits.dtype)[:, None]
        pres = torch.tensor([p.presence_penalty for p in ps], dtype=logits.dtype)[:, None]
        # OpenAI's formula: mu - c * alpha_frequency - (c > 0) * alpha_presence
        return logits - counts * freq - (counts > 0).to(logits.dtype) * pres

    def _sample(self, logits, rows, greedy):
        ps = [r.params for r in rows]
        argmax = logits.argmax(dim=-1)
        temp = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, ps)])[:, None]
        logits = logits / temp
        if any(p.min_p > 0 for p in ps):
            probs = logits.softmax(dim=-1)
            min_p = torch.tensor([p.min_p for p in ps])[:, None]
            threshold = probs.amax(dim=-1, keepdim=True) * min_p
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        logits = apply_top_k_top_p(logits, [p.top_k for p in ps], [p.top_p for p in ps])
        probs = logits.softmax(dim=-1)
        q = self._exponentials(rows, probs.shape)
        # The exponential race: argmax(p / q), q ~ Exp(1), draws from p exactly
        # and lets a seeded row own its randomness whatever shares its batch.
        sampled = (probs / q).argmax(dim=-1)
        return torch.where(torch.tensor(greedy), argmax, sampled)

    def _exponentials(self, rows, shape):
        q = torch.empty(shape)
        q.exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                # Seed by (seed, output index): the same draw however the request
                # was batched, chunked or preempted and recomputed.
                g = torch.Generator().manual_seed(hash((r.params.seed, len(r.output_token_ids)))
                                                  & 0x7FFF_FFFF_FFFF_FFFF)
                q[i].exponential_(generator=g)
        return q

    def _results(self, raw, tokens, ps):
        tokens_list = tokens.tolist()
        want = [p.logprobs for p in ps]
        if all(w is None for w in want):
            return [SampleResult(t) for t in tokens_list]
        logprobs = raw.float().log_softmax(dim=-1)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        k = max(w or 0 for w in want)
        top_v, top_i = logprobs.topk(k, dim=-1) if k else (None, None)
        results = []
        for i, (t, w) in enumerate(zip(tokens_list, want)):
            if w is None:
                results.append(SampleResult(t))
                continue
            top = list(zip(top_i[i, :w].tolist(), top_v[i, :w].tolist())) if w else []
            results.append(SampleResult(t, chosen[i], top))
        return results


def _has_bias_or_bans(rows: list[SampleRequest]) -> bool:
    return any(r.params.logit_bias or r.banned_token_ids for r in rows)


def _has_penalties(ps: list) -> bool:
    return any(p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1
               for p in ps)


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask all but each row's top-k logits, then all but its top-p nucleus
    (smallest set whose probability reaches top_p; at least one token kept)."""
    V = logits.shape[-1]
    use_k = any(0 < k < V for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if not (use_k or use_p):
        return logits
    sorted_logits, idx = logits.sort(dim=-1, descending=False)
    if use_k:
        k = torch.tensor([k if 0 < k < V else V for k in top_k])
        kth = sorted_logits.gather(1, (V - k)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if use_p:
        p = torch.tensor(top_p, dtype=sorted_logits.dtype)[:, None]
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - p
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, sorted_logits)


# =========================================================================== the runner

@dataclass(slots=True)
class SeqInput:
    """One request's share of a step, as the engine hands it over (plain data)."""
    token_ids: list[int]          # the tokens to compute this step
    start: int                    # position of token_ids[0]
    block_table: list[int]
    sample: SampleRequest | None  # None: a prefill chunk that samples nothing


def _check_same_as_eager(ops: ElementwiseOps, model: CausalLM) -> None:
    """Raise unless ``ops`` compute EAGER_OPS' results bit for bit on random
    inputs of this model's shapes (q and k as views of one projection, as the
    layers pass them)."""
    cfg, gen = model.config, torch.Generator().manual_seed(0)
    T, hq, hk, d = 37, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rand = lambda *shape: (torch.randn(*shape, generator=gen) * 3).bfloat16()  # noqa: E731
    x, w, gate_up = rand(T, cfg.hidden_size), rand(cfg.hidden_size), rand(T, 2 * cfg.intermediate_size)
    qkv, qw, kw = rand(T, (hq + 2 * hk) * d), rand(d), rand(d)
    q, k = qkv[:, :hq * d].view(T, hq, d), qkv[:, hq * d:(hq + hk) * d].view(T, hk, d)
    positions = torch.randint(0, model.rope.cos.shape[0], (T,), generator=gen)
    rope = (positions, model.rope.cos, model.rope.sin)
    pairs = [(ops.rms_norm(x, w, 1e-6), EAGER_OPS.rms_norm(x, w, 1e-6)),
             (ops.silu_and_mul(gate_up), EAGER_OPS.silu_and_mul(gate_up))]
    for weights in ((qw, kw), (None, None)):
        pairs += zip(ops.qk_norm_rope(q, k, *rope, *weights, 1e-6), EAGER_OPS.qk_norm_rope(q, k, *rope, *weights, 1e-6))
    if not all(torch.equal(a, b) for a, b in pairs):
        raise RuntimeError("their results differ from eager torch's on this machine")


def dummy_prompt(cfg: ModelConfig, num_tokens: int, block_size: int, device: torch.device,
                 backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A throwaway prompt of ``num_tokens`` tokens for warm-up and profiling: its KV
    slots are all -1 (stored nowhere) and its block table all block 0 (read only)."""
    T = num_tokens
    meta = AttentionMetadata(torch.full((T,), -1, dtype=torch.int64, device=device),
                             torch.zeros(1, -(-T // block_size), dtype=torch.int32, device=device),
                             torch.tensor([T], dtype=torch.int32, device=device),
                             torch.tensor([0, T], dtype=torch.int32, device=device), backend)
    positions = torch.arange(T, device=device) % cfg.max_position_embeddings
    return torch.zeros(T, dtype=torch.long, device=device), positions, meta


@torch.inference_mode()
def profile_activation_bytes(model: CausalLM, num_tokens: int, num_sample_rows: int,
                             block_size: int) -> int:
    """vLLM's profile run, on a CUDA device: the memory that one step at full budget
    (a forward of ``num_tokens`` tokens, then ``num_sample_rows`` rows of logits)
    takes at its peak beyond what is already allocated, so that the KV cache is
    sized from what is left rather than from all free memory. The attention reads
    a one-block throwaway cache."""
    device = model.model.embed_tokens.weight.device
    cfg, dtype = model.config, model.model.embed_tokens.weight.dtype
    cache = torch.zeros(1, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    hidden = model(*dummy_prompt(cfg, num_tokens, block_size, device), [(cache, cache)] * cfg.num_layers)
    model.compute_logits(hidden[:num_sample_rows])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del hidden, cache
    torch.cuda.empty_cache()  # else the freed activations would count as used a second time
    return peak


def tune_cpu_allocator() -> bool:
    """Keep freed activation memory in the process instead of returning it to the OS.

    Every forward step allocates and frees hundreds of MB of activations and KV
    gathers. glibc serves blocks above 32 MB with fresh mmap()s and trims the heap
    top on free, so each step page-faults all of them in again. Measured on W1's
    64 prompts (outputs capped at 32 tokens, 2-core EPYC, bf16): 78.98 s as is,
    58.82 s with mmap off, one arena and no trimming (MALLOC_MMAP_MAX_=0
    MALLOC_ARENA_MAX=1 MALLOC_TRIM_THRESHOLD_=huge), 56.45 s adding torch's
    THP_MEM_ALLOC_ENABLE=1 (set in nanoserve/__init__.py), at +0.5 GB peak RSS.
    This is process-wide, like those environment variables; it returns False
    (and changes nothing) where libc is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's <malloc.h>
    ok = libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_ARENA_MAX, 1)
    return bool(ok and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


class ModelRunner:
    """Owns the model and its KV tensors; runs one step at a time."""

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device, seed: int = 0, enforce_eager: bool = False):
        if device.type == "cpu" and tune_cpu_allocator():
            logger.debug("[model] glibc malloc: no mmap, one arena, no trimming")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(seed)
        # On the CPU, decode attention runs as one kernel call per step instead of
        # gather + SDPA: in bf16 the C kernels ("avx512": decodes 2.5-2.9x faster
        # than the compiled twin on W1's and W0's decode batches, prefill chunks
        # 4-5x faster than SDPA), else one torch.compile'd kernel ("inductor", 2.4x
        # faster than SDPA on W1's decode batch: 9.6 vs 23 ms per layer, 2-core
        # EPYC; benchmarks/RESULTS.md). warmup() settles which one builds here.
        # On CUDA the Triton kernel is the path.
        dtype = model.model.embed_tokens.weight.dtype
        self.attn_backend = None
        self._decode_kernels: list[str] = []
        if device.type == "cpu" and not enforce_eager:
            self._decode_kernels = (["avx512"] if dtype == torch.bfloat16 else []) + ["inductor"]
            self.attn_backend = self._decode_kernels[0]
        if can_pack_linear_weights(dtype, device):
            logger.debug("[model] %d linear weights packed for oneDNN", pack_linear_weights(model))
        # bf16 on the CPU: the norms, rope and SiLU as one C pass each where they
        # build and match eager bit for bit (C_OPS), else as inductor-fused loops
        # (compiled_elementwise_ops: W1 57.5 -> 52.4 s), rather than one eager
        # pass per op. fp32, the tests' oracle dtype, stays eager (there
        # inductor's exp, in SiLU, differs from ATen's in the last bit).
        self._elementwise_kernels: list[str] = []
        if device.type == "cpu" and dtype == torch.bfloat16 and not enforce_eager:
            self._elementwise_kernels = ["avx512", "inductor"]
        self.elementwise_backend: str | None = None  # warmup() settles it; None = eager

    def warmup(self) -> float:
        """Build what the first step would build (the C kernels, or inductor's
        graphs), before any request waits on it; returns the seconds it took (0.0
        when there is nothing to build). Where one cannot be built here (no C
        compiler, no AVX-512 BF16) the runner takes the next one, down to eager
        torch, and says why, instead of failing its first request."""
        t0 = time.perf_counter()
        self._warmup_attention()
        self._warmup_argmax()
        self._warmup_elementwise()
        return time.perf_counter() - t0 if (self._decode_kernels or self._elementwise_kernels) else 0.0

    def _warmup_attention(self) -> None:
        k_cache, v_cache = self.kv_caches[0]
        cfg = self.model.config
        query = torch.zeros(1, cfg.num_heads, cfg.head_dim, dtype=k_cache.dtype, device=self.device)
        one = torch.ones(1, dtype=torch.int32, device=self.device)
        for backend in self._decode_kernels:
            try:
                with torch.inference_mode():  # reads block 0 of layer 0, writes nothing
                    kv = torch.zeros(1, cfg.num_kv_heads, cfg.head_dim, dtype=k_cache.dtype, device=self.device)
                    kernels.store_kvcache(kv, kv, k_cache, v_cache, -one.long(), backend)  # slot -1: skipped
                    kernels.paged_attention(query, k_cache, v_cache, torch.zeros(1, 1, dtype=torch.int32),
                                            one, torch.tensor([0, 1], dtype=torch.int32), 1.0, backend)
                self.attn_backend = backend
                return
            except Exception as e:  # noqa: BLE001 - any build failure means: try the next one
                log = logger.info if backend == "avx512" else logger.warning
                log("[model] decode attention backend %r is not available here (--enforce-eager skips "
                    "the attempt): %s", backend, str(e).splitlines()[0][:300])
        self.attn_backend = None

    def _warmup_argmax(self) -> None:
        """Greedy sampling takes the C argmax where the C attention kernels were
        meant to run (bf16 on the CPU) and it builds; else torch's."""
        if "avx512" not in self._decode_kernels:
            return
        try:
            kernels.argmax(torch.zeros(1, 16, dtype=torch.bfloat16), "avx512")
            self.sampler.argmax_backend = "avx512"
        except Exception as e:  # noqa: BLE001 - any build failure means: torch's argmax
            logger.info("[model] the C argmax is not available here: %s", str(e).splitlines()[0][:300])

    def _warmup_elementwise(self) -> None:
        """The first of _elementwise_kernels that works here: the C ops if they
        build and give eager's results bit for bit on this model's shapes (they
        copy ATen's summation order, which a future torch might change), else
        inductor's, compiled now by one forward of a prompt just long enough to
        take them (its KV slots -1, written nowhere; its block table all block 0,
        read only); else the layers keep eager ops, and the runner says why."""
        for backend in self._elementwise_kernels:
            try:
                with torch.inference_mode():
                    if backend == "avx512":
                        _check_same_as_eager(C_OPS, self.model)
                        set_elementwise_ops(self.model, C_OPS)
                    else:
                        set_elementwise_ops(self.model, compiled_elementwise_ops())
                        self.model(*dummy_prompt(self.model.config, COMPILED_ELEMENTWISE_MIN_ROWS,
                                                 self.block_size, self.device, self.attn_backend), self.kv_caches)
                self.elementwise_backend = backend
                return
            except Exception as e:  # noqa: BLE001 - any build failure means: try the next one
                set_elementwise_ops(self.model, EAGER_OPS)
                log = logger.info if backend == "avx512" else logger.warning
                log("[model] elementwise ops %r are not available here (--enforce-eager skips the attempt): %s",
                    backend, str(e).splitlines()[0][:300])

    def prepare(self, seqs: list[SeqInput]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten a step into input_ids, positions and attention metadata, with
        tensor ops rather than a Python loop per token."""
        dev = self.device
        q_lens = torch.tensor([len(s.token_ids) for s in seqs])
        starts = torch.tensor([s.start for s in seqs])
        query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        T = int(query_start_loc[-1])
        seq_ids = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
        positions = torch.arange(T) - query_start_loc[:-1].long()[seq_ids] + starts[seq_ids]
        width = max(len(s.block_table) for s in seqs)
        block_tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                                    dtype=torch.int32)
        slots = compute_slot_mapping(block_tables, seq_ids, positions, self.block_size)
        input_ids = torch.tensor(list(itertools.chain.from_iterable(s.token_ids for s in seqs)))
        meta = AttentionMetadata(slots.to(dev), block_tables.to(dev),
                                 (starts + q_lens).to(torch.int32).to(dev), query_start_loc.to(dev),
                                 self.attn_backend)
        return input_ids.to(dev), positions.to(dev), meta

    @torch.inference_mode()
    def execute(self, seqs: list[SeqInput]) -> list[SampleResult]:
        """Run one step; returns one result per sequence that samples, in order."""
        input_ids, positions, meta = self.prepare(seqs)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        rows = [i for i, s in enumerate(seqs) if s.sample is not None]
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("[model] step: %d sequences, %d tokens, %d sampled", len(seqs),
                         input_ids.shape[0], len(rows))
        if not rows:
            return []
        last = meta.query_start_loc[1:].long() - 1
        logits = self.model.compute_logits(hidden[last[rows]]).cpu()
        return self.sampler(logits, [seqs[i].sample for i in rows])

    @torch.inference_mode()
    def logits(self, seqs: list[SeqInput]) -> torch.Tensor:
        """Logits of every token of the step (tests compare them with transformers')."""
        input_ids, positions, meta = self.prepare(seqs)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        return self.model.compute_logits(hidden).float().cpu()
