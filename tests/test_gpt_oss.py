"""OpenAI's gpt-oss against transformers, the oracle: logits in one pass and over a cached prefix, and
greedy tokens, with a sliding layer (16 tokens, shorter than the prompts) and a full one; attention
sinks that change the output; YaRN (factor 32, untruncated); biases on q/k/v/o, the router and the
experts; the clamped SwiGLU. The parameter count; bf16 through the CPU backend; the hub's MXFP4
experts dequantized at load; greedy tokens under preemption, chunked prefill and prefix caching;
what is refused. Its experts through fused_moe: Triton's (the interpreter) against the torch twin, the
twin against transformers' GptOssExperts, and on CUDA captured (no host read, warm-up's variants)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import test_engine
from conftest import hf_model
from nanoserve import kernels
from nanoserve.model import (GptOssMoE, ModelConfig, ModelLoadError, load_model, num_parameters)
from test_cpu_backend import runner_with, two_steps
from test_kernels import moe_case, triton_only
from test_moe import GREEDY, check_parity, check_tp2_greedy, hf_greedy
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


def test_bf16_cpu_backend_takes_the_torch_attention_with_sinks(variant):
    """bf16 on the CPU: the C attention has no sinks, so the backend takes the torch reference for
    attention (its elementwise ops stay C where they build); the steps' logits are the all-torch
    backend's to bf16 rounding, and greedy tokens run."""
    path = variant("gpt_oss")
    llm = make_llm(path, dtype="bfloat16")
    assert llm.engine.backend.name.startswith("cpu (attention: torch,")
    (cpu_prefill, cpu_decode), (ref_prefill, ref_decode) = (two_steps(runner_with(b, path))
                                                            for b in (llm.engine.backend, kernels.TORCH))
    assert torch.isfinite(cpu_prefill).all()
    assert (cpu_prefill - ref_prefill).abs().median() < 0.02
    torch.testing.assert_close(cpu_decode, ref_decode, atol=0.05, rtol=0.02)
    outs = llm.generate([LONG[:23], LONG[5:12]], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


def test_greedy_tokens_do_not_depend_on_preemption_chunks_or_prefix_hits(variant):
    """test_engine's all-constraints run: preempted while chunked, prefix blocks shared, the same tokens
    as the unconstrained run (which test_logits_and_greedy_match_hf checks against transformers)."""
    test_engine.check_tokens_survive_preemption_chunks_and_prefix_hits(variant("gpt_oss"))


def test_tensor_parallel_splits_heads_sinks_and_experts(variant):
    """Two ranks, each with two of the four heads (and their sinks), half of each expert's intermediate
    dim, o_proj's and down's biases added once: transformers' greedy tokens, under chunked prefill."""
    check_tp2_greedy(variant("gpt_oss"))


FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert stack [E, in, out] as the hub's gpt-oss stores it: blocks uint8 [E, out, in / 32, 16] (two
    e2m1 values a byte, the low nibble first) and e8m0 scales uint8 [E, out, in / 32] (2 ** (byte - 127)),
    each group of 32 scaled so that its largest value is at most 6, every value the nearest fp4 one."""
    groups = w.transpose(1, 2).reshape(w.shape[0], w.shape[2], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6)).clamp(-127, 127)
    idx = ((groups / torch.exp2(exponent)[..., None])[..., None] - FP4).abs().argmin(-1).to(torch.uint8)
    return idx[..., 0::2] | (idx[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_pair(variant, tmp_path_factory):
    """(an MXFP4 checkpoint of the tiny model, transformers' model with its experts set to transformers'
    own dequantization of those blocks: the oracle)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    src = variant("gpt_oss")
    out = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    tensors, dequantized = load_file(str(src / "model.safetensors")), {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4_quantize(tensors.pop(name))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    hf = hf_model(src)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in dequantized:
                assert not torch.equal(p, dequantized[name])  # fp4 rounding: the test sees its weights
                p.copy_(dequantized[name])
    return out, hf


def test_mxfp4_checkpoint_is_dequantized_at_load(mxfp4_pair):
    from test_parity import ATOL, hf_logits, nanoserve_logits
    path, hf = mxfp4_pair
    assert ModelConfig.from_dir(path).mxfp4
    llm = make_llm(path)
    torch.testing.assert_close(nanoserve_logits(llm, LONG, [len(LONG)]), hf_logits(hf, LONG), atol=ATOL, rtol=ATOL)
    outs = llm.generate([LONG[:23]], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == hf_greedy(hf, LONG[:23], 8)


def _config(**changes) -> dict:
    from conftest import hf_config
    return {**hf_config("gpt_oss").to_dict(), "architectures": ["GptOssForCausalLM"], **changes}


@pytest.mark.parametrize("changes,message", [
    ({"architectures": ["Qwen3MoeForCausalLM"], "quantization_config": {"quant_method": "mxfp4"}},
     r"quant_method 'mxfp4', which nanoserve serves for GptOssForCausalLM \(its experts\) only"),
    ({"quantization_config": {"quant_method": "gguf"}}, r"quant_method 'gguf'.*gpt-oss's MXFP4 experts"),
    ({"attention_bias": False}, r"GptOssForCausalLM with attention_bias false is not supported"),
], ids=["mxfp4-elsewhere", "gguf", "no-bias"])
def test_configs_nanoserve_cannot_serve_are_refused(changes, message):
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dict(_config(**changes))


def test_mxfp4_blocks_without_scales_are_refused(mxfp4_pair, tmp_path):
    from safetensors.torch import load_file, save_file
    path, _ = mxfp4_pair
    for f in path.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"'model.layers.1.mlp.experts.down_proj_blocks'.* has no scales"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_lora_is_refused_at_start_up(variant):
    with pytest.raises(ModelLoadError, match=r"LoRA is not supported for GptOssForCausalLM"):
        make_llm(variant("gpt_oss"), enable_lora=True)


# --------------------------------------------------------------------------- its experts through fused_moe

def gpt_oss_moe_case(T, E, k, H, I, routing, limit=1.0):
    """test_kernels' MoE case as gpt-oss's experts: transformers' layout [E, H, 2I] and [E, I, H] read
    transposed (as GptOssExperts hands them to fused_moe), random biases, and a SwiGLU limit that the
    inputs exceed (so that a kernel without the clamps differs)."""
    x, w13, w2, topk_weights, topk_ids = moe_case(T, E, k, H, I, routing, ids_dtype=torch.int32)
    g = torch.Generator().manual_seed(T * 31 + E)
    w13 = w13.transpose(1, 2).contiguous().transpose(1, 2) * 3  # gate/up values well past the limit
    w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
    kwargs = dict(w13_bias=torch.randn(E, 2 * I, generator=g), w2_bias=torch.randn(E, H, generator=g),
                  activation="swigluoai", swiglu_alpha=1.702, swiglu_limit=limit)
    return (x, w13, w2, topk_weights, topk_ids), kwargs


@triton_only
@pytest.mark.parametrize("T,E,k,H,I,routing", [
    (1, 4, 2, 16, 24, "random"),     # one token (a decode)
    (7, 8, 2, 40, 20, "skewed"),     # experts nobody chose; H, I not multiples of the tiles
    (13, 5, 1, 16, 40, "random"),    # k = 1
    (5, 3, 3, 16, 16, "random"),     # every expert chosen by every token
    (70, 2, 2, 32, 48, "random"),    # 140 pairs over 2 experts: the 64-row tile
], ids=["T1", "unchosen", "k1", "all-experts", "block64"])
def test_fused_moe_triton_with_biases_and_swigluoai_is_the_torch_twin_s(T, E, k, H, I, routing):
    args, kwargs = gpt_oss_moe_case(T, E, k, H, I, routing)
    gate_up = args[0] @ args[1][0].T
    assert (gate_up.abs() > kwargs["swiglu_limit"]).float().mean() > 0.2  # the clamps bite
    want = kernels.fused_moe_torch(*args, **kwargs)
    torch.testing.assert_close(kernels.fused_moe_triton(*args, **kwargs), want, rtol=1e-4, atol=1e-4)
    for change in ({"w13_bias": None}, {"w2_bias": None}, {"activation": "silu"}):  # each part shows
        assert not torch.allclose(kernels.fused_moe_torch(*args, **{**kwargs, **change}), want, atol=1e-2)


@triton_only
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_fused_moe_triton_with_biases_and_the_other_activations(activation):
    args, kwargs = gpt_oss_moe_case(9, 4, 2, 16, 24, "random")
    kwargs["activation"] = activation
    torch.testing.assert_close(kernels.fused_moe_triton(*args, **kwargs), kernels.fused_moe_torch(*args, **kwargs),
                               rtol=1e-4, atol=1e-4)


@triton_only
def test_swigluoai_and_mul_triton_is_the_torch_twin_s():
    """Both clamps (gate above only, up both ways) and a width that is not a power of two."""
    gate_up = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(1)) * 6
    want = kernels.swigluoai_and_mul_torch(gate_up, 1.5, 2.0)
    torch.testing.assert_close(kernels.swigluoai_and_mul_triton(gate_up, 1.5, 2.0), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want, kernels.swigluoai_and_mul_torch(gate_up, 1.5, 50.0))


def test_experts_through_fused_moe_are_transformers_gpt_oss_experts():
    """The oracle for the torch twin: transformers' GptOssExperts (interleaved gate/up, biases, the
    clamped SwiGLU, an expert a token at a time) against ours, which hands its weights transposed to
    fused_moe: on the references and on the CPU backend (whose fused_moe takes no biases: the reference
    serves), with a limit the values pass and experts nobody chose."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as HfExperts

    from conftest import hf_config
    from nanoserve.cpu_backend import build_cpu_backend
    from nanoserve.model import GptOssExperts, TPGroup
    hf = HfExperts(hf_config("gpt_oss", swiglu_limit=0.5))
    hf.limit = 0.5  # transformers 5.17 (the GPU image's) reads no swiglu_limit: its 7.0 is fixed
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    cfg = ModelConfig.from_dict(_config(swiglu_limit=0.5))
    T, E = 6, cfg.num_experts
    x = torch.randn(T, cfg.hidden_size, generator=g)
    topk_ids = torch.stack([torch.randperm(E // 2, generator=g)[:2] for _ in range(T)])  # experts 4..7 idle
    topk_weights = torch.rand(T, 2, generator=g).softmax(-1)
    want = hf(x, topk_ids, topk_weights)
    cpu = build_cpu_backend(cfg, torch.float32, 16, enforce_eager=False)
    assert not cpu.fused_moe_biases
    for backend in (kernels.TORCH, cpu):
        ours = GptOssExperts(cfg, backend, TPGroup())
        ours.load_state_dict(hf.state_dict())
        assert ours.fused_moe is kernels.fused_moe_torch
        torch.testing.assert_close(ours(x, topk_weights, topk_ids), want, rtol=1e-5, atol=1e-5)
    for name, value in (("limit", 50.0), ("alpha", 3.0)):  # the data make both show
        setattr(ours, name, value)
        assert not torch.allclose(ours(x, topk_weights, topk_ids), want, atol=1e-3), name
        setattr(ours, name, getattr(hf, name))


@pytest.mark.skipif(kernels.TRITON is None, reason="triton is not installed")
def test_cuda_graphs_on_triton_the_experts_never_sync_and_warm_up_compiles_their_variants(variant, monkeypatch):
    """On CUDA the Triton kernels serve gpt-oss captured: its MoE layer (router, top-k, softmax, the fused
    experts) reads nothing on the host (test_kernels' guard, the kernels recorded rather than run), and
    launches the same grids for any routing; warm-up with the experts' moe_kwargs launches every variant
    (biases, swigluoai, both tiles) that the layer's steps launch."""
    from nanoserve.model import GptOssMoE, TPGroup, select_backend
    from test_kernels import RecordedKernel, no_host_sync
    monkeypatch.setattr(kernels, "probe_triton", lambda *args: None)
    cfg = ModelConfig.from_dir(variant("gpt_oss"))
    backend = select_backend(cfg, torch.bfloat16, torch.device("cuda"), 16)
    assert backend is kernels.TRITON and backend.capture_safe
    moe = GptOssMoE(cfg, kernels.TRITON, TPGroup())
    assert moe.experts.fused_moe is kernels.fused_moe_triton
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_()
    launches = []
    for name in ("_fused_moe_kernel", "_swigluoai_and_mul_kernel"):
        monkeypatch.setattr(kernels, name, RecordedKernel(name, launches))
    guard = no_host_sync(monkeypatch)
    steps = []
    for T in (3, 3, 260):  # two routings of one batch, then a prefill large enough for the 64-row tile
        launches.clear()
        with guard, torch.no_grad():
            assert moe(torch.randn(T, cfg.hidden_size)).shape == (T, cfg.hidden_size)
        steps.append([(name, grid, sorted(c.items())) for name, grid, c in launches])
    assert steps[0] == steps[1] and len(steps[0]) == 3
    gemms = [dict(c) for step in steps for name, _, c in step if name == "_fused_moe_kernel"]
    assert {c["HAS_BIAS"] for c in gemms} == {True} and {c["BLOCK_M"] for c in gemms} == {16, 64}
    launches.clear()
    experts = moe.experts
    kernels.warm_up_fused_moe_triton(experts.w13_weight, experts.w2_weight, moe.top_k, **experts.moe_kwargs)
    warm = [(name, sorted(c.items())) for name, _, c in launches]
    assert all((name, c) in warm for step in steps for name, _, c in step)


def test_bad_biases_and_activations_are_one_line_errors():
    args, kwargs = gpt_oss_moe_case(3, 4, 2, 16, 24, "random")
    ops = [kernels.fused_moe_torch] + ([kernels.fused_moe_triton] if kernels.TRITON else [])
    for op in ops:
        with pytest.raises(ValueError, match=r"need w13_bias \(4, 48\)"):
            op(*args, **{**kwargs, "w13_bias": kwargs["w13_bias"][:, :-1]})
        with pytest.raises(ValueError, match=r"need w2_bias \(4, 16\) in torch.float32.*torch.float64"):
            op(*args, **{**kwargs, "w2_bias": kwargs["w2_bias"].double()})
        with pytest.raises(ValueError, match=r"unknown MoE activation 'swiglu': one of silu, gelu_tanh, swigluoai"):
            op(*args, **{**kwargs, "activation": "swiglu"})


def test_mxfp4_slice_is_transformers_dequantization():
    """Mxfp4Slice against transformers' convert_moe_packed_tensors on random bytes (every nibble, -0.0 among
    them, exponents on both sides of 2 ** 0): the same values, whole and an expert's slice of columns."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from nanoserve.model import Mxfp4Slice
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(117, 137, (3, 10, 2), generator=gen, dtype=torch.uint8)

    class Loaded:  # safetensors' slice: its shape and [key]
        def get_shape(self):
            return list(blocks.shape)

        def __getitem__(self, key):
            return blocks[key]
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    got = Mxfp4Slice(Loaded(), scales)
    assert got.get_shape() == list(ref.shape) == [3, 64, 10]
    assert torch.equal(got[(slice(None),)], ref)
    assert torch.equal(got[slice(1, 2), slice(None), slice(4, 8)], ref[1:2, :, 4:8])
