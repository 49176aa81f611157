"""W1 on a CUDA machine in one process (benchmarks/gpu_w1_ab.sh runs the variants).
argv: KV blocks (0 = 0.9 of the GPU), split-KV rule (new | old = the first guess), model dir."""
import sys, time, json
from pathlib import Path
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import torch
from nanoserve import LLM, SamplingParams, kernels
import workloads
blocks, rule, model = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if rule == "old":
    def old(all_decodes, num_seqs, num_kv_heads, max_context):
        if not all_decodes or num_seqs * num_kv_heads >= 512:
            return 1
        return max(1, min(16, max_context // 512))
    kernels._num_kv_splits = old
w = workloads.get("W1")
kw = dict(num_kv_blocks=blocks) if blocks else {}
llm = LLM(model, dtype="bfloat16", device="cuda", skip_tokenizer_init=True, **kw)
llm.generate([w.prompts[0][:16]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in w.output_lens]
torch.cuda.synchronize(); t = time.perf_counter()
outs = llm.generate(w.prompts, params, use_tqdm=False)
wall = time.perf_counter() - t
print(json.dumps(dict(blocks=llm.engine.kv_plan.num_blocks, rule=rule, wall=round(wall, 2),
      digest=hash(tuple(tuple(o.outputs[0].token_ids) for o in outs)) & 0xffffffff)), flush=True)
