"""Mistral 3's text (Mistral3ForConditionalGeneration, its vision tower not loaded) and GLM-4 dense
(Glm4ForCausalLM: a norm after each branch, a rotary half turned in pairs, gate/up stored fused), as
vLLM serves them: greedy tokens and logprobs equal transformers' in fp32 under chunked prefill, prefix
caching and preemption, GLM-4 under TP=2 too; a bf16 smoke run; the configs nanoserve cannot serve
refused by name. Tiny random models, transformers the oracle, nothing downloaded."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import VOCAB, hf_greedy_logprobs, make_model
from nanoserve import LLM, SamplingParams
from nanoserve.model import ModelConfig, ModelLoadError

_rng = torch.Generator().manual_seed(31)
# the last two share a 24-token prefix: the second reads it from the prefix cache
_SHARED = torch.randint(1, VOCAB, (24,), generator=_rng).tolist()
PROMPTS = [torch.randint(1, VOCAB, (n,), generator=_rng).tolist() for n in (1, 9, 37)] + \
    [_SHARED + [5, 6, 7], _SHARED + [8]]
N_NEW = 12
# 8 blocks of 16 tokens for five requests of up to 49: some are preempted; 16-token steps chunk the prefills
SMALL = dict(dtype="float32", enforce_eager=True, num_kv_blocks=8, max_model_len=64, max_num_batched_tokens=16,
             max_num_seqs=5)
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
            eos_token_id=0, bos_token_id=None, pad_token_id=None)


def _randomize(model: torch.nn.Module) -> None:
    """Weights larger than the default init, and norms and biases not ones and zeros (which would hide one
    loaded wrong or not at all)."""
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            else:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if name.endswith("bias") else 1.0))


def _save(model: torch.nn.Module, out: Path, model_root: Path) -> Path:
    model.save_pretrained(out)
    tokenizer = make_model(model_root, "llama")
    for f in tokenizer.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def glm4_model(model_root: Path) -> Path:
    """GLM-4-0414's shape: Glm4Config's defaults (q/k/v bias, partial_rotary_factor 0.5) left to it."""
    from transformers import Glm4Config, Glm4ForCausalLM
    out = Path(model_root) / "glm4-dense"
    if not (out / "config.json").exists():
        torch.manual_seed(0)
        model = Glm4ForCausalLM(Glm4Config(**BASE, head_dim=64))  # a rotary half of 32: the C rotary's least
        _randomize(model)
        _save(model, out, model_root)
    return out


def mistral3_model(model_root: Path, layout: str = "v4") -> Path:
    """Mistral 3 with a small Pixtral tower and projector (not loaded). transformers 5.25 saves the v4 layout
    (language_model.model.*, language_model.lm_head.*); "v5" renames it to 5's (model.language_model.*,
    lm_head.*), as checkpoints saved by transformers 4.52 and later hold it."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig
    out = Path(model_root) / f"mistral3-{layout}"
    if (out / "config.json").exists():
        return out
    if layout == "v5":
        from safetensors.torch import load_file, save_file
        shutil.copytree(mistral3_model(model_root), out)
        def v5_name(k: str) -> str:
            if k.startswith("language_model.model."):
                return "model.language_model." + k[len("language_model.model."):]
            return k.removeprefix("language_model.")  # the head: lm_head.weight
        renamed = {v5_name(k): v for k, v in load_file(str(out / "model.safetensors")).items()}
        assert "lm_head.weight" in renamed and "model.language_model.norm.weight" in renamed
        save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    torch.manual_seed(0)
    text = MistralConfig(**BASE, head_dim=32, sliding_window=None, rope_theta=1e6)
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=32, patch_size=8, head_dim=16)
    model = Mistral3ForConditionalGeneration(Mistral3Config(text_config=text.to_dict(),
                                                            vision_config=vision.to_dict(), tie_word_embeddings=False))
    _randomize(model)
    return _save(model, out, model_root)


def hf_reference(path: Path, prompts: list[list[int]], n_new: int, dtype=torch.float32):
    """transformers' greedy tokens (exactly n_new each) and their logprobs, Mistral 3 through its own class."""
    from transformers import AutoModelForCausalLM, Mistral3ForConditionalGeneration
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    cls = Mistral3ForConditionalGeneration if arch == "Mistral3ForConditionalGeneration" else AutoModelForCausalLM
    return hf_greedy_logprobs(path, prompts, n_new, cls.from_pretrained(path, dtype=dtype).eval())


def generate(path: Path, prompts=PROMPTS, n_new=N_NEW, **kw):
    llm = LLM(str(path), **{**SMALL, **kw})
    try:
        params = SamplingParams(temperature=0, max_tokens=n_new, min_tokens=n_new, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = {**llm.stats(), "backend": llm.engine.backend.name,
                 "num_cached_tokens": [o.num_cached_tokens for o in outs]}
    finally:
        llm.shutdown()
    return ([o.outputs[0].token_ids for o in outs],
            [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs], stats)


def _assert_matches_hf(path: Path, **kw) -> dict:
    tokens, logprobs, stats = generate(path, **kw)
    ref, ref_logprobs = hf_reference(path, PROMPTS, N_NEW)
    assert tokens == ref
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=1e-4)
    assert stats["num_preemptions"] > 0  # recomputed after preemption, and still the same tokens
    assert stats["num_cached_tokens"][-1] >= 16  # the last prompt read its shared block from the prefix cache
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return stats


