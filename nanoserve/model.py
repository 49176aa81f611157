"""Model execution layer: weights, the forward pass, and sampling.

This module owns
* ``ModelConfig``: a Hugging Face ``config.json`` read into the few numbers a
  decoder needs (both transformers 4's ``rope_theta``/``rope_scaling`` keys and
  transformers 5's ``rope_parameters``);
* the Llama / Qwen2 / Qwen3 / Mistral / Granite / Phi-3 decoder, written once: q/k/v and
  gate/up are fused at load time (Phi-3's checkpoints store them fused), Qwen2's q/k/v bias,
  Qwen3's q/k RMSNorm and Granite's four scalars are flags (so are SmolLM3's layers without rotary
  positions, and GLM-4's rotary pairs, reordered into halves; Mistral 3's text is Mistral's); OLMo 2/3's
  and GLM-4's layers (their norms after attention and the MLP) beside it; Gemma 3's text decoder beside it
  (its own layer: four norms of x * (1 + w), GELU, scaled embeddings, a second rotary
  embedding for the sliding-window layers), and Gemma 2's in it (no q/k norm, one rotary,
  soft caps on the attention scores and the logits); the mixture-of-experts MLP of Mixtral,
  Qwen2-MoE, Qwen3-MoE, OLMoE, GraniteMoe(Shared) and GLM-4.5 (a router, ``FusedMoE``'s stacked
  experts run by the backend's ``fused_moe``, a shared expert; GLM's grouped sigmoid routing) in the
  place of the dense one, in the layers that have it (OLMoE's q/k norms over all heads, Granite's
  scalars are flags too); DeepSeek-V2/V3's multi-head latent attention (``MLAAttention``: the latent is
  the KV cache, one tensor for K and V) in the place of the attention, with their routing; gpt-oss
  (``GptOssMoE``: experts with biases and a clamped SwiGLU, attention sinks, its MXFP4 experts
  dequantized at load);
* LoRA adapters (``wrap_lora_layers``: device slots beside the base linears, a row's adapter picked
  per token), custom logits processors, prompt logprobs, and the pooling runner's hidden states
  (embeddings: a chunk's last row or its rows' sum, no logits; sentence-transformers ``Dense``
  projectors after them);
* the pooling runner's encoders (``EncoderModel``): BERT, RoBERTa, XLM-RoBERTa, ModernBERT, ColBERT's
  projection and EmbeddingGemma (bidirectional Gemma 3), their attention bidirectional in plain torch
  over whole prompts, no KV cache;
* loading ``*.safetensors`` (one file or a sharded index) into it; under
  tensor parallelism each rank reads only its slices; an FP8 checkpoint's weights
  (quant_method "fp8", block or per-tensor scales) dequantized into the model's dtype as they are read;
  a GPTQ, AWQ or compressed-tensors int4/int8 weight-only one's kept packed on CUDA (``WNA16Weight``,
  ``WNA16Experts``: built on the meta device, never allocated dequantized), else dequantized so;
* tensor parallelism (Megatron's split, vLLM's layer names): ``TPGroup``, the
  column/row-parallel linears, the vocab-parallel embedding and head, and
  ``run_worker``, the loop ranks 1..N-1 run;
* ``select_backend``: the one place the kernels are chosen (a ``kernels.Backend``),
  handed to every layer when the model is built;
* ``ModelRunner``: turns one scheduled step (plain lists) into tensors, runs the
  forward over the flattened tokens of all requests (no padding to a
  rectangle), computes logits only for the rows that are sampled, and samples
  (speculative decoding: a row for each draft position, ``Sampler.sample_speculative``).

It knows nothing of queues or HTTP. The KV tensors it writes come from
``kvcache``; the attention and the other per-token ops come from ``kernels``
(on the CPU, maybe from ``cpu_backend``, which only ``select_backend`` and the
process settings ``tune_process`` / ``release_idle_memory`` call).
"""
from __future__ import annotations

import abc
import collections
import contextvars
import dataclasses
import datetime
import enum
import functools
import inspect
import itertools
import json
import logging
import math
import os
import pickle
import re
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanoserve import kernels, kvcache
from nanoserve.kernels import Backend
from nanoserve.kvcache import CacheConfig, KVCachePlan, KVCacheSpec
from nanoserve.kvcache import compute_slot_mapping

logger = logging.getLogger("nanoserve.model")
LOG_FORMAT, LOG_DATE_FORMAT = "%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"  # server's and ranks'

GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")  # the latter: its text only
# Mistral 3 (Mistral-Small-3.1/3.2, Devstral, Magistral in HF format): its text decoder only, a Mistral one
MISTRAL3 = "Mistral3ForConditionalGeneration"
# the multimodal checkpoints served as their text decoder (vLLM serves their text too); the vision tower is not loaded
TEXT_OF_MULTIMODAL = ("Gemma3ForConditionalGeneration", MISTRAL3)
# GLM-4-0414 (dense): Llama's layer with a norm after attention and one after the MLP, a rotary half in pairs
GLM4 = "Glm4ForCausalLM"
BIDIRECTIONAL_GEMMA3 = "Gemma3TextModel"  # EmbeddingGemma: served as an encoder model (use_bidirectional_attention)
GRANITE_MOE_ARCHITECTURES = ("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM")
GRANITE_ARCHITECTURES = ("GraniteForCausalLM", *GRANITE_MOE_ARCHITECTURES)  # Granite's four scalars
# DeepSeek-V2 and -V3 (and what shares V3's architecture: DeepSeek-R1, Kimi-K2): multi-head latent attention
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# OpenAI's gpt-oss (20b, 120b): attention sinks, biases on q/k/v/o, experts with biases and a clamped SwiGLU
GPT_OSS = "GptOssForCausalLM"
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
                     *GRANITE_MOE_ARCHITECTURES, "Glm4MoeForCausalLM", *MLA_ARCHITECTURES, GPT_OSS)
# OLMo 2 and 3: norms after attention and after the MLP (none before), q/k norms over all heads
OLMO2_ARCHITECTURES = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")
SMOLLM3 = "SmolLM3ForCausalLM"  # Llama with every no_rope_layer_interval-th layer's rotary left out (NoPE)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MistralForCausalLM", "GraniteForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
                           *GEMMA3_ARCHITECTURES, MISTRAL3, GLM4, *MOE_ARCHITECTURES,
                           SMOLLM3, *OLMO2_ARCHITECTURES)
# encoder models (the pooling runner's only): embeddings, and classifiers (cross-encoders with one label)
ENCODER_ARCHITECTURES = ("BertModel", "RobertaModel", "XLMRobertaModel", "BertForSequenceClassification",
                         "RobertaForSequenceClassification", "XLMRobertaForSequenceClassification",
                         "ModernBertModel", "ModernBertForSequenceClassification", "ModernBertForTokenClassification",
                         "HF_ColBERT")
# late-interaction encoders (vLLM's ColBERTModel): BERT, then a bias-free projection of every token's row
COLBERT_ARCHITECTURES = ("HF_ColBERT",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings")  # config.json's, checked at load
# the mixture-of-experts models' sizes, checked as SIZE_KEYS are (a key a family does not use is not read)
MOE_SIZE_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "decoder_sparse_step", "n_routed_experts", "n_group", "topk_group")
DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}


class ModelLoadError(ValueError):
    """A model directory nanoserve cannot serve; the message says why."""


def first_line(e: BaseException) -> str:
    """An error's first line, for a one-line log or start-up message."""
    return str(e).splitlines()[0][:300] if str(e).strip() else type(e).__name__


# =========================================================================== config

def resolve_model_dir(model: str | Path, revision: str | None = None, download_dir: str | None = None) -> Path:
    """A model directory, or a Hugging Face hub id (``Qwen/Qwen3-0.6B``) as vLLM takes
    one: found in the local Hugging Face cache (``download_dir``, vLLM's, else the
    default one), downloaded only when the hub is reachable and ``HF_HUB_OFFLINE`` is not set."""
    path, repo_id = Path(model), str(model)
    if path.is_dir() or repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")):
        return path
    from huggingface_hub import constants, snapshot_download
    try:  # the local cache first: no network for a model already there
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (huggingface_hub raises several kinds)
        if constants.HF_HUB_OFFLINE:
            raise ModelLoadError(f"model {repo_id!r} is not a directory and not in the local Hugging Face cache "
                                 f"({download_dir or constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE is set") from None
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                      allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except Exception as e:  # noqa: BLE001 - no network, no such repo, gated: say which
        raise ModelLoadError(f"model {repo_id!r} is not a directory, and downloading it from the Hugging "
                             f"Face hub failed: {first_line(e)}") from None


def _seq_cls_architecture(arch: Any) -> str | None:
    """The decoder a *ForSequenceClassification architecture wraps (vLLM's as_seq_cls_model: the
    same layers, plus the score head), or None for any other name."""
    suffix = "ForSequenceClassification"
    if not isinstance(arch, str) or not arch.endswith(suffix):
        return None
    decoder = f"{arch[:-len(suffix)]}ForCausalLM"
    if decoder in GEMMA3_ARCHITECTURES:  # transformers' is the multimodal model's, a layout not read here
        raise ModelLoadError(f"{arch} (Gemma 3's multimodal classifier) is not supported")
    if decoder not in SUPPORTED_ARCHITECTURES:
        served = ", ".join(a[:-len("ForCausalLM")] for a in SUPPORTED_ARCHITECTURES if a.endswith("ForCausalLM"))
        raise ModelLoadError(f"unsupported architecture {arch!r}; nanoserve serves the ForSequenceClassification "
                             f"of {served}")
    return decoder


# vLLM's SEQ_CLS_LOAD_METHODS: how a causal LM's head rows become a classifier's score head
SEQ_CLS_METHODS = ("from_2_way_softmax", "no_post_processing")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


CONFIG_VALUE_KINDS = {  # what _check_config_values' each keyword asks of a value, and how it is said
    "numbers": ("a positive number", _is_number),
    "integers": ("a non-negative integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    "strings": ("a string", lambda v: isinstance(v, str)),
    "lists": ("a list", lambda v: isinstance(v, list)),
    "dicts": ("an object", lambda v: isinstance(v, dict)),
    "booleans": ("true or false", lambda v: isinstance(v, bool)),
}


def _check_config_values(arch: str, c: dict[str, Any], where: str = "", **kinds: tuple[str, ...]) -> None:
    """config.json's values of the wrong kind refused in one line naming the key (else a Python error from
    deep in the parsing, or a model built on them); a key left out or null is not checked."""
    for kind, keys in kinds.items():
        what, ok = CONFIG_VALUE_KINDS[kind]
        bad = next((k for k in keys if c.get(k) is not None and not ok(c[k])), None)
        if bad is not None:
            raise ModelLoadError(f"{arch}: config.json's {where}{bad} {c[bad]!r} must be {what}")


def _encoder_config(arch: str, c: dict[str, Any]) -> "ModelConfig":
    """BERT's and RoBERTa's config.json (transformers' keys and defaults). RoBERTa's positions start
    past its padding_idx, so its longest prompt is that much shorter than max_position_embeddings."""
    roberta = arch.startswith(("Roberta", "XLMRoberta"))
    bad = {k: c.get(k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "max_position_embeddings", "type_vocab_size")
           if k in c and (isinstance(c[k], bool) or not isinstance(c[k], int) or c[k] < 1)}
    if bad:
        raise ModelLoadError(f"{', '.join(f'{k} {v!r}' for k, v in bad.items())}: sizes must be positive integers")
    _check_config_values(arch, c, numbers=("layer_norm_eps",), integers=("pad_token_id",),
                         strings=("hidden_act", "position_embedding_type"), lists=("matryoshka_dimensions",))
    if c.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError(f"{arch} with position_embedding_type {c['position_embedding_type']!r} is not "
                             f"supported (absolute position embeddings are)")
    act = c.get("hidden_act", "gelu")
    if act not in ENCODER_ACTIVATIONS:
        raise ModelLoadError(f"{arch}: hidden_act {act!r} is not supported ({', '.join(ENCODER_ACTIVATIONS)} are)")
    if c.get("quantization_config"):
        raise ModelLoadError(f"{arch}: quantized encoder checkpoints are not supported")
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    if hidden % heads:
        raise ModelLoadError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    offset = c.get("pad_token_id", 1) + 1 if roberta else 0
    max_positions = c.get("max_position_embeddings", 512) - offset
    if max_positions < 2:
        raise ModelLoadError(f"{arch}: max_position_embeddings {c.get('max_position_embeddings')} leaves no room "
                             f"for a prompt past the padding_idx offset {offset}")
    classifier = arch.endswith("ForSequenceClassification")
    return ModelConfig(
        architecture=arch, vocab_size=c["vocab_size"], hidden_size=hidden, intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"], num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
        rms_norm_eps=float(c.get("layer_norm_eps", 1e-12)), rope_theta=0.0, rope_scaling=None,
        max_position_embeddings=max_positions, tie_word_embeddings=False, attention_bias=True, qk_norm=False,
        sliding_window=None, sliding_layers=(), checkpoint_dtype=str(c.get("dtype") or c.get("torch_dtype")
                                                                        or "float32"),
        eos_token_ids=[], hidden_act=act, encoder_only="roberta" if roberta else "bert",
        type_vocab_size=c.get("type_vocab_size", 2), position_offset=offset, position_rows=max_positions + offset,
        is_matryoshka=bool(c.get("matryoshka_dimensions") or c.get("is_matryoshka")),
        matryoshka_dimensions=tuple(c["matryoshka_dimensions"]) if c.get("matryoshka_dimensions") else None,
        colbert_dim=_colbert_dim(arch, c) if arch in COLBERT_ARCHITECTURES else None,
        **(_classifier_config(c, arch) if classifier else {}))


@dataclass(frozen=True, slots=True)
class ModernBertOptions:
    """What ModernBERT's config.json says beyond a BERT's: its local layers attend within ``window`` tokens
    either side (local_attention // 2) with rotary positions of ``local_rope_theta`` (the global layers':
    ModelConfig.rope_theta); its norms and Linears may lack biases; its classifier pools by ``pooling``."""
    local_layers: tuple[int, ...]
    window: int
    local_rope_theta: float
    norm_bias: bool
    mlp_bias: bool
    pooling: str               # classifier_pooling, as vLLM's pooling type: "CLS" or "MEAN"
    classifier_bias: bool
    classifier_activation: str


def _modernbert_rope_theta(c: dict[str, Any], layer_type: str, old_key: str, default: float) -> float:
    """A layer type's rotary theta: transformers 5's rope_parameters, else transformers 4's global_/local_rope_theta."""
    params = (c.get("rope_parameters") or {}).get(layer_type) or {}
    _check_config_values("ModernBERT", {layer_type: params}, "rope_parameters.", dicts=(layer_type,))
    _check_config_values("ModernBERT", params, f"rope_parameters.{layer_type}.", numbers=("rope_theta",),
                         strings=("rope_type",))
    if params.get("rope_type", "default") != "default":
        raise ModelLoadError(f"ModernBERT with rope_type {params['rope_type']!r} for its {layer_type} layers is "
                             f"not supported (default rotary positions are)")
    return float(params.get("rope_theta", c.get(old_key, default)))


def _modernbert_config(arch: str, c: dict[str, Any]) -> "ModelConfig":
    """ModernBERT's config.json, as transformers 4 saved it (global_attn_every_n_layers, global_/local_rope_theta)
    or 5 does (layer_types, rope_parameters), with transformers' defaults."""
    sizes = {k: c.get(k, d) for k, d in (("vocab_size", 50368), ("hidden_size", 768), ("intermediate_size", 1152),
                                         ("num_hidden_layers", 22), ("num_attention_heads", 12),
                                         ("max_position_embeddings", 8192), ("local_attention", 128))}
    bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
    if bad:
        raise ModelLoadError(f"{', '.join(f'{k} {v!r}' for k, v in bad.items())}: sizes must be positive integers")
    _check_config_values(arch, c, numbers=("norm_eps", "global_rope_theta", "local_rope_theta"),
                         strings=("hidden_activation", "classifier_activation", "classifier_pooling"),
                         lists=("layer_types", "matryoshka_dimensions"), dicts=("rope_parameters",))
    heads, hidden, layers = sizes["num_attention_heads"], sizes["hidden_size"], sizes["num_hidden_layers"]
    if hidden % heads or hidden // heads % 2:
        raise ModelLoadError(f"hidden_size {hidden} must be a multiple of num_attention_heads {heads} with an even "
                             f"head size (rotary positions)")
    every = c.get("global_attn_every_n_layers", 3)
    if not c.get("layer_types") and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ModelLoadError(f"global_attn_every_n_layers must be a positive integer, got {every!r}")
    types = c.get("layer_types") or ["sliding_attention" if i % every else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
        raise ModelLoadError(f"layer_types must name full_attention or sliding_attention for each of the "
                             f"{layers} layers, got {types!r}")
    acts = {k: c.get(k, "gelu") for k in ("hidden_activation", "classifier_activation")}
    for key, act in acts.items():
        if act not in ENCODER_ACTIVATIONS:
            raise ModelLoadError(f"{arch}: {key} {act!r} is not supported ({', '.join(ENCODER_ACTIVATIONS)} are)")
    pooling = c.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise ModelLoadError(f"{arch}: classifier_pooling must be \"cls\" or \"mean\", got {pooling!r}")
    if c.get("quantization_config"):
        raise ModelLoadError(f"{arch}: quantized encoder checkpoints are not supported")
    options = ModernBertOptions(
        local_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        window=sizes["local_attention"] // 2,
        local_rope_theta=_modernbert_rope_theta(c, "sliding_attention", "local_rope_theta", 10_000.0),
        norm_bias=bool(c.get("norm_bias", False)), mlp_bias=bool(c.get("mlp_bias", False)), pooling=pooling.upper(),
        classifier_bias=bool(c.get("classifier_bias", False)), classifier_activation=acts["classifier_activation"])
    classifier = arch.endswith(("ForSequenceClassification", "ForTokenClassification"))
    return ModelConfig(
        architecture=arch, vocab_size=sizes["vocab_size"], hidden_size=hidden,
        intermediate_size=sizes["intermediate_size"], num_layers=layers, num_heads=heads, num_kv_heads=heads,
        head_dim=hidden // heads, rms_norm_eps=float(c.get("norm_eps", 1e-5)),
        rope_theta=_modernbert_rope_theta(c, "full_attention", "global_rope_theta", 160_000.0), rope_scaling=None,
        max_position_embeddings=sizes["max_position_embeddings"], tie_word_embeddings=False,
        attention_bias=bool(c.get("attention_bias", False)), qk_norm=False, sliding_window=None, sliding_layers=(),
        checkpoint_dtype=str(c.get("dtype") or c.get("torch_dtype") or "float32"), eos_token_ids=[],
        hidden_act=acts["hidden_activation"], encoder_only="modernbert", modernbert=options,
        is_matryoshka=bool(c.get("matryoshka_dimensions") or c.get("is_matryoshka")),
        matryoshka_dimensions=tuple(c["matryoshka_dimensions"]) if c.get("matryoshka_dimensions") else None,
        **(_classifier_config(c, arch) if classifier else {}))


def _colbert_dim(arch: str, c: dict[str, Any]) -> int | None:
    """ColBERT's projection size where config.json names it (vLLM's keys, in its order); None: none does."""
    key = next((k for k in ("colbert_dim", "dim", "projection_dim") if c.get(k)), None)
    if key is not None and (isinstance(c[key], bool) or not isinstance(c[key], int) or c[key] < 1):
        raise ModelLoadError(f"{arch}: {key} {c[key]!r} must be a positive integer (the projection's size)")
    return None if key is None else c[key]


# sentence-transformers' tokenizer settings, as vLLM looks for them
SENTENCE_CONFIG_FILES = ("sentence_bert_config.json", "sentence_roberta_config.json",
                         "sentence_xlm-roberta_config.json")


def _encoder_max_len(cfg: "ModelConfig", raw: dict[str, Any], path: Path) -> "ModelConfig":
    """An encoder's longest prompt as vLLM derives it: sentence-transformers' max_seq_length where its
    config has one (all-MiniLM-L6-v2: 256 of 512 positions), else, where config.json names
    position_embedding_type "absolute" (as transformers 4 saved every BERT), the tokenizer's model_max_length
    where that is shorter; always within the positions the model has."""
    limit = None
    for name in SENTENCE_CONFIG_FILES:
        if (path / name).is_file():
            limit = json.loads((path / name).read_text()).get("max_seq_length")
            break
    tokenizer_config = path / "tokenizer_config.json"
    if limit is None and raw.get("position_embedding_type") == "absolute" and tokenizer_config.is_file():
        limit = json.loads(tokenizer_config.read_text()).get("model_max_length")
    if isinstance(limit, int) and not isinstance(limit, bool) and 2 <= limit < cfg.max_position_embeddings:
        return dataclasses.replace(cfg, max_position_embeddings=limit)
    return cfg


def _score_from_token(c: dict[str, Any], decoder: str) -> dict[str, Any]:
    """vLLM's as_seq_cls_model on a causal LM checkpoint: a score head built at load from the LM head's
    rows of ``classifier_from_token`` by ``method``: "from_2_way_softmax" (two tokens [false, true]: one
    label, row true - row false, so its sigmoid is the softmax of the two logits' "true"), or
    "no_post_processing" (a label per token, its row). Qwen3's is_original_qwen3_reranker means the
    former. A reranker so built joins query and document as one text unless use_sep_token says not."""
    tokens, method = c.get("classifier_from_token"), c.get("method")
    if c.get("is_original_qwen3_reranker") and decoder == "Qwen3ForCausalLM":
        if not isinstance(tokens, list) or len(tokens) != 2:  # vLLM's assertion, as one line
            raise ModelLoadError(f"is_original_qwen3_reranker needs classifier_from_token of two tokens (the "
                                 f"original Qwen3-Reranker's [\"no\", \"yes\"]), got {tokens!r}")
        method = "from_2_way_softmax"
    if tokens is None and method is None:
        return {}
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t for t in tokens):
        raise ModelLoadError(f"classifier_from_token must be a non-empty list of token strings (with method "
                             f"{method!r}), got {tokens!r}")
    if method not in SEQ_CLS_METHODS:
        raise ModelLoadError(f"method must be one of {', '.join(SEQ_CLS_METHODS)} (vLLM's ways to build a score "
                             f"head from classifier_from_token's LM-head rows), got {method!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ModelLoadError(f"method from_2_way_softmax takes two classifier_from_token tokens ([false, true]), "
                             f"got {len(tokens)}: {tokens!r}")
    return {"classifier_from_token": tuple(tokens), "seq_cls_method": method,
            "num_labels": 1 if method == "from_2_way_softmax" else len(tokens)}


def _classifier_config(c: dict[str, Any], decoder: str) -> dict[str, Any]:
    """A classifier's head size and labels as transformers reads them: id2label's entries (num_labels,
    where given alone; two, LABEL_0 and LABEL_1, by default), and what picks its activation; or, for a
    score head built from LM-head rows (_score_from_token), as many labels as that makes."""
    from_token = _score_from_token(c, decoder)
    id2label = None if from_token else c.get("id2label")
    if id2label is not None and not isinstance(id2label, dict):
        raise ModelLoadError(f"config.json's id2label must be an object, got {id2label!r}")
    num_labels = from_token.get("num_labels", c.get("num_labels", len(id2label) if id2label else 2))
    if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
        raise ModelLoadError(f"num_labels must be a positive integer, got {num_labels!r}")
    labels = {int(k): str(v) for k, v in id2label.items()} if id2label and len(id2label) == num_labels \
        else {i: f"LABEL_{i}" for i in range(num_labels)}
    st = c.get("sentence_transformers") or {}
    activation = st.get("activation_fn") if isinstance(st, dict) else None
    # use_pad_token: vLLM's older name; an LM turned reranker joins the texts by default (vLLM's)
    use_sep = c.get("use_pad_token", c.get("use_sep_token", not from_token))
    ids = c.get("classifier_token_ids")  # the engine's (model_overrides): the tokens' ids, and their rows' tensor
    return {**from_token, "num_labels": num_labels, "id2label": labels, "problem_type": c.get("problem_type"),
            "score_activation": activation or c.get("sbert_ce_default_activation_function"),
            "use_sep_token": bool(use_sep), "classifier_token_ids": tuple(ids) if ids else None,
            "lm_head_tied": bool(c.get("lm_head_tied", c.get("tie_word_embeddings", False)))}


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
    attention_bias: bool          # Qwen2, Qwen2-MoE: bias on q/k/v
    qk_norm: bool                 # Qwen3, Qwen3-MoE, Gemma 3: RMSNorm on q and k per head
    sliding_window: int | None    # the window of the layers that use one; None: no layer does
    sliding_layers: tuple[int, ...]  # the layers that attend to the last sliding_window positions only
    checkpoint_dtype: str
    eos_token_ids: list[int]
    rotary_dim: int = 0              # the leading dims of a head that RoPE turns (0, given: all of head_dim)
    attention_scale: float | None = None  # None: head_dim ** -0.5 (Granite's attention_multiplier,
    #                                       Gemma's query_pre_attn_scalar ** -0.5)
    # Granite: Llama with three more scalars (transformers' names; 1.0 leaves Llama's math)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0   # each branch's output, before its residual add
    logits_scaling: float = 1.0        # logits are divided by it
    # Gemma 3, and Gemma 2 (the defaults are every other architecture's)
    gemma: bool = False           # Gemma 2 and 3: GemmaDecoderLayer, norms x * (1 + w), embeddings x sqrt(hidden)
    # Gemma 2's soft caps, cap * tanh(x / cap) (None: none): on each attention score, on the logits
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    hidden_act: str = "silu"      # the gated MLP's activation: silu, or Gemma's gelu_pytorch_tanh
    # the sliding-window layers' rotary (theta, scaling) where it is not the others' (Gemma 3)
    sliding_rope: tuple[float, dict[str, Any] | None] | None = None
    qk_norm_whole: bool = False   # OLMoE: one RMSNorm over all of q's heads together, one over k's (not per head)
    nope_layers: tuple[int, ...] = ()  # SmolLM3's layers without rotary positions (NoPE)
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GraniteMoe(Shared), GLM-4.5; 0: a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0       # top-k: the experts each token runs
    moe_intermediate_size: int = 0     # each expert's (intermediate_size stays the dense layers')
    moe_layers: tuple[int, ...] = ()   # the layers whose MLP is the experts; the rest are dense
    norm_topk_prob: bool = False       # the top-k weights renormalised to sum to 1
    router_weights_fp32: bool = False  # Mixtral and GLM keep them fp32; the others round them to the model's dtype
    # GLM-4.5's routing (DeepSeek-V3's; vLLM's grouped_topk): "sigmoid" scores, an fp32 router with its
    # e_score_correction_bias added to the scores that choose (not to the weights), the top-k chosen from
    # the topk_group best of num_expert_group groups, the weights times routed_scaling_factor
    scoring_func: str = "softmax"
    num_expert_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_intermediate_size: int = 0  # a shared expert every token runs (Qwen2-MoE, GraniteMoeShared, GLM)
    shared_expert_gate: bool = False          # Qwen2-MoE's: the shared expert scaled by sigmoid(shared_expert_gate(x))
    fp32_router: bool = False  # GLM's and DeepSeek's: an fp32 router weight, routed by grouped_topk
    # DeepSeek's multi-head latent attention (0: none). head_dim and num_kv_heads are then the KV cache's
    # (kv_lora_rank + qk_rope_head_dim wide, one head), rotary_dim qk_rope_head_dim; the heads' own sizes:
    kv_lora_rank: int = 0
    q_lora_rank: int = 0          # 0: q_proj; else q_a_proj, q_a_layernorm, q_b_proj
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the rope dims stored as pairs (x0, x1), (x2, x3), ...: DeepSeek's, GLM-4's
    # an FP8 or int4/int8 weight-only checkpoint's (dequantized at load); None: unquantized
    quantization: Fp8Config | WNA16Config | None = None
    # gpt-oss: a learned logit a head in each attention softmax (no value), the experts' clamped SwiGLU
    # (GptOssExperts), and its hub checkpoints' MXFP4 experts (dequantized at load)
    attention_sinks: bool = False
    moe_activation: str = "silu"  # the experts' (kernels.MOE_ACTIVATIONS): gpt-oss's swigluoai, with biases
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mxfp4: bool = False
    # Embedding models (the pooling runner): a checkpoint of the decoder without its LM head, which
    # config.json names as such (Qwen3Model, MistralModel: vLLM pools those by default), and the
    # Matryoshka sizes its vectors may be cut to (None: any, where is_matryoshka says it may be cut)
    base_model: bool = False
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    # Classifiers (the pooling runner's classify task): a *ForSequenceClassification checkpoint, the
    # decoder with a bias-free ``score`` head of num_labels rows (None: not a classifier), its labels by
    # index, and what vLLM reads to pick the activation (classify_activation) and to pair a cross-encoder's
    # texts (use_sep_token: as the tokenizer's text pair, else joined as one text)
    num_labels: int | None = None
    id2label: dict[int, str] | None = None
    problem_type: str | None = None
    score_activation: str | None = None  # sentence-transformers' activation_fn (a torch.nn.modules name)
    use_sep_token: bool = True
    # a score head built from LM-head rows (vLLM's classifier_from_token and method), with the tokens' ids
    # and whether those rows are the embedding's (the checkpoint's own tie_word_embeddings: the pooling
    # runner loads every model as tied)
    classifier_from_token: tuple[str, ...] | None = None
    seq_cls_method: str | None = None
    classifier_token_ids: tuple[int, ...] | None = None
    lm_head_tied: bool = False
    # Encoder models (ENCODER_ARCHITECTURES): "bert", "roberta" or "modernbert" (None: a decoder). rms_norm_eps
    # is then their LayerNorm's eps, hidden_act their MLP's; max_position_embeddings the longest prompt.
    # "gemma3": a bidirectional Gemma3TextModel, Gemma 3's fields, its sliding_window the distance either side
    encoder_only: str | None = None
    modernbert: ModernBertOptions | None = None  # ModernBERT's own settings (its global layers' theta: rope_theta)
    type_vocab_size: int = 0
    position_offset: int = 0  # RoBERTa's: position p reads row padding_idx + 1 + p
    position_rows: int = 0    # the position table's rows (config.json's max_position_embeddings)
    # ColBERT's projection size (config.json's colbert_dim, dim or projection_dim, as vLLM reads them; None:
    # its linear.weight's rows, or not a ColBERT model)
    colbert_dim: int | None = None

    @property
    def late_interaction(self) -> bool:
        """A ColBERT model: token_embed is its only task, and it scores pairs by MaxSim (vLLM's)."""
        return self.architecture in COLBERT_ARCHITECTURES

    @property
    def token_classifier(self) -> bool:
        """A *ForTokenClassification checkpoint: labels for each token, none for a whole prompt."""
        return self.architecture.endswith("ForTokenClassification")

    @property
    def checkpoint_architecture(self) -> str:
        """The architecture config.json names (``architecture`` is the decoder that serves it): a
        classifier's XForSequenceClassification, a bare decoder's XModel."""
        stem = self.architecture.removesuffix("ForCausalLM")
        if stem == self.architecture:
            return self.architecture
        return f"{stem}ForSequenceClassification" if self.num_labels is not None else \
            f"{stem}Model" if self.base_model else self.architecture

    @classmethod
    def from_dir(cls, path: str | Path, hf_overrides: dict[str, Any] | None = None) -> "ModelConfig":
        """config.json, with ``hf_overrides``' keys laid over its own (vLLM's --hf-overrides)."""
        path = Path(path)
        if not path.is_dir():
            raise ModelLoadError(f"model directory {str(path)!r} does not exist (pass --model DIR, "
                                 f"a Hugging Face model directory with config.json)")
        cfg_file = path / "config.json"
        if not cfg_file.exists():
            raise ModelLoadError(f"{str(path)!r} has no config.json: not a Hugging Face model directory")
        try:
            raw = override_config(json.loads(cfg_file.read_text()), hf_overrides)
            cfg = cls.from_dict(raw)
            return _encoder_max_len(cfg, raw, path) if cfg.encoder_only else cfg
        except ModelLoadError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # a key missing or of the wrong type
            given = " with --hf-overrides" if hf_overrides else ""
            raise ModelLoadError(f"{cfg_file}{given} cannot be read as a model config: "
                                 f"{type(e).__name__}: {e}") from e

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> "ModelConfig":
        archs = c.get("architectures") or []
        arch = archs[0] if archs else None
        if arch in ENCODER_ARCHITECTURES:
            return _modernbert_config(arch, c) if arch.startswith("ModernBert") else _encoder_config(arch, c)
        if arch == BIDIRECTIONAL_GEMMA3:
            return _bidirectional_gemma3_config(cls, c)
        base_model = isinstance(arch, str) and arch.endswith("Model") and f"{arch[:-5]}ForCausalLM" in \
            SUPPORTED_ARCHITECTURES  # its decoder alone: the same layers, under the same config keys
        if base_model:
            arch = f"{arch[:-5]}ForCausalLM"
        seq_cls = _seq_cls_architecture(arch)
        if seq_cls:
            arch = seq_cls
        elif given := [k for k in ("classifier_from_token", "is_original_qwen3_reranker") if c.get(k)]:
            raise ModelLoadError(f"{given[0]} builds a classifier's score head, and {arch} is not served as one: "
                                 f"pass --convert classify, or name its ForSequenceClassification in architectures")
        if arch not in SUPPORTED_ARCHITECTURES:
            why = " (a mixture-of-experts model nanoserve does not serve)" if "Moe" in str(arch) else ""
            raise ModelLoadError(f"unsupported architecture {arch!r}{why}; nanoserve supports "
                                 f"{', '.join(SUPPORTED_ARCHITECTURES + ENCODER_ARCHITECTURES)}")
        if arch in GEMMA3_ARCHITECTURES:
            c = _gemma3_text_config(c)
        elif arch == "Gemma2ForCausalLM":
            c = _gemma2_config(c)
        elif arch == MISTRAL3:
            c = _mistral3_text_config(c)
        elif arch in (GLM4, "Glm4MoeForCausalLM"):
            c = _glm4_config(c)
        # a decoder's values of the wrong kind refused by their keys (else a Python error deep in the parsing,
        # or a model built on them: an rms_norm_eps "x" reached the first forward)
        _check_config_values(arch, c, numbers=("rms_norm_eps", "rope_theta", "partial_rotary_factor"),
                             integers=("sliding_window",), strings=("hidden_act",),
                             dicts=("rope_scaling", "rope_parameters"),
                             booleans=("tie_word_embeddings", "attention_bias", "use_sliding_window"))
        if arch in (SMOLLM3, *OLMO2_ARCHITECTURES) and c.get("attention_bias"):
            raise ModelLoadError(f"{arch} with attention_bias is not supported (transformers puts one on o_proj too, "
                                 "which nanoserve's has not; its released checkpoints leave it off)")
        mxfp4 = _mxfp4(arch, c.get("quantization_config"))
        quantization = None if mxfp4 else quantization_config(c.get("quantization_config"))
        sizes = SIZE_KEYS + (MOE_SIZE_KEYS if arch in MOE_ARCHITECTURES else ())
        bad = {k: c[k] for k in sizes if c.get(k) is not None
               and (isinstance(c[k], bool) or not isinstance(c[k], int) or c[k] < 1)}
        if bad:  # else torch's error when the model is built, or a zero-sized model
            raise ModelLoadError(f"{', '.join(f'{k} {v!r}' for k, v in bad.items())}: sizes must be positive integers")
        if c.get("mlp_bias"):  # Llama's and Granite's option, off in their released checkpoints
            raise ModelLoadError("mlp_bias (biases on gate/up/down) is not supported")
        num_heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // num_heads
        gemma3 = arch in GEMMA3_ARCHITECTURES
        gemma = gemma3 or arch == "Gemma2ForCausalLM"  # Gemma 2 and 3 share the layer, norms, embeddings and MLP
        # Gemma turns whole heads in its rotaries: transformers and vLLM ignore partial_rotary_factor there
        rotary_dim = head_dim if gemma else _rotary_dim(c, head_dim)
        theta, scaling = _rope_from_config(c, arch, rotary_dim)
        eos = c.get("eos_token_id")
        window, layers = _sliding_window(arch, c)
        granite = arch in GRANITE_ARCHITECTURES  # transformers' Granite defaults are 1.0, its scale too
        cfg = cls(
            architecture=arch,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=c.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=(c["max_position_embeddings"] if gemma else  # vLLM's exception: already scaled
                                     _scaled_max_positions(c.get("max_position_embeddings", 2048), scaling)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=(arch == "Qwen2ForCausalLM" or bool(c.get("attention_bias", arch in (GPT_OSS, GLM4)))
                            or (arch == "Qwen2MoeForCausalLM" and bool(c.get("qkv_bias", True)))),
            qk_norm=(arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") or gemma3
                     or (arch == "Glm4MoeForCausalLM" and bool(c.get("use_qk_norm", False)))),
            sliding_window=window,
            sliding_layers=layers,
            checkpoint_dtype=str(c.get("dtype") or c.get("torch_dtype") or "float32"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            rotary_dim=rotary_dim,
            rope_interleave=arch == GLM4,  # transformers' and vLLM's (is_neox_style=False) GLM-4 rotary
            embedding_multiplier=float(c.get("embedding_multiplier", 1.0)) if granite else 1.0,
            residual_multiplier=float(c.get("residual_multiplier", 1.0)) if granite else 1.0,
            logits_scaling=float(c.get("logits_scaling", 1.0)) if granite else 1.0,
            gemma=gemma,
            attn_logit_softcapping=_float_or_none(c.get("attn_logit_softcapping")) if gemma else None,
            final_logit_softcapping=_float_or_none(c.get("final_logit_softcapping")) if gemma else None,
            hidden_act=c["hidden_activation"] if gemma else "silu",
            attention_scale=(float(c.get("attention_multiplier", 1.0)) if granite else
                             float(c["query_pre_attn_scalar"]) ** -0.5 if gemma else None),
            sliding_rope=(_sliding_rope(c) if gemma3 else _olmo3_sliding_rope(c) if arch == "Olmo3ForCausalLM"
                          else None),
            qk_norm_whole=arch in ("OlmoeForCausalLM", *OLMO2_ARCHITECTURES),
            nope_layers=_nope_layers(c) if arch == SMOLLM3 else (),
            quantization=quantization,
            **(_moe_config(arch, c) if arch in MOE_ARCHITECTURES else {}),
            **(_gpt_oss_config(c, mxfp4) if arch == GPT_OSS else {}),
            base_model=base_model,
            is_matryoshka=bool(c.get("matryoshka_dimensions") or c.get("is_matryoshka")),
            matryoshka_dimensions=tuple(c["matryoshka_dimensions"]) if c.get("matryoshka_dimensions") else None,
            **(_classifier_config(c, arch) if seq_cls else {}),
        )
        return _mla_config(cfg, c) if arch in MLA_ARCHITECTURES else cfg

    def __post_init__(self) -> None:
        self.rotary_dim = self.rotary_dim or self.head_dim

    def check_max_model_len(self, max_model_len: int, window_disabled: bool) -> None:
        if window_disabled and self.sliding_window is not None and self.sliding_window < max_model_len:
            raise ModelLoadError(  # as vLLM's: full attention is the sliding window's only within the window
                f"--disable-sliding-window keeps max_model_len within this checkpoint's sliding window "
                f"({self.sliding_window}), got --max-model-len {max_model_len}; leave the flag out to serve longer "
                f"prompts with sliding-window attention")

    def with_max_model_len(self, max_model_len: int | None) -> "ModelConfig":
        """LongRoPE's factors chosen as vLLM chooses them: the long ones for every position
        when the engine may serve past the pre-training length (the requested max_model_len,
        else max_position_embeddings), else the short ones. transformers switches per forward,
        by the longest position in it; choosing once keeps the KV cache's keys consistent
        when a sequence crosses that length. (Where start-up lowers a max_model_len left
        unset to what the KV cache holds, the choice stays the long one.)"""
        if self.rope_scaling is None or self.rope_scaling["rope_type"] != "longrope":
            return self
        long = (max_model_len or self.max_position_embeddings) > self.rope_scaling["original_max_position_embeddings"]
        return dataclasses.replace(self, rope_scaling={**self.rope_scaling, "use_long_factor": long})

    def layer_window(self, layer: int) -> int | None:
        """The sliding window layer ``layer`` attends within, or None (full attention).
        (--disable-sliding-window keeps max_model_len within the window: it never acts.)"""
        return self.sliding_window if layer in self.sliding_layers else None


@dataclass(frozen=True, slots=True)
class Fp8Config:
    """quantization_config of an FP8 checkpoint (quant_method "fp8": vLLM's Fp8Config, transformers'
    FineGrainedFP8Config), as DeepSeek-V3/R1, Kimi-K2 and Qwen3-*-FP8 ship it. Each quantized linear
    weight is stored float8_e4m3fn beside its scale: with ``weight_block_size`` [bm, bn] (block FP8),
    ``<name>.weight_scale_inv`` holds one scale per bm x bn block ([ceil(out / bm), ceil(in / bn)],
    the last blocks partial); without, ``<name>.weight_scale`` one per tensor, and a static
    activation scheme adds ``input_scale``. The weight is fp8 (as fp32) times its block's scale.
    nanoserve dequantizes each weight as it is read and serves the model in its dtype
    (Fp8Slice); which weights are quantized is read from the tensors' dtypes, so
    ``modules_to_not_convert`` / ``ignored_layers`` (stored unquantized) need no list here."""
    weight_block_size: tuple[int, int] | None  # None: per-tensor scales
    activation_scheme: str                     # "dynamic", or "static" (input_scale: not applied here)

    @property
    def scale_suffix(self) -> str:
        """A weight's scale is named the weight's name and this (``q_proj.weight`` -> ``q_proj.weight_scale_inv``)."""
        return "_scale_inv" if self.weight_block_size else "_scale"

    def describe(self) -> str:
        block = self.weight_block_size
        return (f"block FP8 ({block[0]}x{block[1]} blocks)" if block else "per-tensor FP8") + \
            f", {self.activation_scheme} activation scheme"


def fp8_config(quant: Any) -> Fp8Config | None:
    """config.json's quantization_config: None (unquantized), an FP8 one, or a refusal that names the
    method (else a GPTQ/AWQ/... checkpoint's packed tensors would fail as "unexpected tensors")."""
    if not quant:
        return None
    quant = quant if isinstance(quant, dict) else {"quant_method": quant}
    method = quant.get("quant_method")
    if method != "fp8":
        raise ModelLoadError(f"the checkpoint is quantized with quant_method {method!r}, which nanoserve does not "
                             "serve: it serves unquantized checkpoints (bf16, fp16 or fp32 safetensors), FP8 "
                             "ones (quant_method 'fp8', block or per-tensor), int4/int8 weight-only ones "
                             "(quant_method 'gptq', 'awq' or 'compressed-tensors'), and gpt-oss's MXFP4 experts")
    fmt, scheme = quant.get("fmt") or "e4m3", str(quant.get("activation_scheme") or "dynamic").lower()
    block, scale_fmt = quant.get("weight_block_size"), quant.get("scale_fmt") or "float"
    if fmt != "e4m3":
        raise ModelLoadError(f"FP8 checkpoint with fmt {fmt!r} is not supported (nanoserve reads e4m3 weights)")
    if scheme not in ("dynamic", "static"):
        raise ModelLoadError(f"FP8 checkpoint with activation_scheme {scheme!r} is not supported (dynamic or static)")
    if block is not None and (not isinstance(block, (list, tuple)) or len(block) != 2 or any(
            isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block)):
        raise ModelLoadError(f"FP8 checkpoint's weight_block_size {block!r} must be two positive integers")
    if (quant.get("expert_dtype") or "fp8") != "fp8":
        raise ModelLoadError(f"FP8 checkpoint with expert_dtype {quant['expert_dtype']!r} is not supported "
                             "(nanoserve reads fp8 experts)")
    if scale_fmt not in ("float", "ue8m0"):
        raise ModelLoadError(f"FP8 checkpoint with scale_fmt {scale_fmt!r} is not supported (float or ue8m0)")
    kv = sorted(k for k, v in quant.items() if "kv_cache" in k and v)
    if kv:  # for vLLM's --kv-cache-dtype fp8; with its default (auto) vLLM leaves them unused, as here
        logger.info("[model] FP8 checkpoint with %s: not applied, the KV cache holds the model's dtype (as vLLM's "
                    "with --kv-cache-dtype auto)", ", ".join(kv))
    return Fp8Config(weight_block_size=tuple(block) if block is not None else None, activation_scheme=scheme)


def _mxfp4(arch: str, quant: Any) -> bool:
    """Whether the checkpoint is gpt-oss's MXFP4 one (the hub's openai/gpt-oss-*: the experts' weights as fp4
    blocks and e8m0 scales); MXFP4 is served for gpt-oss only."""
    method = (quant.get("quant_method") if isinstance(quant, dict) else quant) if quant else None
    if method == "mxfp4" and arch != GPT_OSS:
        raise ModelLoadError(f"the checkpoint is quantized with quant_method 'mxfp4', which nanoserve serves for "
                             f"{GPT_OSS} (its experts) only, not {arch}")
    return method == "mxfp4"


# quant_method -> what config.json says of it (the methods served dequantized besides FP8 and MXFP4)
_WNA16_METHODS = ("gptq", "awq", "compressed-tensors")
# compressed-tensors' weight-only formats: int codes packed 32 / bits to an int32 (weight_packed), or one int8
# a code (the weight itself, int8)
_CT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized")


@dataclass(frozen=True, slots=True)
class WNA16Config:
    """quantization_config of a weight-only integer checkpoint (vLLM's "WNA16": int4 or int8 weights,
    activations in the model's dtype): GPTQ (quant_method "gptq"), AWQ ("awq", its GEMM layout) or
    llm-compressor's compressed-tensors w4a16/w8a16 ("compressed-tensors"). Each weight is stored as
    unsigned codes q, one scale s and zero point z a group of ``group_size`` input columns (-1: a row's
    whole input), and is (q - z) * s; the symmetric schemes' z is 2 ** (bits - 1). nanoserve dequantizes
    each weight as it is read (PackedIntSlice), as it does FP8's; which weights are quantized is read
    from the tensors' names (``qweight``, ``weight_packed``), so the modules left unquantized load as
    they are."""
    method: str             # "gptq", "awq" or "compressed-tensors"
    bits: int               # 4 or 8
    group_size: int         # -1: one group a row (compressed-tensors' "channel" strategy)
    symmetric: bool
    checkpoint_format: str  # gptq: "gptq" (v1: zeros stored minus one) or "gptq_v2"; awq: "gemm";
                            # compressed-tensors: one of _CT_FORMATS
    desc_act: bool = False  # GPTQ's act-order: each input column's group read from g_idx

    @property
    def packed_suffix(self) -> str:
        """A quantized weight's codes are named its module's name and this."""
        return {"gptq": ".qweight", "awq": ".qweight"}.get(
            self.method, ".weight_packed" if self.checkpoint_format == "pack-quantized" else ".weight")

    @property
    def companion_suffixes(self) -> tuple[str, ...]:
        """The tensors read with a quantized weight (its scales, zero points ...), named as it is."""
        if self.method in ("gptq", "awq"):
            return ".scales", ".qzeros", ".g_idx"
        return ".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx"

    def describe(self) -> str:
        name = {"gptq": "GPTQ", "awq": "AWQ", "compressed-tensors": "compressed-tensors"}[self.method]
        groups = "one group a row" if self.group_size == -1 else f"groups of {self.group_size}"
        detail = {"gptq": f", {self.checkpoint_format} format" + (", desc_act" if self.desc_act else ""),
                  "awq": ", GEMM layout", "compressed-tensors": f", {self.checkpoint_format}"}[self.method]
        return f"{name} int{self.bits}, {groups}, {'symmetric' if self.symmetric else 'asymmetric'}{detail}"


def quantization_config(quant: Any) -> Fp8Config | WNA16Config | None:
    """config.json's quantization_config: None (unquantized), an FP8 or weight-only integer one, or a
    refusal that names the method or the variant nanoserve does not serve."""
    method = (quant.get("quant_method") if isinstance(quant, dict) else quant) if quant else None
    if method not in _WNA16_METHODS:
        return fp8_config(quant)
    if not isinstance(quant, dict):
        raise ModelLoadError(f"quantization_config {quant!r} must be an object with its quant_method's keys")
    return {"gptq": _gptq_config, "awq": _awq_config, "compressed-tensors": _compressed_tensors_config}[method](quant)


def _int_key(quant: dict, method: str, *keys: str, default: Any = None) -> int:
    """The first of ``keys`` quantization_config has, which must be an integer (else ``default``)."""
    value = next((quant[k] for k in keys if k in quant), default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{method} checkpoint's quantization_config needs an integer {keys[0]}, "
                             f"got {value!r}")
    return value


def _check_bits_and_group(method: str, bits: int, group_size: int, served_bits: tuple[int, ...]) -> None:
    if bits not in served_bits:
        raise ModelLoadError(f"{method} checkpoint with {bits}-bit weights is not supported (nanoserve reads "
                             f"{' or '.join(map(str, served_bits))}-bit ones)")
    if group_size != -1 and group_size < 1:
        raise ModelLoadError(f"{method} checkpoint's group_size {group_size} must be positive or -1 (one group a row)")


def _gptq_config(quant: dict) -> WNA16Config:
    """AutoGPTQ's and GPTQModel's: qweight packed along the input dim, v1 or v2 zero points."""
    bits, group = _int_key(quant, "GPTQ", "bits"), _int_key(quant, "GPTQ", "group_size", default=-1)
    _check_bits_and_group("GPTQ", bits, group, (4, 8))
    fmt = quant.get("format") or quant.get("checkpoint_format") or "gptq"
    if fmt not in ("gptq", "gptq_v2") or quant.get("is_marlin_format"):
        raise ModelLoadError(f"GPTQ checkpoint in format {'marlin' if quant.get('is_marlin_format') else fmt!r} "
                             "is not supported (nanoserve reads the 'gptq' and 'gptq_v2' formats)")
    if (quant.get("pack_dtype") or "int32") != "int32":
        raise ModelLoadError(f"GPTQ checkpoint with pack_dtype {quant['pack_dtype']!r} is not supported (int32)")
    overrides = {k: v for k, v in (quant.get("dynamic") or {}).items() if not str(k).startswith("-:") and v}
    if overrides:  # "-:" modules are stored unquantized, and load as they are
        raise ModelLoadError(f"GPTQ checkpoint with per-module overrides (dynamic: {', '.join(overrides)}) is not "
                             "supported: nanoserve reads one bits and group_size for every quantized module")
    return WNA16Config("gptq", bits, group, bool(quant.get("sym", True)), fmt, bool(quant.get("desc_act")))


def _awq_config(quant: dict) -> WNA16Config:
    """AutoAWQ's GEMM layout (the hub's -AWQ checkpoints): qweight packed along the output dim."""
    bits, group = _int_key(quant, "AWQ", "bits", "w_bit"), _int_key(quant, "AWQ", "group_size", "q_group_size")
    _check_bits_and_group("AWQ", bits, group, (4,))
    version = str(quant.get("version") or "gemm").lower()
    if version != "gemm":
        raise ModelLoadError(f"AWQ checkpoint of version {version!r} is not supported (nanoserve reads AutoAWQ's "
                             "'gemm' layout; GEMV, Marlin and ExLlama ones are packed otherwise)")
    if not quant.get("zero_point", True):  # AutoAWQ's GEMM packer needs zero points; vLLM's kernels too
        raise ModelLoadError("AWQ checkpoint with zero_point false is not supported (nanoserve, as vLLM, reads "
                             "AWQ's GEMM layout with zero points)")
    return WNA16Config("awq", bits, group, False, "gemm")


def _compressed_tensors_config(quant: dict) -> WNA16Config:
    """llm-compressor's weight-only integer schemes (W4A16, W8A16: RedHatAI's and neuralmagic's
    quantized.w4a16 / w8a16), one scheme for every quantized module; anything else refused by name."""
    name = "compressed-tensors checkpoint"
    sparsity = quant.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense") or quant.get("format") in ("marlin-24", "sparse-24-bitmask"):
        raise ModelLoadError(f"{name} with {sparsity.get('format') or quant.get('format')!r} sparsity is not "
                             "supported (nanoserve reads dense weights)")
    if quant.get("transform_config"):
        raise ModelLoadError(f"{name} with transforms (transform_config: rotations applied to the weights) is "
                             "not supported")
    groups = list((quant.get("config_groups") or {}).values())
    if not groups:
        raise ModelLoadError(f"{name} with no config_groups: nothing says how its weights are quantized")
    schemes = {_ct_scheme(name, g, quant.get("format")) for g in groups}
    if len(schemes) > 1:
        raise ModelLoadError(f"{name} with {len(schemes)} different schemes across its config_groups is not "
                             "supported: nanoserve reads one weight scheme for every quantized module")
    return schemes.pop()


def _ct_scheme(name: str, group: dict, default_format: str | None) -> WNA16Config:
    """One config_groups entry as a WNA16Config, or a refusal naming its scheme."""
    weights = group.get("weights") or {}
    inputs = group.get("input_activations")
    kind, bits = weights.get("type", "int"), weights.get("num_bits")
    if inputs:  # W8A8 int8, FP8 (dynamic or static input scales), W4A8, NVFP4 ...
        scheme = f"W{bits}A{inputs.get('num_bits')} {'FP8' if kind == 'float' else kind}"
        raise ModelLoadError(f"{name} with scheme {scheme} (activations quantized: input_activations "
                             f"{'dynamic' if inputs.get('dynamic') else 'static'}) is not supported: nanoserve "
                             "reads weight-only int4/int8 ones (W4A16, W8A16)")
    if kind != "int":
        raise ModelLoadError(f"{name} with {kind} weights (W{bits}A16 {kind}) is not supported: nanoserve reads "
                             "weight-only int4/int8 ones (W4A16, W8A16)")
    fmt = group.get("format") or default_format
    if fmt not in _CT_FORMATS:
        raise ModelLoadError(f"{name} in format {fmt!r} is not supported (nanoserve reads "
                             f"{', '.join(_CT_FORMATS)})")
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel") or weights.get("dynamic"):
        raise ModelLoadError(f"{name} with weight strategy {strategy!r}{' (dynamic)' if weights.get('dynamic') else ''}"
                             " is not supported (nanoserve reads the 'group' and 'channel' strategies, as vLLM)")
    group_size = _int_key(weights, "compressed-tensors", "group_size") if strategy == "group" else -1
    _check_bits_and_group("compressed-tensors", _int_key(weights, "compressed-tensors", "num_bits"), group_size,
                          (4, 8) if fmt == "pack-quantized" else (8,))
    return WNA16Config("compressed-tensors", bits, group_size, bool(weights.get("symmetric", True)), fmt)


def _gpt_oss_config(c: dict[str, Any], mxfp4: bool) -> dict[str, Any]:
    """gpt-oss's own fields, as transformers' GptOssConfig reads them."""
    if not c.get("attention_bias", True):
        raise ModelLoadError(f"{GPT_OSS} with attention_bias false is not supported (its checkpoints have them)")
    return dict(attention_sinks=True, moe_activation="swigluoai", swiglu_alpha=float(c.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(c.get("swiglu_limit", 7.0)), mxfp4=mxfp4)


# num_experts and num_experts_per_tok where config.json leaves them out: each family's transformers config defaults
MOE_DEFAULTS = {"MixtralForCausalLM": (8, 2), "Qwen2MoeForCausalLM": (60, 4), "Qwen3MoeForCausalLM": (128, 8),
                "OlmoeForCausalLM": (64, 8), "GraniteMoeForCausalLM": (8, 2), "GraniteMoeSharedForCausalLM": (8, 2),
                "Glm4MoeForCausalLM": (128, 8), "DeepseekV2ForCausalLM": (64, 6), "DeepseekV3ForCausalLM": (256, 8),
                GPT_OSS: (128, 4)}
# first_k_dense_replace where config.json leaves it out (transformers' defaults)
FIRST_DENSE_DEFAULTS = {"Glm4MoeForCausalLM": 1, "DeepseekV2ForCausalLM": 0, "DeepseekV3ForCausalLM": 3}
# the families whose every layer is sparse, each expert intermediate_size wide (Qwen's have moe_intermediate_size)
EXPERTS_OF_INTERMEDIATE_SIZE = ("MixtralForCausalLM", "OlmoeForCausalLM", *GRANITE_MOE_ARCHITECTURES, GPT_OSS)


def _moe_config(arch: str, c: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields, read as transformers builds the model: Mixtral's,
    OLMoE's and Granite's every layer sparse, their experts intermediate_size wide; Qwen's sparse
    layers every decoder_sparse_step-th but mlp_only_layers (dense, intermediate_size wide). The
    top-k weights renormalised by Mixtral and Granite always (Granite's softmax over the top-k
    logits is that), by Qwen, OLMoE and GLM as norm_topk_prob says; kept fp32 by Mixtral and GLM,
    rounded to the model's dtype by the others. The shared expert: Qwen2-MoE's, gated; GraniteMoeShared's
    (shared_intermediate_size, 0: none) and GLM's (n_shared_experts of moe_intermediate_size), not.
    GLM's layers are sparse from first_k_dense_replace on, routed by _glm4_moe_routing."""
    n = c["num_hidden_layers"]
    default_experts, default_top_k = MOE_DEFAULTS[arch]
    if arch in EXPERTS_OF_INTERMEDIATE_SIZE:
        experts = c.get("num_local_experts", c.get("num_experts", default_experts))
        inter, layers = c["intermediate_size"], tuple(range(n))
    elif arch in FIRST_DENSE_DEFAULTS:  # GLM-4.5, DeepSeek
        experts, inter = c.get("n_routed_experts", default_experts), c["moe_intermediate_size"]
        layers = _first_dense_then_sparse(arch, c, n)
    else:
        experts, inter = c.get("num_experts", c.get("num_local_experts", default_experts)), c["moe_intermediate_size"]
        step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or ())
        layers = tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)
        if c.get("use_sliding_window"):
            raise ModelLoadError(f"{arch} with use_sliding_window is not supported (its released checkpoints "
                                 "leave it off)")
    top_k = c.get("num_experts_per_tok", default_top_k)
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
        raise ModelLoadError(f"num_experts {experts!r}: sizes must be positive integers")
    if top_k > experts:
        raise ModelLoadError(f"num_experts_per_tok {top_k} is more than num_experts {experts}")
    if c.get("hidden_act", "silu") != "silu":  # fused_moe's experts are SiLU-gated
        raise ModelLoadError(f"{arch} with hidden_act {c['hidden_act']!r} is not supported (its experts run SiLU)")
    _check_olmoe_and_granite_moe(arch, c)
    shared = {"Qwen2MoeForCausalLM": c.get("shared_expert_intermediate_size"),
              "GraniteMoeSharedForCausalLM": c.get("shared_intermediate_size", 0),
              "Glm4MoeForCausalLM": _glm4_moe_shared_size(c, inter),
              "DeepseekV2ForCausalLM": _glm4_moe_shared_size(c, inter, default=2),
              "DeepseekV3ForCausalLM": _glm4_moe_shared_size(c, inter)}.get(arch) or 0
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
        raise ModelLoadError(f"shared_intermediate_size {shared!r}: sizes must be non-negative integers")
    glm = arch == "Glm4MoeForCausalLM"
    grouped = arch in ("Glm4MoeForCausalLM", *MLA_ARCHITECTURES)
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter, moe_layers=layers,
                norm_topk_prob=(arch in ("MixtralForCausalLM", *GRANITE_MOE_ARCHITECTURES)  # GLM's, V3's default True
                                or bool(c.get("norm_topk_prob", glm or arch == "DeepseekV3ForCausalLM"))),
                router_weights_fp32=arch in ("MixtralForCausalLM", "Glm4MoeForCausalLM", *MLA_ARCHITECTURES),
                shared_expert_intermediate_size=shared, shared_expert_gate=arch == "Qwen2MoeForCausalLM",
                fp32_router=grouped,
                **(_glm4_moe_routing(c, experts, top_k) if glm else
                   _deepseek_routing(arch, c, experts, top_k) if grouped else {}))


def _first_dense_then_sparse(arch: str, c: dict[str, Any], n: int) -> tuple[int, ...]:
    """GLM's and DeepSeek's sparse layers: from first_k_dense_replace on, every moe_layer_freq-th (vLLM's
    DeepSeek rule; transformers reads no moe_layer_freq, and the released configs set it to 1)."""
    first, freq = c.get("first_k_dense_replace", FIRST_DENSE_DEFAULTS[arch]), c.get("moe_layer_freq", 1)
    for key, value, least in (("first_k_dense_replace", first, 0), ("moe_layer_freq", freq, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ModelLoadError(f"{key} {value!r}: must be an integer >= {least}")
    return tuple(i for i in range(first, n) if i % freq == 0)


def _glm4_moe_shared_size(c: dict[str, Any], inter: int, default: int = 1) -> int:
    n = c.get("n_shared_experts", default)
    n = 0 if n is None else n  # DeepSeek's: none (vLLM's reading of null)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ModelLoadError(f"n_shared_experts {n!r}: must be a non-negative integer")
    return n * inter


def _glm4_moe_routing(c: dict[str, Any], experts: int, top_k: int) -> dict[str, Any]:
    """GLM-4.5's grouped sigmoid routing, checked as transformers would need it to run: the experts
    split into n_group equal groups of at least 2 (a group scores by its best two), topk_group of
    them picked, holding at least top_k experts."""
    groups, topk_group = c.get("n_group") or 1, c.get("topk_group") or 1
    _check_groups(experts, top_k, groups, topk_group, least=2)
    return dict(scoring_func="sigmoid", num_expert_group=groups, topk_group=topk_group,
                routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)))


def _check_groups(experts: int, top_k: int, groups: int, topk_group: int, least: int) -> None:
    if experts % groups or experts // groups < least:
        raise ModelLoadError(f"n_routed_experts {experts} cannot be split into n_group {groups} groups of "
                             f"{least} or more")
    if topk_group > groups or topk_group * (experts // groups) < top_k:
        raise ModelLoadError(f"topk_group {topk_group} of n_group {groups} groups hold fewer than "
                             f"num_experts_per_tok {top_k} experts")


# (topk_method, scoring_func) each DeepSeek architecture's transformers router implements
DEEPSEEK_ROUTING = {"DeepseekV2ForCausalLM": (("greedy", "softmax"), ("group_limited_greedy", "softmax")),
                    "DeepseekV3ForCausalLM": (("noaux_tc", "sigmoid"),)}


def _deepseek_routing(arch: str, c: dict[str, Any], experts: int, top_k: int) -> dict[str, Any]:
    """DeepSeek's routing as transformers' routers do it. V2: softmax scores; the top-k of all experts
    (topk_method greedy) or of the topk_group groups holding the best single experts (group_limited_greedy);
    no correction bias. V3 (noaux_tc): GLM-4.5's grouped sigmoid routing with its bias. transformers' V2
    router never renormalises; vLLM's does where norm_topk_prob says, as here (the released V2 configs
    leave it false)."""
    v3 = arch == "DeepseekV3ForCausalLM"
    method = c.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    scoring = c.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    if (method, scoring) not in DEEPSEEK_ROUTING[arch]:
        raise ModelLoadError(f"{arch} with topk_method {method!r} and scoring_func {scoring!r} is not supported "
                             f"(its routing: {' or '.join(f'{m} with {s}' for m, s in DEEPSEEK_ROUTING[arch])})")
    if v3:
        return _glm4_moe_routing(c, experts, top_k)
    groups, topk_group = (c.get("n_group") or 1, c.get("topk_group") or 1) if method != "greedy" else (1, 1)
    _check_groups(experts, top_k, groups, topk_group, least=1)
    return dict(scoring_func="softmax", num_expert_group=groups, topk_group=topk_group,
                routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)))


def _mla_config(cfg: "ModelConfig", c: dict[str, Any]) -> "ModelConfig":
    """DeepSeek's attention sizes, read as transformers' DeepseekV2/V3Attention builds it. The KV cache
    holds one latent a token: kv_lora_rank + qk_rope_head_dim wide, one head (the config's head_dim and
    num_kv_heads here); the softmax scale is the full query head's, times YaRN's mscale_all_dim squared
    (transformers' yarn_apply_mscale, vLLM's)."""
    keys = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    sizes = {k: c.get(k) for k in keys} | {"q_lora_rank": c.get("q_lora_rank") or 0}
    bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int)
           or v < (0 if k == "q_lora_rank" else 1)}
    if bad:
        raise ModelLoadError(f"{', '.join(f'{k} {v!r}' for k, v in bad.items())}: sizes must be positive integers")
    if sizes["qk_rope_head_dim"] % 2:
        raise ModelLoadError(f"qk_rope_head_dim {sizes['qk_rope_head_dim']} must be even (rope turns pairs)")
    if c.get("attention_bias"):
        raise ModelLoadError(f"{cfg.architecture} with attention_bias is not supported (its released checkpoints "
                             "leave it off)")
    scale = (sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"]) ** -0.5
    rope = cfg.rope_scaling or {}
    if rope.get("mscale_all_dim"):
        scale *= yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
    v3 = cfg.architecture == "DeepseekV3ForCausalLM"
    return dataclasses.replace(
        cfg, head_dim=sizes["kv_lora_rank"] + sizes["qk_rope_head_dim"], num_kv_heads=1,
        rotary_dim=sizes["qk_rope_head_dim"], attention_scale=scale,
        rope_interleave=bool(c.get("rope_interleave", True)) if v3 else True, **sizes)  # V2's: always pairs


def _glm4_config(c: dict[str, Any]) -> dict[str, Any]:
    """GLM-4's and GLM-4.5's config.json with what transformers fills in where it is left out: a rotary
    half of each head (partial_rotary_factor 0.5)."""
    if c.get("partial_rotary_factor") is None and _rope_params(c).get("partial_rotary_factor") is None:
        c = {**c, "partial_rotary_factor": 0.5}
    return c


def _check_olmoe_and_granite_moe(arch: str, c: dict[str, Any]) -> None:
    """What transformers' OLMoE and GraniteMoe can be configured to do that nanoserve does not
    (their released checkpoints do none of it)."""
    if arch not in ("OlmoeForCausalLM", *GRANITE_MOE_ARCHITECTURES):
        return
    if c.get("attention_bias"):  # transformers puts one on o_proj too, which nanoserve's has not
        raise ModelLoadError(f"{arch} with attention_bias is not supported (its released checkpoints leave it off)")
    if arch != "OlmoeForCausalLM":
        return
    if c.get("clip_qkv") is not None:
        raise ModelLoadError(f"OlmoeForCausalLM with clip_qkv {c['clip_qkv']!r} is not supported (q, k and v "
                             "are not clipped here; OLMoE-1B-7B leaves it null)")
    if c.get("sliding_window") is not None:
        raise ModelLoadError("OlmoeForCausalLM with a sliding_window is not supported")
    head_dim, whole = c.get("head_dim"), c["hidden_size"] // c["num_attention_heads"]
    if head_dim is not None and head_dim != whole:  # its q_norm is hidden_size wide, which q then is not
        raise ModelLoadError(f"OlmoeForCausalLM with head_dim {head_dim} (not hidden_size / num_attention_heads, "
                             f"{whole}) is not supported: its q norm is hidden_size wide")


# What transformers' Gemma3TextConfig fills in for a key config.json leaves out: the hub's
# Gemma 3 configs, written by transformers 4, leave out every default (a multimodal
# checkpoint's text_config may hold only its sizes), and transformers reads them with these.
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "eos_token_id": 1,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
}


