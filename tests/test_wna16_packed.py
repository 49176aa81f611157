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
    scales = torch.rand(groups, N, generator=gen) / 8 + 1e-3
    zeros = torch.full((groups, N), 1 << (bits - 1)) if sym else torch.randint(0, 1 << bits, (groups, N), generator=gen)
    weight = (codes - zeros[g]).float() * scales[g]
    return (pack(codes, bits, 0), scales, zeros.to(torch.uint8), g.to(torch.int32) if act_order else None,
            group_size, weight)


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
