"""OpenAI's gpt-oss against transformers, the oracle: logits in one pass and over a cached prefix, and
greedy tokens, with a sliding layer (16 tokens, shorter than the prompts) and a full one; attention
sinks that change the output; YaRN (factor 32, untruncated); biases on q/k/v/o, the router and the
experts; the clamped SwiGLU. The parameter count; bf16 through the CPU backend; the hub's MXFP4
experts dequantized at load; greedy tokens under preemption, chunked prefill and prefix caching;
what is refused."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import test_engine
from conftest import hf_model
from nanoserve import LLM, kernels
from nanoserve.model import (GptOssMoE, ModelConfig, ModelLoadError, load_model, num_parameters)
from test_cpu_backend import runner_with, two_steps
from test_moe import GREEDY, check_parity, hf_greedy
from test_parity import LONG, make_llm, variant  # noqa: F401


def test_logits_and_greedy_match_hf(variant):
    check_parity(variant("gpt_oss"))


def test_config_layers_and_parameter_count_are_transformers_s(variant):
    path = variant("gpt_oss")
    cfg = ModelConfig.from_dir(path)
    assert num_parameters(cfg) == sum(p.numel() for p in hf_model(path).parameters())
    assert (cfg.sliding_window, cfg.sliding_layers, cfg.attention_sinks, cfg.attention_bias) == (16, (0,), True, True)
    assert cfg.rope_scaling["truncate"] is False and cfg.rope_scaling["factor"] == 32.0
    layers = load_model(path, torch.float32, torch.device("cpu"))[0].model.layers
    assert all(isinstance(layer.mlp, GptOssMoE) for layer in layers)
    assert layers[0].self_attn.sinks.shape == (4,) and layers[0].self_attn.o_proj.bias is not None


def test_sinks_change_the_output(variant):
    """The same model with its sinks at -inf (no mass taken) gives other logits: a kernel that ignored
    sinks would fail test_logits_and_greedy_match_hf."""
    path = variant("gpt_oss")
    llm = make_llm(path)
    from test_parity import nanoserve_logits
    with_sinks = nanoserve_logits(llm, LONG, [len(LONG)])
    for layer in llm.engine.runner.model.model.layers:
        layer.self_attn.sinks.fill_(float("-inf"))
    assert not torch.allclose(nanoserve_logits(llm, LONG, [len(LONG)]), with_sinks, atol=1e-2)
