"""A mixture-of-experts layer's int4/int8 experts kept packed (kernels.PackedExperts): the fused-MoE Triton
kernel reading the codes against its torch twin, the twin against fused_moe_torch on the weights dequantized
here from the integers before packing, and a quantized Qwen3-MoE served packed against the same checkpoint
served dequantized (whose tokens tests/test_wna16.py checks against transformers)."""
from __future__ import annotations

import logging

import pytest
import torch

from test_kernels import DEVICE, triton_only
from test_wna16_packed import packed_case
from nanoserve import kernels

E, TOP_K = 4, 2


def packed_experts(K: int, N: int, bits: int, group: int, sym: bool, k_off: int, seed: int, experts: int = E):
    """(PackedExperts of random experts [N, K], their weights [experts, N, K] fp32), from packed_case's codes."""
    cases = [packed_case(K, N, bits, group, sym, False, k_off, seed=seed + e) for e in range(experts)]
    stack = [torch.stack([c[i] for c in cases]) for i in range(3)]
    return (kernels.PackedExperts(*stack, bits, cases[0][4], k_off, K),
            torch.stack([c[5].T for c in cases]))


def routing(T: int, seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(T)]).to(torch.int32)
    ids[0] = torch.tensor([1, 3])  # expert 0 may go unchosen; 1 and 3 are chosen
    return torch.rand(T, TOP_K, generator=gen), ids


CASES = [  # (T, H, I, bits, group, sym, w2's k_off): H and I off the 32-row tile and the 8-code word
    (5, 72, 40, 4, 32, True, 0), (3, 72, 40, 4, 32, False, 0), (1, 64, 36, 4, -1, False, 0),
    (6, 72, 40, 8, 32, False, 0), (2, 64, 40, 4, 32, False, 20),  # down's TP shard 20 columns into a group
]
IDS = [f"t{c[0]}-int{c[3]}-g{c[4]}-{'sym' if c[5] else 'asym'}{'-off' if c[6] else ''}" for c in CASES]


def experts_case(H, I, bits, group, sym, k_off):
    w13, w13_ref = packed_experts(H, 2 * I, bits, group, sym, 0, seed=10)
    w2, w2_ref = packed_experts(I, H, bits, group, sym, k_off, seed=20)
    return w13, w2, w13_ref, w2_ref


@pytest.mark.parametrize("T,H,I,bits,group,sym,k_off", CASES, ids=IDS)
def test_the_torch_twin_is_fused_moe_on_the_dequantized_experts(T, H, I, bits, group, sym, k_off):
    w13, w2, w13_ref, w2_ref = experts_case(H, I, bits, group, sym, k_off)
    topk_weights, topk_ids = routing(T)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    assert torch.equal(w13.dequantize(torch.arange(E), torch.float32), w13_ref)
    assert torch.equal(w2.dequantize(torch.arange(E), torch.float32), w2_ref)
    got = kernels.fused_moe_wna16_torch(x, w13, w2, topk_weights, topk_ids)
    torch.testing.assert_close(got, kernels.fused_moe_torch(x, w13_ref, w2_ref, topk_weights, topk_ids))


@triton_only
@pytest.mark.parametrize("T,H,I,bits,group,sym,k_off", CASES, ids=IDS)
def test_the_triton_kernel_reads_packed_experts_as_its_twin(T, H, I, bits, group, sym, k_off):
    w13, w2, _, _ = experts_case(H, I, bits, group, sym, k_off)
    w13, w2 = (kernels.PackedExperts(w.qweight.to(DEVICE), w.scales.to(DEVICE), w.zeros.to(DEVICE), w.bits,
                                     w.group_size, w.k_off, w.in_features) for w in (w13, w2))
    topk_weights, topk_ids = (t.to(DEVICE) for t in routing(T))
    x = torch.randn(T, H + 3, generator=torch.Generator().manual_seed(1)).to(DEVICE)[:, 1:H + 1]  # strided
    got = kernels.fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    want = kernels.fused_moe_wna16_torch(x, w13, w2, topk_weights, topk_ids)
    assert got.shape == (T, H) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_packed_experts_are_refused_with_biases_or_beside_a_tensor():
    w13, w2, w13_ref, _ = experts_case(64, 32, 4, 32, True, 0)
    x, (weights, ids) = torch.zeros(1, 64), routing(1)
    with pytest.raises(ValueError, match="^w13 and w2 must both be PackedExperts or both tensors$"):
        kernels.fused_moe_wna16_torch(x, w13_ref, w2, weights, ids)
    with pytest.raises(ValueError, match=r"^packed experts \(PackedExperts\) take no biases$"):
        kernels.fused_moe_triton(x, w13, w2, weights, ids, w13_bias=torch.zeros(E, 64))


