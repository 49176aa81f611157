"""FP8 checkpoints (quant_method "fp8": DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8), served dequantized.

A tiny transformers model's linear weights are quantized here as the hub's are: float8_e4m3fn, with a
``weight_scale_inv`` per block of weight_block_size (the last blocks partial: the tiny dims are not
multiples of the blocks), or one ``weight_scale`` per tensor (plus a static scheme's ``input_scale``).
The oracle is the same model with each weight replaced by its dequantized value in fp32 (fp8 times
its block's scale), saved unquantized: nanoserve's weights from the FP8 checkpoint must equal those
exactly, its greedy tokens equal transformers' on it, and two tensor-parallel ranks (whose shards cut
through blocks) one rank's."""
from __future__ import annotations

import json
import logging
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import (VOCAB, assert_loads_as_its_dequantized_twin, dequant_of, edited_checkpoint,
                      greedy_tokens_and_logprobs, hf_greedy_logprobs, make_model)
from nanoserve.model import Fp8Slice, ModelConfig, ModelLoadError, load_model

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
_rng = torch.Generator().manual_seed(8)
PROMPTS = [torch.randint(1, VOCAB - 1, (n,), generator=_rng).tolist() for n in (5, 19, 33)]
N_NEW = 12


def is_quantized_linear(name: str, t: torch.Tensor) -> bool:
    """The tensors the hub's FP8 checkpoints quantize: the linear layers' weights (MLA's projections and
    every expert's included); not the embeddings, the head, the norms or the router."""
    return (t.dim() >= 2 and name.endswith(".weight") and "embed_tokens" not in name and "lm_head" not in name
            and "norm" not in name and not name.endswith(".mlp.gate.weight"))


def quantize_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, weight_scale_inv [ceil(rows / bm), ceil(cols / bn)]): each block scaled so that its
    largest magnitude is FP8_MAX, as DeepSeek's quantizer does."""
    (rows, cols), (bm, bn) = w.shape, block
    gr, gc = math.ceil(rows / bm), math.ceil(cols / bn)
    blocks = F.pad(w.float(), (0, gc * bn - cols, 0, gr * bm - rows)).view(gr, bm, gc, bn)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).view(gr * bm, gc * bn)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def dequantize_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    full = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return q.float() * full[:q.shape[0], :q.shape[1]]


def quantize_checkpoint(src: Path, dst: Path, block: tuple[int, int] | None, skip: tuple[str, ...] = (),
                        scale_dtype: torch.dtype = torch.float32) -> Path:
    """``src`` written as an FP8 checkpoint under ``dst`` (the modules in ``skip`` left unquantized and
    listed in modules_to_not_convert; block None: per-tensor scales and a static scheme's input_scale),
    and the oracle beside it, ``dst``-dequant: the dequantized weights, unquantized. Returns ``dst``."""
    ref = dst.with_name(dst.name + "-dequant")
    if (dst / "config.json").exists():
        return dst
    quantized, dequantized = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if not is_quantized_linear(name, w) or module in skip:
            quantized[name] = dequantized[name] = w
            continue
        if block is None:
            scale = (w.abs().amax().clamp(min=1e-12) / FP8_MAX).to(scale_dtype)
            q = (w / scale.float()).to(torch.float8_e4m3fn)
            quantized[f"{module}.weight_scale"] = scale
            quantized[f"{module}.input_scale"] = torch.tensor(0.02)
            dequantized[name] = q.float() * scale.float()
        else:
            q, scale = quantize_block(w, block)
            quantized[f"{module}.weight_scale_inv"] = scale.to(scale_dtype)
            dequantized[name] = dequantize_block(q, scale.to(scale_dtype), block)
        quantized[name] = q
    for out, tensors in ((dst, quantized), (ref, dequantized)):
        shutil.copytree(src, out)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "static" if block is None else "dynamic",
                                     **({"weight_block_size": list(block)} if block else {}),
                                     **({"modules_to_not_convert": list(skip)} if skip else {})}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def fp8_model(model_root: Path, arch: str, block, **kw) -> Path:
    tag = f"{'x'.join(map(str, block)) if block else 'tensor'}-{'-'.join(kw.get('skip', ()))}-" \
          f"{str(kw.get('scale_dtype', 'f32')).replace('torch.', '')}"
    return quantize_checkpoint(make_model(model_root, arch), model_root / f"fp8-{arch}-{tag}"[:120], block, **kw)


