"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GraniteMoe, GraniteMoeShared,
GLM-4.5) against transformers, the oracle: logits in one pass and in prefill chunks and greedy tokens through
the engine; the experts loaded from the hub's tensors (what save_pretrained writes: per expert, or
Granite's stacks) and from transformers 5's stacks; the sizes checked, the parameters counted; what
is refused (other MoE families and options, adapters of the experts); and two ranks splitting every
expert, with one all-reduce a sparse layer."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ARCHS, MOE_ARCHS, VOCAB, hf_model
from nanoserve import LLM, LoRARequest, SamplingParams, kernels
from nanoserve.model import (MLP, FusedMoE, ModelConfig, ModelLoadError, SparseMoeBlock, check_tensor_parallel,
                             load_model, num_parameters)
from test_lora import make_adapter, merged_model
from test_parity import ATOL, LONG, PROMPTS, hf_logits, make_llm, nanoserve_logits, variant  # noqa: F401

N_NEW = 8
ARCH_NAMES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
              "olmoe": "OlmoeForCausalLM", "granitemoe": "GraniteMoeForCausalLM",
              "granitemoeshared": "GraniteMoeSharedForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}
GREEDY = SamplingParams(temperature=0, max_tokens=N_NEW, min_tokens=N_NEW)


def check_parity(path: Path) -> LLM:
    """test_parity's check, lighter (transformers runs its experts one at a time, slowly): the logits
    in one pass and over a cached prefix, and the greedy tokens of a batch of two prompts."""
    llm, hf = make_llm(path), hf_model(path)
    ref = hf_logits(hf, LONG)
    torch.testing.assert_close(nanoserve_logits(llm, LONG, [len(LONG)]), ref, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(nanoserve_logits(llm, LONG, [21, 19, 1, 16]), ref, atol=ATOL, rtol=ATOL)
    prompts = [PROMPTS[1], PROMPTS[4]]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, N_NEW) for p in prompts]
    return llm


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=n, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", [a for a in MOE_ARCHS if a not in ARCHS])  # test_parity checks those in ARCHS
def test_logits_and_greedy_match_hf(variant, arch):
    check_parity(variant(arch))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_layers_and_parameter_count_are_transformers_s(variant, arch):
    path = variant(arch)
    assert num_parameters(ModelConfig.from_dir(path)) == sum(p.numel() for p in hf_model(path).parameters())
    layers = load_model(path, torch.float32, torch.device("cpu"))[0].model.layers
    if arch == "qwen2_moe":  # layer 0 sparse with its gated shared expert, layer 1 dense (mlp_only_layers)
        assert isinstance(layers[0].mlp, SparseMoeBlock) and layers[0].mlp.shared_expert is not None
        assert layers[0].mlp.shared_expert_gate is not None and type(layers[1].mlp) is MLP
    elif arch == "glm4_moe":  # layer 0 dense (first_k_dense_replace), layer 1 sparse with its ungated shared expert
        assert type(layers[0].mlp) is MLP and layers[1].mlp.shared_expert is not None
        assert layers[1].mlp.shared_expert_gate is None and layers[1].mlp.grouped
    elif arch == "granitemoeshared":  # every layer sparse, with its shared expert, ungated
        assert all(isinstance(layer.mlp, SparseMoeBlock) and layer.mlp.shared_expert is not None
                   and layer.mlp.shared_expert_gate is None for layer in layers)
    else:
        assert all(isinstance(layer.mlp, SparseMoeBlock) and layer.mlp.shared_expert is None for layer in layers)


def test_sparse_layers_are_the_ones_transformers_builds():
    """decoder_sparse_step and mlp_only_layers pick Qwen's sparse layers; Mixtral's, OLMoE's and
    Granite's are all (the last two given Qwen's keys, which they do not read); GLM's those from
    first_k_dense_replace on."""
    from transformers import AutoModelForCausalLM

    from conftest import hf_config
    qwen_keys = {"decoder_sparse_step": 2, "mlp_only_layers": [3]}
    for arch, overrides in [("qwen3_moe", qwen_keys),
                            ("qwen2_moe", {"decoder_sparse_step": 1, "mlp_only_layers": [0, 2]}),
                            ("mixtral", {}), ("olmoe", qwen_keys), ("granitemoe", qwen_keys),
                            ("glm4_moe", {"first_k_dense_replace": 2, **qwen_keys})]:
        hf_cfg = hf_config(arch, num_hidden_layers=5, **overrides)
        hf_cfg.architectures = [ARCH_NAMES[arch]]
        hf = AutoModelForCausalLM.from_config(hf_cfg)
        want = tuple(i for i, layer in enumerate(hf.model.layers)
                     if hasattr(getattr(layer, "mlp", None) or layer.block_sparse_moe, "experts"))
        assert ModelConfig.from_dict(hf_cfg.to_dict()).moe_layers == want, arch


