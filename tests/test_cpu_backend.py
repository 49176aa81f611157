"""The CPU backend's choice (nanoserve/cpu_backend.py): on the CPU an engine
takes the C kernels where they build, else torch.compile'd ones, else the torch
references, says why at each step down, and gets the same tokens whichever it
took; --enforce-eager takes the references. Also the oneDNN weight packing, the
C linear kernel (or fp32 linear weights) of a CPU without bf16 matrix
instructions, and the process-wide allocator settings."""
from __future__ import annotations

import dataclasses
import logging
import os
import platform
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import VOCAB, make_model, step_logits
from test_cpu_kernels import _c_linear_or_skip
from nanoserve import LLM, SamplingParams, cpu_backend, cpu_kernels, kernels
from nanoserve.kvcache import KVCacheSpec, allocate_kv_cache
from nanoserve.model import ModelConfig, ModelRunner, SeqInput, load_model

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
_rng = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(1, VOCAB, (n,), generator=_rng).tolist() for n in (45, 7, 1, 60, 23)]


@pytest.fixture(scope="module")
def model(model_root):
    return make_model(model_root, "llama")  # head_dim 16: the C attention kernels take multiples of 32


def make_llm(model, **kw) -> LLM:
    return LLM(str(model), **{"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 64, **kw})


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def runner_with(backend: kernels.Backend, path, dtype=torch.bfloat16) -> ModelRunner:
    """A runner of its own over ``backend``, as the engine would build it (on the
    CPU every backend packs bf16 linear weights: cpu_backend.prepare_model)."""
    backend = dataclasses.replace(backend, prepare_model=cpu_backend.prepare_model)
    cfg = ModelConfig.from_dir(path)
    model, _ = load_model(path, dtype, torch.device("cpu"), backend)
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, 16)
    return ModelRunner(model, allocate_kv_cache(spec, 64, torch.device("cpu")), 16, torch.device("cpu"), backend)


def two_steps(runner: ModelRunner, prompt_len: int = 100) -> list[torch.Tensor]:
    """A prefill of three prompts, then a decode of each: the logits of both steps."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (prompt_len,), generator=gen).tolist() for _ in range(3)]
    n = -(-(prompt_len + 1) // 16)
    tables = [list(range(1 + n * i, 1 + n * (i + 1))) for i in range(3)]
    return [step_logits(runner, step) for step in (
        [SeqInput(p, 0, t, None) for p, t in zip(prompts, tables)],
        [SeqInput([5 + i], prompt_len, t, None) for i, t in enumerate(tables)])]


def _c_or_skip(group=2, head_dim=32):
    try:
        cpu_kernels.attention_library(group, head_dim)
        cpu_kernels.row_ops_library()
    except RuntimeError as e:
        pytest.skip(str(e))


def _no_c(monkeypatch):
    def broken(*args):
        raise RuntimeError("no C compiler found (set CC)")
    monkeypatch.setattr(cpu_kernels, "attention_library", broken)
    monkeypatch.setattr(cpu_kernels, "row_ops_library", broken)


# ---------------------------------------------------------------- which backend

def test_fp32_cpu_compiles_decode_attention_unless_enforce_eager(model):
    compiled, eager = make_llm(model), make_llm(model, enforce_eager=True)
    b = compiled.engine.backend
    assert b.paged_attention is cpu_backend.paged_attention_compiled
    assert b.rms_norm is kernels.rms_norm_torch and b.argmax is kernels.argmax_torch  # fp32: the references
    # the references, but top-p decided by candidates (the same masks) and, in fp32, the weights as loaded
    assert eager.engine.backend == dataclasses.replace(kernels.TORCH, top_k_top_p=cpu_backend.top_k_top_p_by_candidates)
    assert tokens(compiled) == tokens(eager)


@pytest.mark.skipif(not cpu_backend.can_pack_linear_weights(torch.bfloat16, torch.device("cpu")),
                    reason="packed weights need oneDNN's bf16")
def test_enforce_eager_takes_the_references_over_packed_bf16_weights(model):
    """--enforce-eager chooses kernels (the references, nothing built); the bf16
    weights are packed all the same: a layout, with F.linear's results."""
    from nanoserve.model import Linear
    llm = make_llm(model, dtype="bfloat16", enforce_eager=True)
    b, m = llm.engine.backend, llm.engine.runner.model
    assert b.name == "torch" and (b.paged_attention, b.rms_norm) == (kernels.paged_attention_torch,
                                                                    kernels.rms_norm_torch)
    assert isinstance(m.lm_head, cpu_backend.PackedLinear) and not any(isinstance(x, Linear) for x in m.modules())


def test_a_failing_compile_falls_back_to_the_reference(model, monkeypatch, caplog):
    """No C++ compiler for inductor (say): the engine starts on the references and says why."""
    def broken(shape_key):
        raise RuntimeError("InductorError: no working C++ compiler found")
    monkeypatch.setattr(cpu_backend, "compiled_decode_attention", broken)
    with caplog.at_level(logging.WARNING, logger="nanoserve.model"):
        llm = make_llm(model)
    assert llm.engine.backend.paged_attention is kernels.paged_attention_torch
    assert "attention backend 'inductor' is not available" in caplog.text and "C++ compiler" in caplog.text
    assert tokens(llm) == tokens(make_llm(model, enforce_eager=True))


def test_a_fallback_names_an_error_without_text_by_its_type(caplog):
    """An error with only whitespace for text (a bare assert's, say) still says what failed: its type."""
    def blank():
        raise AssertionError(" \n")
    with caplog.at_level(logging.WARNING, logger="nanoserve.model"):
        assert cpu_backend._first_that_works("argmax", [("inductor", blank)], ("torch", None)) == ("torch", None)
    assert caplog.records[-1].getMessage().endswith("the attempt): AssertionError")


def test_bf16_cpu_runs_the_c_kernels(tiny_model):
    """bf16 on the CPU: attention, the KV store, the elementwise ops and argmax are
    the C kernels; a prefill and a decode give the references' logits to bf16
    rounding (attention sums in another order), and greedy tokens run."""
    _c_or_skip()  # the tiny qwen3: 4 heads on 2 kv heads, head_dim 32
    llm = make_llm(tiny_model, dtype="bfloat16")
    b = llm.engine.backend
    assert (b.paged_attention, b.store_kvcache) == (cpu_kernels.paged_attention, cpu_kernels.store_kvcache)
    ops = [getattr(op, "__wrapped__", op) for op in (b.rms_norm, b.rotary, b.silu_and_mul, b.argmax)]
    assert ops == [cpu_kernels.rms_norm, cpu_kernels.rotary, cpu_kernels.silu_and_mul, cpu_kernels.argmax]
    for c, ref in zip(two_steps(runner_with(b, tiny_model)), two_steps(runner_with(kernels.TORCH, tiny_model))):
        assert torch.isfinite(c).all()
        torch.testing.assert_close(c, ref, atol=0.05, rtol=0.02)
    assert all(len(t) == 16 for t in tokens(llm))


def test_bf16_cpu_gemma3_runs_the_c_kernels(model_root):
    """Gemma 3 in bf16: its GELU is the C kernel (the SiLU one over a table of torch's GELU), beside
    the other C kernels; 100-token prefills past its 16-token window and decodes give the references'
    logits to bf16 rounding, and greedy tokens run."""
    _c_or_skip()
    path = make_model(model_root, "gemma3")
    llm = make_llm(path, dtype="bfloat16")
    b = llm.engine.backend
    assert (b.gelu_tanh_and_mul, b.paged_attention) == (cpu_kernels.gelu_tanh_and_mul, cpu_kernels.paged_attention)
    for c, ref in zip(two_steps(runner_with(b, path)), two_steps(runner_with(kernels.TORCH, path))):
        assert torch.isfinite(c).all()
        torch.testing.assert_close(c, ref, atol=0.05, rtol=0.02)
    assert all(len(t) == 16 for t in tokens(llm))


def test_bf16_cpu_gemma2_runs_the_reference_attention_beside_the_c_kernels(model_root, caplog):
    """Gemma 2 in bf16: its soft-capped attention is the torch reference's (the C attention does not
    soft-cap), its GELU still C's, and greedy tokens run (the C ops' logits are checked on Gemma 3 above,
    the capped reference's in bf16 against transformers in test_parity.py). The choice is the design's,
    not a failure: no start-up warning."""
    _c_or_skip()
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        llm = make_llm(make_model(model_root, "gemma2"), dtype="bfloat16")
    assert not caplog.records, caplog.text
    b = llm.engine.backend
    assert b.paged_attention is kernels.paged_attention_torch and b.gelu_tanh_and_mul is cpu_kernels.gelu_tanh_and_mul
    assert "attention: torch" in b.name
    assert all(len(t) == 16 for t in tokens(llm))


def test_bf16_cpu_windowed_chunks_run_the_c_kernels(model_root, monkeypatch):
    """A windowed model (Mistral, 12 tokens) in bf16: prefill chunks longer and shorter than the
    window beside decodes, the blocks wholly before each sequence's window the (NaN) null block,
    as the block manager leaves them: the C kernels give the references' logits to bf16
    rounding and never call the torch attention."""
    _c_or_skip()
    path = make_model(model_root, "mistral", sliding_window=12, head_dim=32)
    gen = torch.Generator().manual_seed(5)
    a, b = (torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (70, 42))
    window, bs = 12, 16

    def table(blocks, first_query):  # blocks wholly before the first query's window: the null block
        gone = max(first_query - window + 1, 0) // bs
        return [0] * gone + blocks[gone:]
    ta, tb = list(range(1, 6)), list(range(6, 9))
    steps = [[SeqInput(a[0:20], 0, table(ta, 0), None), SeqInput(b[:40], 0, table(tb, 0), None)],
             [SeqInput(a[20:40], 20, table(ta, 20), None), SeqInput(b[40:41], 40, table(tb, 40), None)],
             [SeqInput(a[40:70], 40, table(ta, 40), None), SeqInput(b[41:42], 41, table(tb, 41), None)]]

    def run(backend):
        runner = runner_with(backend, path)
        for k, v in runner.kv_caches:
            k[0], v[0] = float("nan"), float("nan")
        return [step_logits(runner, step) for step in steps]
    reference = run(kernels.TORCH)
    backend = cpu_backend.build_cpu_backend(ModelConfig.from_dir(path), torch.bfloat16, bs)
    assert backend.paged_attention is cpu_kernels.paged_attention
    monkeypatch.setattr(kernels, "paged_attention_torch", None)
    for c, ref in zip(run(backend), reference):
        assert torch.isfinite(c).all()
        torch.testing.assert_close(c, ref, atol=0.05, rtol=0.02)


def test_bf16_cpu_attention_falls_back_when_the_c_kernel_cannot_be_built(model, caplog):
    """The llama test model's head_dim is 16: the engine takes the compiled
    attention, and says why at INFO level."""
    with caplog.at_level(logging.INFO, logger="nanoserve.model"):
        llm = make_llm(model, dtype="bfloat16")
    assert llm.engine.backend.paged_attention is cpu_backend.paged_attention_compiled
    assert "attention backend 'c' is not available" in caplog.text and "head_dim % 32 == 0" in caplog.text
    assert all(len(t) == 16 for t in tokens(llm))


def test_bf16_cpu_elementwise_ops_are_c_or_compiled_and_the_references_bit_for_bit(tiny_model, monkeypatch):
    """The norms, rotary and SiLU are the C ops where they build, else inductor's;
    either way, with the reference attention beside them, a 100-token prefill
    (inductor's ops take steps of 256+ tokens: 300 here) and a decode give the
    references' logits bit for bit."""
    cfg = ModelConfig.from_dir(tiny_model)
    reference = two_steps(runner_with(kernels.TORCH, tiny_model), 100)

    def same_as_reference(backend, prompt_len):
        backend = dataclasses.replace(backend, store_kvcache=kernels.store_kvcache_torch,
                                      paged_attention=kernels.paged_attention_torch)
        want = reference if prompt_len == 100 else two_steps(runner_with(kernels.TORCH, tiny_model), prompt_len)
        for got, ref in zip(two_steps(runner_with(backend, tiny_model), prompt_len), want):
            assert torch.equal(got, ref)
    try:
        cpu_kernels.row_ops_library()
        backend = cpu_backend.build_cpu_backend(cfg, torch.bfloat16, 16)
        assert backend.rms_norm.__wrapped__ is cpu_kernels.rms_norm
        same_as_reference(backend, 100)
    except RuntimeError:  # no AVX-512 here: the compiled ops below are what runs
        pass
    _no_c(monkeypatch)
    backend = cpu_backend.build_cpu_backend(cfg, torch.bfloat16, 16)
    assert "elementwise ops: inductor" in backend.name
    same_as_reference(backend, 300)


def test_c_elementwise_ops_take_widths_the_c_kernels_do_not(tiny_model):
    """A layer of a width the start-up check did not see, and the C kernels do not take (not a multiple of 16:
    a shared expert's 48 split across two ranks), runs the reference (it raised); the C kernel's widths run it."""
    try:
        cpu_kernels.row_ops_library()
    except RuntimeError as e:
        pytest.skip(str(e))
    backend = cpu_backend.build_cpu_backend(ModelConfig.from_dir(tiny_model), torch.bfloat16, 16)
    assert "elementwise ops: c" in backend.name
    gen = torch.Generator().manual_seed(0)
    for n in (24, 32):
        gate_up, x, w = (torch.randn(*shape, generator=gen).bfloat16() for shape in ((5, 2 * n), (5, n), (n,)))
        assert torch.equal(backend.silu_and_mul(gate_up), kernels.silu_and_mul_torch(gate_up))
        assert torch.equal(backend.rms_norm(x, w, 1e-6), kernels.rms_norm_torch(x, w, 1e-6))
    with pytest.raises(ValueError, match="n % 16 == 0"):
        cpu_kernels.silu_and_mul(torch.zeros(5, 48, dtype=torch.bfloat16))  # what the backend's op was


def test_bf16_partial_rotary_takes_the_c_rotary_bit_for_bit(model_root):
    """Phi-4-mini's partial rotary (96 of 128 dims) on the C rotary: the backend's start-up
    check takes it for such a model, and in place of the reference's a prefill and a decode
    give the references' logits bit for bit."""
    path = make_model(model_root, "phi3", hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                      partial_rotary_factor=0.75)
    cfg = ModelConfig.from_dir(path)
    assert (cfg.head_dim, cfg.rotary_dim) == (128, 96)
    try:
        cpu_kernels.row_ops_library()
    except RuntimeError as e:
        pytest.skip(str(e))
    ops = (cpu_kernels.rms_norm, cpu_kernels.rotary, cpu_kernels.silu_and_mul)
    assert cpu_backend.check_same_as_torch(ops, cfg) == ops  # what _pick_elementwise asks of the C ops
    backend = dataclasses.replace(kernels.TORCH, rotary=cpu_kernels.rotary)
    for got, want in zip(two_steps(runner_with(backend, path), 40), two_steps(runner_with(kernels.TORCH, path), 40)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_elementwise_op_is_one_graph_for_all_step_sizes(dtype):
    """compile_rows: steps from COMPILED_ELEMENTWISE_MIN_ROWS tokens up share one
    graph (the token axis is unbacked), smaller ones run eager. In bf16, the dtype
    they serve, the fused ops match eager's bit for bit (emulate_precision_casts);
    in fp32 inductor's exp (SiLU) differs in the last bit."""
    from torch._dynamo.utils import counters
    MIN_ROWS = cpu_backend.COMPILED_ELEMENTWISE_MIN_ROWS

    def same(a, b):
        assert torch.equal(a, b) if dtype == torch.bfloat16 else torch.testing.assert_close(a, b) is None

    def silu_mul_copy(x):  # a fresh code object: a compile of its own, whatever ran before
        return kernels.silu_and_mul_torch(x)
    fn = cpu_backend.compile_rows(silu_mul_copy, 1)
    gen = torch.Generator().manual_seed(0)
    before = counters["stats"]["unique_graphs"]
    for rows in (MIN_ROWS, MIN_ROWS + 1, 3 * MIN_ROWS + 5, 3):
        x = torch.randn(rows, 2 * 48, generator=gen).to(dtype)
        same(fn(x), kernels.silu_and_mul_torch(x))
    assert counters["stats"]["unique_graphs"] - before == 1

    rms_norm, rotary, _ = cpu_backend.compiled_elementwise_ops(("test", dtype))
    T = MIN_ROWS + 7
    qkv = torch.randn(T, (4 + 2 + 2) * 32, generator=gen).to(dtype)  # q, k as views of one projection
    q, k = qkv[:, :128].view(T, 4, 32), qkv[:, 128:192].view(T, 2, 32)
    positions = torch.randint(0, 512, (T,), generator=gen)
    cos, sin = torch.randn(512, 32, generator=gen), torch.randn(512, 32, generator=gen)
    for got, want in zip(rotary(q, k, positions, cos, sin), kernels.rotary_torch(q, k, positions, cos, sin)):
        same(got, want)
    w = torch.randn(32, generator=gen).to(dtype)
    same(rms_norm(q, w, 1e-6), kernels.rms_norm_torch(q, w, 1e-6))
    x, w = torch.randn(T, 64, generator=gen).to(dtype), torch.randn(64, generator=gen).to(dtype)
    same(rms_norm(x, w, 1e-6), kernels.rms_norm_torch(x, w, 1e-6))


def test_compiled_elementwise_ops_never_run_out_of_recompiles():
    """As the decode attention: more model shapes than dynamo's recompile_limit (lowered
    to 2 here), each with ops compiled for it, none run eager (the fallback warns: an
    error here), bit for bit eager's."""
    import torch._dynamo
    gen = torch.Generator().manual_seed(0)
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for n in (40, 48, 56):  # a model's intermediate_size
            silu_and_mul = cpu_backend.compiled_elementwise_ops(("never run out", n))[2]
            x = torch.randn(cpu_backend.COMPILED_ELEMENTWISE_MIN_ROWS, 2 * n, generator=gen).bfloat16()
            assert torch.equal(silu_and_mul(x), kernels.silu_and_mul_torch(x))


def test_a_failing_elementwise_compile_falls_back_to_the_references(tiny_model, monkeypatch, caplog):
    """No C compiler (say): neither the C ops nor inductor's build, the layers
    keep the references and the engine says why, instead of failing its first prompt."""
    def broken(*args):
        raise RuntimeError("InductorError: no working C++ compiler found")
    _no_c(monkeypatch)
    monkeypatch.setattr(cpu_backend, "compiled_elementwise_ops", lambda shape_key: (broken, broken, broken))
    with caplog.at_level(logging.INFO, logger="nanoserve.model"):
        llm = make_llm(tiny_model, dtype="bfloat16")
    b = llm.engine.backend
    assert (b.rms_norm, b.rotary, b.silu_and_mul) == (kernels.rms_norm_torch, kernels.rotary_torch,
                                                       kernels.silu_and_mul_torch)
    assert "elementwise ops 'c' is not available" in caplog.text
    assert "elementwise ops 'inductor' is not available" in caplog.text and "C++ compiler" in caplog.text
    assert all(len(t) == 16 for t in tokens(llm))


# ---------------------------------------------------------------- the model and the process

@pytest.mark.parametrize("tied", [False, True], ids=["llama-untied-head", "qwen3-tied-head"])
def test_packed_bf16_linear_weights_change_no_bit(model, tiny_model, tied, monkeypatch):
    """bf16 on the CPU: linear weights are packed for oneDNN once at load; the
    logits and greedy tokens must be bit-identical to plain F.linear's."""
    from nanoserve.model import Linear
    path = tiny_model if tied else model
    monkeypatch.setattr(cpu_backend, "has_bf16_matmul", lambda: True)  # else a CPU without holds them in fp32
    packed = runner_with(kernels.TORCH, path)
    assert isinstance(packed.model.lm_head, cpu_backend.PackedLinear)  # a tied head gets a packed copy
    assert not any(isinstance(m, Linear) for m in packed.model.modules())
    monkeypatch.setattr(cpu_backend, "can_pack_linear_weights", lambda dtype, device: False)
    plain = runner_with(kernels.TORCH, path)
    assert not any(isinstance(m, cpu_backend.PackedLinear) for m in plain.model.modules())
    for a, b in zip(two_steps(packed, 30), two_steps(plain, 30)):
        assert torch.equal(a, b)


def _no_c_linear():
    raise RuntimeError("no C linear here (faked)")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"],
                         ids=["llama-untied-head", "qwen3-tied-head", "qwen2-qkv-bias"])
def test_c_linear_where_the_cpu_has_no_bf16_matmul(model, tiny_model, model_root, arch, monkeypatch, caplog):
    """A CPU without AVX-512 BF16 or AMX (faked here on every CPU): bf16 linear weights stay
    bf16, packed for the C linear kernel (a tied head is packed, and the embedding lookup
    reads its rows from there: one copy of the table), the weights' bytes count the panels'
    padding, and the logits are bf16 GEMMs' but for the order of fp32 sums; --enforce-eager
    keeps oneDNN's bf16."""
    _c_linear_or_skip()
    from nanoserve.model import Linear
    path = {"llama": model, "qwen3": tiny_model}.get(arch) or make_model(model_root, "qwen2")
    tied = ModelConfig.from_dir(path).tie_word_embeddings
    monkeypatch.setattr(cpu_backend, "has_bf16_matmul", lambda: False)
    with caplog.at_level(logging.INFO, logger="nanoserve.model"):
        widened = runner_with(kernels.TORCH, path)
    m = widened.model
    assert isinstance(m.lm_head, cpu_backend.WidenedLinear) and m.lm_head.packed.dtype == torch.bfloat16
    assert not any(isinstance(x, (Linear, cpu_backend.PackedLinear)) for x in m.modules())
    assert m.model.embed_tokens.weight.dtype == torch.bfloat16
    assert m.model.embed_tokens.weight.numel() == (0 if tied else VOCAB * m.config.hidden_size)
    assert "kept in bf16 for the C linear kernel" in caplog.text
    assert any(x.bias is not None for x in m.modules() if isinstance(x, cpu_backend.WidenedLinear)) == (arch == "qwen2")
    plain_model, plain_bytes = load_model(path, torch.bfloat16, torch.device("cpu"), kernels.TORCH)
    _, widened_bytes = load_model(path, torch.bfloat16, torch.device("cpu"),
                                  dataclasses.replace(kernels.TORCH, prepare_model=cpu_backend.prepare_model))
    linears = [x.weight for x in plain_model.modules() if isinstance(x, Linear)]
    if tied:
        linears.append(plain_model.model.embed_tokens.weight)
        ids = torch.tensor([0, 1, 31, 32, 33, VOCAB - 1, 5, 5])  # both sides of a panel, the last row, a repeat
        assert torch.equal(m.model.embed_tokens(ids), plain_model.model.embed_tokens(ids))
        assert m.model.embed_tokens(ids[:0]).shape == (0, m.config.hidden_size)
    padding = sum((-x.shape[0] % cpu_kernels.LINEAR_PANEL) * x.shape[1] for x in linears)
    assert widened_bytes - plain_bytes == 2 * padding
    monkeypatch.setattr(cpu_backend, "can_pack_linear_weights", lambda dtype, device: False)
    plain = runner_with(kernels.TORCH, path)
    for a, b in zip(two_steps(widened, 30), two_steps(plain, 30)):
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.02)  # a bf16 step or so where the sums round apart
    eager = cpu_backend.build_cpu_backend(ModelConfig.from_dir(path), torch.bfloat16, 16, enforce_eager=True)
    assert eager.prepare_model is not cpu_backend.prepare_model  # the references: bf16 as loaded (or packed)


