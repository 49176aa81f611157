"""DeepSeek-V2 and -V3 (multi-head latent attention, MLA) against transformers, the oracle: logits in one
pass and over a cached prefix, greedy tokens (V2 without a q_lora_rank and greedy routing, V2 with one and
group-limited routing, V3 with noaux_tc routing and YaRN's two mscales); the parameters counted; the KV
cache one latent a token (kv_lora_rank + qk_rope_head_dim, one tensor for K and V); greedy tokens under
preemption, chunked prefill and prefix caching; bf16 on the CPU's C kernels; the Triton attention (interpreted)
over the latent split; two ranks splitting the heads; what is refused."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import test_engine
from conftest import TRITON_INTERPRETER_CLASH, hf_config, hf_model
from nanoserve import kernels
from nanoserve.kvcache import KVCacheSpec, allocate_kv_cache
from nanoserve.model import MLP, MLAAttention, ModelConfig, ModelLoadError, SparseMoeBlock, load_model, num_parameters
from test_cpu_backend import _c_or_skip, runner_with, two_steps
from test_moe import GREEDY, N_NEW, check_parity, check_tp2_greedy, hf_greedy
from test_parity import LONG, PROMPTS, make_llm, variant  # noqa: F401

# one group (of 2 experts) of 4 chosen: both experts from the best one's group, where greedy's second might not be
V2_GROUPED = {"q_lora_rank": 24, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 1}
CASES = [("deepseek_v2", {}), ("deepseek_v2", V2_GROUPED), ("deepseek_v3", {})]
IDS = ["v2-lite", "v2-grouped", "v3-yarn"]


@pytest.mark.parametrize("arch,overrides", CASES, ids=IDS)
def test_logits_and_greedy_match_hf(variant, arch, overrides):
    check_parity(variant(arch, **overrides))


def test_v3_without_rope_interleave_matches_hf(variant):
    check_parity(variant("deepseek_v3", rope_interleave=False))


@pytest.mark.parametrize("arch,overrides", CASES, ids=IDS)
def test_layers_parameter_count_and_latent_cache_are_transformers_s(variant, arch, overrides):
    """The parameter count is transformers'; layer 0 dense, layer 1 sparse (V3's router with its
    correction bias, V2's without). The KV cache: one head of kv_lora_rank + qk_rope_head_dim a token,
    one tensor passed as K and V, half the bytes two would take."""
    path = variant(arch, **overrides)
    cfg = ModelConfig.from_dir(path)
    assert num_parameters(cfg) == sum(p.numel() for p in hf_model(path).parameters())
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim) == (1, 32 + 32, 32)
    layers = load_model(path, torch.float32, torch.device("cpu"))[0].model.layers
    assert type(layers[0].mlp) is MLP and isinstance(layers[1].mlp, SparseMoeBlock)
    assert all(isinstance(layer.self_attn, MLAAttention) for layer in layers)
    assert (layers[1].mlp.gate.e_score_correction_bias is not None) == (arch == "deepseek_v3")
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, 16, one_tensor=True)
    assert spec.bytes_per_block == 2 * 16 * 64 * 4  # layers x tokens x latent x fp32
    k, v = allocate_kv_cache(spec, 3, torch.device("cpu"))[0]
    assert k is v and k.shape == (3, 16, 1, 64)
    llm = make_llm(path)
    assert llm.engine.kv_plan.bytes_per_block == spec.bytes_per_block
    assert llm.engine.runner.kv_caches[1][0] is llm.engine.runner.kv_caches[1][1]


def test_v3_softmax_scale_is_yarn_s_mscale_all_dim_squared(variant):
    """transformers' yarn_apply_mscale: (nope + rope) ** -0.5 times mscale(factor, mscale_all_dim) ** 2,
    not the cache width's 1 / sqrt(64); cos and sin carry mscale / mscale_all_dim's ratio."""
    cfg = ModelConfig.from_dir(variant("deepseek_v3"))
    mscale_all = 0.1 * 0.8 * torch.log(torch.tensor(4.0)).item() + 1
    assert cfg.attention_scale == pytest.approx(48 ** -0.5 * mscale_all ** 2)
    assert cfg.rope_interleave and cfg.q_lora_rank == 24 and cfg.scoring_func == "sigmoid"


def test_greedy_tokens_do_not_depend_on_preemption_chunks_or_prefix_hits(variant):
    """test_engine's all-constraints run on V3: preempted while chunked, prefix blocks shared, the same
    tokens as the unconstrained run (which test_logits_and_greedy_match_hf checks against transformers)."""
    test_engine.check_tokens_survive_preemption_chunks_and_prefix_hits(variant("deepseek_v3"))


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_bf16_cpu_runs_the_c_kernels(variant, arch):
    """bf16 on the CPU: the C attention over the 64-wide latent (MQA, 4 heads), the C store and
    elementwise ops; the decode step's logits are the references' to bf16 rounding (the prefill's may
    route a token to another expert where attention sums in another order, as GLM's do), and greedy
    tokens run."""
    _c_or_skip(group=4, head_dim=64)
    path = variant(arch)
    llm = make_llm(path, dtype="bfloat16")
    assert llm.engine.backend.name == "cpu (attention: c, elementwise ops: c, argmax: c)"
    (c_prefill, c_decode), (ref_prefill, ref_decode) = (two_steps(runner_with(b, path))
                                                        for b in (llm.engine.backend, kernels.TORCH))
    assert torch.isfinite(c_prefill).all()
    assert (c_prefill - ref_prefill).abs().median() < 0.02
    torch.testing.assert_close(c_decode, ref_decode, atol=0.05, rtol=0.02)
    outs = llm.generate([LONG[:23], LONG[5:12]], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


@pytest.mark.skipif(kernels.TRITON is None or TRITON_INTERPRETER_CLASH is not None,
                    reason=TRITON_INTERPRETER_CLASH or "triton is not installed")
def test_greedy_on_the_triton_attention_is_transformers_s(variant, monkeypatch):
    """The GPU's MLA path on the CPU: Triton's store and attention (interpreted) over V3's latent, K all 32 + 32
    dims of it and V the first 32 (the split as at 512 + 64, two dots, a 32-wide output), decodes padded to 4
    rows in the graphs' buffers and split in up to 4 partitions of 32 tokens (512 on a GPU): transformers' greedy
    tokens. (The pointwise ops stay the references': interpreted, they would take most of a minute.)"""
    from nanoserve import engine
    monkeypatch.setattr(kernels, "_SPLIT_KV_MIN_PARTITION", 32)
    backend = dataclasses.replace(kernels.TORCH, name="triton-attention", store_kvcache=kernels.TRITON.store_kvcache,
                                  paged_attention=kernels.TRITON.paged_attention)
    monkeypatch.setattr(engine, "select_backend", lambda *args, **kwargs: backend)
    path = variant("deepseek_v3")
    llm = make_llm(path, cudagraph_capture_sizes=[1, 2, 4], max_model_len=128)  # tables of 8 blocks: 4 splits
    assert llm.engine.runner.backend is backend
    prompts = [LONG, PROMPTS[3]]  # 57 and 23 tokens: the first decode's context splits in two
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    hf = hf_model(path)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, N_NEW) for p in prompts]


