"""Issue 22's GPU check in one command: greedy parity with transformers, W1 cold
and warm with CUDA graphs and with enforce_eager, the per-step breakdown of a
decode step, transformers' continuous batching with its CUDA graphs as the
peer, and the server online. Writes OUT/gpu-w1.json, OUT/gpu-w1.md (a section
for benchmarks/RESULTS.md) and OUT/gpu-w1-log.txt (every part's output).

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu.py --out DIR   # a CUDA machine: at most 450 s (--budget-s)
    python benchmarks/gpu.py --dry-run                       # the same parts on a CPU, tiny: 1-2 min

How to run it on the device machine (benchmarks/RESULTS.md, "GPU check: how to
run it", says the same). Here, in the repository root of the checkout that the
session started in (the device tool sends that one), once:

    echo /.whl/ >> "$(git rev-parse --git-common-dir)/info/exclude"
    rm -rf .whl && python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
      --platform manylinux2014_x86_64 -d .whl uvicorn==0.55.0 starlette==1.10.0 \\
      prometheus_client==0.26.0 httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 \\
      pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5 \\
      typing_extensions==4.16.0 click==8.5.1 pytest==9.2.0 pytest-timeout==2.4.0 pluggy==1.7.0 \\
      iniconfig==2.3.1 pygments==2.21.0 packaging==26.4 partial-json-parser==0.2.1.1.post7
    { git rev-parse HEAD; git status --porcelain --untracked-files=no; } > .whl/COMMIT

(.git does not travel to the device machine: the script reads the commit from
that file, "-dirty" where tracked files differ from it), then one call of the
device tool's `run` with carry [".whl"] and timeout_s 500 (the script's own
budget is 450 s):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; \\
      PYTHONUNBUFFERED=1 python3 benchmarks/gpu.py --out $OUT

and copy files_at/gpu-w1.json to benchmarks/results/gpu-w1.json, and gpu-w1.md
into RESULTS.md. The device image (torch 2.11+cu130, Triton 3.6, transformers
5.17) lacks uvicorn, starlette, pydantic and partial-json-parser (the server's)
and pytest (the cuda_tests part's); the other wheels pin what those need to the
versions this repository is tested with.

Every part runs in a fresh process of its own (an exception, a CUDA error or a
hang ends that part only: its error goes into the JSON and the next part runs),
under its own timeout and a total budget (--budget-s). The JSON is rewritten
after every part, so a run stopped from outside still leaves what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(HERE), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# mistral-sw: Mistral with a 32-token sliding window, shorter than the longer prompts (the Triton window);
# phi3-partial: Phi-3 as Phi-4-mini, 72 of each head's 96 dims turned (the Triton rotary's partial path), tied;
#   head_dim 96 as Phi-3-mini's: the Triton tiles padded to 128;
# gemma3: a 32-token sliding layer, then a full one (its own norms, GELU and rotary bases on the device);
# gemma2: Gemma 3's layout with soft caps on the attention scores (the Triton kernel's SOFT_CAP) and logits;
# mixtral, qwen2_moe (a shared expert, then a dense layer), qwen3_moe: mixture-of-experts layers (the backend's
#   fused_moe: on the device the Triton grouped GEMMs, captured in the "graphs" configs);
# olmoe (q/k norms over all heads), granitemoeshared (Granite's scalars, an ungated shared expert), glm4_moe
#   (a dense layer, then grouped sigmoid routing with its bias, fp32 router weights; a rotary half): the same
#   kernels, routed and normed in other ways;
# deepseek_v2 (no q_lora_rank, softmax routing), deepseek_v3 (noaux_tc routing, YaRN): multi-head latent
#   attention, MQA of 4 heads over one 64-wide latent cache, K and V one tensor (the Triton store writes it once);
#   deepseek_v3-576: the released models' 512 + 64 latent (the Triton attention's two dots, the K tile as V),
#   32 heads in two blocks of 16;
# gpt_oss: attention sinks (the Triton kernel's SINKS variant), a sliding then a full layer, YaRN, biased experts
#   with the clamped SwiGLU (on the device Triton's fused MoE with biases and swigluoai, captured in "graphs");
# smollm3: a NoPE layer (no rotary launch) after a rotary one; olmo2: norms after attention and the MLP, q/k
#   norms over all heads (k's 64 wide); olmo3: olmo2 with a 32-token sliding layer rotating at a base of its own
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "mistral-sw", "granite", "phi3-partial", "gemma3", "gemma2",
         "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoeshared", "glm4_moe", "deepseek_v2", "deepseek_v3",
         "deepseek_v3-576", "gpt_oss",
         "smollm3", "olmo2", "olmo3")
# The later architectures differ in the decoder's own math, which plain and chunked steps check;
# preemption and the graphs' padding are the same code for every one but gemma3 (its mixed window)
# and the MoE models (padding rows routed to experts: qwen3_moe stands for them all):
# fewer configs keep the part within its time.
ARCH_CONFIGS = {"granite": ("plain-graphs", "chunked-eager"), "phi3-partial": ("plain-graphs", "chunked-eager"),
                "gemma3": ("plain-graphs", "preempt-graphs", "chunked-eager"),
                "gemma2": ("plain-graphs", "chunked-eager"),
                "mixtral": ("plain-graphs", "chunked-eager"), "qwen2_moe": ("plain-graphs", "chunked-eager"),
                "qwen3_moe": ("plain-graphs", "preempt-graphs", "chunked-eager"),
                "olmoe": ("plain-graphs", "chunked-eager"), "granitemoeshared": ("plain-graphs", "chunked-eager"),
                "glm4_moe": ("plain-graphs", "chunked-eager"), "deepseek_v2": ("plain-graphs", "chunked-eager"),
                "deepseek_v3": ("plain-graphs", "chunked-eager"), "deepseek_v3-576": ("plain-graphs", "chunked-eager"),
                "gpt_oss": ("plain-graphs", "chunked-eager"),
                "smollm3": ("plain-graphs", "chunked-eager"), "olmo2": ("plain-graphs", "chunked-eager"),
                "olmo3": ("plain-graphs", "chunked-eager")}
# Quiet, offline children (nothing can be fetched on the device machine).
CHILD_ENV = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
             "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false",
             "TRANSFORMERS_VERBOSITY": "error"}
TARGETS = dict(w1_warm_s=1.2, w1_cold_s=3.0, decode_step_ms_b64=2.5, host_ms=0.5)  # issue 22, H200


# ============================================================================ scale

@dataclass
class Scale:
    """What one run does: the GPU's full sizes, or the dry run's tiny ones."""
    device: str
    w1_shape: dict
    w1_requests: int | None        # None: all 64 of W1
    w1_max_out: int | None         # None: W1's own output lengths
    parity_prompts: tuple = (1, 9, 40, 130, 300)
    parity_new: int = 24
    parity_max_model_len: int = 512
    parity_max_num_seqs: int = 8   # graphs at vLLM's default list up to it: 1, 2, 4, 8
    chunk_tokens: int = 32
    bd_batch: int = 64             # the breakdown's decode batch ...
    bd_prompt: int = 350           # ... whose context grows 350 -> ~460 over the timed steps
    bd_steps: int = 110            # instrumented steps (the first 10 are not counted)
    bd_plain_steps: int = 50       # plain engine.step() calls after them
    bd_ctx: int = 400              # the fixed-context forward: batch sizes at exactly this context
    bd_sizes: tuple = (1, 64, 256)
    bd_reps: int = 100
    serve_c1_prompts: int = 16
    serve_hi: int = 64             # clients (and prompts) of the loaded level
    kv_cpu: str | None = None      # the CPU's KV budget (server flag) ...
    kv_cpu_bytes: int = 0          # ... and the same for LLM()


GPU = Scale(device="cuda", w1_shape={}, w1_requests=None, w1_max_out=None)
DRY = Scale(device="cpu",
            w1_shape=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=32, intermediate_size=128, vocab_size=151936, tie_word_embeddings=True,
                          max_position_embeddings=2048),
            w1_requests=6, w1_max_out=6, parity_prompts=(1, 12, 40), parity_new=8, parity_max_model_len=64,
            chunk_tokens=16, bd_batch=8, bd_prompt=30, bd_steps=14, bd_plain_steps=5, bd_ctx=40,
            bd_sizes=(1, 4, 8), bd_reps=3, serve_c1_prompts=2, serve_hi=4, kv_cpu="64MiB",
            kv_cpu_bytes=64 << 20)


def w1_shape(scale: Scale) -> dict:
    from make_models import SHAPES
    return scale.w1_shape or SHAPES["w1"]


def w1_workload(scale: Scale):
    import workloads
    w = workloads.get("W1")
    n = scale.w1_requests or len(w.prompts)
    lens = [min(x, scale.w1_max_out) if scale.w1_max_out else x for x in w.output_lens[:n]]
    return workloads.Workload(w.name, w.model, w.prompts[:n], lens)


def digest(token_lists) -> str:
    from throughput import _digest
    return _digest(token_lists)


def _sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def _mean(xs) -> float | None:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def _r(x, nd=3):
    return None if x is None else round(x, nd)


# ============================================================================ parts (workers)

def part_env(scale: Scale, spec: dict) -> dict:
    if scale.device == "cpu":  # the dry run: Triton's interpreter runs the launch below (set before its import)
        os.environ["TRITON_INTERPRET"] = "1"
    import numpy
    import torch
    import transformers
    res = dict(torch=torch.__version__, transformers=transformers.__version__, numpy=numpy.__version__,
               python=platform.python_version(), device=scale.device, cuda_available=torch.cuda.is_available())
    try:
        import triton
        res["triton"] = triton.__version__
    except ImportError:
        res["triton"] = None
    try:  # one tiny launch: Triton builds its launchers with a C compiler and Python.h, here in seconds
        from nanoserve import kernels
        x = torch.randn(2, 64, device=scale.device)
        torch.testing.assert_close(kernels.silu_and_mul_triton(x), kernels.silu_and_mul_torch(x))
        res["triton_launch"] = "ok"
    except Exception as e:  # noqa: BLE001 - the engine would fall back to the torch references: say why
        res["triton_launch"] = f"{type(e).__name__}: {str(e).strip()[:500]}"
        res["ok"] = scale.device != "cuda"  # on a GPU, a failed part
    if scale.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        res.update(gpu=p.name, sms=p.multi_processor_count, gpu_mem_GiB=round(p.total_memory / 2**30, 1),
                   cuda=torch.version.cuda)
        try:
            res["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception as e:  # noqa: BLE001
            res["driver"] = f"? ({e})"
    else:
        from throughput import machine
        res["gpu"] = f"none (dry run on {machine()['cpu']})"
    from importlib.metadata import version
    missing, found = [], {}
    for mod, dist in (("uvicorn", "uvicorn"), ("starlette", "starlette"), ("prometheus_client", "prometheus_client"),
                      ("httpx", "httpx"), ("pydantic", "pydantic")):
        try:
            __import__(mod)
            found[mod] = version(dist)
        except Exception:  # noqa: BLE001
            missing.append(mod)
    res.update(server_packages=found, server_packages_missing=missing)
    return res


def tiny_hf_config(arch: str, max_pos: int):
    """tests/conftest.py's tiny models, without importing the test suite."""
    from transformers import (DeepseekV2Config, DeepseekV3Config, Gemma2Config, Gemma3TextConfig, Glm4MoeConfig,
                              GptOssConfig, GraniteConfig, GraniteMoeSharedConfig, LlamaConfig, MistralConfig,
                              MixtralConfig, Olmo2Config, Olmo3Config, OlmoeConfig, Phi3Config, Qwen2Config,
                              Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig, SmolLM3Config)
    base = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=0, bos_token_id=None)
    cls = dict(llama=LlamaConfig, qwen2=Qwen2Config, qwen3=Qwen3Config, mistral=MistralConfig, granite=GraniteConfig,
               phi3=Phi3Config, gemma3=Gemma3TextConfig, gemma2=Gemma2Config, mixtral=MixtralConfig,
               qwen2_moe=Qwen2MoeConfig, qwen3_moe=Qwen3MoeConfig, olmoe=OlmoeConfig,
               granitemoeshared=GraniteMoeSharedConfig, glm4_moe=Glm4MoeConfig, deepseek_v2=DeepseekV2Config,
               deepseek_v3=DeepseekV3Config, gpt_oss=GptOssConfig, smollm3=SmolLM3Config, olmo2=Olmo2Config,
               olmo3=Olmo3Config)[arch.split("-")[0]]
    if arch == "qwen3":
        base.update(head_dim=32, tie_word_embeddings=True)
    if arch in ("gemma3", "gemma2"):
        base.update(head_dim=32, query_pre_attn_scalar=24, tie_word_embeddings=True, sliding_window=32,
                    layer_types=["sliding_attention", "full_attention"])
    if arch == "gemma2":  # caps low enough to bend the tiny model's scores and logits (Gemma 2's 50 and 30 barely)
        base.update(attn_logit_softcapping=1.0, final_logit_softcapping=5.0)
    if arch.startswith("mistral"):
        base.update(sliding_window=32 if arch == "mistral-sw" else None)
    if arch == "granite":
        base.update(embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.09, logits_scaling=2.5)
    if arch == "phi3-partial":
        base.update(partial_rotary_factor=0.75, tie_word_embeddings=True, sliding_window=None, pad_token_id=None,
                    hidden_size=192, num_attention_heads=2, num_key_value_heads=1)  # head_dim 96
    if arch == "mixtral":
        base.update(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    if arch == "qwen2_moe":
        base.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                    mlp_only_layers=[1], norm_topk_prob=False)
    if arch == "qwen3_moe":
        base.update(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    if arch == "olmoe":
        base.update(intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, pad_token_id=None)
    if arch == "granitemoeshared":
        base.update(embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.09, logits_scaling=2.5,
                    intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48)
    if arch == "glm4_moe":
        base.update(head_dim=32, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                    topk_group=1, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                    use_qk_norm=True, attention_bias=True)
    if arch.startswith("deepseek"):  # as tests/conftest.py's: a 32 + 32 latent, 4 heads, layer 1 sparse
        base.update(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=24,
                    moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                    first_k_dense_replace=1, routed_scaling_factor=2.5)
        base.update(q_lora_rank=None, topk_method="greedy") if arch == "deepseek_v2" else base.update(
            q_lora_rank=24, n_group=2, topk_group=1, rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings":
                max(max_pos // 4, 1), "mscale": 0.9, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1})
    if arch == "deepseek_v3-576":
        base.update(kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=32, num_key_value_heads=32)
    if arch == "gpt_oss":  # as tests/conftest.py's: q wider than hidden, 8 experts (top 2), untruncated YaRN
        base.update(head_dim=32, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, sliding_window=32,
                    layer_types=["sliding_attention", "full_attention"], rope_parameters={
                        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": max(max_pos // 32, 1)})
    if arch == "smollm3":
        base.update(no_rope_layer_interval=2, pad_token_id=None)
    if arch in ("olmo2", "olmo3"):
        base.update(pad_token_id=None)
    if arch == "olmo3":
        base.update(sliding_window=32, layer_types=["sliding_attention", "full_attention"], rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})
    return cls(**base)


def part_models(scale: Scale, spec: dict, archs=ARCHS, w1: bool = True) -> dict:
    """Tiny fp32 models of every architecture, and W1's Qwen3-0.6B shape in
    bf16 with random weights (initialised on the device: ~1 s on a GPU)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config
    work = Path(spec["work"])
    res = {"tiny": {}}
    for arch in archs:
        out = work / "models" / f"tiny-{arch}"
        if not (out / "config.json").exists():
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(tiny_hf_config(arch, scale.parity_max_model_len),
                                                     dtype=torch.float32)
            with torch.no_grad():  # as conftest: sharper logits, so that greedy ties are rare
                for p in model.parameters():
                    if p.dim() >= 2:  # 3: transformers 5's stacks of experts
                        p.normal_(0, 0.08)
                for name, b in model.named_buffers():  # GLM's router bias: not zero, so that it counts
                    if name.endswith("e_score_correction_bias"):
                        b.normal_(0, 0.05)
                for name, p in model.named_parameters():  # gpt-oss's sinks and biases: not ~0, so that they count
                    if arch == "gpt_oss" and name.endswith(("sinks", "bias")):
                        p.normal_(0, 0.5)
            model.save_pretrained(out)
        res["tiny"][arch] = str(out)
    if not w1:
        return res
    out = work / "models" / ("w1" if scale.device == "cuda" else "w1-tiny")
    t = time.perf_counter()
    if not (out / "config.json").exists():
        torch.manual_seed(0)
        shape = w1_shape(scale)
        config = Qwen3Config(**shape, rms_norm_eps=1e-6, rope_theta=1000000.0, eos_token_id=0, bos_token_id=None)
        try:
            with torch.device(scale.device):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        except Exception as e:  # noqa: BLE001 - the CPU takes longer, but works
            res["w1_init_on_device_error"] = f"{type(e).__name__}: {e}"[:300]
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(out)
        res["w1_params_M"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 1)
        del model
    res["w1"] = str(out)
    res["w1_build_s"] = round(time.perf_counter() - t, 1)
    return res


def part_parity(scale: Scale, spec: dict, archs=ARCHS, configs=None) -> dict:
    """Greedy tokens of nanoserve == transformers' generate(do_sample=False), fp32,
    on the device: plain, under preemption, chunked; CUDA graphs on and eager."""
    import torch
    from transformers import AutoModelForCausalLM

    from nanoserve import LLM, SamplingParams
    from nanoserve.kvcache import blocks_per_request
    from nanoserve.model import ModelConfig
    dev, n_new = scale.device, scale.parity_new
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 384, (n,), generator=gen).tolist() for n in scale.parity_prompts]
    max_len, bs = scale.parity_max_model_len, 16
    # Preemption: room for every prompt (the scheduler admits against prompt blocks)
    # and for one request of max_model_len, but not for all of them grown to the end
    # (a sequence stores its prompt and all its new tokens but the last).
    prompt_blocks = sum(-(-len(p) // bs) for p in prompts)
    need = sum(-(-(len(p) + n_new - 1) // bs) for p in prompts)
    preempt_blocks = max(prompt_blocks, -(-max_len // bs))
    assert preempt_blocks < need, (prompt_blocks, preempt_blocks, need)
    kinds = {"plain": dict(num_kv_blocks=4 * need),
             "preempt": dict(num_kv_blocks=preempt_blocks),
             "chunked": dict(num_kv_blocks=4 * need, max_num_batched_tokens=scale.chunk_tokens)}
    # On the CPU there are no CUDA graphs: "graphs" there is the padded static-buffer
    # decode path they replay, run eagerly with the CPU's compiled kernels.
    modes = {"graphs": {} if dev == "cuda" else dict(cudagraph_capture_sizes=[1, 2, 4, 8]),
             "eager": dict(enforce_eager=True)}
    configs = configs or [f"{k}-{m}" for k in kinds for m in modes]
    res = dict(prompts=[len(p) for p in prompts], new_tokens=n_new, archs={}, ok=True)
    for arch in archs:
        path = spec["models"]["tiny"][arch]
        mc = ModelConfig.from_dir(path)  # a window on every layer frees the blocks before it (not Gemma 3's)
        window = mc.sliding_window if len(mc.sliding_layers) == mc.num_layers else None
        arch_kinds = kinds if window is None else {  # its pool holds windows (kvcache.blocks_per_request), not
            # whole requests: one request's window, a chunk and the null block, in chunks, so the five preempt
            **kinds, "preempt": dict(num_kv_blocks=1 + blocks_per_request(max_len, bs, window, scale.chunk_tokens),
                                     max_num_batched_tokens=scale.chunk_tokens)}
        # transformers' own attention: 5.17 (the device image's) picks SDPA for Gemma 2, which drops
        # its score soft cap (5.25 refuses SDPA there), and so would not be the oracle
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").to(dev).eval()
        refs, gaps = [], []  # gaps: transformers' top-2 logit gap at each new token (a near-tie, or a bug?)
        for p in prompts:
            with torch.no_grad():
                ids = torch.tensor([p], device=dev)
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n_new,
                                  min_new_tokens=n_new, pad_token_id=0, output_logits=True,
                                  return_dict_in_generate=True)
            refs.append(out.sequences[0, len(p):].tolist())
            top2 = torch.cat(out.logits).float().topk(2).values
            gaps.append((top2[:, 0] - top2[:, 1]).tolist())
        del hf
        rows = {}
        for name in [c for c in configs if c in ARCH_CONFIGS.get(arch, configs)]:
            kind, mode = name.split("-")
            t = time.perf_counter()
            try:
                llm = LLM(path, dtype="float32", device=dev, skip_tokenizer_init=True, max_model_len=max_len,
                          max_num_seqs=scale.parity_max_num_seqs, **arch_kinds[kind], **modes[mode])
                outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n_new, min_tokens=n_new,
                                                            detokenize=False), use_tqdm=False)
                got = [o.outputs[0].token_ids for o in outs]
                equal = [g == r for g, r in zip(got, refs)]
                row = dict(equal=f"{sum(equal)}/{len(equal)}", ok=all(equal),
                           graphs=sorted(llm.engine.runner.graphs), decode_sizes=llm.engine.runner.decode_sizes,
                           backend=llm.engine.backend.name, preemptions=llm.stats()["num_preemptions"],
                           seconds=round(time.perf_counter() - t, 2))
                if kind == "preempt" and row["preemptions"] == 0:
                    row.update(ok=False, error="no preemption happened: this check did not test what it says")
                if not all(equal):
                    i = equal.index(False)
                    j = next((k for k, (a, b) in enumerate(zip(got[i], refs[i])) if a != b), None)
                    row["first_mismatch"] = dict(prompt=i, prompt_len=len(prompts[i]), position=j,
                                                 got=got[i][:12], want=refs[i][:12],
                                                 hf_top2_logit_gap=None if j is None else _r(gaps[i][j], 6))
                del llm
            except Exception as e:  # noqa: BLE001 - one config's failure is a result
                row = dict(ok=False, error=f"{type(e).__name__}: {e}"[:500], trace=traceback.format_exc()[-1500:])
            res["ok"] &= row["ok"]
            rows[name] = row
            print(f"[parity] {arch} {name}: {row.get('equal', row.get('error'))}", flush=True)
        res["archs"][arch] = rows
        if "result" in spec:  # what is checked so far, should the part's timeout stop it before the last one
            Path(spec["result"]).write_text(json.dumps(dict(res, ok=False, error=f"timed out after {len(res['archs'])}"
                                                            f" of {len(archs)} architectures"), default=str))
    res["summary"] = f"{sum(r['ok'] for a in res['archs'].values() for r in a.values())}/" \
                     f"{sum(len(a) for a in res['archs'].values())} configs equal"
    return res


def _w1_llm(scale: Scale, spec: dict, eager: bool, **kw):
    from nanoserve import LLM
    kw |= dict(enforce_eager=True) if eager else ({} if scale.device == "cuda" else
                                                 dict(cudagraph_capture_sizes=[1, 2, 4, 8]))
    if scale.kv_cpu and scale.device == "cpu":
        kw["kv_cache_memory_bytes"] = scale.kv_cpu_bytes
    return LLM(spec["models"]["w1"], dtype="bfloat16", device=scale.device, skip_tokenizer_init=True, **kw)


def part_w1(scale: Scale, spec: dict, eager: bool = False, async_scheduling: bool = False) -> dict:
    """W1 in this fresh process: start-up (with one 2-token warm-up request, as
    benchmarks/throughput.py times it), then the first W1 run (cold), then a
    second (warm). Prefix caching is off: W1's random prompts share no prefix,
    and the warm run would otherwise find every prompt cached by the cold one.
    ``async_scheduling``: vLLM's --async-scheduling (w1_async)."""
    import torch

    from nanoserve import SamplingParams
    w = w1_workload(scale)
    t0 = time.perf_counter()
    llm = _w1_llm(scale, spec, eager, enable_prefix_caching=False, async_scheduling=async_scheduling)
    engine_s = time.perf_counter() - t0
    llm.generate([w.prompts[0][:16]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    startup = time.perf_counter() - t0
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in w.output_lens]
    res = dict(eager=eager, async_scheduling=async_scheduling, startup_s=_r(startup, 2), engine_init_s=_r(engine_s, 2),
               compile_time_s=_r(llm.engine.compile_time_s, 2), backend=llm.engine.backend.name,
               graphs=len(llm.engine.runner.graphs), decode_sizes=llm.engine.runner.decode_sizes,
               kv_blocks=llm.engine.kv_plan.num_blocks, requests=len(w.prompts), prefix_caching=False,
               triton_cache=os.environ.get("TRITON_CACHE_DIR"))
    tokens = None
    for run in ("cold", "warm"):
        _sync(scale.device)
        t = time.perf_counter()
        outs = llm.generate(w.prompts, params, use_tqdm=False)
        _sync(scale.device)
        wall = time.perf_counter() - t
        toks = [o.outputs[0].token_ids for o in outs]
        n_out = sum(map(len, toks))
        res[f"{run}_s"] = _r(wall)
        res[f"{run}_output_tok_s"] = _r(n_out / wall, 1)
        res[f"{run}_digest"] = digest(toks)
        res["num_out"] = n_out
        tokens = toks
        print(f"[w1] {'eager' if eager else 'graphs'}{' async' if async_scheduling else ''} {run}: {wall:.2f} s, {n_out / wall:.0f} tok/s, "
              f"digest {res[f'{run}_digest']}", flush=True)
    res["cold_warm_same_tokens"] = res["cold_digest"] == res["warm_digest"]
    if scale.device == "cuda" and (res["backend"] != "triton" or (not eager and not res["graphs"])):
        res.update(ok=False, error=f"not the path measured: backend {res['backend']}, {res['graphs']} CUDA graphs "
                                   "(select_backend fell back: see the log's [kernels] warning)")
    if async_scheduling and scale.device == "cuda":
        res["launch_syncs"] = _launch_syncs(llm, w.prompts[:16])
    res["stats"] = llm.stats()
    if scale.device == "cuda":
        res["peak_allocated_GiB"] = _r(torch.cuda.max_memory_allocated() / 2**30, 2)
    res["tokens"] = tokens  # the orchestrator compares graphs with eager, then drops them
    return res


def _launch_syncs(llm, prompts) -> dict:
    """Async scheduling overlaps only if launching a step never waits for the GPU:
    each launch of a short run under torch's sync debug mode, counting the host
    syncs it makes, over the kinds of requests that run ahead (greedy; seeded
    top-k/top-p with logprobs; min_tokens; logit_bias). Expected: none."""
    import warnings

    import torch

    from nanoserve import SamplingParams
    kinds = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1, logprobs=2, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0, min_tokens=12, max_tokens=24),
             SamplingParams(temperature=0, logit_bias={5: 2.0}, max_tokens=24, ignore_eos=True)]
    runner, counts = llm.engine.runner, []
    launch = runner.execute_model

    def checked(seqs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return launch(seqs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                # torch's: "called a synchronizing CUDA operation"; any other warning is no sync
                counts.append([str(c.message)[:200] for c in caught if "synchroniz" in str(c.message)])
    runner.execute_model = checked
    try:
        llm.generate(prompts, [kinds[i % len(kinds)] for i in range(len(prompts))], use_tqdm=False)
    finally:
        runner.execute_model = launch
    return dict(launches=len(counts), launches_that_synced=sum(map(bool, counts)),
                first=next((c for c in counts if c), None))


class _NoReplay:
    """Stands in for a captured graph while the runner fills its input buffers,
    so that copying the inputs is timed apart from the forward."""

    def replay(self) -> None:
        pass


def _prefill_all(engine, rids) -> None:
    reqs = [engine.scheduler.requests[r] for r in rids]
    while not all(len(r.output_token_ids) >= 1 for r in reqs):
        engine.step()


def part_breakdown(scale: Scale, spec: dict) -> dict:
    """Where a W1 decode step's time goes. (a) At exactly bd_ctx tokens of context,
    the captured forward of each batch size (back-to-back replays) against the
    same forward launched eagerly: decode_step_ms_b64. (b) bd_steps decode steps
    of bd_batch requests (context ~400), each phase timed with a device sync
    between: schedule, build_inputs, the copy into the graphs' input buffers,
    the forward (graph replay, and the eager forward of the same inputs),
    prepare (what an eager step builds instead), logits, sampler, postprocess.
    (c) plain engine.step() calls, as the engine runs them."""
    import torch

    from nanoserve import SamplingParams
    from nanoserve.engine import RequestOutputKind
    dev = scale.device
    big = max(scale.bd_sizes)
    # A token budget that prefills every prompt in one step: else the requests admitted
    # first would decode while the rest prefill, and the contexts would differ.
    budget = max(8192, big * scale.bd_ctx)
    # A fixed KV cache on the GPU: sizing it would profile one forward of the whole budget
    # (a 102,400-token causal prefill, seconds of the call for nothing the part measures).
    blocks = {} if dev != "cuda" else dict(num_kv_blocks=2 * -(-big * (scale.bd_ctx + scale.bd_steps) // 16))
    llm = _w1_llm(scale, spec, eager=False, max_num_batched_tokens=budget, **blocks)
    engine, runner = llm.engine, llm.engine.runner
    for attr in ("_run_decode_padded", "_forward_static", "static_hidden"):
        if not hasattr(runner, attr):
            raise RuntimeError(f"ModelRunner has no {attr}: benchmarks/gpu.py's breakdown needs updating")
    vocab = w1_shape(scale)["vocab_size"]
    rng = random.Random(1)
    res = dict(device=dev, graphs=sorted(runner.graphs), decode_sizes=runner.decode_sizes,
               max_num_batched_tokens=budget)
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True, detokenize=False)

    def copy_inputs(seqs):
        saved = runner.graphs
        runner.graphs = {s: _NoReplay() for s in runner.decode_sizes}
        try:
            runner._run_decode_padded(seqs)
        finally:
            runner.graphs = saved

    def forward(bs: int):
        if bs in runner.graphs:
            runner.graphs[bs].replay()
            return runner.static_hidden[:bs]
        return runner._forward_static(bs)

    # (a) every row at exactly bd_ctx tokens of context
    rids = [engine.add_request([rng.randrange(vocab) for _ in range(scale.bd_ctx - 1)], params)
            for _ in range(big)]
    _prefill_all(engine, rids)
    sched = engine.scheduler.schedule()
    seqs = engine.build_inputs(sched)
    assert len(seqs) == big and all(len(s.token_ids) == 1 for s in seqs), "expected a decode step of every request"
    contexts = sorted({s.start + 1 for s in seqs})
    fixed = {}
    with torch.inference_mode():
        copy_inputs(seqs)
        for bs in scale.bd_sizes:
            row = {}
            for how in ("graph", "eager"):
                if how == "graph" and bs not in runner.graphs:
                    row["graph_ms"] = None
                    row["graph_note"] = "no CUDA graph" + (" on the CPU" if dev == "cpu" else f" of size {bs}")
                    continue
                fn = (lambda: runner.graphs[bs].replay()) if how == "graph" else (lambda: runner._forward_static(bs))
                for _ in range(3):
                    fn()
                _sync(dev)
                reps = scale.bd_reps if how == "graph" else max(3, scale.bd_reps // 4)
                t = time.perf_counter()
                for _ in range(reps):
                    fn()
                _sync(dev)
                row[f"{how}_ms"] = _r((time.perf_counter() - t) / reps * 1000)
            if row.get("graph_ms") is not None:  # replay == eager, bit for bit?
                a = forward(bs).float().clone()
                b = runner._forward_static(bs).float()
                row["graph_vs_eager_max_abs_diff"] = float((a - b).abs().max())
            fixed[bs] = row
            print(f"[breakdown] batch {bs} x {scale.bd_ctx} context: {row}", flush=True)
    res["fixed_context"] = dict(context=scale.bd_ctx if contexts == [scale.bd_ctx] else
                                f"{contexts[0]}-{contexts[-1]}", reps=scale.bd_reps, by_batch=fixed)
    key = scale.bd_batch if scale.bd_batch in fixed else max(fixed)
    res["decode_step_ms_b64"] = fixed[key].get("graph_ms") or fixed[key].get("eager_ms")
    res["decode_step_eager_ms_b64"] = fixed[key].get("eager_ms")
    res["decode_step_is_graph"] = fixed[key].get("graph_ms") is not None
    if dev == "cuda" and not res["decode_step_is_graph"]:  # else decode_step_ms_b64 is an eager time
        res.update(ok=False, error=f"no CUDA graph of batch {key} (backend {engine.backend.name})")
    for r in rids:
        engine.abort_request(r)
    while engine.has_unfinished_requests():
        engine.step()

    # (b) instrumented decode steps, batch bd_batch at ~400 context
    rids = [engine.add_request([rng.randrange(vocab) for _ in range(scale.bd_prompt)], params,
                               output_kind=RequestOutputKind.FINAL_ONLY)  # as W1 (LLM.generate) asks
            for _ in range(scale.bd_batch)]
    _prefill_all(engine, rids)
    phases = ("schedule", "build_inputs", "buffer_copy", "forward", "forward_eager", "prepare", "logits",
              "sampler", "postprocess")
    times = {p: [] for p in phases}
    ctx = []
    skip = min(10, scale.bd_steps // 2)
    with torch.inference_mode():
        for step in range(scale.bd_steps):
            _sync(dev)
            t0 = time.perf_counter()
            sched = engine.scheduler.schedule()
            t1 = time.perf_counter()
            seqs = engine.build_inputs(sched)
            t2 = time.perf_counter()
            n = len(seqs)
            assert n == scale.bd_batch and all(len(s.token_ids) == 1 for s in seqs), "not a decode-only step"
            bs = next(s for s in runner.decode_sizes if s >= n)
            copy_inputs(seqs)
            _sync(dev)
            t3 = time.perf_counter()
            hidden = forward(bs)[:n]
            _sync(dev)
            t4 = time.perf_counter()
            if bs in runner.graphs:  # the same inputs again, launched eagerly (rewrites the same KV)
                runner._forward_static(bs)
                _sync(dev)
            t5 = time.perf_counter()
            runner.prepare(seqs)
            _sync(dev)
            t6 = time.perf_counter()
            logits = runner.model.compute_logits(hidden)
            _sync(dev)
            t7 = time.perf_counter()
            results = runner.sampler(logits, [s.sample for s in seqs])
            t8 = time.perf_counter()
            engine.postprocess(sched, results)
            t9 = time.perf_counter()
            graphed = bs in runner.graphs
            if step >= skip:
                for p, a, b in zip(phases, (t0, t1, t2, t3, t4, t5, t6, t7, t8), (t1, t2, t3, t4, t5, t6, t7, t8, t9)):
                    times[p].append((b - a) * 1000)
                ctx.append(seqs[0].start + 1)
    ms = {p: _r(_mean(v)) for p, v in times.items()}
    if not graphed:  # the forward above was the eager one
        ms["forward_eager"] = ms["forward"]
    host = ms["schedule"] + ms["build_inputs"] + ms["buffer_copy"] + ms["postprocess"]
    res["per_step"] = dict(batch=scale.bd_batch, steps=len(ctx), context_first=ctx[0] if ctx else None,
                           context_last=ctx[-1] if ctx else None, forward_is_graph=graphed,
                           ms=ms, host_ms=_r(host),
                           graph_step_ms=_r(host + ms["forward"] + ms["logits"] + ms["sampler"]))
    # (c) plain steps: what the engine's loop takes, no syncs but the sampler's own
    walls = []
    for _ in range(scale.bd_plain_steps):
        t = time.perf_counter()
        engine.step()
        walls.append((time.perf_counter() - t) * 1000)
    res["plain_step_ms"] = dict(mean=_r(_mean(walls)), n=len(walls),
                                context=seqs[0].start + 1 + scale.bd_plain_steps // 2)
    for r in rids:
        engine.abort_request(r)
    print(f"[breakdown] per step at batch {scale.bd_batch}: {ms}; plain step {res['plain_step_ms']}", flush=True)
    # (d) decode attention alone at long contexts: an eager step's block table against a graph's
    cases = ((1, 16384), (16, 4096), (64, 4096)) if dev == "cuda" else ((1, 96), (2, 64))
    res["attention_by_table_width"] = [_attention_by_table_width(runner, dev, n, ctx, scale.bd_reps // 5 or 1)
                                       for n, ctx in cases if ctx <= runner.max_blocks * runner.block_size]
    print(f"[breakdown] attention by table width: {res['attention_by_table_width']}", flush=True)
    return res


def _attention_by_table_width(runner, dev: str, n: int, ctx: int, reps: int) -> dict:
    """The model's decode attention (its heads and dtype, the engine's backend) of
    ``n`` sequences at ``ctx`` tokens, with a block table as wide as the context
    (an eager step's) and one max_model_len wide (a captured graph's). Split-KV
    partitions are sized per sequence, so the two should take the same time."""
    import torch

    from nanoserve import kernels
    heads = runner.model.model.layers[0].self_attn.num_heads
    like = runner.kv_caches[0][0]
    block_size, kv_heads, head_dim = like.shape[1:]
    width = -(-ctx // block_size)
    k_cache, v_cache = (torch.randn(n * width + 1, *like.shape[1:], dtype=like.dtype, device=dev) for _ in "kv")
    narrow = torch.arange(1, n * width + 1, dtype=torch.int32, device=dev).view(n, width)  # block 0 unused
    wide = torch.zeros(n, runner.max_blocks, dtype=torch.int32, device=dev)
    wide[:, :width] = narrow
    query = torch.randn(n, heads, head_dim, dtype=like.dtype, device=dev)
    seq_lens = torch.full((n,), ctx, dtype=torch.int32, device=dev)
    query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
    row, outs = dict(seqs=n, context=ctx), []
    for name, table in (("eager_table", narrow), ("graph_table", wide)):
        def attend():
            return runner.backend.paged_attention(query, k_cache, v_cache, table, seq_lens, query_start_loc,
                                                  head_dim ** -0.5)
        for _ in range(3):
            attend()
        _sync(dev)
        t = time.perf_counter()
        for _ in range(reps):
            out = attend()
        _sync(dev)
        row[f"{name}_us"] = _r((time.perf_counter() - t) / reps * 1e6, 1)
        row[f"{name}_splits"] = kernels._num_kv_splits(True, n, kv_heads, table.shape[1] * block_size)
        outs.append(out.float())
    row["max_abs_diff"] = float((outs[0] - outs[1]).abs().max())
    return row


def _hf_run(mgr, prompts, lens, tag: str, timeout: float) -> list[list[int]]:
    for i, (p, n) in enumerate(zip(prompts, lens)):
        mgr.add_request(p, request_id=f"{tag}{i}", max_new_tokens=n)
    results: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout
    while len(results) < len(prompts):
        if time.monotonic() > deadline:
            raise TimeoutError(f"transformers gave {len(results)}/{len(prompts)} results in {timeout:.0f} s")
        r = mgr.get_result(timeout=1)
        if r is None and hasattr(mgr, "is_running") and not mgr.is_running():
            status = getattr(mgr, "background_thread_status", None)
            raise RuntimeError(f"transformers' generation thread stopped: {getattr(status, 'fatal_error', '?')}")
        if r is not None and r.is_finished():
            if getattr(r, "error", None):
                raise RuntimeError(f"transformers request {r.request_id} failed: {r.error}")
            results[r.request_id] = list(r.generated_tokens)
    return [results[f"{tag}{i}"] for i in range(len(prompts))]


def part_hf_cb(scale: Scale, spec: dict) -> dict:
    """transformers' continuous batching on the same W1 (benchmarks/hf_peer.py's
    recipe) with its CUDA graphs on: its defaults on CUDA (the paged cache sized
    from free memory), use_cuda_graph=True, allow_block_sharing=False. The config's field names differ
    between versions (5.17 block_size, later page_size), so only the fields this
    version has are passed. On the CPU: hf_peer's explicit cache, no graphs."""
    import dataclasses
    import importlib.util

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
    dev = scale.device
    if dev == "cpu" and importlib.util.find_spec("psutil") is None:  # on CUDA it asks torch.cuda
        raise RuntimeError("transformers' continuous batching reads the CPU's memory through psutil, "
                           "which is not installed (without it, it refuses: 'more than available memory 0')")
    w = w1_workload(scale)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["models"]["w1"], dtype=torch.bfloat16).to(dev).eval()
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    # No block sharing, for the reason part_w1 turns nanoserve's prefix caching off.
    want = dict(use_cuda_graph=dev == "cuda", auto_switch_to_flash=False, allow_block_sharing=False)
    if dev != "cuda":
        cfg = model.config
        kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
        want.update(num_blocks=int(2**28 // (16 * kv_bytes_per_token)), max_batch_tokens=2048,
                    page_size=16, block_size=16)
    kw = {k: v for k, v in want.items() if k in fields}
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(w.output_lens))
    mgr = model.init_continuous_batching(generation_config=gen,
                                         continuous_batching_config=ContinuousBatchingConfig(**kw))
    res = dict(transformers=transformers.__version__, config=kw, ignored=sorted(set(want) - set(kw)),
               attn=model.config._attn_implementation)
    mgr.start()
    try:
        _hf_run(mgr, [w.prompts[0][:16]], [2], "warm", 300)
        res["startup_s"] = _r(time.perf_counter() - t0, 2)
        for run in ("first", "second"):
            _sync(dev)
            t = time.perf_counter()
            outs = _hf_run(mgr, w.prompts, w.output_lens, run, 600)
            _sync(dev)
            wall = time.perf_counter() - t
            n_out = sum(map(len, outs))
            res[f"{run}_s"] = _r(wall)
            res[f"{run}_output_tok_s"] = _r(n_out / wall, 1)
            res[f"{run}_digest"] = digest(outs)
            res["num_out"] = n_out
            res["tokens"] = outs
            print(f"[hf_cb] {run}: {wall:.2f} s, {n_out / wall:.0f} tok/s", flush=True)
    finally:
        mgr.stop(block=True, timeout=30)
    res["use_cuda_graph_resolved"] = str(getattr(getattr(mgr, "continuous_batching_config", None),
                                                 "use_cuda_graph", "?"))
    return res


def part_serve(scale: Scale, spec: dict) -> dict:
    """`python -m nanoserve` on W1 (a copy of its dir with serve.py's WordLevel
    tokenizer, so that every token streams as a non-empty chunk and prompts go
    in as token ids), then serve.py's client at 1 and at serve_hi clients:
    TTFT, ITL, TPOT. Each level sends prompts of its own (serve.py's level
    index), so no level hits the prefix cache another filled."""
    import asyncio

    import httpx
    import serve
    work = Path(spec["work"])
    model_dir, wordlevel = serve.wordlevel_dir(Path(spec["models"]["w1"]))
    port = serve.free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "nanoserve", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "bfloat16", "--device", scale.device, "--max-model-len", "2048", "--seed", "0",
           "--disable-uvicorn-access-log"]
    if scale.device == "cpu" and scale.kv_cpu:
        cmd += ["--kv-cache-memory-bytes", scale.kv_cpu]
    env = dict(os.environ, **serve.QUIET_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    log_path = work / "server.log"
    res = dict(cmd=" ".join(cmd), wordlevel_tokenizer=wordlevel, log=str(log_path), levels={})
    shape = ((64, 512), (32, 256)) if scale.device == "cuda" else ((16, 40), (4, 8))  # W1's ranges
    vocab = w1_shape(scale)["vocab_size"]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=ROOT)
        try:
            deadline = time.perf_counter() + spec.get("startup_timeout", 240)
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode} before /health answered:\n"
                                       + log_path.read_text(errors="replace")[-3000:])
                try:
                    if httpx.get(base + "/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() > deadline:
                    raise RuntimeError("no /health 200 in time:\n" + log_path.read_text(errors="replace")[-3000:])
                time.sleep(0.5)
            res["startup_s"] = _r(time.perf_counter() - t0, 1)
            model_id = serve.served_model_id(base, str(model_dir))
            warm = serve.Request(-1, [random.Random(12345).randrange(vocab) for _ in range(shape[0][0])], 16)
            recs, _ = asyncio.run(serve.run_level(base, model_id, [warm], serve.Level("warmup", concurrency=1),
                                                  None, 0, 300))
            if not recs[0]["ok"]:
                raise RuntimeError(f"warm-up request failed: {recs[0]['error']}")
            for k, (clients, n) in enumerate(((1, scale.serve_c1_prompts), (scale.serve_hi, scale.serve_hi)), 1):
                level = serve.Level(f"c={clients}", concurrency=clients)
                reqs = serve.make_requests(n, shape[0], shape[1], vocab, k)
                recs, duration = asyncio.run(serve.run_level(base, model_id, reqs, level, None, 0, 300))
                stats = serve.level_stats(level, recs, duration)
                stats["requests"] = [{k2: v for k2, v in r.items() if k2 != "itl_ms"} for r in stats["requests"]]
                res["levels"][level.label] = stats
                print(f"[serve] {level.label}: {stats['completed']}/{stats['num_requests']} in {duration:.1f} s, "
                      f"TTFT p50 {(stats['ttft_ms'] or {}).get('p50')} ms, ITL p50 "
                      f"{(stats['itl_ms'] or {}).get('p50')} ms, TPOT p50 {(stats['tpot_ms'] or {}).get('p50')} ms",
                      flush=True)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            res["exit_code"] = proc.returncode
    res["ok"] = all(lv["failed"] == 0 for lv in res["levels"].values()) and len(res["levels"]) == 2
    return res


def part_cuda_tests(scale: Scale, spec: dict) -> dict:
    """The test suite's CUDA-only tests (tests/test_decode_graphs.py: graph replay ==
    eager for every captured size, padding rows write no KV; tests/test_lora.py: the same
    with adapter rows; tests/test_kernels.py: the fused-MoE kernel and MLA's 512 + 64 attention in
    bf16 and replayed in a graph) with compiled Triton
    (the suite's default TRITON_INTERPRET=1 skips them). Needs pytest, carried in
    .whl; in the dry run they skip, and the part checks only that pytest ran."""
    import importlib.util
    if importlib.util.find_spec("pytest") is None or importlib.util.find_spec("pytest_timeout") is None:
        raise RuntimeError("pytest or pytest-timeout is not installed (RESULTS.md, 'GPU check: how to run it')")
    # Only the plugin pyproject's --timeout needs: the device image has pytest plugins of its own
    # (cov, xdist, benchmark, ...) built for its pytest, not for the one carried in .whl.
    cmd = [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", "-p", "pytest_timeout",
           "tests/test_decode_graphs.py", "tests/test_lora.py",  # test_lora's: LoRA slots captured == eager
           "tests/test_kernels.py",  # fused_moe_triton in bf16, and its graph replayed on other routings
           "-k", "graph_replay or graph_padding or async_scheduling_with_graphs"]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    # a per-test limit and a run limit inside the part's own, so that a hang leaves pytest's output
    # (killed with the part, the captured output would be lost, and with it which test hung)
    limit = max(20, spec.get("timeout", 90) - 10)
    cmd.append(f"--timeout={max(10, limit - 15)}")  # after addopts' --timeout=600: this one wins
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(out[-20000:], flush=True)
        raise RuntimeError(f"pytest ran past {limit} s; its last lines: {out[-1500:]}") from None
    print(proc.stdout[-20000:], proc.stderr[-5000:], flush=True)
    summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1].strip("= ")
    counts = {k: int(n) for n, k in
              (w.split() for w in summary.split(" in ")[0].split(", ") if w.split()[0].isdigit())}
    passed = counts.get("passed", 0)
    ok = proc.returncode == 0 and (passed > 0 if scale.device == "cuda" else True)
    return dict(ok=ok, summary=summary, returncode=proc.returncode, passed=passed, failed=counts.get("failed", 0),
                skipped=counts.get("skipped", 0))


def part_wna16(scale: Scale, spec: dict) -> dict:
    """Int4/int8 weights kept packed (model.WNA16Weight): Triton's wna16_matmul against its torch twin (bf16
    on the GPU, fp32 interpreted in the dry run), its time beside a bf16 matmul of the same weight dequantized,
    one CUDA graph of it replayed on new inputs, and W1 as a GPTQ int4 g128 checkpoint served packed and
    dequantized: weight bytes, peak memory, and greedy tokens (the two paths' weights are the same values;
    their sums may round apart)."""
    cuda = scale.device == "cuda"
    os.environ["TRITON_INTERPRET"] = "0" if cuda else "1"  # before triton's import (tests' conftest sets 1)
    import torch

    from nanoserve import kernels
    from wna16 import gptq_checkpoint, random_packed
    dtype = torch.bfloat16 if cuda else torch.float32
    res: dict = {"kernel": []}
    ok = True
    shapes = [(1, 4096, 4096), (16, 4096, 12288), (64, 4096, 4096), (1, 12288, 4096)] if cuda else \
        [(1, 100, 72), (17, 136, 40)]
    for (M, K, N), (bits, group, act) in ((s, v) for s in shapes for v in ((4, 128, False), (4, 128, True),
                                                                            (8, -1, False))):
        qw, sc, zr, g, gs = random_packed(K, N, bits, group, act, scale.device)
        x = torch.randn(M, K, device=scale.device, dtype=dtype)
        got = kernels.wna16_matmul_triton(x, qw, sc, zr, g, bits, gs, 0)
        want = kernels.wna16_matmul_torch(x, qw, sc, zr, g, bits, gs, 0)
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6)).item()
        row = dict(M=M, K=K, N=N, bits=bits, group=group, act_order=act, rel_err=_r(err, 5))
        ok &= err < (2e-2 if cuda else 1e-4)
        if cuda:  # microseconds a call, 50 calls after 5, beside the dense bf16 weight's matmul
            dense = kernels.wna16_weight_torch(qw, sc, zr, g, bits, gs, 0, K, dtype)  # [K, N], as x @ W
            row["packed_us"] = _time_us(torch, lambda: kernels.wna16_matmul_triton(x, qw, sc, zr, g, bits, gs, 0))
            row["dense_bf16_us"] = _time_us(torch, lambda: x @ dense)
        res["kernel"].append(row)
    if cuda:  # one graph of the kernel, replayed on other inputs == eager
        qw, sc, zr, g, gs = random_packed(4096, 4096, 4, 128, False, "cuda")
        x = torch.randn(8, 4096, device="cuda", dtype=dtype)
        kernels.wna16_matmul_triton(x, qw, sc, zr, g, 4, gs, 0)  # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = kernels.wna16_matmul_triton(x, qw, sc, zr, g, 4, gs, 0)
        same = True
        for seed in range(3):
            x.copy_(torch.randn(8, 4096, generator=torch.Generator().manual_seed(seed)).to("cuda", dtype))
            graph.replay()
            same &= torch.equal(out, kernels.wna16_matmul_triton(x, qw, sc, zr, g, 4, gs, 0))
        res["graph_replay_equals_eager"] = bool(same)
        ok &= same
    work = Path(spec["work"])
    path = gptq_checkpoint(Path(spec["models"]["w1"]), work / "models" / "w1-gptq-int4-g128")
    tokens, weights, peaks = _packed_and_dequantized(scale, path, max_model_len=256, kv_cache_memory_bytes=64 << 20)
    for mode in tokens:
        res[mode] = dict(weight_MiB=_r(weights[mode] / 2**20, 1), peak_MiB=_r(peaks[mode] / 2**20, 1) if cuda else None)
    res["greedy_match"] = match_rate(tokens.get("packed"), tokens.get("dequantized"))
    # the dry run's W1 is mostly its embedding (151,936 x 64): packed only has to be smaller there
    ok &= res["packed"]["weight_MiB"] < (0.5 if cuda else 1) * res["dequantized"]["weight_MiB"]
    res["moe"] = _wna16_moe(scale, work)
    res["ok"] = bool(ok and res["moe"]["ok"])
    return res


def _wna16_moe(scale: Scale, work: Path) -> dict:
    """Experts kept packed (model.WNA16Experts): fused_moe_triton on PackedExperts against its torch twin at
    Qwen3-30B-A3B-GPTQ's shapes (128 experts of 2048 x 768, top 8, g128; tiny and fp32 in the dry run), its
    time beside the bf16 stacks' fused_moe, one CUDA graph replayed on new inputs, the bytes of one layer's
    experts each way, and a tiny GPTQ Qwen3-MoE served packed and dequantized (greedy tokens, weight bytes)."""
    import torch

    from nanoserve import kernels
    from test_wna16 import quantized_checkpoint
    from test_wna16_moe import packed_experts
    cuda = scale.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    E, H, I, top_k = (128, 2048, 768, 8) if cuda else (4, 72, 40, 2)
    res: dict = {"kernel": []}
    ok = True
    for bits in (4, 8):
        group = 128 if cuda else 32
        w13, w13_ref = packed_experts(H, 2 * I, bits, group, False, 0, seed=10, experts=E)
        w2, w2_ref = packed_experts(I, H, bits, group, False, 0, seed=20, experts=E)
        w13, w2 = (kernels.PackedExperts(w.qweight.to(scale.device), w.scales.to(scale.device),
                                         w.zeros.to(scale.device), w.bits, w.group_size, w.k_off, w.in_features)
                   for w in (w13, w2))
        res[f"int{bits}_layer_MiB"] = dict(
            packed=_r(sum(t.numel() * t.element_size() for w in (w13, w2) for t in (w.qweight, w.scales, w.zeros))
                      / 2**20, 1), bf16=_r((w13_ref.numel() + w2_ref.numel()) * 2 / 2**20, 1))
        dense13, dense2 = w13_ref.to(scale.device, dtype), w2_ref.to(scale.device, dtype)
        del w13_ref, w2_ref
        for T in ((1, 16, 256) if cuda else (1, 5)):
            gen = torch.Generator().manual_seed(T)
            ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(T)]).to(scale.device,
                                                                                                 torch.int32)
            weights = torch.rand(T, top_k, generator=gen).to(scale.device)
            x = torch.randn(T, H, generator=gen).to(scale.device, dtype)
            got = kernels.fused_moe_triton(x, w13, w2, weights, ids)
            want = kernels.fused_moe_wna16_torch(x, w13, w2, weights, ids)
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6)).item()
            row = dict(T=T, bits=bits, rel_err=_r(err, 5))
            ok &= err < (2e-2 if cuda else 1e-4)
            if cuda:
                for name, fn in (("packed_us", lambda: kernels.fused_moe_triton(x, w13, w2, weights, ids)),
                                 ("bf16_us", lambda: kernels.fused_moe_triton(x, dense13, dense2, weights, ids))):
                    row[name] = _time_us(torch, fn)
            res["kernel"].append(row)
        del dense13, dense2
        if cuda and bits == 4:  # one graph of the packed MoE, replayed on other inputs == eager
            x, weights = torch.zeros(8, H, device="cuda", dtype=dtype), torch.zeros(8, top_k, device="cuda")
            ids = torch.zeros(8, top_k, device="cuda", dtype=torch.int32)
            kernels.warm_up_fused_moe_triton(w13, w2, top_k, dtype=dtype)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = kernels.fused_moe_triton(x, w13, w2, weights, ids)
            same = True
            for seed in range(3):
                gen = torch.Generator().manual_seed(seed)
                x.copy_(torch.randn(8, H, generator=gen).to("cuda", dtype))
                weights.copy_(torch.rand(8, top_k, generator=gen))
                ids.copy_(torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(8)]))
                graph.replay()
                same &= torch.equal(out, kernels.fused_moe_triton(x, w13, w2, weights, ids))
            res["graph_replay_equals_eager"] = bool(same)
            ok &= same
    path = quantized_checkpoint(work / "models", "gptq", bits=4, group=32, sym=False, arch="qwen3_moe")
    tokens, weights, _ = _packed_and_dequantized(scale, path, max_model_len=128, kv_cache_memory_bytes=16 << 20)
    for mode in tokens:
        res[f"tiny_{mode}_weight_KiB"] = _r(weights[mode] / 2**10, 1)
    res["tiny_greedy_match"] = match_rate(tokens.get("packed"), tokens.get("dequantized"))
    res["ok"] = bool(ok and res["tiny_packed_weight_KiB"] < res["tiny_dequantized_weight_KiB"])
    return res


