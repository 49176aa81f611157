"""The Triton kernels compiled for the GPUs nanoserve is measured on (sm_90: H100,
H200), on this CPU-only machine.

The other kernel tests run the kernels through Triton's interpreter, which only
does fp32 and never compiles: a kernel that cannot be lowered for a GPU, does not
take bf16, or asks for more shared memory than an SM has would first fail on a
GPU. Triton compiles ahead of time for a target it is given (``triton.compile``
with a ``GPUTarget``), with the ptxas it ships, and no driver. So this file calls
each Triton wrapper of kernels.py with the shapes of the models that
benchmarks/gpu.py runs (its tiny fp32 models, W1's Qwen3-0.6B in bf16), of a
model whose query-head group is not a power of two (Qwen2.5-0.5B), of Gemma 3
1B (its norm and GELU kernels, head_dim 256), of Phi-3-mini (head_dim 96, padded), of Gemma 2 2B
(its soft-capped attention), of gpt-oss-20b (attention sinks; experts with biases and swigluoai, their
weights in transformers' layout read transposed), of Qwen3-30B-A3B's experts (the fused-MoE grouped GEMMs,
both tiles), of DeepSeek-V2-Lite's and -V3's latent attention (512 + 64, 16 and 128 heads) and of
gpu.py's fp32 parity models of the same kernels (MoE, MLA at 32 + 32 and at 512 + 64), at every
decode batch the engine captures in a CUDA graph and at its chunk and prefill
tiles, records each launch instead of running it, and compiles the distinct
variants to cubins: all of them, except that of the variants that differ only in
their split-KV count it compiles the one with the most splits (the count changes
a loop's trip count and the reduce's tile, nothing else).

The compile runs in a child process: the test session has switched Triton's
interpreter on (conftest.py), under which ``triton.jit`` makes no compilable
kernels. Integer arguments are specialised as Triton's launcher does (1 becomes
a constant), but without its divisibility hints, which change vectorisation and
not whether a kernel compiles or fits. To check another Triton, e.g. the device
image's: ``pip install --no-deps --target /tmp/t36 triton==3.6.0`` and
``PYTHONPATH=/tmp/t36 python tests/test_cuda_compile.py`` (one JSON line a variant)."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest

SM90_SHARED_BYTES = 232_448  # an sm_90 block's most shared memory (227 KiB, opted in)
# (name, dtype, hidden, heads, kv_heads, head_dim, intermediate, qk_norm, max_model_len)
MODELS = [
    ("tiny-llama", "float32", 64, 4, 2, 16, 128, False, 512),   # gpu.py's parity models
    ("tiny-qwen3", "float32", 64, 4, 2, 32, 128, True, 512),
    ("w1-qwen3-0.6b", "bfloat16", 1024, 16, 8, 128, 3072, True, 40960),  # its max_position_embeddings
    ("qwen2.5-0.5b", "bfloat16", 896, 14, 2, 64, 4864, False, 4096),  # 7 query heads a KV head
    ("gemma-3-1b", "bfloat16", 1152, 4, 1, 256, 6912, True, 32768),  # Gemma's ops; head_dim 256
    ("phi-3-mini", "bfloat16", 3072, 32, 32, 96, 8192, False, 4096),  # head_dim 96: tiles padded to 128
    ("gemma-2-2b", "bfloat16", 2304, 8, 4, 256, 9216, False, 8192),  # the soft-capped attention (SOFT_CAP)
    ("gpt-oss-20b", "bfloat16", 2880, 64, 8, 64, 2880, False, 131072),  # attention sinks (SINKS)
    ("tiny-gpt_oss", "float32", 64, 4, 2, 32, 64, False, 512),  # gpu.py's parity model: sinks in fp32
]
# (name, dtype, hidden, experts, experts a token, an expert's intermediate): fused_moe's grouped GEMMs
MOE_MODELS = [("qwen3-30b-a3b", "bfloat16", 2048, 128, 8, 768), ("gpt-oss-20b", "bfloat16", 2880, 32, 4, 2880),
              ("tiny-qwen3_moe", "float32", 64, 4, 2, 32), ("tiny-gpt_oss", "float32", 64, 8, 2, 64)]
# (name, dtype, heads, kv_lora_rank, qk_rope_head_dim, max_model_len): MLA's store and attention over its latent
MLA_MODELS = [("deepseek-v2-lite", "bfloat16", 16, 512, 64, 163840), ("deepseek-v3", "bfloat16", 128, 512, 64, 163840),
              ("tiny-deepseek_v3", "float32", 4, 32, 32, 512), ("tiny-deepseek_v3-576", "float32", 32, 512, 64, 512)]
MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs: graphs are captured up to it


def gpt_oss(model) -> bool:
    """gpt-oss's (20b's, or gpu.py's tiny one's) shapes: its sinks and its experts' biases and activation."""
    return "gpt-oss" in model[0] or "gpt_oss" in model[0]


