"""The Triton kernels on a GPU: checked against their torch twins and a float64
truth in bf16, fp16 and fp32, then timed against the card's memory bandwidth
(decode, store) and against torch's own SDPA (prefill), then nanoserve end to
end on the GPU (greedy parity with transformers, and W1's throughput).

    python benchmarks/triton_gpu.py --out DIR          # a CUDA machine: all of it
    TRITON_INTERPRET=1 python benchmarks/triton_gpu.py --device cpu --quick
                                                       # the script itself, on a CPU

The tests check the kernels only under Triton's CPU interpreter (fp32); this is
where they meet real hardware and half precision. Prints a table per part; with
--out writes every number to DIR/triton_gpu.json. Exit status 1 if a check fails.

What is measured (benchmarks/RESULTS.md explains the arithmetic):
  decode   bytes = the K and V each sequence reads (its seq_len rows of kv_heads
           x head_dim) + query + output; GB/s against the measured copy rate
  prefill  FLOPs = 4 x heads x head_dim x (keys each query token sees); TFLOP/s
           against torch's flash SDPA on the same tokens in plain contiguous layout
  store    bytes = K and V read once and written once
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanoserve import kernels  # noqa: E402

NOMINAL_BW = 4.3e12   # H200 device-to-device copy rate measured in this workplace (bytes/s)
SHAPES = {            # name: (block_size, head_dim, num_heads, num_kv_heads)
    "qwen3-0.6b": (16, 128, 16, 8),
    "llama3-8b": (16, 128, 32, 8),
    "w0": (16, 64, 8, 4),
    "group7": (16, 64, 14, 2),    # a query-head group that is no power of two
    "mha-bs32": (32, 64, 8, 8),
    "d256-bs8": (8, 256, 8, 1),
}
# Each sequence of a batch as (tokens cached before this step, tokens this step).
SCENARIOS = {
    "decode": [(4, 1), (16, 1), (37, 1), (0, 1), (300, 1)],
    "decode-long": [(3000, 1), (40, 1), (1500, 1)],          # takes split-KV
    "decode-wide": [((i * 37) % 700, 1) for i in range(80)],  # 80 x kv_heads programs
    "prefill": [(0, 5), (0, 190), (0, 64)],
    "chunked": [(160, 70), (9, 120)],
    "mixed": [(120, 1), (0, 60), (200, 90), (33, 1)],
    "idle-seq": [(5, 0), (3, 2), (9, 1)],
}
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}  # relative L2 error vs float64


# ============================================================================ inputs

def make_batch(specs, block_size, head_dim, num_heads, num_kv_heads, dtype, device, gen):
    """Random queries and a paged cache holding each sequence's context. Every
    slot that no sequence owns (whole spare blocks, the tail of each last block,
    block 0 that pads the tables) is NaN: a kernel that reads one shows it."""
    seq_lens = [c + q for c, q in specs]
    n_blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(n_blocks) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(specs), max(n_blocks) + 1, dtype=torch.int32)
    for i, (n, nb) in enumerate(zip(seq_lens, n_blocks)):
        table[i, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
        pos = torch.arange(n)
        blocks = table[i, pos // block_size].long().to(device)
        for cache in (k_cache, v_cache):
            cache[blocks, (pos % block_size).to(device)] = torch.randn(
                n, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    q_lens = [q for _, q in specs]
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    return (query, k_cache, v_cache, table.to(device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device), qsl.to(device))


def truth(query, k_cache, v_cache, block_tables, seq_lens, qsl, scale):
    """Dense float64 attention, one sequence at a time, from the definition."""
    out = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    bs, group = k_cache.shape[1], query.shape[1] // k_cache.shape[2]
    for i, n in enumerate(seq_lens.tolist()):
        s, e = qsl[i].item(), qsl[i + 1].item()
        if e == s:
            continue
        pos = torch.arange(n, device=query.device)
        blocks = block_tables[i, pos // bs].long()
        k = k_cache[blocks, pos % bs].double().repeat_interleave(group, 1)
        v = v_cache[blocks, pos % bs].double().repeat_interleave(group, 1)
        q_pos = torch.arange(n - (e - s), n, device=query.device)
        scores = torch.einsum("qhd,khd->hqk", query[s:e].double(), k) * scale
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def rel_err(got, ref) -> float:
    return float((got.double() - ref).norm() / ref.norm().clamp_min(1e-30))


# ============================================================================ checks

def check_store(shape_name, dtype, device, gen) -> dict:
    block_size, head_dim, _, kvh = SHAPES[shape_name]
    num_blocks, n = 12, 40
    cache_shape = (num_blocks, block_size, kvh, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(device)
    fused = torch.randn(n, 2, kvh, 2 * head_dim, generator=gen).to(dtype).to(device)
    key, value = fused[:, 0, :, ::2], fused[:, 1, :, 1::2]   # strided views, as a fused QKV gives
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[::7] = -1                                            # padding tokens
    slots = slots.to(device)
    k_twin, v_twin = k_cache.clone(), v_cache.clone()
    kernels.store_kvcache_triton(key, value, k_cache, v_cache, slots)
    kernels.store_kvcache_torch(key, value, k_twin, v_twin, slots)
    ok = torch.equal(k_cache, k_twin) and torch.equal(v_cache, v_twin)
    return dict(kernel="store_kvcache", shape=shape_name, dtype=str(dtype)[6:], ok=ok)


def check_attention(shape_name, scenario, dtype, device, gen) -> dict:
    cfg = SHAPES[shape_name]
    batch = make_batch(SCENARIOS[scenario], *cfg, dtype, device, gen)
    query, k_cache, v_cache, table, seq_lens, qsl = batch
    scale = cfg[1] ** -0.5
    ref = truth(*batch, scale)
    out = torch.full_like(query, float("nan"))                  # every element must be written
    got = kernels.paged_attention_triton(*batch, scale, out=out)
    # The twin gathers whole blocks and masks afterwards (NaN * 0 is NaN): it gets zeros.
    twin = kernels.paged_attention_torch(query, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0),
                                         table, seq_lens, qsl, scale)
    if device == "cuda":
        torch.cuda.synchronize()
    e_triton, e_twin = rel_err(got, ref), rel_err(twin, ref)
    finite = bool(torch.isfinite(got).all())
    ok = finite and e_triton <= TOL[dtype] and e_triton <= 2 * e_twin + TOL[dtype] / 10
    return dict(kernel="paged_attention", shape=shape_name, scenario=scenario, dtype=str(dtype)[6:],
                ok=ok, finite=finite, err_triton=e_triton, err_twin=e_twin,
                max_diff_vs_twin=float((got.double() - twin.double()).abs().nan_to_num(1e9).max()))


def run_checks(device, quick, gen) -> list[dict]:
    dtypes = [torch.float32] if quick else [torch.bfloat16, torch.float16, torch.float32]
    shapes = ["w0", "group7"] if quick else list(SHAPES)
    scenarios = [s for s in SCENARIOS if not (quick and s in ("decode-long", "decode-wide"))]
    rows = []
    for dtype in dtypes:
        # fp32 (the precise path) on two shapes is enough; half precision on all
        for shape in (shapes if dtype != torch.float32 or quick else ["qwen3-0.6b", "group7"]):
            rows.append(_safely(check_store, shape, dtype, device, gen))
            for sc in scenarios:
                rows.append(_safely(check_attention, shape, sc, dtype, device, gen))
    print("\n## checks: Triton vs float64 truth (relative L2 error), and vs the torch twin")
    print(f"{'kernel':16} {'shape':11} {'scenario':12} {'dtype':8} {'err triton':>11} "
          f"{'err twin':>10} {'max|tri-twin|':>13}  ok")
    for r in rows:
        print(f"{r['kernel']:16} {r['shape']:11} {r.get('scenario', ''):12} {r['dtype']:8} "
              f"{r.get('err_triton', float('nan')):11.2e} {r.get('err_twin', float('nan')):10.2e} "
              f"{r.get('max_diff_vs_twin', float('nan')):13.2e}  {'ok' if r['ok'] else 'FAIL ' + r.get('error', '')}")
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} checks passed")
    return rows


def _safely(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a failed case is a row, the run goes on
        traceback.print_exc()
        return dict(kernel=fn.__name__, shape=args[0], scenario=args[1] if isinstance(args[1], str) else "",
                    dtype=str([a for a in args if isinstance(a, torch.dtype)][0])[6:], ok=False,
                    error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")


# ============================================================================ timing

def bench(fn, device) -> float:
    """Median milliseconds of fn()."""
    if device == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=20, rep=80, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def ceilings(device, quick) -> dict:
    if device != "cuda":
        return {}
    x = torch.empty(2**30 if not quick else 2**24, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), device)
    copy_bw = 2 * x.numel() / (ms * 1e-3)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    ms_mm = bench(lambda: a @ b, device)
    res = dict(copy_GBps=copy_bw / 1e9, bf16_gemm_TFLOPs=2 * 8192**3 / (ms_mm * 1e-3) / 1e12)
    print(f"\n## ceilings: copy {res['copy_GBps']:.0f} GB/s (read + write), "
          f"bf16 8192^3 GEMM {res['bf16_gemm_TFLOPs']:.0f} TFLOP/s")
    del x, y, a, b
    return res


def paged_cache(num_seqs, ctx, block_size, head_dim, num_kv_heads, dtype, device, gen):
    """A cache holding num_seqs contexts of ctx tokens in scattered blocks."""
    nb = -(-ctx // block_size)
    num_blocks = num_seqs * nb + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    table = (torch.randperm(num_blocks - 1, generator=gen)[:num_seqs * nb] + 1).view(num_seqs, nb)
    return k_cache, v_cache, table.to(torch.int32).to(device)


def time_decode(device, quick, gen) -> list[dict]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    grid = [(4, 64)] if quick else [(b, c) for b in (1, 16, 64, 256) for c in (1024, 4096, 16384)
                                   if b * c <= 2**20]
    rows = []
    for shape in (["w0"] if quick else ["qwen3-0.6b", "llama3-8b"]):
        bs, d, h, kvh = SHAPES[shape]
        for num_seqs, ctx in grid:
            k_cache, v_cache, table = paged_cache(num_seqs, ctx, bs, d, kvh, dtype, device, gen)
            query = torch.randn(num_seqs, h, d, dtype=dtype, device=device)
            seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device=device)
            qsl = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
            args = (query, k_cache, v_cache, table, seq_lens, qsl, d ** -0.5)
            nbytes = 2 * num_seqs * ctx * kvh * d * k_cache.element_size() + 2 * query.nbytes
            auto = kernels._num_kv_splits(True, num_seqs, kvh, table.shape[1] * bs)
            row = dict(shape=shape, num_seqs=num_seqs, ctx=ctx, MB=nbytes / 1e6, auto_splits=auto)
            row["triton_ms"] = bench(lambda: kernels.paged_attention_triton(*args), device)
            out = torch.empty_like(query)
            block_m = max(kernels._BLOCK_M_DECODE, h // kvh)
            for splits in ([1, 2] if quick else [1, 2, 4, 8, 16, 32]):
                # min_partition=1: exactly `splits` partitions, even below the engine's minimum
                row[f"splits{splits}_ms"] = bench(lambda: kernels._launch_attention(
                    *args, out, block_m, block_m // (h // kvh), splits, min_partition=1), device)
            row["twin_ms"] = bench(lambda: kernels.paged_attention_torch(*args), device)
            row["triton_GBps"] = nbytes / (row["triton_ms"] * 1e-3) / 1e9
            best = min((k for k in row if k.startswith("splits")), key=lambda k: row[k])
            row["best"], row["best_GBps"] = best, nbytes / (row[best] * 1e-3) / 1e9
            rows.append(row)
            del k_cache, v_cache
    print("\n## decode (bf16): one query token per sequence, all contexts equal")
    print(f"{'shape':11} {'seqs':>5} {'ctx':>6} {'MB':>8} {'triton ms':>10} {'GB/s':>7} {'%4.3TB/s':>8} "
          f"{'splits':>6} {'best':>10} {'best GB/s':>9} {'twin ms':>9}")
    for r in rows:
        print(f"{r['shape']:11} {r['num_seqs']:5} {r['ctx']:6} {r['MB']:8.1f} {r['triton_ms']:10.3f} "
              f"{r['triton_GBps']:7.0f} {100 * r['triton_GBps'] * 1e9 / NOMINAL_BW:7.1f}% {r['auto_splits']:6} "
              f"{r['best']:>10} {r['best_GBps']:9.0f} {r['twin_ms']:9.3f}")
    return rows


def time_prefill(device, quick, gen) -> list[dict]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cases = [(1, 64)] if quick else [(1, 1024), (1, 4096), (1, 16384), (8, 2048)]
    variants = [(64, 32, {})] if quick else [
        (64, 32, {}), (64, 64, {}), (128, 32, {}), (128, 64, {}),
        (128, 64, dict(num_warps=8)), (128, 128, dict(num_warps=8)), (64, 64, dict(num_stages=2))]
    rows = []
    bs, d, h, kvh = SHAPES["w0" if quick else "qwen3-0.6b"]
    for num_seqs, L in cases:
        k_cache, v_cache, table = paged_cache(num_seqs, L, bs, d, kvh, dtype, device, gen)
        query = torch.randn(num_seqs * L, h, d, dtype=dtype, device=device)
        seq_lens = torch.full((num_seqs,), L, dtype=torch.int32, device=device)
        qsl = (torch.arange(num_seqs + 1, dtype=torch.int32) * L).to(device)
        args = (query, k_cache, v_cache, table, seq_lens, qsl, d ** -0.5)
        flops = 4 * h * d * num_seqs * L * (L + 1) / 2
        row = dict(num_seqs=num_seqs, L=L, GFLOP=flops / 1e9)
        row["triton_ms"] = bench(lambda: kernels.paged_attention_triton(*args), device)
        out = torch.empty_like(query)
        group = h // kvh
        for block_m, block_n, opts in variants:
            name = f"m{block_m}n{block_n}" + "".join(f"{k[4]}{v}" for k, v in opts.items())
            row[name + "_ms"] = _safe_ms(lambda: kernels._launch_attention(
                *args, out, block_m, block_m // group, 1, block_n=block_n, **opts), device)
        # torch's flash SDPA on the same tokens, contiguous [seqs, heads, L, d]: the yardstick
        q = query.view(num_seqs, L, h, d).transpose(1, 2)
        # K/V repeated to every query head: flash SDPA takes no GQA, and the
        # repeat is made once, outside the timed call
        k = torch.randn(num_seqs, h, L, d, dtype=dtype, device=device)
        v = torch.randn_like(k)
        row["sdpa_ms"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device)
        row["twin_ms"] = bench(lambda: kernels.paged_attention_torch(*args), device)
        best = min((k for k in row if k.endswith("_ms") and k[0] == "m"), key=lambda k: row[k])
        row["best"] = best
        for k in [k for k in row if k.endswith("_ms")]:
            row[k[:-3] + "_TFLOPs"] = flops / (row[k] * 1e-3) / 1e12
        rows.append(row)
        del k_cache, v_cache
    print("\n## prefill (bf16, qwen3-0.6b heads): fresh causal prompts")
    print(f"{'seqs':>4} {'L':>6} {'GFLOP':>7} {'triton ms':>10} {'TFLOP/s':>8} {'best variant':>14} "
          f"{'its TFLOP/s':>11} {'SDPA ms':>8} {'TFLOP/s':>8} {'twin ms':>8}")
    for r in rows:
        print(f"{r['num_seqs']:4} {r['L']:6} {r['GFLOP']:7.1f} {r['triton_ms']:10.3f} {r['triton_TFLOPs']:8.1f} "
              f"{r['best'][:-3]:>14} {r[r['best'][:-3] + '_TFLOPs']:11.1f} {r['sdpa_ms']:8.3f} "
              f"{r['sdpa_TFLOPs']:8.1f} {r['twin_ms']:8.3f}")
    return rows


def _safe_ms(fn, device) -> float:
    try:
        return bench(fn, device)
    except Exception as e:  # noqa: BLE001 - e.g. a tile too large for shared memory
        print(f"  variant failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        return float("inf")


def time_mixed_and_store(device, quick, gen) -> list[dict]:
    """Continuous-batching steps (decodes beside prefill chunks) under each tile
    shape, then store_kvcache."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    bs, d, h, kvh = SHAPES["w0" if quick else "qwen3-0.6b"]
    group, ctx = h // kvh, (64 if quick else 2048)
    mixes = [(4, 1, 32)] if quick else [(256, 1, 2048), (64, 1, 2048), (64, 4, 512), (16, 1, 2048),
                                         (4, 1, 2048), (8, 8, 1024), (0, 8, 1024)]
    rows = []
    for n_dec, n_chunks, chunk in mixes:
        n = n_dec + n_chunks
        k_cache, v_cache, table = paged_cache(n, ctx + chunk, bs, d, kvh, dtype, device, gen)
        q_lens = [1] * n_dec + [chunk] * n_chunks
        qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32).to(device)
        query = torch.randn(sum(q_lens), h, d, dtype=dtype, device=device)
        seq_lens = torch.tensor([ctx] * n_dec + [ctx + chunk] * n_chunks, dtype=torch.int32, device=device)
        args = (query, k_cache, v_cache, table, seq_lens, qsl, d ** -0.5)
        out = torch.empty_like(query)
        row = dict(case=f"{n_dec} decodes + {n_chunks} x {chunk}-token chunks, {ctx} cached",
                   tokens_per_seq=sum(q_lens) / n,
                   auto_ms=bench(lambda: kernels.paged_attention_triton(*args), device))
        for block_m, block_n in ((16, 32), (64, 32), (128, 64)):
            bm = max(block_m, group)
            row[f"m{block_m}n{block_n}_ms"] = _safe_ms(lambda: kernels._launch_attention(
                *args, out, bm, bm // group, 1, block_n=block_n), device)
        row["twin_ms"] = bench(lambda: kernels.paged_attention_torch(*args), device)
        rows.append(row)
        del k_cache, v_cache
    print("\n## mixed steps (bf16, qwen3-0.6b heads): ms per tile shape (rows x keys)")
    print(f"{'case':44} {'tok/seq':>7} {'auto':>7} {'m16n32':>7} {'m64n32':>7} {'m128n64':>7} {'twin':>7}")
    for r in rows:
        print(f"{r['case']:44} {r['tokens_per_seq']:7.1f} {r['auto_ms']:7.3f} {r['m16n32_ms']:7.3f} "
              f"{r['m64n32_ms']:7.3f} {r['m128n64_ms']:7.3f} {r['twin_ms']:7.3f}")
    n = 64 if quick else 16384
    k_cache = torch.randn(2 * n // bs, bs, kvh, d, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    key = torch.randn(n, kvh, d, dtype=dtype, device=device)
    value = torch.randn_like(key)
    slots = torch.randperm(k_cache.shape[0] * bs, generator=gen)[:n].to(device)
    nbytes = 4 * key.nbytes
    store = dict(case=f"store_kvcache {n} tokens", MB=nbytes / 1e6)
    store["triton_ms"] = bench(lambda: kernels.store_kvcache_triton(key, value, k_cache, v_cache, slots), device)
    store["twin_ms"] = bench(lambda: kernels.store_kvcache_torch(key, value, k_cache, v_cache, slots), device)
    store["triton_GBps"] = nbytes / (store["triton_ms"] * 1e-3) / 1e9
    store["twin_GBps"] = nbytes / (store["twin_ms"] * 1e-3) / 1e9
    print(f"## {store['case']} ({store['MB']:.0f} MB moved): triton {store['triton_ms']:.3f} ms "
          f"({store['triton_GBps']:.0f} GB/s), twin {store['twin_ms']:.3f} ms ({store['twin_GBps']:.0f} GB/s)")
    return rows + [store]


# ============================================================================ end to end

def save_random_qwen3(path: Path, dtype, **shape) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    config = Qwen3Config(rms_norm_eps=1e-6, eos_token_id=0, bos_token_id=None, **shape)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if shape.get("hidden_size", 0) <= 256:
        with torch.no_grad():  # sharper logits than the default init: greedy ties are rare
            for p in model.parameters():
                p.normal_(0, 0.08) if p.dim() == 2 else p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def end_to_end(device, quick, root: Path) -> dict:
    """nanoserve on the GPU: greedy tokens of a tiny fp32 model against
    transformers' generate on the same GPU, then W1's workload in bf16."""
    from transformers import AutoModelForCausalLM

    from nanoserve import LLM, SamplingParams
    res = {}
    tiny = save_random_qwen3(root / "tiny", torch.float32, vocab_size=384, hidden_size=128,
                             intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                             tie_word_embeddings=True)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 384, (n,), generator=gen).tolist() for n in (1, 9, 40, 130, 300)]
    n_new = 24
    llm = LLM(str(tiny), dtype="float32", device=device, skip_tokenizer_init=True,
              max_model_len=512, num_kv_blocks=256, max_num_batched_tokens=256)
    res["tiny_attn_backend"] = llm.engine.backend.name
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n_new, min_tokens=n_new,
                                                detokenize=False), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).to(device).eval()
    same = 0
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p], device=device), attention_mask=torch.ones(1, len(p), dtype=torch.long,
                              device=device), do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new)
        same += o.outputs[0].token_ids == ref[0, len(p):].tolist()
    res["tiny_greedy_equal"] = f"{same}/{len(prompts)}"
    res["ok"] = same == len(prompts)
    print(f"\n## end to end, tiny fp32 Qwen3 on {device} (attention {res['tiny_attn_backend']}; "
          f"prompts of 1..300 tokens, chunked by a 256-token budget): greedy equal to transformers' "
          f"for {res['tiny_greedy_equal']} prompts")
    del llm, hf
    if quick or device != "cuda":
        return res
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import workloads
    from make_models import SHAPES as MODEL_SHAPES
    w = workloads.get("W1")
    model = save_random_qwen3(root / "w1", torch.bfloat16, **MODEL_SHAPES["w1"])
    t0 = time.perf_counter()
    llm = LLM(str(model), dtype="bfloat16", device=device, skip_tokenizer_init=True)  # 0.9 of the GPU
    llm.generate([w.prompts[0][:16]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    startup = time.perf_counter() - t0
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in w.output_lens]
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(w.prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res.update(w1_wall_s=wall, w1_startup_s=startup, w1_output_tok_s=n_out / wall,
               w1_num_out=n_out, w1_kv_blocks=llm.engine.kv_plan.num_blocks,
               w1_kv_budget_GiB=llm.engine.kv_plan.budget_bytes / 2**30,
               w1_peak_allocated_GiB=torch.cuda.max_memory_allocated() / 2**30,
               gpu_total_GiB=torch.cuda.get_device_properties(0).total_memory / 2**30)
    print(f"## end to end, W1 (64 requests, Qwen3-0.6B shape, random bf16 weights) on the GPU: "
          f"{wall:.2f} s, {n_out / wall:.0f} output tok/s (start-up {startup:.1f} s, "
          f"{res['w1_kv_blocks']} KV blocks = {res['w1_kv_budget_GiB']:.1f} GiB; peak allocated "
          f"{res['w1_peak_allocated_GiB']:.1f} of {res['gpu_total_GiB']:.1f} GiB)")
    return res


# ============================================================================ main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, fp32: a smoke test of the script")
    ap.add_argument("--out", type=Path, help="write DIR/triton_gpu.json")
    parts = ["checks", "ceilings", "decode", "prefill", "mixed_store", "e2e"]
    ap.add_argument("--parts", nargs="*", default=parts, choices=parts)
    args = ap.parse_args()
    if kernels.triton is None:
        print("triton is not installed")
        return 2
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("on the CPU the Triton kernels need TRITON_INTERPRET=1 (set before the run)")
        return 2
    import logging
    import triton
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the engine's start-up arithmetic
    env = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch=torch.__version__,
               triton=triton.__version__, python=platform.python_version(), device=args.device)
    if args.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sms=p.multi_processor_count, gpu_mem_GiB=round(p.total_memory / 2**30, 1))
    print("# " + ", ".join(f"{k} {v}" for k, v in env.items()))
    gen = torch.Generator().manual_seed(0)
    result = dict(env=env)
    root = (args.out or Path("/tmp")) / "models"

    def save():
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "triton_gpu.json").write_text(json.dumps(result, indent=1, default=str))

    parts = [("checks", lambda: run_checks(args.device, args.quick, gen)),
             ("ceilings", lambda: ceilings(args.device, args.quick)),
             ("decode", lambda: time_decode(args.device, args.quick, gen)),
             ("prefill", lambda: time_prefill(args.device, args.quick, gen)),
             ("mixed_store", lambda: time_mixed_and_store(args.device, args.quick, gen)),
             ("e2e", lambda: end_to_end(args.device, args.quick, root))]
    for name, fn in parts:
        if name not in args.parts:
            continue
        t = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as e:  # noqa: BLE001 - report it and go on to the next part
            traceback.print_exc()
            result[name] = dict(error=f"{type(e).__name__}: {e}")
        print(f"[{name}: {time.perf_counter() - t:.1f} s]", flush=True)
        save()
    failed = [r for r in result.get("checks", []) if not r["ok"]]
    failed += [name for name in ("decode", "prefill", "mixed_store", "e2e")
               if isinstance(result.get(name), dict) and ("error" in result[name] or not result[name].get("ok", True))]
    print(f"\n{len(failed)} failures" if failed else "\nall checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
