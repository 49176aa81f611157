"""SmolLM3 and OLMo 2 / 3 against transformers (fp32 greedy tokens and logprobs): SmolLM3's NoPE
layers (no rotary where no_rope_layers says 0), OLMo's norms after attention and the MLP with q/k norms
over all heads, OLMo 3's sliding layers with a rotary base of their own. The engine runs them with
chunked prefill and preemption (a 16-token step budget, few KV blocks), then again over its prefix
cache; OLMo 3 also over two tensor-parallel ranks (its q/k norms' mean square all-reduced); SmolLM3 and OLMo 3
on the Triton kernels (the interpreter) and SmolLM3 in bf16 on the CPU's fast paths. Their own
tiny models (not conftest's ARCHS, which every all-architecture test runs)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import VOCAB, _tokenizer_dir, hf_greedy_logprobs, hf_model, step_logits
from nanoserve import LLM, SamplingParams, kernels
from nanoserve.engine import ModelRunner
from nanoserve.kvcache import KVCacheSpec, allocate_kv_cache
from nanoserve.model import ModelConfig, ModelLoadError, SeqInput, _sliding_window, load_model
from test_kernels import triton_only

_rng = torch.Generator().manual_seed(31)
PROMPTS = [torch.randint(1, VOCAB, (n,), generator=_rng).tolist() for n in (1, 9, 23, 40)]
N_NEW = 12
# 7 blocks of 16 tokens for four requests of up to 52 (10 blocks together): some are preempted; a step's
# 16 tokens chunk the longer prompts
SMALL = dict(dtype="float32", enforce_eager=True, num_kv_blocks=7, max_model_len=64, max_num_batched_tokens=16,
             max_num_seqs=4)
# hidden 128 over 4 heads: head_dim 32, which the CPU's C attention takes (the bf16 run's fast path)
BASE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
            eos_token_id=0, bos_token_id=None, pad_token_id=None)


def hf_config(arch: str):
    from transformers import Olmo2Config, Olmo3Config, SmolLM3Config
    if arch == "smollm3":  # layer 0 rotates, layer 1 is NoPE; the embeddings tied, as SmolLM3-3B's
        return SmolLM3Config(**{**BASE, "tie_word_embeddings": True}, no_rope_layer_interval=2)
    if arch == "olmo2":  # k's norm 64 wide (2 KV heads), q's 128
        return Olmo2Config(**BASE)
    # OLMo 3: an 8-token sliding layer (the longer prompts pass it) at a base of its own, then a full one
    return Olmo3Config(**BASE, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                       rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})


def make(root: Path, arch: str) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = root / f"own-{arch}"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32)
    with torch.no_grad():  # sharper logits than the default init; norm weights away from 1, so they count
        for p in model.parameters():
            p.normal_(0, 0.08) if p.dim() >= 2 else p.copy_(torch.randn_like(p) * 0.3 + 1.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(_tokenizer_dir(str(root))).save_pretrained(out)
    return out


def generate(llm: LLM) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=N_NEW, min_tokens=N_NEW, logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs])


@pytest.mark.parametrize("arch", ["smollm3", "olmo2", "olmo3"])
def test_greedy_tokens_and_logprobs_match_transformers(model_root, arch):
    path = make(model_root, arch)
    ref, ref_logprobs = hf_greedy_logprobs(path, PROMPTS, N_NEW)
    llm = LLM(str(path), **SMALL)
    try:
        runs = [generate(llm), generate(llm)]  # the second over the first's cached prefixes
        stats = llm.stats()
    finally:
        llm.shutdown()
    for tokens, logprobs in runs:
        assert tokens == ref
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=1e-4)
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0


def test_olmo3_tp2_matches_transformers(model_root):
    path = make(model_root, "olmo3")
    ref, ref_logprobs = hf_greedy_logprobs(path, PROMPTS, N_NEW)
    llm = LLM(str(path), **SMALL, tensor_parallel_size=2)
    try:
        tokens, logprobs = generate(llm)
    finally:
        llm.shutdown()
    assert tokens == ref
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=1e-4)


@triton_only
@pytest.mark.parametrize("arch", ["smollm3", "olmo3"])
def test_triton_kernels_through_the_whole_model(model_root, arch):
    """The model on the Triton backend (the interpreter, fp32): SmolLM3's NoPE layer skips the rotary launch,
    OLMo 3's sliding layer rotates with its own tables and attends within its window; a prompt in two chunks,
    the second over the first's KV cache, gives transformers' logits."""
    path = make(model_root, arch)
    cfg = ModelConfig.from_dir(path)
    model, _ = load_model(path, torch.float32, torch.device("cpu"), kernels.TRITON)
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, 16)
    runner = ModelRunner(model, allocate_kv_cache(spec, 4, torch.device("cpu")), 16, torch.device("cpu"),
                         kernels.TRITON)
    prompt, table = PROMPTS[3][:30], [1, 2]
    got = torch.cat([step_logits(runner, [SeqInput(prompt[:20], 0, table, None)]),
                     step_logits(runner, [SeqInput(prompt[20:], 20, table, None)])])
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_bf16_on_the_cpu_fast_paths_follows_fp32(model_root):
    """bf16, not eager: the C attention (head_dim 32) and the C or compiled norms and rotary; each prompt's
    first token as fp32 transformers picks it, its logprob close."""
    from test_cpu_backend import _c_or_skip
    from nanoserve import cpu_kernels
    _c_or_skip(group=2, head_dim=32)
    path = make(model_root, "smollm3")
    ref, ref_logprobs = hf_greedy_logprobs(path, PROMPTS, 1)
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=12, max_model_len=64)
    try:
        assert llm.engine.backend.paged_attention is cpu_kernels.paged_attention
        assert llm.engine.backend.rotary is cpu_kernels.rotary  # layer 0's; layer 1 (NoPE) launches none
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, logprobs=0), use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == ref
    got = [o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob for o in outs]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_logprobs).squeeze(1), atol=0.05, rtol=0.05)


# ---------------------------------------------------------------- config.json as transformers reads it

def _config(arch: str, **kw) -> ModelConfig:
    return ModelConfig.from_dict({"architectures": [arch], **{k: v for k, v in BASE.items() if v is not None},
                                  "num_hidden_layers": 8, **kw})


def test_smollm3_nope_layers_and_windows():
    assert _config("SmolLM3ForCausalLM").nope_layers == (3, 7)  # every 4th by default
    assert _config("SmolLM3ForCausalLM", no_rope_layer_interval=3).nope_layers == (2, 5)
    assert _config("SmolLM3ForCausalLM", no_rope_layers=[1, 0] * 4).nope_layers == (1, 3, 5, 7)
    c = {"architectures": ["SmolLM3ForCausalLM"], "num_hidden_layers": 8, "sliding_window": 16}
    assert _sliding_window("SmolLM3ForCausalLM", c) == (None, ())  # use_sliding_window off
    assert _sliding_window("SmolLM3ForCausalLM", {**c, "use_sliding_window": True}) == (16, (3, 7))  # the NoPE ones
    with pytest.raises(ModelLoadError, match="no_rope_layers needs a 0 or 1 for each of its 8 layers"):
        _config("SmolLM3ForCausalLM", no_rope_layers=[1, 0])


def test_olmo3_layers_and_rotaries_from_both_config_forms():
    cfg = _config("Olmo3ForCausalLM")  # Olmo3Config's defaults: a 4096 window, every 4th layer full
    assert (cfg.sliding_window, cfg.sliding_layers) == (4096, (0, 1, 2, 4, 5, 6)) and cfg.qk_norm_whole
    assert not _config("Olmo3ForCausalLM", sliding_window=None).sliding_layers
    assert not _config("Olmo2ForCausalLM", sliding_window=4096).sliding_layers
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192}
    legacy = _config("Olmo3ForCausalLM", sliding_window=4096, rope_theta=10000.0, rope_scaling=yarn)
    assert legacy.rope_scaling["rope_type"] == "yarn" and legacy.rope_theta == 10000.0
    assert legacy.sliding_rope == (500000.0, None)  # transformers 5.25's reading: its default_theta, unscaled


@pytest.mark.parametrize("arch", ["SmolLM3ForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM"])
def test_attention_bias_is_refused(arch):
    with pytest.raises(ModelLoadError, match=f"{arch} with attention_bias is not supported"):
        _config(arch, attention_bias=True)