# arch, weight_block_size, options: the hub's 128x128 blocks (every tiny matrix one partial block), and
# small blocks that split every matrix into several, the last ones partial; bf16 scales (some checkpoints
# store them so); per-tensor scales with a static scheme's input_scale; MoE experts; DeepSeek-V3's MLA
# (q_a/q_b, kv_a_proj_with_mqa and kv_b quantized, as in its checkpoint), dense layer, experts, shared expert
CASES = [("qwen3", (128, 128), {}), ("qwen3", (48, 40), {"scale_dtype": torch.bfloat16}),
         ("llama", None, {}), ("qwen3_moe", (16, 24), {}), ("deepseek_v3", (24, 20), {})]


@pytest.mark.parametrize("arch,block,kw", CASES, ids=["qwen3-128", "qwen3-48x40-bf16", "llama-per-tensor",
                                                       "qwen3_moe-16x24", "deepseek_v3-24x20"])
def test_the_weights_are_the_dequantized_ones(model_root, arch, block, kw, caplog):
    path = fp8_model(model_root, arch, block, **kw)
    with caplog.at_level(logging.INFO, logger="nanoserve.model"):
        assert_loads_as_its_dequantized_twin(path)
    log = next(r.getMessage() for r in caplog.records if "FP8 checkpoint" in r.getMessage())
    n = sum(1 for k, v in load_file(str(path / "model.safetensors")).items() if v.dtype == torch.float8_e4m3fn)
    kind = "per-tensor FP8, static" if block is None else f"block FP8 ({block[0]}x{block[1]} blocks), dynamic"
    assert log.startswith(f"[model] FP8 checkpoint ({kind} activation scheme): {n} fp8 weights dequantized to "
                          "float32 as they were loaded. The weights are held dequantized: the memory is the "
                          "float32 model's (about 4x the checkpoint's)")
    assert ("static input scales not applied" in log) == (block is None)


def test_bfloat16_holds_the_dequantized_weights_rounded_once(model_root):
    """Dequantized in fp32, then rounded to the model's dtype: as the dequantized checkpoint is loaded."""
    path = fp8_model(model_root, "qwen3", (48, 40), scale_dtype=torch.bfloat16)
    model, weight_bytes = load_model(path, torch.bfloat16, torch.device("cpu"))
    ref, _ = load_model(dequant_of(path), torch.bfloat16, torch.device("cpu"))
    theirs = dict(ref.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in model.named_parameters())
    assert weight_bytes == sum(p.numel() * 2 for p in model.parameters())  # the bf16 model's


class TensorSlice:
    """safetensors' slice of a tensor in memory: what a weight_loader is handed."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    def get_shape(self) -> list[int]:
        return list(self.t.shape)

    def get_dtype(self) -> str:
        return "F8_E4M3"

    def __getitem__(self, key):
        return self.t[key]


@pytest.mark.parametrize("key", [(), (slice(None), slice(7, 41)), (slice(None), slice(None), slice(13, 61)),
                                 (slice(1, 2), slice(0, 0))], ids=["whole", "rows", "columns", "empty"])
def test_a_stack_of_experts_slices_as_its_dequantized_weights(key, monkeypatch):
    """A 3-D stack (one grid of blocks per expert), its ue8m0 scales stored as bytes (2 ** (byte - 127)),
    sliced through blocks, 5 rows dequantized at a time: each element times its own block's scale."""
    monkeypatch.setattr(Fp8Slice, "ROWS_AT_A_TIME", 5)
    torch.manual_seed(0)
    q = (torch.randn(2, 50, 70) * 100).to(torch.float8_e4m3fn)
    exponents = torch.randint(120, 130, (2, 4, 3), dtype=torch.uint8)  # 50 rows in 16s, 70 columns in 32s
    weights = torch.stack([dequantize_block(q[e], 2.0 ** (exponents[e].float() - 127), (16, 32)) for e in range(2)])
    fp8 = Fp8Slice("experts.gate_up_proj", TensorSlice(q), "experts.gate_up_proj_scale_inv", exponents, (16, 32))
    assert fp8.get_shape() == [2, 50, 70]
    assert torch.equal(fp8[key], weights[key])


