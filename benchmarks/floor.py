"""How fast a workload could possibly run on this machine: its work, counted,
over the machine's measured rates.

    python benchmarks/floor.py --workload W1 --vllm-seconds 129.3

The work comes from the model's config.json and the workload's exact prompt
and output lengths: the matmul FLOPs (every prompt and decode token through
every linear layer, the LM head for each sampled token only), the prefill
attention FLOPs (causal), and the bytes of K/V that decode attention must read
(each decode step reads its sequence's whole context, every layer). The rates
are measured here, now:

  * bf16 peak: a loop of independent AVX-512 BF16 dot products (vdpbf16ps) on
    every thread, compiled with the system C compiler: what the cores can do;
  * GEMM: the model's four linear layers at a prefill step's 8192 rows, bf16,
    weights packed for oneDNN and the allocator tuned as nanoserve does: what
    its matmuls get;
  * stream: torch's sum over 1 GiB of fp32, the rate decode attention's reads
    are bounded by.

Everything else a step does (norms, rotary, KV stores, sampling, scheduling,
Python) counts as zero, so a real engine is slower than every line printed.
With --vllm-seconds, it also prints issue 7's target (W1: 0.66x vLLM's time;
W0: 1.2x its tok/s, so vLLM's time / 1.2) and what would be left of it for
that everything else.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from nanoserve.cpu_backend import can_pack_linear_weights, tune_process

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import workloads  # noqa: E402

# 12 accumulators: enough independent dot products to cover the instruction's
# latency on every core, so the loop runs at the issue rate.
_PEAK_C = r"""
#include <immintrin.h>
#include <stdint.h>
float bf16_dot_loop(int64_t iters) {
    __m512 acc[12];
    for (int i = 0; i < 12; i++) acc[i] = _mm512_setzero_ps();
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3c00);
    for (int64_t n = 0; n < iters; n++) {
        #pragma GCC unroll 12  /* the accumulators must live in registers */
        for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
        __asm__ volatile("" : "+v"(a));  /* keep the loop from being folded */
    }
    float s = 0;
    for (int i = 0; i < 12; i++) s += _mm512_reduce_add_ps(acc[i]);
    return s;
}
float bf16_peak(int64_t iters, int threads) {
    float s = 0;
    #pragma omp parallel for num_threads(threads) reduction(+:s)
    for (int t = 0; t < threads; t++) s += bf16_dot_loop(iters);
    return s;
}
"""
TARGET_TIME_RATIO = {"W1": 0.66, "W0": 1 / 1.2}  # issue 7: wall time as a fraction of vLLM's
_FLOP_PER_ITER = 12 * 32 * 2  # 12 instructions x 32 bf16 pairs x (mul + add)


def bf16_peak_gflops(threads: int, iters: int = 100_000_000) -> float | None:
    """GFLOP/s of the dot-product loop on ``threads`` threads (best of 3), or None
    where the compiler or the CPU lacks AVX-512 BF16."""
    with tempfile.TemporaryDirectory() as d:
        src, lib = Path(d) / "peak.c", Path(d) / "peak.so"
        src.write_text(_PEAK_C)
        cc = subprocess.run(["cc", "-O2", "-march=native", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(lib)],
                            capture_output=True, text=True)
        if cc.returncode != 0:
            print(f"bf16 peak: not measured (cc: {cc.stderr.strip().splitlines()[-1:]})")
            return None
        fn = ctypes.CDLL(str(lib)).bf16_peak
        fn.argtypes, fn.restype = [ctypes.c_int64, ctypes.c_int], ctypes.c_float
        best = 0.0
        for _ in range(3):
            t = time.perf_counter()
            fn(iters, threads)
            best = max(best, threads * iters * _FLOP_PER_ITER / (time.perf_counter() - t) / 1e9)
        return best


def _best_seconds(fn, reps: int) -> float:
    """The fastest of ``reps`` calls after a warm-up: a floor wants the best the
    machine did, and this machine is shared (its rates move by 30% run to run)."""
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def attention_sizes(cfg: dict) -> tuple[int, int, int, int]:
    """heads, head_dim, and the widths of q and of k (= v) in one token's projection."""
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return heads, head_dim, heads * head_dim, cfg.get("num_key_value_heads", heads) * head_dim


def linear_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's qkv, o, gate+up and down projections."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    _, _, q, kv = attention_sizes(cfg)
    return [(hidden, q + 2 * kv), (q, hidden), (hidden, 2 * inter), (inter, hidden)]


def gemm_gflops(shapes: list[tuple[int, int]], rows: int = 8192, reps: int = 5) -> float:
    """bf16 [rows, in] x [in, out] through oneDNN with packed weights, as
    model.py's Linear runs them: all ``shapes``' FLOPs over their best times."""
    assert can_pack_linear_weights(torch.bfloat16, torch.device("cpu")), "this torch has no oneDNN bf16 linear"
    flop = seconds = 0.0
    for k, n in shapes:
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, dtype=torch.bfloat16), rows)
        seconds += _best_seconds(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), reps)
        flop += 2 * rows * k * n
    return flop / seconds / 1e9