@pytest.mark.parametrize("bits, group", [(4, 32), (8, -1)])
def test_start_up_probe_gives_the_packed_experts_every_group_they_read(monkeypatch, bits, group):
    """probe_triton's one launch of fused_moe on packed experts, run by the twin (which indexes, so a group
    past the probe's scales raises where the kernel on a GPU would read past them)."""
    monkeypatch.setattr(kernels, "fused_moe_triton", kernels.fused_moe_wna16_torch)
    kernels._probe_wna16_moe(torch.zeros(1, 200), bits, group, 100, TOP_K)


# --------------------------------------------------------------------------- a model served packed

from conftest import greedy_tokens_and_logprobs  # noqa: E402
from test_wna16 import MOE_CASES, N_NEW, PROMPTS, quantized_checkpoint  # noqa: E402
from nanoserve.model import FusedMoE, load_model  # noqa: E402


def test_packed_experts_give_the_dequantized_experts_tokens(model_root, caplog):
    """A tiny Qwen3-MoE quantized expert by expert (AWQ), served with every quantized weight packed (2 layers'
    q, k, v, o and 4 experts' gate, up, down; none dequantized), gives the tokens and logprobs of the same
    checkpoint served dequantized. (tests/test_wna16_packed.py serves the GPTQ one against transformers.)"""
    path = MOE_CASES["awq"](model_root)
    with caplog.at_level(logging.INFO, logger="nanoserve.model"):
        tokens, logprobs = greedy_tokens_and_logprobs(path, PROMPTS, N_NEW, wna16_weights="packed")
    assert f"{2 * 4 + 2 * 4 * 3} int4 weights kept packed" in caplog.text
    assert "dequantized (" not in caplog.text
    ref_tokens, ref_logprobs = greedy_tokens_and_logprobs(path, PROMPTS, N_NEW, wna16_weights="dequantized")
    assert tokens == ref_tokens
    torch.testing.assert_close(torch.tensor(sum(logprobs, [])), torch.tensor(sum(ref_logprobs, [])),
                               atol=1e-5, rtol=1e-5)


def test_packed_experts_hold_the_dequantized_experts_in_their_codes(model_root):
    """Each FusedMoE holds codes and no dequantized stack; its twin-dequantized experts are the dequantized
    checkpoint's exactly, and the weight bytes count the codes."""
    path = MOE_CASES["awq"](model_root)
    model, weight_bytes = load_model(path, torch.float32, torch.device("cpu"), wna16_weights="packed")
    ref = dict(load_model(path, torch.float32, torch.device("cpu"), wna16_weights="dequantized")[0]
               .named_parameters())
    moes = {n: m for n, m in model.named_modules() if isinstance(m, FusedMoE)}
    assert len(moes) == 2
    for name, m in moes.items():
        assert m.w13_weight is None and m.w2_weight is None
        w13, w2 = m.packed_experts()
        assert torch.equal(w13.dequantize(torch.arange(E), torch.float32), ref[name + ".w13_weight"]), name
        assert torch.equal(w2.dequantize(torch.arange(E), torch.float32), ref[name + ".w2_weight"]), name
    assert weight_bytes < 0.5 * sum(p.numel() * p.element_size() for p in ref.values())


def test_act_order_experts_are_held_dequantized_beside_packed_attention(model_root, caplog):
    """GPTQ desc_act experts: the packed fused_moe has no g_idx (vLLM's refuses act-order MoE), so under
    wna16_weights='packed' they are dequantized as before, logged, and equal the dequantized path's; the
    attention stays packed."""
    path = quantized_checkpoint(model_root, "gptq", bits=4, group=32, sym=False, act_order=True, arch="qwen3_moe")
    with caplog.at_level(logging.INFO, logger="nanoserve.model"):
        model, _ = load_model(path, torch.float32, torch.device("cpu"), wna16_weights="packed")
    assert f"{2 * 4} int4 weights kept packed" in caplog.text
    assert f"; {2 * 4 * 3} dequantized (act-order experts" in caplog.text
    ref = dict(load_model(path, torch.float32, torch.device("cpu"), wna16_weights="dequantized")[0]
               .named_parameters())
    for name, m in model.named_modules():
        if isinstance(m, FusedMoE):
            assert m.w13_packed is None and torch.equal(m.w13_weight, ref[name + ".w13_weight"])
            assert m.w2_packed is None and torch.equal(m.w2_weight, ref[name + ".w2_weight"])