@pytest.mark.parametrize("tied", [False, True], ids=["llama-untied-head", "qwen3-tied-head"])
def test_fp32_linear_weights_where_the_c_linear_cannot_run(model, tiny_model, tied, monkeypatch, caplog):
    """No bf16 matrix instructions and no C linear (no AVX-512, faked): bf16 linear weights
    are held in fp32 (a tied head gets an fp32 copy), the weights' bytes count them, and
    the logits are bf16 GEMMs' but for the order of fp32 sums."""
    from nanoserve.model import Linear
    path = tiny_model if tied else model
    monkeypatch.setattr(cpu_backend, "has_bf16_matmul", lambda: False)
    monkeypatch.setattr(cpu_backend, "check_c_linear", _no_c_linear)
    with caplog.at_level(logging.INFO, logger="nanoserve.model"):
        upcast = runner_with(kernels.TORCH, path)
    m = upcast.model
    assert isinstance(m.lm_head, cpu_backend.Fp32Linear) and m.lm_head.packed.dtype == torch.float32
    assert not any(isinstance(x, Linear) or type(x) is cpu_backend.PackedLinear for x in m.modules())
    assert m.model.embed_tokens.weight.dtype == torch.bfloat16  # the lookup stays bf16
    assert "linear kernel 'c' is not available here" in caplog.text and "linear weights held in fp32" in caplog.text
    plain_model, plain_bytes = load_model(path, torch.bfloat16, torch.device("cpu"), kernels.TORCH)
    _, upcast_bytes = load_model(path, torch.bfloat16, torch.device("cpu"),
                                 dataclasses.replace(kernels.TORCH, prepare_model=cpu_backend.prepare_model))
    linear = sum(x.weight.numel() for x in plain_model.modules() if isinstance(x, Linear))
    assert upcast_bytes - plain_bytes == 2 * linear + (4 * plain_model.model.embed_tokens.weight.numel() if tied else 0)
    monkeypatch.setattr(cpu_backend, "can_pack_linear_weights", lambda dtype, device: False)
    plain = runner_with(kernels.TORCH, path)
    for a, b in zip(two_steps(upcast, 30), two_steps(plain, 30)):
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.02)


