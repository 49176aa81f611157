"""Weight-only int4/int8 weights kept packed (model.WNA16Linear, kernels' wna16_matmul): the Triton kernel
against its torch twin, the twin against the weights dequantized here from the integers before packing, and
whole models served packed against the same checkpoints served dequantized (whose tokens tests/test_wna16.py
checks against transformers)."""
from __future__ import annotations

import pytest
import torch

from test_kernels import DEVICE, triton_only
from test_wna16 import pack
from nanoserve import kernels


def packed_case(K: int, N: int, bits: int, group: int, sym: bool, act_order: bool, k_off: int = 0, seed: int = 0):
    """(qweight, scales, zeros, g_idx, group_size, the weight [K, N] as fp32) in the layout above
    kernels.wna16_unpack, from random codes; group -1: one group for all K rows."""
    gen = torch.Generator().manual_seed(seed)
    group_size = K if group == -1 else group
    g = (torch.arange(K) + k_off) // group_size
    if act_order:
        g = g[torch.randperm(K, generator=gen)]
    groups = int(g.max()) + 1
    codes = torch.randint(0, 1 << bits, (K, N), generator=gen)
    # as WNA16Weight holds them: int4's with fp16 scales and uint8 zeros, int8's with fp32 and int16 ones
    scales = (torch.rand(groups, N, generator=gen) / 8 + 1e-3).to(torch.float16 if bits == 4 else torch.float32)
    zeros = torch.full((groups, N), 1 << (bits - 1)) if sym else torch.randint(0, 1 << bits, (groups, N), generator=gen)
    weight = (codes - zeros[g]).float() * scales[g].float()
    return (pack(codes, bits, 0), scales, zeros.to(torch.uint8 if bits == 4 else torch.int16),
            g.to(torch.int32) if act_order else None, group_size, weight)


CASES = [  # (M, K, N, bits, group, sym, act_order, k_off): K off the 32-row tile and the 8-code word
    (1, 100, 72, 4, 32, True, False, 0), (3, 100, 72, 4, 64, False, False, 0),
    (20, 136, 40, 4, 128, False, False, 0), (2, 100, 72, 4, -1, True, False, 0),
    (5, 96, 64, 4, 32, False, True, 0), (1, 100, 50, 4, 128, False, False, 100),  # a TP shard mid-group
    (17, 100, 72, 8, 64, False, False, 0), (2, 64, 72, 8, -1, True, False, 0),
]
IDS = [f"m{c[0]}-k{c[1]}-int{c[3]}-g{c[4]}-{'sym' if c[5] else 'asym'}{'-act' if c[6] else ''}"
       f"{'-off' if c[7] else ''}" for c in CASES]


@pytest.mark.parametrize("M,K,N,bits,group,sym,act_order,k_off", CASES, ids=IDS)
def test_the_torch_twin_multiplies_by_the_dequantized_weight(M, K, N, bits, group, sym, act_order, k_off):
    qweight, scales, zeros, g_idx, group_size, weight = packed_case(K, N, bits, group, sym, act_order, k_off)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1))
    assert torch.equal(kernels.wna16_weight_torch(qweight, scales, zeros, g_idx, bits, group_size, k_off, K,
                                                  torch.float32), weight)
    torch.testing.assert_close(kernels.wna16_matmul_torch(x, qweight, scales, zeros, g_idx, bits, group_size, k_off),
                               x @ weight)


@triton_only
@pytest.mark.parametrize("M,K,N,bits,group,sym,act_order,k_off", CASES, ids=IDS)
def test_the_triton_kernel_is_its_torch_twin(M, K, N, bits, group, sym, act_order, k_off):
    qweight, scales, zeros, g_idx, group_size, _ = (t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in
                                                    packed_case(K, N, bits, group, sym, act_order, k_off))
    x = torch.randn(M, K + 5, generator=torch.Generator().manual_seed(1)).to(DEVICE)[:, 2:K + 2]  # a strided view
    got = kernels.wna16_matmul_triton(x, qweight, scales, zeros, g_idx, bits, group_size, k_off)
    want = kernels.wna16_matmul_torch(x, qweight, scales, zeros, g_idx, bits, group_size, k_off)
    assert got.shape == (M, N) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- whole models served packed