def _copy_with(src: Path, out: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """``src``'s config and tokenizer with ``tensors`` as its weights."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("arch,hub_key,stack_key", [
    ("mixtral", "block_sparse_moe.experts.3.w3.weight", "mlp.experts.gate_up_proj"),
    ("granitemoeshared", "block_sparse_moe.input_linear.weight", "block_sparse_moe.experts.gate_up_proj")])
def test_hub_and_transformers_5_expert_layouts_load_alike(variant, tmp_path, arch, hub_key, stack_key):
    """save_pretrained writes the hub's tensors (Mixtral's per expert, block_sparse_moe.experts.E.w1/w2/w3;
    Granite's stacked, input_linear [E, 2I, H], output_linear and router.layer): the parity test loads
    those. transformers 5's own stacks (experts.gate_up_proj [E, 2I, H], down_proj [E, H, I], Granite's
    router.weight) load to the same logits."""
    path = variant(arch)
    hub = load_file(str(path / "model.safetensors"))
    assert f"model.layers.0.{hub_key}" in hub
    stacked = {k: v.contiguous() for k, v in hf_model(path).state_dict().items()}
    assert stacked[f"model.layers.0.{stack_key}"].shape[0] == 4 and set(stacked) != set(hub)
    out = _copy_with(path, tmp_path / "stacked", stacked)
    torch.testing.assert_close(nanoserve_logits(make_llm(out), LONG, [20, 37]), hf_logits(hf_model(path), LONG),
                               atol=ATOL, rtol=ATOL)


def test_missing_or_unexpected_expert_tensors_are_load_errors(variant, tmp_path):
    path = variant("qwen3_moe")
    hub = load_file(str(path / "model.safetensors"))
    less = {k: v for k, v in hub.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"}
    with pytest.raises(ModelLoadError, match=r"missing weights for model\.layers\.1\.mlp\.experts\.w13_weight "
                                             r"\(experts 3\)"):
        make_llm(_copy_with(path, tmp_path / "less", less))
    more = {**hub, "model.layers.0.mlp.experts.4.down_proj.weight": torch.zeros(64, 32)}
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.experts\.4\.down_proj"):
        make_llm(_copy_with(path, tmp_path / "more", more))
    wrong = {**hub, "model.layers.0.mlp.experts.1.gate_proj.weight": torch.zeros(31, 64)}
    with pytest.raises(ModelLoadError, match=r"experts\.1\.gate_proj\.weight' has shape \(31, 64\), expected "
                                             r"\(32, 64\)"):
        make_llm(_copy_with(path, tmp_path / "wrong", wrong))


def test_glm4_moe_loads_transformers_5_stacks_skips_its_mtp_layer_and_routes_in_fp32(variant, tmp_path):
    """GLM-4.5's checkpoint holds a multi-token-prediction layer past num_hidden_layers (for speculative
    decoding): it is not loaded, and not an unexpected tensor. transformers 5's stacked experts load to
    the same logits. Its router and e_score_correction_bias stay fp32 in a bf16 model, as transformers
    keeps them."""
    path = variant("glm4_moe")
    stacked = {k: v.contiguous() for k, v in hf_model(path).state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in stacked
    mtp = {"model.layers.2.eh_proj.weight": torch.zeros(64, 128), "model.layers.2.mlp.experts.0.up_proj.weight":
           torch.zeros(32, 64), "model.layers.2.shared_head.head.weight": torch.zeros(VOCAB, 64)}
    out = _copy_with(path, tmp_path / "stacked", {**stacked, **mtp})
    torch.testing.assert_close(nanoserve_logits(make_llm(out), LONG, [20, 37]), hf_logits(hf_model(path), LONG),
                               atol=ATOL, rtol=ATOL)
    gate = load_model(path, torch.bfloat16, torch.device("cpu"))[0].model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert gate.e_score_correction_bias.abs().sum() > 0  # conftest's, so that the parity test routes with it


def _config(arch: str, **changes) -> dict:
    from conftest import hf_config
    c = hf_config(arch).to_dict()
    c["architectures"] = [ARCH_NAMES[arch]]
    return {**c, **changes}


@pytest.mark.parametrize("arch,changes,message", [
    ("qwen3_moe", {"num_experts_per_tok": 5}, r"num_experts_per_tok 5 is more than num_experts 4"),
    ("mixtral", {"num_local_experts": 0}, r"num_local_experts 0: sizes must be positive integers"),
    ("qwen2_moe", {"moe_intermediate_size": -1}, r"moe_intermediate_size -1: sizes must be positive"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, r"decoder_sparse_step 0: sizes must be positive"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}, r"use_sliding_window is not supported"),
    ("mixtral", {"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
    ("qwen3_moe", {"architectures": ["DeepseekV32ForCausalLM"]}, r"unsupported architecture 'DeepseekV32ForCausalL"),
    ("qwen3_moe", {"architectures": ["Ernie4_5_MoeForCausalLM"]}, r"'Ernie4_5_MoeForCausalLM' \(a mixture-of-exp"),
    ("qwen3_moe", {"architectures": ["GraniteMoeHybridForCausalLM"]}, r"unsupported architecture 'GraniteMoeHybr"),
    ("olmoe", {"clip_qkv": 8.0}, r"OlmoeForCausalLM with clip_qkv 8\.0 is not supported"),
    ("olmoe", {"head_dim": 32}, r"head_dim 32 \(not hidden_size / num_attention_heads, 16\) is not supported"),
    ("olmoe", {"sliding_window": 8}, r"OlmoeForCausalLM with a sliding_window is not supported"),
    ("granitemoe", {"attention_bias": True}, r"GraniteMoeForCausalLM with attention_bias is not supported"),
    ("granitemoeshared", {"shared_intermediate_size": -1}, r"shared_intermediate_size -1: sizes must be non-neg"),
    ("glm4_moe", {"n_group": 3}, r"n_routed_experts 8 cannot be split into n_group 3 groups of 2 or more"),
    ("glm4_moe", {"n_group": 4, "num_experts_per_tok": 3}, r"topk_group 1 of n_group 4 groups hold fewer than "
                                                           r"num_experts_per_tok 3 experts"),
    ("glm4_moe", {"n_shared_experts": -1}, r"n_shared_experts -1: must be a non-negative integer"),
], ids=["top-k", "no-experts", "moe-size", "sparse-step", "qwen-window", "act", "deepseek-v3.2", "ernie-moe",
        "granite-hybrid", "olmoe-clip-qkv", "olmoe-head-dim", "olmoe-window", "granite-attention-bias",
        "granite-shared-size", "glm-groups", "glm-topk-group", "glm-shared"])
def test_configs_nanoserve_cannot_serve_are_refused(arch, changes, message):
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dict(_config(arch, **changes))


def test_tensor_parallel_sizes_are_checked_for_the_experts():
    cfg = ModelConfig.from_dict(_config("qwen2_moe", moe_intermediate_size=30, shared_expert_intermediate_size=34))
    with pytest.raises(ValueError, match=r"moe_intermediate_size=30 is not divisible by tensor_parallel_size=4; "
                                         r"shared_expert_intermediate_size=34 is not divisible"):
        check_tensor_parallel(cfg, 4)
    check_tensor_parallel(cfg, 2)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_top_k_left_out_of_config_json_is_transformers_default(arch):
    """A config.json without num_experts_per_tok routes as transformers reads it: its family's default
    (Mixtral 2, Qwen2-MoE 4, Qwen3-MoE 8, OLMoE 8, Granite 2, GLM 8), not one number for all."""
    from transformers import AutoConfig
    c = _config(arch, num_experts=8, num_local_experts=8, **({"n_group": 1} if arch == "glm4_moe" else {}))
    del c["num_experts_per_tok"]
    want = AutoConfig.for_model(c["model_type"], **{k: v for k, v in c.items() if k != "model_type"})
    assert ModelConfig.from_dict(c).num_experts_per_tok == want.num_experts_per_tok


def test_mixtral_sliding_window_is_every_layer_s():
    cfg = ModelConfig.from_dict(_config("mixtral", sliding_window=12))
    assert (cfg.sliding_window, cfg.sliding_layers) == (12, (0, 1))


def test_attention_adapters_serve_and_expert_adapters_are_refused(variant, tmp_path):
    """An adapter of q/k/v/o runs as its merged model; one that names a sparse layer's MLP
    (an expert's down_proj, as PEFT writes it) is refused, naming why."""
    path = variant("qwen3_moe")
    adapter = make_adapter(path, tmp_path / "attn", targets=("q_proj", "v_proj", "o_proj"))
    merged = merged_model(path, adapter, tmp_path / "merged")
    llm = make_llm(path, enable_lora=True, max_loras=1)
    prompt = LONG[:11]
    out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest("attn", 1, str(adapter)))
    assert out[0].outputs[0].token_ids == hf_greedy(hf_model(merged), prompt, N_NEW)
    experts = make_adapter(path, tmp_path / "experts", targets=("q_proj",), extra={
        "base_model.model.model.layers.0.mlp.experts.0.down_proj.lora_A.weight": torch.zeros(4, 32)})
    with pytest.raises(ValueError, match=r"experts\.0\.down_proj\.lora_A\.weight adapts a mixture-of-experts "
                                         r"layer's MLP"):
        llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest("experts", 2, str(experts)))


