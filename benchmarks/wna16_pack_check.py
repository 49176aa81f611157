"""Independent check of nanoserve's GPTQ and AWQ unpacking (model.PackedIntSlice) against packers it did not
write: vLLM's pure-torch/numpy ones (quant_utils.gptq_pack, awq_pack, from its own tests' helpers) and, if its
sdist is given, AutoAWQ's WQLinear_GEMM.from_linear (the packer the hub's -AWQ checkpoints came from).
Random codes, scales and zeros are packed by each, nanoserve reads the packed tensors back, and the weights
must equal (code - zero) * scale exactly, in whole and cut through words and groups. (compressed-tensors is
checked against its own library in tests/test_wna16.py.)

Run it with the vLLM peer venv's Python (benchmarks/setup_peers.sh), nanoserve on PYTHONPATH:
    PYTHONPATH=. benchmarks/.peers/vllm/bin/python benchmarks/wna16_pack_check.py [--autoawq-src DIR]
"""
from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch

from nanoserve.model import PackedIntSlice, WNA16Config, _awq_weight, _Companions, _gptq_weight

OUT, IN, GROUP = 96, 128, 32
WINDOWS = [(slice(None), slice(None)), (slice(5, 77), slice(None)), (slice(None), slice(9, 101))]


def read_back(build, quant: WNA16Config, tensors: dict[str, torch.Tensor], g_idx: torch.Tensor) -> PackedIntSlice:
    """nanoserve's reading of the packed tensors (what load_weights builds for a checkpoint holding them)."""
    comp = _Companions("m", "m.qweight", Path("check.safetensors"), tensors.get, quant)
    codes, shape, scale, zero = build(comp, tensors["m.qweight"], tuple(tensors["m.qweight"].shape), quant)
    return PackedIntSlice(codes, shape, quant.bits, scale, zero, g_idx)


def compare(label: str, got: PackedIntSlice, want: torch.Tensor) -> bool:
    ok = all(torch.equal(got[r, c], want[r, c]) for r, c in WINDOWS)
    print(f"{label:48s} {'equal' if ok else 'DIFFERENT'} ({len(WINDOWS)} windows)")
    return ok


def random_quant(bits: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (IN, OUT), generator=g)       # [in, out]: vLLM's layout
    zeros = torch.randint(1, 1 << bits, (IN // GROUP, OUT), generator=g)
    scales = (torch.rand(IN // GROUP, OUT, generator=g) + 0.01).half()
    g_idx = torch.arange(IN) // GROUP
    want = ((codes - zeros[g_idx]).float() * scales.float()[g_idx]).T  # [out, in]
    return codes, zeros, scales, g_idx, want


def check_vllm() -> bool:
    from vllm.model_executor.layers.quantization.utils.quant_utils import awq_pack, gptq_pack, pack_cols

    ok = True
    for bits in (4, 8):  # GPTQ v2 (zeros as they are), packed by vLLM's gptq_pack / pack_cols
        codes, zeros, scales, g_idx, want = random_quant(bits, bits)
        tensors = {"m.qweight": gptq_pack(codes, bits, IN, OUT), "m.qzeros": pack_cols(zeros, bits, IN // GROUP, OUT),
                   "m.scales": scales}
        quant = WNA16Config("gptq", bits, GROUP, False, "gptq_v2")
        ok &= compare(f"GPTQ int{bits} v2 asym, vLLM gptq_pack", read_back(_gptq_weight, quant, tensors, g_idx), want)
    codes, zeros, scales, g_idx, want = random_quant(4, 0)
    tensors = {"m.qweight": awq_pack(codes, 4, IN, OUT), "m.qzeros": awq_pack(zeros, 4, IN // GROUP, OUT),
               "m.scales": scales}
    ok &= compare("AWQ int4 GEMM, vLLM awq_pack", read_back(_awq_weight, WNA16Config("awq", 4, GROUP, False, "gemm"),
                                                              tensors, g_idx), want)
    return ok


def check_autoawq(src: Path) -> bool:
    """AutoAWQ's own packer, imported from its sdist without its package's heavy imports (accelerate stubbed)."""
    for name in ("accelerate", "accelerate.utils", "accelerate.utils.modeling"):
        stub = types.ModuleType(name)
        stub.__getattr__ = lambda attr: None
        sys.modules.setdefault(name, stub)
    pkg = types.ModuleType("awq")
    pkg.__path__ = [str(src / "awq")]
    sys.modules["awq"] = pkg
    from awq.modules.linear.gemm import WQLinear_GEMM

    codes, zeros, scales, g_idx, want = random_quant(4, 1)
    linear = torch.nn.Linear(IN, OUT, bias=False)
    with torch.no_grad():  # a weight whose round((w + z * s) / s) is exactly the codes
        linear.weight.copy_(((codes - zeros[g_idx]).double() * scales.double()[g_idx]).T.float())
    packed = WQLinear_GEMM.from_linear(linear, 4, GROUP, scales=scales.float(), zeros=zeros.float())
    tensors = {"m.qweight": packed.qweight, "m.qzeros": packed.qzeros, "m.scales": packed.scales}
    return compare("AWQ int4 GEMM, AutoAWQ WQLinear_GEMM.from_linear",
                   read_back(_awq_weight, WNA16Config("awq", 4, GROUP, False, "gemm"), tensors, g_idx), want)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--autoawq-src", type=Path, help="an unpacked autoawq sdist (e.g. autoawq-0.2.9)")
    args = parser.parse_args()
    ok = check_vllm()
    if args.autoawq_src:
        ok &= check_autoawq(args.autoawq_src)
    print("all equal" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
