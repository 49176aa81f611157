"""Weight-only int4/int8 checkpoints (GPTQ, AWQ, compressed-tensors W4A16/W8A16), served dequantized.

A tiny transformers model's linear weights are quantized here to integer codes with one scale (and zero
point) a group of input columns, and packed as each format's spec says. The oracle is the same model with
each weight replaced by its dequantized value in fp32 ((code - zero) * scale, computed from the integers
before packing), saved unquantized: nanoserve's weights from the packed checkpoint must equal those exactly
and its greedy tokens equal transformers' on it. For compressed-tensors, the format's own library packs the
checkpoint (its compressor, from the integers here) and its own decompressor makes the oracle, so that a
packer and an unpacker written by the same hand cannot share a misunderstanding; for GPTQ and AWQ the
independent check against AutoAWQ's packer and vLLM's pure-torch GPTQ/AWQ packers is
benchmarks/wna16_pack_check.py (RESULTS.md)."""
from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import (VOCAB, assert_loads_as_its_dequantized_twin, dequant_of, edited_checkpoint,
                      greedy_tokens_and_logprobs, hf_greedy_logprobs, make_model)
from nanoserve import LLM, SamplingParams
from nanoserve.model import ModelConfig, ModelLoadError, PackedIntSlice, load_model

_rng = torch.Generator().manual_seed(4)
PROMPTS = [torch.randint(1, VOCAB - 1, (n,), generator=_rng).tolist() for n in (5, 19, 33)]
N_NEW = 10
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def is_quantized_linear(name: str, t: torch.Tensor, lm_head: bool = False) -> bool:
    """The tensors these checkpoints quantize: the decoder's linear weights (not embeddings, norms, a MoE's
    router ``mlp.gate``, as the hub's leave it), and lm_head only if asked (GPTQ's ``lm_head: true``)."""
    if name == "lm_head.weight":
        return lm_head
    return t.dim() == 2 and name.endswith(".weight") and "embed_tokens" not in name and "norm" not in name \
        and not name.endswith(".mlp.gate.weight")