def test_fp32_linear_weights_only_where_memory_allows(model, monkeypatch, caplog):
    """The fp32 copies must take under half the available memory: else bf16, with a warning."""
    monkeypatch.setattr(cpu_backend, "has_bf16_matmul", lambda: False)
    monkeypatch.setattr(cpu_backend, "check_c_linear", _no_c_linear)
    monkeypatch.setattr(cpu_backend, "available_cpu_memory", lambda: 4096)
    with caplog.at_level(logging.INFO, logger="nanoserve.model"):
        runner = runner_with(kernels.TORCH, model)
    assert not any(isinstance(x, cpu_backend.Fp32Linear) for x in runner.model.modules())
    assert "fp32 linear weights would be faster" in caplog.text and "bf16 it is" in caplog.text


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="mallopt is glibc's")
def test_process_tuning_is_explicit_and_can_be_turned_off(model, monkeypatch, caplog):
    """Importing nanoserve changes nothing process-wide; an engine on the CPU
    applies the allocator settings at start-up and logs them, unless told not to."""
    import subprocess
    code = "import os, nanoserve; print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "None"
    calls = []
    monkeypatch.setattr(cpu_backend, "tune_process", lambda: calls.append(1) or ["glibc malloc: test"])
    with caplog.at_level(logging.INFO, logger="nanoserve.engine"):
        make_llm(model, enforce_eager=True)
    assert calls == [1] and "process-wide: glibc malloc: test" in caplog.text
    make_llm(model, enforce_eager=True, cpu_allocator_tuning=False)
    assert calls == [1]
    monkeypatch.undo()
    assert "glibc malloc: no mmap, one arena, no trimming" in cpu_backend.tune_process()  # every mallopt accepted