@pytest.mark.parametrize("arch,overrides", [("qwen2_moe", {}), ("olmoe", {"num_key_value_heads": 1})],
                         ids=["qwen2_moe", "olmoe-replicated-kv"])
def test_tensor_parallel_splits_every_expert(variant, arch, overrides):
    """Two ranks, each holding its half of every expert's intermediate dim (and of the shared expert
    and the dense layer): transformers' greedy tokens, under chunked prefill. OLMoE's q and k norms
    span the ranks' heads (and its one KV head, which both ranks hold)."""
    check_tp2_greedy(variant(arch, **overrides))


def check_tp2_greedy(path) -> None:
    """Two ranks give transformers' greedy tokens for two prompts, under chunked prefill (16-token chunks)."""
    llm = LLM(str(path), dtype="float32", enforce_eager=True, num_kv_blocks=32, max_model_len=128,
              max_num_batched_tokens=16, tensor_parallel_size=2)
    try:
        prompts = [LONG[:23], LONG[5:12]]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    hf = hf_model(path)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, N_NEW) for p in prompts]


def test_tensor_parallel_checks_the_widths_the_model_splits_by_their_config_names():
    """Mixtral's experts are intermediate_size wide (config.json has no moe_intermediate_size): one
    problem, by that name. A Qwen MoE whose every layer is sparse has no dense MLP to split: its
    intermediate_size does not refuse a split its experts take."""
    with pytest.raises(ValueError, match=r"ranks: intermediate_size=49 is not divisible by tensor_parallel_size=2$"):
        check_tensor_parallel(ModelConfig.from_dict(_config("mixtral", intermediate_size=49)), 2)
    check_tensor_parallel(ModelConfig.from_dict(_config("qwen3_moe", intermediate_size=127)), 2)
    with pytest.raises(ValueError, match=r"ranks: intermediate_size=127 is not divisible"):  # its dense layer 1
        check_tensor_parallel(ModelConfig.from_dict(_config("qwen2_moe", intermediate_size=127)), 2)
    with pytest.raises(ValueError, match=r"ranks: intermediate_size=33 is not divisible by tensor_parallel_size=2; "
                                         r"shared_intermediate_size=47 is not divisible"):  # Granite's names
        check_tensor_parallel(ModelConfig.from_dict(_config("granitemoeshared", intermediate_size=33,
                                                            shared_intermediate_size=47)), 2)
    with pytest.raises(ValueError, match=r"ranks: moe_intermediate_size=33 is not divisible by tensor_parallel_size=4; "
                                         r"moe_intermediate_size \* n_shared_experts=66 is not divisible by "
                                         r"tensor_parallel_size=4$"):  # GLM's shared expert: n of the experts' width
        check_tensor_parallel(ModelConfig.from_dict(_config("glm4_moe", moe_intermediate_size=33, n_shared_experts=2,
                                                            intermediate_size=132)), 4)