def generate(path: Path, **kw) -> tuple[list[list[int]], list[list[float]]]:
    return greedy_tokens_and_logprobs(path, PROMPTS, N_NEW, **kw)


def hf_reference(path) -> tuple[list[list[int]], list[list[float]]]:
    return hf_greedy_logprobs(path, PROMPTS, N_NEW)


def test_greedy_tokens_are_transformers_on_the_dequantized_weights(model_root, caplog):
    """Two modules left unquantized (modules_to_not_convert: stored in fp32, loaded as they are), the rest
    in 48x40 blocks; under chunked prefill."""
    skip = ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj")
    path = fp8_model(model_root, "qwen3", (48, 40), skip=skip)
    with caplog.at_level(logging.INFO, logger="nanoserve.model"):
        tokens, logprobs = generate(path)
    assert "dynamic activation scheme): 12 fp8 weights dequantized to float32" in caplog.text  # 14 linears, 2 kept
    ref_tokens, ref_logprobs = hf_reference(dequant_of(path))
    assert tokens == ref_tokens
    torch.testing.assert_close(torch.tensor(sum(logprobs, [])), torch.tensor(sum(ref_logprobs, [])),
                               atol=2e-4, rtol=1e-4)


def test_bfloat16_serving_is_the_dequantized_checkpoints(model_root):
    """In bf16, through the CPU backend's kernels (its linear weights packed as an unquantized model's):
    the same tokens and logprobs as the dequantized checkpoint served in bf16."""
    path = fp8_model(model_root, "qwen3", (48, 40), scale_dtype=torch.bfloat16)
    cpu = dict(dtype="bfloat16", enforce_eager=False)
    assert generate(path, **cpu) == generate(dequant_of(path), **cpu)


def test_tensor_parallel_shards_are_cut_from_the_dequantized_weights(model_root):
    """DeepSeek-V3 in 24x20 blocks over two ranks, each rank's shard cut through blocks: kv_b's rows (80 of
    160), the dense MLP's and every expert's intermediate rows (64 of 128, 16 of 32) and columns of their
    down projections, o's columns (48 of 96). Tokens as one rank's and transformers'."""
    path = fp8_model(model_root, "deepseek_v3", (24, 20))
    tp2, tp2_logprobs = generate(path, tensor_parallel_size=2)
    tp1, tp1_logprobs = generate(path)
    assert tp2 == tp1 == hf_reference(dequant_of(path))[0]
    torch.testing.assert_close(torch.tensor(sum(tp2_logprobs, [])), torch.tensor(sum(tp1_logprobs, [])),
                               atol=2e-4, rtol=1e-4)


def _config(path: Path, **quant) -> dict:
    c = json.loads((path / "config.json").read_text())
    return {**c, "quantization_config": quant}


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "gguf"}, "quant_method 'gguf'"),
    ({"quant_method": "fbgemm_fp8"}, "quant_method 'fbgemm_fp8'"),
], ids=["bnb", "gguf", "fbgemm_fp8"])  # mxfp4 (gpt-oss's only): test_gpt_oss; gptq, awq, compressed-tensors: test_wna16
def test_other_quantization_methods_are_refused_by_name(tiny_model, quant, message):
    with pytest.raises(ModelLoadError) as e:
        ModelConfig.from_dict(_config(tiny_model, **quant))
    assert str(e.value) == (f"the checkpoint is quantized with {message}, which nanoserve does not serve: it "
                            "serves unquantized checkpoints (bf16, fp16 or fp32 safetensors), FP8 ones "
                            "(quant_method 'fp8', block or per-tensor), int4/int8 weight-only ones (quant_method "
                            "'gptq', 'awq' or 'compressed-tensors'), and gpt-oss's MXFP4 experts")


