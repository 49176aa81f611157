"""What a first start on a GPU meets, checked on the CPU: the decisions of the
CUDA start-up path run here for real, with only the GPU's answers faked
(torch.cuda's queries monkeypatched) or, for the Triton probe, its kernels run
by Triton's interpreter (conftest.py)."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from conftest import TRITON_INTERPRETER_CLASH, make_model
from nanoserve import kernels, model as model_mod
from nanoserve.model import ModelConfig, WNA16Config, select_backend, shard_config

needs_triton = pytest.mark.skipif(kernels.TRITON is None or TRITON_INTERPRETER_CLASH is not None,
                                  reason=TRITON_INTERPRETER_CLASH or "triton is not installed")
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def cfg(tiny_model) -> ModelConfig:
    return ModelConfig.from_dir(tiny_model)


@needs_triton
def test_the_triton_probe_launches_every_kernel(cfg, model_root, monkeypatch):
    """kernels.probe_triton launches each Triton kernel once (a new kernel the model uses must be probed too):
    SiLU's for the Qwen3 model, GELU's (and Gemma's norms) for a Gemma 3, the experts' for a MoE model,
    gpt-oss's clamped SwiGLU for its experts, the packed int matmul for an int4/int8 checkpoint."""
    names = [n for n, v in vars(kernels).items() if n.endswith("_kernel") and hasattr(v, "__getitem__")]
    launched = set()

    class Recorder:
        def __init__(self, name):
            self.name, self.kernel = name, getattr(kernels, name)

        def __getitem__(self, grid):
            launched.add(self.name)
            return self.kernel[grid]
    for name in names:
        monkeypatch.setattr(kernels, name, Recorder(name))
    gemma = ModelConfig.from_dir(make_model(model_root, "gemma3"))
    for tp in (1, 2):  # a rank's widths under tensor parallelism
        kernels.probe_triton(shard_config(cfg, tp), torch.float32, torch.device("cpu"), 16)
    moe_only, int_only = {"_fused_moe_kernel", "_swigluoai_and_mul_kernel"}, {"_wna16_matmul_kernel"}
    assert launched == set(names) - {"_gelu_tanh_and_mul_kernel", *moe_only, *int_only}
    kernels.probe_triton(gemma, torch.float32, torch.device("cpu"), 16)
    assert launched == set(names) - moe_only - int_only
    for arch in ("qwen3_moe", "gpt_oss"):
        moe = ModelConfig.from_dir(make_model(model_root, arch))
        for tp in (1, 2):
            kernels.probe_triton(shard_config(moe, tp), torch.float32, torch.device("cpu"), 16)
        assert launched == set(names) - int_only - ({"_swigluoai_and_mul_kernel"} if arch == "qwen3_moe" else set())
    for bits, group_size, act_order in ((4, 128, False), (4, 128, True), (8, -1, False)):  # GPTQ, its act-order, int8
        quant = WNA16Config("gptq", bits, group_size, True, "gptq", act_order)
        kernels.probe_triton(dataclasses.replace(cfg, quantization=quant), torch.float32, torch.device("cpu"), 16)
    assert launched == set(names)
    assert len(names) == 10


@needs_triton
@pytest.mark.parametrize("partial_rotary_factor", [1.0, 0.75], ids=["phi3-mini", "partial"])
def test_a_head_dim_of_96_passes_the_probe(model_root, partial_rotary_factor):
    """Phi-3-mini's head_dim 96 (padded to 128 in the tiles) is the Triton kernels' now, so on a GPU
    select_backend hands out TRITON and the decodes run in CUDA graphs; the probe runs every kernel at
    the model's widths under the interpreter here."""
    path = make_model(model_root, "phi3", hidden_size=192, num_attention_heads=2, num_key_value_heads=1,
                      partial_rotary_factor=partial_rotary_factor)
    phi3 = ModelConfig.from_dir(path)
    assert phi3.head_dim == 96 and phi3.rotary_dim == int(96 * partial_rotary_factor)
    kernels.probe_triton(phi3, torch.float32, torch.device("cpu"), 16)


@needs_triton
def test_a_kernel_that_fails_fails_the_probe(cfg, monkeypatch):
    class TooBig:  # what Triton raises for a tile over an SM's shared memory
        def __getitem__(self, grid):
            raise RuntimeError("out of resource: shared memory, Required: 98304, Hardware limit: 65536")
    monkeypatch.setattr(kernels, "_paged_attention_kernel", TooBig())
    with pytest.raises(RuntimeError, match="shared memory"):
        kernels.probe_triton(cfg, torch.float32, torch.device("cpu"), 16)


@pytest.mark.parametrize("installed", [pytest.param(True, marks=needs_triton), False])
def test_cuda_falls_back_to_the_torch_references_where_triton_cannot_run(cfg, caplog, monkeypatch, installed):
    """A head_dim the Triton kernels do not take fails the probe's static check (before
    any launch), or Triton is not installed: select_backend hands out the references,
    which no CUDA graph captures, and start-up says so in one line, not one per layer."""
    from types import SimpleNamespace

    from nanoserve.engine import EngineConfig, LLMEngine
    if not installed:
        monkeypatch.setattr(kernels, "TRITON", None)
    odd = dataclasses.replace(cfg, head_dim=44)
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        backend = select_backend(odd, torch.float16, CUDA, 16)
        sizes = LLMEngine._decode_sizes(SimpleNamespace(config=EngineConfig("unused"), device=CUDA, backend=backend))
    assert backend is kernels.TORCH and not backend.capture_safe and sizes == []
    why = ("the Triton kernels need head_dim to be a multiple of 8 from 16 to 256, or a larger power of two, "
           "got 44" if installed
           else "triton is not installed")
    assert [r.getMessage() for r in caplog.records] == [
        f"[kernels] Triton kernels unusable here ({why}): torch references, no CUDA graphs"]


def test_a_failed_graph_capture_names_the_phase_and_the_way_out():
    from types import SimpleNamespace

    from nanoserve.engine import LLMEngine

    def capture():
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nCUDA kernel errors ...")
    engine = SimpleNamespace(device=CUDA, decode_sizes=[1, 2], compile_time_s=0.0, backend=kernels.TORCH,
                             runner=SimpleNamespace(warmup=lambda: None, capture_cudagraphs=capture))
    with pytest.raises(RuntimeError) as e:
        LLMEngine._warm_up(engine)
    assert str(e.value) == ("[model] capturing the decode CUDA graphs failed: CUDA error: operation not permitted "
                            "when stream is capturing (--enforce-eager serves without them)")


@pytest.mark.parametrize("fails", [1, 2])
def test_out_of_memory_while_profiling_names_the_phase_and_the_flags(monkeypatch, fails):
    """The profiling forward that sizes the KV cache runs out of memory: the step's
    (call 1) or the CUDA graphs' (call 2); a ValueError says which and what to lower."""
    from nanoserve.kvcache import CacheConfig
    calls = []

    def profile(model, num_tokens, *args, **kw):
        calls.append(num_tokens)
        if len(calls) == fails:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore")
        return 2**20
    monkeypatch.setattr(model_mod, "profile_activation_bytes", profile)
    with pytest.raises(ValueError) as e:
        model_mod.step_activation_bytes(None, CacheConfig(profile_tokens=8192, graph_tokens=256))
    phase = ("a step of 8192 tokens: lower --max-num-batched-tokens" if fails == 1 else
             "the CUDA graphs' decode batch of 256: lower --max-num-seqs, or --enforce-eager")
    assert str(e.value) == (f"[kvcache] out of GPU memory in the profiling forward that sizes the KV cache, {phase} "
                            "(--gpu-memory-utilization cannot help: no KV cache is allocated yet; "
                            "--kv-cache-memory-bytes skips the profiling): CUDA out of memory. Tried to allocate "
                            "2.00 GiB.")
    assert calls == [8192, 256][:fails]


@pytest.mark.parametrize("value", [0.0, -0.5, 1.5, float("nan")])
def test_gpu_memory_utilization_is_a_fraction(tiny_model, value, capsys):
    from nanoserve import LLM
    from nanoserve.entry import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--model", str(tiny_model), "--gpu-memory-utilization", str(value)])
    assert "--gpu-memory-utilization must be in (0, 1]" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got"):
        LLM(str(tiny_model), device="cpu", gpu_memory_utilization=value)
    assert parse_args(["--model", str(tiny_model), "--gpu-memory-utilization", "1"]).gpu_memory_utilization == 1


def test_weights_that_do_not_fit_the_gpu_are_refused_before_loading(cfg, monkeypatch):
    """This rank's weights against gpu_memory_utilization of the GPU less what is in use (fake GPU figures)."""
    from types import SimpleNamespace

    from nanoserve.engine import EngineConfig, LLMEngine
    w = model_mod.num_parameters(cfg) * 2  # bf16
    total, in_use = 4 * w, w // 2  # another process holds half the weights' size
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - in_use, total))

    def check(utilization, tp=1, **kv):
        config = EngineConfig("unused", gpu_memory_utilization=utilization, tensor_parallel_size=tp, **kv)
        LLMEngine._check_memory(SimpleNamespace(config=config, model_config=cfg, dtype=torch.bfloat16, device=CUDA))
    with pytest.raises(ValueError) as e:
        check(0.25)  # leaves w / 2
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    assert str(e.value) == (f"not enough GPU memory: the weights need {gib(w)}, but --gpu-memory-utilization 0.25 "
                            f"of cuda's {gib(total)}, less {gib(in_use)} in use, leaves {gib(w // 2)}. Use a smaller "
                            "model, more GPUs (--tensor-parallel-size), or a higher --gpu-memory-utilization")
    check(0.5)
    check(0.25, tp=2)  # a rank holds half
    # An explicit KV size reads no utilization: weights + that KV cache against the free 3.5 w
    check(0.25, kv_cache_memory_bytes=2 * w)
    with pytest.raises(ValueError, match=f"the weights need {gib(w)} and the KV cache {gib(3 * w)}, but cuda has "
                                         f"{gib(total - in_use)} free of {gib(total)}"):
        check(0.9, kv_cache_memory_bytes=3 * w)
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, bf16
    check(0.25, num_kv_blocks=2 * w // per_block)
    with pytest.raises(ValueError, match="--num-kv-blocks"):
        check(0.9, num_kv_blocks=3 * w // per_block)


def test_lora_slots_that_do_not_fit_are_refused_before_loading(cfg, monkeypatch):
    """The LoRA slots count with the weights before loading (they are allocated with them): weights that fit
    alone but not with max_loras slots of max_lora_rank fail naming the flags (fake GPU and CPU figures)."""
    from types import SimpleNamespace

    from nanoserve import kvcache
    from nanoserve.engine import EngineConfig, LLMEngine
    w = model_mod.num_parameters(cfg) * 2  # bf16
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * w, 2 * w))
    monkeypatch.setattr(kvcache, "available_cpu_memory", lambda: 2 * w)

    def check(device, **lora):
        config = EngineConfig("unused", gpu_memory_utilization=0.75, **lora)  # 1.5 w of the GPU
        LLMEngine._check_memory(SimpleNamespace(config=config, model_config=cfg, dtype=torch.bfloat16,
                                                device=device))
    rank = 3 * w // 4 // model_mod.lora_slot_bytes(cfg, model_mod.LoRAConfig(1, 1), 1, torch.bfloat16)
    slots = model_mod.lora_slot_bytes(cfg, model_mod.LoRAConfig(1, rank), 1, torch.bfloat16)
    assert w // 2 < slots < w  # fit alone, not with the weights
    for device, scale in ((CUDA, 1), (torch.device("cpu"), 2)):  # a CPU's slots are fp32
        check(device)
        check(device, enable_lora=True, max_lora_rank=rank // 8)
        with pytest.raises(ValueError, match=rf"the weights need .* GiB \(with {scale * slots / 2**30:.2f} GiB of "
                                             r"LoRA adapter slots\).* fewer --max-loras or a lower --max-lora-rank"):
            check(device, enable_lora=True, max_lora_rank=rank)


def test_the_engine_makes_its_gpu_the_current_device(tiny_model, cfg, monkeypatch):
    """Triton launches and graph capture go to the current device: LLM(device="cuda:1") sets it
    (the first CUDA call of its start-up, faked here); tensor parallelism takes GPUs by local rank."""
    from nanoserve import LLM
    from nanoserve.engine import EngineConfig, check_parallel_config
    chosen = []

    def set_device(device):
        chosen.append(device)
        raise InterruptedError  # no GPU here: stop the start-up once the device is chosen
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past resolve_device's check for a GPU
    with pytest.raises(InterruptedError):
        LLM(str(tiny_model), device="cuda:1")
    assert chosen == [torch.device("cuda", 1)]
    with pytest.raises(ValueError, match="device=cuda:1 with tensor_parallel_size=2: .* CUDA_VISIBLE_DEVICES"):
        check_parallel_config(EngineConfig("unused", tensor_parallel_size=2), cfg, torch.device("cuda", 1))


@pytest.mark.parametrize("world_size", [1, 2])
def test_ranks_meet_on_the_patient_group_before_the_profiling_forward(cfg, monkeypatch, world_size):
    """The profiling forward's collectives (NCCL's first) wait only COLLECTIVE_TIMEOUT: ranks that
    finished loading far apart must meet first, on the gloo group that waits (fake GPU figures)."""
    from types import SimpleNamespace

    from nanoserve.kvcache import CacheConfig
    events = []
    monkeypatch.setattr(model_mod.dist, "barrier", lambda group=None: events.append(("barrier", group)))
    monkeypatch.setattr(model_mod.dist, "all_reduce", lambda t, op=None, group=None: events.append(("min", group)))
    monkeypatch.setattr(model_mod, "step_activation_bytes",
                        lambda model, cache: events.append(("profile",)) or (3 * 2**20, 2**20))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30, 2**31))
    weight = SimpleNamespace(device=CUDA, dtype=torch.bfloat16)
    model = SimpleNamespace(config=cfg, tp=model_mod.TPGroup(0, world_size, cpu_group="patient"),
                            model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=weight)))
    spec, plan = model_mod.plan_rank_kv_cache(model, 0, CacheConfig())
    # gpu_budget's, less the step's activations and the graphs' pool, which the plan keeps for the engine's check
    assert plan.num_blocks == (2**31 * 9 // 10 - 2**30 - 4 * 2**20) // spec.bytes_per_block
    assert plan.graph_pool_bytes == 2**20
    assert events == ([("barrier", "patient"), ("profile",), ("min", "patient")] if world_size > 1 else [("profile",)])


@pytest.mark.parametrize("capability", [(7, 5), (8, 0)])
def test_bfloat16_only_where_the_gpu_has_it(cfg, monkeypatch, caplog, capability):
    """Before compute capability 8.0 (T4, V100): auto takes float16 and says so, an explicit bfloat16 is refused."""
    from nanoserve.model import resolve_dtype
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    old_gpu = capability < (8, 0)
    for ckpt in ("bfloat16", "float32"):
        with caplog.at_level(logging.WARNING, logger="nanoserve.model"):
            got = resolve_dtype("auto", CUDA, dataclasses.replace(cfg, checkpoint_dtype=ckpt))
        assert got == (torch.float16 if old_gpu else torch.bfloat16)
    assert [r.getMessage() for r in caplog.records] == \
        ["[model] dtype auto: float16, as cuda (compute capability 7.5) has no bfloat16"] * 2 * old_gpu
    assert resolve_dtype("float16", CUDA, cfg) == torch.float16
    assert resolve_dtype("auto", torch.device("cpu"), cfg) == torch.bfloat16  # the CPU asks no GPU
    for dtype in ("bfloat16", torch.bfloat16):
        if old_gpu:
            with pytest.raises(ValueError, match=r"bfloat16 needs a GPU of compute capability 8.0 or higher, and "
                                                 r"cuda has 7.5: use --dtype float16 \(or float32\)"):
                resolve_dtype(dtype, CUDA, cfg)
        else:
            assert resolve_dtype(dtype, CUDA, cfg) == torch.bfloat16


@pytest.mark.parametrize("estimate_mib, pool_mib, warns", [(100, 150, False), (100, 300, True), (0, 300, False)])
def test_the_graphs_pool_is_logged_beside_its_estimate(monkeypatch, caplog, estimate_mib, pool_mib, warns):
    """The pool the KV cache's sizing left the graphs (plan.graph_pool_bytes, 0: not profiled) beside the
    measured one; a warning where the graphs took more than it and the allocator's rounding (fake GPU figures)."""
    from types import SimpleNamespace

    from nanoserve.engine import LLMEngine
    from nanoserve.kvcache import KVCachePlan
    reserved = iter([1000 * 2**20, (1000 + pool_mib) * 2**20])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: next(reserved))
    engine = SimpleNamespace(device=CUDA, decode_sizes=[1, 2], compile_time_s=0.0, backend=kernels.TORCH,
                             runner=SimpleNamespace(warmup=lambda: None, capture_cudagraphs=lambda: None, lora=None),
                             kv_plan=KVCachePlan(8, 1024, 8192, graph_pool_bytes=estimate_mib * 2**20))
    with caplog.at_level(logging.INFO, logger="nanoserve.engine"):
        LLMEngine._warm_up(engine)
    captured = next(r.getMessage() for r in caplog.records if "captured 2 CUDA graphs" in r.getMessage())
    assert f", {pool_mib} MiB" + (f" (the KV cache's sizing estimated {estimate_mib} MiB)" if estimate_mib else "") \
        + " (--enforce-eager turns them off)" in captured
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == warns * [f"[model] the CUDA graphs took {pool_mib - estimate_mib} MiB more than the KV cache's "
                                "sizing left them: steps may run out of GPU memory (lower --gpu-memory-utilization "
                                "if they do)"]