def _packed_and_dequantized(scale: Scale, path: Path, **llm_args) -> tuple[dict, dict, dict]:
    """The greedy tokens of four prompts, the weights' bytes and (CUDA) the peak bytes allocated, with the
    int4/int8 weights of ``path`` served packed, then dequantized: each mode's engine in turn."""
    import torch

    from nanoserve import LLM, SamplingParams
    cuda = scale.device == "cuda"
    prompts = [list(range(3 + i, 40 + 7 * i)) for i in range(4)]
    tokens, weights, peaks = {}, {}, {}
    for mode in ("packed", "dequantized"):
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        llm = LLM(str(path), dtype="bfloat16", device=scale.device, skip_tokenizer_init=True, wna16_weights=mode,
                  enforce_eager=not cuda, **llm_args)
        try:
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, min_tokens=16),
                                use_tqdm=False)
            tokens[mode] = [o.outputs[0].token_ids for o in outs]
            weights[mode] = llm.engine.weight_bytes
            peaks[mode] = torch.cuda.max_memory_allocated() if cuda else 0
        finally:
            llm.shutdown()
            del llm
    return tokens, weights, peaks


def _time_us(torch, fn) -> float:
    """Microseconds a call of ``fn`` on the GPU: 50 calls after 5."""
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        fn()
    end.record()
    end.synchronize()
    return _r(start.elapsed_time(end) * 1000 / 50, 1)