def quantize(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor | None = None):
    """(codes [out, in] unsigned, scale [out, groups], zero [out, groups]) by min/max in each group of input
    columns (g_idx: each column's group, act-order); symmetric: zero the midpoint 2 ** (bits - 1)."""
    out, inp = w.shape
    g_idx = torch.arange(inp) // group if g_idx is None else g_idx
    groups = int(g_idx.max()) + 1
    lo = torch.stack([w[:, g_idx == g].amin(1) for g in range(groups)], 1).clamp(max=0)
    hi = torch.stack([w[:, g_idx == g].amax(1) for g in range(groups)], 1).clamp(min=0)
    qmax = (1 << bits) - 1
    if sym:
        scale = torch.maximum(-lo, hi) / (qmax // 2)
        zero = torch.full_like(scale, float(1 << (bits - 1)))
    else:
        scale = (hi - lo) / qmax
        zero = (-lo / scale).round().clamp(0, qmax)
    codes = (w / scale[:, g_idx] + zero[:, g_idx]).round().clamp(0, qmax).to(torch.int32)
    return codes, scale, zero.to(torch.int32)


def dequantize(codes, scale, zero, g_idx) -> torch.Tensor:
    return (codes.float() - zero[:, g_idx].float()) * scale[:, g_idx]


def pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words along ``dim``: value j * p + i in bits [i * bits, (i + 1) * bits) of word j."""
    p = 32 // bits
    v = (values.to(torch.int64) & ((1 << bits) - 1)).movedim(dim, 0)
    v = torch.nn.functional.pad(v, (0, 0) * (v.dim() - 1) + (0, -v.shape[0] % p))
    words = sum(v[i::p] << (bits * i) for i in range(p))
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32).movedim(0, dim).contiguous()


def gptq_tensors(module, codes, scale, zero, bits, v1: bool, g_idx):
    """GPTQ: qweight [in / p, out], qzeros [groups, out / p] (v1: each zero minus one), scales [groups, out]."""
    return {f"{module}.qweight": pack(codes.T, bits, 0), f"{module}.qzeros": pack(zero.T - int(v1), bits, 1),
            f"{module}.scales": scale.T.contiguous(), f"{module}.g_idx": g_idx.to(torch.int32)}


def awq_tensors(module, codes, scale, zero, bits, *_):
    """AWQ GEMM: qweight [in, out / 8] and qzeros [groups, out / 8], each 8 columns in AWQ_ORDER."""
    def interleaved(t):  # [rows, out] -> word field i holds column AWQ_ORDER[i] of its 8
        return pack(t.unflatten(1, (-1, 8))[..., AWQ_ORDER].flatten(1), bits, 1)
    return {f"{module}.qweight": interleaved(codes.T), f"{module}.qzeros": interleaved(zero.T),
            f"{module}.scales": scale.T.contiguous()}


def quantized_checkpoint(model_root: Path, method: str, bits: int, group: int, sym: bool, v1: bool = True,
                         act_order: bool = False, arch: str = "qwen3", lm_head: bool = False, **overrides) -> Path:
    """A tiny model (qwen3 unless asked) written as a GPTQ or AWQ checkpoint, and beside it (``-dequant``) its
    dequantized weights unquantized. The embeddings, norms and head (unless ``lm_head``) stay fp32 (as the
    hub's keep them in the model's dtype)."""
    src = make_model(model_root, arch, **overrides)
    dst = model_root / (f"{method}-{bits}-{group}-{'sym' if sym else 'asym'}-{'v1' if v1 else 'v2'}-{act_order}"
                        f"-{src.name}{'-lm_head' if lm_head else ''}")
    if (dst / "config.json").exists():
        return dst
    write = gptq_tensors if method == "gptq" else awq_tensors
    quantized, dequantized = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not is_quantized_linear(name, w, lm_head):
            quantized[name] = dequantized[name] = w
            continue
        g_idx = torch.arange(w.shape[1]) // group
        if act_order:  # GPTQ's desc_act: groups formed in a permuted column order, from the input's Hessian,
            # so the same for the layers that read one input (q/k/v, gate/up), as a packed fused layer needs
            g_idx = g_idx[torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(w.shape[1]))]
        codes, scale, zero = quantize(w, bits, group, sym, g_idx)
        assert not (v1 and method == "gptq" and (zero == 0).any())  # v1 cannot store a zero of 0 (as zero - 1)
        scale = scale.half()  # as the hub's GPTQ and AWQ checkpoints store them
        dequantized[name] = dequantize(codes, scale.float(), zero, g_idx)
        quantized.update(write(name.removesuffix(".weight"), codes, scale, zero, bits, v1, g_idx))
    _write(src, dst, quantized, dequantized)
    quant = ({"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": act_order,
              "checkpoint_format": "gptq" if v1 else "gptq_v2", "lm_head": lm_head} if method == "gptq" else
             {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"})
    _set_quant(dst, quant)
    return dst


def _write(src: Path, dst: Path, quantized: dict, dequantized: dict) -> None:
    for out, tensors in ((dst, quantized), (dequant_of(dst), dequantized)):
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(src, out)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _set_quant(path: Path, quant: dict) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(config))


def ct_checkpoint(model_root: Path, bits: int, strategy: str, sym: bool, fmt: str = "pack-quantized",
                  arch: str = "qwen3", **overrides) -> Path:
    """A tiny model (qwen3 unless asked) compressed by compressed-tensors itself (its compressor packs the codes
    quantized here), and its dequantized twin as the library's own decompressor reads the checkpoint back."""
    ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors (the [test] extra) is the oracle")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    src = make_model(model_root, arch, **overrides)
    dst = model_root / f"ct-{bits}-{strategy}-{'sym' if sym else 'asym'}-{fmt}-{src.name}"
    if (dst / "config.json").exists():
        return dst
    group = 32 if strategy == "group" else None
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy=strategy, group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = BaseCompressor.load_from_registry(fmt)
    quantized, dequantized = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not is_quantized_linear(name, w):
            quantized[name] = dequantized[name] = w
            continue
        module = name.removesuffix(".weight")
        codes, scale, zero = quantize(w, bits, group or w.shape[1], sym)
        state = {"weight": dequantize(codes, scale, zero, torch.arange(w.shape[1]) // (group or w.shape[1])),
                 "weight_scale": scale, "weight_zero_point": (zero - (1 << (bits - 1))).to(torch.int8)}
        packed = compressor.compress(state, scheme)
        quantized.update({f"{module}.{k}": v for k, v in packed.items()})
        dequantized[name] = compressor.decompress(packed, scheme)["weight"]
    _write(src, dst, quantized, dequantized)
    _set_quant(dst, {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
                     "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                                   "weights": args.model_dump(mode="json"), "format": fmt}},
                     "ignore": ["lm_head", "re:.*mlp.gate$"], "sparsity_config": {}, "kv_cache_scheme": None,
                     "version": ct.__version__})
    return dst


CASES = {  # id: (make, args): one of each format's layouts, bit widths and zero-point conventions
    "gptq-4-g32-sym-v1": ("gptq", dict(bits=4, group=32, sym=True)),
    "gptq-4-g32-asym-v1-act-order": ("gptq", dict(bits=4, group=32, sym=False, act_order=True)),
    "gptq-8-g64-asym-v2": ("gptq", dict(bits=8, group=64, sym=False, v1=False)),
    "awq-4-g32": ("awq", dict(bits=4, group=32, sym=False)),
    "ct-w4a16-group-sym": ("ct", dict(bits=4, strategy="group", sym=True)),
    "ct-w4a16-group-asym": ("ct", dict(bits=4, strategy="group", sym=False)),
    "ct-w8a16-channel-asym": ("ct", dict(bits=8, strategy="channel", sym=False)),
    "ct-w8a16-naive-asym": ("ct", dict(bits=8, strategy="group", sym=False, fmt="naive-quantized")),
}


def checkpoint(model_root: Path, case: str) -> Path:
    make, kw = CASES[case]
    if make == "ct":
        return ct_checkpoint(model_root, **kw)
    return quantized_checkpoint(model_root, make, **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_the_weights_are_the_dequantized_ones(model_root, case, caplog):
    path = checkpoint(model_root, case)
    with caplog.at_level(logging.INFO, logger="nanoserve.model"):
        assert_loads_as_its_dequantized_twin(path)
    bits = CASES[case][1]["bits"]
    assert f"weight-only checkpoint (" in caplog.text
    assert f"): 14 int{bits} weights dequantized to float32 as they were loaded. The weights are held " \
           f"dequantized: the memory is the float32 model's (about {32 // bits}x the checkpoint's" in caplog.text


def generate(path: Path, **kw) -> tuple[list[list[int]], list[list[float]]]:
    return greedy_tokens_and_logprobs(path, PROMPTS, N_NEW, **kw)


@pytest.mark.parametrize("case", ["gptq-4-g32-asym-v1-act-order", "awq-4-g32", "ct-w4a16-group-asym"])
def test_greedy_tokens_are_transformers_on_the_dequantized_weights(model_root, case):
    path = checkpoint(model_root, case)
    tokens, logprobs = generate(path)
    ref_tokens, ref_logprobs = hf_greedy_logprobs(dequant_of(path), PROMPTS, N_NEW)
    assert tokens == ref_tokens
    torch.testing.assert_close(torch.tensor(sum(logprobs, [])), torch.tensor(sum(ref_logprobs, [])),
                               atol=2e-4, rtol=1e-4)


def test_tensor_parallel_shards_are_cut_from_the_dequantized_weights(model_root):
    """Two ranks of an AWQ model whose shards fall off the packing and the groups (vLLM's kernels refuse
    those; a shard of the dequantized weight has neither): gate/up's 200 output rows split at 100, in the
    middle of a packed word of 8; down's 200 input columns (groups of 128: the last one 72 wide) split at
    100, in the middle of the first group; q/k/v's 64 inputs one group narrower than group_size. Tokens
    and logprobs transformers' on the dequantized weights."""
    path = quantized_checkpoint(model_root, "awq", bits=4, group=128, sym=False, intermediate_size=200)
    tokens, logprobs = generate(path, tensor_parallel_size=2)
    ref_tokens, ref_logprobs = hf_greedy_logprobs(dequant_of(path), PROMPTS, N_NEW)
    assert tokens == ref_tokens
    torch.testing.assert_close(torch.tensor(sum(logprobs, [])), torch.tensor(sum(ref_logprobs, [])),
                               atol=2e-4, rtol=1e-4)


MOE_CASES = {  # Qwen3-30B-A3B-GPTQ-Int4 / -AWQ and RedHatAI's w4a16 MoEs: each expert's weights by name, the
    # router (mlp.gate) unquantized; the GPTQ one with its lm_head quantized too (lm_head: true)
    "gptq-lm_head": lambda root: quantized_checkpoint(root, "gptq", bits=4, group=32, sym=False, arch="qwen3_moe",
                                                      lm_head=True),
    "awq": lambda root: quantized_checkpoint(root, "awq", bits=4, group=32, sym=False, arch="qwen3_moe"),
    "ct-w4a16": lambda root: ct_checkpoint(root, bits=4, strategy="group", sym=False, arch="qwen3_moe"),
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_experts_quantized_one_by_one_are_transformers_on_the_dequantized_weights(model_root, case, caplog):
    path = MOE_CASES[case](model_root)
    with caplog.at_level(logging.INFO, logger="nanoserve.model"):
        tokens, logprobs = generate(path)
    experts = 2 * 4 * 3  # 2 layers of 4 experts, gate/up/down each; and q/k/v/o
    assert f"{experts + 2 * 4 + (case == 'gptq-lm_head')} int4 weights dequantized" in caplog.text
    ref_tokens, ref_logprobs = hf_greedy_logprobs(dequant_of(path), PROMPTS, N_NEW)
    assert tokens == ref_tokens
    torch.testing.assert_close(torch.tensor(sum(logprobs, [])), torch.tensor(sum(ref_logprobs, [])),
                               atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("wna16_weights", ["dequantized", "packed"])
def test_an_adapter_on_a_quantized_base_is_its_merged_model(model_root, tmp_path, wna16_weights):
    """LoRA on an AWQ base (as vLLM serves it), held dequantized or packed: the adapter's delta on the
    dequantized weights; a request without it is the base's."""
    from test_lora import hf_greedy, make_adapter, merged_model
    path = checkpoint(model_root, "awq-4-g32")
    adapter = make_adapter(path, tmp_path / "adapter")
    merged = merged_model(dequant_of(path), adapter, tmp_path / "merged")
    from nanoserve import LoRARequest
    llm = LLM(str(path), dtype="float32", enforce_eager=True, num_kv_blocks=16, max_model_len=64, enable_lora=True,
              max_loras=1, wna16_weights=wna16_weights)
    try:
        outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=N_NEW, min_tokens=N_NEW),
                            use_tqdm=False, lora_request=[LoRARequest("a", 1, str(adapter)), None])
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(merged, PROMPTS[0], N_NEW),
                                                      hf_greedy(dequant_of(path), PROMPTS[1], N_NEW)]


def test_bfloat16_holds_the_dequantized_weights_rounded_once(model_root):
    path = checkpoint(model_root, "gptq-4-g32-sym-v1")
    model, weight_bytes = load_model(path, torch.bfloat16, torch.device("cpu"))
    ref, _ = load_model(dequant_of(path), torch.bfloat16, torch.device("cpu"))
    theirs = dict(ref.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in model.named_parameters())
    assert weight_bytes == sum(p.numel() * 2 for p in model.parameters())


@pytest.mark.parametrize("rows,cols", [(slice(None), slice(None)), (slice(3, 45), slice(None)),
                                       (slice(None), slice(13, 61)), (slice(5, 5), slice(None))],
                         ids=["whole", "rows", "columns", "empty"])
def test_a_slice_is_the_whole_dequantized_weights_slice(rows, cols, monkeypatch):
    """Cut through words and groups, a few rows at a time: the same elements as the whole weight's."""
    monkeypatch.setattr(PackedIntSlice, "ROWS_AT_A_TIME", 7)
    from nanoserve.model import _awq_weight, _Companions, WNA16Config
    torch.manual_seed(0)
    w = torch.randn(48, 64)
    codes, scale, zero = quantize(w, 4, 16, False)
    tensors = awq_tensors("m", codes, scale, zero, 4)
    quant = WNA16Config("awq", 4, 16, False, "gemm")
    t = _Companions("m", "m.qweight", Path("x.safetensors"), tensors.get, quant)
    fn, shape, s, z = _awq_weight(t, tensors["m.qweight"], tuple(tensors["m.qweight"].shape), quant)
    sliced = PackedIntSlice(fn, shape, 4, s, z, torch.arange(64) // 16)
    whole = dequantize(codes, scale, zero, torch.arange(64) // 16)
    assert torch.equal(sliced[rows, cols], whole[rows, cols])


def _config(path: Path, **quant) -> dict:
    return {**json.loads((path / "config.json").read_text()), "quantization_config": quant}


CT = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ checkpoint with 3-bit weights is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "GPTQ checkpoint in format 'marlin' is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {r"+:.*\.1\..*": {"bits": 8}}},
     "GPTQ checkpoint with per-module overrides"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     "AWQ checkpoint of version 'gemv' is not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": False},
     "AWQ checkpoint with zero_point false is not supported"),
    ({**CT, "config_groups": {"g": {"weights": {**W4, "num_bits": 8}, "format": "int-quantized",
                                    "input_activations": {"num_bits": 8, "type": "int", "dynamic": True}}}},
     "compressed-tensors checkpoint with scheme W8A8 int (activations quantized: input_activations dynamic)"),
    ({**CT, "format": "float-quantized", "config_groups": {"g": {"weights": {**W4, "num_bits": 8, "type": "float"}}}},
     "compressed-tensors checkpoint with float weights (W8A16 float) is not supported"),
    ({**CT, "format": "marlin-24", "config_groups": {"g": {"weights": W4}}},
     "compressed-tensors checkpoint with 'marlin-24' sparsity is not supported"),
    ({**CT, "sparsity_config": {"format": "sparse-24-bitmask"}, "config_groups": {"g": {"weights": W4}}},
     "compressed-tensors checkpoint with 'sparse-24-bitmask' sparsity is not supported"),
    ({**CT, "config_groups": {"g": {"weights": {**W4, "strategy": "tensor"}}}},
     "compressed-tensors checkpoint with weight strategy 'tensor' is not supported"),
    ({**CT, "config_groups": {"a": {"weights": W4}, "b": {"weights": {**W4, "num_bits": 8}}}},
     "compressed-tensors checkpoint with 2 different schemes across its config_groups is not supported"),
], ids=["gptq-3bit", "gptq-marlin", "gptq-dynamic", "awq-gemv", "awq-no-zero", "ct-w8a8", "ct-fp8", "ct-marlin24",
        "ct-2of4", "ct-tensor", "ct-mixed"])