def test_the_routed_experts_request_field_is_refused_as_not_implemented():
    """vLLM's routed_experts_prompt_start asks for each token's experts: refused (400, test_fields), for
    that reason, not because there would be no experts (a Mixtral served here has them)."""
    from nanoserve.entry import UNSUPPORTED_FIELDS
    assert UNSUPPORTED_FIELDS["routed_experts_prompt_start"][1].endswith("is not implemented")


def test_fused_moe_weight_loader_takes_this_rank_s_slice():
    """Rank 1 of 2 holds rows I/2.. of each expert's gate and up, and those columns of its down,
    from either layout."""
    from nanoserve.model import TPGroup
    E, H, I = 3, 4, 6
    moe = FusedMoE(E, H, I, kernels.TORCH, TPGroup(rank=1, world_size=2))
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)

    class Slice:  # safetensors' get_slice, as the loader reads it
        def __init__(self, t):
            self.t = t

        def get_shape(self):
            return list(self.t.shape)

        def __getitem__(self, index):
            return self.t[index]
    with torch.no_grad():
        moe.weight_loader(moe.w13_weight, Slice(w13), None)
        moe.weight_loader(moe.w2_weight, Slice(w2), None)
    want13 = torch.cat([w13[:, 3:6], w13[:, 9:12]], dim=1)
    assert torch.equal(moe.w13_weight, want13) and torch.equal(moe.w2_weight, w2[:, :, 3:])
    with torch.no_grad():
        for e in range(E):
            moe.weight_loader(moe.w13_weight, Slice(w13[e, :I]), 2 * e)
            moe.weight_loader(moe.w13_weight, Slice(w13[e, I:]), 2 * e + 1)
            moe.weight_loader(moe.w2_weight, Slice(w2[e]), e)
    assert torch.equal(moe.w13_weight, want13) and torch.equal(moe.w2_weight, w2[:, :, 3:])


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_lora_memory_check_counts_the_slots_of_a_moe_model(variant, world_size):
    """lora_slot_bytes, the check before loading, counts what wrap_lora_layers allocates: attention in
    every layer, the MLP only in the dense ones (Qwen2-MoE's layer 1), as experts take no adapter."""
    from nanoserve.model import LoRAConfig, TPGroup, build_model, lora_slot_bytes, wrap_lora_layers
    cfg, config = ModelConfig.from_dir(variant("qwen2_moe")), LoRAConfig(2, 8)
    model = build_model(cfg, torch.float32, torch.device("cpu"), kernels.TORCH, TPGroup(world_size - 1, world_size))
    assert wrap_lora_layers(model, config) == lora_slot_bytes(cfg, config, world_size, torch.float32)