def test_the_memory_check_before_loading_counts_packed_experts_at_their_codes(model_root, monkeypatch):
    """The start-up check (weights against the memory there is) reads a packed checkpoint's linear layers, its
    experts the bulk of them, as codes: a machine with room for those and not for the dequantized weights
    serves it packed, and refuses it dequantized, by name (the check counted every weight in the dtype's bytes,
    so the memory that packing saves could not be used: 29 GiB for a 24-layer Qwen3-30B-A3B-GPTQ-Int4 whose
    packed weights are about 9)."""
    from nanoserve import LLM, kvcache
    from nanoserve.model import ModelConfig, num_parameters, weight_bytes_before_load
    path = MOE_CASES["awq"](model_root)
    cfg = ModelConfig.from_dir(path)
    packed, dtype_bytes = weight_bytes_before_load(cfg, torch.float32, True), num_parameters(cfg) * 4
    assert packed < 0.5 * dtype_bytes == 0.5 * weight_bytes_before_load(cfg, torch.float32, False)
    _, loaded = load_model(path, torch.float32, torch.device("cpu"), wna16_weights="packed")
    assert 0.95 * loaded <= packed <= loaded  # a lower bound, and a close one
    # room for the packed weights and the tiny KV cache (4 blocks, 64 KiB), not for the dequantized weights
    monkeypatch.setattr(kvcache, "available_cpu_memory", lambda: (loaded + dtype_bytes) // 2)
    small = dict(dtype="float32", enforce_eager=True, num_kv_blocks=4, max_model_len=64)
    LLM(str(path), wna16_weights="packed", **small).shutdown()
    with pytest.raises(ValueError, match="not enough memory: the weights need"):
        LLM(str(path), wna16_weights="dequantized", **small)


@pytest.mark.parametrize("expert", [0, 3])
def test_a_layer_with_unquantized_experts_is_refused_packed_whatever_their_order(model_root, tmp_path, expert):
    """One expert of layer 0 stored unquantized beside its quantized peers: served packed, refused by name
    whether it comes first in the checkpoint (expert 0: the layer was silently dequantized) or last (expert 3);
    served dequantized, it loads."""
    import shutil

    from safetensors.torch import load_file, save_file

    from nanoserve.model import ModelLoadError
    from test_wna16 import dequant_of
    path = MOE_CASES["awq"](model_root)
    tensors = load_file(str(path / "model.safetensors"))
    plain = load_file(str(dequant_of(path) / "model.safetensors"))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        stem = f"model.layers.0.mlp.experts.{expert}.{proj}"
        for name in [n for n in tensors if n.startswith(stem + ".")]:
            del tensors[name]
        tensors[stem + ".weight"] = plain[stem + ".weight"]
    mixed = tmp_path / "mixed"
    shutil.copytree(path, mixed)
    save_file(tensors, str(mixed / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"layer.* unquantized.*one packed layer cannot hold both"):
        load_model(mixed, torch.float32, torch.device("cpu"), wna16_weights="packed")
    load_model(mixed, torch.float32, torch.device("cpu"), wna16_weights="dequantized")


def test_warm_up_takes_a_layer_of_each_kind_of_packed_experts(model_root):
    """CUDA warm-up compiles fused_moe's tiles for one sparse layer per Triton variant (model.moe_warm_up_layers):
    one for layers alike, and another for a layer whose packed scales are fp32 where the first's are fp16 (a
    pointer's dtype makes another variant, else compiled in traffic by the first long prefill)."""
    from nanoserve.model import moe_warm_up_layers
    model, _ = load_model(MOE_CASES["awq"](model_root), torch.float32, torch.device("cpu"), wna16_weights="packed")
    first, second = (m for m in model.modules() if isinstance(m, FusedMoE))
    assert [layer[0].qweight for layer in moe_warm_up_layers(model)] == [first.w13_packed.qweight]
    assert first.w13_packed.scales.dtype == torch.float16
    second.w2_packed.scales = second.w2_packed.scales.float()  # as _needs_fp32 leaves scales fp16 cannot hold
    layers = moe_warm_up_layers(model)
    assert [w2.scales.dtype for _, w2, _, _ in layers] == [torch.float16, torch.float32]
    assert all(top_k == 2 and kwargs == {} for _, _, top_k, kwargs in layers)