def test_variants_not_served_are_refused_by_name(tiny_model, quant, message):
    with pytest.raises(ModelLoadError) as e:
        ModelConfig.from_dict(_config(tiny_model, **quant))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def _broken(model_root: Path, case: str, name: str, edit) -> Path:
    return edited_checkpoint(checkpoint(model_root, case), model_root / f"broken-{case}-{name}", edit)


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("case,name,edit,message", [
    ("gptq-4-g32-asym-v1-act-order", "no-zeros", lambda t: t.pop(f"{Q}.qzeros"),
     f"gptq tensor '{Q}.qweight' in model.safetensors has no '{Q}.qzeros' beside it"),
    ("awq-4-g32", "bad-scales", lambda t: t.update({f"{Q}.scales": torch.ones(3, 128).half()}),
     f"tensor '{Q}.scales' has shape (3, 128), expected (2, 128)"),
    ("gptq-4-g32-sym-v1", "stray", lambda t: t.update({"model.layers.0.input_layernorm.scales": torch.ones(1)}),
     "unexpected tensor 'model.layers.0.input_layernorm.scales': a gptq scale or zero point with no quantized "
     "weight beside it"),
    ("gptq-4-g32-sym-v1", "float-codes", lambda t: t.update({f"{Q}.qweight": t[f"{Q}.qweight"].float()}),
     f"gptq tensor '{Q}.qweight' is F32, expected int32 codes"),
], ids=["no-zeros", "bad-scales", "stray", "float-codes"])
def test_a_broken_checkpoint_is_refused_in_one_line(model_root, case, name, edit, message):
    with pytest.raises(ModelLoadError) as e:
        load_model(_broken(model_root, case, name, edit), torch.float32, torch.device("cpu"))
    assert str(e.value) == message