_GEMM_CACHE_PROBE = """
import ctypes, sys, torch
from nanoserve import cpu_backend
print(cpu_backend.tune_process())
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t)
                for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
def in_use():
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd
linears = [cpu_backend.PackedLinear(torch.randn(o, 256, dtype=torch.bfloat16), None) for o in (512, 256)]
before = in_use()
with torch.inference_mode():
    for rows in range(1, 301):  # 300 step sizes: 600 GEMM primitives
        for linear in linears:
            linear(torch.randn(rows, 256, dtype=torch.bfloat16))
print((in_use() - before) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc"
                    or not cpu_backend.can_pack_linear_weights(torch.bfloat16, torch.device("cpu")),
                    reason="mallinfo2 is glibc's; packed weights need oneDNN's bf16")
def test_process_tuning_bounds_onednn_caches():
    """Every new step size builds GEMM primitives that oneDNN and ideep cache (1,024
    each by default): tune_process caps both before the first oneDNN call, so a
    server's malloc'd memory stops growing with the step sizes it has seen; a
    value the user set wins."""
    import subprocess

    def run(**env):
        base = {k: v for k, v in os.environ.items()
                if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
        out = subprocess.run([sys.executable, "-c", _GEMM_CACHE_PROBE], env={**base, **env}, capture_output=True,
                             text=True, check=True).stdout.split("\n")
        return out[0], int(out[1])
    settings, capped = run()
    assert f"ONEDNN_PRIMITIVE_CACHE_CAPACITY={cpu_backend.ONEDNN_CACHE_CAPACITY}" in settings
    assert f"LRU_CACHE_CAPACITY={cpu_backend.ONEDNN_CACHE_CAPACITY}" in settings
    settings, default = run(ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024", LRU_CACHE_CAPACITY="1024")
    assert "CACHE_CAPACITY" not in settings  # the user's values are left alone
    assert capped * 3 < default, (capped, default)


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="malloc_trim is glibc's")
def test_trim_heap_gives_back_what_tune_process_keeps():
    """With glibc's trimming off, 256 MiB freed stay resident; trim_heap returns them."""
    import subprocess
    code = """
import torch
from nanoserve import cpu_backend
rss = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) >> 10
cpu_backend.tune_process()
x = torch.ones(2**28, dtype=torch.uint8)
before = rss()
del x
kept = rss()
cpu_backend.trim_heap()
print(before - kept, kept - rss())
"""
    freed, trimmed = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                             check=True).stdout.split())
    assert freed < 64 and trimmed > 192, (freed, trimmed)


