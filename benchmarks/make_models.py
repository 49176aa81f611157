"""Build the benchmark models: random weights in the shapes the workloads name,
saved as ordinary Hugging Face directories (bf16 safetensors) that every engine
loads. Deterministic (torch.manual_seed(0)); nothing is downloaded.

    python benchmarks/make_models.py            # -> benchmarks/models/{w0,w1,wmoe}
"""
from __future__ import annotations

import argparse
from pathlib import Path

SHAPES = {
    # Qwen3-0.6B's shape: the W1 / W2 headline workloads
    "w1": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
               head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
               max_position_embeddings=40960),
    # ~40M parameters: where per-step overhead, not arithmetic, decides
    "w0": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
               head_dim=64, intermediate_size=1536, vocab_size=32000, tie_word_embeddings=True,
               max_position_embeddings=4096),
    # w0's vocabulary and attention with Qwen3-MoE's sparse MLP in every layer: 16 experts of 384,
    # top-4 (renormalised, as Qwen3-30B-A3B): the CPU fused_moe's workload (WMOE)
    "wmoe": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=64, intermediate_size=1536, moe_intermediate_size=384, num_experts=16,
                 num_experts_per_tok=4, norm_topk_prob=True, vocab_size=32000, tie_word_embeddings=True,
                 max_position_embeddings=4096),
}
MOE = {"wmoe"}


def make(name: str, root: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    out = root / name
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    config = (Qwen3MoeConfig if name in MOE else Qwen3Config)(**SHAPES[name], rms_norm_eps=1e-6, rope_theta=1000000.0,
                         eos_token_id=0, bos_token_id=None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters -> {out}")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", default=list(SHAPES))
    ap.add_argument("--root", type=Path, default=Path(__file__).parent / "models")
    args = ap.parse_args()
    for n in args.names:
        make(n, args.root)