DISAGREEING = [  # (case, name, edit, message)
    ("gptq-4-g32-asym-v1-act-order", "desc-act-no-g-idx", lambda t: t.pop(f"{Q}.g_idx"),
     f"gptq tensor '{Q}.qweight' in model.safetensors has no '{Q}.g_idx' beside it (desc_act: each input "
     "column's group is read from it)"),
    ("gptq-4-g32-asym-v1-act-order", "float-g-idx", lambda t: t.update({f"{Q}.g_idx": t[f"{Q}.g_idx"].float()}),
     f"tensor '{Q}.g_idx' is float32, expected an integer dtype"),
    ("gptq-4-g32-asym-v1-act-order", "g-idx-out-of-range", lambda t: t[f"{Q}.g_idx"].__setitem__(3, 2),
     f"tensor '{Q}.g_idx' names groups outside 0..1"),
    ("gptq-4-g32-sym-v1", "g-idx-not-group-size-s", lambda t: t[f"{Q}.g_idx"].copy_(torch.arange(64) % 2),
     f"tensor '{Q}.g_idx' puts input columns in other groups than group_size 32 in column order (desc_act is "
     "false)"),
    ("gptq-4-g32-sym-v1", "asymmetric-zeros", lambda t: t[f"{Q}.qzeros"].__setitem__((0, 0), 0),
     f"tensor '{Q}.qzeros' holds zero points other than 8, the midpoint of a symmetric (sym: true) checkpoint's "
     "codes"),
    ("awq-4-g32", "float-zeros", lambda t: t.update({f"{Q}.qzeros": t[f"{Q}.qzeros"].float()}),
     f"tensor '{Q}.qzeros' is float32, expected int32 (packed)"),
    ("ct-w4a16-group-asym", "int-scales", lambda t: t.update({f"{Q}.weight_scale": t[f"{Q}.weight_scale"].int()}),
     f"tensor '{Q}.weight_scale' is int32, expected a float dtype (scales)"),
    ("ct-w4a16-group-asym", "float-weight-shape", lambda t: t.update({f"{Q}.weight_shape": torch.tensor([128., 64.])}),
     f"tensor '{Q}.weight_shape' is float32, expected an integer dtype"),
    ("ct-w4a16-group-asym", "weight-shape-not-the-model-s",
     lambda t: t.update({f"{Q}.weight_shape": torch.tensor([128, 60])}),  # 60 columns fill the 8 words too
     f"tensor '{Q}.weight_packed' holds a weight of shape (128, 60), expected (128, 64) from config.json"),
    ("ct-w8a16-naive-asym", "int32-codes", lambda t: t.update({f"{Q}.weight": t[f"{Q}.weight"].int()}),
     f"compressed-tensors tensor '{Q}.weight' is I32, expected int8 codes"),
    ("awq-4-g32", "both-weights", lambda t: t.update({f"{Q}.weight": torch.zeros(128, 64)}),
     f"tensor '{Q}.weight' and '{Q}.qweight' both hold its module's weight (one unquantized, one quantized)"),
    ("awq-4-g32", "no-such-module",
     lambda t: t.update({f"model.layers.0.self_attn.r_proj.{k}": t.pop(f"{Q}.{k}") for k in ("qweight", "qzeros",
                                                                                            "scales")}),
     "unexpected tensor 'model.layers.0.self_attn.r_proj.qweight' in model.safetensors"),
    ("awq-4-g32", "quantized-embedding",
     lambda t: t.update({f"model.embed_tokens.{k}": t[f"{Q}.{k}"].clone() for k in ("qweight", "qzeros", "scales")}),
     "awq tensor 'model.embed_tokens.qweight' is a quantized embedding, which nanoserve (as vLLM) does not read: "
     "only linear layers and lm_head may be quantized"),
]