def _gemma3_text_config(c: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's text decoder config, Gemma3TextConfig's defaults filled in. The multimodal
    checkpoint (Gemma3ForConditionalGeneration, 4B and up) holds it as text_config, with the
    ids and dtype at the top; its vision tower is not loaded (vLLM serves the text of it too)."""
    arch = c["architectures"][0]
    if arch == "Gemma3ForConditionalGeneration":
        top = {k: c[k] for k in ("eos_token_id", "dtype", "torch_dtype", "tie_word_embeddings", "quantization_config")
               if k in c}
        c = {**top, **(c.get("text_config") or {}), "architectures": c["architectures"]}
    # The released Gemma 3 configs set no soft cap (null); one that does is served with it, as
    # transformers' eager Gemma 3 attention and logits apply it (Gemma 2's code, below).
    return _check_gemma(arch, {**GEMMA3_TEXT_DEFAULTS, **c})


# the text_config model types whose decoder is Mistral's (or Llama's) layer as vLLM builds it for Mistral 3
MISTRAL3_TEXT_TYPES = (None, "mistral", "ministral3", "llama")


def _mistral3_text_config(c: dict[str, Any]) -> dict[str, Any]:
    """Mistral 3's text decoder config: its text_config, with the ids, dtype and quantization at the
    top. The head is tied as the text model's config says (vLLM builds the text model from
    text_config; MistralConfig's default: untied), else as the top level says."""
    text = c.get("text_config") or {}
    model_type = text.get("model_type")
    if model_type not in MISTRAL3_TEXT_TYPES:
        raise ModelLoadError(f"{MISTRAL3} with a {model_type!r} text_config is not supported (its text decoder "
                             f"must be Mistral's: model_type {', '.join(repr(t) for t in MISTRAL3_TEXT_TYPES[1:])})")
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if text.get("llama_4_scaling") or (isinstance(params, dict) and params.get("llama_4_scaling_beta")):
        raise ModelLoadError(f"{MISTRAL3} with Ministral 3's llama_4_scaling (a query scale growing with the "
                             f"position) is not supported")
    top = {k: c[k] for k in ("eos_token_id", "dtype", "torch_dtype", "tie_word_embeddings", "quantization_config")
           if k in c}
    if model_type == "llama":  # Llama's layers attend to every position, whatever sliding_window says
        text = {**text, "sliding_window": None}
    return {"tie_word_embeddings": False, **top, **text, "architectures": c["architectures"]}


# Gemma2Config's defaults, for a key config.json leaves out (the hub's Gemma 2 configs hold most)
GEMMA2_DEFAULTS = {
    "vocab_size": 256_000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "eos_token_id": 1, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 2,
    "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "head_dim": 256, "rope_theta": 10_000.0,
}


def _bidirectional_gemma3_config(cls: type[ModelConfig], c: dict[str, Any]) -> ModelConfig:
    """Gemma3TextModel with use_bidirectional_attention (EmbeddingGemma), as vLLM's Gemma3TextModelConfig: not
    causal, so served as an encoder (each prompt whole, no KV cache). Gemma 3's decoder config otherwise, but its
    sliding window: transformers keeps config.json's sliding_window // 2 + 1 as an exclusive bound either side,
    so a token sees those within sliding_window // 2 of it on both sides (vLLM's window (w - 1, w - 1))."""
    if not c.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{BIDIRECTIONAL_GEMMA3} without use_bidirectional_attention (a causal Gemma 3 without "
                             f"its head) is not supported; with it (EmbeddingGemma) it is")
    if c.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(f"{BIDIRECTIONAL_GEMMA3} with attn_logit_softcapping is not supported")
    if c.get("quantization_config"):
        raise ModelLoadError(f"{BIDIRECTIONAL_GEMMA3}: quantized encoder checkpoints are not supported")
    _check_gemma3_values(c)
    try:  # Gemma 3's decoder config, its refusals naming the architecture config.json names
        cfg = cls.from_dict({**c, "architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": False})
    except ModelLoadError as e:
        raise ModelLoadError(str(e).replace("Gemma3ForCausalLM", BIDIRECTIONAL_GEMMA3)) from None
    window = None if cfg.sliding_window is None else cfg.sliding_window // 2
    return dataclasses.replace(cfg, architecture=BIDIRECTIONAL_GEMMA3, encoder_only="gemma3", sliding_window=window,
                               tie_word_embeddings=True, eos_token_ids=[])


def _check_gemma3_values(c: dict[str, Any]) -> None:
    """EmbeddingGemma's config values of the wrong kind, each refused by its key (Gemma 3's decoder config
    would take a string norm epsilon as it is, or fail on the others with a Python error)."""
    _check_config_values(BIDIRECTIONAL_GEMMA3, c, numbers=("rms_norm_eps", "rope_theta", "rope_local_base_freq",
                                                           "query_pre_attn_scalar", "final_logit_softcapping"),
                         integers=("sliding_window", "sliding_window_pattern"), strings=("hidden_activation",),
                         lists=("layer_types", "matryoshka_dimensions"), dicts=("rope_parameters", "rope_scaling"))
    params = c.get("rope_parameters") or {}
    for layer_type in ("full_attention", "sliding_attention"):
        _check_config_values(BIDIRECTIONAL_GEMMA3, params, "rope_parameters.", dicts=(layer_type,))
        _check_config_values(BIDIRECTIONAL_GEMMA3, params.get(layer_type) or {}, f"rope_parameters.{layer_type}.",
                             numbers=("rope_theta", "factor"), strings=("rope_type",))


def _gemma2_config(c: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's config, Gemma2Config's defaults filled in: every other layer slides (layer_types, else
    sliding_window_pattern 2: layer 0 slides), and a soft cap a config sets to null is none."""
    return _check_gemma("Gemma2ForCausalLM", {**GEMMA2_DEFAULTS, **c})


def _float_or_none(x) -> float | None:
    return None if x is None else float(x)


def _check_gemma(arch: str, c: dict[str, Any]) -> dict[str, Any]:
    """What Gemma 2's and 3's configs may ask that nanoserve's Gemma decoder does not do."""
    if c.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{arch} with use_bidirectional_attention (an embedding model) is not supported: "
                             f"{arch} is served causally; EmbeddingGemma's config.json names {BIDIRECTIONAL_GEMMA3}, "
                             f"served bidirectionally")
    if c.get("attention_bias"):
        raise ModelLoadError(f"{arch} with attention_bias is not supported (nanoserve's o_proj has no bias)")
    c["hidden_activation"] = c.get("hidden_activation") or "gelu_pytorch_tanh"
    if c["hidden_activation"] != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{arch} with hidden_activation {c['hidden_activation']!r} is not supported "
                             "(nanoserve's Gemma MLP is gelu_pytorch_tanh's)")
    return c


def _gemma_layer_types(c: dict[str, Any]) -> list[str]:
    """Gemma 2's and 3's layer_types, or (older configs) every sliding_window_pattern-th layer full, the rest
    sliding (Gemma 2's pattern 2: every other layer, from layer 0)."""
    pattern = c.get("sliding_window_pattern") or 6
    return c.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                    for i in range(c["num_hidden_layers"])]