def test_a_sparse_layer_reduces_once_across_ranks(variant, monkeypatch):
    """Qwen2-MoE's sparse layer on each of two ranks (their slices of its experts and shared expert,
    from the same checkpoint) calls all_reduce once, on the sum of its experts' partial output and its
    gated shared expert's; the ranks' partial sums add up to the one-rank layer's output."""
    from nanoserve import model as model_module
    from nanoserve.model import TPGroup, build_model, load_weights
    path = variant("qwen2_moe")
    cfg, calls = ModelConfig.from_dir(path), []
    monkeypatch.setattr(model_module.dist, "all_reduce", lambda t: calls.append(t.shape))  # each rank's partial

    def sparse_layer(rank: int, world_size: int) -> SparseMoeBlock:
        model = build_model(cfg, torch.float32, torch.device("cpu"), kernels.TORCH, TPGroup(rank, world_size))
        load_weights(model, path)
        return model.model.layers[0].mlp
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = sparse_layer(0, 1)(x)
        parts = [sparse_layer(rank, 2)(x) for rank in (0, 1)]
    assert calls == [(5, cfg.hidden_size)] * 2  # one a rank
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-5, rtol=1e-5)


def test_an_adapter_of_granite_s_shared_mlp_is_refused_as_the_experts_are():
    """GraniteMoeShared's shared_mlp sits beside block_sparse_moe, not under it: its adapter is named
    an expert layer's (the load error says why), an attention adapter of the same layer is not."""
    from nanoserve.model import _targets_experts
    cfg = ModelConfig.from_dict(_config("granitemoeshared"))
    assert _targets_experts("base_model.model.model.layers.1.shared_mlp.input_linear.lora_A.weight", cfg)
    assert not _targets_experts("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight", cfg)
