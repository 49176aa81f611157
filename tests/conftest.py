"""Shared test fixtures: tiny random models of every supported architecture,
built from transformers' config classes and saved with save_pretrained, plus a
byte-level BPE tokenizer trained here. Nothing is downloaded."""
from __future__ import annotations

import functools
import os

# The Triton interpreter is chosen when triton is first imported: set it before any test imports nanoserve.
os.environ.setdefault("TRITON_INTERPRET", "1")
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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


ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def hf_config(arch: str, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
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
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(_tokenizer_dir(str(root))).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(model_root) -> Path:
    return make_model(model_root, "qwen3")


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