def attention_kwargs(model) -> dict:
    """The attention's keyword for a soft-capped model (Gemma 2's 50) or one with sinks (gpt-oss's, a
    logit a head), none for the others."""
    import torch
    if model[0].startswith("gemma-2"):
        return {"logits_soft_cap": 50.0}
    return {"sinks": torch.empty(model[3], dtype=torch.float32)} if gpt_oss(model) else {}


def _variants() -> dict[tuple, tuple]:
    """Call kernels.py's Triton wrappers as the engine does, with every kernel
    replaced by a recorder: {(kernel, signature, constants): (signature, constants)}."""
    import torch
    from nanoserve import kernels
    from nanoserve.model import cudagraph_capture_sizes

    def engine_launches():
        for model in MODELS:
            _launch_like_the_engine(kernels.TRITON, torch, model, cudagraph_capture_sizes(MAX_NUM_SEQS))
        for model in MOE_MODELS:
            _launch_moe_like_the_engine(kernels.TRITON, torch, model, cudagraph_capture_sizes(MAX_NUM_SEQS))
        for model in MLA_MODELS:
            _launch_mla_like_the_engine(kernels.TRITON, torch, model, cudagraph_capture_sizes(MAX_NUM_SEQS))
        _launch_wna16_like_the_engine(torch, cudagraph_capture_sizes(MAX_NUM_SEQS))
        _launch_wna16_moe_like_the_engine(torch, cudagraph_capture_sizes(MAX_NUM_SEQS))
    return {key[:3]: value for key, value in record_launches(engine_launches).items()}


def record_launches(run) -> dict[tuple, tuple]:
    """Call ``run()`` with every Triton kernel of kernels.py replaced by a
    recorder: {(kernel, signature, constants, alignment): (signature, constants)}.
    ``alignment`` says which integers and pointers are multiples of 16 (of
    bytes, for pointers), on which Triton's launcher also picks a variant."""
    import torch
    from nanoserve import kernels

    found = {}

    class Recorder:
        def __init__(self, name):
            self.name, self.fn = name, getattr(kernels, name)

        def __getitem__(self, grid):
            return self.launch

        def launch(self, *args, **kwargs):
            sig, consts, aligned = {}, {}, []
            params = _params(self.fn)
            for (name, is_constexpr, fixed), value in zip(params, [*args, *(kwargs[p[0]] for p in params[len(args):])]):
                if is_constexpr:
                    sig[name], consts[name] = "constexpr", value
                elif isinstance(value, torch.Tensor):
                    sig[name] = "*" + {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                                             torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
                                             torch.int16: "i16"}[value.dtype]
                    aligned.append(value.data_ptr() % 16 == 0)
                elif isinstance(value, float):
                    sig[name] = "fp32"
                elif value == 1 and not fixed:  # as Triton's launcher specialises
                    sig[name], consts[name] = "constexpr", 1
                else:
                    sig[name] = "i32" if -2**31 <= value < 2**31 else "i64"
                    aligned.append(not fixed and value % 16 == 0)
            key = (self.name, json.dumps(sig, sort_keys=True), json.dumps(consts, sort_keys=True), tuple(aligned))
            found[key] = (sig, consts)

    names = [n for n in vars(kernels) if n.endswith("_kernel") and n.startswith("_")]
    saved = {n: getattr(kernels, n) for n in names}
    try:
        for n in names:
            setattr(kernels, n, Recorder(n))
        run()
    finally:
        for n, fn in saved.items():
            setattr(kernels, n, fn)
    return found


