"""A sliding-window prefill on the CPU: the torch reference's attention (what a step with
prefill chunks and a window ran before the C chunk kernel had one) against the C kernels,
side by side, A B A B in one process, medians.

    python benchmarks/window_prefill.py                  # one layer's attention (the default)
    python benchmarks/window_prefill.py --model          # a whole Mistral-shaped model's prefill

--layer (default): Mistral-7B's attention shape (32 query heads on 8 kv heads, head_dim 128),
bf16, a 2,048-token prompt prefilled in chunks of 512 with a 512-token window: one run is the
four chunks' attention calls, each over a cache whose blocks wholly before its chunk's first
window are the null block (as the block manager leaves them; NaN here, so a kernel that read
one would say so).

--model: a small Mistral-shaped model (bf16, random weights, hidden 1024 in 8 heads of 128 on 2
kv heads, 4 layers, every layer windowed) prefilling
the same prompt through LLM.generate (max_tokens=1, max_num_batched_tokens=512): the whole
forward, so the attention's share of a step shows. A swaps the C attention for the old
dispatch (the torch reference on a step with chunks where the window masks a key).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from nanoserve import cpu_kernels, kernels


def layer_steps(args):
    """The chunk steps of one prompt through one layer: [(query, k, v, table, seq_lens, qsl)]."""
    torch.manual_seed(0)
    bs, n, hq, hk, d = args.block_size, args.tokens, args.heads, args.kv_heads, args.head_dim
    nb = -(-n // bs)
    k = torch.randn(nb + 1, bs, hk, d).bfloat16()
    v = torch.randn(nb + 1, bs, hk, d).bfloat16()
    k[0] = v[0] = float("nan")  # the null block
    steps = []
    for start in range(0, n, args.chunk):
        q_len = min(args.chunk, n - start)
        end = start + q_len
        table = torch.arange(1, nb + 1, dtype=torch.int32)[None, :]
        table[0, :max(start - args.window + 1, 0) // bs] = 0  # freed: wholly before the chunk's first window
        table[0, -(-end // bs):] = 0
        steps.append((torch.randn(q_len, hq, d).bfloat16(), k, v, table, torch.tensor([end], dtype=torch.int32),
                      torch.tensor([0, q_len], dtype=torch.int32)))
    return steps


def run_layer(args):
    steps = layer_steps(args)
    scale = args.head_dim ** -0.5
    impls = {"A torch": kernels.paged_attention_torch, "B C": cpu_kernels.paged_attention}
    for s in steps:  # agree (and build the C library) before timing
        want = kernels.paged_attention_torch(*s, scale, args.window)
        got = cpu_kernels.paged_attention(*s, scale, args.window)
        assert not got.isnan().any()
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)

    def once(fn):
        t0 = time.perf_counter()
        for s in steps:
            fn(*s, scale, args.window)
        return time.perf_counter() - t0
    return alternate(impls, once, args.repeat)


def run_model(args, root: Path):
    from transformers import AutoModelForCausalLM, MistralConfig

    from nanoserve import LLM, SamplingParams
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                           num_hidden_layers=args.layers, num_attention_heads=args.heads,
                           num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                           max_position_embeddings=4 * args.tokens, sliding_window=args.window,
                           rms_norm_eps=1e-5, eos_token_id=0, bos_token_id=None)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(root)
    llm = LLM(str(root), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=2 * args.tokens,
              max_num_batched_tokens=args.chunk, block_size=args.block_size, enable_prefix_caching=False)
    attns = [layer.self_attn for layer in llm.engine.runner.model.model.layers]
    backend = attns[0].backend
    assert backend.paged_attention is cpu_kernels.paged_attention, backend.name

    def old_dispatch(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window=None):
        if cpu_kernels.window_masks(seq_lens, sliding_window) and not cpu_kernels.is_decode_only(query_start_loc):
            return kernels.paged_attention_torch(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                                 scale, sliding_window)
        return cpu_kernels.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                           scale, sliding_window)
    backends = {"A torch": dataclasses.replace(backend, paged_attention=old_dispatch), "B C": backend}
    ids = torch.randint(1, 32000, (args.tokens,), generator=torch.Generator().manual_seed(1))
    prompt = {"prompt_token_ids": ids.tolist()}
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def once(b):
        for a in attns:
            a.backend = b
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 1
        return time.perf_counter() - t0
    once(backends["B C"])  # warm: builds and loads every library
    return alternate(backends, once, args.repeat)


def alternate(impls: dict, once, repeat: int) -> dict:
    """A B A B ..., repeat rounds; the medians, in ms, and B / A."""
    times = {name: [] for name in impls}
    for _ in range(repeat):
        for name, impl in impls.items():
            times[name].append(once(impl) * 1e3)
    (a, ta), (b, tb) = times.items()
    ma, mb = statistics.median(ta), statistics.median(tb)
    return {f"{a} ms": round(ma, 2), f"{b} ms": round(mb, 2), "B/A": round(mb / ma, 4),
            "runs": {k: [round(t, 1) for t in v] for k, v in times.items()}}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="store_true", help="a whole model's prefill, not one layer's attention")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--heads", type=int, help="query heads (default: 32, Mistral-7B's; --model: hidden / head_dim)")
    p.add_argument("--kv-heads", type=int, help="kv heads (default: heads / 4, Mistral-7B's ratio)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=1024, help="--model: hidden size (intermediate: 3x)")
    p.add_argument("--layers", type=int, default=4, help="--model: decoder layers")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    args.heads = args.heads or (args.hidden // args.head_dim if args.model else 32)
    args.kv_heads = args.kv_heads or max(args.heads // 4, 1)
    torch.set_num_threads(args.threads)
    if args.model:
        with tempfile.TemporaryDirectory(prefix="window_prefill_") as tmp:
            res = run_model(args, Path(tmp))
    else:
        res = run_layer(args)
    print(json.dumps({"what": "model" if args.model else "layer", **{k: v for k, v in vars(args).items()
                                                                       if k != "model"}, **res}))


if __name__ == "__main__":
    main()