def _sliding_rope(c: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Gemma 3's sliding layers' rotary embedding: transformers 5's rope_parameters["sliding_attention"],
    else (transformers 4) rope_local_base_freq, unscaled: its rope_scaling is the full layers' only."""
    params = c.get("rope_parameters")
    if isinstance(params, dict) and "sliding_attention" in params:
        return _rope_from_config({**c, "rope_theta": c["rope_local_base_freq"],
                                  "rope_parameters": params["sliding_attention"] or {}})
    return float(c["rope_local_base_freq"]), None


def _olmo3_sliding_rope(c: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """OLMo 3's sliding layers' rotary: transformers 5's rope_parameters["sliding_attention"]; from a
    transformers 4 config (rope_scaling, rope_theta) plain RoPE at Olmo3Config's default_theta, 500000, as
    transformers 5.25 (and so vLLM) reads one: rope_theta and rope_scaling (YaRN in the long-context
    checkpoints) go to the full layers only. The released checkpoints' rope_theta is 500000 too."""
    params = c.get("rope_parameters")
    if isinstance(params, dict) and "sliding_attention" in params:
        return _rope_from_config({**c, "rope_theta": 500_000.0, "rope_parameters": params["sliding_attention"] or {}})
    return 500_000.0, None


def _smollm3_rope_layers(c: dict[str, Any]) -> list[int]:
    """SmolLM3Config's no_rope_layers: 1 for a layer with rotary, 0 for a NoPE one; by default every
    no_rope_layer_interval-th layer (the 4th, 8th, ...) is NoPE."""
    n, interval = c["num_hidden_layers"], c.get("no_rope_layer_interval") or 4
    flags = c.get("no_rope_layers")
    if flags is None:
        return [int((i + 1) % interval != 0) for i in range(n)]
    if not isinstance(flags, list) or len(flags) < n:
        raise ModelLoadError(f"SmolLM3ForCausalLM's no_rope_layers needs a 0 or 1 for each of its {n} layers, "
                             f"got {flags!r}")
    return [int(bool(f)) for f in flags[:n]]


def _nope_layers(c: dict[str, Any]) -> tuple[int, ...]:
    return tuple(i for i, rope in enumerate(_smollm3_rope_layers(c)) if not rope)


def override_config(c: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's hf_overrides: each key replaces the checkpoint's. A rope_scaling given in
    transformers 4's form replaces a transformers 5 checkpoint's rope_parameters, whose
    rope_theta it keeps unless rope_theta is given too. A text_config given as an object is
    laid over the checkpoint's key by key (vLLM's, for a sub-config): replaced whole, a
    multimodal checkpoint's text decoder would lose its sizes to Gemma3TextConfig's defaults."""
    if not overrides:
        return c
    nested = {k: override_config(c[k], v) for k, v in overrides.items()
              if k == "text_config" and isinstance(v, dict) and isinstance(c.get(k), dict)}
    c = {**c, **overrides, **nested}
    legacy = "rope_scaling" in overrides and "rope_parameters" not in overrides
    if legacy and isinstance(c.get("rope_parameters"), dict):
        params = c.pop("rope_parameters")
        sliding = params.get("sliding_attention") or {}  # per layer type (Gemma 3): each keeps its theta
        params = params.get("full_attention", params) or {}
        thetas = {"rope_theta": params.get("rope_theta"), "rope_local_base_freq": sliding.get("rope_theta")}
        for key, theta in thetas.items():
            if theta is not None:
                c.setdefault(key, theta)
    return c


def _rope_params(c: dict[str, Any]) -> dict[str, Any]:
    params = c.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    if params is None:  # transformers 4: rope_scaling, and rope_theta beside it
        params = c.get("rope_scaling") or {}
    return dict(params)  # a copy: rope_theta is popped from it


def _rope_from_config(c: dict[str, Any], arch: str | None = None,
                      rotary_dim: int | None = None) -> tuple[float, dict[str, Any] | None]:
    params = _rope_params(c)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if arch == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):  # Phi3Config's reading: older names of LongRoPE
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope type {rope_type!r}; nanoserve supports "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    theta = float(params.pop("rope_theta", c.get("rope_theta", 10000.0)))
    params["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn", "longrope"):  # the pre-training length, read as transformers standardizes it
        params["original_max_position_embeddings"] = int(c.get("original_max_position_embeddings")
                                                          or params.get("original_max_position_embeddings")
                                                          or c.get("max_position_embeddings", 2048))
    if rope_type == "yarn" and params.get("factor") is None:  # DeepSeek-V3's form: the ratio of the lengths
        params["factor"] = c.get("max_position_embeddings", 2048) / params["original_max_position_embeddings"]
    if rope_type == "longrope":
        _longrope_params(c, params, rotary_dim)
    return theta, (None if rope_type == "default" else params)


def _longrope_params(c: dict[str, Any], params: dict[str, Any], rotary_dim: int | None) -> None:
    """LongRoPE (Phi-3.5, Phi-4-mini): per-dimension divisors of the frequencies, short_factor
    for contexts within the pre-training length, long_factor beyond it, and an attention factor
    on cos and sin (transformers': its own key, else from ``factor``, else from the ratio of the
    lengths). Which set serves is chosen once, as vLLM does: ModelConfig.with_max_model_len."""
    short, long = params.get("short_factor"), params.get("long_factor")
    if not (isinstance(short, list) and isinstance(long, list)):
        raise ModelLoadError("longrope rope scaling needs short_factor and long_factor lists")
    if rotary_dim is not None and not len(short) == len(long) == rotary_dim // 2:
        raise ModelLoadError(f"longrope's short_factor and long_factor need {rotary_dim // 2} values each (half "
                             f"the rotary dims), got {len(short)} and {len(long)}")
    old_len = params["original_max_position_embeddings"]
    if params.get("attention_factor") is None:
        factor = params.get("factor") or c.get("max_position_embeddings", 2048) / old_len
        params["attention_factor"] = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    params["use_long_factor"] = c.get("max_position_embeddings", 2048) > old_len  # max_model_len's default


def _rotary_dim(c: dict[str, Any], head_dim: int) -> int:
    """The leading dims of each head that RoPE turns: ``partial_rotary_factor`` of them
    (Phi-4-mini's 0.75), top-level or in rope_parameters as transformers 5 saves it."""
    factor = c.get("partial_rotary_factor") or _rope_params(c).get("partial_rotary_factor") or 1.0
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ModelLoadError(f"partial_rotary_factor {factor} of head_dim {head_dim} gives {rotary_dim} rotary dims: "
                             f"need an even number, at most head_dim")
    return rotary_dim


def _scaled_max_positions(max_positions: int, scaling: dict[str, Any] | None) -> int:
    """As vLLM derives max_model_len: linear scaling stretches the context by its
    factor, YaRN the pre-training length by its factor; llama3 and longrope keep the config's."""
    if scaling is None or scaling["rope_type"] in ("llama3", "longrope"):
        return int(max_positions)
    if scaling["rope_type"] == "yarn":
        return int(scaling["original_max_position_embeddings"] * scaling["factor"])
    return int(max_positions * scaling["factor"])


def _sliding_window(arch: str, c: dict[str, Any]) -> tuple[int | None, tuple[int, ...]]:
    """The window and the layers that use it, as transformers reads them: every layer of
    Mistral's, Mixtral's and Phi-3's; Gemma 2's and 3's ``layer_types``; with Qwen's use_sliding_window, those
    ``layer_types`` names (by default the layers from max_window_layers on), and SmolLM3's (by default its NoPE
    layers); OLMo 3's ``layer_types``; none of Llama's, Granite's (dense or MoE) or OLMo 2's."""
    window, n = c.get("sliding_window", 4096 if arch == "Olmo3ForCausalLM" else None), c["num_hidden_layers"]
    if window is None or arch in ("LlamaForCausalLM", *GRANITE_ARCHITECTURES, "Olmo2ForCausalLM"):
        return None, ()
    if arch == "Olmo3ForCausalLM":  # always on; Olmo3Config's defaults: 4096, three sliding layers, then a full one
        types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        return (int(window) if layers else None), layers
    if arch == SMOLLM3:  # with use_sliding_window, the layer_types names (by default the NoPE layers)
        if not c.get("use_sliding_window", False):
            return None, ()
        types = c.get("layer_types") or ["full_attention" if rope else "sliding_attention"
                                         for rope in _smollm3_rope_layers(c)]
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        return (int(window) if layers else None), layers
    if arch == "Phi3ForCausalLM":  # every layer (Phi-3-mini-4k's 2047); one no sequence outgrows is none
        return (None, ()) if window >= c.get("max_position_embeddings", 2048) else (int(window), tuple(range(n)))
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", MISTRAL3):
        return int(window), tuple(range(n))
    if arch in (*GEMMA3_ARCHITECTURES, "Gemma2ForCausalLM", GPT_OSS):  # always on, for the layers layer_types names
        types = (c.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
                 if arch == GPT_OSS else _gemma_layer_types(c))  # GptOssConfig's default: every other, from 0
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        return (int(window) if layers else None), layers
    if not c.get("use_sliding_window", False):
        return None, ()
    first = c.get("max_window_layers", 28)
    types = c.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return (int(window) if layers else None), layers


def num_parameters(cfg: ModelConfig) -> int:
    """Parameter count from the config alone, to check memory before loading."""
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    if cfg.modernbert:  # embeddings and three norms a layer at most (weights only: biases are few, often none)
        return (cfg.vocab_size + 1) * H + cfg.num_layers * (4 * H * H + 3 * H * I + 2 * H)
    if cfg.encoder_only in ("bert", "roberta"):  # embeddings and their norm; per layer q/k/v/o, the MLP, two norms
        embeddings = (cfg.vocab_size + cfg.position_rows + cfg.type_vocab_size + 2) * H
        return embeddings + cfg.num_layers * (4 * H * H + 4 * H + 2 * H * I + I + H + 4 * H)
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * D
    layer = H * qkv + cfg.num_heads * D * H + 2 * H
    if cfg.kv_lora_rank:
        layer = _mla_parameters(cfg) + 2 * H
    layer += qkv if cfg.attention_bias else 0
    layer += 2 * D if cfg.qk_norm else 0
    layer += (cfg.num_heads + cfg.num_kv_heads) * D if cfg.qk_norm_whole else 0
    layer += 2 * H if cfg.gemma or cfg.architecture == GLM4 else 0  # their two norms more
    # every expert is held (a token runs top-k of them, the memory is all of them), with the router
    # and the shared expert (and Qwen2-MoE's gate of it)
    sparse = cfg.num_experts * (3 * H * cfg.moe_intermediate_size + H)
    if cfg.architecture == GPT_OSS:  # o_proj's bias and the sinks; the router's bias, the experts' two biases
        layer += H + cfg.num_heads
        sparse += cfg.num_experts * (1 + 2 * cfg.moe_intermediate_size + H)
    sparse += 3 * H * cfg.shared_expert_intermediate_size + (H if cfg.shared_expert_gate else 0)
    mlps = len(cfg.moe_layers) * sparse + (cfg.num_layers - len(cfg.moe_layers)) * 3 * H * I
    heads = 1 if cfg.tie_word_embeddings else 2
    return heads * cfg.vocab_size * H + cfg.num_layers * layer + mlps + H


def weight_bytes_before_load(cfg: ModelConfig, dtype: torch.dtype, wna16_packed: bool = False) -> int:
    """The weights' bytes from the config alone, to check memory before loading: every parameter in
    ``dtype``; or, a weight-only int checkpoint served packed (wna16_packed), its linear layers (the experts
    too, unless act-order: those stay dequantized) as codes, a scale and zero point a group, and only the
    embeddings and head (quantized or not) in ``dtype``. Low where the checkpoint leaves a linear layer
    unquantized: the check then errs toward loading, as it did not before packing."""
    elem = torch.empty((), dtype=dtype).element_size()
    total = num_parameters(cfg)
    quant = cfg.quantization
    if not wna16_packed or not isinstance(quant, WNA16Config):
        return total * elem
    dense = (1 if cfg.tie_word_embeddings else 2) * cfg.vocab_size * cfg.hidden_size
    if quant.desc_act:
        dense += len(cfg.moe_layers) * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    per_group = 2 + (1 if quant.bits == 4 else 2)  # an fp16 scale, a uint8 or int16 zero point
    packed = (total - dense) * (quant.bits / 8 + (per_group / quant.group_size if quant.group_size > 0 else 0))
    return dense * elem + int(packed)


def _mla_parameters(cfg: ModelConfig) -> int:
    """One MLAAttention's: the query's projections (and norm), kv_a (and its norm), kv_b, o."""
    H, heads, L = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
    q_out = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    Q = cfg.q_lora_rank
    q = H * Q + Q + Q * q_out if Q else H * q_out
    return q + H * (L + cfg.qk_rope_head_dim) + L + L * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) \
        + heads * cfg.v_head_dim * H


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, config: ModelConfig) -> torch.dtype:
    """``auto``: the checkpoint's dtype on a GPU (fp16 where it has no bf16: before
    compute capability 8.0), bf16 on the CPU (fp16 matmuls are slow there and fp32
    doubles the bytes every step reads)."""
    if dtype == "auto":
        if device.type == "cpu":
            return torch.bfloat16
        ckpt = DTYPES.get(config.checkpoint_dtype.replace("torch.", ""), torch.bfloat16)
        chosen = torch.bfloat16 if ckpt == torch.float32 else ckpt
    elif isinstance(dtype, torch.dtype) or dtype in DTYPES:
        chosen = DTYPES.get(dtype, dtype)
    else:
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if chosen == torch.bfloat16 and capability is not None and capability < (8, 0):
        if dtype != "auto":
            raise ValueError(f"bfloat16 needs a GPU of compute capability 8.0 or higher, and {device} has "
                             f"{capability[0]}.{capability[1]}: use --dtype float16 (or float32)")
        logger.warning("[model] dtype auto: float16, as %s (compute capability %d.%d) has no bfloat16", device,
                       *capability)
        return torch.float16
    return chosen


# =========================================================================== layers
#
# The decoder as transformers writes it, with two differences: q/k/v and
# gate/up are fused into one matmul each at load time, and the ops between the
# matmuls come from the kernels.Backend that select_backend picked once (the
# engine, or a worker rank, calls it), handed to each layer when it is built.

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, backend: Backend):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With a residual: (norm(x + residual), x + residual), in one pass where
        the backend fuses it (vLLM's fused_add_rms_norm)."""
        if residual is None:
            return self.backend.rms_norm(x, self.weight, self.eps)
        return self.backend.fused_add_rms_norm(x, residual, self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm, x / rms(x) * (1 + w), scaled in fp32 and rounded once (Llama's rounds
    x / rms(x) to the model's dtype first). The 1 is added at load, in fp32 to w as the model's
    dtype holds it, and the weight stays fp32: the same numbers as transformers' (and vLLM's)
    1 + w.float() on every call, so that bf16 logits are transformers' bit for bit. (Adding it
    into a bf16 weight for the Llama norm's kernels instead rounds twice more: it moved a tiny
    model's bf16 logits further from transformers' than those are from fp32.)"""

    def __init__(self, dim: int, eps: float, backend: Backend):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32))
        self.model_dtype = torch.get_default_dtype()  # build_model's
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.backend.gemma_rms_norm(x, self.weight, self.eps)
        return self.backend.gemma_fused_add_rms_norm(x, residual, self.weight, self.eps)

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: int) -> None:
        param.copy_(_read(loaded, param.shape).to(self.model_dtype).float() + 1.0)


# True while build_model builds a weight-only int checkpoint served packed (WNA16Weight, WNA16Experts): each
# Linear's weight and FusedMoE's expert stacks are then made on the meta device, and load_weights gives each
# its form when its checkpoint tensor comes, packed codes if quantized, else the weight allocated, so the
# dequantized weights never take the device's memory.
# A context variable, as torch's default device is a context: it holds for one construction, in its own thread.
_defer_linear_weights: contextvars.ContextVar[bool] = contextvars.ContextVar("defer_linear_weights", default=False)


class Linear(nn.Module):
    """nn.Linear without the random init (the checkpoint overwrites it anyway,
    and initialising 0.6B parameters costs seconds on a CPU). A backend's prepare_model may
    replace it after loading (the CPU's, by a layer holding the weight packed or in fp32:
    cpu_backend.pack_linear_weights). An int4/int8 weight served packed is ``wna16`` (its
    ``weight`` then None)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        deferred = _defer_linear_weights.get()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device="meta" if deferred else None))
        self.weight_device = torch.get_default_device() if deferred else None  # where a deferred one goes
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.wna16: WNA16Weight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wna16 is None:
            return F.linear(x, self.weight, self.bias)
        y = self.wna16(x)
        return y if self.bias is None else y + self.bias


# --------------------------------------------------------------------------- tensor parallelism
#
# Megatron's split with vLLM's names. A column-parallel linear splits its output
# rows across ranks (q/k/v by heads, gate/up by rows), so each rank goes on with
# its own heads and needs no communication; the row-parallel linear after it
# (o_proj, down_proj) splits its input columns the same way, and one all-reduce
# sums the ranks' partial products. With world_size 1 every layer here is the
# plain layer: the same shapes, the same math, no collective and no padding.

# A forward's collectives: a peer that died fails them at once (its socket
# closes); one that hangs fails them after this long.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=30)
# Step messages, and start-up: a worker waits for the next step as long as the
# server is idle, and ranks may load their weights at different speeds.
IDLE_TIMEOUT = datetime.timedelta(days=365)
STEP_KEY = "nanoserve/step/{}"