def _params(kernel) -> list[tuple[str, bool, bool]]:
    """(name, is constexpr, do_not_specialize) of each parameter of a Triton
    kernel, compiled (a JITFunction) or under the interpreter."""
    if hasattr(kernel, "params"):
        return [(p.name, p.is_constexpr, p.do_not_specialize) for p in kernel.params]
    fixed = kernel.kwargs.get("do_not_specialize") or ()
    return [(name, "constexpr" in str(p.annotation), name in fixed)
            for name, p in inspect.signature(kernel.fn).parameters.items()]


def _launch_like_the_engine(b, torch, model, decode_sizes, block_size=16):
    """One layer's launches (model.py's Attention, MLP, RMSNorm) for each kind of step."""
    name, dtype, hidden, heads, kv_heads, head_dim, inter, qk_norm, max_len = model
    dt = getattr(torch, dtype)
    gemma = name.startswith("gemma")  # its norms (an fp32 weight) and GELU
    rms_norm, fused_add_rms_norm = (b.gemma_rms_norm, b.gemma_fused_add_rms_norm) if gemma else \
        (b.rms_norm, b.fused_add_rms_norm)
    weight = (lambda n: torch.empty(n, dtype=torch.float32)) if gemma else (lambda n: torch.empty(n, dtype=dt))
    num_blocks = 64
    k_cache, v_cache = (torch.empty(num_blocks, block_size, kv_heads, head_dim, dtype=dt) for _ in "kv")
    cos = sin = torch.empty(max_len, head_dim, dtype=torch.float32)
    width = max_len // block_size  # the graphs' block tables span max_model_len
    steps = [[1] * n for n in decode_sizes]          # every captured decode batch
    steps += [[600, 700], [1, 1, 37, 1], [5000 // 8] * 8]  # prefill tiles, a mixed step, many chunks
    for q_lens in steps:
        T, n = sum(q_lens), len(q_lens)
        qkv = torch.empty(T, (heads + 2 * kv_heads) * head_dim, dtype=dt)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k, v = (x.view(T, -1, head_dim) for x in (q, k, v))
        if qk_norm:
            q, k = rms_norm(q, weight(head_dim), 1e-6), rms_norm(k, weight(head_dim), 1e-6)
        q, k = b.rotary(q, k, torch.empty(T, dtype=torch.int64), cos, sin)
        b.store_kvcache(k, v, k_cache, v_cache, torch.empty(T, dtype=torch.int64))
        b.paged_attention(q, k_cache, v_cache, torch.empty(n, width, dtype=torch.int32),
                          torch.empty(n, dtype=torch.int32), torch.empty(n + 1, dtype=torch.int32), head_dim ** -0.5,
                          **attention_kwargs(model))
        x = torch.empty(T, hidden, dtype=dt)
        rms_norm(x, weight(hidden), 1e-6)
        fused_add_rms_norm(x, x, weight(hidden), 1e-6)
        (b.gelu_tanh_and_mul if gemma else b.silu_and_mul)(torch.empty(T, 2 * inter, dtype=dt))


def _mla_steps(decode_sizes) -> list[list[int]]:
    """The q_lens of the steps _launch_like_the_engine takes, with MLA's fewer prefill sizes (its tile is one)."""
    return [[1] * n for n in decode_sizes] + [[600, 700], [1, 1, 37, 1]]


def _launch_mla_like_the_engine(b, torch, model, decode_sizes, block_size=16):
    """MLAAttention's store and attention: the latent's one tensor written once, K all of it, V (a view) its
    first kv_lora_rank dims; and its rotary over the rope dims."""
    name, dtype, heads, rank, rope, max_len = model
    dt = getattr(torch, dtype)
    cache = torch.empty(64, block_size, 1, rank + rope, dtype=dt)
    cos = sin = torch.empty(max_len, rope, dtype=torch.float32)
    for q_lens in _mla_steps(decode_sizes):
        T, n = sum(q_lens), len(q_lens)
        b.rotary(torch.empty(T, heads, rope, dtype=dt), torch.empty(T, 1, rope, dtype=dt),
                 torch.empty(T, dtype=torch.int64), cos, sin)
        kv = torch.empty(T, 1, rank + rope, dtype=dt)
        b.store_kvcache(kv, kv, cache, cache, torch.empty(T, dtype=torch.int64))
        b.paged_attention(torch.empty(T, heads, rank + rope, dtype=dt), cache, cache[..., :rank],
                          torch.empty(n, max_len // block_size, dtype=torch.int32), torch.empty(n, dtype=torch.int32),
                          torch.empty(n + 1, dtype=torch.int32), 0.1)


def _launch_moe_like_the_engine(b, torch, model, decode_sizes):
    """One MoE layer's experts (fused_moe) at every captured decode batch and at prefills large
    enough for the 64-row tile. The weights are never touched: torch.empty only reserves them."""
    name, dtype, hidden, experts, top_k, inter = model
    dt = getattr(torch, dtype)
    w13, w2 = torch.empty(experts, 2 * inter, hidden, dtype=dt), torch.empty(experts, hidden, inter, dtype=dt)
    moe_kwargs = {}
    if gpt_oss(model):  # as GptOssExperts calls it: transformers' [E, H, 2I] and [E, I, H] read transposed
        w13 = torch.empty(experts, hidden, 2 * inter, dtype=dt).transpose(1, 2)
        w2 = torch.empty(experts, inter, hidden, dtype=dt).transpose(1, 2)
        moe_kwargs = dict(w13_bias=torch.empty(experts, 2 * inter, dtype=dt),
                          w2_bias=torch.empty(experts, hidden, dtype=dt), activation="swigluoai")
    for T in [*decode_sizes, 1300, 4096]:
        ids = torch.zeros(T, top_k, dtype=torch.int32)  # the routing changes no launch
        b.fused_moe(torch.empty(T, hidden, dtype=dt), w13, w2, torch.empty(T, top_k), ids, **moe_kwargs)


def _launch_wna16_like_the_engine(torch, decode_sizes):
    """W1's gate_up as an int4 g128 weight (fp16 scales, uint8 zeros; and act-order's g_idx) and as an int8 per
    channel one (fp32 scales, int16 zeros), as model.WNA16Weight holds them, at every captured decode batch and
    a prefill: both tiles."""
    from nanoserve import kernels
    K, N = 1024, 2 * 3072
    act_order = torch.empty(K, dtype=torch.int32)
    for bits, scales, zeros, groups, g_idx in ((4, torch.float16, torch.uint8, K // 128, None),
                                               (4, torch.float16, torch.uint8, K // 128, act_order),
                                               (8, torch.float32, torch.int16, 1, None)):
        qweight = torch.empty(K * bits // 32, N, dtype=torch.int32)
        for T in [*decode_sizes, 2048]:
            kernels.wna16_matmul_triton(torch.empty(T, K, dtype=torch.bfloat16), qweight,
                                        torch.empty(groups, N, dtype=scales), torch.empty(groups, N, dtype=zeros),
                                        g_idx, bits, 1 if g_idx is not None else K // groups, 0)


def _launch_wna16_moe_like_the_engine(torch, decode_sizes):
    """Qwen3-30B-A3B-GPTQ-Int4's experts (and -Int8's), kept packed as model.WNA16Experts holds them (g128:
    fp16 scales, uint8 or int16 zeros), at every captured decode batch and a prefill: both tiles, both GEMMs."""
    from nanoserve import kernels
    _, _, hidden, experts, top_k, inter = MOE_MODELS[0]

    def stack(N, K, bits):  # torch.empty: reserved, never touched
        zeros = torch.uint8 if bits == 4 else torch.int16
        return kernels.PackedExperts(torch.empty(experts, K * bits // 32, N, dtype=torch.int32),
                                     torch.empty(experts, K // 128, N, dtype=torch.float16),
                                     torch.empty(experts, K // 128, N, dtype=zeros), bits, 128, 0, K)
    for bits in (4, 8):
        w13, w2 = stack(2 * inter, hidden, bits), stack(hidden, inter, bits)
        for T in [*decode_sizes, 4096]:
            kernels.fused_moe_triton(torch.empty(T, hidden, dtype=torch.bfloat16), w13, w2, torch.empty(T, top_k),
                                     torch.zeros(T, top_k, dtype=torch.int32))


def _compile(item):
    from triton import compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from nanoserve import kernels
    name, sig, consts = item
    try:
        k = compile(ASTSource(getattr(kernels, name), sig, consts), target=GPUTarget("cuda", 90, 32))
    except Exception as e:  # say which variant: the compiler's message names only a line of the kernel
        raise RuntimeError(f"{name} {sig} {consts}: {e}") from None
    return {"kernel": name, "constants": {c: v for c, v in consts.items() if c.isupper()},
            "dtype": next(t for t in sig.values() if t.startswith("*")), "shared": k.metadata.shared,
            "cubin_bytes": len(k.asm["cubin"])}


def main() -> None:
    """Child process: print one JSON line per compiled variant."""
    from concurrent.futures import ProcessPoolExecutor
    most_splits = {}
    for (name, sig_key, _), (sig, consts) in _variants().items():
        splits = consts.get("NUM_SPLITS", 1)
        kind = (name, sig_key, json.dumps({c: v for c, v in consts.items() if c not in ("NUM_SPLITS", "SPLITS_PAD")},
                                          sort_keys=True), splits > 1)
        if splits >= most_splits.get(kind, (0,))[0]:
            most_splits[kind] = (splits, name, sig, consts)
    items = [item[1:] for item in most_splits.values()]
    with ProcessPoolExecutor(max(1, min(2, os.cpu_count() or 1))) as pool:
        for result in pool.map(_compile, items):
            print(json.dumps(result), flush=True)


def _cuda_compiler_missing() -> str | None:
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        return f"no Triton with ahead-of-time compilation: {e}"
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return None if os.path.exists(ptxas) else "Triton's wheel has no ptxas"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    # A cache of its own: ~13 MB of sm_90 cubins this machine cannot run should not stay in ~/.triton.
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="", TRITON_DEFAULT_FP_FUSION="1",
               TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton-sm90")))
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=500,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, f"compiling for sm_90 failed:\n{run.stderr[-4000:]}"
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


needs_ptxas = pytest.mark.skipif(_cuda_compiler_missing() is not None, reason=str(_cuda_compiler_missing()))


@needs_ptxas
def test_every_engine_kernel_variant_compiles_for_sm90(compiled):
    kinds = {(v["kernel"], v["dtype"]) for v in compiled}
    for kernel in ("_store_kvcache_kernel", "_paged_attention_kernel", "_rms_norm_kernel", "_rotary_kernel",
                   "_silu_and_mul_kernel"):
        assert {(kernel, "*bf16"), (kernel, "*fp32")} <= kinds, f"{kernel} was not compiled in bf16 and fp32"
    # the tiny fp32 models' 512-token contexts are never split
    assert ("_split_kv_reduce_kernel", "*bf16") in kinds
    attention = [v["constants"] for v in compiled if v["kernel"] == "_paged_attention_kernel"]
    # decode, chunk and prefill tiles, unsplit and split: what the engine picks on a GPU
    assert {(a["BLOCK_M"], a["BLOCK_N"]) for a in attention} >= {(16, 32), (64, 32), (128, 64)}
    assert {a["NUM_SPLITS"] for a in attention} >= {1, 8, 32}  # 32: the most (kernels._SPLIT_KV_MAX_SPLITS)
    moe = {(v["constants"]["BLOCK_M"], v["constants"]["MUL_ROUTED_WEIGHT"]) for v in compiled
           if v["kernel"] == "_fused_moe_kernel" and v["dtype"] == "*bf16"}
    assert moe == {(16, False), (16, True), (64, False), (64, True)}  # both tiles, both GEMMs
    # gpt-oss's experts: both GEMMs with their biases, both tiles in bf16, and gpu.py's fp32 parity model's
    biased = {(v["dtype"], v["constants"]["BLOCK_M"], v["constants"]["MUL_ROUTED_WEIGHT"]) for v in compiled
              if v["kernel"] == "_fused_moe_kernel" and v["constants"]["HAS_BIAS"]}
    assert {("*bf16", m, w) for m in (16, 64) for w in (False, True)} <= biased
    assert {("*fp32", 16, False), ("*fp32", 16, True)} <= biased
    assert {("_swigluoai_and_mul_kernel", "*bf16"), ("_swigluoai_and_mul_kernel", "*fp32")} <= kinds
    wna16 = {(v["constants"]["BLOCK_M"], v["constants"]["BITS"], v["constants"]["HAS_G_IDX"]) for v in compiled
             if v["kernel"] == "_wna16_matmul_kernel" and v["dtype"] == "*bf16"}
    assert wna16 == {(m, bits, g) for m in (16, 64) for bits, g in ((4, False), (4, True), (8, False))}
    packed_moe = {(v["constants"]["BLOCK_M"], v["constants"]["MUL_ROUTED_WEIGHT"], v["constants"]["WNA16_BITS"])
                  for v in compiled if v["kernel"] == "_fused_moe_kernel" and v["constants"]["WNA16_BITS"]}
    assert packed_moe == {(m, w, bits) for m in (16, 64) for w in (False, True) for bits in (4, 8)}
    assert {a["SOFT_CAP"] for a in attention} == {False, True}
    assert {(v["dtype"], v["constants"]["SINKS"]) for v in compiled if v["kernel"] == "_paged_attention_kernel"} == \
        {("*bf16", False), ("*bf16", True), ("*fp32", False), ("*fp32", True)}
    padded = {(v["kernel"], v["constants"]["HEAD_DIM"]) for v in compiled if v["constants"].get("HEAD_DIM_PAD") == 128}
    assert {("_paged_attention_kernel", 96), ("_split_kv_reduce_kernel", 96)} <= padded
    assert any(v["constants"].get("MAIN") == 96 and v["constants"]["MAIN_PAD"] == 128 for v in compiled)  # the store
    # MLA's latent: the store's two parts, the attention's two dots, 16 heads a tile however many the group has
    assert any(v["constants"].get("MAIN") == 512 and v["constants"]["REST"] == 64 for v in compiled)
    latent = [(v["dtype"], v["constants"]) for v in compiled
              if v["kernel"] == "_paged_attention_kernel" and v["constants"]["ROPE_DIM"]]
    mla = {(a["HEADS"], a["GROUP"], a["NUM_SPLITS"] > 1) for dt, a in latent if dt == "*bf16"}
    assert mla == {(16, 16, False), (16, 16, True), (16, 128, False), (16, 128, True)}
    assert all(a["HEAD_DIM"] == 512 and (a["BLOCK_M"], a["BLOCK_N"]) == (16, 32)
               for _, a in latent if a["ROPE_DIM"] == 64)
    # gpu.py's fp32 parity models: deepseek_v3-576's 32 heads on 512 + 64, deepseek's 32 + 32
    assert {(dt, a["HEAD_DIM"], a["ROPE_DIM"], a["GROUP"]) for dt, a in latent if dt == "*fp32"} == \
        {("*fp32", 512, 64, 32), ("*fp32", 32, 32, 4)}
    assert {a["ONE_CACHE"] for a in attention} == {False, True}  # V read apart, and MLA's V out of K's tile
    assert all(a["ONE_CACHE"] for _, a in latent)
    assert all(v["cubin_bytes"] > 0 for v in compiled)


@needs_ptxas
def test_every_variant_fits_an_sm90_block(compiled):
    over = [v for v in compiled if v["shared"] > SM90_SHARED_BYTES]
    assert not over, f"more shared memory than an sm_90 block has: {over}"


@pytest.mark.parametrize("model", MODELS, ids=[m[0] for m in MODELS])
def test_warm_up_builds_every_attention_variant_that_traffic_launches(model):
    """No Triton compile in the middle of traffic: the variants of the attention
    kernels that any decode batch (1 to 2 x max_num_seqs sequences, eager with
    tables as wide as their longest context, or in a captured graph with tables
    max_model_len wide), prefill or mixed step launches are all among those the
    backend's warm-up launched."""
    torch = pytest.importorskip("torch")
    _, dtype, _, heads, kv_heads, head_dim, _, _, max_len = model
    k_cache, v_cache = (torch.empty(4, 16, kv_heads, head_dim, dtype=getattr(torch, dtype)) for _ in "kv")
    check_warm_up_covers_traffic(heads, k_cache, v_cache, max_len, **attention_kwargs(model))


@pytest.mark.parametrize("model", MLA_MODELS, ids=[m[0] for m in MLA_MODELS])
def test_warm_up_builds_every_latent_attention_variant_that_traffic_launches(model):
    """The same for MLA's attention: K the latent's tensor, V its first kv_lora_rank dims (MLAAttention's
    attention_caches, which the runner's warm-up passes too)."""
    torch = pytest.importorskip("torch")
    _, dtype, heads, rank, rope, max_len = model
    cache = torch.empty(4, 16, 1, rank + rope, dtype=getattr(torch, dtype))
    check_warm_up_covers_traffic(heads, cache, cache[..., :rank], max_len)


def check_warm_up_covers_traffic(heads, k_cache, v_cache, max_len, **kwargs):
    from nanoserve import kernels
    if kernels.TRITON is None:
        pytest.skip("triton is not installed")
    import torch
    block_size = k_cache.shape[1]
    max_blocks = -(-max_len // block_size)

    def attend(q_lens, width):
        T, n = sum(q_lens), len(q_lens)
        kernels.TRITON.paged_attention(torch.empty(T, heads, k_cache.shape[3], dtype=k_cache.dtype), k_cache,
                                       v_cache, torch.empty(n, width, dtype=torch.int32),
                                       torch.empty(n, dtype=torch.int32), torch.empty(n + 1, dtype=torch.int32),
                                       0.1, **kwargs)

    def traffic():
        widths = sorted({min(1 << i, max_blocks) for i in range(max_blocks.bit_length() + 1)} | {3, max_blocks})
        for n in range(1, 2 * MAX_NUM_SEQS + 1):
            for width in widths:
                attend([1] * n, width)
        for q_lens in ([600, 700], [1, 1, 37, 1], [5000 // 8] * 8, [1] * 64 + [2048]):
            attend(q_lens, max_blocks)

    attention = ("_paged_attention_kernel", "_split_kv_reduce_kernel")
    launched = {k for k in record_launches(traffic) if k[0] in attention}
    warm = record_launches(lambda: kernels.TRITON.warm_up(heads, k_cache, v_cache, max_blocks * block_size, **kwargs))
    assert launched, "the recorder saw no attention launch"
    missing = sorted(launched - set(warm))
    assert not missing, f"traffic would compile {len(missing)} variant(s) the warm-up did not: {missing[:3]}"


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    os.environ.update(TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="", TRITON_DEFAULT_FP_FUSION="1")
    main()