# In the order they run: W1 with graphs, then what only a GPU can check (parity, the CUDA
# tests), then the other figures, which a second, shorter call could fill in if the
# budget runs out before them.
WORKERS = dict(env=part_env, models=part_models,
               w1_graphs=lambda s, spec: part_w1(s, spec, eager=False),
               parity=part_parity, cuda_tests=part_cuda_tests,
               breakdown=part_breakdown, w1_eager=lambda s, spec: part_w1(s, spec, eager=True),
               hf_cb=part_hf_cb, w1_async=lambda s, spec: part_w1(s, spec, async_scheduling=True),
               serve=part_serve, wna16=part_wna16)
# name: (timeout s on the GPU, in the dry run)
TIMEOUTS = dict(env=(60, 60), models=(120, 60), w1_graphs=(150, 60), w1_eager=(110, 60), w1_async=(90, 60),
                breakdown=(120, 60), parity=(240, 180), cuda_tests=(120, 90), serve=(150, 90), hf_cb=(120, 60),
                wna16=(240, 150))
NEEDS_W1 = ("w1_graphs", "w1_eager", "w1_async", "breakdown", "hf_cb", "serve", "wna16")


def worker_main(name: str, spec_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    scale = Scale(**spec["scale"])
    try:
        res = WORKERS[name](scale, spec)
        code = 0
    except BaseException as e:  # noqa: BLE001 - the error is this part's result
        traceback.print_exc()
        res, code = dict(error=f"{type(e).__name__}: {e}"[:2000]), 1
    Path(spec["result"]).write_text(json.dumps(res, default=str))
    # Leave at once: a thread the part left running (transformers' generation loop is no daemon,
    # and outlives mgr.stop's timeout after an error) would hold the process, and the budget,
    # until the part's timeout. The orchestrator kills what the part started.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ============================================================================ orchestration

@dataclass
class Run:
    out: Path
    work: Path
    scale: Scale
    dry_run: bool
    budget_s: float
    copy_to_results: bool = False  # also write benchmarks/results/gpu-w1.json (a real run from the repo)
    t0: float = field(default_factory=time.perf_counter)
    parts: dict = field(default_factory=dict)
    models: dict = field(default_factory=dict)

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)


