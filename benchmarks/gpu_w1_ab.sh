#!/usr/bin/env bash
# W1 on a CUDA machine, one run per fresh process, 2 rounds of 3 variants:
# KV blocks fixed at 31793 or 0.9 of the GPU, the tuned or the first-guess split-KV rule.
# Prints one JSON line per run (benchmarks/RESULTS.md, "Triton kernels on an H200").
export PYTHONUNBUFFERED=1
python3 -c "
import sys; sys.path.insert(0, 'benchmarks'); sys.path.insert(0, '.')
import torch; from pathlib import Path
from triton_gpu import save_random_qwen3; from make_models import SHAPES
save_random_qwen3(Path('/tmp/w1'), torch.bfloat16, **SHAPES['w1'])" >/dev/null 2>&1 || exit 1
for r in 1 2; do for v in "31793 new" "0 new" "31793 old"; do
  python3 benchmarks/gpu_w1_ab.py $v /tmp/w1 2>&1 | grep -v -i warn | tail -2
done; done