from conftest import dequant_of, greedy_tokens_and_logprobs, hf_greedy_logprobs  # noqa: E402
from test_wna16 import MOE_CASES, N_NEW, PROMPTS, checkpoint, quantized_checkpoint  # noqa: E402
from nanoserve.model import Linear, ModelLoadError, load_model  # noqa: E402


def assert_transformers_on_the_dequantized_weights(path, **kw):
    tokens, logprobs = greedy_tokens_and_logprobs(path, PROMPTS, N_NEW, wna16_weights="packed", **kw)
    ref_tokens, ref_logprobs = hf_greedy_logprobs(dequant_of(path), PROMPTS, N_NEW)
    assert tokens == ref_tokens
    torch.testing.assert_close(torch.tensor(sum(logprobs, [])), torch.tensor(sum(ref_logprobs, [])),
                               atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["gptq-4-g32-asym-v1-act-order", "gptq-8-g64-asym-v2", "awq-4-g32",
                                  "ct-w4a16-group-sym", "ct-w8a16-channel-asym"])
def test_packed_weights_hold_the_dequantized_weights_in_their_codes(model_root, case):
    """Every quantized Linear holds codes, none a dequantized weight; each one's twin-dequantized weight is the
    dequantized checkpoint's exactly, and its weight bytes are the packed ones."""
    path = checkpoint(model_root, case)
    model, weight_bytes = load_model(path, torch.float32, torch.device("cpu"), wna16_weights="packed")
    ref = dict(load_model(dequant_of(path), torch.float32, torch.device("cpu"))[0].named_parameters())
    packed = {n: m for n, m in model.named_modules() if isinstance(m, Linear) and m.wna16 is not None}
    assert len(packed) == 2 * 4  # 2 layers: qkv, o, gate_up, down
    for name, m in packed.items():
        w = m.wna16
        assert m.weight is None and w.qweight.dtype == torch.int32
        got = kernels.wna16_weight_torch(w.qweight, w.scales, w.zeros, w.g_idx, w.bits, w.group_size, w.k_off,
                                         w.in_features, torch.float32)
        assert torch.equal(got.T, ref[name + ".weight"]), name
    assert weight_bytes == sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for m in packed.values() for b in m.wna16.buffers())
    assert weight_bytes < 0.6 * sum(p.numel() * p.element_size() for p in ref.values())


@pytest.mark.parametrize("case", ["gptq-4-g32-asym-v1-act-order", "awq-4-g32", "ct-w4a16-group-asym"])
def test_packed_greedy_tokens_are_transformers_on_the_dequantized_weights(model_root, case):
    assert_transformers_on_the_dequantized_weights(checkpoint(model_root, case))


def test_packed_tensor_parallel_shards_fall_anywhere_in_words_and_groups(model_root):
    """tests/test_wna16's AWQ model whose shards cut through words and groups (down's rank 1 starts 100
    columns into a group of 128: the kernel's k_off), two ranks, served packed."""
    path = quantized_checkpoint(model_root, "awq", bits=4, group=128, sym=False, intermediate_size=200)
    assert_transformers_on_the_dequantized_weights(path, tensor_parallel_size=2)


def test_packed_moe_keeps_attention_the_experts_and_the_head_packed(model_root, caplog):
    """Every quantized weight of a Qwen3-MoE kept packed (the experts as FusedMoE's WNA16Experts, read by
    kernels.fused_moe_wna16_torch here; tests/test_wna16_moe.py), none dequantized."""
    import logging
    path = MOE_CASES["gptq-lm_head"](model_root)
    with caplog.at_level(logging.INFO, logger="nanoserve.model"):
        assert_transformers_on_the_dequantized_weights(path)
    assert f"{2 * 4 + 2 * 4 * 3 + 1} int4 weights kept packed" in caplog.text  # 2 layers' q, k, v, o and 4
    assert "dequantized (" not in caplog.text                                   # experts' gate, up, down; lm_head