def run_part(run: Run, name: str, extra_env: dict | None = None) -> dict:
    """One part in a fresh process, its output in work/logs/NAME.log, bounded by
    its timeout and what is left of the budget."""
    timeout = min(TIMEOUTS[name][1 if run.dry_run else 0], run.left() - 5)
    if timeout < 15:
        return dict(ok=False, skipped=f"the budget of {run.budget_s:.0f} s is spent", seconds=0)
    logs = run.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    result, spec_path = logs / f"{name}.json", logs / f"{name}.spec.json"
    result.unlink(missing_ok=True)
    spec_path.write_text(json.dumps(dict(scale=asdict(run.scale), work=str(run.work), models=run.models,
                                         result=str(result), startup_timeout=max(30, timeout - 60), timeout=timeout)))
    env = dict(os.environ, **CHILD_ENV, **(extra_env or {}))
    t = time.perf_counter()
    print(f"[gpu] {name} ... (timeout {timeout:.0f} s)", flush=True)
    with open(logs / f"{name}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", name,
                                 "--spec", str(spec_path)], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, cwd=ROOT, start_new_session=True)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:  # the part's whole process group, also once it exited: a server it started goes too
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
    seconds = round(time.perf_counter() - t, 1)
    if result.exists():
        res = json.loads(result.read_text())
    elif seconds >= timeout - 1:
        res = dict(error=f"timed out after {timeout:.0f} s")
    else:
        res = dict(error=f"the worker exited with {proc.returncode} and wrote no result")
    if "error" in res:
        res["log_tail"] = (logs / f"{name}.log").read_text(errors="replace")[-2500:]
    res.setdefault("ok", "error" not in res)
    res["seconds"] = seconds
    status = "ok" if res["ok"] else f"FAILED: {res.get('error', 'a check failed')}"
    print(f"[gpu] {name}: {seconds:.1f} s, {status}", flush=True)
    if "error" in res:
        print(res["log_tail"][-1200:], flush=True)
    return res