@pytest.mark.parametrize("case,name,edit,message", DISAGREEING, ids=[c[1] for c in DISAGREEING])
def test_a_checkpoint_its_config_disagrees_with_is_refused_by_tensor(model_root, case, name, edit, message):
    """What would otherwise be a traceback (float zero points through the bit shifts) or wrong weights (a
    g_idx truncated to integers, integer scales, act-order groups guessed, the qzeros of sym: true ignored,
    two weights of one module, one of them silently dropped)."""
    with pytest.raises(ModelLoadError) as e:
        load_model(_broken(model_root, case, name, edit), torch.float32, torch.device("cpu"))
    assert str(e.value) == message


def _mutation(rng: random.Random, tensors: dict, quant: dict) -> str:
    """One random change to a quantized checkpoint (a tensor of a random quantized module, or a config key),
    made in place; returns what it did."""
    modules = sorted({k.rpartition(".")[0] for k in tensors if k.endswith((".qweight", ".weight_packed"))}
                     or {k.rpartition(".")[0] for k, v in tensors.items() if v.dtype == torch.int8})
    module = rng.choice(modules)
    key = rng.choice(sorted(k for k in tensors if k.rpartition(".")[0] == module))
    t, op = tensors[key], rng.choice(["drop", "dtype", "shrink", "grow", "unsqueeze", "move", "g_idx", "config"])
    if op == "drop":
        tensors.pop(key)
    elif op == "dtype":  # not float to float: fp16 scales are other scales, not a broken checkpoint
        tensors[key] = t.to(rng.choice([d for d in (torch.float32, torch.int32, torch.int8, torch.int64)
                                        if d != t.dtype and not (d.is_floating_point and t.is_floating_point())]))
    elif op in ("shrink", "grow"):
        dim = rng.randrange(t.dim())
        tensors[key] = (t.narrow(dim, 0, t.shape[dim] - 1) if op == "shrink" and t.shape[dim] > 1 else
                        torch.cat([t, t.narrow(dim, 0, 1)], dim)).contiguous()
    elif op == "unsqueeze":
        tensors[key] = t[None].contiguous()
    elif op == "move":  # to a module the model lacks, an embedding, a norm
        other = rng.choice(["model.layers.0.self_attn.x_proj", "model.embed_tokens", "model.norm", "lm_head"])
        tensors[other + key[len(module):]] = tensors.pop(key)
    elif op == "g_idx" and key.endswith("g_idx"):
        t[rng.randrange(t.numel())] = rng.choice([-1, 2, 7])
    else:
        name, value = rng.choice([("bits", 2), ("bits", 3), ("bits", 8), ("bits", "4"), ("group_size", -1),
                                  ("group_size", 0), ("group_size", 16), ("group_size", 48), ("group_size", 128),
                                  ("sym", True), ("sym", False), ("desc_act", True), ("desc_act", False),
                                  ("quant_method", "awq"), ("quant_method", "gptq")])
        weights = quant["config_groups"]["group_0"]["weights"] if "config_groups" in quant else quant
        weights[{"bits": "num_bits", "sym": "symmetric"}.get(name, name) if weights is not quant else name] = value
        return f"{name}={value!r}"
    return f"{op} {key}"