# ---------------------------------------------------------------- mixture of experts

def _routing(T: int, E: int, k: int, dtype, unchosen: int | None = None, seed: int = 0):
    """Random x [T, 64] and a top-k routing of T tokens over E experts (expert ``unchosen`` left out)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=gen)
    if unchosen is not None:
        logits[:, unchosen] = -torch.inf
    weights, ids = torch.topk(torch.softmax(logits, -1), k)
    return torch.randn(T, 64, generator=gen).to(dtype), (weights / weights.sum(-1, keepdim=True)).to(dtype), ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,k,unchosen", [(1, 4, 2, None), (7, 5, 2, 3), (33, 6, 3, 0), (64, 8, 1, 7)])
def test_cpu_fused_moe_is_the_reference_bit_for_bit(dtype, T, E, k, unchosen):
    """The CPU backend's fused_moe (one sort, one gather, a sum over each token's choices in expert
    order) gives kernels.fused_moe_torch's result bit for bit, an expert nobody chose included."""
    gen = torch.Generator().manual_seed(1)
    w13 = (torch.randn(E, 2 * 48, 64, generator=gen) / 8).to(dtype)
    w2 = (torch.randn(E, 64, 48, generator=gen) / 8).to(dtype)
    x, weights, ids = _routing(T, E, k, dtype, unchosen)
    assert unchosen is None or not (ids == unchosen).any()
    with torch.inference_mode():
        assert torch.equal(cpu_backend.fused_moe_cpu(x, w13, w2, weights, ids),
                           kernels.fused_moe_torch(x, w13, w2, weights, ids))