def commit_of(arg: str | None, root: Path = ROOT) -> str:
    if arg:
        return arg
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=root,
                              timeout=10).stdout.strip()
        if head:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                   text=True, cwd=root, timeout=10).stdout.strip()
            return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    f = root / ".whl" / "COMMIT"  # written at prepare time: HEAD, then `git status --porcelain` lines
    if f.exists() and f.read_text().strip():
        lines = [x for x in f.read_text().splitlines() if x.strip()]
        return lines[0].strip() + ("-dirty" if len(lines) > 1 else "")
    return os.environ.get("NANOSERVE_COMMIT", "unknown")


def match_rate(a: list[list[int]] | None, b: list[list[int]] | None) -> dict | None:
    """How far two runs' greedy tokens agree: requests identical, and tokens
    before each request's first difference."""
    if not a or not b or len(a) != len(b):
        return None
    same = sum(x == y for x, y in zip(a, b))
    prefix = 0
    for x, y in zip(a, b):
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix += k
    total = sum(len(x) for x in a)
    return dict(requests_identical=f"{same}/{len(a)}", tokens_before_first_difference=f"{prefix}/{total}",
                rate=_r(prefix / max(1, total), 4))


def summarize(record: dict) -> dict:
    """The headline keys from the parts' results (None where a part failed)."""
    p = record["parts"]
    g, e, hf, bd, a = (p.get(k) or {} for k in ("w1_graphs", "w1_eager", "hf_cb", "breakdown", "w1_async"))
    env = p.get("env") or {}
    out = dict(gpu=env.get("gpu"), torch=env.get("torch"), triton=env.get("triton"),
               triton_launch=env.get("triton_launch"),
               transformers=env.get("transformers"),
               w1_warm_s=g.get("warm_s"), w1_cold_s=g.get("cold_s"), w1_startup_s=g.get("startup_s"),
               w1_eager_s=e.get("warm_s"), w1_eager_cold_s=e.get("cold_s"), w1_eager_startup_s=e.get("startup_s"),
               w1_output_tok_s=g.get("warm_output_tok_s"),
               w1_digest=g.get("warm_digest"), w1_eager_digest=e.get("warm_digest"),
               w1_async_warm_s=a.get("warm_s"), w1_async_digest=a.get("warm_digest"),
               hf_cb_graph_s=hf.get("second_s"), hf_cb_graph_first_s=hf.get("first_s"),
               decode_step_ms_b64=bd.get("decode_step_ms_b64"),
               decode_step_eager_ms_b64=bd.get("decode_step_eager_ms_b64"),
               host_ms_b64=(bd.get("per_step") or {}).get("host_ms"),
               parity_ok=(p.get("parity") or {}).get("ok"), parity=(p.get("parity") or {}).get("summary"))
    if g.get("warm_digest") and e.get("warm_digest"):
        out["graphs_eager_same_tokens"] = g["warm_digest"] == e["warm_digest"]
        if not out["graphs_eager_same_tokens"]:
            out["graphs_eager_match"] = record.get("graphs_eager_match")
    if g.get("warm_digest") and a.get("warm_digest"):  # async scheduling must not change a token
        out["async_graphs_same_tokens"] = g["warm_digest"] == a["warm_digest"]
    return out


