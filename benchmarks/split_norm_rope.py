"""A B A B, one process: the old fused C qk_norm_rope (kernels.py of a checkout given as
argv[1], e.g. a worktree at 55f6e9c) against the C rms_norm x2 + rotary now called for Qwen3.
Checks both give the same bits; prints per-layer medians (benchmarks/RESULTS.md, 2026-12-04 19:30)."""
import importlib.util, sys, time, statistics, torch

from nanoserve import cpu_kernels, kernels
spec = importlib.util.spec_from_file_location("oldk", sys.argv[1] + "/nanoserve/kernels.py")
oldk = importlib.util.module_from_spec(spec); spec.loader.exec_module(oldk)
def bench(fn, n=300):
    for _ in range(20): fn()
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(n): fn()
        ts.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(ts)
for name, T, hq, hk, d in (("W1 decode", 64, 16, 8, 128), ("W0 decode", 256, 8, 4, 64), ("batch 1", 1, 16, 8, 128)):
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(T, (hq + 2 * hk) * d, generator=g) * 3).bfloat16()
    q, k = qkv[:, :hq * d].view(T, hq, d), qkv[:, hq * d:(hq + hk) * d].view(T, hk, d)
    qw, kw = torch.randn(d).bfloat16(), torch.randn(d).bfloat16()
    pos = torch.randint(0, 4096, (T,)); cos, sin = torch.randn(4096, d), torch.randn(4096, d)
    def old(): return oldk.qk_norm_rope(q, k, pos, cos, sin, qw, kw, 1e-6)
    def new():
        qn, kn = cpu_kernels.rms_norm(q, qw, 1e-6), cpu_kernels.rms_norm(k, kw, 1e-6)
        return cpu_kernels.rotary(qn, kn, pos, cos, sin)
    a, b = old(), new()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    r = []
    for _ in range(2): r += [("old", bench(old)), ("new", bench(new))]
    print(name, " ".join(f"{n}={v:.1f}us" for n, v in r), flush=True)