def test_the_cpu_backend_runs_the_cpu_fused_moe_and_enforce_eager_the_reference():
    from conftest import hf_config
    cfg = ModelConfig.from_dict({**hf_config("qwen3_moe").to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})
    assert cpu_backend.build_cpu_backend(cfg, torch.bfloat16, 16).fused_moe is cpu_backend.fused_moe_cpu
    eager = cpu_backend.build_cpu_backend(cfg, torch.bfloat16, 16, enforce_eager=True)
    assert eager.fused_moe is kernels.fused_moe_torch and eager.prepare_model is cpu_backend.pack_model


@pytest.mark.parametrize("T,E,k,unchosen,inter", [(1, 4, 2, None, 48), (13, 5, 2, 1, 48), (40, 6, 3, 5, 40)])
def test_widened_experts_are_the_reference_with_the_c_linear_s_sums(T, E, k, unchosen, inter, monkeypatch):
    """WidenedMoE (both projections of every expert one C call each) is fused_moe_torch with each
    F.linear summed as the C linear sums (linear_in_order): bit for bit, an expert nobody chose and
    an intermediate size the C silu_and_mul does not take (40) included; bf16-close to F.linear's."""
    _c_linear_or_skip()
    from nanoserve.model import FusedMoE, TPGroup
    gen = torch.Generator().manual_seed(2)
    c_silu = cpu_backend.c_or_reference(cpu_kernels.silu_and_mul, kernels.silu_and_mul_torch,
                                        lambda gate_up: gate_up.shape[-1] // 2)  # as the backend holds it
    moe = FusedMoE(E, 64, inter, dataclasses.replace(kernels.TORCH, silu_and_mul=c_silu), TPGroup())
    with torch.no_grad():
        moe.w13_weight.copy_(torch.randn(E, 2 * inter, 64, generator=gen) / 8)
        moe.w2_weight.copy_(torch.randn(E, 64, inter, generator=gen) / 8)
    moe = moe.to(torch.bfloat16)
    x, weights, ids = _routing(T, E, k, torch.bfloat16, unchosen, seed=3)
    widened = cpu_backend.WidenedMoE(moe)
    with torch.inference_mode():
        out = widened(x, weights, ids)
        ref = kernels.fused_moe_torch(x, moe.w13_weight, moe.w2_weight, weights, ids)
        torch.testing.assert_close(out, ref, atol=0.02, rtol=0.02)
        monkeypatch.setattr(kernels.F, "linear", cpu_backend.linear_in_order)
        assert torch.equal(out, kernels.fused_moe_torch(x, moe.w13_weight, moe.w2_weight, weights, ids))


def _packs_or_skip():
    if not cpu_backend.can_pack_linear_weights(torch.bfloat16, torch.device("cpu")):
        pytest.skip("oneDNN cannot pack bf16 linear weights here")


def _experts(E: int, inter: int, silu_and_mul=kernels.silu_and_mul_torch):
    """A bf16 FusedMoE of E random experts, hidden 64, intermediate ``inter``."""
    from nanoserve.model import FusedMoE, TPGroup
    gen = torch.Generator().manual_seed(2)
    moe = FusedMoE(E, 64, inter, dataclasses.replace(kernels.TORCH, silu_and_mul=silu_and_mul), TPGroup())
    with torch.no_grad():
        moe.w13_weight.copy_(torch.randn(E, 2 * inter, 64, generator=gen) / 8)
        moe.w2_weight.copy_(torch.randn(E, 64, inter, generator=gen) / 8)
    return moe.to(torch.bfloat16)


@pytest.mark.parametrize("T,E,k,unchosen,inter", [(0, 4, 2, None, 48), (1, 4, 2, None, 48), (13, 5, 2, 1, 48),
                                                  (40, 6, 3, 5, 40), (70, 8, 2, 0, 48)])
def test_packed_experts_are_the_reference_bit_for_bit(T, E, k, unchosen, inter):
    """PackedMoE (each expert's w13 and w2 packed for oneDNN once) gives fused_moe_torch's result
    bit for bit: no step, one token, an expert nobody chose, an intermediate size the C
    silu_and_mul does not take (40) included."""
    _packs_or_skip()
    moe = _experts(E, inter, cpu_kernels.silu_and_mul if inter % 16 == 0 else kernels.silu_and_mul_torch)
    x, weights, ids = _routing(T, E, k, torch.bfloat16, unchosen, seed=3)
    with torch.inference_mode():
        out = cpu_backend.PackedMoE(moe)(x, weights, ids)
        assert out.shape == x.shape and out.dtype == x.dtype
        assert torch.equal(out, kernels.fused_moe_torch(x, moe.w13_weight, moe.w2_weight, weights, ids))


def test_packed_experts_run_small_steps_through_their_c_linear_copy(monkeypatch):
    """With a WidenedMoE copy, PackedMoE runs the steps of at most WIDENED_MAX_ROWS (token, choice)
    rows an expert on average through it, and larger ones through oneDNN: the reference's result
    bit for bit."""
    _packs_or_skip()
    _c_linear_or_skip()
    E, k = 4, 2
    moe = _experts(E, 48, cpu_kernels.silu_and_mul)
    widened = cpu_backend.WidenedMoE(moe)
    packed, calls = cpu_backend.PackedMoE(moe, widened), []
    forward = widened.forward
    monkeypatch.setattr(widened, "forward", lambda *args: calls.append(args[0].shape[0]) or forward(*args))
    limit = cpu_backend.WIDENED_MAX_ROWS * E // k  # tokens
    with torch.inference_mode():
        for T in (1, limit, limit + 1, 3 * limit):
            x, weights, ids = _routing(T, E, k, torch.bfloat16, seed=T)
            out = packed(x, weights, ids)
            if T > limit:
                assert torch.equal(out, kernels.fused_moe_torch(x, moe.w13_weight, moe.w2_weight, weights, ids))
            else:
                assert torch.equal(out, forward(x, weights, ids))
    assert calls == [1, limit]


@pytest.mark.parametrize("c_linear", [True, False], ids=["c-linear", "no-c-linear"])
def test_packed_experts_where_the_cpu_has_bf16_matmul(model_root, c_linear, monkeypatch, caplog):
    """A bf16 mixture-of-experts model on a CPU with bf16 matrix instructions (faked on every CPU):
    every FusedMoE becomes a PackedMoE, with a WidenedMoE copy for small steps where the C linear
    builds (its bytes counted as added); a prefill's logits are the unpacked reference's bit for
    bit, a decode's too without the C linear, else but for the order of fp32 sums."""
    _packs_or_skip()
    if c_linear:
        _c_linear_or_skip()
    else:
        monkeypatch.setattr(cpu_backend, "check_c_linear", _no_c_linear)
    from nanoserve.model import FusedMoE
    path = make_model(model_root, "qwen3_moe")
    monkeypatch.setattr(cpu_backend, "has_bf16_matmul", lambda: True)
    with caplog.at_level(logging.INFO, logger="nanoserve.model"):
        packed = runner_with(kernels.TORCH, path)
    assert "2 layers' experts packed for oneDNN" in caplog.text
    moes = [m for m in packed.model.modules() if isinstance(m, cpu_backend.PackedMoE)]
    assert len(moes) == 2 and not any(isinstance(m, FusedMoE) for m in packed.model.modules())
    assert all((m.widened is not None) == c_linear for m in moes)
    _, plain_bytes = load_model(path, torch.bfloat16, torch.device("cpu"), kernels.TORCH)
    _, packed_bytes = load_model(path, torch.bfloat16, torch.device("cpu"),
                                 dataclasses.replace(kernels.TORCH, prepare_model=cpu_backend.prepare_model))
    copies = sum(2 * (m.widened.packed13.numel() + m.widened.packed2.numel()) for m in moes if m.widened)
    assert (copies > 0) == c_linear and packed_bytes - plain_bytes == copies
    if c_linear:  # the copy only where it fits in half the memory available
        available = cpu_backend.available_cpu_memory
        monkeypatch.setattr(cpu_backend, "available_cpu_memory", lambda: 2 * copies)
        with caplog.at_level(logging.INFO, logger="nanoserve.model"):
            _, tight_bytes = load_model(path, torch.bfloat16, torch.device("cpu"),
                                        dataclasses.replace(kernels.TORCH, prepare_model=cpu_backend.prepare_model))
        assert tight_bytes == plain_bytes and "the experts get no C linear copy" in caplog.text
        monkeypatch.setattr(cpu_backend, "available_cpu_memory", available)
    monkeypatch.setattr(cpu_backend, "can_pack_linear_weights", lambda dtype, device: False)
    plain = runner_with(kernels.TORCH, path)
    assert sum(isinstance(m, FusedMoE) for m in plain.model.modules()) == 2
    (prefill, decode), (plain_prefill, plain_decode) = two_steps(packed, 30), two_steps(plain, 30)
    assert torch.equal(prefill, plain_prefill)  # 90 tokens: 45 rows an expert, oneDNN's
    if c_linear:
        torch.testing.assert_close(decode, plain_decode, atol=0.05, rtol=0.02)
    else:
        assert torch.equal(decode, plain_decode)


def test_c_linear_experts_where_the_cpu_has_no_bf16_matmul(model_root, monkeypatch, caplog):
    """A bf16 mixture-of-experts model on a CPU without bf16 matrix instructions (faked): every
    FusedMoE becomes a WidenedMoE, the weights' bytes count the experts' panel padding (an
    intermediate size of 40: 2 x 40 gate and up rows pad to 96), and the logits are the
    reference's but for the order of fp32 sums."""
    _c_linear_or_skip()
    from nanoserve.model import FusedMoE, Linear
    path = make_model(model_root, "qwen3_moe", moe_intermediate_size=40)
    monkeypatch.setattr(cpu_backend, "has_bf16_matmul", lambda: False)
    with caplog.at_level(logging.INFO, logger="nanoserve.model"):
        widened = runner_with(kernels.TORCH, path)
    assert "layers' experts kept in bf16 for the C linear kernel" in caplog.text
    moes = [m for m in widened.model.modules() if isinstance(m, cpu_backend.WidenedMoE)]
    assert len(moes) == 2 and not any(isinstance(m, FusedMoE) for m in widened.model.modules())
    plain_model, plain_bytes = load_model(path, torch.bfloat16, torch.device("cpu"), kernels.TORCH)
    _, widened_bytes = load_model(path, torch.bfloat16, torch.device("cpu"),
                                  dataclasses.replace(kernels.TORCH, prepare_model=cpu_backend.prepare_model))
    pad = cpu_kernels.LINEAR_PANEL
    linears = [x.weight for x in plain_model.modules() if isinstance(x, Linear)] + (
        [plain_model.model.embed_tokens.weight] if plain_model.lm_head is None else [])  # a tied head's copy
    experts = [w for x in plain_model.modules() if isinstance(x, FusedMoE) for w in (*x.w13_weight, *x.w2_weight)]
    padding = sum((-w.shape[0] % pad) * w.shape[1] for w in linears + experts)
    assert padding > sum((-w.shape[0] % pad) * w.shape[1] for w in linears)  # the experts' rows pad
    assert widened_bytes - plain_bytes == 2 * padding
    monkeypatch.setattr(cpu_backend, "can_pack_linear_weights", lambda dtype, device: False)
    plain = runner_with(kernels.TORCH, path)
    for a, b in zip(two_steps(widened, 30), two_steps(plain, 30)):
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.02)


