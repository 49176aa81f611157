"""Shared test fixtures: tiny random models of every supported architecture,
built from transformers' config classes and saved with save_pretrained, plus a
byte-level BPE tokenizer trained here. Nothing is downloaded."""
from __future__ import annotations

import asyncio
import functools
import json
import os

# The Triton interpreter is chosen when triton is first imported: set it before any test imports nanoserve.
os.environ.setdefault("TRITON_INTERPRET", "1")
from importlib.metadata import PackageNotFoundError, version  # noqa: E402
from pathlib import Path  # noqa: E402


def _triton_interpreter_clash() -> str | None:
    """Triton's interpreter before 3.7 turns a loop bound into a Python int with
    int() of a 1-element array, which numpy 2.4 refuses: every kernel with a
    runtime loop bound then fails with "only 0-dimensional arrays can be converted
    to Python scalars". torch 2.11's CUDA wheels pin Triton 3.6; compiled on a GPU
    the kernels are fine."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        triton_v, numpy_v = version("triton"), version("numpy")
    except PackageNotFoundError:
        return None

    def major_minor(v: str) -> tuple[int, int]:
        return tuple(int(x) for x in v.split("+")[0].split(".")[:2])
    if major_minor(triton_v) < (3, 7) and major_minor(numpy_v) >= (2, 4):
        return (f"Triton {triton_v}'s interpreter cannot run with numpy {numpy_v} (fixed in Triton 3.7): "
                "pip install 'numpy<2.4' to test the Triton kernels on the CPU")
    return None


TRITON_INTERPRETER_CLASH = _triton_interpreter_clash()
if TRITON_INTERPRETER_CLASH:
    # On a GPU machine every engine test would run its Triton kernels through the
    # broken interpreter; hide the GPU so the suite takes the CPU path, as CI does.
    # tests/test_kernels.py fails once with the message; its Triton cases skip.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


import nanoserve  # noqa: E402,F401 - first: it sets OpenMP's spin count, which libgomp reads as torch loads it
import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _share_httpx_default_ssl_context() -> None:
    """Every httpx client the tests open (httpx.post, httpx.Client, the openai and
    anthropic SDKs' clients) builds a new verifying SSL context and loads certifi's
    CA bundle into it: ~25 ms each, over a thousand times, ~30 s of the suite. The
    tests speak plain HTTP to 127.0.0.1 (the one HTTPS test passes its own context),
    so the default context is made once and shared; any other verify is httpx's own."""
    try:
        from httpx._transports import default
    except ImportError:  # another httpx layout: each client makes its own, as before
        return
    make = default.create_ssl_context
    shared = []

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is not True or cert is not None or not trust_env:
            return make(verify=verify, cert=cert, trust_env=trust_env)
        if not shared:
            shared.append(make())
        return shared[0]
    default.create_ssl_context = create_ssl_context


_share_httpx_default_ssl_context()


def _patient_httpx_default_timeout(seconds: float = 120.0) -> None:
    """httpx gives a request 5 s by default; on a busy 2-core CI machine a request
    that renders a template in a fresh subprocess, or waits behind a step, can take
    longer, and the test then fails for the load, not for what the server said.
    The tests check answers, not speed: every httpx call and client that names no
    timeout of its own gets ``seconds`` (a hang still fails, at that limit)."""
    import httpx
    patient = httpx.Timeout(seconds)
    for f in (httpx.request, httpx.stream, httpx.get, httpx.options, httpx.head, httpx.post, httpx.put,
              httpx.patch, httpx.delete, httpx.Client.__init__, httpx.AsyncClient.__init__):
        if f.__kwdefaults__ and "timeout" in f.__kwdefaults__:
            f.__kwdefaults__["timeout"] = patient


_patient_httpx_default_timeout()


def pytest_report_header(config):
    return f"nanoserve: {TRITON_INTERPRETER_CLASH}; GPU hidden" if TRITON_INTERPRETER_CLASH else None


CORPUS = ("The quick brown fox jumps over the lazy dog. def main(): return 0\n"
          "import os, sys; print('hello world') 你好，世界！ 🙂 emoji and ünïcödé text. " * 8)
VOCAB = 384


@functools.lru_cache(maxsize=None)
def _tokenizer_dir(root: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                         "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                          "{% endif %}")
    out = Path(root) / "tokenizer"
    fast.save_pretrained(out)
    return str(out)


# qwen3_moe: one mixture-of-experts model through every all-architecture test (tests/test_moe.py has all three)
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "granite", "phi3", "gemma3", "gemma2", "qwen3_moe")
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared", "glm4_moe")


def hf_config(arch: str, **overrides):
    from transformers import (Gemma2Config, Gemma3TextConfig, Glm4MoeConfig, GraniteConfig, GraniteMoeConfig,
                              GraniteMoeSharedConfig, LlamaConfig, MistralConfig, MixtralConfig, OlmoeConfig,
                              Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=0, bos_token_id=None)
    if arch == "llama":
        cls = LlamaConfig
    elif arch == "qwen2":
        cls = Qwen2Config
    elif arch == "qwen3":
        cls = Qwen3Config
        base.update(head_dim=32, tie_word_embeddings=True)  # head_dim != hidden / heads
    elif arch == "mistral":
        cls = MistralConfig
        base.update(sliding_window=None)
    elif arch == "granite":  # Granite 3's four scalars, at values unlike 1 and head_dim ** -0.5
        cls = GraniteConfig
        base.update(embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.09, logits_scaling=2.5)
    elif arch == "phi3":  # q/k/v and gate/up stored fused; no window unless asked
        cls = Phi3Config
        base.update(sliding_window=None, pad_token_id=None)
    elif arch == "gemma3":  # a sliding layer (16 tokens: the tests' longer prompts pass it), then a full one;
        cls = Gemma3TextConfig  # the attention scale not head_dim's, the embeddings tied as Gemma's are
        base.update(head_dim=32, query_pre_attn_scalar=24, tie_word_embeddings=True, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"])
    elif arch == "gemma2":  # Gemma 3's layout less q/k norm, soft caps low enough to bend the tiny model's
        cls = Gemma2Config  # scores and logits (the real 50 and 30 barely would), a 16-token sliding layer
        base.update(head_dim=32, query_pre_attn_scalar=24, tie_word_embeddings=True, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=0.5,
                    final_logit_softcapping=2.0)
    elif arch == "mixtral":  # every layer sparse, 4 experts of intermediate_size, top 2 (always renormalised)
        cls = MixtralConfig
        base.update(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    elif arch == "qwen2_moe":  # layer 0 sparse with the shared expert, layer 1 dense (mlp_only_layers)
        cls = Qwen2MoeConfig
        base.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                    mlp_only_layers=[1], norm_topk_prob=False)
    elif arch == "qwen3_moe":  # q/k norm, head_dim not hidden / heads, the top-k renormalised, both layers sparse
        cls = Qwen3MoeConfig
        base.update(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    elif arch == "olmoe":  # q/k norms over all heads (k's 2 KV heads wide), every layer sparse, top 2 not renormalised
        cls = OlmoeConfig
        base.update(intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, pad_token_id=None)
    elif arch in ("granitemoe", "granitemoeshared"):  # Granite's scalars as "granite"'s; the shared expert 48 wide
        cls = GraniteMoeSharedConfig if arch == "granitemoeshared" else GraniteMoeConfig
        base.update(embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.09, logits_scaling=2.5,
                    intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
        if arch == "granitemoeshared":
            base.update(shared_intermediate_size=48)
    elif arch == "glm4_moe":  # layer 0 dense (first_k_dense_replace), layer 1 sparse: 8 experts in 2 groups, the top 2
        cls = Glm4MoeConfig  # from the best group, scaled; a shared expert; q/k norm and bias; a rotary half (default)
        base.update(head_dim=32, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                    topk_group=1, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                    use_qk_norm=True, attention_bias=True)
    elif arch in ("deepseek_v2", "deepseek_v3"):  # MLA: a 32 + 32 latent (C kernels' widths), 4 heads; layer 0
        from transformers import DeepseekV2Config, DeepseekV3Config  # dense, layer 1: 8 experts, a shared one
        cls = DeepseekV3Config if arch == "deepseek_v3" else DeepseekV2Config
        base.update(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=24,
                    moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                    first_k_dense_replace=1, routed_scaling_factor=2.5)
        if arch == "deepseek_v2":  # V-Lite's: no q_lora_rank, greedy softmax routing (not renormalised)
            base.update(q_lora_rank=None, topk_method="greedy")
        else:  # V3's noaux_tc routing in 2 groups, a q_lora_rank, YaRN with both mscales (scale and cos/sin)
            base.update(q_lora_rank=24, n_group=2, topk_group=1, max_position_embeddings=512, rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                "mscale": 0.9, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1})
    elif arch == "gpt_oss":  # a 16-token sliding layer, then a full one; 8 experts (top 2), q wider than hidden;
        from transformers import GptOssConfig  # YaRN as the released (factor 32, untruncated), 64 positions old
        base.update(head_dim=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                    num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=2048,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
        cls = GptOssConfig
    else:
        raise ValueError(arch)
    base.update(overrides)
    return cls(**base)


def make_model(root: Path, arch: str = "qwen3", seed: int = 0, dtype=torch.float32, **overrides) -> Path:
    """Save a tiny random HF model (and the test tokenizer) under root/arch-…; return the dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    name = f"{arch}-{seed}-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items())).replace(" ", "")
    out = Path(root) / name.replace("/", "_").replace("{", "").replace("}", "").replace(":", "")[:120]
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    config = hf_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # larger weights than the default init: sharper, more varied logits
        for p in model.parameters():
            if p.dim() >= 2:  # 3: transformers 5's stacks of experts
                p.normal_(0, 0.08)
        for name, b in model.named_buffers():  # GLM's router bias (a buffer, saved): not zero, so that it counts
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(_tokenizer_dir(str(root))).save_pretrained(out)
    return out


def greedy_tokens_and_logprobs(path: Path, prompts: list[list[int]], n_new: int, **kw
                               ) -> tuple[list[list[int]], list[list[float]]]:
    """nanoserve's greedy tokens for ``prompts`` (n_new each) and their logprobs: a small eager fp32 engine
    (``kw`` over it), shut down after."""
    from nanoserve import LLM, SamplingParams
    llm = LLM(str(path), **{"dtype": "float32", "enforce_eager": True, **kw}, num_kv_blocks=16, max_model_len=64,
              max_num_batched_tokens=16)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n_new, min_tokens=n_new, logprobs=0),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    return ([o.outputs[0].token_ids for o in outs],
            [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs])


def dequant_of(path: Path) -> Path:
    """Where a quantized test checkpoint's dequantized twin (its weights as the codes and scales say) lies."""
    return path.with_name(path.name + "-dequant")


def assert_loads_as_its_dequantized_twin(path: Path) -> None:
    """The quantized checkpoint at ``path`` loads (fp32, on the CPU) into exactly its twin's weights."""
    from nanoserve.model import load_model
    model, weight_bytes = load_model(path, torch.float32, torch.device("cpu"))
    ref, ref_bytes = load_model(dequant_of(path), torch.float32, torch.device("cpu"))
    assert weight_bytes == ref_bytes
    theirs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, theirs[name]), name


def edited_checkpoint(src: Path, out: Path, edit) -> Path:
    """A copy of checkpoint ``src`` at ``out`` whose tensors ``edit`` changed (in place on the dict): a broken
    checkpoint for a loader's refusals."""
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(model_root) -> Path:
    return make_model(model_root, "qwen3")


def hf_model(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **hf_attention(path)).eval()


def hf_attention(path: Path) -> dict:
    """Gemma 2's score soft cap is in transformers' eager attention only: 5.17 (the GPU image's) would
    pick SDPA, which drops the cap (5.25 refuses SDPA there and runs eager)."""
    config = json.loads((Path(path) / "config.json").read_text())
    return {"attn_implementation": "eager"} if config.get("attn_logit_softcapping") else {}


def hf_greedy_logprobs(path: Path, prompts: list[list[int]], n_new: int, hf=None
                       ) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens (exactly n_new each) for each prompt, and each token's logprob (``hf``: the
    model, where hf_model would not load it as the test needs)."""
    hf = hf_model(path) if hf is None else hf
    tokens, logprobs = [], []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new)
            new = out[0, len(p):]
            lp = hf(out).logits[0, len(p) - 1:-1].float().log_softmax(-1)
            tokens.append(new.tolist())
            logprobs.append(lp.gather(1, new[:, None]).squeeze(1).tolist())
    return tokens, logprobs


def step_logits(runner, seqs) -> torch.Tensor:
    """The logits of every token of one step (``SeqInput``s), in fp32 on the CPU:
    what the parity tests compare with transformers'."""
    with torch.inference_mode():
        input_ids, positions, meta = runner.prepare(seqs)
        hidden = runner.model(input_ids, positions, meta, runner.kv_caches)
        return runner.model.compute_logits(hidden).float().cpu()


async def run_request(async_llm, prompt, params, request_id: str) -> list:
    """One request through ``AsyncLLM`` as the server drives it (add_request with a
    queue, read to its last output): its RequestOutputs."""
    queue, outs = asyncio.Queue(), []
    async_llm.add_request(prompt, params, request_id, queue)
    while not (outs and outs[-1].finished):
        outs.append(await queue.get())
        if isinstance(outs[-1], BaseException):  # the engine ended it
            raise outs[-1]
    return outs