def _fmt(x, unit="", nd=2) -> str:
    return "—" if x is None else (f"{x:.{nd}f}{unit}" if isinstance(x, (int, float)) else f"{x}{unit}")


def markdown(record: dict) -> str:
    """A section for benchmarks/RESULTS.md."""
    s, p = record, record["parts"]
    g, e, hf, bd, sv, a = (p.get(k) or {} for k in ("w1_graphs", "w1_eager", "hf_cb", "breakdown", "serve",
                                                     "w1_async"))
    dry = " (DRY RUN on a CPU, tiny shapes: no figure here is a GPU measurement)" if s.get("dry_run") else ""
    lines = [f"## {s['date']}: issue 22's GPU check on {s.get('gpu')}{dry}", "",
             f"`benchmarks/gpu.py`, commit `{s['commit']}`; torch {s.get('torch')}, Triton {s.get('triton')}, "
             f"transformers {s.get('transformers')}; {s['total_s']:.0f} s in all. Raw: `results/gpu-w1.json`.", "",
             "| figure | value | target |", "|---|---|---|"]

    def row(name, value, target=""):
        lines.append(f"| {name} | {value} | {target} |")
    ok = lambda x, t: "" if x is None else (" ✓" if x <= t else " ✗")  # noqa: E731
    row("W1 warm (second run in the process, CUDA graphs; prefix caching off in all W1 runs)",
        f"**{_fmt(g.get('warm_s'), ' s')}**, {_fmt(g.get('warm_output_tok_s'), ' tok/s', 0)}",
        f"≤ {TARGETS['w1_warm_s']} s{ok(g.get('warm_s'), TARGETS['w1_warm_s'])}")
    row("W1 first run in a fresh process (empty Triton cache)",
        f"{_fmt(g.get('cold_s'), ' s')} (start-up {_fmt(g.get('startup_s'), ' s', 1)} apart: "
        f"{g.get('graphs', '?')} graphs)", f"≤ {TARGETS['w1_cold_s']} s{ok(g.get('cold_s'), TARGETS['w1_cold_s'])}")
    row("W1 `enforce_eager=True`: warm / first", f"{_fmt(e.get('warm_s'), ' s')} / {_fmt(e.get('cold_s'), ' s')} "
        f"(start-up {_fmt(e.get('startup_s'), ' s', 1)})")
    am = s.get("async_graphs_same_tokens")
    ls = a.get("launch_syncs") or {}
    row("W1 `async_scheduling=True` (CUDA graphs): warm / first",
        f"{_fmt(a.get('warm_s'), ' s')} / {_fmt(a.get('cold_s'), ' s')}, tokens "
        f"{'—' if am is None else 'identical to' if am else 'DIFFER from'} the graphs run's; launches that "
        f"synced the host: {ls.get('launches_that_synced', '—')} of {ls.get('launches', '—')}")
    gm = s.get("graphs_eager_same_tokens")
    row("greedy tokens, graphs vs eager", "—" if gm is None else ("identical" if gm else
        f"differ: {s.get('graphs_eager_match')}") + f" (digests {g.get('warm_digest')} / {e.get('warm_digest')})")
    row("transformers CB with its CUDA graphs: second / first run",
        f"{_fmt(hf.get('second_s'), ' s')} / {_fmt(hf.get('first_s'), ' s')} (transformers "
        f"{hf.get('transformers', '?')})")
    fc = (bd.get("fixed_context") or {}).get("by_batch") or {}
    for bs, r in fc.items():
        row(f"decode forward, batch {bs} × {(bd.get('fixed_context') or {}).get('context')} context: graph / eager",
            f"{'**' if str(bs) == '64' else ''}{_fmt(r.get('graph_ms'), ' ms', 3)}{'**' if str(bs) == '64' else ''}"
            f" / {_fmt(r.get('eager_ms'), ' ms', 3)}",
            f"≤ {TARGETS['decode_step_ms_b64']} ms{ok(r.get('graph_ms'), TARGETS['decode_step_ms_b64'])}"
            if str(bs) == "64" else "")
    for r in bd.get("attention_by_table_width") or []:
        row(f"decode attention alone, {r['seqs']} × {r['context']} context: table as wide as the context / as "
            f"max_model_len (a graph's)", f"{_fmt(r.get('eager_table_us'), ' µs', 1)} ({r.get('eager_table_splits')} "
            f"splits) / {_fmt(r.get('graph_table_us'), ' µs', 1)} ({r.get('graph_table_splits')} splits), "
            f"max diff {_fmt(r.get('max_abs_diff'), '', 4)}")
    ps = bd.get("per_step") or {}
    if ps:
        m = ps["ms"]
        row(f"one decode step, batch {ps['batch']}, context {ps['context_first']}–{ps['context_last']}, "
            f"mean of {ps['steps']} (ms)",
            ", ".join(f"{k} {_fmt(v, '', 3)}" for k, v in m.items()), "")
        row("host work per step (schedule + build_inputs + buffer copy + postprocess)",
            _fmt(ps.get("host_ms"), " ms", 3),
            f"≤ {TARGETS['host_ms']} ms{ok(ps.get('host_ms'), TARGETS['host_ms'])}")
        row("plain `engine.step()`, mean", _fmt((bd.get("plain_step_ms") or {}).get("mean"), " ms", 3))
    par = p.get("parity") or {}
    row(f"greedy parity with transformers (fp32, {len(par.get('archs') or ARCHS)} archs: dense, Gemma, MoE, "
        "a sliding window among them, × plain/preempt/chunked × graphs/eager)",
        par.get("summary") or par.get("error") or "—")
    ct = p.get("cuda_tests") or {}
    row("the suite's CUDA tests (graph replay == eager per captured size; padding writes no KV)",
        ct.get("summary") or ct.get("error") or "—")
    wn = p.get("wna16") or {}
    if wn.get("kernel"):
        worst = max(r["rel_err"] for r in wn["kernel"])
        times = "; ".join(f"{r['M']}×{r['K']}×{r['N']} int{r['bits']}{' act' if r['act_order'] else ''} "
                          f"{_fmt(r.get('packed_us'), ' µs', 1)} vs {_fmt(r.get('dense_bf16_us'), ' µs', 1)}"
                          for r in wn["kernel"] if r.get("packed_us") is not None)
        row("int4/int8 weights packed: wna16_matmul vs its torch twin (worst relative error); a call vs bf16 dense",
            f"{worst}; {times or '—'}; graph replay == eager: {wn.get('graph_replay_equals_eager', '—')}")
        pk, dq = wn.get("packed") or {}, wn.get("dequantized") or {}
        row("W1 as GPTQ int4 g128: weights / peak memory, packed vs dequantized; greedy tokens",
            f"{_fmt(pk.get('weight_MiB'), ' MiB', 0)} / {_fmt(pk.get('peak_MiB'), ' MiB', 0)} vs "
            f"{_fmt(dq.get('weight_MiB'), ' MiB', 0)} / {_fmt(dq.get('peak_MiB'), ' MiB', 0)}; "
            f"{wn.get('greedy_match')}")
    mo = wn.get("moe") or {}
    if mo.get("kernel"):
        worst = max(r["rel_err"] for r in mo["kernel"])
        times = "; ".join(f"T={r['T']} int{r['bits']} {_fmt(r.get('packed_us'), ' µs', 1)} vs "
                          f"{_fmt(r.get('bf16_us'), ' µs', 1)}" for r in mo["kernel"]
                          if r.get("packed_us") is not None)
        row("int4/int8 experts packed (Qwen3-30B-A3B's 128 x 2048 x 768, top 8): fused_moe vs its torch twin "
            "(worst relative error); a call vs the bf16 stacks'",
            f"{worst}; {times or '—'}; graph replay == eager: {mo.get('graph_replay_equals_eager', '—')}")
        row("one MoE layer's experts, int4 / int8 packed vs bf16; a tiny GPTQ Qwen3-MoE packed vs dequantized: "
            "greedy tokens",
            f"{_fmt((mo.get('int4_layer_MiB') or {}).get('packed'), ' MiB', 1)} / "
            f"{_fmt((mo.get('int8_layer_MiB') or {}).get('packed'), ' MiB', 1)} vs "
            f"{_fmt((mo.get('int4_layer_MiB') or {}).get('bf16'), ' MiB', 1)}; {mo.get('tiny_greedy_match')}")
    for label, lv in (sv.get("levels") or {}).items():
        def q(k, st="p50"):
            return (lv.get(k) or {}).get(st)
        row(f"online {label} ({lv['completed']}/{lv['num_requests']} requests): TTFT / ITL / TPOT p50 (ITL p99)",
            f"{_fmt(q('ttft_ms'), ' ms', 1)} / {_fmt(q('itl_ms'), ' ms', 2)} / {_fmt(q('tpot_ms'), ' ms', 2)} "
            f"({_fmt(q('itl_ms', 'p99'), ' ms', 2)}), {_fmt(lv.get('output_throughput'), ' tok/s', 0)}")
    failed = [f"`{k}`: {v.get('error') or v.get('skipped') or 'a check failed'}"
              for k, v in p.items() if not v.get("ok")]
    lines += ["", "Failed or skipped parts: " + ("; ".join(failed) if failed else "none") + "."]
    return "\n".join(lines) + "\n"