def test_experts_the_c_linear_cannot_take_stay_and_count_as_loaded(model_root, monkeypatch):
    """An odd intermediate size (41: w2's K, which the C linear packs in pairs) leaves each FusedMoE
    as loaded beside the widened linear layers: the bytes prepare_model adds are the linear
    weights' panel padding only (it subtracted the experts' bytes as if they had been repacked)."""
    _c_linear_or_skip()
    from nanoserve.model import FusedMoE, Linear
    path = make_model(model_root, "qwen3_moe", moe_intermediate_size=41)
    monkeypatch.setattr(cpu_backend, "has_bf16_matmul", lambda: False)
    plain_model, plain_bytes = load_model(path, torch.bfloat16, torch.device("cpu"), kernels.TORCH)
    model, widened_bytes = load_model(path, torch.bfloat16, torch.device("cpu"),
                                      dataclasses.replace(kernels.TORCH, prepare_model=cpu_backend.prepare_model))
    assert not any(isinstance(m, cpu_backend.WidenedMoE) for m in model.modules())
    assert sum(isinstance(m, FusedMoE) for m in model.modules()) == 2
    pad = cpu_kernels.LINEAR_PANEL
    linears = [x.weight for x in plain_model.modules() if isinstance(x, Linear)] + (
        [plain_model.model.embed_tokens.weight] if plain_model.lm_head is None else [])
    assert widened_bytes - plain_bytes == 2 * sum((-w.shape[0] % pad) * w.shape[1] for w in linears)


