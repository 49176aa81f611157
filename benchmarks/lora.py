"""What a LoRA adapter costs: a workload with every request on a random rank-R adapter of every
q/k/v/o/gate/up/down layer (PEFT's layout, written here), against the same workload on the base
model, in one process, alternating (A B A B ...). Medians and their ratio.

    python benchmarks/lora.py --workload W0 --rank 16 --repeat 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import workloads  # noqa: E402

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(model_dir: Path, out: Path, rank: int) -> Path:
    """A random adapter of the model's shapes (B random too: PEFT's zero B would change nothing)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    gen, tensors = torch.Generator().manual_seed(0), {}
    for i in range(cfg["num_hidden_layers"]):
        for name, part in TARGETS.items():
            n_in, n_out = shapes[name]
            key = f"base_model.model.model.layers.{i}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen) * 0.01).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(n_out, rank, generator=gen) * 0.01).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": list(TARGETS), "bias": "none"}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="W0")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each (A B alternating)")
    ap.add_argument("--models", type=Path, default=HERE / "models")
    args = ap.parse_args()
    from nanoserve import LLM, LoRARequest, SamplingParams
    w = workloads.get(args.workload)
    model = args.models / w.model
    adapter = write_adapter(model, Path(tempfile.mkdtemp()) / "adapter", args.rank)
    llm = LLM(str(model), skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 30, enable_lora=True,
              enable_prefix_caching=False,  # each run computes its prompts, as the first one did
              max_lora_rank=args.rank)
    lora = LoRARequest("bench", 1, str(adapter))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in w.output_lens]
    llm.generate([w.prompts[0][:16]], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=lora)  # warm
    times: dict[str, list[float]] = {"base": [], "lora": []}
    for _ in range(args.repeat):
        for name in times:
            t = time.perf_counter()
            llm.generate(w.prompts, params, use_tqdm=False, lora_request=lora if name == "lora" else None)
            times[name].append(time.perf_counter() - t)
            print(f"{name}: {times[name][-1]:.2f} s", flush=True)
    base, with_lora = statistics.median(times["base"]), statistics.median(times["lora"])
    print("RESULT " + json.dumps(dict(workload=args.workload, rank=args.rank, backend=llm.engine.backend.name,
                                      base_s=times["base"], lora_s=times["lora"], base_median=round(base, 2),
                                      lora_median=round(with_lora, 2), ratio=round(with_lora / base, 3))))


if __name__ == "__main__":
    main()