@pytest.mark.parametrize("layout", ["v4", "v5"])
def test_mistral3_text_matches_transformers(model_root, layout):
    path = mistral3_model(model_root, layout)
    cfg = ModelConfig.from_dir(path)
    assert (cfg.architecture, cfg.head_dim, cfg.rope_theta, cfg.tie_word_embeddings) == \
        ("Mistral3ForConditionalGeneration", 32, 1e6, False)
    _assert_matches_hf(path)


def test_glm4_matches_transformers(model_root):
    path = glm4_model(model_root)
    cfg = ModelConfig.from_dir(path)
    assert (cfg.rotary_dim, cfg.rope_interleave, cfg.attention_bias) == (32, True, True)
    _assert_matches_hf(path)


def test_glm4_tp2_matches_transformers(model_root):
    """Each rank's heads turn their pairs, and slices the checkpoint's fused gate_up_proj."""
    path = glm4_model(model_root)
    tokens, logprobs, _ = generate(path, tensor_parallel_size=2)
    ref, ref_logprobs = hf_reference(path, PROMPTS, N_NEW)
    assert tokens == ref
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("which", ["mistral3", "glm4"])
def test_bf16_smoke(model_root, which):
    """bf16 with the CPU backend's kernels (not --enforce-eager: the C attention, norm and rotary where they
    build): the first greedy token of each prompt is transformers' fp32 one, its logprob near."""
    path = mistral3_model(model_root) if which == "mistral3" else glm4_model(model_root)
    prompts = PROMPTS[1:3]
    tokens, logprobs, stats = generate(path, prompts, n_new=1, dtype="bfloat16", enforce_eager=False)
    assert "attention: c," in stats["backend"] and "elementwise ops: c," in stats["backend"]
    ref, ref_logprobs = hf_reference(path, prompts, 1)
    assert tokens == ref
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=0.1, rtol=0.05)


def _mistral3_config(**text) -> dict:
    return {"architectures": ["Mistral3ForConditionalGeneration"], "eos_token_id": 2,
            "text_config": {"model_type": "mistral", "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 100,
                            "intermediate_size": 128, "num_attention_heads": 4, **text}}


@pytest.mark.parametrize("text,message", [
    ({"model_type": "ministral3", "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "rope_theta": 1e6,
                                                      "original_max_position_embeddings": 16384,
                                                      "llama_4_scaling_beta": 0.1}}, "llama_4_scaling"),
    ({"model_type": "qwen3"}, "'qwen3' text_config is not supported"),
], ids=["ministral3-llama4-scaling", "other-decoder"])
def test_mistral3_text_configs_nanoserve_cannot_serve_are_refused(text, message):
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dict(_mistral3_config(**text))


def test_mistral3_config_read_from_its_text_config():
    """The top level's ids; the head untied unless a level says tied; every layer windowed (Mistral's)."""
    cfg = ModelConfig.from_dict(_mistral3_config(sliding_window=32))
    assert (cfg.num_layers, cfg.eos_token_ids, cfg.tie_word_embeddings, cfg.sliding_layers) == (2, [2], False, (0, 1))
    assert ModelConfig.from_dict({**_mistral3_config(), "tie_word_embeddings": True}).tie_word_embeddings
    assert ModelConfig.from_dict(_mistral3_config(model_type="llama", sliding_window=32)).sliding_window is None


@pytest.mark.skipif(not __import__("test_kernels").TRITON_RUNNABLE, reason="the Triton kernels cannot run here")
def test_glm4_on_the_triton_backend_matches_the_references(model_root):
    """GLM-4's forward (a prefill, then a decode of each prompt) with every op from kernels.TRITON gives
    kernels.TORCH's logits (fp32; the interpreter on the CPU): the reordered rotary half through the Triton
    rotary, the extra norms through its rms_norm."""
    from conftest import step_logits
    from nanoserve import kernels
    from nanoserve.kvcache import KVCacheSpec, allocate_kv_cache
    from nanoserve.model import ModelRunner, SeqInput, load_model
    from test_kernels import DEVICE
    path = glm4_model(model_root)
    cfg = ModelConfig.from_dir(path)
    prompts = [PROMPTS[1], PROMPTS[4]]  # 9 and 25 tokens: two 16-token blocks each
    logits = []
    for backend in (kernels.TORCH, kernels.TRITON):
        model, _ = load_model(path, torch.float32, torch.device(DEVICE), backend)
        spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, 16, False)
        runner = ModelRunner(model, allocate_kv_cache(spec, 8, torch.device(DEVICE)), 16, torch.device(DEVICE),
                             backend)
        tables = [[1, 2], [3, 4]]
        logits.append([step_logits(runner, step) for step in (
            [SeqInput(p, 0, t, None) for p, t in zip(prompts, tables)],
            [SeqInput([7], len(p), t, None) for p, t in zip(prompts, tables)])])
    for a, b in zip(*logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