def test_fp32_experts_where_the_c_linear_cannot_run(model_root, monkeypatch):
    """No bf16 matrix instructions and no C linear (faked): the experts are held in fp32 as the
    linear weights are (Fp32MoE), the weights' bytes count them, and the logits are the bf16
    reference's but for the order of fp32 sums."""
    from nanoserve.model import FusedMoE, Linear
    path = make_model(model_root, "qwen3_moe", moe_intermediate_size=40)
    monkeypatch.setattr(cpu_backend, "has_bf16_matmul", lambda: False)
    monkeypatch.setattr(cpu_backend, "check_c_linear", _no_c_linear)
    upcast = runner_with(kernels.TORCH, path)
    moes = [m for m in upcast.model.modules() if isinstance(m, cpu_backend.Fp32MoE)]
    assert len(moes) == 2 and all(m.w13_weight.dtype == torch.float32 for m in moes)
    plain_model, plain_bytes = load_model(path, torch.bfloat16, torch.device("cpu"), kernels.TORCH)
    _, upcast_bytes = load_model(path, torch.bfloat16, torch.device("cpu"),
                                 dataclasses.replace(kernels.TORCH, prepare_model=cpu_backend.prepare_model))
    weights = sum(x.weight.numel() for x in plain_model.modules() if isinstance(x, Linear)) + sum(
        x.w13_weight.numel() + x.w2_weight.numel() for x in plain_model.modules() if isinstance(x, FusedMoE))
    tied = 4 * plain_model.model.embed_tokens.weight.numel() if plain_model.lm_head is None else 0
    assert upcast_bytes - plain_bytes == 2 * weights + tied
    monkeypatch.setattr(cpu_backend, "can_pack_linear_weights", lambda dtype, device: False)
    plain = runner_with(kernels.TORCH, path)
    for a, b in zip(two_steps(upcast, 30), two_steps(plain, 30)):
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.02)


def test_importing_nanoserve_first_makes_openmp_threads_sleep_sooner():
    """nanoserve's import sets libgomp's spin count (unless set) where torch is not loaded yet, as libgomp
    reads it once when torch loads it; imported after torch it leaves the environment alone."""
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    show = "import os; print(os.environ.get('GOMP_SPINCOUNT'))"
    for first, want in (("import nanoserve", "10000"), ("import torch, nanoserve", "None")):
        out = subprocess.run([sys.executable, "-c", f"{first}; {show}"], env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.stdout.strip() == want, out.stderr[-2000:]