@pytest.mark.parametrize("quant,message", [
    ({"fmt": "e5m2"}, "FP8 checkpoint with fmt 'e5m2' is not supported (nanoserve reads e4m3 weights)"),
    ({"activation_scheme": "token"}, "FP8 checkpoint with activation_scheme 'token' is not supported"),
    ({"weight_block_size": [128]}, "FP8 checkpoint's weight_block_size [128] must be two positive integers"),
    ({"weight_block_size": [128, 0]}, "FP8 checkpoint's weight_block_size [128, 0] must be two positive integers"),
    ({"expert_dtype": "fp4"}, "FP8 checkpoint with expert_dtype 'fp4' is not supported"),
], ids=["e5m2", "scheme", "block-1", "block-0", "fp4-experts"])
def test_fp8_variants_not_served_are_refused(tiny_model, quant, message):
    with pytest.raises(ModelLoadError, match=r"^" + re.escape(message)):
        ModelConfig.from_dict(_config(tiny_model, quant_method="fp8", **quant))


def test_fp8_kv_cache_scales_are_left_unused_as_vllms_auto_kv_cache_dtype_does(model_root, caplog):
    """A checkpoint made for vLLM's --kv-cache-dtype fp8 (kv_cache_scheme, k_scale/v_scale tensors) loads
    as without them: the KV cache holds the model's dtype, and each is logged, not refused."""
    def add_scales(tensors):
        for layer in range(2):
            for kind in ("k", "v"):
                tensors[f"model.layers.{layer}.self_attn.{kind}_proj.{kind}_scale"] = torch.tensor(0.5)
    path = _edited(model_root, "kv-scales", add_scales)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float"}
    (path / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.INFO, logger="nanoserve.model"):
        model, _ = load_model(path, torch.float32, torch.device("cpu"))
    plain, _ = load_model(fp8_model(model_root, "qwen3", (48, 40)), torch.float32, torch.device("cpu"))
    theirs = dict(plain.named_parameters())
    assert all(torch.equal(p, theirs[name]) for name, p in model.named_parameters())
    logs = [r.getMessage() for r in caplog.records]
    assert "[model] FP8 checkpoint with kv_cache_scheme: not applied, the KV cache holds the model's dtype (as " \
           "vLLM's with --kv-cache-dtype auto)" in logs
    assert "[model] 4 fp8 KV-cache scales (k_scale, v_scale ...) not applied: the KV cache holds the model's " \
           "dtype, as vLLM's with --kv-cache-dtype auto" in logs


def _edited(model_root: Path, name: str, edit) -> Path:
    """The 48x40 qwen3 FP8 checkpoint with its tensors changed by ``edit`` (in place on the dict)."""
    return edited_checkpoint(fp8_model(model_root, "qwen3", (48, 40)), model_root / f"broken-{name}", edit)


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("name,edit,message", [
    ("no-scale", lambda t: t.pop(f"{Q}.weight_scale_inv"),
     f"fp8 tensor '{Q}.weight' in model.safetensors has no scale '{Q}.weight_scale_inv' beside it"),
    ("bad-grid", lambda t: t.update({f"{Q}.weight_scale_inv": torch.ones(2, 2)}),
     f"tensor '{Q}.weight_scale_inv' has shape (2, 2), expected (3, 2): '{Q}.weight' (128, 64) in blocks of 48x40"),
    ("stray-scale", lambda t: t.update({"model.layers.0.input_layernorm.weight_scale_inv": torch.ones(1)}),
     "unexpected tensor 'model.layers.0.input_layernorm.weight_scale_inv': a scale with no fp8 weight beside it"),
], ids=["no-scale", "bad-grid", "stray-scale"])
def test_a_broken_fp8_checkpoint_is_refused_in_one_line(model_root, name, edit, message):
    path = _edited(model_root, name, edit)
    with pytest.raises(ModelLoadError) as e:
        load_model(path, torch.float32, torch.device("cpu"))
    assert str(e.value) == message


def test_fp8_tensors_without_a_quantization_config_are_refused(model_root):
    path = _edited(model_root, "no-config", lambda t: None)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"^tensor 'model.layers.0.mlp.down_proj.weight' in model.safetensors "
                                             r"is F8_E4M3, but config.json has no quantization_config to say how "
                                             r"it is scaled$"):
        load_model(path, torch.float32, torch.device("cpu"))
