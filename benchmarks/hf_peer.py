"""transformers' continuous batching as a benchmark peer (runs in .peers/hf).

The recipe PEERS.md records for transformers 5.24: ``init_continuous_batching``
with an explicit paged cache (on the CPU it would otherwise size itself at 60%
of RAM), one ``add_request`` per prompt with its own ``max_new_tokens``, and
``eos_token_id=-1`` so that no request stops early (ignore_eos).
"""
from __future__ import annotations

import time


def generate_batch(w, model_dir: str, extra: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    cfg = model.config
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    num_blocks = int(extra.get("kv_gib", 4) * 2**30 // (16 * kv_bytes_per_token))
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(w.output_lens))
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=num_blocks, max_batch_tokens=2048,
                                  auto_switch_to_flash=False, use_cuda_graph=False)
    mgr = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    mgr.start()
    try:
        _run(mgr, [w.prompts[0][:16]], [2])  # warm-up
        startup = time.perf_counter() - t0
        t = time.perf_counter()
        outs = _run(mgr, w.prompts, w.output_lens)
        wall = time.perf_counter() - t
    finally:
        mgr.stop(block=True)
    from throughput import _digest
    return dict(wall=wall, startup=startup, tokens=_digest(outs), num_out=sum(map(len, outs)),
                settings=dict(num_blocks=num_blocks, page_size=16, max_batch_tokens=2048,
                              attn=cfg._attn_implementation, torch_compile=False))


def _run(mgr, prompts, lens) -> list[list[int]]:
    for i, (p, n) in enumerate(zip(prompts, lens)):
        mgr.add_request(p, request_id=f"r{i}", max_new_tokens=n)
    results: dict[str, list[int]] = {}
    while len(results) < len(prompts):
        r = mgr.get_result(timeout=1)
        if r is not None and r.is_finished():
            results[r.request_id] = list(r.generated_tokens)
    return [results[f"r{i}"] for i in range(len(prompts))]