@dataclass(slots=True, frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group (vLLM's tp group, as
    plain data). The forward's collectives run on torch.distributed's default
    process group (NCCL on CUDA, gloo on the CPU); start-up's on ``cpu_group``,
    a patient gloo group as vLLM's ``cpu_group``. Step messages go through
    ``store``, the rendezvous TCPStore: rank 0's ``set`` never waits for a
    worker (a gloo broadcast's root waits for every receiver, so one hung
    worker would hang it for good), and a hung worker is then caught by the
    forward's collective timeout. World size 1 needs no group: every
    collective is then the identity. ``reduce_results`` False (``partial()``): the
    group of a layer whose partial sums its caller reduces, once for several
    (vLLM's reduce_results=False), whose all_reduce is then the identity too."""
    rank: int = 0
    world_size: int = 1
    cpu_group: Any = None
    store: Any = None
    reduce_results: bool = True

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1 and self.reduce_results:
            dist.all_reduce(x)
        return x

    def partial(self) -> "TPGroup":
        """This group for a layer that leaves its partial sums to its caller's one all-reduce.
        (The layer's tp, not a flag on it: a backend that replaces the layer, cpu_backend's,
        reduces with the tp it takes from it.)"""
        return dataclasses.replace(self, reduce_results=False)

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` concatenated along the last dim, on rank 0 (None on the others)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def min(self, n: int) -> int:
        """The smallest ``n`` over the ranks (start-up: on the patient cpu group)."""
        if self.world_size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t)

    def barrier(self) -> None:
        """Wait for every rank (start-up: on the patient cpu group)."""
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    def send_step(self, step: int, message: Any) -> None:
        """Rank 0: step number ``step``'s inputs (None: shut down), one pickled
        message. Step ``step - 1``'s is dropped: every worker has read it, since
        its forward's collectives finished."""
        self.store.set(STEP_KEY.format(step), pickle.dumps(message))
        if step > 0:
            self.store.delete_key(STEP_KEY.format(step - 1))

    def recv_step(self, step: int) -> Any:
        """Ranks 1..N-1: wait (while the server is idle) for step ``step``'s message."""
        return pickle.loads(self.store.get(STEP_KEY.format(step)))


def init_distributed(rank: int, world_size: int, init_method: str, device: torch.device) -> TPGroup:
    """Join the group through torch.distributed's own rendezvous: ``tcp://HOST:PORT``
    (rank 0 hosts the store there), or ``env://`` (MASTER_ADDR/MASTER_PORT; under
    torchrun its agent hosts the store)."""
    if init_method == "env://":
        host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
        hosts_store = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    else:
        (host, port), hosts_store = tcp_address(init_method), rank == 0
    # The store waits for slow ranks (another node starting later) as long as
    # IDLE_TIMEOUT; the forward's collectives get the short COLLECTIVE_TIMEOUT.
    store = dist.TCPStore(host, port, world_size, is_master=hosts_store, timeout=IDLE_TIMEOUT)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TPGroup(rank, world_size, cpu_group, store)


def tcp_address(init_method: str) -> tuple[str, int]:
    address = init_method[len("tcp://"):] if init_method.startswith("tcp://") else ""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"distributed_init_method must be tcp://HOST:PORT or env://, got {init_method!r}")
    return host.strip("[]"), int(port)


def check_tensor_parallel(cfg: ModelConfig, tp_size: int) -> None:
    """One clear start-up error for a model that cannot be split ``tp_size`` ways."""
    kv = cfg.num_kv_heads
    problems = []
    if tp_size < 1:
        problems.append(f"tensor_parallel_size must be >= 1, got {tp_size}")
    else:
        if cfg.num_heads % tp_size:
            problems.append(f"num_attention_heads={cfg.num_heads} is not divisible by tensor_parallel_size={tp_size}")
        if (kv % tp_size) if tp_size <= kv else (tp_size % kv):
            problems.append(f"num_key_value_heads={kv} and tensor_parallel_size={tp_size}: one must divide "
                            f"the other (KV heads are split, or replicated when there are fewer than ranks)")
        # the widths this model splits, by config.json's names: a dense layer's (if there is one: a MoE model's
        # every layer may be sparse), every expert's (vLLM splits each, as a dense MLP's; Mixtral's, OLMoE's
        # and Granite's is their intermediate_size), the shared expert's
        sizes = {"intermediate_size": cfg.intermediate_size} if cfg.num_layers > len(cfg.moe_layers) else {}
        if cfg.num_experts:
            experts = ("intermediate_size" if cfg.architecture in EXPERTS_OF_INTERMEDIATE_SIZE
                       else "moe_intermediate_size")
            sizes[experts] = cfg.moe_intermediate_size
        shared = {"GraniteMoeSharedForCausalLM": "shared_intermediate_size",
                  **dict.fromkeys(("Glm4MoeForCausalLM", *MLA_ARCHITECTURES),
                                  "moe_intermediate_size * n_shared_experts")}.get(
                      cfg.architecture, "shared_expert_intermediate_size")
        sizes[shared] = cfg.shared_expert_intermediate_size
        problems += [f"{k}={v} is not divisible by tensor_parallel_size={tp_size}" for k, v in sizes.items()
                     if v % tp_size]
    if problems:
        raise ValueError("cannot split this model across ranks: " + "; ".join(problems))


def num_kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds (and caches): split, or one replicated head."""
    return max(1, num_kv_heads // tp_size)


def shard_config(cfg: ModelConfig, tp_size: int) -> ModelConfig:
    """The shapes one rank computes with (what a backend builds and checks its kernels for)."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp_size,
                               num_kv_heads=num_kv_heads_per_rank(cfg.num_kv_heads, tp_size),
                               intermediate_size=cfg.intermediate_size // tp_size,
                               moe_intermediate_size=cfg.moe_intermediate_size // tp_size,
                               shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // tp_size)


class _ShapeMismatch(Exception):
    def __init__(self, actual: tuple, expected: tuple):
        super().__init__(actual, expected)
        self.actual, self.expected = actual, expected


def _read(loaded, full_shape: tuple, dim: int = 0, start: int = 0, size: int | None = None) -> torch.Tensor:
    """Rows (or, dim=1, columns) [start, start + size) of a checkpoint tensor that must
    have ``full_shape``; safetensors' get_slice reads only those bytes."""
    shape = tuple(loaded.get_shape())
    if shape != tuple(full_shape):
        raise _ShapeMismatch(shape, tuple(full_shape))
    size = shape[dim] - start if size is None else size
    return loaded[(slice(None),) * dim + (slice(start, start + size),)]


def default_weight_loader(param: torch.Tensor, loaded, shard_id: int) -> None:
    """Norms and whatever else every rank holds whole."""
    param.copy_(_read(loaded, param.shape))


class ColumnParallelLinear(Linear):
    """Y = XA with A's output rows split across ranks; ``output_sizes`` lists the
    logical shards fused side by side (q, k, v or gate, up), each split on its
    own. No communication: the row-parallel layer after it takes Y split."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup,
                 local_sizes: list[int] | None = None):
        self.full_sizes = list(output_sizes)
        self.local_sizes = local_sizes or [s // tp.world_size for s in output_sizes]
        super().__init__(in_features, sum(self.local_sizes), bias)
        self.tp = tp

    def shard_rank(self, shard_id: int) -> int:
        """Whose slice of shard ``shard_id`` this rank holds."""
        return self.tp.rank

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: int | None) -> None:
        """One logical shard's tensor (q_proj's), or with ``shard_id`` None one that holds them all
        side by side as this layer does (Phi-3's qkv_proj): this rank's rows of each shard."""
        full = (sum(self.full_sizes) if shard_id is None else self.full_sizes[shard_id], *param.shape[1:])
        for i in range(len(self.full_sizes)) if shard_id is None else [shard_id]:
            size, offset = self.local_sizes[i], sum(self.full_sizes[:i]) if shard_id is None else 0
            dest = param.narrow(0, sum(self.local_sizes[:i]), size)
            dest.copy_(_read(loaded, full, 0, offset + self.shard_rank(i) * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """gate_proj and up_proj as one matmul, each split by rows: a rank holds its
    gate rows, then its up rows, so SiLU-and-mul pairs them as before."""


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v fused, split by heads. With more ranks than KV heads, each KV
    head is replicated on tensor_parallel_size / num_kv_heads ranks (vLLM's
    rule), so a rank's query heads always find theirs."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, tp: TPGroup):
        self.num_heads = num_heads // tp.world_size
        self.num_kv_heads = num_kv_heads_per_rank(num_kv_heads, tp.world_size)
        self.num_kv_head_replicas = max(1, tp.world_size // num_kv_heads)
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden_size, [num_heads * head_dim] + [num_kv_heads * head_dim] * 2, bias, tp,
                         local_sizes=[q, kv, kv])

    def shard_rank(self, shard_id: int) -> int:
        return self.tp.rank if shard_id == 0 else self.tp.rank // self.num_kv_head_replicas


class RowParallelLinear(Linear):
    """Y = XA with A's input columns split across ranks: each rank multiplies the
    slice of X it already holds (a column-parallel layer's output) and one
    all-reduce sums the partial products (``reduce_results`` False: the caller's). A bias
    (gpt-oss's o_proj) is rank 0's, zeros on the others: added once in the sum."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, reduce_results: bool = True,
                 bias: bool = False):
        super().__init__(in_features // tp.world_size, out_features, bias)
        self.full_in_features = in_features
        self.tp = tp if reduce_results else tp.partial()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: int) -> None:
        if param is self.bias:
            param.copy_(_read(loaded, param.shape) if self.tp.rank == 0 else torch.zeros_like(param))
            return
        n = param.shape[1]
        param.copy_(_read(loaded, (param.shape[0], self.full_in_features), 1, self.tp.rank * n, n))


def vocab_range(vocab_size: int, tp: TPGroup) -> tuple[int, int]:
    """This rank's vocabulary rows [start, end): equal shares, the last padded
    when the vocabulary does not divide (one rank: the vocabulary exactly)."""
    per_rank = -(-vocab_size // tp.world_size)
    return tp.rank * per_rank, (tp.rank + 1) * per_rank


def _load_vocab_rows(param: torch.Tensor, loaded, start: int, vocab_size: int) -> None:
    rows = max(0, min(param.shape[0], vocab_size - start))
    param[:rows].copy_(_read(loaded, (vocab_size, param.shape[1]), 0, start, rows))
    param[rows:].zero_()  # padding: never looked up, its logits cut off before sampling


class VocabParallelEmbedding(nn.Module):
    """The embedding split by vocabulary rows: a rank looks up the ids it holds,
    zeroes the others' rows, and an all-reduce fills them in (exact: one rank
    contributes each row, the rest add zeros)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp
        self.vocab_start, self.vocab_end = vocab_range(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.rows(input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        x = self.rows(torch.where(outside, 0, input_ids - self.vocab_start))
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's rows ``ids`` (a CPU backend may read them from a tied head's packed copy instead)."""
        return F.embedding(ids, self.weight)

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: int) -> None:
        _load_vocab_rows(param, loaded, self.vocab_start, self.vocab_size)


class ParallelLMHead(Linear):
    """The untied LM head, split by vocabulary rows as VocabParallelEmbedding is:
    each rank computes its rows' logits; CausalLM.compute_logits gathers them."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        self.vocab_start, self.vocab_end = vocab_range(vocab_size, tp)
        super().__init__(hidden_size, self.vocab_end - self.vocab_start)
        self.vocab_size = vocab_size

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: int) -> None:
        _load_vocab_rows(param, loaded, self.vocab_start, self.vocab_size)


# --------------------------------------------------------------------------- the decoder

def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    if scaling["rope_type"] == "longrope":  # a divisor per frequency, one set for every position
        ext = scaling["long_factor" if scaling["use_long_factor"] else "short_factor"]
        return (inv_freq / torch.tensor(ext, dtype=torch.float64)).float()
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return (inv_freq / factor).float()
    if scaling["rope_type"] == "yarn":
        return yarn_inv_freq(inv_freq, head_dim, theta, factor, scaling).float()
    # llama3: long wavelengths are slowed by `factor`, short ones kept, smooth in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(mid, blended, scaled).float()


def yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, factor: float,
                  scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): dimensions that turn fewer than beta_slow times over
    the pre-training length are slowed by ``factor`` (interpolated), those that turn
    more than beta_fast times are kept (extrapolated), with a linear ramp between."""
    old_len = scaling["original_max_position_embeddings"]

    def dim_turning(turns: float) -> float:  # the dimension whose wave turns `turns` times in old_len
        return head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_turning(scaling.get("beta_fast") or 32), dim_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high += 0.001 if low == high else 0  # no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What YaRN and LongRoPE multiply cos and sin by (an attention temperature); 1 otherwise."""
    if scaling is not None and scaling["rope_type"] == "longrope":
        return float(scaling["attention_factor"])
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    factor, m, m_all = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    return yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched ``scale`` times (transformers' yarn_get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


class RotaryEmbedding(nn.Module):
    """The rotary embedding, its cos/sin tables cached for every position (fp32).
    One instance serves all layers, as vLLM's get_rope hands out. ``rotary_dim``:
    head_dim, or fewer (partial rotary): the tables' width, which the backend's
    rotary op reads as the leading dims of each head it turns."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 backend: Backend):
        super().__init__()
        inv_freq = rope_inv_freq(rotary_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        scale = rope_attention_factor(scaling)  # in the tables, as transformers and vLLM scale them
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)
        self.backend = backend

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return self.backend.rotary(q, k, positions, self.cos, self.sin)


@dataclass(slots=True)
class AttentionMetadata:
    """What every attention layer of one step needs (vLLM's names)."""
    slot_mapping: torch.Tensor     # int64 [num_tokens]
    block_tables: torch.Tensor     # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor         # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]


class ShardedRMSNorm(nn.Module):
    """An RMSNorm over a dim that tensor parallelism splits (OLMoE's q and k norms, over all heads):
    a rank holds its slice of the weight, from ``start``, and its slice of x; the mean square
    is the all-reduced sum of the ranks' squares over ``world_size`` slices' widths (exact where
    ranks replicate KV heads too: each is then counted as often as there are replicas, in both).
    One rank: the backend's rms_norm, every other norm's."""

    def __init__(self, full_dim: int, dim: int, start: int, eps: float, backend: Backend, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.full_dim, self.start, self.eps, self.backend, self.tp = full_dim, start, eps, backend, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.backend.rms_norm(x, self.weight, self.eps)
        squares = self.tp.all_reduce(x.float().pow(2).sum(-1, keepdim=True))
        mean_square = squares / (self.tp.world_size * x.shape[-1])
        return self.weight * (x.float() * torch.rsqrt(mean_square + self.eps)).to(x.dtype)

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: int) -> None:
        param.copy_(_read(loaded, (self.full_dim,), 0, self.start, param.shape[0]))


def _pairs_to_halves(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's dims that puts its rotary pairs' first elements, then their second, before
    the dims it does not turn."""
    evens, odds = torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)
    return torch.cat([evens, odds, torch.arange(rotary_dim, head_dim)])


class Attention(nn.Module):
    """Under tensor parallelism a rank computes its own heads: q/k/v come split by
    heads, its KV cache holds only its KV heads, and o_proj sums the ranks' parts."""

    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding | None, backend: Backend, tp: TPGroup,
                 sliding_window: int | None):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.attention_bias, tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, tp,
                                        bias=cfg.attention_sinks)  # gpt-oss's o_proj has a bias too
        norm = GemmaRMSNorm if cfg.gemma else RMSNorm
        self.q_norm = norm(cfg.head_dim, cfg.rms_norm_eps, backend) if cfg.qk_norm else None
        self.k_norm = norm(cfg.head_dim, cfg.rms_norm_eps, backend) if cfg.qk_norm else None
        self.qk_norm_whole = cfg.qk_norm_whole
        if self.qk_norm_whole:  # OLMoE's: this rank's q (and k) rows, the mean square over all the ranks'
            (q_full, kv_full, _), qkv, eps = self.qkv_proj.full_sizes, self.qkv_proj, cfg.rms_norm_eps
            self.q_norm = ShardedRMSNorm(q_full, self.q_size, qkv.shard_rank(0) * self.q_size, eps, backend, tp)
            self.k_norm = ShardedRMSNorm(kv_full, self.kv_size, qkv.shard_rank(1) * self.kv_size, eps, backend, tp)
        self.rotary_emb = rotary_emb  # None: a NoPE layer (SmolLM3's), q and k attend unrotated
        # GLM-4 turns pairs (x0, x1), (x2, x3), ... of the rotary dims; the backends' rotary turns halves: each
        # head's rotary dims are reordered evens then odds (q and k alike, so their dot products are the same)
        self.register_buffer("rope_order", _pairs_to_halves(cfg.head_dim, cfg.rotary_dim) if cfg.rope_interleave
                             else None, persistent=False)
        self.scale = cfg.head_dim ** -0.5 if cfg.attention_scale is None else cfg.attention_scale
        self.sliding_window = sliding_window  # None: every earlier position is visible
        # Gemma 2's soft cap on the scores, a keyword only where there is one: a backend's
        # attention that no soft-capped model runs on need not take it
        self.logits_soft_cap = cfg.attn_logit_softcapping
        self.attn_kwargs = {} if self.logits_soft_cap is None else {"logits_soft_cap": self.logits_soft_cap}
        # gpt-oss's sinks: a logit for each of this rank's heads (fp32, as the kernels read it), one keyword more
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32)) if cfg.attention_sinks else None
        if self.sinks is not None:
            self.attn_kwargs["sinks"] = self.sinks
        self.tp = tp
        self.backend = backend

    def attention_caches(self, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V that paged_attention reads: the layer's caches as they are (MLAAttention's differ)."""
        return kv_cache

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: int) -> None:
        """The sinks (the one parameter held here): this rank's heads' of all the heads'."""
        n = param.shape[0]
        param.copy_(_read(loaded, (n * self.tp.world_size,), 0, self.tp.rank * n, n))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """One layer's attention over the step's flattened tokens: qkv -> (q/k norm) -> rotary ->
        backend.store_kvcache -> backend.paged_attention (kernels.py, or cpu_backend.py) -> o_proj."""
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_whole:  # OLMoE: an RMSNorm over all of q's heads together, one over k's
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_whole:  # Qwen3 (and its MoE), Gemma 3: each head's
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_emb is not None:
            if self.rope_order is not None:
                q, k = q[..., self.rope_order], k[..., self.rope_order]
            q, k = self.rotary_emb(positions, q, k)
        # The step's new K and V go into the paged cache first, so that attention
        # reads every position, old and new, through the block tables.
        k_cache, v_cache = kv_cache
        self.backend.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        o = self.backend.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                         meta.query_start_loc, self.scale, self.sliding_window, **self.attn_kwargs)
        return self.o_proj(o.reshape(T, self.q_size))


class KVBProj(nn.Module):
    """kv_b_proj's weight [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank], this rank's heads' rows:
    never multiplied as a linear layer (MLAAttention reads W_UK and W_UV out of it), so not a ``Linear``,
    which a CPU backend would repack."""

    def __init__(self, kv_lora_rank: int, rows_per_head: int, num_heads: int, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_heads // tp.world_size * rows_per_head, kv_lora_rank))
        self.full_rows, self.tp = num_heads * rows_per_head, tp

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: int) -> None:
        n = param.shape[0]
        param.copy_(_read(loaded, (self.full_rows, param.shape[1]), 0, self.tp.rank * n, n))


class MLAAttention(nn.Module):
    """DeepSeek's multi-head latent attention as vLLM runs it: the KV cache holds, per token, one latent
    c (kv_lora_rank, after kv_a_layernorm) and the roped k_pe, one KV head (cfg.head_dim wide). Absorb:
    q_nope[h] . (W_UK[h] c) = (W_UK[h]^T q_nope[h]) . c, and sum_t p_t W_UV[h] c_t = W_UV[h] sum_t p_t c_t,
    so each head's query moves into the latent space, attention is MQA over the cached [c; k_pe] (one
    tensor: K is all of it, V its first kv_lora_rank dims, c, a view; the output is the latent output,
    kv_lora_rank wide), and W_UV lifts the result. Prefill runs the same absorbed form (correct; more
    compute than expanding K and V for long prompts, as vLLM's prefill does). Under tensor parallelism a
    rank holds its heads' rows of q and kv_b, and its columns of o_proj; the latent and its projection are
    every rank's."""

    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding, backend: Backend, tp: TPGroup):
        super().__init__()
        H, heads, L = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
        self.num_heads, self.num_kv_heads = heads // tp.world_size, 1  # this rank's
        self.nope, self.rope, self.v_dim, self.kv_lora_rank = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                               cfg.v_head_dim, L)
        q_out = heads * (self.nope + self.rope)
        self.q_lora_rank = cfg.q_lora_rank  # V2-Lite projects q directly; V2/V3 through a low-rank q_a/q_b
        if cfg.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(H, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, backend)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, [q_out], False, tp)
        else:
            self.q_proj = ColumnParallelLinear(H, [q_out], False, tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(H, L + self.rope)
        self.kv_a_layernorm = RMSNorm(L, cfg.rms_norm_eps, backend)
        self.kv_b_proj = KVBProj(L, self.nope + self.v_dim, heads, tp)
        self.o_proj = RowParallelLinear(heads * self.v_dim, H, tp)
        self.rotary_emb, self.rope_interleave = rotary_emb, cfg.rope_interleave
        self.scale = cfg.attention_scale  # the full query head's, not the cache's width's (_mla_config)
        self.attn_kwargs: dict[str, Any] = {}
        self.backend = backend

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """q and the latent -> rotary on their rope parts -> backend.store_kvcache of [c; k_pe] -> q absorbed
        into the latent space -> backend.paged_attention (MQA over the latent) -> W_UV -> o_proj."""
        T = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q_nope, q_pe = q.view(T, self.num_heads, -1).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        q_pe, k_pe = self.rotary_emb(positions, self._rope_layout(q_pe), self._rope_layout(k_pe.view(T, 1, -1)))
        kv = torch.cat([self.kv_a_layernorm(latent).unsqueeze(1), k_pe], dim=-1)  # [T, 1, kv_lora_rank + rope]
        w_uk, w_uv = self.kv_b_proj.weight.view(self.num_heads, -1, self.kv_lora_rank).split(
            [self.nope, self.v_dim], dim=1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, heads, kv_lora_rank]
        cache = kv_cache[0]  # kv_cache[1] is the same tensor
        self.backend.store_kvcache(kv, kv, cache, cache, meta.slot_mapping)
        o = self.backend.paged_attention(torch.cat([q_latent, q_pe], dim=-1), *self.attention_caches(kv_cache),
                                         meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale)
        out = torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2))  # [heads, T, v]
        return self.o_proj(out.transpose(0, 1).reshape(T, self.num_heads * self.v_dim))

    def attention_caches(self, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V that paged_attention reads: the latent's tensor, and its first kv_lora_rank dims, c
        (vLLM's kv_c_and_k_pe_cache and kv_c_cache)."""
        return kv_cache[0], kv_cache[0][..., :self.kv_lora_rank]

    def _rope_layout(self, x: torch.Tensor) -> torch.Tensor:
        """The rope dims as the backend's rotary turns them (halves), contiguous. DeepSeek stores them as
        pairs (x0, x1), (x2, x3), ...: the evens then the odds, as transformers' V3 reorders them (V2's
        complex product turns the same pairs; q and k move alike, so their dot products are the same)."""
        return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2) if self.rope_interleave else x.contiguous()


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend, tp: TPGroup, intermediate_size: int | None = None,
                 reduce_results: bool = True):
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size  # a shared expert's: a width of its own
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter] * 2, False, tp)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, tp, reduce_results)
        self.act_and_mul = getattr(backend, kernels.act_and_mul_name(cfg))  # Gemma's GELU-tanh, else SiLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers: down_proj(act(gate_proj(x)) * up_proj(x)), gate and up as one matmul
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class ReplicatedLinear(Linear):
    """A linear layer every rank holds whole (vLLM's name): the router, whose every expert's
    score each rank needs, and Qwen2-MoE's one-output shared-expert gate."""


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
               weights_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing as transformers' routers do it (vLLM's fused_topk): softmax over the experts in
    fp32, the top_k, renormalised to sum to 1 if asked, the weights in ``weights_dtype``.
    Returns (topk_weights [T, k], topk_ids [T, k])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights.to(weights_dtype), topk_ids


def grouped_topk(router_logits: torch.Tensor, e_score_correction_bias: torch.Tensor | None, top_k: int,
                 renormalize: bool, num_expert_group: int, topk_group: int, routed_scaling_factor: float,
                 scoring_func: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's grouped_topk, in fp32: GLM-4.5's and DeepSeek-V3's routing (transformers' Glm4MoeTopkRouter,
    DeepseekV3TopkRouter): sigmoid scores; the bias added to choose with (not to weigh by); each group
    scored by its best two; the top_k among the topk_group best groups' experts, weighted by their scores,
    renormalised if asked, times routed_scaling_factor. DeepSeek-V2's (DeepseekV2TopkRouter): softmax
    scores, no bias, each group scored by its best expert (one group: the plain top-k of all).
    Returns (topk_weights [T, k] fp32, topk_ids [T, k])."""
    scores = router_logits.float().softmax(-1) if scoring_func == "softmax" else router_logits.float().sigmoid()
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias
    T, E = choice.shape
    grouped = choice.view(T, num_expert_group, -1)
    group_scores = grouped.max(dim=-1).values if e_score_correction_bias is None else \
        grouped.topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    expert_mask = group_mask.unsqueeze(-1).expand(T, num_expert_group, E // num_expert_group).reshape(T, E)
    topk_ids = torch.topk(choice.masked_fill(~expert_mask.bool(), float("-inf")), k=top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids


class Fp32Router(nn.Module):
    """GLM-4.5's and DeepSeek's router: an fp32 weight scoring fp32 activations (transformers keeps it fp32 in a bf16
    model, as vLLM does), and the fp32 e_score_correction_bias grouped_topk chooses with. Not a
    ``Linear``: a backend that repacks the linear layers leaves it as it is."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = (nn.Parameter(torch.empty(num_experts, dtype=torch.float32))
                                        if correction_bias else None)  # DeepSeek-V2's router has none

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class FusedMoE(nn.Module):
    """A layer's experts as two 3-D weights (vLLM's FusedMoE): ``w13_weight [E, 2 * I, H]``,
    each expert's gate rows then its up rows, and ``w2_weight [E, H, I]``. Under tensor
    parallelism every rank holds every expert, its slice of each one's intermediate dim I (the
    gate and up rows, down's columns: Megatron's split of each expert's MLP), and one all-reduce
    sums the ranks' partial outputs, as RowParallelLinear's (``reduce_results`` False: the
    caller's). The backend's fused_moe runs them; a backend's prepare_model may replace the
    layer after loading (the CPU's, by one holding the weights packed or in fp32: cpu_backend.prepare_model).
    An int4/int8 checkpoint's experts served packed are ``w13_packed`` and ``w2_packed`` (WNA16Experts; the
    two weights then None), run by Triton's fused_moe under Triton's backend, its torch twin elsewhere
    (packed_kernels_are_triton), as WNA16Weight's."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, backend: Backend, tp: TPGroup,
                 reduce_results: bool = True):
        super().__init__()
        self.num_experts, self.full_intermediate_size = num_experts, intermediate_size
        self.intermediate_size = intermediate_size // tp.world_size  # this rank's
        deferred = _defer_linear_weights.get()  # as a Linear's: the stacks made when their tensors come
        where = "meta" if deferred else None
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_size, hidden_size,
                                                   device=where))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate_size, device=where))
        self.weight_device = torch.get_default_device() if deferred else None
        self.w13_packed: WNA16Experts | None = None
        self.w2_packed: WNA16Experts | None = None
        self.backend, self.tp = backend, (tp if reduce_results else tp.partial())

    @property
    def moe_kwargs(self) -> dict:
        """fused_moe's keywords for these experts: none (no biases, SiLU), as warm-up compiles them."""
        return {}

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.w13_packed is None:
            return self.tp.all_reduce(self.backend.fused_moe(x, self.w13_weight, self.w2_weight, topk_weights,
                                                             topk_ids))
        fused_moe = kernels.fused_moe_triton if packed_kernels_are_triton(self.backend) \
            else kernels.fused_moe_wna16_torch
        return self.tp.all_reduce(fused_moe(x, *self.packed_experts(), topk_weights, topk_ids))

    def packed_experts(self) -> tuple[kernels.PackedExperts, kernels.PackedExperts]:
        return self.w13_packed.packed(), self.w2_packed.packed()

    def fused_moe_weights(self) -> tuple:
        """(w13, w2) as fused_moe takes them: the stacks, or the packed experts."""
        return (self.w13_weight, self.w2_weight) if self.w13_packed is None else self.packed_experts()

    def num_shards(self, param: str) -> int:
        """The per-expert checkpoint tensors a weight is loaded from: w13 2 an expert (gate, up), w2 one."""
        return self.num_experts * (2 if param == "w13_weight" else 1)

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: int | None) -> None:
        """One expert's tensor as the hub stores it (shard ``2e + j`` of w13: expert e's gate, j 0,
        or up, j 1, [I, H]; shard ``e`` of w2: its down [H, I]), or, ``shard_id`` None, the whole
        stack as transformers 5 holds it (gate_up_proj [E, 2I, H], down_proj [E, H, I]): this
        rank's slice of I of each."""
        E, I, n = self.num_experts, self.full_intermediate_size, self.intermediate_size
        start = self.tp.rank * n
        if param is self.w2_weight or isinstance(param, _PackedExpertsDest) and param.experts is self.w2_packed:
            if shard_id is None:
                param.copy_(_read(loaded, (E, param.shape[1], I), 2, start, n))
            else:
                param[shard_id].copy_(_read(loaded, (param.shape[1], I), 1, start, n))
            return
        if shard_id is None:
            full = (E, 2 * I, param.shape[2])
            param[:, :n].copy_(_read(loaded, full, 1, start, n))
            param[:, n:].copy_(_read(loaded, full, 1, I + start, n))
        else:
            expert, half = divmod(shard_id, 2)
            param[expert, half * n:(half + 1) * n].copy_(_read(loaded, (I, param.shape[2]), 0, start, n))


class SparseMoeBlock(nn.Module):
    """A mixture-of-experts MLP (transformers' *SparseMoeBlock): the router ``gate`` scores
    the experts, each token runs its top-k (FusedMoE), their outputs weighted by the routing;
    a shared expert every token runs added (Qwen2-MoE's scaled by sigmoid(shared_expert_gate(x)),
    GraniteMoeShared's, GLM's and DeepSeek's not); GLM's and DeepSeek's routing is grouped_topk. Under
    tensor parallelism the experts' partial sums and the shared expert's are added before one
    all-reduce, as vLLM's: the gate is per token and every rank holds it whole, so scaling a rank's
    partial sum by it before the sum is exact."""

    def __init__(self, cfg: ModelConfig, backend: Backend, tp: TPGroup):
        super().__init__()
        self.grouped = cfg.fp32_router  # GLM-4.5's and DeepSeek's routing: grouped_topk
        self.gate = (Fp32Router(cfg.hidden_size, cfg.num_experts, cfg.scoring_func == "sigmoid") if self.grouped
                     else ReplicatedLinear(cfg.hidden_size, cfg.num_experts))
        self.grouping = (cfg.num_expert_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.scoring_func)
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, backend, tp,
                                reduce_results=False)
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router_weights_fp32 = cfg.router_weights_fp32
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = MLP(cfg, backend, tp, shared, reduce_results=False) if shared else None
        self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1) if shared and cfg.shared_expert_gate else None
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights_dtype = torch.float32 if self.router_weights_fp32 else x.dtype
        if self.grouped:
            topk_weights, topk_ids = grouped_topk(self.gate(x), self.gate.e_score_correction_bias, self.top_k,
                                                  self.renormalize, *self.grouping)
        else:
            topk_weights, topk_ids = fused_topk(self.gate(x), self.top_k, self.renormalize, weights_dtype)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return self.tp.all_reduce(out)


class GptOssExperts(nn.Module):
    """gpt-oss's experts, held as transformers' GptOssExperts holds them: ``gate_up_proj [E, H, 2I]`` (gate
    and up interleaved: columns 2j gate, 2j + 1 up), ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]``,
    ``down_proj_bias [E, H]``. The backend's fused_moe runs them (vLLM's gpt-oss: activation swigluoai, which
    reads gate and up interleaved, and the biases) on the weights read transposed (w13_weight, w2_weight:
    views in fused_moe's [E, 2I, H] and [E, H, I], no copy); a backend whose fused_moe takes no biases (the
    CPU's) leaves them to the reference, kernels.fused_moe_torch. Under tensor parallelism a rank holds its
    slice of each expert's I (a run of whole gate/up pairs, down's rows) and rank 0 the down bias (zeros
    elsewhere), so the caller's one all-reduce sums to the whole."""

    def __init__(self, cfg: ModelConfig, backend: Backend, tp: TPGroup):
        super().__init__()
        E, H = cfg.num_experts, cfg.hidden_size
        self.full_intermediate_size = cfg.moe_intermediate_size
        n = self.intermediate_size = cfg.moe_intermediate_size // tp.world_size  # this rank's
        self.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * n))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * n))
        self.down_proj = nn.Parameter(torch.empty(E, n, H))
        self.down_proj_bias = nn.Parameter(torch.empty(E, H))
        self.fused_moe = backend.fused_moe if backend.fused_moe_biases else kernels.fused_moe_torch
        self.activation, self.alpha, self.limit = cfg.moe_activation, cfg.swiglu_alpha, cfg.swiglu_limit
        self.tp = tp

    @property
    def w13_weight(self) -> torch.Tensor:
        return self.gate_up_proj.transpose(1, 2)

    @property
    def w2_weight(self) -> torch.Tensor:
        return self.down_proj.transpose(1, 2)

    @property
    def moe_kwargs(self) -> dict:
        """fused_moe's keywords for these experts (their forward's, and warm-up's)."""
        return dict(w13_bias=self.gate_up_proj_bias, w2_bias=self.down_proj_bias, activation=self.activation,
                    swiglu_alpha=self.alpha, swiglu_limit=self.limit)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, **self.moe_kwargs)

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: int) -> None:
        """This rank's slice of I of each expert, read an expert at a time (an MXFP4 checkpoint's are
        dequantized so: Mxfp4Slice)."""
        E, H, I, n = param.shape[0], self.down_proj.shape[2], self.full_intermediate_size, self.intermediate_size
        start = self.tp.rank * n
        if param is self.down_proj_bias:
            param.copy_(_read(loaded, param.shape) if self.tp.rank == 0 else torch.zeros_like(param))
        elif param is self.gate_up_proj_bias:
            param.copy_(_read(loaded, (E, 2 * I), 1, 2 * start, 2 * n))
        else:
            full = (E, H, 2 * I) if param is self.gate_up_proj else (E, I, H)
            dim, first, size = (2, 2 * start, 2 * n) if param is self.gate_up_proj else (1, start, n)
            if tuple(loaded.get_shape()) != full:
                raise _ShapeMismatch(tuple(loaded.get_shape()), full)
            index = [slice(None)] * 3
            for e in range(E):
                index[0], index[dim] = slice(e, e + 1), slice(first, first + size)
                param[e].copy_(loaded[tuple(index)][0])


class GptOssMoE(nn.Module):
    """gpt-oss's MLP (transformers' GptOssMLP): a router with a bias, the top-k of its logits, softmax over
    those k only (in the logits' dtype), then the experts (GptOssExperts) and one all-reduce."""

    def __init__(self, cfg: ModelConfig, backend: Backend, tp: TPGroup):
        super().__init__()
        self.router = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = GptOssExperts(cfg, backend, tp)
        self.top_k, self.tp = cfg.num_experts_per_tok, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, topk_ids = torch.topk(self.router(x), self.top_k, dim=-1)
        topk_weights = torch.softmax(top, dim=-1, dtype=top.dtype)
        return self.tp.all_reduce(self.experts(x, topk_weights, topk_ids))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding, backend: Backend, tp: TPGroup, index: int):
        super().__init__()
        self.self_attn = (MLAAttention(cfg, rotary_emb, backend, tp) if cfg.kv_lora_rank
                          else Attention(cfg, rotary_emb, backend, tp, cfg.layer_window(index)))
        self.mlp = (GptOssMoE(cfg, backend, tp) if cfg.architecture == GPT_OSS else
                    SparseMoeBlock(cfg, backend, tp) if index in cfg.moe_layers else MLP(cfg, backend, tp))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.residual_multiplier = cfg.residual_multiplier  # Granite's; 1.0 (no multiply) elsewhere

    def forward(self, positions, x, residual, kv_cache, meta):
        """transformers' h = x + attn(norm(x)); out = h + mlp(norm(h)), with the
        residual stream carried beside x so each add fuses into the next norm;
        ``residual`` is None before the first layer. Granite scales each branch's
        output by residual_multiplier before its add."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        return x, residual


class Glm4DecoderLayer(DecoderLayer):
    """GLM-4's layer: Llama's with a norm on each branch's output, transformers'
    h = x + post_self_attn_norm(attn(input_norm(x))); out = h + post_mlp_norm(mlp(post_attention_norm(h))),
    the residual stream carried beside x as in DecoderLayer."""

    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding, backend: Backend, tp: TPGroup, index: int):
        super().__init__(cfg, rotary_emb, backend, tp, index)
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)

    def forward(self, positions, x, residual, kv_cache, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_self_attn_layernorm(self.self_attn(positions, x, kv_cache, meta))
        x, residual = self.post_attention_layernorm(x, residual)
        return self.post_mlp_layernorm(self.mlp(x)), residual


class GemmaDecoderLayer(nn.Module):
    """Gemma 2 and 3's layer: a norm before and after both attention and the MLP, transformers'
    h = x + post_attn_norm(attn(input_norm(x))); out = h + post_ff_norm(mlp(pre_ff_norm(h))),
    the residual stream carried beside x as in DecoderLayer, each add fused into the next norm."""

    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding, backend: Backend, tp: TPGroup, index: int):
        super().__init__()
        self.self_attn = Attention(cfg, rotary_emb, backend, tp, cfg.layer_window(index))
        self.mlp = MLP(cfg, backend, tp)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)

    def forward(self, positions, x, residual, kv_cache, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, kv_cache, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Olmo2DecoderLayer(nn.Module):
    """OLMo 2's and 3's layer: no norm before attention or the MLP, one after each, on the branch's
    output before its residual add: h = x + post_attn_norm(attn(x)); out = h + post_ff_norm(mlp(h)).
    The stream comes in and goes out as DecoderLayer's (x, residual), their sum the hidden state,
    so that the model's final norm fuses the last add as it does for every layer."""

    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding, backend: Backend, tp: TPGroup, index: int):
        super().__init__()
        self.self_attn = Attention(cfg, rotary_emb, backend, tp, cfg.layer_window(index))
        self.mlp = MLP(cfg, backend, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)

    def forward(self, positions, x, residual, kv_cache, meta):
        h = x if residual is None else x + residual
        h = h + self.post_attention_layernorm(self.self_attn(positions, h, kv_cache, meta))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class DecoderModel(nn.Module):
    """The body shared by every supported architecture (HF's ``model.`` prefix)."""

    def __init__(self, cfg: ModelConfig, backend: Backend, tp: TPGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary_emb = RotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                          cfg.rope_scaling, backend)
        # Gemma 3's and OLMo 3's sliding-window layers rotate with a base (and scaling) of their own
        self.sliding_rotary_emb = None if cfg.sliding_rope is None else RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, *cfg.sliding_rope, backend)
        layer = (GemmaDecoderLayer if cfg.gemma else Olmo2DecoderLayer if cfg.architecture in OLMO2_ARCHITECTURES
                 else Glm4DecoderLayer if cfg.architecture == GLM4 else DecoderLayer)
        self.layers = nn.ModuleList(layer(cfg, self.layer_rotary_emb(cfg, i), backend, tp, i)
                                    for i in range(cfg.num_layers))
        self.norm = (GemmaRMSNorm if cfg.gemma else RMSNorm)(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.embedding_multiplier = cfg.embedding_multiplier  # Granite's; 1.0 elsewhere
        # Gemma scales the embeddings by sqrt(hidden_size), rounded to the model's dtype (build_model's
        # default dtype) as transformers rounds it
        self.register_buffer("normalizer", torch.tensor(cfg.hidden_size ** 0.5) if cfg.gemma else None,
                             persistent=False)

    def layer_rotary_emb(self, cfg: ModelConfig, index: int) -> RotaryEmbedding | None:
        if index in cfg.nope_layers:  # SmolLM3's NoPE layers: no rotary at all
            return None
        sliding = self.sliding_rotary_emb is not None and index in cfg.sliding_layers
        return self.sliding_rotary_emb if sliding else self.rotary_emb

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input for token ids (vLLM's name): their embeddings, Gemma's scaled."""
        x = self.embed_tokens(input_ids)
        return x if self.normalizer is None else x * self.normalizer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x, residual = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds, None
        if self.embedding_multiplier != 1.0:  # Granite: given embeddings too, as transformers and vLLM scale them
            x = x * self.embedding_multiplier
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        return self.norm(x, residual)[0]


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend, tp: TPGroup):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = DecoderModel(cfg, backend, tp)
        # None: tied to the embedding (a CPU backend may set a packed copy here)
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        # a classifier's head, whole on every rank and in fp32 (vLLM's pooling head_dtype)
        self.score = None if cfg.num_labels is None else nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False,
                                                                   dtype=torch.float32)
        self.lora_config: LoRAConfig | None = None  # wrap_lora_layers' (LoRASlots reads max_cpu_loras)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states of every token; logits are compute_logits' (only the rows that need them).
        ``inputs_embeds``: the first layer's input in the place of input_ids' embeddings."""
        return self.model(input_ids, positions, meta, kv_caches, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits in the model's dtype (the sampler takes fp32 copies where it needs
        them). Under tensor parallelism each rank computes its vocabulary rows and
        rank 0, where the sampler runs, gets them all (the others get None)."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        if self.config.logits_scaling != 1.0:  # Granite's, on the logits (a tied embedding stays as it is)
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma 2's, as transformers: in the logits' dtype
            logits = torch.tanh(logits / cap) * cap
        logits = self.tp.gather(logits)
        return None if logits is None else logits[:, :self.config.vocab_size].contiguous()  # padding off


# =========================================================================== encoder models
#
# BERT, RoBERTa and XLM-RoBERTa, as transformers writes them (vLLM's bert.py and roberta.py serve the
# same checkpoints): embeddings (word + absolute position + token type, then LayerNorm), post-norm
# layers of bidirectional attention and a GELU MLP. A prompt attends to all of itself, so the engine
# runs each one whole in one step and keeps no KV cache for them (vLLM's ENCODER_ONLY attention).
# The path is plain torch: a step's sequences, grouped by length, each group padded to its longest
# (at most twice a sequence's length) for one masked SDPA call.

ENCODER_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "swish": F.silu,
                       "gelu_new": functools.partial(F.gelu, approximate="tanh"),
                       "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


@dataclass(slots=True)
class EncoderGroup:
    """A step's sequences of similar length (the same power of two), padded to the longest for one SDPA call."""
    rows: torch.Tensor   # int64: their tokens' rows in the step
    slots: torch.Tensor  # int64: the same tokens' rows in the padded [num_seqs * width] layout
    mask: torch.Tensor   # bool [num_seqs, 1, 1, width]: the keys that are a sequence's own tokens
    num_seqs: int
    width: int


def encoder_groups(query_start_loc: list[int], device: torch.device) -> list[EncoderGroup]:
    """The step's sequences by length class: a padded group wastes at most half its rows, and no sequence
    attends to another's tokens (each is its own row of the batch)."""
    classes: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    for a, b in itertools.pairwise(query_start_loc):
        classes[(b - a - 1).bit_length()].append((a, b))
    groups = []
    for spans in classes.values():
        width = max(b - a for a, b in spans)
        rows = [r for a, b in spans for r in range(a, b)]
        slots = [i * width + j for i, (a, b) in enumerate(spans) for j in range(b - a)]
        mask = torch.arange(width)[None] < torch.tensor([b - a for a, b in spans])[:, None]
        groups.append(EncoderGroup(to_device(host_ints(rows), device), to_device(host_ints(slots), device),
                                   mask[:, None, None].to(device), len(spans), width))
    return groups


class EncoderEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.position_rows, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.position_offset = cfg.position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_types)
        return self.LayerNorm(x + self.position_embeddings(positions + self.position_offset))


class EncoderSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, groups: list[EncoderGroup]) -> torch.Tensor:
        """Each sequence's rows attend to all of its own rows, none of another's."""
        q, k, v = self.query(x), self.key(x), self.value(x)
        out = torch.empty_like(q)
        for g in groups:
            def padded(t: torch.Tensor) -> torch.Tensor:  # [num_seqs, heads, width, head_dim]
                rows = t.new_zeros(g.num_seqs * g.width, t.shape[1]).index_copy_(0, g.slots, t[g.rows])
                return rows.view(g.num_seqs, g.width, self.num_heads, self.head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=g.mask)
            out[g.rows] = o.transpose(1, 2).reshape(-1, x.shape[1])[g.slots]
        return out


class EncoderDenseNorm(nn.Module):
    """A sublayer's output projection, then LayerNorm of it plus the residual (BERT's post-norm)."""

    def __init__(self, cfg: ModelConfig, in_features: int):
        super().__init__()
        self.dense = nn.Linear(in_features, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class EncoderAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self = EncoderSelfAttention(cfg)
        self.output = EncoderDenseNorm(cfg, cfg.hidden_size)


class EncoderIntermediate(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = ENCODER_ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention = EncoderAttention(cfg)
        self.intermediate = EncoderIntermediate(cfg)
        self.output = EncoderDenseNorm(cfg, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, groups: list[EncoderGroup]) -> torch.Tensor:
        x = self.attention.output(self.attention.self(x, groups), x)
        return self.output(self.intermediate(x), x)


class EncoderStack(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))


class BertModel(nn.Module):
    """BertModel's (and RobertaModel's) tensors under transformers' names, without the "bert."/"roberta." prefix."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embeddings = EncoderEmbeddings(cfg)
        self.encoder = EncoderStack(cfg)

    @property
    def embed_tokens(self) -> nn.Embedding:  # what the engine reads the model's dtype and device from
        return self.embeddings.word_embeddings

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor,
                query_start_loc: list[int]) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, token_types)
        groups = encoder_groups(query_start_loc, x.device)
        for layer in self.encoder.layer:
            x = layer(x, groups)
        return x


class BertClassifierHead(nn.Module):
    """BertForSequenceClassification's head on the CLS row: the pooler (dense, tanh), then the classifier."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size, dtype=torch.float32)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels, dtype=torch.float32)

    def forward(self, cls: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler(cls)))

    def token_head(self, rows: torch.Tensor) -> torch.Tensor:
        """token_classify's: the classifier on each token's row, without the pooler (it is BERT's CLS pooling;
        vLLM's BertForSequenceClassification gives token_classify the classifier alone)."""
        return self.classifier(rows)


class RobertaClassifierHead(nn.Module):
    """RobertaForSequenceClassification's head on the CLS row: dense, tanh, out_proj."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, dtype=torch.float32)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.num_labels, dtype=torch.float32)

    def forward(self, cls: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(cls)))


# ModernBERT (vLLM's modernbert.py; gte-modernbert, modernbert-embed, gte-reranker-modernbert): pre-norm layers
# with rotary positions, every global_attn_every_n_layers-th layer global and the others local (a token sees
# those within local_attention // 2 of it, each side), a GeGLU MLP, no token types, a final norm.


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos and sin per row, [tokens, 1, head_dim], computed in fp32 (the halves' layout: rotate_half)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    freqs = positions.float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated by its rows' positions."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def local_masks(groups: list[EncoderGroup], window: int) -> list[torch.Tensor]:
    """Each group's mask for a local layer: its own keys within ``window`` of the query, either side. A padding
    row keeps its diagonal, so no row is all masked (its output is dropped)."""
    masks = []
    for g in groups:
        i = torch.arange(g.width, device=g.mask.device)
        band = (i[:, None] - i[None]).abs() <= window
        masks.append(g.mask & band | torch.eye(g.width, dtype=torch.bool, device=g.mask.device))
    return masks


class ModernBertEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, bias=cfg.modernbert.norm_bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.Wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.attention_bias)
        self.Wo = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[EncoderGroup],
                masks: list[torch.Tensor]) -> torch.Tensor:
        """Each sequence's rows attend to its own rows that ``masks`` (a group's) lets them."""
        q, k, v = self.Wqkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = x.new_empty(x.shape)
        for g, mask in zip(groups, masks):
            def padded(t: torch.Tensor) -> torch.Tensor:  # [num_seqs, heads, width, head_dim]
                rows = t.new_zeros(g.num_seqs * g.width, *t.shape[1:]).index_copy_(0, g.slots, t[g.rows])
                return rows.view(g.num_seqs, g.width, self.num_heads, self.head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=mask)
            out[g.rows] = o.transpose(1, 2).reshape(-1, x.shape[1])[g.slots]
        return self.Wo(out)


class ModernBertMLP(nn.Module):
    """GeGLU: Wi's first half through the activation, times its second half."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.Wi = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.modernbert.mlp_bias)
        self.Wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.modernbert.mlp_bias)
        self.act = ENCODER_ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(up) * gate)


class ModernBertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        # the first layer's input is the embeddings' norm already: it has no attn_norm
        norm = functools.partial(nn.LayerNorm, cfg.hidden_size, eps=cfg.rms_norm_eps, bias=cfg.modernbert.norm_bias)
        self.attn_norm = nn.Identity() if index == 0 else norm()
        self.attn = ModernBertAttention(cfg)
        self.mlp_norm = norm()
        self.mlp = ModernBertMLP(cfg)
        self.local = index in cfg.modernbert.local_layers

    def forward(self, x: torch.Tensor, rope: dict[bool, tuple[torch.Tensor, torch.Tensor]],
                groups: list[EncoderGroup], masks: dict[bool, list[torch.Tensor]]) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), *rope[self.local], groups, masks[self.local])
        return x + self.mlp(self.mlp_norm(x))


class ModernBertModel(nn.Module):
    """ModernBertModel's tensors under transformers' names, without a classifier's "model." prefix."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = ModernBertEmbeddings(cfg)
        self.layers = nn.ModuleList(ModernBertLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, bias=cfg.modernbert.norm_bias)

    @property
    def embed_tokens(self) -> nn.Embedding:  # what the engine reads the model's dtype and device from
        return self.embeddings.tok_embeddings

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor,
                query_start_loc: list[int]) -> torch.Tensor:
        """``token_types`` is read by no layer: ModernBERT has none (every row's is 0)."""
        cfg, mb = self.config, self.config.modernbert
        x = self.embeddings(input_ids)
        groups = encoder_groups(query_start_loc, x.device)
        # a group's positions are its rows' places in their sequences (prompts are computed whole, from 0)
        masks = {False: [g.mask for g in groups], True: local_masks(groups, mb.window) if mb.local_layers else []}
        rope = {local: tuple(t.to(x.dtype) for t in rotary_cos_sin(positions, cfg.head_dim, theta))
                for local, theta in ((False, cfg.rope_theta), (True, mb.local_rope_theta))}
        for layer in self.layers:
            x = layer(x, rope, groups, masks)
        return self.final_norm(x)


class ModernBertClassifierHead(nn.Module):
    """ModernBertForSequenceClassification's head on the pooled row (CLS or mean, its classifier_pooling):
    dense, activation, norm (transformers' ``head``), then the classifier. ModernBertForTokenClassification's
    is the same on every row."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        mb = cfg.modernbert
        self.token_wise = cfg.token_classifier
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=mb.classifier_bias, dtype=torch.float32)
        self.act = ENCODER_ACTIVATIONS[mb.classifier_activation]
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, bias=mb.norm_bias, dtype=torch.float32)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels, dtype=torch.float32)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.norm(self.act(self.dense(pooled))))

    def token_head(self, rows: torch.Tensor) -> torch.Tensor:
        """token_classify's: a token classifier's whole head on each row; a sequence classifier's classifier
        alone (vLLM's: its dense, activation and norm belong to the sequence pooling)."""
        return self(rows) if self.token_wise else self.classifier(rows)


# EmbeddingGemma: Gemma 3's layers (Gemma3TextModel with use_bidirectional_attention, as vLLM serves it: its
# attention ENCODER_ONLY), each prompt attending to all of itself on the full layers and, on the sliding ones, to
# the tokens within ``sliding_window`` of it on both sides. Plain torch, as transformers writes it.

class GemmaEncoderRMSNorm(nn.Module):
    """transformers' Gemma3RMSNorm: x / rms(x) * (1 + w) in fp32, rounded once to x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos and sin per row, [tokens, 1, head_dim] (rotate_half's layout), computed in fp32 with the
    config's scaling, then in ``dtype`` (transformers' order)."""
    freqs = positions.float()[:, None] * rope_inv_freq(head_dim, theta, scaling).to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    scale = rope_attention_factor(scaling)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


class GemmaEncoderAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.attention_scale
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = GemmaEncoderRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaEncoderRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[EncoderGroup],
                masks: list[torch.Tensor]) -> torch.Tensor:
        """Each sequence's rows attend to its own rows that ``masks`` (a group's) lets them; grouped-query heads
        share their key/value head."""
        q = self.q_norm(self.q_proj(x).view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        repeat = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = q.new_empty(q.shape)
        for g, mask in zip(groups, masks):
            def padded(t: torch.Tensor) -> torch.Tensor:  # [num_seqs, heads, width, head_dim]
                rows = t.new_zeros(g.num_seqs * g.width, *t.shape[1:]).index_copy_(0, g.slots, t[g.rows])
                return rows.view(g.num_seqs, g.width, *t.shape[1:]).transpose(1, 2)
            o = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=mask, scale=self.scale)
            out[g.rows] = o.transpose(1, 2).reshape(-1, *q.shape[1:])[g.slots]
        return self.o_proj(out.flatten(1))


class GemmaEncoderMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaEncoderLayer(nn.Module):
    """Gemma 3's layer: h = x + post_attn_norm(attn(input_norm(x))); out = h + post_ff_norm(mlp(pre_ff_norm(h)))."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.self_attn = GemmaEncoderAttention(cfg)
        self.mlp = GemmaEncoderMLP(cfg)
        norm = functools.partial(GemmaEncoderRMSNorm, cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.sliding = index in cfg.sliding_layers

    def forward(self, x: torch.Tensor, rope: dict[bool, tuple[torch.Tensor, torch.Tensor]],
                groups: list[EncoderGroup], masks: dict[bool, list[torch.Tensor]]) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), *rope[self.sliding], groups, masks[self.sliding])
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaEncoderModel(nn.Module):
    """Gemma3TextModel's tensors under transformers' names (embed_tokens, layers, norm)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaEncoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaEncoderRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor,
                query_start_loc: list[int]) -> torch.Tensor:
        """``token_types`` is read by no layer: Gemma has none."""
        cfg = self.config
        w = self.embed_tokens.weight
        x = self.embed_tokens(input_ids) * torch.tensor(cfg.hidden_size ** 0.5, dtype=w.dtype, device=w.device)
        groups = encoder_groups(query_start_loc, x.device)
        # prompts are computed whole, from position 0: a group's rows' places are their positions
        masks = {False: [g.mask for g in groups],
                 True: local_masks(groups, cfg.sliding_window) if cfg.sliding_layers else []}
        rope = {False: rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, x.dtype),
                True: rope_cos_sin(positions, cfg.head_dim, *cfg.sliding_rope, x.dtype)}
        for layer in self.layers:
            x = layer(x, rope, groups, masks)
        return self.norm(x)


class EncoderModel(nn.Module):
    """An encoder for the pooling runner, in CausalLM's shape: forward gives every token's final hidden
    state (the KV caches are not read), ``score`` a classifier's head in fp32 (vLLM's pooling head_dtype;
    None for an embedding model), and no logits."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.config, self.tp = cfg, tp
        self.model = ModernBertModel(cfg) if cfg.modernbert else GemmaEncoderModel(cfg) \
            if cfg.encoder_only == "gemma3" else BertModel(cfg)
        self.lm_head = None
        head = {"roberta": RobertaClassifierHead, "modernbert": ModernBertClassifierHead}.get(cfg.encoder_only,
                                                                                           BertClassifierHead)
        self.score = None if cfg.num_labels is None else head(cfg)
        if cfg.late_interaction:  # ColBERT's projection, the head every pooled row passes (fp32, as vLLM's)
            self.score = nn.Linear(cfg.hidden_size, cfg.colbert_dim, bias=False, dtype=torch.float32)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                inputs_embeds: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``token_type_ids``: each row's BERT token type (a cross-encoder pair's, from its tokenizer); None:
        every row is type 0."""
        if inputs_embeds is not None:
            raise ValueError("an encoder model takes token ids, not prompt embeddings")
        token_types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        return self.model(input_ids, positions, token_types, meta.query_start_loc.tolist())

    def compute_logits(self, hidden: torch.Tensor) -> None:
        return None


# the checkpoint's tensors this loader skips: MLM heads, BertModel's pooler (an embedding model's vectors are
# the last hidden states), and transformers' saved position_ids buffer
ENCODER_SKIPPED = re.compile(r"^(lm_head|cls)\.|(^|\.)position_ids$|^pooler\.")


def _modernbert_param_name(name: str, cfg: ModelConfig) -> str | None:
    """ModernBERT's: its layers under "model." in a classifier's checkpoint (or a ModernBertModel saved as a
    classifier's base), its classifier's ``head`` and ``classifier`` under ``score``; an MLM head is skipped."""
    name = name.removeprefix("model.")
    if cfg.num_labels is not None and name.startswith(("head.", "classifier.")):
        return "score." + name.removeprefix("head.")
    return None if name.startswith(("head.", "decoder.", "classifier.")) else "model." + name


# ColBERT's projection, wherever in the checkpoint (vLLM's suffixes): HF_ColBERT saves it as linear.weight
COLBERT_WEIGHTS = ("linear.weight", "colbert_linear.weight")


def _encoder_param_name(name: str, cfg: ModelConfig) -> str | None:
    """A checkpoint tensor's name here (None: not loaded): with or without transformers' "bert."/"roberta."
    prefix (sentence-transformers saves BertModel without it), a classifier's head (or ColBERT's projection)
    under ``score``."""
    if cfg.modernbert:
        return _modernbert_param_name(name, cfg)
    if cfg.encoder_only == "gemma3":  # Gemma3TextModel's names; a causal LM's "model." prefix and head too
        return None if name.startswith("lm_head.") else "model." + name.removeprefix("model.")
    if cfg.late_interaction and name.endswith(COLBERT_WEIGHTS):
        return "score.weight"
    prefix = "roberta." if cfg.encoder_only == "roberta" else "bert."
    name = name.removeprefix(prefix)
    if cfg.num_labels is not None:
        if cfg.encoder_only == "bert" and name.startswith("pooler.dense."):
            return "score.pooler." + name.removeprefix("pooler.dense.")
        if name.startswith("classifier."):  # BERT's one Linear; RoBERTa's dense and out_proj
            head = "score.classifier." if cfg.encoder_only == "bert" else "score."
            return head + name.removeprefix("classifier.")
    return None if ENCODER_SKIPPED.search(name) else "model." + name


def load_encoder_weights(model: EncoderModel, path: Path) -> int:
    """Every parameter from the checkpoint's safetensors, each exactly once, in the parameter's dtype."""
    from safetensors import safe_open
    params = dict(model.named_parameters())
    loaded = set()
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                target = _encoder_param_name(name, model.config)
                if target is None:
                    continue
                if target not in params:
                    raise ModelLoadError(f"{file.name}: unexpected tensor {name!r} for {model.config.architecture}")
                tensor, param = f.get_tensor(name), params[target]
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ModelLoadError(f"{file.name}: {name!r} has shape {tuple(tensor.shape)}, config.json "
                                         f"makes it {tuple(param.shape)}")
                param.data.copy_(tensor)
                loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelLoadError(f"{path}: the checkpoint lacks {len(missing)} tensor(s) of "
                             f"{model.config.architecture}, e.g. {missing[0]!r}")
    return sum(p.numel() * p.element_size() for p in params.values())


def colbert_projection_rows(cfg: ModelConfig, path: Path) -> int:
    """ColBERT's projection size: config.json's, else its checkpoint tensor's rows (vLLM infers it so). A
    checkpoint with two tensors of the projection's names is refused: vLLM keeps whichever it reads last."""
    from safetensors import safe_open
    found = []  # (file, name, shape) of each tensor named as the projection
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            found += [(file, n, f.get_slice(n).get_shape()) for n in f.keys() if n.endswith(COLBERT_WEIGHTS)]
    if not found:
        raise ModelLoadError(f"{path}: {cfg.architecture} needs its projection (a tensor named linear.weight) in "
                             f"the checkpoint's safetensors; sentence-transformers Dense folders are not read")
    if len(found) > 1:
        raise ModelLoadError(f"{path}: {cfg.architecture}'s checkpoint holds {found[0][1]!r} and {found[1][1]!r}, "
                             f"two projections where one is read: keep one")
    file, name, shape = found[0]
    if len(shape) != 2:
        raise ModelLoadError(f"{file.name}: {name!r} has shape {tuple(shape)}, not a projection's 2-D")
    return cfg.colbert_dim or shape[0]


@torch.no_grad()
def load_encoder_model(cfg: ModelConfig, path: Path, dtype: torch.dtype, device: torch.device,
                       tp: TPGroup) -> tuple[EncoderModel, int]:
    """An encoder's layers in ``dtype`` (its classifier head or ColBERT projection in fp32), on ``device``,
    then its weights."""
    if cfg.late_interaction:
        cfg = dataclasses.replace(cfg, colbert_dim=colbert_projection_rows(cfg, path))
    model = built_in(dtype, device, lambda: EncoderModel(cfg, tp))
    weight_bytes = load_encoder_weights(model, path)
    model.eval().requires_grad_(False)
    logger.info("[model] %s: %d layers, hidden %d, %d heads, %s pooling model on %s (plain torch, no KV cache), "
                "%.1f MiB weights", cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads,
                str(dtype).replace("torch.", ""), device, weight_bytes / 2**20)
    return model, weight_bytes


def select_backend(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, block_size: int,
                   enforce_eager: bool = False) -> Backend:
    """The one place the kernels are chosen, once per engine: Triton on CUDA where
    its probe runs (kernels.probe_triton); on the CPU the fastest that builds and
    checks out here (cpu_backend.py: C kernels, else torch.compile), unless
    enforce_eager (the references, bf16 weights still packed); else the torch
    references (which no CUDA graph can capture: capture_safe is False)."""
    if device.type == "cuda":
        try:
            if kernels.TRITON is None:
                raise ImportError("triton is not installed")
            kernels.probe_triton(cfg, dtype, device, block_size)
            return kernels.TRITON
        except Exception as e:  # noqa: BLE001 - Triton's compiler and launcher raise many kinds
            logger.warning("[kernels] Triton kernels unusable here (%s): torch references, no CUDA graphs",
                           first_line(e))
    if device.type == "cpu":
        from nanoserve.cpu_backend import build_cpu_backend  # platform code, off the reading path
        return build_cpu_backend(cfg, dtype, block_size, enforce_eager)
    return kernels.TORCH


def tune_process(device: torch.device, enabled: bool) -> list[str]:
    """Process-wide settings for faster CPU steps (THP, glibc malloc, oneDNN's caches), run before
    torch allocates anything; returns what was set. Nothing on a GPU or when not enabled."""
    if device.type != "cpu" or not enabled:
        return []
    from nanoserve import cpu_backend  # platform code, off the reading path
    return cpu_backend.tune_process()


def release_idle_memory(device: torch.device, enabled: bool) -> None:
    """Going idle after steps: on the CPU the heap glibc kept for them (tune_process) goes back."""
    if device.type == "cpu" and enabled:
        from nanoserve import cpu_backend  # platform code, off the reading path
        cpu_backend.trim_heap()


# =========================================================================== loading

# checkpoint name fragment -> (fused parameter fragment, shard index)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_FUSED_SHARDS = collections.Counter(fused for fused, _ in _FUSED.values())  # qkv_proj: 3, gate_up_proj: 2


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
    """Copy every checkpoint tensor into its (possibly fused) parameter, each
    layer's ``weight_loader`` reading only this rank's slice; returns this rank's
    weight bytes. Every parameter must be filled exactly once. An FP8 checkpoint's
    weights are read dequantized (Fp8Slice), their scales consumed with them; an int4/int8
    weight-only one's so too (PackedIntSlice), with their scales and zero points."""
    from safetensors import safe_open

    cfg = model.config
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    pending = _expected_shards(params, modules)
    files = checkpoint_files(path)
    fp8 = cfg.quantization if isinstance(cfg.quantization, Fp8Config) else None
    wna16 = cfg.quantization if isinstance(cfg.quantization, WNA16Config) else None
    scales = _fp8_scales(files, fp8) if fp8 else {}
    scale_names, dequantized, input_scales, kv_scales = set(scales), collections.Counter(), 0, 0
    kept_packed = 0
    # a deferred (packed) layer's first tensor, where it was unquantized: a quantized one after it is refused,
    # as one before it refuses it (_deferred_weight), so the checkpoint's tensor order does not decide
    unquantized_first: dict[str, str] = {}
    mxfp4_scales = _mxfp4_scale_files(files) if cfg.mxfp4 else {}
    companions = _Wna16Companions(files, wna16) if wna16 else None
    if wna16 and wna16.desc_act:
        _dequantize_act_order_experts(modules, params)
    head_rows: torch.Tensor | None = None  # the LM-head rows a score head is built from (classifier_from_token)
    head_name = "model.embed_tokens.weight" if cfg.lm_head_tied else "lm_head.weight"
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if _KV_CACHE_SCALE.search(name):
                    kv_scales += 1  # as vLLM's --kv-cache-dtype auto: the KV cache has the model's dtype
                    continue
                if name in scale_names or name in mxfp4_scales or (companions and name in companions.names):
                    continue  # read with its weight
                if cfg.quantization and name.endswith(_ACTIVATION_SCALES):
                    input_scales += 1  # a static activation scale: activations are not quantized here
                    continue
                loaded, stored = f.get_slice(name), name
                if loaded.get_dtype().startswith("F8_"):
                    loaded = _fp8_slice(name, loaded, scales, fp8, file)
                if name.endswith(MXFP4_BLOCKS) and cfg.mxfp4:
                    name, loaded = _mxfp4_slice(name, loaded, mxfp4_scales, file)
                if companions and companions.is_quantized(name, loaded):
                    name, loaded = _wna16_slice(name, loaded, companions.read, wna16, file)
                if name.startswith(_BASE_MODEL_PREFIXES):  # saved from the decoder alone (Qwen3Model), as vLLM's
                    name = "model." + name                   # pooling loader takes both layouts
                if name == head_name and cfg.classifier_token_ids:
                    head_rows = _token_rows(stored, loaded, cfg.classifier_token_ids, model.model.embed_tokens)
                target, shard = _target_param(name, cfg)
                if target is None:
                    continue
                if target not in params:
                    raise ModelLoadError(f"unexpected tensor {stored!r} in {file.name}")
                module = modules[target.rpartition(".")[0]]
                if isinstance(loaded, PackedIntSlice) and isinstance(module, VocabParallelEmbedding):
                    raise ModelLoadError(f"{wna16.method} tensor {stored!r} is a quantized embedding, which nanoserve "
                                         "(as vLLM) does not read: only linear layers and lm_head may be quantized")
                param = params[target]
                if param.is_meta:  # a Linear's weight or experts' stack deferred (served packed): packed codes,
                    # or allocated now
                    param = _deferred_weight(module, target.rpartition(".")[2], loaded, stored)
                    if not isinstance(param, (_PackedDest, _PackedExpertsDest)):
                        params[target] = param
                        unquantized_first[target] = stored
                elif isinstance(loaded, PackedIntSlice) and target in unquantized_first:
                    _refuse_mixed_packed_layer(stored, unquantized_first[target])
                if isinstance(param, (_PackedDest, _PackedExpertsDest)):
                    kept_packed += 1
                elif isinstance(loaded, (Fp8Slice, Mxfp4Slice, PackedIntSlice)):  # dequantized into the param's dtype
                    loaded.dtype = param.dtype
                    dequantized[loaded.dtype] += 1
                loader = getattr(module, "weight_loader", default_weight_loader)
                try:
                    loader(param, loaded, shard)
                except _ShapeMismatch as e:
                    held = " holds a weight of" if stored != name else " has"
                    raise ModelLoadError(f"tensor {stored!r}{held} shape {e.actual}, expected "
                                         f"{e.expected} from config.json") from None
                except _PackedLayoutMismatch as e:
                    raise ModelLoadError(f"tensor {stored!r}: {e}") from None
                pending -= ({(target, s) for s in range(_num_shards(target, modules))} if shard is None
                            else {(target, shard)})
    if cfg.classifier_token_ids:
        _build_score_from_rows(model, head_rows, head_name)
        pending.discard(("score.weight", 0))
    if companions:
        companions.check_all_read()
    if scales:  # a scale whose weight is not in the checkpoint (or is not fp8)
        raise ModelLoadError(f"unexpected tensor {next(iter(scales))!r}: a scale with no fp8 weight beside it")
    if pending:
        missing = _describe_missing(pending, modules)
        raise ModelLoadError(f"checkpoint is missing weights for {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))
    if fp8:
        _log_fp8(fp8, dequantized, input_scales)
    if wna16:
        _log_wna16(wna16, dequantized, kept_packed)
    if kv_scales:
        logger.info("[model] %d fp8 KV-cache scales (k_scale, v_scale ...) not applied: the KV cache holds the "
                    "model's dtype, as vLLM's with --kv-cache-dtype auto", kv_scales)
    if cfg.mxfp4:
        dtype = str(next(iter(dequantized), torch.float32)).replace("torch.", "")
        logger.info("[model] MXFP4 checkpoint: %d expert weights dequantized to %s as they were loaded (held "
                    "dequantized: the memory is the %s model's, about 4x the checkpoint's experts)",
                    sum(dequantized.values()), dtype, dtype)
    packed = [m.wna16 for m in modules.values() if isinstance(m, Linear) and m.wna16 is not None]
    for m in modules.values():
        if isinstance(m, Linear) and m.wna16 is not None:
            m.weight = None  # the meta placeholder: the packed codes stand for it
    packed += _packed_experts_loaded(modules)
    return sum(p.numel() * p.element_size() for p in params.values() if not p.is_meta) \
        + sum(b.numel() * b.element_size() for m in packed for b in m.buffers())


def _packed_experts_loaded(modules: dict[str, nn.Module]) -> list[nn.Module]:
    """Each FusedMoE whose experts were kept packed loses its meta stacks; returns their WNA16Experts. Both
    stacks packed or neither: the packed fused_moe reads both."""
    packed = []
    for name, m in modules.items():
        if not isinstance(m, FusedMoE) or (m.w13_packed is None and m.w2_packed is None):
            continue
        if m.w13_packed is None or m.w2_packed is None:
            held, other = ("w13", "w2") if m.w13_packed is not None else ("w2", "w13")
            raise ModelLoadError(f"{name}: its experts' {held} weights are kept packed and their {other} weights "
                                 "not (unquantized, or act-order), which one packed fused_moe cannot run; serve "
                                 "it with wna16_weights='dequantized'")
        m.w13_weight = m.w2_weight = None
        packed += [m.w13_packed, m.w2_packed]
    return packed


def _token_rows(name: str, loaded, token_ids: tuple[int, ...], embedding: nn.Module) -> torch.Tensor:
    """The LM head's rows of ``token_ids`` (whole, whatever this rank's shard), in the model's dtype as
    vLLM's ParallelLMHead holds them."""
    if isinstance(loaded, (PackedIntSlice, Mxfp4Slice)):
        raise ModelLoadError(f"classifier_from_token: {name} is quantized ({type(loaded).__name__}), and a score "
                             f"head is built only from an unquantized (or FP8) LM head here")
    rows = loaded.get_shape()[0]
    if bad := [t for t in token_ids if t >= rows]:
        raise ModelLoadError(f"classifier_from_token: token id {bad[0]} is past {name}'s {rows} rows")
    dtype = embedding.weight.dtype
    if isinstance(loaded, Fp8Slice):
        loaded.dtype = dtype
    return torch.cat([loaded[(slice(t, t + 1), slice(None))].to(dtype) for t in token_ids])


def _build_score_from_rows(model: CausalLM, rows: torch.Tensor | None, head_name: str) -> None:
    """vLLM's SEQ_CLS_LOAD_METHODS: the fp32 score head from the LM head's rows of classifier_from_token,
    the difference true - false (from_2_way_softmax: one label) or the rows themselves (no_post_processing)."""
    cfg = model.config
    if rows is None:
        raise ModelLoadError(f"classifier_from_token: the checkpoint has no {head_name} to build the score head "
                             f"from (config.json's tie_word_embeddings is {cfg.lm_head_tied})")
    rows = rows.float()
    weight = rows[1:2] - rows[0:1] if cfg.seq_cls_method == "from_2_way_softmax" else rows
    with torch.no_grad():
        model.score.weight.copy_(weight)
    logger.info("[model] score head (%s) built from %s's rows of %s", cfg.seq_cls_method, head_name,
                ", ".join(repr(t) for t in cfg.classifier_from_token))


# =========================================================================== FP8 checkpoints
# Served as vLLM's "fp8" checkpoints, but dequantized at load: each fp8 weight times its scales
# becomes a weight of the model's dtype, so every kernel, backend, TP split and LoRA path serves
# it as it serves an unquantized model. The price: the memory of the bf16 model (about 2x the
# checkpoint), and outputs that are the dequantized weights' (vLLM on a GPU with FP8 support
# also quantizes the activations, per token: its tokens may differ slightly).

# vLLM's fp8 KV-cache scales (k_proj.k_scale, self_attn.kv_scale, attn.q_scale ...), and a static
# activation scheme's per-tensor input scales (vLLM's input_scale, transformers' activation_scale)
_KV_CACHE_SCALE = re.compile(r"\.(k|v|kv|q|prob)_scale$")
_ACTIVATION_SCALES = (".input_scale", ".activation_scale", "_activation_scale")


def _fp8_scales(files: list[Path], quant: Fp8Config) -> dict[str, torch.Tensor]:
    """Every weight scale of the checkpoint (``...weight_scale_inv``, or per tensor ``...weight_scale``),
    by name: a scale may sit in another shard file than its weight. Small (one number a 128x128 block)."""
    from safetensors import safe_open

    scales = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(quant.scale_suffix) and not _KV_CACHE_SCALE.search(name) \
                        and not name.endswith(_ACTIVATION_SCALES):
                    scales[name] = f.get_tensor(name)
    return scales


def _fp8_slice(name: str, loaded, scales: dict[str, torch.Tensor], quant: Fp8Config | None,
               file: Path) -> "Fp8Slice":
    """An fp8 checkpoint tensor with its scale (taken out of ``scales``), read dequantized."""
    if quant is None:
        raise ModelLoadError(f"tensor {name!r} in {file.name} is {loaded.get_dtype()}, but config.json has no "
                             "quantization_config to say how it is scaled")
    scale_name = name + quant.scale_suffix
    if scale_name not in scales:
        raise ModelLoadError(f"fp8 tensor {name!r} in {file.name} has no scale {scale_name!r} beside it")
    return Fp8Slice(name, loaded, scale_name, scales.pop(scale_name), quant.weight_block_size)


class Fp8Slice:
    """An fp8 checkpoint tensor read as its dequantized values, in ``dtype``: what a layer's
    ``weight_loader`` takes in place of safetensors' slice (``get_shape``, and ``[key]``, which reads
    only the rows or columns asked for). The slice is cut first, then each element multiplied by its
    own block's scale, so a tensor-parallel rank's shard, even one that cuts through a block, holds
    exactly its rows of the whole dequantized weight. Dequantized at most 256 rows at a time: no fp32
    copy of a whole tensor. A weight of more than two dims (a stack of experts) has one grid of
    blocks per matrix, its scale the same leading dims."""
    ROWS_AT_A_TIME = 256

    def __init__(self, name: str, loaded, scale_name: str, scale: torch.Tensor,
                 block: tuple[int, int] | None, dtype: torch.dtype = torch.float32):
        self.loaded, self.dtype, self.shape = loaded, dtype, tuple(loaded.get_shape())
        if len(self.shape) < 2:
            raise ModelLoadError(f"fp8 tensor {name!r} has shape {self.shape}: a quantized weight is a matrix")
        if scale.dtype == torch.uint8:  # ue8m0 scales stored as bytes: each a power of two's exponent
            scale = scale.view(torch.float8_e8m0fnu)
        lead, (rows, cols) = self.shape[:-2], self.shape[-2:]
        if block is None:  # per tensor: one block the whole matrix
            if scale.numel() != 1:
                raise ModelLoadError(f"tensor {scale_name!r} has shape {tuple(scale.shape)}, expected one "
                                     "per-tensor scale (no weight_block_size in quantization_config)")
            block, scale = (rows, cols), scale.reshape((1,) * len(self.shape)).expand(*lead, 1, 1)
        grid = (*lead, -(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale.shape) != grid:
            raise ModelLoadError(f"tensor {scale_name!r} has shape {tuple(scale.shape)}, expected {grid}: "
                                 f"{name!r} {self.shape} in blocks of {block[0]}x{block[1]}")
        self.scale, self.block = scale, block

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.loaded.get_dtype()

    def __getitem__(self, key: tuple[slice, ...]) -> torch.Tensor:
        key = tuple(key) + (slice(None),) * (len(self.shape) - len(key))
        (r0, r1), (c0, c1) = (key[d].indices(self.shape[d])[:2] for d in (-2, -1))
        bm, bn = self.block
        q = self.loaded[key]
        scale = self.scale[key[:-2]].float()  # [..., block rows, block cols] of the leading dims asked for
        out = torch.empty(q.shape, dtype=self.dtype)
        a = r0
        while a < r1:  # a chunk of rows within one block row
            b = min(r1, (a // bm + 1) * bm, a + self.ROWS_AT_A_TIME)
            row_scale = scale[..., a // bm, c0 // bn:-(-c1 // bn)].repeat_interleave(bn, -1)
            row_scale = row_scale[..., c0 % bn:c0 % bn + (c1 - c0)]
            out[..., a - r0:b - r0, :] = q[..., a - r0:b - r0, :].float() * row_scale.unsqueeze(-2)
            a = b
        return out


# =========================================================================== MXFP4 checkpoints
# gpt-oss's hub checkpoints (quant_method "mxfp4"): each expert weight W [E, in, out] (transformers' layout)
# stored as ``<name>_blocks`` uint8 [E, out, in / 32, 16], two fp4 (e2m1) values a byte, the low nibble first,
# and ``<name>_scales`` uint8 [E, out, in / 32], one power of two a group of 32 (e8m0: 2 ** (byte - 127)):
# transformers' integrations/mxfp4.py (convert_moe_packed_tensors). Dequantized at load, as FP8 is.
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _mxfp4_scale_files(files: list[Path]) -> dict[str, Path]:
    """Every ``..._scales`` tensor's file, by name (a scale may sit in another shard than its blocks)."""
    from safetensors import safe_open

    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            out.update({name: file for name in f.keys() if name.endswith(MXFP4_SCALES)})
    return out


def _mxfp4_slice(name: str, loaded, scale_files: dict[str, Path], file: Path) -> tuple[str, "Mxfp4Slice"]:
    """``<name>_blocks`` and its scales -> (``<name>``, the weight read dequantized)."""
    from safetensors import safe_open

    base = name[:-len(MXFP4_BLOCKS)]
    scale_file = scale_files.get(base + MXFP4_SCALES)
    if scale_file is None:
        raise ModelLoadError(f"MXFP4 tensor {name!r} in {file.name} has no scales {base + MXFP4_SCALES!r} beside it")
    with safe_open(str(scale_file), framework="pt") as f:
        scales = f.get_tensor(base + MXFP4_SCALES)
    shape = tuple(loaded.get_shape())
    if len(shape) != 4 or shape[-1] != 16 or tuple(scales.shape) != shape[:-1]:
        raise ModelLoadError(f"MXFP4 tensor {name!r} has shape {shape} and its scales {tuple(scales.shape)}: expected "
                             "[experts, out, in / 32, 16] and [experts, out, in / 32]")
    return base, Mxfp4Slice(loaded, scales)


class Mxfp4Slice:
    """An MXFP4 expert stack read as its dequantized weight [E, in, out] (what the unquantized checkpoint
    holds), in ``dtype``: ``get_shape`` and ``[key]``, which dequantizes only the experts the key asks for."""

    def __init__(self, blocks, scales: torch.Tensor, dtype: torch.dtype = torch.float32):
        self.blocks, self.scales, self.dtype = blocks, scales, dtype
        E, out, groups, _ = blocks.get_shape()
        self.shape = (E, groups * 32, out)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return "MXFP4"

    def __getitem__(self, key: tuple[slice, ...]) -> torch.Tensor:
        key = tuple(key) + (slice(None),) * (3 - len(key))
        blocks = self.blocks[key[0]].to(torch.int64)                      # [e, out, groups, 16]
        values = torch.tensor(FP4_E2M1)[torch.stack([blocks & 0xF, blocks >> 4], -1)]  # [e, out, groups, 16, 2]
        exponents = self.scales[key[0]].to(torch.int32) - 127             # [e, out, groups]
        w = torch.ldexp(values.flatten(-2), exponents[..., None]).flatten(-2)  # [e, out, in]
        return w.transpose(1, 2)[(slice(None), *key[1:])].to(self.dtype)


# =========================================================================== int4 / int8 weight-only checkpoints
# GPTQ, AWQ and compressed-tensors' W4A16 / W8A16 (WNA16Config), dequantized at load as FP8 is: the memory is
# the bf16 model's (about 4x an int4 checkpoint's weights), the outputs the dequantized weights' (vLLM computes
# with the packed codes in its mixed-precision kernels, so its tokens may differ slightly). The layouts, a
# weight W [out, in] quantized in groups along `in` (as vLLM's gptq / awq / compressed_tensors wNa16 read them):
#   GPTQ   qweight [in / p, out] int32, input rows j * p + i in bits [i * b, (i + 1) * b) of word row j (p = 32 / b);
#          scales [groups, out]; qzeros [groups, out / p] packed likewise along out; g_idx [in] each input's
#          group (act-order). Symmetric: z = 2 ** (b - 1) (vLLM ignores qzeros); else the stored zero, plus one
#          in the v1 format ("gptq": AutoGPTQ saved zeros minus one), as is in "gptq_v2".
#   AWQ    qweight [in, out / 8] int32 packed along out in the order [0, 2, 4, 6, 1, 3, 5, 7] (field i holds
#          column ORDER[i] of its 8); qzeros [groups, out / 8] the same; scales [groups, out].
#   compressed-tensors  weight_packed [out, ceil(in * b / 32)] int32 along in, each code offset by 2 ** (b - 1);
#          weight_scale [out, groups]; weight_zero_point (asymmetric) [ceil(out * b / 32), groups] packed along
#          out, offset likewise; weight_shape [out, in]; naive/int-quantized: weight int8 [out, in], signed.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Each int32 of ``words`` split into its 32 / bits codes along ``dim`` (word j -> codes j * p .. j * p + p - 1,
    code i its bits [i * bits, (i + 1) * bits)), as unsigned integers (int32)."""
    dim = dim % words.dim()
    shifts = torch.arange(0, 32, bits, dtype=torch.int32).view(-1, *([1] * (words.dim() - dim - 1)))
    return ((words.unsqueeze(dim + 1) >> shifts) & ((1 << bits) - 1)).flatten(dim, dim + 1)


class PackedIntSlice:
    """A weight-only int4/int8 weight read as its dequantized [out, in] matrix, in ``dtype``: what a layer's
    ``weight_loader`` takes in place of safetensors' slice (``get_shape``; ``[key]`` reads only the codes of
    the rows and columns asked for, so a tensor-parallel rank's shard is its rows of the whole dequantized
    weight). ``codes(r0, r1, c0, c1)`` reads the unsigned codes of that window; ``scale`` and ``zero`` are
    [out, groups] (fp32), ``group_of`` each input column's group. Dequantized ROWS_AT_A_TIME output rows at a
    time, in fp32, then rounded once to ``dtype``."""
    ROWS_AT_A_TIME = 256

    def __init__(self, codes: Callable[[int, int, int, int], torch.Tensor], shape: tuple[int, int], bits: int,
                 scale: torch.Tensor, zero: torch.Tensor, group_of: torch.Tensor, dtype: torch.dtype = torch.float32,
                 group_size: int = -1):
        self.codes, self.shape, self.bits, self.dtype = codes, shape, bits, dtype
        self.scale, self.zero, self.group_of, self.group_size = scale, zero, group_of, group_size
        self.packed = False  # set for a weight served packed: ``[key]`` is then a PackedWindow, nothing dequantized

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return f"INT{self.bits}"

    def __getitem__(self, key: tuple[slice, ...]) -> torch.Tensor:
        key = tuple(key) + (slice(None),) * (2 - len(key))
        (r0, r1), (c0, c1) = (key[d].indices(self.shape[d])[:2] for d in (0, 1))
        r1, c1 = max(r0, r1), max(c0, c1)
        if self.packed:
            return self.window(r0, r1, c0, c1)
        out = torch.empty(r1 - r0, c1 - c0, dtype=self.dtype)
        groups = self.group_of[c0:c1]
        for a in range(r0, r1, self.ROWS_AT_A_TIME):
            b = min(r1, a + self.ROWS_AT_A_TIME)
            q = self.codes(a, b, c0, c1).float()
            out[a - r0:b - r0] = (q - self.zero[a:b][:, groups]) * self.scale[a:b][:, groups]
        return out

    def window(self, r0: int, r1: int, c0: int, c1: int) -> PackedWindow:
        """Rows [r0, r1) and columns [c0, c1) as codes, with the scales and zero points of the groups they
        fall in (renumbered from 0) and where those groups start (WNA16Weight's layout)."""
        groups = self.group_of[c0:c1]
        lo, hi = (int(groups.min()), int(groups.max()) + 1) if c1 > c0 else (0, 1)
        groups = groups - lo
        if self.group_size == -1:
            group_size, k_off, g_idx = max(c1 - c0, 1), 0, None
        elif torch.equal(groups, (torch.arange(c1 - c0) + c0 % self.group_size) // self.group_size):
            group_size, k_off, g_idx = self.group_size, c0 % self.group_size, None
        else:  # act-order: each column's group given
            group_size, k_off, g_idx = 1, 0, groups.to(torch.int32)
        return PackedWindow(lambda a, b: self.codes(a, b, c0, c1), r0, r1, c1 - c0, self.scale[r0:r1, lo:hi],
                            self.zero[r0:r1, lo:hi], group_size, k_off, g_idx)


@dataclass(frozen=True, slots=True)
class PackedWindow:
    """Output rows [r0, r1) of a quantized weight, ``cols`` input columns wide, still as codes: what a
    Linear's weight_loader copies into a WNA16Weight. ``codes(a, b)`` reads rows [a, b) of them; ``scale``
    and ``zero`` [rows, groups] (fp32) are the window's groups, the group of column k being g_idx[k] or
    (k + k_off) // group_size."""
    codes: Callable[[int, int], torch.Tensor]
    r0: int
    r1: int
    cols: int
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int
    k_off: int
    g_idx: torch.Tensor | None

    def same_groups(self, other: "WNA16Weight") -> bool:
        return (self.scale.shape[1], self.group_size, self.k_off) == (other.scales.shape[0], other.group_size,
                                                                       other.k_off) \
            and (self.g_idx is None) == (other.g_idx is None) \
            and (self.g_idx is None or torch.equal(self.g_idx, other.g_idx.cpu()))


def _pack_along_k(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [K, n] -> int32 [ceil(K / p), n]: code k in bits [(k % p) * bits, ...) of word k // p."""
    p = 32 // bits
    c = F.pad(codes.to(torch.int64), (0, 0, 0, -codes.shape[0] % p))
    words = sum(c[i::p] << (bits * i) for i in range(p))
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


class _PackedLayoutMismatch(Exception):
    pass


class WNA16Weight(nn.Module):
    """A Linear's int4/int8 weight kept packed, in the layout kernels.wna16_unpack reads (qweight, scales,
    zeros, and g_idx for act-order), the logical weight [out, in]; forward is x @ its transpose: Triton's
    wna16_matmul where the engine's backend is Triton's (``triton``), the torch twin elsewhere. Filled by the layer's weight_loader a window of output
    rows at a time (write); the scales and groups are sized by the first window, which every other one
    (q, k and v's; gate and up's) must match."""
    ROWS_AT_A_TIME = 1024  # codes unpacked at load this many output rows at a time (a bounded host copy)

    def __init__(self, bits: int, out_features: int, in_features: int, device: torch.device):
        super().__init__()
        self.bits, self.out_features, self.in_features = bits, out_features, in_features
        self.group_size, self.k_off = max(in_features, 1), 0
        self.triton = False  # Triton's kernel, not the twin: set by load_model (packed_kernels_are_triton)
        self.register_buffer("qweight", torch.zeros(-(-in_features // (32 // bits)), out_features, dtype=torch.int32,
                                                    device=device))
        for name in ("scales", "zeros", "g_idx"):
            self.register_buffer(name, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        matmul = kernels.wna16_matmul_triton if self.triton else kernels.wna16_matmul_torch
        y = matmul(x.reshape(-1, self.in_features), self.qweight, self.scales, self.zeros, self.g_idx, self.bits,
                   self.group_size, self.k_off)
        return y.view(*x.shape[:-1], self.out_features)

    def write(self, n0: int, n1: int, w: PackedWindow) -> None:
        """Output rows [n0, n1) from the window ``w`` of a checkpoint tensor."""
        if self.scales is None:
            self._allocate(w)
        elif not w.same_groups(self):
            raise _PackedLayoutMismatch("its input columns fall in other groups than its layer's other quantized "
                                        "slices (act-order: another g_idx), which one packed layer cannot hold; "
                                        "serve it with wna16_weights='dequantized'")
        if _needs_fp32(self.scales, w):
            self.scales = self.scales.float()
        _write_window(self.qweight, self.scales, self.zeros, n0, w, self.bits)

    def _allocate(self, w: PackedWindow) -> None:
        self.scales, self.zeros = _scales_and_zeros(w, (w.scale.shape[1], self.out_features), self.bits,
                                                    self.qweight.device)
        self.group_size, self.k_off = w.group_size, w.k_off
        self.g_idx = None if w.g_idx is None else w.g_idx.to(self.qweight.device)

    def zero_(self, n0: int, n1: int) -> None:
        """Rows [n0, n1) all zero (an LM head's padding rows)."""
        self.qweight[:, n0:n1] = 0
        if self.scales is not None:
            self.scales[:, n0:n1] = 0


def _scales_and_zeros(w: PackedWindow, shape: tuple[int, ...], bits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero scales (fp16 where the first window's are exact in it: the checkpoint's, as they were; else fp32)
    and zero points (uint8 for int4, int16 for int8: GPTQ v1's 8-bit zero may be 256) of ``shape``."""
    exact16 = torch.equal(w.scale.half().float(), w.scale)
    return (torch.zeros(shape, dtype=torch.float16 if exact16 else torch.float32, device=device),
            torch.zeros(shape, dtype=torch.uint8 if bits == 4 else torch.int16, device=device))


def _needs_fp32(scales: torch.Tensor, w: PackedWindow) -> bool:
    """Whether a window's scales are not exact in the fp16 ``scales`` held so far."""
    return scales.dtype != torch.float32 and not torch.equal(w.scale.to(scales.dtype).float(), w.scale)


def _write_window(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, n0: int, w: PackedWindow,
                  bits: int) -> None:
    """Output columns [n0, n0 + rows of w) of one packed weight (qweight [words, N], scales and zeros [G, N])
    from the window ``w``, its codes unpacked and repacked WNA16Weight.ROWS_AT_A_TIME rows at a time."""
    n1, step = n0 + w.r1 - w.r0, WNA16Weight.ROWS_AT_A_TIME
    for a in range(w.r0, w.r1, step):
        b = min(w.r1, a + step)
        qweight[:, n0 + a - w.r0:n0 + b - w.r0] = _pack_along_k(w.codes(a, b).T, bits).to(qweight.device)
    scales[:, n0:n1] = w.scale.T.to(scales.device, scales.dtype)
    zeros[:, n0:n1] = w.zero.T.to(zeros.device, zeros.dtype)


class WNA16Experts(nn.Module):
    """One projection of a FusedMoE's experts kept packed (w13: [2I, H] each, w2: [H, I]): WNA16Weight's
    layout stacked over the experts (qweight [E, words, N], scales and zeros [E, G, N]), every expert's input
    rows in the same groups (its ``group_size`` and ``k_off``); no act-order, as vLLM's fused MoE. Filled an
    expert's window of output rows at a time (write); ``packed()`` is what kernels' fused_moe reads."""

    def __init__(self, bits: int, num_experts: int, out_features: int, in_features: int, device: torch.device):
        super().__init__()
        self.bits, self.in_features = bits, in_features
        self.group_size, self.k_off = max(in_features, 1), 0
        self.register_buffer("qweight", torch.zeros(num_experts, -(-in_features // (32 // bits)), out_features,
                                                    dtype=torch.int32, device=device))
        self.register_buffer("scales", None)
        self.register_buffer("zeros", None)

    def write(self, expert: int, n0: int, n1: int, w: PackedWindow) -> None:
        """Expert ``expert``'s output rows [n0, n1) from the window ``w`` of its checkpoint tensor."""
        if w.g_idx is not None:
            raise _PackedLayoutMismatch("its input columns are in act-order groups (g_idx), which the packed "
                                        "fused_moe does not read (nor vLLM's); serve it with "
                                        "wna16_weights='dequantized'")
        E, _, N = self.qweight.shape
        if self.scales is None:
            self.scales, self.zeros = _scales_and_zeros(w, (E, w.scale.shape[1], N), self.bits, self.qweight.device)
            self.group_size, self.k_off = w.group_size, w.k_off
        elif (w.scale.shape[1], w.group_size, w.k_off) != (self.scales.shape[1], self.group_size, self.k_off):
            raise _PackedLayoutMismatch("its input columns fall in other groups than its layer's other experts'")
        if _needs_fp32(self.scales, w):
            self.scales = self.scales.float()
        _write_window(self.qweight[expert], self.scales[expert], self.zeros[expert], n0, w, self.bits)

    def packed(self) -> kernels.PackedExperts:
        return kernels.PackedExperts(self.qweight, self.scales, self.zeros, self.bits, self.group_size, self.k_off,
                                     self.in_features)


@dataclass(frozen=True, slots=True)
class _ExpertSlot:
    """One expert of a WNA16Experts, as a _PackedDest's ``weight``."""
    experts: WNA16Experts
    expert: int

    @property
    def in_features(self) -> int:
        return self.experts.in_features

    def write(self, n0: int, n1: int, w: PackedWindow) -> None:
        self.experts.write(self.expert, n0, n1, w)


@dataclass(frozen=True, slots=True)
class _PackedExpertsDest:
    """What FusedMoE's weight_loader copies a quantized expert's tensor into in place of its stack: ``[e]``
    (an expert's whole weight) and ``[e, rows]`` (w13's gate or up rows) as _PackedDest's; ``shape`` the
    stack's [E, N, K]."""
    experts: WNA16Experts
    shape: tuple[int, int, int]

    def __getitem__(self, key) -> "_PackedDest":
        expert, rows = key if isinstance(key, tuple) else (key, slice(None))
        return _PackedDest(_ExpertSlot(self.experts, expert), 0, self.shape[1])[rows]


@dataclass(frozen=True, slots=True)
class _PackedDest:
    """What a Linear's weight_loader copies a quantized tensor into in place of its weight: output rows
    [n0, n1) of its WNA16Weight, with the few tensor methods the loaders call (shape, narrow, [rows],
    copy_ of a PackedWindow, zero_)."""
    weight: WNA16Weight
    n0: int
    n1: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.n1 - self.n0, self.weight.in_features

    def narrow(self, dim: int, start: int, size: int) -> "_PackedDest":
        assert dim == 0, "a packed weight is cut by output rows only"
        return _PackedDest(self.weight, self.n0 + start, self.n0 + start + size)

    def __getitem__(self, rows: slice) -> "_PackedDest":
        start, stop, _ = rows.indices(self.n1 - self.n0)
        return self.narrow(0, start, max(0, stop - start))

    def copy_(self, window: PackedWindow) -> None:
        self.weight.write(self.n0, self.n1, window)

    def zero_(self) -> None:
        self.weight.zero_(self.n0, self.n1)


def _deferred_weight(module: nn.Module, attr: str, loaded,
                     stored: str) -> torch.Tensor | _PackedDest | _PackedExpertsDest:
    """A deferred Linear weight's destination: its packed codes for a quantized tensor, else the weight
    allocated in the model's dtype on its device (a module the checkpoint leaves unquantized); a FusedMoE's
    stack ``attr`` likewise (_deferred_experts)."""
    if isinstance(module, FusedMoE):
        return _deferred_experts(module, attr, loaded, stored)
    if isinstance(loaded, PackedIntSlice):
        loaded.packed = True
        if module.wna16 is None:
            out, inp = module.weight.shape
            module.wna16 = WNA16Weight(loaded.bits, out, inp, module.weight_device)
        return _PackedDest(module.wna16, 0, module.weight.shape[0])
    if module.wna16 is not None:
        raise ModelLoadError(f"tensor {stored!r} is unquantized, and the other slices of its layer quantized: "
                             "one packed layer cannot hold both; serve it with wna16_weights='dequantized'")
    module.weight = nn.Parameter(torch.empty_like(module.weight, device=module.weight_device), requires_grad=False)
    return module.weight


def _deferred_experts(moe: FusedMoE, attr: str, loaded, stored: str) -> torch.Tensor | _PackedExpertsDest:
    """A deferred expert stack's destination: packed codes for a quantized tensor; else (unquantized) the
    stack allocated, and every expert after it dequantized into it, as before packing."""
    stack, packed_attr = getattr(moe, attr), attr.replace("_weight", "_packed")
    packed = getattr(moe, packed_attr)
    if isinstance(loaded, PackedIntSlice):
        loaded.packed = True
        if packed is None:
            packed = WNA16Experts(loaded.bits, *stack.shape, moe.weight_device)
            setattr(moe, packed_attr, packed)
        return _PackedExpertsDest(packed, tuple(stack.shape))
    if packed is not None:
        raise ModelLoadError(f"tensor {stored!r} is unquantized, and its layer's other experts kept "
                             "packed: one packed layer cannot hold both; serve it with wna16_weights='dequantized'")
    return _allocate_stack(moe, attr)


def _refuse_mixed_packed_layer(quantized: str, unquantized: str) -> None:
    """Under wna16_weights='packed' a layer's weights (a FusedMoE's experts, a fused Linear's slices) are all
    quantized or all unquantized: a mix is refused, whichever kind the checkpoint names first."""
    raise ModelLoadError(f"tensor {quantized!r} is quantized, and {unquantized!r} of its layer unquantized: one "
                         "packed layer cannot hold both; serve it with wna16_weights='dequantized'")


def _allocate_stack(moe: FusedMoE, attr: str) -> nn.Parameter:
    """A deferred expert stack allocated in the model's dtype on its device, to be loaded dequantized."""
    setattr(moe, attr, nn.Parameter(torch.empty_like(getattr(moe, attr), device=moe.weight_device),
                                    requires_grad=False))
    return getattr(moe, attr)


def _dequantize_act_order_experts(modules: dict[str, nn.Module], params: dict[str, torch.Tensor]) -> None:
    """An act-order (desc_act) checkpoint's deferred expert stacks allocated before loading, so its experts are
    dequantized into them: the packed fused_moe reads no g_idx (vLLM's fused MoE refuses act-order), and one
    layer's w13 and w2 are both packed or both not (a w2 with one group is act-order in name only)."""
    for name, m in modules.items():
        if isinstance(m, FusedMoE):
            for attr in ("w13_weight", "w2_weight"):
                if getattr(m, attr).is_meta:
                    params[f"{name}.{attr}"] = _allocate_stack(m, attr)


def _wna16_slice(name: str, loaded, read: Callable[[str], torch.Tensor | None], quant: WNA16Config,
                 file: Path) -> tuple[str, PackedIntSlice]:
    """A quantized weight's codes and (through ``read``, by name) its scales and zero points -> (the weight's
    name, the weight read dequantized). Every stored shape is checked, each mismatch one line."""
    module = name[:-len(quant.packed_suffix)]
    shape = tuple(loaded.get_shape())
    if len(shape) != 2:
        raise ModelLoadError(f"{quant.method} tensor {name!r} has shape {shape}: a quantized weight is a matrix")
    build = {"gptq": _gptq_weight, "awq": _awq_weight, "compressed-tensors": _ct_weight}[quant.method]
    codes, (out, inp), scale, zero = build(_Companions(module, name, file, read, quant), loaded, shape, quant)
    g_idx_name = module + quant.companion_suffixes[-1]
    g_idx = read(g_idx_name)
    if g_idx is None and quant.desc_act and quant.group_size != -1:  # act-order: the groups are not in column order
        raise ModelLoadError(f"{quant.method} tensor {name!r} in {file.name} has no {g_idx_name!r} beside it "
                             "(desc_act: each input column's group is read from it)")
    if g_idx is None:
        group_of = torch.arange(inp) // (inp if quant.group_size == -1 else quant.group_size)
    else:
        _expect(g_idx_name, g_idx, (inp,), "int")
        group_of = g_idx.long()
        if inp and not 0 <= int(group_of.min()) <= int(group_of.max()) < scale.shape[1]:
            raise ModelLoadError(f"tensor {g_idx_name!r} names groups outside "
                                 f"0..{scale.shape[1] - 1}")
        if not quant.desc_act and quant.group_size != -1 and not torch.equal(
                group_of, torch.arange(inp) // quant.group_size):  # config and tensor disagree: which is right?
            raise ModelLoadError(f"tensor {g_idx_name!r} puts input columns in other groups than group_size "
                                 f"{quant.group_size} in column order (desc_act is false)")
    return module + ".weight", PackedIntSlice(codes, (out, inp), quant.bits, scale, zero, group_of,
                                              group_size=quant.group_size)


@dataclass(frozen=True, slots=True)
class _Companions:
    """The tensors read beside one quantized weight, by suffix; a missing one is a one-line error."""
    module: str
    weight: str
    file: Path
    read: Callable[[str], torch.Tensor | None]
    quant: WNA16Config

    def get(self, suffix: str, shape: tuple[int, ...], kind: str) -> torch.Tensor:
        t = self.read(self.module + suffix)
        if t is None:
            raise ModelLoadError(f"{self.quant.method} tensor {self.weight!r} in {self.file.name} has no "
                                 f"{self.module + suffix!r} beside it")
        _expect(self.module + suffix, t, shape, kind)
        return t

    def groups(self, inp: int) -> int:
        return 1 if self.quant.group_size == -1 else -(-inp // self.quant.group_size)


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...], kind: str) -> None:
    """``t`` must have ``shape`` and be of ``kind``: "int" (zero points, g_idx, weight_shape: a float there
    would be truncated), "int32" (codes packed into words: another width would shift them elsewhere) or
    "float" (scales: integers would be whole-number scales)."""
    if tuple(t.shape) != shape:
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
    if kind == "int32" and t.dtype != torch.int32:
        raise ModelLoadError(f"tensor {name!r} is {str(t.dtype).replace('torch.', '')}, expected int32 (packed)")
    if t.is_floating_point() != (kind == "float") or t.dtype == torch.bool or t.is_complex():
        raise ModelLoadError(f"tensor {name!r} is {str(t.dtype).replace('torch.', '')}, expected "
                             f"{'a float dtype (scales)' if kind == 'float' else 'an integer dtype'}")


def _midpoint(out: int, groups: int, bits: int) -> torch.Tensor:
    """A symmetric scheme's zero point: the codes' midpoint."""
    return torch.full((out, groups), float(1 << (bits - 1)))


def _gptq_weight(t: _Companions, loaded, shape, quant):
    """GPTQ: qweight [in / p, out], scales [groups, out], qzeros [groups, out / p] (g_idx [in]: the caller's)."""
    bits, p = quant.bits, 32 // quant.bits
    inp, out = shape[0] * p, shape[1]
    groups = t.groups(inp)

    def codes(r0, r1, c0, c1):
        w0 = c0 // p
        return _unpack_int32(loaded[w0:-(-c1 // p), r0:r1], bits, 0)[c0 - w0 * p:c1 - w0 * p].T

    scale = t.get(".scales", (groups, out), "float").float().T
    if quant.symmetric and t.read(t.module + ".qzeros") is None:  # as vLLM: the midpoint, qzeros not needed
        return codes, (out, inp), scale, _midpoint(out, groups, bits)
    qzeros = t.get(".qzeros", (groups, -(-out // p)), "int32")
    zero = _unpack_int32(qzeros, bits, 1)[:, :out].T.float() + (quant.checkpoint_format == "gptq")
    if quant.symmetric and not torch.equal(zero, _midpoint(out, groups, bits)):  # sym: true, asymmetric zeros
        raise ModelLoadError(f"tensor {t.module + '.qzeros'!r} holds zero points other than {1 << (bits - 1)}, the "
                             "midpoint of a symmetric (sym: true) checkpoint's codes")
    return codes, (out, inp), scale, zero


def _awq_weight(t: _Companions, loaded, shape, quant):
    """AWQ: qweight [in, out / 8] and qzeros [groups, out / 8] interleaved in AWQ_ORDER, scales [groups, out]."""
    bits, p = quant.bits, 32 // quant.bits
    inp, out = shape[0], shape[1] * p
    groups = t.groups(inp)
    undo = torch.tensor(AWQ_ORDER).argsort()  # column k of a word's 8 is its field undo[k]

    def in_order(words: torch.Tensor) -> torch.Tensor:
        return _unpack_int32(words, bits, 1).unflatten(1, (-1, p))[..., undo].flatten(1)

    def codes(r0, r1, c0, c1):
        w0 = r0 // p
        return in_order(loaded[c0:c1, w0:-(-r1 // p)])[:, r0 - w0 * p:r1 - w0 * p].T

    scale = t.get(".scales", (groups, out), "float").float().T
    return codes, (out, inp), scale, in_order(t.get(".qzeros", (groups, shape[1]), "int32")).T.float()


def _ct_weight(t: _Companions, loaded, shape, quant):
    """compressed-tensors: weight_packed [out, in * b / 32] (naive: weight int8 [out, in]) beside weight_shape,
    weight_scale [out, groups], weight_zero_point [out * b / 32, groups] (naive: int8 [out, groups])."""
    bits, offset, p = quant.bits, 1 << (quant.bits - 1), 32 // quant.bits
    packed = quant.checkpoint_format == "pack-quantized"
    out, inp = shape
    if packed:
        out, inp = (int(v) for v in t.get(".weight_shape", (2,), "int").tolist())
        if shape != (out, -(-inp // p)):
            raise ModelLoadError(f"tensor {t.weight!r} has shape {shape}, expected {(out, -(-inp // p))} "
                                 f"for a weight_shape of {[out, inp]}")
    groups = t.groups(inp)

    def codes(r0, r1, c0, c1):
        if not packed:  # signed int8: offset to the unsigned codes the zero points are
            return loaded[r0:r1, c0:c1].int() + offset
        w0 = c0 // p
        return _unpack_int32(loaded[r0:r1, w0:-(-c1 // p)], bits, 1)[:, c0 - w0 * p:c1 - w0 * p]

    scale = t.get(".weight_scale", (out, groups), "float").float()
    if quant.symmetric:
        return codes, (out, inp), scale, _midpoint(out, groups, bits)
    if packed:
        zero = _unpack_int32(t.get(".weight_zero_point", (-(-out // p), groups), "int32"), bits, 0)[:out].float()
    else:
        zero = t.get(".weight_zero_point", (out, groups), "int").float() + offset
    return codes, (out, inp), scale, zero


class _Wna16Companions:
    """Which file holds each scale, zero point, g_idx and weight_shape of a weight-only int checkpoint (one may
    sit in another shard file than its weight), read on demand; those never read are stray ones."""

    def __init__(self, files: list[Path], quant: WNA16Config):
        from safetensors import safe_open

        self.quant, self.where, self.taken, self.packed = quant, {}, set(), set()
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                self.where.update({n: file for n in f.keys() if n.endswith(quant.companion_suffixes)})
                if quant.packed_suffix != ".weight":
                    self.packed.update(n[:-len(quant.packed_suffix)] for n in f.keys()
                                       if n.endswith(quant.packed_suffix))
        self.names = set(self.where)

    def is_quantized(self, name: str, loaded) -> bool:
        """Whether ``name`` holds a quantized weight's codes (naive compressed-tensors': an int8 ``weight``;
        the modules left unquantized keep theirs in the model's dtype)."""
        if name.endswith(".weight") and name[:-len(".weight")] in self.packed:  # which one is the module's?
            raise ModelLoadError(f"tensor {name!r} and {name[:-len('.weight')] + self.quant.packed_suffix!r} both "
                                 "hold its module's weight (one unquantized, one quantized)")
        if not name.endswith(self.quant.packed_suffix):
            return False
        want, dtype = ("I8" if self.quant.packed_suffix == ".weight" else "I32"), loaded.get_dtype()
        if want == "I8" and not (dtype.startswith(("I", "U")) or dtype == "BOOL"):
            return False  # a module left unquantized
        if want == "I8" and dtype != want:
            raise ModelLoadError(f"{self.quant.method} tensor {name!r} is {dtype}, expected int8 codes")
        if want == "I8":
            return True
        if loaded.get_dtype() != want:
            raise ModelLoadError(f"{self.quant.method} tensor {name!r} is {loaded.get_dtype()}, expected int32 codes")
        return True

    def read(self, name: str) -> torch.Tensor | None:
        from safetensors import safe_open

        if name not in self.where:
            return None
        self.taken.add(name)
        with safe_open(str(self.where[name]), framework="pt") as f:
            return f.get_tensor(name)

    def check_all_read(self) -> None:
        stray = sorted(self.names - self.taken)
        if stray:
            raise ModelLoadError(f"unexpected tensor {stray[0]!r}: a {self.quant.method} scale or zero point with "
                                 "no quantized weight beside it")


def _log_wna16(quant: WNA16Config, dequantized: collections.Counter, kept_packed: int) -> None:
    if kept_packed:
        logger.info("[model] int%d weight-only checkpoint (%s): %d int%d weights kept packed (the checkpoint's "
                    "memory; their matmuls dequantize a tile at a time: %s)%s", quant.bits, quant.describe(),
                    kept_packed, quant.bits, "Triton's wna16_matmul under the Triton backend, else its torch twin",
                    f"; {sum(dequantized.values())} dequantized (act-order experts, which the packed fused_moe "
                    "does not read, as vLLM's; or modules not built as Linear layers)" if dequantized else "")
        return
    dtype = max(dequantized, key=dequantized.get) if dequantized else torch.bfloat16
    name = str(dtype).replace("torch.", "")
    logger.info("[model] int%d weight-only checkpoint (%s): %d int%d weights dequantized to %s as they were loaded. "
                "The weights are held dequantized: the memory is the %s model's (about %dx the checkpoint's "
                "quantized weights), and the outputs are the dequantized weights' (vLLM computes with the packed "
                "int%d weights in its mixed-precision kernels, so its tokens may differ slightly)", quant.bits,
                quant.describe(), sum(dequantized.values()), quant.bits, name, name,
                dtype.itemsize * 8 // quant.bits, quant.bits)


def _log_fp8(quant: Fp8Config, dequantized: collections.Counter, input_scales: int) -> None:
    dtype = max(dequantized, key=dequantized.get) if dequantized else torch.bfloat16
    name = str(dtype).replace("torch.", "")
    logger.info("[model] FP8 checkpoint (%s): %d fp8 weights dequantized to %s as they were loaded. The weights "
                "are held dequantized: the memory is the %s model's (about %dx the checkpoint's), and the outputs "
                "are the dequantized weights' (vLLM on a GPU with FP8 support computes W8A8, the activations "
                "quantized per token, so its tokens may differ slightly)%s", quant.describe(),
                sum(dequantized.values()), name, name, dtype.itemsize,
                f"; {input_scales} static input scales not applied (activations are not quantized)"
                if input_scales else "")


def _describe_missing(pending: set[tuple[str, int]], modules: dict[str, nn.Module]) -> list[str]:
    """The parameters ``pending`` names, an expert stack's with the experts it lacks."""
    experts: dict[str, set[int]] = {}
    for name, shard in sorted(pending):
        moe = modules.get(name.rpartition(".")[0])
        experts.setdefault(name, set())
        if isinstance(moe, FusedMoE):
            experts[name].add(shard // 2 if name.endswith("w13_weight") else shard)
    return [f"{n} (experts {', '.join(map(str, sorted(e)[:8]))}{' ...' if len(e) > 8 else ''})" if e else n
            for n, e in experts.items()]


def _expected_shards(params: dict[str, torch.Tensor], modules: dict[str, nn.Module]) -> set[tuple[str, int]]:
    """(parameter, shard index) for every checkpoint tensor the parameters need."""
    return {(name, s) for name in params for s in range(_num_shards(name, modules))}


def _num_shards(param: str, modules: dict[str, nn.Module]) -> int:
    """The checkpoint tensors a parameter may be loaded from: qkv_proj 3, gate_up_proj 2, an
    expert stack 2 or 1 per expert (FusedMoE.num_shards), else 1."""
    module_name, _, attr = param.rpartition(".")
    if isinstance(modules.get(module_name), FusedMoE):
        return modules[module_name].num_shards(attr)
    return _FUSED_SHARDS.get(module_name.rpartition(".")[2], 1)  # "...self_attn.qkv_proj.weight" -> "qkv_proj"


# A hub checkpoint's experts, one tensor each: Mixtral's w1 (gate), w3 (up) and w2 (down) under
# block_sparse_moe (renamed mlp before this matches), Qwen's gate_proj, up_proj and down_proj under
# mlp -> (FusedMoE weight, w13's half: gate rows 0, up rows 1)
_EXPERT_KEY = re.compile(r"(.*\.)mlp\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_EXPERT_PARTS = {"w1": ("w13_weight", 0), "gate_proj": ("w13_weight", 0), "w3": ("w13_weight", 1),
                 "up_proj": ("w13_weight", 1), "w2": ("w2_weight", None), "down_proj": ("w2_weight", None)}
# ... and transformers 5's stacks of them, as its models hold them (gate_up_proj [E, 2I, H], down_proj [E, H, I])
_EXPERT_STACKS = {"experts.gate_up_proj": "experts.w13_weight", "experts.down_proj": "experts.w2_weight"}


# Granite's MoE tensors (block_sparse_moe renamed mlp before this matches): the hub's router.layer and its
# experts stored stacked, input_linear [E, 2I, H] (each expert's gate rows, then its up rows) and
# output_linear [E, H, I]; transformers 5's router; GraniteMoeShared's shared_mlp, its gate and up fused
# -> (parameter, shard: None fills every one)
_GRANITE_MOE_TENSORS = {"mlp.router.layer.weight": ("mlp.gate.weight", 0), "mlp.router.weight": ("mlp.gate.weight", 0),
                        "mlp.input_linear.weight": ("mlp.experts.w13_weight", None),
                        "mlp.output_linear.weight": ("mlp.experts.w2_weight", None),
                        "shared_mlp.input_linear.weight": ("mlp.shared_expert.gate_up_proj.weight", None),
                        "shared_mlp.output_linear.weight": ("mlp.shared_expert.down_proj.weight", 0)}


def _expert_target(name: str, cfg: ModelConfig) -> tuple[str, int | None] | None:
    """A mixture-of-experts checkpoint tensor's FusedMoE parameter and shard (None: the whole
    stack), or None for a tensor that is not an expert's. An expert index past num_experts is
    left as it is named, so that it is reported as an unexpected tensor."""
    if cfg.architecture in GRANITE_MOE_ARCHITECTURES:
        for suffix, (param, shard) in _GRANITE_MOE_TENSORS.items():
            if name.endswith(f".{suffix}"):
                return name[:-len(suffix)] + param, shard
    m = _EXPERT_KEY.fullmatch(name)
    if m is not None:
        expert, (param, half) = int(m[2]), _EXPERT_PARTS[m[3]]
        if expert >= cfg.num_experts:
            return name, 0
        return f"{m[1]}mlp.experts.{param}", expert if half is None else 2 * expert + half
    for stack, param in _EXPERT_STACKS.items():
        if name.endswith(f".mlp.{stack}"):
            return name[:-len(stack)] + param, None
    return None


# TEXT_OF_MULTIMODAL (Gemma 3's, Mistral 3's): their text decoder's tensors under the prefixes transformers
# writes (4's and 5's), and the vision tower's and projector's, which are not loaded
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


_BASE_MODEL_PREFIXES = ("layers.", "embed_tokens.", "norm.")


def _target_param(name: str, cfg: ModelConfig) -> tuple[str | None, int | None]:
    """The parameter a checkpoint tensor goes into (None: skipped) and its shard
    index there (0 for a tensor that fills its parameter whole; None for one stored
    fused as the parameter is, Phi-3's qkv_proj and gate_up_proj, that fills every shard)."""
    if "rotary_emb" in name:
        return None, 0
    if cfg.architecture in TEXT_OF_MULTIMODAL:
        if name.startswith(_VISION_PREFIXES):
            return None, 0
        old, new = next(((o, n) for o, n in _TEXT_PREFIXES if name.startswith(o)), ("", ""))
        name = new + name[len(old):]
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None, 0  # tied: the embedding is the head
    if cfg.architecture in ("Glm4MoeForCausalLM", *MLA_ARCHITECTURES):
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m is not None and int(m[1]) >= cfg.num_layers:
            return None, 0  # its multi-token-prediction layer (speculative decoding's, as vLLM skips it)
        if cfg.kv_lora_rank and ".self_attn." in name:  # MLA's projections: their own names, none fused
            return name, 0
        name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
    if cfg.architecture == GPT_OSS and ".mlp." in name:  # router and experts: held under their own names
        return name, 0
    if cfg.num_experts:
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's hub name for its router and experts
        expert = _expert_target(name, cfg)
        if expert is not None:
            return expert
    for part, (fused, shard) in _FUSED.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    if any(f".{fused}." in name for fused, _ in _FUSED.values()):
        return name, None
    return name, 0


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                backend: Backend, tp: TPGroup, defer_linear_weights: bool = False) -> CausalLM:
    """Uninitialised parameters created directly in ``dtype`` on ``device`` (no
    fp32 copy of a large model first); RotaryEmbedding's tables are fp32 whatever the default.
    ``defer_linear_weights``: the Linear layers' weights on the meta device (_defer_linear_weights)."""
    token = _defer_linear_weights.set(defer_linear_weights)
    try:
        return built_in(dtype, device, lambda: CausalLM(cfg, backend, tp))
    finally:
        _defer_linear_weights.reset(token)


def built_in(dtype: torch.dtype, device: torch.device, make: Callable[[], nn.Module]) -> nn.Module:
    """``make()`` with torch's default dtype and device set, so each parameter is created once, where it stays."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return make()
    finally:
        torch.set_default_dtype(old)


WNA16_WEIGHTS = ("auto", "packed", "dequantized")


def packed_kernels_are_triton(backend: Backend) -> bool:
    """Whether the layers kept packed (WNA16Weight, FusedMoE's WNA16Experts) run Triton's kernels: only under
    Triton's backend, whose start-up probe launched them. Under the torch references (a CUDA device where the
    probe failed: select_backend's fallback) and the CPU's, their torch twins run."""
    return kernels.TRITON is not None and backend is kernels.TRITON


def wna16_packed(choice: str, cfg: ModelConfig, device: torch.device) -> bool:
    """Whether a weight-only int checkpoint's Linear weights are kept packed (``wna16_weights``): "auto"
    packs them on CUDA (vLLM's memory: the checkpoint's) and dequantizes them on the CPU, where the
    torch twin, which dequantizes a whole weight every call, decodes slower than the dequantized weights
    (benchmarks/RESULTS.md, "int4 weights kept packed")."""
    if choice not in WNA16_WEIGHTS:
        raise ValueError(f"wna16_weights must be one of {', '.join(WNA16_WEIGHTS)}, got {choice!r}")
    if not isinstance(cfg.quantization, WNA16Config):
        return False
    return choice == "packed" or (choice == "auto" and device.type == "cuda")


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device,
               backend: Backend = kernels.TORCH, tp: TPGroup = TPGroup(),
               hf_overrides: dict[str, Any] | None = None, max_model_len: int | None = None,
               wna16_weights: str = "auto") -> tuple[CausalLM, int]:
    """``max_model_len``: the requested one (None: the model's), for what depends on it (LongRoPE's factors);
    ``wna16_weights``: an int4/int8 weight-only checkpoint's weights kept packed or dequantized (wna16_packed)."""
    path = Path(path)
    cfg = ModelConfig.from_dir(path, hf_overrides).with_max_model_len(max_model_len)
    if cfg.encoder_only:
        return load_encoder_model(cfg, path, dtype, device, tp)
    model = build_model(cfg, dtype, device, backend, tp, wna16_packed(wna16_weights, cfg, device))
    weight_bytes = load_weights(model, path)
    for m in model.modules():
        if isinstance(m, WNA16Weight):
            m.triton = packed_kernels_are_triton(backend)
    model.eval().requires_grad_(False)
    weight_bytes += backend.prepare_model(model)  # on the CPU: bf16 linear weights packed, or in fp32
    if cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "longrope":
        long = cfg.rope_scaling["use_long_factor"]
        logger.info("[model] LongRoPE: the %s factors at every position (max_model_len %s "
                    "original_max_position_embeddings=%d, as vLLM chooses)", "long" if long else "short",
                    ">" if long else "<=", cfg.rope_scaling["original_max_position_embeddings"])
    experts = (f", {cfg.num_experts} experts (top {cfg.num_experts_per_tok}) in {len(cfg.moe_layers)} layers"
               if cfg.num_experts else "")
    logger.info("[model] %s: %d layers%s, hidden %d, %d/%d heads, head_dim %d, %s on %s, %.1f MiB weights%s",
                cfg.architecture, cfg.num_layers, experts, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                cfg.head_dim, str(dtype).replace("torch.", ""), device, weight_bytes / 2**20,
                f" (rank {tp.rank} of {tp.world_size}: its shard)" if tp.world_size > 1 else "")
    return model, weight_bytes


# =========================================================================== LoRA adapters
# vLLM's multi-LoRA serving: adapters in PEFT's format (adapter_config.json and
# adapter_model.safetensors) beside the base weights, a mix of them in one step. Each
# layer they may change becomes a LoRALinear: the base layer's output, plus for the rows of
# each adapter in the step x A^T B^T (B scaled by lora_alpha / r, or / sqrt(r) with rslora).
#
# As vLLM's, the device holds ``max_loras`` adapters at a time, in slots reserved at start-up
# (before the KV cache is sized); the max_cpu_loras most recently used adapters' weights stay
# in host memory (the engine loads one dropped from there again from its path when a step needs
# it), and a step's adapters are copied into slots before its forward, the least recently used
# out (LoRASlots). The scheduler keeps a step's adapters within max_loras. Eager steps apply each
# slot to its own rows (a gather and a scatter); padded decode steps, the ones CUDA graphs
# capture, apply every slot to every row under a per-row mask: fixed shapes, so one graph
# serves any mix of the slots' adapters.
#
# Under tensor parallelism an adapter is split as its layer is (vLLM's, Megatron's split):
# a column-parallel layer (qkv_proj, gate_up_proj) keeps A whole and this rank's rows of
# each slice of B, so x A^T B^T is this rank's output rows; a row-parallel one (o_proj,
# down_proj) keeps this rank's input columns of A and B whole: x A^T is then a partial
# sum, and one all-reduce of it (r numbers a token) makes every rank's delta whole.

# PEFT's module names -> (the fused module here, its slice): q, k and v are qkv_proj's slices
LORA_TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
                "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
                "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
                "down_proj": ("mlp.down_proj", 0),
                # Phi-3's own fused modules: one adapter over all the slices (None: split at load)
                "qkv_proj": ("self_attn.qkv_proj", None), "gate_up_proj": ("mlp.gate_up_proj", None)}
LORA_ERROR_KEY = "nanoserve/lora_error/{}"  # TPGroup.store: why a worker could not load an adapter
_LORA_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


@dataclass(slots=True, frozen=True)
class LoRAConfig:
    """The adapter memory reserved at start-up, as vLLM's LoRAConfig: ``max_loras`` slots in every
    adapted layer, each as wide as an adapter of rank ``max_lora_rank`` needs."""
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept in host memory (None: max_loras)


@dataclass(slots=True)
class LoRAStep:
    """What every LoRALinear reads in a step's forward (the runner sets it). The eager path:
    ``groups``, each slot's token rows on the device (None: all of them). The padded path: ``mask``
    [rows, max_loras], 1 where a row runs the slot's adapter (all 0: the base model, or padding).
    Neither: a step without adapter rows."""
    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)
    mask: torch.Tensor | None = None


@dataclass(slots=True, frozen=True)
class LoRATarget:
    """A layer adapters may change, and this rank's part of an adapter's weights for it. Read
    from the model config and the TPGroup, not from the base module: a backend may have
    replaced it by a class of its own."""
    parent: nn.Module
    attr: str
    in_features: int                 # the whole layer's (an adapter's A is [r, in_features])
    sizes: list[int]                 # the whole layer's output slices (q, k, v; gate, up; or one)
    rows: list[tuple[int, int]]      # (start, size) of each slice's rows this rank holds
    cols: tuple[int, int]            # (start, size) of the input columns this rank holds
    row_parallel: bool               # its x A^T is a partial sum over the ranks


class LoRALinear(nn.Module):
    """A base linear layer (any of the backend's) and ``max_loras`` slots for adapters of it (vLLM's
    punica layout, dense): slot s holds an adapter's A [W, in] (its slices' A stacked) and B^T
    [W, out] (their B block-diagonal, the scale in it), this rank's parts, where W is the layer's
    slices x max_lora_rank; the columns past what the adapter uses (``widths``) are zero.
    ``tp``: a row-parallel layer's group (None: column-parallel)."""

    def __init__(self, base: nn.Module, step: LoRAStep, target: LoRATarget, config: LoRAConfig,
                 dtype: torch.dtype, device: torch.device, tp: TPGroup | None = None):
        super().__init__()
        self.base, self.step, self.tp = base, step, tp
        width, out_features = len(target.sizes) * config.max_lora_rank, sum(size for _, size in target.rows)
        self.lora_a = torch.zeros(config.max_loras, width, target.cols[1], dtype=dtype, device=device)
        self.lora_b = torch.zeros(config.max_loras, width, out_features, dtype=dtype, device=device)
        self.widths = [0] * config.max_loras  # each slot's adapter's A rows here (0: it leaves this layer be)

    def set_slot(self, slot: int, ab: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """An adapter's weights for this layer (load_lora's A and B^T; None: it has none) into ``slot``."""
        w = 0 if ab is None else ab[0].shape[0]
        if ab is not None:  # from pinned host memory on CUDA: queued behind the step in flight, which may read the slot
            self.lora_a[slot, :w].copy_(ab[0], non_blocking=True)
            self.lora_b[slot, :w].copy_(ab[1], non_blocking=True)
        self.lora_a[slot, w:].zero_()  # the padded path reads the whole slot
        self.lora_b[slot, w:].zero_()
        self.widths[slot] = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # a row-parallel base has done its own all-reduce: the delta is added whole
        if self.step.mask is not None:
            return self._add_masked(x, y, self.step.mask)
        groups = [(slot, rows, w) for slot, rows in self.step.groups if (w := self.widths[slot])]
        if not groups:
            return y
        a, b = self.lora_a, self.lora_b
        shrunk = [(x if rows is None else x.index_select(0, rows)).to(a.dtype) @ a[slot, :w].T
                  for slot, rows, w in groups]
        if self.tp is not None:
            shrunk = self._all_reduce(shrunk)
        for (slot, rows, w), xa in zip(groups, shrunk):
            delta = (xa @ b[slot, :w]).to(y.dtype)
            if rows is None:  # one adapter for the whole step: no gather, no scatter
                y += delta
            else:
                y.index_add_(0, rows, delta)
        return y

    def _add_masked(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Every slot's x A^T for every row, each row's own kept by ``mask``, then B^T over all the
        slots at once: no data-dependent shape or index, so a CUDA graph records it once."""
        slots, width, _ = self.lora_a.shape
        xa = x.to(self.lora_a.dtype) @ self.lora_a.view(slots * width, -1).T
        xa = (xa.view(-1, slots, width) * mask[:, :, None]).view(-1, slots * width)
        if self.tp is not None:
            xa = self.tp.all_reduce(xa)
        y += (xa @ self.lora_b.view(slots * width, -1)).to(y.dtype)
        return y

    def _all_reduce(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's partial x A^T summed, all adapters' in one collective. Every rank runs the
        same groups with the same adapters in the same slots (LoRASlots decides alike on every rank
        from the same messages), so the collectives pair up."""
        flat = self.tp.all_reduce(torch.cat([p.flatten() for p in parts]))
        return [f.view_as(p) for f, p in zip(flat.split([p.numel() for p in parts]), parts)]


def lora_layers(model: CausalLM) -> dict[str, LoRATarget]:
    """The layers adapters may change, by name ("layers.{i}.{module}"), split as the model's
    own parallel layers are: q by heads, k and v by this rank's KV head (one replicated on
    several ranks when there are fewer KV heads than ranks: QKVParallelLinear.shard_rank),
    gate and up by rows, o and down by input columns."""
    cfg, tp, out = model.config, model.tp, {}
    n, rank = tp.world_size, tp.rank
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    kv_local = num_kv_heads_per_rank(cfg.num_kv_heads, n) * cfg.head_dim
    kv_rank = rank // max(1, n // cfg.num_kv_heads)
    column = {"self_attn.qkv_proj": (hidden, [q, kv, kv], [(rank * q // n, q // n), (kv_rank * kv_local, kv_local),
                                                          (kv_rank * kv_local, kv_local)]),
              "mlp.gate_up_proj": (hidden, [inter, inter], [(rank * inter // n, inter // n)] * 2)}
    row = {"self_attn.o_proj": (q, hidden), "mlp.down_proj": (inter, hidden)}
    for i, layer in enumerate(model.model.layers):
        for name, (in_features, sizes, rows) in column.items():
            if name.startswith("mlp.") and i in cfg.moe_layers:  # experts take no adapter (load_lora says so)
                continue
            parent, attr = name.split(".")
            out[f"layers.{i}.{name}"] = LoRATarget(getattr(layer, parent), attr, in_features, sizes, rows,
                                                   (0, in_features), False)
        for name, (in_features, out_features) in row.items():
            if name.startswith("mlp.") and i in cfg.moe_layers:
                continue
            parent, attr = name.split(".")
            out[f"layers.{i}.{name}"] = LoRATarget(getattr(layer, parent), attr, in_features, [out_features],
                                                   [(0, out_features)], (rank * in_features // n, in_features // n),
                                                   n > 1)
    return out


def check_lora_supported(cfg: ModelConfig) -> None:
    if cfg.architecture == GPT_OSS:  # its experts are stacks of their own (GptOssExperts), not gate/up/down layers
        raise ModelLoadError(f"LoRA is not supported for {GPT_OSS} (its experts run a path of their own, and no "
                             "attention-only adapter path is tested for it): serve it without --enable-lora")
    if cfg.kv_lora_rank:  # its projections are not q/k/v/o, and kv_b_proj is absorbed, never run as a layer
        raise ModelLoadError(f"LoRA is not supported for {cfg.architecture} (multi-head latent attention): "
                             "serve it without --enable-lora")


def lora_dtype(model: CausalLM) -> torch.dtype:
    """Adapters run in the model's dtype, but on a CPU in fp32: there a bf16 matmul outside the packed
    kernels is much slower at LoRA's shapes without bf16 instructions (RESULTS.md, "What a LoRA adapter
    costs"), and fp32 is the more exact."""
    weight = model.model.embed_tokens.weight  # the model's dtype (Gemma's norms are fp32)
    return torch.float32 if weight.device.type == "cpu" else weight.dtype


def lora_slot_bytes(cfg: ModelConfig, config: LoRAConfig, world_size: int, dtype: torch.dtype) -> int:
    """The bytes wrap_lora_layers allocates on one rank, from the config alone, for the memory check before
    loading: in every layer, each adapted module's A [slices x rank, its input columns] and B^T [slices x rank,
    its output rows] (lora_layers' split), in each of max_loras slots."""
    check_lora_supported(cfg)
    hidden, inter, q = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
    kv = num_kv_heads_per_rank(cfg.num_kv_heads, world_size) * cfg.head_dim
    attention = [(3, hidden, q // world_size + 2 * kv), (1, q // world_size, hidden)]          # qkv, o
    mlp = [(2, hidden, 2 * (inter // world_size)), (1, inter // world_size, hidden)]           # gate_up, down

    def per_slot(modules):
        return sum(slices * config.max_lora_rank * (cols + rows) for slices, cols, rows in modules)
    dense = cfg.num_layers - len(cfg.moe_layers)  # a MoE layer's experts take no adapter
    per_layer = cfg.num_layers * per_slot(attention) + dense * per_slot(mlp)
    return config.max_loras * per_layer * torch.empty((), dtype=dtype).element_size()


def wrap_lora_layers(model: CausalLM, config: LoRAConfig) -> int:
    """Wrap every layer an adapter may change (after the backend prepared the base layers), its
    slots allocated now, before the KV cache is sized, as vLLM reserves its LoRA memory before
    profiling: the bytes they take, which the caller counts with the weights'."""
    check_lora_supported(model.config)
    step, dtype, device, total = LoRAStep(), lora_dtype(model), model.model.norm.weight.device, 0
    model.lora_config = config
    for t in lora_layers(model).values():
        layer = LoRALinear(getattr(t.parent, t.attr), step, t, config, dtype, device,
                           model.tp if t.row_parallel else None)
        setattr(t.parent, t.attr, layer)
        total += layer.lora_a.nbytes + layer.lora_b.nbytes
    logger.info("[model] LoRA: %d adapter slot(s) of rank %d in %d layers, %.1f MiB (counted with the weights)",
                config.max_loras, config.max_lora_rank, len(model.model.layers), total / 2**20)
    return total


def lora_layer(model: CausalLM) -> LoRALinear | None:
    """One of the LoRALinear layers wrap_lora_layers made (they share one LoRAStep); None: it made none
    (an encoder: LoRA is refused for it)."""
    if model.config.encoder_only:
        return None
    layer = model.model.layers[0].self_attn.o_proj  # every layer's attention is wrapped (not every MLP: experts)
    return layer if isinstance(layer, LoRALinear) else None


class LoRASlots:
    """The adapters a runner serves: the max_cpu_loras most recently used ones' weights in host memory
    (pinned on CUDA), by id, and the device slots' LRU, vLLM's LRUCacheLoRAModelManager in small. Before
    a step's forward, its adapters not in a slot are copied in, each into a free slot or the least
    recently used one that the step does not need. Every rank decides alike from the same messages:
    the host LRU moves only in add (whose ``keep`` rank 0 sends) and slots."""

    def __init__(self, model: CausalLM):
        self.layers = {name: getattr(t.parent, t.attr) for name, t in lora_layers(model).items()}
        first = next(iter(self.layers.values()))
        self.step: LoRAStep = first.step
        self.max_loras, self.dtype = len(first.widths), first.lora_a.dtype
        self.slot_ids = torch.arange(self.max_loras, device=first.lora_a.device)  # a padded step's mask: index == slot
        self.max_cpu_loras = model.lora_config.max_cpu_loras or self.max_loras
        # host copies, least recently used first; the engine loads a dropped one again before a step needs it
        self.adapters: collections.OrderedDict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = \
            collections.OrderedDict()
        self.slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # least recently used first
        self.slot_fills = 0  # adapters copied into a slot (a test reads it)

    def add(self, lora_int_id: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
            keep: Iterable[int] = ()) -> None:
        """Into host memory, the least recently used host copy out past max_cpu_loras: not one of ``keep``
        (the next step's adapters) unless it is in a slot, whose copy the step does not need (else this one)."""
        self.remove(lora_int_id)
        self.adapters[lora_int_id] = weights
        keep = set(keep)
        while len(self.adapters) > self.max_cpu_loras:
            del self.adapters[next((i for i in self.adapters if i not in keep or i in self.slot_of), lora_int_id)]

    def resident(self, lora_int_id: int) -> bool:
        """Whether a step may run it without loading it again: in a slot, or in host memory."""
        return lora_int_id in self.slot_of or lora_int_id in self.adapters

    def remove(self, lora_int_id: int) -> None:
        """Out of host memory, and its slot zeroed and free."""
        self.adapters.pop(lora_int_id, None)
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.set_slot(slot, None)

    def slots(self, lora_ids: Iterable[int]) -> dict[int, int]:
        """The slot of each of a step's adapters, copied in where not there yet."""
        needed = dict.fromkeys(lora_ids)
        if len(needed) > self.max_loras:  # the scheduler never schedules such a step
            raise ValueError(f"a step with {len(needed)} LoRA adapters, more than max_loras ({self.max_loras})")
        for i in needed:
            if i in self.slot_of:
                self.slot_of.move_to_end(i)
            if i in self.adapters:
                self.adapters.move_to_end(i)
        for i in needed:
            if i not in self.slot_of:
                free = sorted(set(range(self.max_loras)) - set(self.slot_of.values()))
                slot = free[0] if free else self.slot_of.pop(next(j for j in self.slot_of if j not in needed))
                weights = self.adapters[i]
                for name, layer in self.layers.items():
                    layer.set_slot(slot, weights.get(name))
                self.slot_of[i] = slot
                self.slot_fills += 1
        return {i: self.slot_of[i] for i in needed}


def load_lora(path: str | Path, model: CausalLM, max_rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """An adapter's weights for LoRALinear.set_slot (this rank's parts), by layer name (lora_layers):
    in host memory (pinned where the model is on CUDA), in lora_dtype. ValueError for what nanoserve
    cannot apply as the checkpoint means it (checked on the whole adapter: every rank refuses the same ones)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    path = Path(path)
    try:
        config = json.loads((path / "adapter_config.json").read_text())
        if not isinstance(config, dict):
            raise ValueError(f"adapter_config.json holds a JSON {type(config).__name__}, not an object")
        tensors = load_file(str(path / "adapter_model.safetensors"))
    except (OSError, ValueError, SafetensorError) as e:  # SafetensorError: a file that is not safetensors
        raise ValueError(f"LoRA adapter {str(path)!r}: cannot read adapter_config.json and "
                         f"adapter_model.safetensors ({e})") from None
    r, alpha = config.get("r"), config.get("lora_alpha")
    unsupported = {k: config.get(k) for k in ("modules_to_save", "rank_pattern", "alpha_pattern", "use_dora",
                                              "fan_in_fan_out") if config.get(k)}
    if config.get("bias", "none") != "none":
        unsupported["bias"] = config["bias"]
    if unsupported or not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"LoRA adapter {str(path)!r}: needs an integer r and lora_alpha, and no "
                         f"{', '.join(unsupported) or 'other options'} (nanoserve applies plain LoRA on q/k/v/o and "
                         f"gate/up/down only)")
    if r > max_rank:
        raise ValueError(f"LoRA adapter {str(path)!r} has rank {r}, more than max_lora_rank ({max_rank})")
    scale = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
    parts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    layers = lora_layers(model)
    for key, t in tensors.items():
        m = _LORA_KEY.fullmatch(key)
        if _targets_experts(key, model.config):
            raise ValueError(f"LoRA adapter {str(path)!r}: {key} adapts a mixture-of-experts layer's MLP (its experts, "
                             f"router or shared expert), which nanoserve does not; adapters of the attention "
                             f"(q/k/v/o_proj) and of dense MLP layers are served")
        if m is None or m[2] not in LORA_TARGETS or int(m[1]) >= model.config.num_layers:
            raise ValueError(f"LoRA adapter {str(path)!r}: {key} is not a weight nanoserve applies (only "
                             f"lora_A/lora_B of {', '.join(LORA_TARGETS)} in the model's layers)")
        if not torch.isfinite(t).all():  # a padded step multiplies every slot by its rows' masks: 0 x inf is nan
            raise ValueError(f"LoRA adapter {str(path)!r}: {key} holds inf or nan")
        module, index = LORA_TARGETS[m[2]]
        name = f"layers.{m[1]}.{module}"
        if index is not None:
            parts.setdefault(name, {}).setdefault(index, {})[m[3]] = t
            continue
        # An adapter of a fused module (Phi-3's qkv_proj): as one adapter per slice, A shared and
        # B's rows of that slice, so that it splits under TP as the slices' adapters do
        sizes = layers[name].sizes
        if m[3] == "B" and t.shape[0] != sum(sizes):
            raise ValueError(f"LoRA adapter {str(path)!r}: {key} has {t.shape[0]} rows, the layer {sum(sizes)}")
        for i, rows in enumerate(t.split(sizes) if m[3] == "B" else [t] * len(sizes)):
            parts.setdefault(name, {}).setdefault(i, {})[m[3]] = rows
    dtype, pin = lora_dtype(model), model.model.norm.weight.device.type == "cuda"  # pinned: copies into a slot queue
    return {name: tuple(w.pin_memory() if pin else w for w in _fuse_lora(path, name, slices, layers[name], scale,
                                                                         r, dtype))
            for name, slices in parts.items()}


def _targets_experts(key: str, cfg: ModelConfig) -> bool:
    """Whether an adapter's tensor belongs to a sparse layer's MLP, or GraniteMoeShared's shared_mlp
    beside it (vLLM serves no LoRA of FusedMoE either, before its fused-MoE LoRA kernels)."""
    m = re.match(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:mlp|block_sparse_moe|shared_mlp)\.", key)
    return m is not None and int(m[1]) in cfg.moe_layers


def _fuse_lora(path, name: str, slices: dict[int, dict[str, torch.Tensor]], target: LoRATarget, scale: float,
               r: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's slices as A [R, in] (stacked) and B^T [R, out] (B block-diagonal, scaled), this rank's
    part of each: ``target``'s input columns of A, its rows of each slice of B."""
    in_features, sizes = target.in_features, target.sizes
    col, width = target.cols
    a_rows, bt = [], torch.zeros(r * len(slices), sum(size for _, size in target.rows))
    for k, (index, ab) in enumerate(sorted(slices.items())):
        a, bk = ab.get("A"), ab.get("B")
        if a is None or bk is None or a.shape != (r, in_features) or bk.shape != (sizes[index], r):
            raise ValueError(f"LoRA adapter {str(path)!r}: {name} slice {index}'s lora_A and lora_B must be "
                             f"[{r}, {in_features}] and [{sizes[index]}, {r}] (the base model's), got "
                             f"{None if a is None else list(a.shape)} and {None if bk is None else list(bk.shape)}")
        a_rows.append(a[:, col:col + width].float())
        row, height = target.rows[index]
        start = sum(size for _, size in target.rows[:index])  # where this rank's slice sits in its output
        bt[k * r:(k + 1) * r, start:start + height] = bk[row:row + height].float().T * scale
    return torch.cat(a_rows).to(dtype), bt.to(dtype)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many kinds; name the directory
        raise ModelLoadError(f"cannot load the tokenizer from {str(path)!r}: {e}") from None


# =========================================================================== sampling

MAX_LOGPROBS = 20  # vLLM's default max_logprobs (EngineConfig's), and what a GPU profile run samples with
NO_TOKEN = -1  # a result's id where the row's bans, bias and bitmask left no token to sample


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
    allowed_token_ids: list[int] | None
    logprob_token_ids: list[int] | None  # logprobs of these tokens instead of the top ones


@dataclass(slots=True)
class SamplingTensors:
    """A request's logit_bias and allowed_token_ids as host tensors, made once (the engine keeps
    them with the request): made from the dict and list at every step they cost a pass of Python
    over every entry of every row, and a request may bring thousands."""
    bias_ids: torch.Tensor | None = None     # int64
    bias_values: torch.Tensor | None = None  # fp32
    allowed_ids: torch.Tensor | None = None  # int64

    @classmethod
    def of(cls, params: SamplingOptions) -> "SamplingTensors":
        bias, allowed = params.logit_bias, params.allowed_token_ids
        return cls(torch.tensor(list(bias), dtype=torch.int64) if bias else None,
                   torch.tensor(list(bias.values()), dtype=torch.float32) if bias else None,
                   torch.tensor(allowed, dtype=torch.int64) if allowed else None)


@dataclass(slots=True)
class SampleRequest:
    """One row to sample: its parameters and the token history penalties need."""
    params: SamplingOptions
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: list[int] = field(default_factory=list)  # min_tokens not reached yet, bad_words
    allowed_token_bitmask: torch.Tensor | None = None  # structured outputs: int32, bit t = token t allowed
    num_output_placeholders: int = 0  # async scheduling: sampled tokens not on the host yet
    tensors: SamplingTensors | None = None  # None: made from params when the row needs them
    serial: int = -1  # its request's, unique for the engine's life (ids may be reused): LogitsProcessorBatch's key


@dataclass(slots=True)
class SamplerOutput:
    """A step's samples where the logits are: the ids (the next step's placeholders read them
    there) and what results() reads on the host in one copy: the ids, or logprob_rows if asked,
    with NO_TOKEN for a row that had none to sample (its placeholder keeps a valid id)."""
    token_ids: torch.Tensor
    packed: torch.Tensor
    num_logprobs: list[int | None]
    failed: dict[int, LogitsProcessorFailed] = field(default_factory=dict)  # rows a custom processor failed for

    def results(self) -> list[SampleResult]:
        host = self.packed.tolist()
        if self.packed.dim() == 1:
            done = [SampleResult(t) for t in host]
        else:
            done = [SampleResult(r.token_id) if w is None else SampleResult(r.token_id, r.logprob, r.top[:w], r.rank)
                    for r, w in zip(unpack_logprob_rows(host), self.num_logprobs)]
        if not self.failed:
            return done
        rest = iter(done)
        return [SampleResult(NO_TOKEN, error=self.failed[i]) if i in self.failed else next(rest)
                for i in range(len(self.token_ids))]


@dataclass(slots=True)
class SampleResult:
    token_id: int
    logprob: float | None = None                     # of the sampled token (raw logits)
    top_logprobs: list[tuple[int, float]] | None = None
    rank: int | None = None                          # of the sampled token, as vLLM ranks it
    error: LogitsProcessorFailed | None = None       # why the row failed (a custom logits processor raised)
    # Speculative decoding: the tokens the same step emitted after this one, in order (the drafts
    # accepted after it, then the sampler's own); its drafts accepted are len(following) of them
    following: Sequence["SampleResult"] = ()


# --------------------------------------------------------------------------- custom logits processors
# vLLM's interface for them (vllm.v1.sample.logits_processor), so that one written for vLLM runs here
# with its imports changed. A processor sees the whole batch's logits at once and keeps per-row state,
# which update_state keeps in step with the rows: the batch's requests come and go and move between rows.

class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()  # row a's state goes to row b, and a has none after
    SWAP = enum.auto()            # rows a and b exchange their states


@dataclass(frozen=True, slots=True)
class BatchUpdate:
    """How the rows changed since the last step, as vLLM's: apply ``removed``, then ``added``
    (index, params, prompt token ids, output token ids: the request's own list, which grows as
    it does), then ``moved`` (a, b, MoveDirectionality). An index reused by ``added`` is not in
    ``removed``. Rows past ``batch_size`` hold no request."""
    batch_size: int
    removed: list[int]
    added: list[tuple[int, Any, list[int], list[int]]]
    moved: list[tuple[int, int, MoveDirectionality]]


class LogitsProcessor(abc.ABC):
    """A custom logits processor (vLLM's ``LogitsProcessor``). Loaded once at start-up
    (``logits_processors=[...]``, ``--logits-processors``); a request reaches it through
    its SamplingParams, usually ``extra_args`` (the server's ``vllm_xargs``)."""

    @classmethod
    def validate_params(cls, params) -> None:
        """Raise ValueError for a request this processor cannot take (a 400 for the server's)."""

    @abc.abstractmethod
    def __init__(self, config, device: torch.device, is_pin_memory: bool):
        """``config``: the engine's EngineConfig (vLLM passes its VllmConfig)."""

    @abc.abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The batch's logits [rows, vocab], fp32 (may be changed in place); returns the new ones."""

    @abc.abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if it never changes a row's argmax (as min_p): then greedy rows skip it, and it runs
        after temperature; else before penalties, as logit_bias."""

    @abc.abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every step's apply; None when the rows are the last step's."""


def process_dict_updates(req_entries: dict[int, Any], batch_update: BatchUpdate | None,
                         new_state: Callable[[Any, list[int], list[int]], Any]) -> bool:
    """vLLM's helper: ``req_entries`` (row -> state) kept through ``batch_update``, a new row's state
    from ``new_state(params, prompt_ids, output_ids)`` (None: no entry). Whether anything changed."""
    if batch_update is None:
        return False
    changed = False
    for index in batch_update.removed:
        changed |= req_entries.pop(index, None) is not None
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        old = req_entries.pop(index, None)
        if state is not None:
            req_entries[index] = state
        changed |= state is not None or old is not None
    for a, b, direction in batch_update.moved:
        a_state, b_state = req_entries.pop(a, None), req_entries.pop(b, None)
        if a_state is not None:
            req_entries[b] = a_state
        if b_state is not None and direction == MoveDirectionality.SWAP:
            req_entries[a] = b_state
        changed |= a_state is not None or b_state is not None
    return changed


class AdapterLogitsProcessor(LogitsProcessor):
    """vLLM's wrapper for per-request processors: new_req_logits_processor(params) gives a
    request's function, of (output_ids, logits_row) or (prompt_ids, output_ids, logits_row),
    returning the row, or None where the request needs none."""

    def __init__(self, config, device: torch.device, is_pin_memory: bool):
        self.req_info: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    @abc.abstractmethod
    def new_req_logits_processor(self, params) -> Callable | None:
        ...

    def _new_state(self, params, prompt_ids: list[int], output_ids: list[int]):
        fn = self.new_req_logits_processor(params)
        if fn is None:
            return None
        arity = len(inspect.signature(fn).parameters)
        if arity not in (2, 3):
            raise ValueError(f"a request's logits processor takes (output_ids, logits) or (prompt_ids, "
                             f"output_ids, logits), not {arity} arguments")
        return functools.partial(fn, output_ids) if arity == 2 else functools.partial(fn, prompt_ids, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, fn in self.req_info.items():
            logits[row] = fn(logits[row])
        return logits


class LogitsProcessorFailed(Exception):
    """A custom processor raised (its update_state or apply): the sampler finds the rows it fails for.
    Its words are for the log; a client is told only which processor (``processor``)."""

    def __init__(self, processor: LogitsProcessor, error: Exception):
        self.processor = type(processor).__name__
        super().__init__(f"the logits processor {self.processor} failed: {type(error).__name__}: {first_line(error)}")


class LogitsProcessorBatch:
    """The custom processors, and the order of requests in their rows: vLLM's persistent batch,
    made here from each step's rows (only those that sample). A request keeps its row while
    it runs; new ones take free rows, then swaps put every request at its row of this step."""

    def __init__(self, processors: list[LogitsProcessor]):
        self.processors = processors
        self.before = [p for p in processors if not p.is_argmax_invariant()]  # beside logit_bias
        self.after = [p for p in processors if p.is_argmax_invariant()]       # beside min_p
        self.rows: list[int | None] = []  # the request (its serial) in each row

    def update(self, rows: list[SampleRequest]) -> None:
        ids = [r.serial for r in rows]
        update = None if ids == self.rows else self._batch_update(rows, ids)
        try:
            for p in self.processors:
                _call_processor(p, p.update_state, update)
        except BaseException:  # some processors saw the update, some not: the next one removes every row and
            self.rows = [-1] * len(self.rows)  # adds them again, for all of them (-1: no request's)
            raise

    @staticmethod
    def apply(processors: list[LogitsProcessor], logits: torch.Tensor) -> torch.Tensor:
        """Each processor's apply in turn; what is not logits of the shape it was given fails as a raise
        does (else the sampler's next step on it would fail every row of the step)."""
        for p in processors:
            out = _call_processor(p, p.apply, logits)
            if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
                what = (f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor)
                        else "None" if out is None else f"a {type(out).__name__}")
                raise LogitsProcessorFailed(p, TypeError(f"apply returned {what}, not logits of shape "
                                                         f"{tuple(logits.shape)}"))
            logits = out
        return logits

    def _batch_update(self, rows: list[SampleRequest], ids: list[int]) -> BatchUpdate:
        now = set(ids)
        slots = self.rows + [None] * (len(ids) - len(self.rows))
        removed = [i for i, rid in enumerate(slots) if rid is not None and rid not in now]
        for i in removed:
            slots[i] = None
        free = iter([i for i, rid in enumerate(slots) if rid is None])
        at = {rid: i for i, rid in enumerate(slots) if rid is not None}
        added = []
        for r in rows:
            if r.serial not in at:
                i = at[r.serial] = next(free)
                slots[i] = r.serial
                added.append((i, r.params, r.prompt_token_ids, r.output_token_ids))
        reused = {i for i, *_ in added}
        moved = []
        for j, rid in enumerate(ids):  # every request to its row of this step, a swap at a time
            i = at[rid]
            if i != j:
                other = slots[j]
                slots[i], slots[j] = other, rid
                at[rid] = j
                if other is not None:
                    at[other] = i
                moved.append((i, j, MoveDirectionality.SWAP))
        self.rows = ids
        return BatchUpdate(len(ids), [i for i in removed if i not in reused], added, moved)


def _call_processor(p: LogitsProcessor, method: Callable, arg):
    """A processor's method, whatever it raises (its own code: a bug, or a request it cannot take)
    as a LogitsProcessorFailed, which fails only the requests it fails for (Sampler.sample)."""
    try:
        return method(arg)
    except Exception as e:
        raise LogitsProcessorFailed(p, e) from e


class Sampler:
    """Batched sampling, in vLLM's order: logit bias and min_tokens -> penalties ->
    greedy or temperature -> min_p -> top-k/top-p -> sample. It runs where the
    logits are (the GPU's stay there): per-request parameters become one small
    tensor each, built on the host and copied once; nothing loops over requests
    on the device, and only the sampled ids (and requested logprobs) come back,
    in one copy. Logprobs come from the raw logits."""

    def __init__(self, seed: int = 0, argmax=kernels.argmax_torch, logits_processors: list[LogitsProcessor] = (),
                 top_k_top_p=kernels.top_k_top_p_reference):
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}  # unseeded rows' draws, per device
        self.argmax = argmax  # the backend's: greedy rows' argmax of the model's own logits
        self.top_k_top_p = top_k_top_p  # the backend's: apply_top_k_top_p's masks
        self.custom = LogitsProcessorBatch(list(logits_processors)) if logits_processors else None

    def __call__(self, logits: torch.Tensor, rows: list[SampleRequest]) -> list[SampleResult]:
        return self.sample(logits, rows).results()

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, rows: list[SampleRequest]) -> SamplerOutput:
        """logits [rows, vocab] in the model's dtype; every step but a greedy one
        without bias or penalties works on an fp32 copy. A custom processor that raises
        fails only the rows it raises for (SamplerOutput.failed)."""
        try:
            return self._sample_batch(logits, rows)
        except LogitsProcessorFailed as e:
            logger.warning("[model] %s; finding the requests it fails for, a row at a time", e, exc_info=True)
            return self._sample_isolating(logits, rows)

    def _sample_isolating(self, logits: torch.Tensor, rows: list[SampleRequest]) -> SamplerOutput:
        """Each row sampled alone finds those a processor raises for; the rest are sampled again
        together (all failed if it raises for them together). The processors see the rows
        removed and added again (as a preempted request's): state they keep per row is rebuilt."""
        failed = {}
        for i, r in enumerate(rows):  # the unseeded rows' draws are thrown away: the generator moves on
            try:
                self._sample_batch(logits[i:i + 1], [r])
            except LogitsProcessorFailed as e:
                failed[i] = e
        keep = [i for i in range(len(rows)) if i not in failed]
        try:
            out = self._sample_batch(logits[keep], [rows[i] for i in keep]) if keep else None
        except LogitsProcessorFailed as e:
            failed.update(dict.fromkeys(keep, e))
            out = None
        token_ids = torch.zeros(len(rows), dtype=torch.long, device=logits.device)  # a failed row's: any valid id
        if out is None:
            return SamplerOutput(token_ids, token_ids.new_empty(0), [], failed)
        token_ids[to_device(keep, logits.device)] = out.token_ids
        return SamplerOutput(token_ids, out.packed, out.num_logprobs, failed)

    def _sample_batch(self, logits: torch.Tensor, rows: list[SampleRequest]) -> SamplerOutput:
        raw, none_left = logits, None
        ps = [r.params for r in rows]
        greedy = [p.temperature == 0.0 for p in ps]
        custom = self.custom
        if custom is not None:
            custom.update(rows)
        if all(greedy) and not _has_bias_or_bans(rows) and not _has_penalties(ps) and not (custom and custom.before):
            # the common case, and a pass over memory less: argmax of the model's own logits
            tokens = self.argmax(logits)
        else:
            logits = self._apply_bias_and_bans(logits.float(), rows)
            if custom is not None and custom.before:
                logits = logits.clone() if logits is raw else logits  # raw: what logprobs read
                logits = custom.apply(custom.before, logits)
            logits = self._apply_penalties(logits, rows)
            if _has_bias_or_bans(rows) or custom is not None:  # a row left all -inf would "sample" id 0: flag it
                none_left = logits.amax(dim=-1).isneginf()
            tokens = logits.argmax(dim=-1) if all(greedy) else self._sample(logits, rows, greedy)
        ids = tokens if none_left is None else tokens.masked_fill(none_left, NO_TOKEN)
        want = [p.logprobs for p in ps]
        if all(w is None for w in want):
            return SamplerOutput(tokens, ids, want)
        listed = [p.logprob_token_ids or [] for p in ps]
        width = max(w or 0 for w in want)
        chosen = None if not any(listed) else to_device([ids + [-1] * (width - len(ids)) for ids in listed],
                                                          raw.device)
        packed = logprob_rows(raw, tokens, width, chosen)
        if none_left is not None:
            packed[:, 0] = ids  # the flag rides in the one copy to the host
        return SamplerOutput(tokens, packed, want)

    def _apply_bias_and_bans(self, logits, rows):
        if not _has_bias_or_bans(rows):
            return logits
        logits = logits.clone()  # written in place below; fp32 logits' .float() is the raw tensor logprobs read
        dev = logits.device
        tensors = [r.tensors or SamplingTensors.of(r.params) for r in rows]
        biased = [(i, t) for i, t in enumerate(tensors) if t.bias_ids is not None]
        if biased:
            rows_of = torch.repeat_interleave(torch.tensor([i for i, _ in biased]),
                                              torch.tensor([t.bias_ids.numel() for _, t in biased]))
            ids, values = (torch.cat([getattr(t, name) for _, t in biased]) for name in ("bias_ids", "bias_values"))
            logits.index_put_((to_device(rows_of, dev), to_device(ids, dev)), to_device(values, dev), accumulate=True)
        bans = [(i, t) for i, r in enumerate(rows) for t in r.banned_token_ids]
        if bans:
            i, t = zip(*bans)
            # a 0-d tensor made on the device: torch would copy a Python scalar there, a host sync
            logits.index_put_((to_device(i, dev), to_device(t, dev)), logits.new_full((), float("-inf")))
        for i, t in enumerate(tensors):  # allowed_token_ids: every other token banned (rare: a row at a time)
            if t.allowed_ids is not None:
                keep = to_device(t.allowed_ids, dev)
                logits[i] = torch.full_like(logits[i], float("-inf")).index_copy_(0, keep, logits[i, keep])
        masked = [i for i, r in enumerate(rows) if r.allowed_token_bitmask is not None]
        if masked:  # structured outputs: unpack each row's bitmask on the device, ban what it does not allow
            idx = to_device(masked, dev)
            words = to_device(torch.stack([rows[i].allowed_token_bitmask for i in masked]), dev)
            allowed = ((words[:, :, None] >> torch.arange(32, device=dev, dtype=torch.int32)) & 1).flatten(1)
            logits[idx] = logits[idx].masked_fill(allowed[:, :logits.shape[1]] == 0, float("-inf"))
        return logits

    def _apply_penalties(self, logits, rows):
        ps = [r.params for r in rows]
        if not _has_penalties(ps):
            return logits
        dev, dtype = logits.device, logits.dtype
        counts = torch.zeros_like(logits)
        out = [(i, t) for i, r in enumerate(rows) for t in r.output_token_ids]
        if out:
            i, t = zip(*out)
            counts.index_put_((to_device(i, dev), to_device(t, dev)),
                              torch.ones(len(i), dtype=dtype, device=dev), accumulate=True)
        seen = counts > 0
        prompt = [(i, t) for i, r in enumerate(rows) if ps[i].repetition_penalty != 1
                  for t in r.prompt_token_ids]
        if prompt:
            i, t = zip(*prompt)
            # a device scalar: `= True` would copy a host one with a blocking copy (a sync per step)
            seen.index_put_((to_device(i, dev), to_device(t, dev)), seen.new_ones(()))

        def column(name):
            return to_device([getattr(p, name) for p in ps], dev, dtype)[:, None]
        rep = column("repetition_penalty")
        # repetition (CTRL): divide positive logits, multiply negative ones, for seen tokens
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        # OpenAI's formula: mu - c * alpha_frequency - (c > 0) * alpha_presence
        return logits - counts * column("frequency_penalty") - (counts > 0).to(dtype) * column("presence_penalty")

    def _sample(self, logits, rows, greedy):
        dev = logits.device
        argmax = logits.argmax(dim=-1)
        sampled = self._draw(self._truncated(logits, rows, greedy).softmax(dim=-1), self._uniforms(rows, dev))
        return torch.where(to_device(greedy, dev), argmax, sampled)

    def _truncated(self, logits, rows, greedy):
        """The logits a random row samples from: over its temperature, then min-p, the custom
        processors that act after them, top-k and top-p."""
        ps, dev = [r.params for r in rows], logits.device
        temp = to_device([1.0 if g else p.temperature for g, p in zip(greedy, ps)], dev)[:, None]
        logits = logits / temp
        if any(p.min_p > 0 for p in ps):
            probs = logits.softmax(dim=-1)
            min_p = to_device([p.min_p for p in ps], dev)[:, None]
            threshold = probs.amax(dim=-1, keepdim=True) * min_p
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if self.custom is not None:
            logits = self.custom.apply(self.custom.after, logits)
        return self.top_k_top_p(logits, [p.top_k for p in ps], [p.top_p for p in ps])

    @staticmethod
    def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Each row's token by the inverse of its distribution function: the first whose
        cumulative probability reaches u x the row's total. u in (0, 1], so the token found
        has probability > 0 (the sum rises at it); fp64 sums, so the tail keeps its share.
        One number a row, where noise over the whole vocabulary (the exponential race)
        took most of a sampling step on the CPU (RESULTS.md, "non-greedy sampling")."""
        cdf = probs.double().cumsum(dim=-1)
        # clamped for a row of NaNs (nothing left to sample), which the caller flags
        return torch.searchsorted(cdf, u[:, None] * cdf[:, -1:]).squeeze(1).clamp_(max=probs.shape[-1] - 1)

    def _uniforms(self, rows, dev: torch.device, offsets: list[int] | None = None, count: int = 1) -> torch.Tensor:
        """A number in (0, 1] for each row (fp64; ``count`` > 1: [count, rows], the speculative
        sampler's draft test and draw): unseeded rows from the sampler's own generator, a seeded
        row from one seeded by (seed, output index), so it draws the same however it was batched,
        chunked or preempted. ``offsets``: each row's position past its next token (a draft's)."""
        if dev not in self.generators:
            self.generators[dev] = torch.Generator(device=dev).manual_seed(self.seed)
        u = torch.rand(count, len(rows), dtype=torch.float64, device=dev, generator=self.generators[dev])
        for i, r in enumerate(rows):
            if r.params.seed is not None:  # the token this row samples
                index = len(r.output_token_ids) + r.num_output_placeholders + (offsets[i] if offsets else 0)
                g = torch.Generator(device=dev).manual_seed(hash((r.params.seed, index)) & 0x7FFF_FFFF_FFFF_FFFF)
                u[:, i] = torch.rand(count, dtype=torch.float64, device=dev, generator=g).flip(0)
        u = 1.0 - u  # rand is in [0, 1)
        return u[0] if count == 1 else u

    @torch.no_grad()
    def sample_speculative(self, logits: torch.Tensor, rows: list[SampleRequest],
                           drafts: list[list[int]]) -> "SpecSamplerOutput":
        """A step where some rows have drafts: row i has len(drafts[i]) + 1 rows of logits. The rows
        without drafts go through the whole sampler (``sample``: penalties, bans, min_tokens, grammars
        act on them), those with drafts through the rejection sampler (``_sample_drafted``)."""
        plain = [i for i, d in enumerate(drafts) if not d]
        if not plain:
            return self._sample_drafted(logits, rows, drafts)
        first = list(itertools.accumulate([len(d) + 1 for d in drafts], initial=0))
        drafted = [i for i, d in enumerate(drafts) if d]
        spec_rows = [j for i in drafted for j in range(first[i], first[i + 1])]
        out = self._sample_drafted(logits[to_device(spec_rows, logits.device)], [rows[i] for i in drafted],
                                   [drafts[i] for i in drafted])
        out.plain = (plain, self.sample(logits[to_device([first[i] for i in plain], logits.device)],
                                        [rows[i] for i in plain]))
        return out

    def _sample_drafted(self, logits: torch.Tensor, rows: list[SampleRequest],
                        drafts: list[list[int]]) -> "SpecSamplerOutput":
        """vLLM's rejection sampler for drafts without a distribution (n-gram's: one-hot). Row i has
        len(drafts[i]) + 1 rows of logits, one a position: draft t at a position is accepted where a
        greedy row's argmax is t, and a random row's with probability p(t), p its distribution after
        bias, temperature, min-p, top-k and top-p; at the first rejection the row samples from p less
        t (renormalized), so each token it emits has p's distribution; with all accepted, one more
        (the bonus) is sampled from the last position's p. The engine sends no row that penalties,
        bans, a grammar or custom processors act on (their logits would differ from one position to
        the next); logit_bias and allowed_token_ids act alike at every position."""
        dev = logits.device
        counts = [len(d) + 1 for d in drafts]
        expanded = [r for r, c in zip(rows, counts) for _ in range(c)]
        offsets = [j for c in counts for j in range(c)]  # each position's output index past the row's
        draft = to_device(host_ints(itertools.chain.from_iterable([*d, -1] for d in drafts)), dev)
        greedy = [r.params.temperature == 0.0 for r in expanded]
        has_draft = draft >= 0
        x, none_left = logits, None
        if _has_bias_or_bans(expanded):
            x = self._apply_bias_and_bans(logits.float(), expanded)
            none_left = x.amax(dim=-1).isneginf()
        argmax = self.argmax(logits) if x is logits else x.argmax(dim=-1)
        accept, token = draft == argmax, argmax
        if not all(greedy):
            probs = self._truncated(x.float(), expanded, greedy).softmax(dim=-1)
            index = draft.clamp(min=0)[:, None]
            p_draft = probs.gather(1, index).squeeze(1)
            rest = probs.scatter(1, index, 0.0).where(has_draft[:, None], probs)  # p less the draft
            u_accept, u_draw = self._uniforms(expanded, dev, offsets, count=2)
            random = ~to_device(greedy, dev)
            # where p is all on the draft, rest is empty: never rejected (u <= 1 = p(t)), drawn from nothing
            accept = torch.where(random, has_draft & (u_accept <= p_draft), accept)
            token = torch.where(random, self._draw(rest, u_draw), token)
        token = torch.where(accept, draft, token)
        if none_left is not None:
            token, accept = token.masked_fill(none_left, NO_TOKEN), accept & ~none_left
        want = [r.params.logprobs for r in expanded]
        if all(w is None for w in want):
            packed = torch.stack([token, accept.long()], dim=1)
        else:
            listed = [r.params.logprob_token_ids or [] for r in expanded]
            width = max(w or 0 for w in want)
            chosen = None if not any(listed) else to_device([ids + [-1] * (width - len(ids)) for ids in listed], dev)
            packed = logprob_rows(logits, token.clamp(min=0), width, chosen)
            packed[:, 0] = token
            packed = torch.cat([packed, accept.double()[:, None]], dim=1)
        return SpecSamplerOutput(token, packed, want, counts)


@dataclass(slots=True)
class SpecSamplerOutput:
    """A speculative step's samples (Sampler.sample_speculative), one row a position: the token each
    emits, whether its draft was accepted, and logprobs if asked (``packed``, one copy to the host).
    ``counts``: each sequence's positions. Its results() has one SampleResult a sequence, the rest of
    what it emitted in ``following``."""
    token_ids: torch.Tensor
    packed: torch.Tensor
    num_logprobs: list[int | None]
    counts: list[int]
    # the step's sequences without drafts (their indices among all), sampled by Sampler.sample
    plain: tuple[list[int], SamplerOutput] | None = None

    def results(self) -> list[SampleResult]:
        drafted = self._drafted_results()
        if self.plain is None:
            return drafted
        indices, out = self.plain
        merged = dict(zip(indices, out.results()))
        rest = iter(drafted)
        return [merged[i] if i in merged else next(rest) for i in range(len(indices) + len(drafted))]

    def _drafted_results(self) -> list[SampleResult]:
        host = self.packed.tolist()
        if self.packed.dtype == torch.int64:
            rows = [SampleResult(t) for t, _ in host]
        else:
            rows = [SampleResult(r.token_id) if w is None else SampleResult(r.token_id, r.logprob, r.top[:w], r.rank)
                    for r, w in zip(unpack_logprob_rows([h[:-1] for h in host]), self.num_logprobs)]
        out, start = [], 0
        for c in self.counts:
            emitted = []
            for j in range(start, start + c):  # up to the first rejected draft, or the bonus
                emitted.append(rows[j])
                if not host[j][-1] or rows[j].token_id == NO_TOKEN:
                    break
            emitted[0].following = emitted[1:]
            out.append(emitted[0])
            start += c
        return out


@dataclass(slots=True)
class TokenLogprobs:
    """One row's raw logprob of a given token, its rank (vLLM's: the number of
    tokens with a logprob at least as great) and the row's top tokens."""
    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """Each row's log-softmax of the raw logits at ``token_ids[row]`` (vLLM's
    ``raw_logprobs``), its rank and the row's top ``k``, in one copy to the host."""
    return unpack_logprob_rows(logprob_rows(logits, token_ids, k).tolist())


def logprob_rows(logits: torch.Tensor, token_ids: torch.Tensor, k: int,
                 listed: torch.Tensor | None = None) -> torch.Tensor:
    """gather_logprobs' values where the logits are, one float64 row each (it holds
    the int64 ids and the fp32 logprobs exactly): id, logprob, rank, top k values, their ids.
    ``listed`` [rows, k]: a row's logprob_token_ids (-1 past them, and for a row without),
    which replace its top ones."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs >= chosen).sum(dim=-1, keepdim=True)  # as vLLM: a tie takes the worse rank
    top_v, top_i = logprobs.topk(k, dim=-1)
    if listed is not None:
        mine = listed >= 0
        top_i = torch.where(mine, listed, top_i)
        top_v = torch.where(mine, logprobs.gather(1, listed.clamp(min=0)), top_v)
    return torch.cat([token_ids[:, None].double(), chosen.double(), ranks.double(), top_v.double(), top_i.double()], 1)


def unpack_logprob_rows(host: list[list[float]]) -> list[TokenLogprobs]:
    k = (len(host[0]) - 3) // 2 if host else 0
    return [TokenLogprobs(int(row[0]), row[1], int(row[2]), [(int(i), v) for v, i in zip(row[3:3 + k], row[3 + k:])])
            for row in host]


def _has_bias_or_bans(rows: list[SampleRequest]) -> bool:
    return any(r.params.logit_bias or r.banned_token_ids or r.allowed_token_bitmask is not None
               or r.params.allowed_token_ids for r in rows)


def _has_penalties(ps: list) -> bool:
    return any(p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1
               for p in ps)


# Top-k up to this many takes each row's k-th largest logit from topk; a row with a larger k is
# sorted, as a top-p row is.
TOP_K_WITHOUT_SORT = 1024


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask each row's logits below its threshold: its k-th largest logit (top-k), raised to the
    least logit of its top-p nucleus (the most likely tokens until their probability, after
    top-k, reaches top_p; at least one). Ties of a threshold are all kept: the set does not
    depend on how a sort orders equal logits. The reference (Backend.top_k_top_p's): top-p
    rows are sorted; a backend may decide them otherwise, with the same masks."""
    V = logits.shape[-1]
    top_k = [k if 0 < k < V else 0 for k in top_k]
    if not any(top_k) and all(p >= 1.0 for p in top_p):
        return logits
    K = min(V, TOP_K_WITHOUT_SORT)
    # top-k alone needs only each row's k largest
    candidates = logits.topk(max(1, min(K, max(top_k))), dim=-1).values
    threshold = top_k_top_p_thresholds(candidates, top_k, [1.0] * len(top_k))
    sort = [i for i, (k, p) in enumerate(zip(top_k, top_p)) if k > K or p < 1.0]
    if sort:
        sort_rows_for_thresholds(logits, sort, top_k, top_p, threshold)
    return logits.masked_fill(logits < threshold, float("-inf"))


def sort_rows_for_thresholds(logits: torch.Tensor, rows: list[int], top_k: list[int], top_p: list[float],
                             threshold: torch.Tensor) -> None:
    """The thresholds of ``rows`` (in place) from their whole rows, sorted."""
    index = to_device(rows, logits.device)
    some = logits if len(rows) == len(top_k) else logits[index]  # all rows: no copy
    whole = some.sort(dim=-1, descending=True).values
    threshold[index] = top_k_top_p_thresholds(whole, [top_k[i] for i in rows], [top_p[i] for i in rows])


def top_k_top_p_thresholds(largest: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Each row's threshold from its largest logits, descending (the whole row sorted where it
    has top-p). A row whose k is past them is given a wrong one: its caller sorts it."""
    dev, K = largest.device, largest.shape[-1]
    k = to_device(top_k, dev)[:, None]
    kth = largest.gather(1, (k - 1).clamp(0, K - 1)).masked_fill(k == 0, float("-inf"))
    if all(p >= 1.0 for p in top_p):
        return kth
    p = to_device(top_p, dev, largest.dtype)[:, None]
    if any(top_k):
        largest = largest.masked_fill(largest < kth, float("-inf"))
    probs = largest.softmax(dim=-1)
    # the nucleus: the tokens before the first whose running sum reaches top_p, and that one
    n = torch.searchsorted(probs.cumsum(dim=-1), p) + 1
    least = largest.gather(1, n.clamp(max=K) - 1).masked_fill(p >= 1.0, float("-inf"))
    return torch.maximum(kth, least)


# =========================================================================== the runner

def host_ints(values: Iterable[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-D host tensor of Python ints by way of the stdlib's array: several
    times faster than torch.tensor, which converts a list element by element.
    (array() grows item by item from an iterator, but sizes itself once from a list.)"""
    data = array({torch.int64: "q", torch.int32: "i"}[dtype], values if isinstance(values, list) else list(values))
    return torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)


def to_device(data: torch.Tensor | list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor (or a list, as torch.tensor takes it) on ``device``. On CUDA from pinned memory,
    non-blocking: a pageable copy waits for the stream to drain, which would hold step N+1's launch
    behind step N. (The caching host allocator keeps a freed pinned block until its copy has run.)"""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def block_table_tensor(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one int32 host tensor, each padded with block 0 to the longest."""
    width = max(map(len, tables))
    rows = itertools.chain.from_iterable(t + [0] * (width - len(t)) for t in tables)
    return host_ints(rows, torch.int32).view(len(tables), width)


@dataclass(slots=True)
class SeqInput:
    """One request's share of a step, as the engine hands it over (plain data)."""
    token_ids: list[int]          # the tokens to compute this step
    start: int                    # position of token_ids[0]
    block_table: list[int]
    sample: SampleRequest | None  # None: a prefill chunk that samples nothing
    # prompt_logprobs: the prompt tokens that rows 0, 1, ... of this chunk predict
    # (each row's logprob of its next token), and how many top tokens to report
    prompt_logprob_ids: list[int] | None = None
    num_prompt_logprobs: int = 0
    # async scheduling: its one input token is the one the previous step sampled in
    # this row (not on the host yet); token_ids holds a stand-in
    prev_sample_row: int | None = None
    # a prompt given as embeddings (vLLM's prompt_embeds): the inputs of this chunk's first
    # rows, in the place of their token ids' embeddings (stand-ins)
    prompt_embeds: torch.Tensor | None = None
    lora_int_id: int | None = None  # the LoRA adapter it runs with (ModelRunner.add_lora's id)
    # speculative decoding: the draft tokens that end token_ids, each position's logits sampled
    draft_token_ids: list[int] | None = None
    # the pooling runner (embeddings): what of this chunk's final hidden states comes back,
    # "LAST" its last row, "FIRST" its first (CLS pooling's, in a prompt's first chunk), "SUM" the sum of
    # its rows (MEAN pooling, added up chunk by chunk), "MEAN" their mean (an encoder's MEAN: its prompt whole),
    # "ALL" every row (token_embed, token_classify); None: nothing
    pooling: str | None = None
    # an encoder's token types for this chunk's rows (a cross-encoder pair's, from its tokenizer); None: all 0
    token_type_ids: list[int] | None = None


@dataclass(slots=True)
class ModelRunnerOutput:
    """One step's results: a SampleResult per sequence that samples, in order,
    the prompt logprobs of the sequences that asked, and the pooled hidden states
    (fp32, on the host) of those that pool, both by their index in the step."""
    sampled: list[SampleResult]
    prompt_logprobs: dict[int, list[TokenLogprobs]]
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)


class AsyncModelRunnerOutput:
    """A launched step's results, still on the device (vLLM's AsyncGPUModelRunnerOutput). On CUDA
    their copy to pinned host memory is queued now, behind the sampler and before the next step;
    ``get()`` waits for it (the step's only device -> host sync) and returns the ModelRunnerOutput."""

    def __init__(self, sampled: SamplerOutput | None, prompt_logprobs: dict[int, list[TokenLogprobs]],
                 pooled: dict[int, torch.Tensor] | None = None):
        self.sampled, self.prompt_logprobs, self.copied = sampled, prompt_logprobs, None
        self.pooled = pooled or {}
        if sampled is not None and sampled.packed.is_cuda:
            stream = torch.cuda.current_stream(sampled.packed.device)  # the copy's, whatever device is current
            sampled.packed = sampled.packed.to("cpu", non_blocking=True)  # into pinned memory
            self.copied = torch.cuda.Event()
            self.copied.record(stream)

    def get(self) -> ModelRunnerOutput:
        if self.copied is not None:
            self.copied.synchronize()
        return ModelRunnerOutput(self.sampled.results() if self.sampled is not None else [], self.prompt_logprobs,
                                 self.pooled)


# sentence-transformers' Dense modules (vLLM's _DENSE_MODULE_TYPES), applied to an embedding model's pooled rows
ST_DENSE_TYPES = ("sentence_transformers.models.Dense", "sentence_transformers.base.modules.dense.Dense",
                  "pylate.models.Dense.Dense")
# vLLM's get_act_fn names (a torch.nn.modules class name is read by its last part, lower-cased); xielu's
# learned parameters are not read here
ST_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda x: x, "tanh": torch.tanh, "sigmoid": torch.sigmoid, **ENCODER_ACTIVATIONS,
    "gelu_fast": functools.partial(F.gelu, approximate="tanh"), "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu2": lambda x: F.relu(x).square()}


class STDense(nn.Module):
    """One Dense module: its Linear in fp32 (vLLM's pooling head_dtype), then its activation."""

    def __init__(self, in_features: int, out_features: int, bias: bool, activation: str):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=bias, dtype=torch.float32)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ST_ACTIVATIONS[self.activation](self.linear(x))


def _st_activation(where: str, name: Any) -> str:
    """A Dense config's activation_function as vLLM's get_act_fn reads it; None or missing: none (vLLM's)."""
    if name is None:
        return "identity"
    key = str(name).lower()
    key = key.rsplit(".", 1)[-1] if key.startswith("torch.nn.modules.") else key
    if key not in ST_ACTIVATIONS:
        raise ModelLoadError(f"{where}: activation_function {name!r} is not supported ({', '.join(ST_ACTIVATIONS)} "
                             f"and torch.nn.modules' classes of those names are)")
    return key


def _st_dense_tensors(folder: Path, where: str) -> dict[str, torch.Tensor]:
    """A Dense folder's weights: model.safetensors, else pytorch_model.bin (vLLM's order)."""
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file
        return load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ModelLoadError(f"{where}: neither model.safetensors nor pytorch_model.bin is there")


def _load_st_dense(path: Path, module: dict[str, Any], in_features: int) -> STDense:
    where = f"sentence-transformers Dense module {module.get('path', '')!r}"
    folder = path / str(module.get("path") or "")
    try:
        c = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{where}: its config.json cannot be read: {first_line(e)}") from None
    sizes = {k: c.get(k) for k in ("in_features", "out_features")}
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes.values()):
        raise ModelLoadError(f"{where}: in_features and out_features must be positive integers, got {sizes}")
    if sizes["in_features"] != in_features:
        raise ModelLoadError(f"{where}: in_features {sizes['in_features']}, but the rows it is given have "
                             f"{in_features}")
    dense = STDense(sizes["in_features"], sizes["out_features"], bool(c.get("bias", True)),
                    _st_activation(where, c.get("activation_function")))
    tensors = _st_dense_tensors(folder, where)
    key = next((k for k in ("weight", "linear.weight", "dense.weight") if k in tensors), None)  # vLLM's names
    if key is None:
        raise ModelLoadError(f"{where}: its weights hold no linear.weight (nor weight, dense.weight)")
    expected = {key: dense.linear.weight}
    if dense.linear.bias is not None:
        expected[key.replace("weight", "bias")] = dense.linear.bias
    for name, param in expected.items():
        if name not in tensors:
            raise ModelLoadError(f"{where}: its config says bias, and its weights hold no {name}")
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise ModelLoadError(f"{where}: {name} has shape {tuple(tensors[name].shape)}, its config.json makes it "
                                 f"{tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensors[name])
    return dense.requires_grad_(False)


def load_st_projector(path: Path, in_features: int) -> nn.Sequential | None:
    """vLLM's _load_st_projector: the Dense modules modules.json lists, in its order, each fed the last one's
    rows (the first, the pooled hidden state's ``in_features``); None where it lists none. What vLLM logs and
    skips (a module it cannot read) is refused here, by name: serving without it gives other vectors."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
        modules = modules.get("modules", []) if isinstance(modules, dict) else modules
        dense = [m for m in modules if m.get("type") in ST_DENSE_TYPES]
    except (ValueError, AttributeError) as e:
        raise ModelLoadError(f"{modules_file} (sentence-transformers) cannot be read: {first_line(e)}") from None
    layers = []
    for module in dense:
        layers.append(_load_st_dense(path, module, in_features))
        in_features = layers[-1].linear.out_features
    return nn.Sequential(*layers) if layers else None


def pool_hidden_states(seqs: list[SeqInput], hidden: torch.Tensor,
                       score: nn.Module | None = None) -> dict[int, torch.Tensor]:
    """The pooling sequences' share of a step's final-norm hidden states (vLLM's pooler, before its
    activation), in fp32 on the host: a chunk's last row, its first, the sum or mean of its rows, or all of them,
    through a classifier's ``score`` head or ColBERT's projection where it has one (a decoder's head is linear, so
    a MEAN's chunk sums may pass it one by one; an encoder's whole prompt passes its mean, as ModernBERT's head
    needs).
    The rows are the sequences' tokens in order (a padded decode has one per sequence, its one token);
    CLS's first row is its prompt's first token's (a pooling sequence never decodes)."""
    out, start = {}, 0
    for i, s in enumerate(seqs):
        end = start + len(s.token_ids)
        if s.pooling == "LAST":
            out[i] = hidden[end - 1].float()
        elif s.pooling == "FIRST":
            out[i] = hidden[start].float()
        elif s.pooling == "SUM":
            out[i] = hidden[start:end].float().sum(0)
        elif s.pooling == "MEAN":  # a whole prompt's (an encoder's): a head that is not linear must see the mean
            out[i] = hidden[start:end].float().mean(0)
        elif s.pooling == "ALL":
            out[i] = hidden[start:end].float()
        start = end
    if score is not None and out:  # one matmul per head: the rows of its sequences, split back after
        token_head = getattr(score, "token_head", score)  # a head whose token-wise use differs (BERT's)
        for head, kind in ((score, False), (token_head, True)):
            mine = {i: v for i, v in out.items() if (seqs[i].pooling == "ALL") == kind}
            if mine:
                rows = [v.reshape(-1, v.shape[-1]) for v in mine.values()]
                logits = head(torch.cat(rows)).split([len(r) for r in rows])
                out.update({i: x.reshape(*v.shape[:-1], -1) for (i, v), x in zip(mine.items(), logits)})
    return {i: v.cpu() for i, v in out.items()}


def dummy_step(cfg: ModelConfig, q_lens: list[int], block_size: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A throwaway step for warm-up and profiling: sequence i is a fresh prompt of
    ``q_lens[i]`` tokens (1: a decode-shaped one); its KV slots are all -1 (stored
    nowhere) and its block table all block 0 (read only)."""
    T, width = sum(q_lens), -(-max(q_lens) // block_size)
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n) for n in q_lens]) % cfg.max_position_embeddings
    meta = AttentionMetadata(torch.full((T,), -1, dtype=torch.int64, device=device),
                             torch.zeros(len(q_lens), width, dtype=torch.int32, device=device),
                             torch.tensor(q_lens, dtype=torch.int32, device=device), starts.to(device))
    return torch.zeros(T, dtype=torch.long, device=device), positions.to(device), meta


# The sampling that takes the most memory a row: fp32 copies for penalties, min-p,
# the top-k/top-p sort (values and int64 indices) and logprobs. A profile run
# samples with it, as vLLM's runs a dummy sampler: with a 150k vocabulary and
# 256 rows that is more than a GiB beyond the logits. (Its logprobs: the server's max_logprobs.)
PROFILE_SAMPLING = dict(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, seed=None, presence_penalty=0.5,
                        frequency_penalty=0.5, repetition_penalty=1.1, logit_bias=None, allowed_token_ids=None,
                        logprob_token_ids=None)


@torch.inference_mode()
def profile_activation_bytes(model: CausalLM, num_tokens: int, num_sample_rows: int,
                             block_size: int, sample: bool = True, logprobs: int = MAX_LOGPROBS) -> int:
    """vLLM's profile run, on a CUDA device: the memory that one step at full budget
    (a forward of ``num_tokens`` tokens, then ``num_sample_rows`` rows of logits,
    sampled with PROFILE_SAMPLING and ``logprobs`` top logprobs unless ``sample`` is False) takes at its peak
    beyond what is already allocated, so that the KV cache is sized from what is
    left rather than from all free memory. The attention reads a one-block
    throwaway cache."""
    device = model.model.embed_tokens.weight.device
    cfg, dtype = model.config, model.model.embed_tokens.weight.dtype
    kv_heads = num_kv_heads_per_rank(cfg.num_kv_heads, model.tp.world_size)
    cache = torch.zeros(1, block_size, kv_heads, cfg.head_dim, dtype=dtype, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    # With LoRA layers, every row through every slot (the padded path's ops): a step with adapter rows
    # holds a delta as wide as each adapted layer's output beside it, which a base-only forward would leave
    # out of the KV cache's sizing (and out of the graphs' pool, whose LoRA variants share it)
    lora = lora_layer(model)
    step = None if lora is None else lora.step
    if step is not None:
        step.mask = torch.ones(num_tokens, lora.lora_a.shape[0], dtype=lora.lora_a.dtype, device=device)
    try:
        hidden = model(*dummy_step(cfg, [num_tokens], block_size, device), [(cache, cache)] * cfg.num_layers)
    finally:
        if step is not None:
            step.mask = None
    logits = model.compute_logits(hidden[:num_sample_rows]) if sample else None
    if logits is not None:  # None: a graph (it holds no logits) or a tensor-parallel rank other than 0
        vocab = logits.shape[1]  # logprobs -1 (--max-logprobs -1): the whole vocabulary
        params = SimpleNamespace(**PROFILE_SAMPLING, logprobs=vocab if logprobs == -1 else min(logprobs, vocab))
        rows = [SampleRequest(params, [0], [0]) for _ in range(logits.shape[0])]
        Sampler()(logits, rows)
    del logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del hidden, cache
    torch.cuda.empty_cache()  # else the freed activations would count as used a second time
    return peak


def step_activation_bytes(model: CausalLM, cache: CacheConfig) -> tuple[int, int]:
    """On CUDA, what the KV cache must leave free: a full step's activations
    (the profiling forward), and the CUDA graphs' pool (0 without graphs)."""
    # a step's logits: its sampled rows, or a prompt-logprobs slice if that is larger
    rows = min(max(cache.profile_rows, PROMPT_LOGPROB_ROWS), cache.profile_tokens)
    phase = f"a step of {cache.profile_tokens} tokens: lower --max-num-batched-tokens"
    try:
        activations = profile_activation_bytes(model, cache.profile_tokens, rows, cache.block_size,
                                               logprobs=cache.profile_logprobs)  # --max-logprobs: its top-k's memory
        logger.info("[kvcache] profiling forward of %d tokens: activations peak at %.2f GiB",
                    cache.profile_tokens, activations / 2**30)
        if cache.graph_tokens:  # the graphs' pool keeps one decode forward of the largest size
            phase = f"the CUDA graphs' decode batch of {cache.graph_tokens}: lower --max-num-seqs, or --enforce-eager"
            graphs = profile_activation_bytes(model, cache.graph_tokens, cache.graph_tokens, cache.block_size,
                                              sample=False)  # a graph holds the forward only
            logger.info("[kvcache] CUDA graphs of up to %d sequences: %.2f GiB kept for their pool",
                        cache.graph_tokens, graphs / 2**30)
            return activations, graphs
    except torch.OutOfMemoryError as e:  # the weights leave less than one step needs
        raise ValueError(f"[kvcache] out of GPU memory in the profiling forward that sizes the KV cache, {phase} "
                         f"(--gpu-memory-utilization cannot help: no KV cache is allocated yet; "
                         f"--kv-cache-memory-bytes skips the profiling): {first_line(e)}") from None
    return activations, 0


def plan_rank_kv_cache(model: CausalLM, weight_bytes: int, cache: CacheConfig) -> tuple[KVCacheSpec, KVCachePlan]:
    """This rank's KV cache: its KV heads only, as many blocks as its budget
    (kvcache.kv_budget) buys here, then the smallest count over the ranks (every
    rank must hold every block the block manager hands out). Every rank calls
    this at start-up."""
    model.tp.barrier()  # ranks finish loading at their own pace; the profiling's collectives wait COLLECTIVE_TIMEOUT
    cfg = model.config
    device, dtype = model.model.embed_tokens.weight.device, model.model.embed_tokens.weight.dtype
    kv_heads = num_kv_heads_per_rank(cfg.num_kv_heads, model.tp.world_size)
    spec = KVCacheSpec(cfg.num_layers, kv_heads, cfg.head_dim, dtype, cache.block_size, bool(cfg.kv_lora_rank))
    budget, graph_pool = kvcache.kv_budget(cache, spec, weight_bytes, device, cfg.max_position_embeddings,
                                           lambda: step_activation_bytes(model, cache))
    plan = kvcache.plan_kv_cache(spec, budget, cache.num_kv_blocks)
    plan.graph_pool_bytes = graph_pool  # the engine checks the captured graphs against it
    num_blocks = model.tp.min(plan.num_blocks)
    if num_blocks < plan.num_blocks:
        logger.info("[kvcache] rank %d could hold %d blocks; %d, the fewest any rank can",
                    model.tp.rank, plan.num_blocks, num_blocks)
        plan = dataclasses.replace(plan, num_blocks=num_blocks)
    return spec, plan


def log_tensor_parallel(tp: TPGroup, weight_bytes: int, spec: KVCacheSpec, plan: KVCachePlan) -> None:
    if tp.world_size > 1:
        logger.info("[model] tensor parallel: rank %d of %d (%s), %d KV head(s) per layer: weights "
                    "%.1f MiB, KV cache %.1f MiB (%d blocks)", tp.rank, tp.world_size, dist.get_backend(),
                    spec.num_kv_heads, weight_bytes / 2**20, plan.num_blocks * plan.bytes_per_block / 2**20,
                    plan.num_blocks)


class TensorParallelError(RuntimeError):
    """A collective failed: a worker died, hung, or lost its connection."""


# Warm-up steps: a prefill long enough for the compiled elementwise ops
# (cpu_backend.COMPILED_ELEMENTWISE_MIN_ROWS), and a decode; then on CUDA the
# backend's own warm-up (Triton's other attention tiles and split-KV counts).
WARMUP_PREFILL_TOKENS = 256
PROMPT_LOGPROB_ROWS = 256  # rows of prompt logprobs computed at once (as many as a default step samples)


def cudagraph_capture_sizes(max_num_seqs: int, max_size: int = 512) -> list[int]:
    """The decode batch sizes captured by default: 1, 2, 4, then every multiple of 8, up to
    min(max_num_seqs, ``max_size``), itself included (the engine passes the most rows a decode
    step has: max_num_seqs, or max_num_batched_tokens if smaller, which caps vLLM's list too).
    vLLM's default list is the same up to 256; past it vLLM steps by 16, and it ends at
    min(2 x max_num_seqs, 512) whether or not max_num_seqs is on it: its sizes count a step's
    tokens (its piecewise graphs serve prefill chunks too, and speculative decoding has several
    tokens a sequence), while the graphs here are decode-only, one row per sequence: a larger one
    would never replay, and a full batch (up to max_size) gets its own."""
    limit = min(max_num_seqs, max_size)
    return sorted({s for s in [1, 2, 4, *range(8, limit + 1, 8)] if s <= limit} | {limit})


def moe_warm_up_layers(model: nn.Module) -> list[tuple]:
    """(w13, w2, top_k, moe_kwargs) of one sparse layer per Triton variant the layers' fused_moe launches. The
    layers share their shapes, not always their weights' kinds: an int checkpoint served packed may leave a
    layer's experts unquantized (dequantized stacks beside packed ones), and packed experts' scales are fp16
    or fp32 layer by layer (_scales_and_zeros). A pointer's dtype is part of a variant: warming up the first
    layer alone left another kind's large tile to compile during a long prefill."""
    found: dict[tuple, tuple] = {}
    for moe in model.modules():
        if not isinstance(moe, (SparseMoeBlock, GptOssMoE)):
            continue
        experts = moe.experts
        w13, w2 = (experts.fused_moe_weights() if isinstance(experts, FusedMoE) else
                   (experts.w13_weight, experts.w2_weight))
        kind = tuple((w.bits, w.scales.dtype, w.zeros.dtype) if isinstance(w, kernels.PackedExperts) else (w.dtype,)
                     for w in (w13, w2))
        found.setdefault(kind, (w13, w2, moe.top_k, experts.moe_kwargs))
    return list(found.values())


class ModelRunner:
    """Owns the model and its KV tensors; turns one scheduled step (plain lists)
    into tensors, runs the forward over the flattened tokens of all requests (no
    padding to a rectangle), computes logits only for the rows that sample, and
    samples.

    Decode-only steps of at most ``decode_sizes[-1]`` sequences take another way
    in (vLLM's full CUDA graphs): the step is padded to the next of
    ``decode_sizes`` and written into persistent input buffers, whose padding
    rows store no KV (slot -1) and attend to one token of block 0; on CUDA,
    ``capture_cudagraphs`` records one graph per size over those buffers and a
    step replays it, a few launches instead of hundreds. On the CPU ``decode_sizes``
    is empty unless cudagraph_capture_sizes is given (the tests give it, to check
    that the padded path, run eagerly, changes no output).

    A model with LoRA layers (wrap_lora_layers) comes with its adapters' slots; the
    runner keeps the loaded adapters (LoRASlots) and sets each step's LoRAStep. A padded
    step with adapter rows carries each row's slot in the input buffers (-1: none) and
    runs, or replays, the decode size's LoRA variant (vLLM's cudagraph_specialize_lora)."""

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device, backend: Backend, seed: int = 0,
                 decode_sizes: list[int] | None = None, max_model_len: int | None = None,
                 logits_processors: list[LogitsProcessor] = ()):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.tp = model.tp
        self.num_steps = 0  # under tensor parallelism: the step messages' numbers
        self.sampler = Sampler(seed, backend.argmax, logits_processors, backend.top_k_top_p)
        # the adapters and their slots, where wrap_lora_layers has wrapped the model's layers
        self.lora = None if lora_layer(model) is None else LoRASlots(model)
        self.lora_keep: list[int] = []  # the next step's adapters (reload_loras', or the engine's: none to reload)
        self.backend = backend
        self.max_blocks = -(-(max_model_len or model.config.max_position_embeddings) // block_size)  # a table's widest
        self.decode_sizes = sorted(decode_sizes or [])
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # the same sizes with the LoRA ops
        self.prev_sampled: torch.Tensor | None = None  # the last step's sampled ids, on the device
        if self.decode_sizes:
            self._allocate_static_buffers(self.decode_sizes[-1], self.max_blocks)

    def _allocate_static_buffers(self, max_bs: int, max_blocks: int) -> None:
        """The decode path's inputs, at fixed addresses (a captured graph reads
        them there). The block table is max_model_len wide, so every kernel's
        launch shape (the Triton split-KV count among them) depends on the
        batch size alone."""
        dev, cfg = self.device, self.model.config
        # input_ids, positions, slot_mapping (and with LoRA each row's adapter slot, vLLM's
        # token_lora_mapping): the rows of one buffer, which a step fills in one copy (every torch op
        # costs the host microseconds, and a launch on a GPU)
        rows = [[0], [0], [-1]] + ([[-1]] if self.lora is not None else [])
        self.static_token_inputs = torch.tensor(rows, device=dev).repeat(1, max_bs)
        self.static = dict(
            input_ids=self.static_token_inputs[0], positions=self.static_token_inputs[1],
            slot_mapping=self.static_token_inputs[2],
            block_tables=torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=dev),
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
        )
        if self.lora is not None:
            self.static["lora_index"] = self.static_token_inputs[3]
        self.written_tables: list[list[int]] = [[0]] * max_bs  # the tables block_tables' rows hold (on the host)
        self.static_hidden = torch.zeros(max_bs, cfg.hidden_size, dtype=self.model.model.embed_tokens.weight.dtype,
                                         device=dev)

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run what the first steps would build or compile (Triton's kernels,
        inductor's graphs) before any request waits on it: a prefill and a decode
        of a throwaway prompt that writes no KV and reads only block 0."""
        cfg = self.model.config
        for q_lens in [[min(WARMUP_PREFILL_TOKENS, cfg.max_position_embeddings)], [1]]:
            self.model(*dummy_step(cfg, q_lens, self.block_size, self.device), self.kv_caches)
        if self.device.type == "cuda" and self.kv_caches:  # the attention variants longer contexts launch (an
            # encoder has no KV cache and no paged attention)
            attention = self.model.model.layers[0].self_attn
            self.backend.warm_up(attention.num_heads, *attention.attention_caches(self.kv_caches[0]),
                                 self.max_blocks * self.block_size, **attention.attn_kwargs)
            for w13, w2, top_k, moe_kwargs in moe_warm_up_layers(self.model):
                self.backend.warm_up_moe(w13, w2, top_k, dtype=self.model.model.embed_tokens.weight.dtype,
                                         **moe_kwargs)

    @torch.inference_mode()
    def capture_cudagraphs(self) -> None:
        """One CUDA graph per decode size, largest first, all in one memory pool
        (a smaller graph reuses the larger one's activations). Each size runs
        once eagerly first, so Triton compiles before the capture."""
        pool = None
        variants = [(False, self.graphs)] + ([(True, self.lora_graphs)] if self.lora is not None else [])
        for bs in reversed(self.decode_sizes):
            for lora, graphs in variants:
                self._forward_static(bs, lora)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.static_hidden[:bs] = self._forward_static(bs, lora)
                pool = graph.pool()
                graphs[bs] = graph
        torch.cuda.synchronize(self.device)

    def _forward_static(self, bs: int, lora: bool = False) -> torch.Tensor:
        """The forward over the buffers' first ``bs`` rows; ``lora``: with every adapter slot applied
        under each row's mask (the LoRA variant; without, a step's LoRA layers add nothing)."""
        b = self.static
        # a decode's token ends its context: seq_lens follow from positions here, inside the graph
        torch.add(b["positions"][:bs], 1, out=b["seq_lens"][:bs])
        meta = AttentionMetadata(b["slot_mapping"][:bs], b["block_tables"][:bs], b["seq_lens"][:bs],
                                 b["query_start_loc"][:bs + 1])
        if not lora:
            return self.model(b["input_ids"][:bs], b["positions"][:bs], meta, self.kv_caches)
        step = self.lora.step  # the mask is computed in the graph, from the index in the buffer
        step.mask = (b["lora_index"][:bs, None] == self.lora.slot_ids).to(self.lora.dtype)
        try:
            return self.model(b["input_ids"][:bs], b["positions"][:bs], meta, self.kv_caches)
        finally:
            step.mask = None

    def _run_decode_padded(self, seqs: list[SeqInput]) -> torch.Tensor:
        """A decode step through the static buffers, padded to the next decode
        size: the hidden states of its ``len(seqs)`` real rows."""
        n = len(seqs)
        bs = next(s for s in self.decode_sizes if s >= n)
        b, pad, size = self.static, bs - n, self.block_size
        positions = [s.start for s in seqs]
        slots = [kvcache.slot(s.block_table, p, size) for s, p in zip(seqs, positions)]  # one token a row: on lists
        # input_ids, positions and slot_mapping with their padding (slot -1 stores no KV), and with
        # LoRA each row's adapter slot (-1: none): one host tensor, one copy into the buffer's fixed address
        lora_index = None if self.lora is None else self._lora_index(seqs)
        lora_rows = [] if self.lora is None else (lora_index or [-1] * n) + [-1] * pad
        host = host_ints([s.token_ids[0] for s in seqs] + [0] * pad + positions + [0] * pad + slots + [-1] * pad +
                         lora_rows)
        self.static_token_inputs[:, :bs].copy_(to_device(host, self.device).view(-1, bs))
        self._write_prev_sampled(b["input_ids"], seqs)
        self._write_block_tables([s.block_table for s in seqs] + [[0]] * pad)
        graphs = self.graphs if lora_index is None else self.lora_graphs
        if bs in graphs:
            graphs[bs].replay()
            return self.static_hidden[:n]
        return self._forward_static(bs, lora_index is not None)[:n]

    def _write_block_tables(self, tables: list[list[int]]) -> None:
        """Rewrite only the buffer's rows whose table changed since they were last
        written (a decoding row gains a block every block_size steps), and only the
        columns in use: kernels never read a table past a sequence's own blocks, and
        what an earlier step left there is a valid id. The block manager never changes a
        table in place, so the same list is the same table: an unchanged row's ids go unread."""
        written = self.written_tables
        changed = [i for i, t in enumerate(tables) if t is not written[i] and t != written[i]]
        if not changed:
            return
        new = block_table_tensor([tables[i] for i in changed])
        self.static["block_tables"][to_device(host_ints(changed), self.device), :new.shape[1]] = \
            to_device(new, self.device)
        for i in changed:
            written[i] = tables[i]

    def _is_padded_decode(self, seqs: list[SeqInput]) -> bool:
        """A graph's (or the padded path's) step: decodes only, of token ids, as many as the largest size."""
        return bool(self.decode_sizes) and len(seqs) <= self.decode_sizes[-1] and \
            all(len(s.token_ids) == 1 and s.prompt_embeds is None for s in seqs)

    def add_lora(self, lora_int_id: int, path: str, max_rank: int, keep: Iterable[int] | None = None) -> None:
        """Load an adapter (load_lora) into the layers under ``lora_int_id``, on every rank: this one
        first, so that an adapter it refuses (ValueError) is never sent; then the workers, each its
        own part from the same path. ValueError if one of them cannot (the path missing on its node):
        then no rank keeps it, and the workers go on serving. ``keep``: LoRASlots.add's (None: lora_keep,
        the adapters of the step the engine readied last, which may not have run yet: a runtime load
        may come between the two on the model thread)."""
        keep = sorted(self.lora_keep if keep is None else keep)
        self.lora.add(lora_int_id, load_lora(path, self.model, max_rank), keep)
        if self.tp.world_size == 1:
            return
        failed = self._lora_control("add_lora", lora_int_id, path, max_rank, keep)
        if failed:
            self.remove_lora(lora_int_id)
            raise ValueError(f"LoRA adapter {path!r}: tensor-parallel rank(s) could not load it (its path must "
                             f"exist on every node): " + "; ".join(f"rank {r}: {why}" for r, why in failed.items()))

    def reload_loras(self, paths: dict[int, str], max_rank: int) -> dict[int, str]:
        """A step's adapters (id: path) that max_cpu_loras dropped from host memory, loaded again on every
        rank, none of the step's others dropped for them. Returns why each that could not be was not (its
        file gone since it was first loaded): the engine ends only the requests that need it."""
        self.lora_keep, failed = list(paths), {}
        for i, path in paths.items():
            if not self.lora.resident(i):
                try:
                    self.add_lora(i, path, max_rank)
                except ValueError as e:
                    failed[i] = str(e)
        return failed

    def remove_lora(self, lora_int_id: int) -> None:
        """An adapter out of host memory and its slot, on every rank."""
        self.lora.remove(lora_int_id)
        if self.tp.world_size > 1:
            self._lora_control("remove_lora", lora_int_id)

    def _lora_control(self, *message) -> dict[int, str]:
        """Rank 0: a LoRA message to the workers, numbered as a step (worker_loop runs it), and the
        ranks that failed it, with why. Every rank then joins one all-reduce of the failures: its
        collectives stay paired with rank 0's, and the message is read before the next one drops it."""
        try:
            self.tp.send_step(self.num_steps, message)
            self.num_steps += 1
            failed = self.tp.all_reduce(torch.zeros(self.tp.world_size, dtype=torch.int32, device=self.device))
        except RuntimeError as e:
            raise TensorParallelError(f"a tensor-parallel LoRA update failed (a worker died, hung or lost its "
                                      f"connection): {first_line(e)}") from e
        return {r: self.tp.store.get(LORA_ERROR_KEY.format(r)).decode() for r in failed.nonzero().flatten().tolist()}

    def _worker_lora(self, kind: str, lora_int_id: int, path: str = "", max_rank: int = 0,
                     keep: Iterable[int] = ()) -> None:
        """Ranks 1..N-1: _lora_control's message. A failure to load is reported to rank 0, never
        raised: the worker must go on serving the base model and the other adapters."""
        failed = torch.zeros(self.tp.world_size, dtype=torch.int32, device=self.device)
        try:
            if kind == "add_lora":
                self.lora.add(lora_int_id, load_lora(path, self.model, max_rank), keep)
            else:
                self.lora.remove(lora_int_id)
        except Exception as e:  # noqa: BLE001 - whatever it is, rank 0 refuses the adapter and says why
            logger.error("[model] rank %d: cannot load LoRA adapter %d: %s", self.tp.rank, lora_int_id, e)
            self.tp.store.set(LORA_ERROR_KEY.format(self.tp.rank), first_line(e))
            failed[self.tp.rank] = 1
        self.tp.all_reduce(failed)

    def _lora_groups(self, seqs: list[SeqInput]) -> list[tuple[int, torch.Tensor | None]]:
        """The eager path's LoRAStep.groups: each of the step's adapters' slot (copied in where
        needed) and its token rows in the flattened tokens (None: all of them)."""
        rows: dict[int, list[int]] = {}
        start = 0
        for s in seqs:
            if s.lora_int_id is not None:
                rows.setdefault(s.lora_int_id, []).extend(range(start, start + len(s.token_ids)))
            start += len(s.token_ids)
        slots = self.lora.slots(rows)
        return [(slots[i], None if len(r) == start else to_device(host_ints(r), self.device)) for i, r in rows.items()]

    def _lora_index(self, seqs: list[SeqInput]) -> list[int] | None:
        """The padded path's: each row's adapter slot (copied in where needed; -1: the base model),
        or None for a step without adapter rows."""
        ids = [s.lora_int_id for s in seqs]
        if all(i is None for i in ids):
            return None
        slots = self.lora.slots(i for i in ids if i is not None)
        return [-1 if i is None else slots[i] for i in ids]

    def prepare(self, seqs: list[SeqInput]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten a step into input_ids, positions and attention metadata, with
        tensor ops rather than a Python loop per token."""
        dev = self.device
        q_lens = host_ints(len(s.token_ids) for s in seqs)
        starts = host_ints(s.start for s in seqs)
        query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        T = int(query_start_loc[-1])
        seq_ids = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
        positions = torch.arange(T) - query_start_loc[:-1].long()[seq_ids] + starts[seq_ids]
        block_tables = block_table_tensor([s.block_table for s in seqs])
        slots = compute_slot_mapping(block_tables, seq_ids, positions, self.block_size)
        input_ids = to_device(host_ints(itertools.chain.from_iterable(s.token_ids for s in seqs)), dev)
        self._write_prev_sampled(input_ids, seqs, query_start_loc)
        meta = AttentionMetadata(to_device(slots, dev), to_device(block_tables, dev),
                                 to_device((starts + q_lens).to(torch.int32), dev), to_device(query_start_loc, dev))
        return input_ids, to_device(positions, dev), meta

    def _inputs_embeds(self, input_ids: torch.Tensor, seqs: list[SeqInput]) -> torch.Tensor | None:
        """The first layer's input where a prompt came as embeddings: the tokens' embeddings
        with those prompt rows in place of their stand-ins; None for a step without."""
        if all(s.prompt_embeds is None for s in seqs):
            return None
        x, start = self.model.model.embed_input_ids(input_ids), 0
        for s in seqs:
            if s.prompt_embeds is not None:
                x[start:start + len(s.prompt_embeds)] = s.prompt_embeds.to(x.device, x.dtype)
            start += len(s.token_ids)
        return x

    def _token_type_ids(self, seqs: list[SeqInput]) -> torch.Tensor | None:
        """An encoder step's token types, a row each, where a sequence has them (type 0 for the others' rows);
        None for a step without: every row type 0, the encoder's default."""
        if all(s.token_type_ids is None for s in seqs):
            return None
        types = itertools.chain.from_iterable(
            s.token_type_ids if s.token_type_ids is not None else [0] * len(s.token_ids) for s in seqs)
        return to_device(host_ints(types), self.device)

    def _write_prev_sampled(self, input_ids: torch.Tensor, seqs: list[SeqInput],
                            query_start_loc: torch.Tensor | None = None) -> None:
        """Async scheduling: sequences whose input the previous step sampled read it from that step's
        ids on the device, in one index op (into their first token: at query_start_loc, or row i)."""
        moves = [(i, s.prev_sample_row) for i, s in enumerate(seqs) if s.prev_sample_row is not None]
        if moves:
            seq, row = (host_ints(x) for x in zip(*moves))
            dst = seq if query_start_loc is None else query_start_loc[seq].long()
            input_ids[to_device(dst, self.device)] = self.prev_sampled[to_device(row, self.device)]

    def execute(self, seqs: list[SeqInput]) -> ModelRunnerOutput:
        """Run one step and wait for its results: execute_model, then get()."""
        return self.execute_model(seqs).get()

    @torch.inference_mode()
    def execute_model(self, seqs: list[SeqInput]) -> AsyncModelRunnerOutput:
        """Launch one step; get() of what it returns gives one result per sequence that samples,
        in order, and the prompt logprobs asked for (on CUDA only those wait for the device here).
        Under tensor parallelism this is rank 0: the step goes to the workers first, in one
        message, and they join the forward's collectives."""
        rows = [i for i, s in enumerate(seqs) if s.sample is not None]
        if self.tp.world_size == 1:
            logits, prompt_logprobs, pooled = self.compute_step_logits(seqs, rows)
        else:
            try:
                # the workers need no sampling parameters: they never sample
                self.tp.send_step(self.num_steps, ([dataclasses.replace(s, sample=None) for s in seqs], rows))
                self.num_steps += 1
                logits, prompt_logprobs, pooled = self.compute_step_logits(seqs, rows)
            except RuntimeError as e:  # gloo's and NCCL's errors: one line that says what happened
                raise TensorParallelError(f"a tensor-parallel step failed (a worker died, hung or lost its "
                                          f"connection): {first_line(e)}") from e
        # on the logits' device: the sampler runs there
        drafts = [seqs[i].draft_token_ids or [] for i in rows]
        if any(drafts):
            sampled = self.sampler.sample_speculative(logits, [seqs[i].sample for i in rows], drafts)
        else:
            sampled = self.sampler.sample(logits, [seqs[i].sample for i in rows]) if rows else None
        self.prev_sampled = None if sampled is None else sampled.token_ids
        return AsyncModelRunnerOutput(sampled, prompt_logprobs, pooled)

    def compute_step_logits(self, seqs: list[SeqInput], rows: list[int]
                            ) -> tuple[torch.Tensor | None, dict[int, list[TokenLogprobs]], dict[int, torch.Tensor]]:
        """The forward over the step's tokens, then the logits of the ``rows`` that
        sample (None when none does, and on ranks other than 0), the prompt
        logprobs the sequences ask for and their pooled hidden states (both empty on ranks other than 0)."""
        if self._is_padded_decode(seqs):
            hidden = self._run_decode_padded(seqs)  # one row per sequence
            last = torch.arange(len(seqs), device=self.device)
        else:
            input_ids, positions, meta = self.prepare(seqs)
            if self.lora is not None:
                self.lora.step.groups = self._lora_groups(seqs)
            try:
                types = self._token_type_ids(seqs) if self.model.config.encoder_only else None  # (a decoder's: none)
                extra = {} if types is None else {"token_type_ids": types}  # an encoder's keyword only
                hidden = self.model(input_ids, positions, meta, self.kv_caches, self._inputs_embeds(input_ids, seqs),
                                    **extra)
            finally:
                if self.lora is not None:
                    self.lora.step.groups = []
            last = meta.query_start_loc[1:].long() - 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("[model] step: %d sequences, %d tokens, %d sampled", len(seqs),
                         sum(len(s.token_ids) for s in seqs), len(rows))
        prompt_logprobs = self._prompt_logprobs(seqs, hidden) if any(s.prompt_logprob_ids for s in seqs) else {}
        pools = self.tp.rank == 0 and any(s.pooling for s in seqs)
        pooled = pool_hidden_states(seqs, hidden, self.model.score) if pools else {}
        if any(seqs[i].draft_token_ids for i in rows):  # speculative decoding: a row for each draft too
            ends = list(itertools.accumulate(len(s.token_ids) for s in seqs))
            picked = host_ints([p for i in rows for p in range(ends[i] - 1 - len(seqs[i].draft_token_ids or ()),
                                                                ends[i])])
            return self.model.compute_logits(hidden[to_device(picked, self.device)]), prompt_logprobs, pooled
        logits = self.model.compute_logits(hidden[last[to_device(host_ints(rows), self.device)]]) if rows else None
        return logits, prompt_logprobs, pooled

    def _prompt_logprobs(self, seqs: list[SeqInput], hidden: torch.Tensor) -> dict[int, list[TokenLogprobs]]:
        """The rows' logprobs of the prompt tokens they predict, for the sequences
        that ask, PROMPT_LOGPROB_ROWS rows at a time (full-vocabulary fp32 rows are
        large). Every rank joins each slice's gather; rank 0 gets the values."""
        rows, owners, targets, start = [], [], [], 0
        for i, s in enumerate(seqs):
            for j, token_id in enumerate(s.prompt_logprob_ids or ()):
                rows.append(start + j)
                owners.append(i)
                targets.append(token_id)
            start += len(s.token_ids)
        k = max(s.num_prompt_logprobs for s in seqs)
        out: dict[int, list[TokenLogprobs]] = {}
        for a in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            b = a + PROMPT_LOGPROB_ROWS
            logits = self.model.compute_logits(hidden[to_device(host_ints(rows[a:b]), self.device)])
            if logits is None:  # a rank other than 0
                continue
            for i, r in zip(owners[a:b], gather_logprobs(logits, to_device(host_ints(targets[a:b]), self.device), k)):
                r.top = r.top[:seqs[i].num_prompt_logprobs]
                out.setdefault(i, []).append(r)
        return out

    def shutdown_workers(self) -> None:
        """Rank 0: tell the workers to leave their loop."""
        self.tp.send_step(self.num_steps, None)

    def worker_loop(self) -> None:
        """Ranks 1..N-1: run each step rank 0 sends until it sends None."""
        while (message := self.tp.recv_step(self.num_steps)) is not None:
            self.num_steps += 1
            if isinstance(message[0], str):  # add_lora/remove_lora's, between steps
                self._worker_lora(*message)
                continue
            with torch.inference_mode():
                self.compute_step_logits(*message)


# =========================================================================== tensor-parallel workers

@dataclass(slots=True)
class WorkerSpec:
    """What a worker process needs to build its rank (plain data: it is pickled
    to a spawned process)."""
    model: str
    rank: int
    world_size: int
    local_rank: int
    init_method: str
    device_type: str
    dtype: torch.dtype
    cache: CacheConfig
    enforce_eager: bool
    seed: int
    num_threads: int | None    # CPU: torch threads of this rank (cores / ranks on the node)
    cpu_allocator_tuning: bool
    log_level: int
    hf_overrides: dict[str, Any] | None
    lora: LoRAConfig | None = None  # LoRALinear layers' slots, for the adapters rank 0 sends (ModelRunner.add_lora)
    wna16_weights: str = "auto"     # EngineConfig's: an int4/int8 checkpoint's weights packed or dequantized


def run_worker(spec: WorkerSpec) -> None:
    """Rank 1..N-1: the same start-up as rank 0's engine (the collectives in it
    must match one for one), then the step loop. Exits non-zero on any error:
    rank 0 sees its connection drop and fails the step."""
    if not logging.getLogger().handlers:  # a spawned process: log as the parent does
        logging.basicConfig(format=LOG_FORMAT, datefmt=LOG_DATE_FORMAT)
        logging.getLogger("nanoserve").setLevel(spec.log_level)
    device = torch.device(spec.device_type, spec.local_rank) if spec.device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    tune_process(device, spec.cpu_allocator_tuning)
    torch.manual_seed(spec.seed)
    tp = init_distributed(spec.rank, spec.world_size, spec.init_method, device)
    try:
        cfg = ModelConfig.from_dir(spec.model, spec.hf_overrides)
        backend = select_backend(shard_config(cfg, tp.world_size), spec.dtype, device, spec.cache.block_size,
                                 spec.enforce_eager)
        model, weight_bytes = load_model(spec.model, spec.dtype, device, backend, tp, spec.hf_overrides,
                                         spec.cache.max_model_len, spec.wna16_weights)
        if spec.lora is not None:  # before the KV cache is sized, as rank 0's
            weight_bytes += wrap_lora_layers(model, spec.lora)
        kv_spec, plan = plan_rank_kv_cache(model, weight_bytes, spec.cache)
        log_tensor_parallel(tp, weight_bytes, kv_spec, plan)
        runner = ModelRunner(model, kvcache.allocate_kv_cache(kv_spec, plan.num_blocks, device),
                             spec.cache.block_size, device, backend, spec.seed)
        runner.warmup()
        runner.worker_loop()
    finally:
        dist.destroy_process_group()