def test_a_layer_whose_slices_have_different_act_order_groups_is_refused_by_name(model_root, tmp_path):
    from conftest import edited_checkpoint
    path = checkpoint(model_root, "gptq-4-g32-asym-v1-act-order")

    def other_k_groups(tensors):
        g = tensors["model.layers.0.self_attn.k_proj.g_idx"]
        tensors["model.layers.0.self_attn.k_proj.g_idx"] = g.flip(0).contiguous()
    broken = edited_checkpoint(path, tmp_path / "broken", other_k_groups)
    with pytest.raises(ModelLoadError, match=r"^tensor 'model\.layers\.0\.self_attn\.[qv]_proj\.qweight': its input "
                                             r"columns fall in other groups .* wna16_weights='dequantized'$"):
        load_model(broken, torch.float32, torch.device("cpu"), wna16_weights="packed")


def test_an_unknown_wna16_weights_is_refused():
    from nanoserve.engine import EngineConfig
    with pytest.raises(ValueError, match="wna16_weights must be one of auto, packed, dequantized, got 'int4'"):
        EngineConfig(model="x", wna16_weights="int4")


def test_the_server_flag_chooses_packed_or_dequantized(tmp_path):
    from nanoserve.entry import engine_config, parse_args
    for argv, choice in (([], "auto"), (["--wna16-weights", "packed"], "packed"),
                         (["--wna16-weights", "dequantized"], "dequantized")):
        assert engine_config(parse_args(["--model", str(tmp_path), *argv])).wna16_weights == choice
    with pytest.raises(SystemExit):  # argparse's one-line error: not a choice
        parse_args(["--model", str(tmp_path), "--wna16-weights", "int4"])


@pytest.mark.parametrize("bits, group, act_order", [(4, 32, False), (8, 64, False), (4, -1, False), (4, 128, True)])
def test_start_up_probe_gives_every_group_it_reads_a_scale(monkeypatch, bits, group, act_order):
    """probe_triton's one launch of the packed matmul, run by the twin (which indexes, so a group past the
    probe's scales and zeros raises where the kernel on a GPU would read past them)."""
    monkeypatch.setattr(kernels, "wna16_matmul_triton", kernels.wna16_matmul_torch)
    kernels._probe_wna16(torch.zeros(1, 256), bits, group, act_order)


@triton_only
def test_packed_layers_run_the_kernels_of_the_engines_backend(model_root, monkeypatch):
    """Triton's packed kernels under Triton's backend (whose probe launched them), the twins under any other,
    whatever the device: a GPU whose probe failed serves with the torch references (select_backend's
    fallback), and a packed layer launching the kernel that failed the probe would fail start-up instead."""
    path = MOE_CASES["gptq-lm_head"](model_root)
    launched = []

    def recorded(name, twin):
        def run(*args, **kwargs):
            launched.append(name)
            return twin(*args, **kwargs)
        return run
    monkeypatch.setattr(kernels, "wna16_matmul_triton", recorded("wna16_matmul", kernels.wna16_matmul_torch))
    monkeypatch.setattr(kernels, "fused_moe_triton", recorded("fused_moe", kernels.fused_moe_wna16_torch))
    for backend, want in ((kernels.TRITON, ["wna16_matmul", "fused_moe"]), (kernels.TORCH, [])):
        model, _ = load_model(path, torch.float32, torch.device("cpu"), backend, wna16_weights="packed")
        layer, x = model.model.layers[0], torch.randn(3, model.config.hidden_size)
        launched.clear()
        layer.self_attn.o_proj(torch.randn(3, layer.self_attn.o_proj.wna16.in_features))
        moe = layer.mlp.experts
        moe(x, torch.full((3, 2), 0.5), torch.tensor([[0, 1], [1, 2], [3, 0]]))
        assert launched == want, backend.name