@pytest.mark.parametrize("arch,overrides", [CASES[1], CASES[2]], ids=IDS[1:])
def test_tensor_parallel_splits_the_heads(variant, arch, overrides):
    """Two ranks, each with two of the four heads (its rows of q and kv_b, its columns of o), the latent
    and its cache on both: transformers' greedy tokens, under chunked prefill."""
    check_tp2_greedy(variant(arch, **overrides))


def _config(arch: str, **changes) -> dict:
    c = hf_config(arch).to_dict()
    c["architectures"] = [{"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}[arch]]
    return {**c, **changes}


@pytest.mark.parametrize("arch,changes,message", [
    ("deepseek_v2", {"topk_method": "noaux_tc"}, r"DeepseekV2ForCausalLM with topk_method 'noaux_tc' and "
                                                 r"scoring_func 'softmax' is not supported"),
    ("deepseek_v3", {"scoring_func": "softmax"}, r"topk_method 'noaux_tc' and scoring_func 'softmax'"),
    ("deepseek_v2", {"attention_bias": True}, r"DeepseekV2ForCausalLM with attention_bias is not supported"),
    ("deepseek_v3", {"kv_lora_rank": 0}, r"kv_lora_rank 0: sizes must be positive integers"),
    ("deepseek_v3", {"qk_rope_head_dim": 31}, r"qk_rope_head_dim 31 must be even"),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 3}, r"n_routed_experts 8 cannot be split"),
    ("deepseek_v3", {"moe_layer_freq": 0}, r"moe_layer_freq 0: must be an integer >= 1"),
], ids=["v2-noaux", "v3-softmax", "bias", "no-latent", "odd-rope", "v2-groups", "layer-freq"])
def test_configs_nanoserve_cannot_serve_are_refused(arch, changes, message):
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dict(_config(arch, **changes))


def test_moe_layer_freq_is_vllm_s():
    """transformers reads no moe_layer_freq; vLLM's DeepSeek makes the layers from first_k_dense_replace on
    sparse every moe_layer_freq-th (the released configs: 1)."""
    cfg = ModelConfig.from_dict(_config("deepseek_v2", num_hidden_layers=6, moe_layer_freq=2))
    assert cfg.moe_layers == (2, 4)


def test_lora_is_refused_at_start_up(variant, tmp_path):
    with pytest.raises(ModelLoadError, match=r"LoRA is not supported for DeepseekV3ForCausalLM"):
        make_llm(variant("deepseek_v3"), enable_lora=True)


def test_c_chunk_attention_takes_more_than_32_heads_on_one_kv_head():
    """MQA of 48 heads (V3's 128 alike) over one KV head: the C chunk kernel's tile holds 32 / GROUP tokens,
    so its heads run 32 and 16 at a time, a decode beside the chunk kept; the reference's result to bf16."""
    from nanoserve import cpu_kernels
    _c_or_skip(group=32, head_dim=64)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(8, 16, 1, 64, generator=gen).bfloat16()
    query = torch.randn(11, 48, 64, generator=gen).bfloat16()
    batch = (query, cache, cache, torch.arange(1, 8, dtype=torch.int32).expand(2, -1).contiguous(),
             torch.tensor([40, 60], dtype=torch.int32), torch.tensor([0, 1, 11], dtype=torch.int32), 0.1)
    torch.testing.assert_close(cpu_kernels.paged_attention(*batch).float(),
                               kernels.paged_attention_torch(*batch).float(), atol=0.02, rtol=0.02)