def save(run: Run, record: dict) -> None:
    record["total_s"] = round(time.perf_counter() - run.t0, 1)
    record.update(summarize(record))
    run.out.mkdir(parents=True, exist_ok=True)
    name = "gpu-w1-dry" if run.dry_run else "gpu-w1"
    text = json.dumps(record, indent=1, default=str)
    (run.out / f"{name}.json").write_text(text)
    (run.out / f"{name}.md").write_text(markdown(record))
    logs = run.work / "logs"
    if logs.exists():
        with open(run.out / f"{name}-log.txt", "w") as f:
            for part in record["parts"]:
                log = logs / f"{part}.log"
                if log.exists():
                    f.write(f"\n===== {part} =====\n" + log.read_text(errors="replace")[-1_500_000:])
            server = run.work / "server.log"
            if "serve" in record["parts"] and server.exists():
                f.write("\n===== the server's own log =====\n" + server.read_text(errors="replace")[-1_500_000:])
    results = HERE / "results"
    if run.copy_to_results and results.is_dir() and run.out.resolve() != results.resolve():
        (results / f"{name}.json").write_text(text)


def orchestrate(args) -> int:
    scale = DRY if args.dry_run else GPU
    work = args.work or Path(f"/tmp/nanoserve-gpu{'-dry' if args.dry_run else ''}")
    out = args.out or (work / "out" if args.dry_run else HERE / "results")
    run = Run(out=out, work=work, scale=scale, dry_run=args.dry_run, budget_s=args.budget_s,
              copy_to_results=not args.dry_run)
    run.work.mkdir(parents=True, exist_ok=True)
    record = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), commit=commit_of(args.commit),
                  dry_run=args.dry_run, command=" ".join([sys.executable, *sys.argv]), budget_s=args.budget_s,
                  host=platform.node(), parts={})
    print(f"[gpu] commit {record['commit']}, {'dry run on the CPU' if args.dry_run else 'CUDA'}, "
          f"budget {args.budget_s:.0f} s, work dir {run.work}", flush=True)
    # W1's two runs each start from an empty Triton cache (the first W1 run pays what
    # it pays on a fresh machine); the later parts reuse what w1_graphs compiled.
    stamp = time.strftime("%H%M%S")
    # env's one Triton launch gets a cache of its own: it would build Triton's driver utilities in w1_graphs'
    caches = {name: run.work / f"triton-cache-{name}-{stamp}" for name in ("env", "w1_graphs", "w1_eager")}
    for name in args.parts:
        if name in NEEDS_W1 and "w1" not in run.models:
            res = dict(ok=False, skipped="no W1 model (the models part failed or did not run)", seconds=0)
        else:
            cache = caches.get(name, caches["w1_graphs"])
            res = run_part(run, name, {"TRITON_CACHE_DIR": str(cache)})
        if name == "models" and res.get("ok"):
            run.models = dict(tiny=res["tiny"], w1=res["w1"])
        record["parts"][name] = res
        tokens = {k: v.get("tokens") for k, v in record["parts"].items()}
        record["graphs_eager_match"] = match_rate(tokens.get("w1_graphs"), tokens.get("w1_eager"))
        record["hf_vs_nanoserve_match"] = match_rate(tokens.get("hf_cb"), tokens.get("w1_graphs"))
        save(run, {**record, "parts": {k: {k2: v2 for k2, v2 in v.items() if k2 != "tokens"}
                                       for k, v in record["parts"].items()}})
    for v in record["parts"].values():
        v.pop("tokens", None)
    save(run, record)
    final = json.loads((run.out / f"{'gpu-w1-dry' if args.dry_run else 'gpu-w1'}.json").read_text())
    print("\n" + markdown(final), flush=True)
    print(json.dumps({k: final.get(k) for k in ("date", "gpu", "torch", "commit", "w1_warm_s", "w1_cold_s",
                                                "w1_eager_s", "w1_async_warm_s", "hf_cb_graph_s",
                                                "decode_step_ms_b64")}), flush=True)
    failed = [k for k, v in record["parts"].items() if not v.get("ok")]
    print(f"[gpu] wrote {run.out}; {len(failed)} parts failed or skipped{': ' + ', '.join(failed) if failed else ''}",
          flush=True)
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="where gpu-w1.json/.md/-log.txt go (default benchmarks/results; "
                    "the dry run's gpu-w1-dry.* go to WORK/out)")
    ap.add_argument("--dry-run", action="store_true", help="every part on this CPU with tiny shapes")
    ap.add_argument("--parts", nargs="+", default=list(WORKERS), choices=list(WORKERS),
                    help="a subset, in this order (models is needed by all but env)")
    ap.add_argument("--budget-s", type=float, default=450, help="total seconds; parts past it are skipped")
    ap.add_argument("--work", type=Path, help="models, logs, caches (default /tmp/nanoserve-gpu[-dry])")
    ap.add_argument("--commit", help="the commit measured (default: git, else .whl/COMMIT, else "
                    "$NANOSERVE_COMMIT)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args.worker, args.spec)
    if not args.dry_run:
        import importlib.util
        if importlib.util.find_spec("torch") is None:
            print("torch is not installed")
            return 2
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
