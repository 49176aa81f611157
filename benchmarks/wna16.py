"""CPU decode speed of a 4-bit GPTQ model kept packed (the torch twin: kernels.wna16_matmul_torch) against the
same checkpoint dequantized at load, to choose wna16_weights="auto"'s CPU default (model.wna16_packed).

W0's shape (make_models.py), its linear weights quantized here to GPTQ int4, groups of 128, asymmetric, with
tests/test_wna16.py's quantizer. Both engines live in one process and take turns (A B A B, ``--rounds``): one
request each turn, ``--prompt`` random tokens then ``--tokens`` greedy ones; decode_tok_s is the tokens after
the first over the time from the first to the last. Medians printed, with each engine's weight bytes.

    PYTHONPATH=. python benchmarks/wna16.py --root /tmp/wna16-bench --rounds 5

gptq_checkpoint and random_packed are benchmarks/gpu.py's too (its wna16 part).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent / "tests")]


def gptq_checkpoint(src: Path, dst: Path) -> Path:
    """The model at src as a GPTQ int4 g128 asymmetric checkpoint at dst (embeddings, norms, head as they were)."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from test_wna16 import gptq_tensors, is_quantized_linear, quantize
    if (dst / "config.json").exists():
        return dst
    tensors = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not is_quantized_linear(name, w):
            tensors[name] = w
            continue
        codes, scale, zero = quantize(w.float(), 4, 128, False)
        tensors.update(gptq_tensors(name.removesuffix(".weight"), codes, scale.half(), zero, 4, True,
                                    torch.arange(w.shape[1]) // 128))
    shutil.copytree(src, dst, dirs_exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False,
                                     "desc_act": False, "checkpoint_format": "gptq"}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def random_packed(K: int, N: int, bits: int, group: int, act_order: bool, device, seed: int = 0):
    """(qweight, scales, zeros, g_idx, group_size) of a random weight in kernels' WNA16 layout (as
    tests/test_wna16_packed.py's packed_case), on ``device``."""
    import torch

    from test_wna16_packed import packed_case
    qweight, scales, zeros, g_idx, group_size, _ = packed_case(K, N, bits, group, False, act_order, seed=seed)
    return (qweight.to(device), scales.to(device), zeros.to(device), None if g_idx is None else g_idx.to(device),
            group_size)


def decode_tok_s(llm, prompt: list[int], tokens: int) -> float:
    from nanoserve import SamplingParams
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens),
                       use_tqdm=False)[0]
    m = out.metrics
    return (tokens - 1) / (m.last_token_time - m.first_token_time)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, default=Path("/tmp/wna16-bench"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    import torch

    from nanoserve import LLM
    from make_models import make
    path = gptq_checkpoint(make("w0", args.root), args.root / "w0-gptq-int4-g128")
    engines = {w: LLM(str(path), dtype=args.dtype, wna16_weights=w, max_model_len=256, num_kv_blocks=64)
               for w in ("dequantized", "packed")}
    prompt = torch.randint(1, 32000, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    for llm in engines.values():  # warm-up: compiles and first-touch out of the measurement
        decode_tok_s(llm, prompt, 8)
    runs: dict[str, list[float]] = {w: [] for w in engines}
    for r in range(args.rounds):
        for w, llm in engines.items():
            runs[w].append(decode_tok_s(llm, prompt, args.tokens))
            print(f"round {r} {w}: {runs[w][-1]:.1f} tok/s", flush=True)
    for w, llm in engines.items():
        print(f"{w}: median {statistics.median(runs[w]):.1f} decode tok/s over {args.rounds} rounds; "
              f"weights {llm.engine.weight_bytes / 2**20:.1f} MiB")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