def stream_gbps(gib: float = 1.0, reps: int = 5) -> float:
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    return x.numel() * 4 / _best_seconds(x.sum, reps) / 1e9


def count_work(w: workloads.Workload, cfg: dict) -> dict:
    """FLOPs and bytes of one greedy run of ``w`` (every output length reached)."""
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    heads, head_dim, _, kv = attention_sizes(cfg)
    mac_token = layers * sum(k * n for k, n in linear_shapes(cfg))  # multiply-adds per token
    itemsize = 2  # bf16
    kv_bytes_token = layers * 2 * kv * itemsize  # K and V rows of one token, every layer
    prompt, out = w.num_prompt_tokens, w.num_output_tokens
    # the first output token of each request comes from its prefill step
    decode_tokens = out - len(w.prompts)
    linear = 2 * mac_token * (prompt + decode_tokens) + 2 * hidden * cfg["vocab_size"] * out
    prefill_attn = sum(layers * heads * head_dim * 4 * len(p) * (len(p) + 1) / 2 for p in w.prompts)
    kv_read = sum(kv_bytes_token * (len(p) + t) for p, o in zip(w.prompts, w.output_lens) for t in range(1, o))
    return dict(linear_flop=linear, prefill_attention_flop=prefill_attn, decode_kv_bytes=kv_read,
                prompt_tokens=prompt, output_tokens=out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="W1", choices=["W0", "W1"])
    ap.add_argument("--models", type=Path, default=HERE / "models")
    ap.add_argument("--vllm-seconds", type=float, help="vLLM's measured wall time for this workload here")
    ap.add_argument("--out", type=Path, help="write the numbers as JSON here")
    args = ap.parse_args()

    w = workloads.get(args.workload)
    cfg = json.loads((args.models / w.model / "config.json").read_text())
    work = count_work(w, cfg)
    threads = torch.get_num_threads()
    tune_process()  # as an engine does at start-up, before anything large is allocated
    rates = dict(bf16_peak_gflops=bf16_peak_gflops(threads), gemm_gflops=gemm_gflops(linear_shapes(cfg)),
                 stream_gbps=stream_gbps())
    peak = rates["bf16_peak_gflops"]
    # prefill attention at the GEMM rate: the C chunk kernel runs at ~75% of it, so this is generous
    at_peak = dict(linear=work["linear_flop"] / peak / 1e9 if peak else None,
                   prefill_attention=work["prefill_attention_flop"] / peak / 1e9 if peak else None)
    at_rate = dict(linear=work["linear_flop"] / rates["gemm_gflops"] / 1e9,
                   prefill_attention=work["prefill_attention_flop"] / rates["gemm_gflops"] / 1e9)
    kv_s = work["decode_kv_bytes"] / rates["stream_gbps"] / 1e9

    print(f"{args.workload} on {platform.processor() or platform.machine()}, {threads} threads, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"rates: bf16 dot-product peak {peak or float('nan'):.0f} GFLOP/s, bf16 linear (oneDNN) "
          f"{rates['gemm_gflops']:.0f} GFLOP/s, stream read {rates['stream_gbps']:.1f} GB/s")
    print(f"{'part':<20} {'work':>12} {'s at peak':>10} {'s at GEMM/stream rate':>22}")
    print(f"{'matmuls':<20} {work['linear_flop'] / 1e12:9.2f} TF {at_peak['linear'] or 0:10.1f} {at_rate['linear']:22.1f}")
    print(f"{'prefill attention':<20} {work['prefill_attention_flop'] / 1e12:9.2f} TF "
          f"{at_peak['prefill_attention'] or 0:10.1f} {at_rate['prefill_attention']:22.1f}")
    print(f"{'decode K/V reads':<20} {work['decode_kv_bytes'] / 1e9:9.1f} GB {kv_s:10.1f} {kv_s:22.1f}")
    floor_peak = (at_peak["linear"] or 0) + (at_peak["prefill_attention"] or 0) + kv_s
    floor_rate = at_rate["linear"] + at_rate["prefill_attention"] + kv_s
    print(f"{'floor':<20} {'':>12} {floor_peak:10.1f} {floor_rate:22.1f}")
    record = dict(workload=args.workload, work=work, rates=rates, floor_at_peak_s=floor_peak,
                  floor_at_rate_s=floor_rate, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  threads=threads, torch=torch.__version__)
    if args.vllm_seconds:
        ratio = TARGET_TIME_RATIO[args.workload]
        target = ratio * args.vllm_seconds
        print(f"issue 7's target {ratio:.2f} x {args.vllm_seconds:.1f} s = {target:.1f} s: "
              f"{target - floor_peak:.1f} s left over the floor at peak, {target - floor_rate:.1f} s at the "
              f"measured rates, for everything else a step does")
        record.update(vllm_seconds=args.vllm_seconds, target_s=target)
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