@pytest.mark.parametrize("case", ["gptq-4-g32-asym-v1-act-order", "gptq-8-g64-asym-v2", "awq-4-g32",
                                  "ct-w4a16-group-asym", "ct-w8a16-naive-asym"])
def test_seeded_mutations_are_one_line_errors_or_the_same_weights(model_root, case):
    """Each of these changes to a good checkpoint either loads the very weights it had (a change that means
    nothing) or is a one-line ModelLoadError that names a tensor or a key; never another exception, and
    never other weights."""
    src = checkpoint(model_root, case)
    ref, _ = load_model(dequant_of(src), torch.float32, torch.device("cpu"))
    theirs = dict(ref.named_parameters())
    good, config = load_file(str(src / "model.safetensors")), json.loads((src / "config.json").read_text())
    rng = random.Random(case)
    for i in range(10):
        tensors, quant = {k: v.clone() for k, v in good.items()}, json.loads(json.dumps(config["quantization_config"]))
        what = _mutation(rng, tensors, quant)
        out = model_root / f"mutated-{case}"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(src, out)
        save_file(tensors, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
        try:
            model, _ = load_model(out, torch.float32, torch.device("cpu"))
        except ModelLoadError as e:
            named = "'" in str(e) or str(e).startswith(("GPTQ checkpoint", "AWQ checkpoint", "compressed-tensors"))
            assert "\n" not in str(e) and named, (what, str(e))
            continue
        assert all(torch.equal(p, theirs[n]) for n, p in model.named_parameters()), what
