"""llama.cpp (through llama-cpp-python's low-level API) as a benchmark peer.

Runs in benchmarks/.peers/llamacpp (see setup_peers.sh and PEERS.md). Two jobs:

* ``--make-gguf``: convert benchmarks/models/<w0|w1> to <w0|w1>.gguf in bf16
  with llama.cpp's own ``convert_hf_to_gguf.py`` (the one vendored in the
  llama-cpp-python sdist). The benchmark models have no tokenizer files and
  the converter needs one, so a temporary copy of the model dir (symlinks)
  gets a SentencePiece ``tokenizer.model`` of exactly ``vocab_size`` pieces
  (piece ``w<i>`` is id ``i``). The workloads feed token ids, so the
  vocabulary's text never matters; only its size does.

      python benchmarks/llamacpp_peer.py --make-gguf --models benchmarks/models w0 w1

  (any python: it re-runs itself in the llamacpp venv).

* ``generate_batch`` / ``single_stream``: what throughput.py and
  single_stream.py call in a fresh process. All of a workload's requests go
  into one ``llama_decode`` loop the way llama-server's slots do it: each
  step puts one token for every sequence that is generating into a
  ``llama_batch``, then fills the rest of the batch (``n_batch`` 2048, the
  server's default) with prompt chunks of the sequences still in prefill.
  One sequence id per request, a per-sequence KV stream (``kv_unified``
  false, as ``llama-server --parallel N`` without ``--kv-unified``), greedy
  argmax over each output row, no EOS check (ignore_eos), and a finished
  request's cells are freed at once.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV = HERE / ".peers" / "llamacpp"
LLAMACPP_VERSION = "0.3.36"
CONVERTER = VENV / "src" / f"llama_cpp_python-{LLAMACPP_VERSION}" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"

N_BATCH = 2048   # llama-server's defaults: logical batch 2048, physical 512
N_UBATCH = 512


def gguf_path(models: Path, model: str, outtype: str = "bf16") -> Path:
    """<models>/w1.gguf for the bf16 GGUF the benchmarks use; w1-f32.gguf etc. for others."""
    return Path(models) / (f"{model}.gguf" if outtype == "bf16" else f"{model}-{outtype}.gguf")


# ============================================================================ GGUF

def write_sentencepiece_vocab(path: Path, vocab_size: int) -> None:
    """A SentencePiece model of ``vocab_size`` pieces: ``<unk>`` at 0, ``w<i>``
    at id i. Only for the converter; nothing is ever tokenized with it."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.UNIGRAM
    m.trainer_spec.vocab_size = vocab_size
    m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id, m.trainer_spec.pad_id = 0, -1, -1, -1
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    for i in range(vocab_size):
        p = m.pieces.add()
        p.piece, p.score = ("<unk>" if i == 0 else f"w{i}"), 0.0
        p.type = pb.ModelProto.SentencePiece.UNKNOWN if i == 0 else pb.ModelProto.SentencePiece.NORMAL
    path.write_bytes(m.SerializeToString())


def make_gguf(model_dir: Path, out: Path, outtype: str = "bf16") -> None:
    """Why SentencePiece and not a tokenizers WordLevel ``tokenizer.json``: for
    Qwen2/Qwen3 the converter tries ``tokenizer.model`` first; a
    ``tokenizer.json`` goes down its BPE path, which hashes how the tokenizer
    splits a fixed text and refuses any tokenizer it does not know
    ("BPE pre-tokenizer was not recognized")."""
    import json
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    with tempfile.TemporaryDirectory(prefix="gguf-src-") as tmp:
        tmp = Path(tmp)
        for f in model_dir.iterdir():
            (tmp / f.name).symlink_to(f.resolve())
        write_sentencepiece_vocab(tmp / "tokenizer.model", vocab)
        part = out.with_suffix(".gguf.part")
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        t = time.perf_counter()
        subprocess.run([sys.executable, str(CONVERTER), str(tmp), "--outtype", outtype, "--outfile", str(part)],
                       check=True, env=env)
        part.rename(out)
        print(f"[llamacpp_peer] {out} ({out.stat().st_size / 2**30:.2f} GiB, {time.perf_counter() - t:.0f} s)")


# ============================================================================ running

class Engine:
    """A llama.cpp model and context sized for ``n_seq`` sequences of up to
    ``seq_ctx`` tokens each, in per-sequence KV streams."""

    def __init__(self, path: str, n_seq: int, seq_ctx: int, threads: int = 2, unified: bool = False):
        import llama_cpp as L
        self.L = L
        L.llama_log_set(_quiet_log, None)  # llama.cpp logs every tensor otherwise
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        seq_ctx = -(-seq_ctx // 256) * 256
        cp.n_ctx, cp.n_seq_max = n_seq * seq_ctx, n_seq
        cp.n_batch, cp.n_ubatch = N_BATCH, N_UBATCH
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = unified
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the context")
        self.mem = L.llama_get_memory(self.ctx)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(N_BATCH, 0, 1)
        self.settings = dict(n_ctx=L.llama_n_ctx(self.ctx), n_seq_max=n_seq, seq_ctx=seq_ctx,
                             n_batch=N_BATCH, n_ubatch=N_UBATCH, threads=threads, kv_unified=unified,
                             flash_attn=L.llama_flash_attn_type_name(cp.flash_attn_type).decode(),
                             kv_type="f16 (default)", sampling="numpy argmax of the logits")

    def generate(self, prompts: list[list[int]], lens: list[int], times: list | None = None) -> list[list[int]]:
        """Greedy, ignore_eos; request i gets exactly ``lens[i]`` tokens. With
        ``times``, the perf_counter of every step that produced tokens is
        appended (single_stream.py reads prefill and decode time from it)."""
        import numpy as np
        L, b = self.L, self.batch
        token = np.ctypeslib.as_array(b.token, shape=(N_BATCH,))
        pos = np.ctypeslib.as_array(b.pos, shape=(N_BATCH,))
        n_seq_id = np.ctypeslib.as_array(b.n_seq_id, shape=(N_BATCH,))
        logits_flag = np.ctypeslib.as_array(b.logits, shape=(N_BATCH,))
        seq_ids = [b.seq_id[i] for i in range(N_BATCH)]
        n_seq_id[:] = 1
        out: list[list[int]] = [[] for _ in prompts]
        fed = [0] * len(prompts)           # tokens of the sequence already in the KV cache
        prefill = list(range(len(prompts)))  # sequences with prompt tokens still to feed, in order
        decoding: list[int] = []           # sequences whose last sampled token is to be fed next
        while prefill or decoding:
            n, rows = 0, []
            for s in decoding:             # one token for every generating sequence first
                token[n], pos[n], logits_flag[n] = out[s][-1], fed[s], 1
                seq_ids[n][0] = s
                fed[s] += 1
                n += 1
                rows.append(s)
            while prefill and n < N_BATCH:  # then prompt chunks, as many as fit
                s = prefill[0]
                p = prompts[s]
                take = min(len(p) - fed[s], N_BATCH - n)
                token[n:n + take] = p[fed[s]:fed[s] + take]
                pos[n:n + take] = np.arange(fed[s], fed[s] + take)
                logits_flag[n:n + take] = 0
                for j in range(n, n + take):
                    seq_ids[j][0] = s
                fed[s] += take
                n += take
                if fed[s] == len(p):       # the prompt's last token gives the first output token
                    logits_flag[n - 1] = 1
                    rows.append(s)
                    prefill.pop(0)
            b.n_tokens = n
            rc = L.llama_decode(self.ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            logits = np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(len(rows), self.n_vocab))
            best = logits.argmax(axis=1).tolist()
            if times is not None:
                times.append(time.perf_counter())
            decoding = []
            for s, t in zip(rows, best):   # rows are in batch order, as llama_get_logits returns them
                out[s].append(t)
                if len(out[s]) < lens[s]:
                    decoding.append(s)
                else:                      # done: free its cells
                    L.llama_memory_seq_rm(self.mem, s, -1, -1)
        for o, n in zip(out, lens):
            assert len(o) == n, (len(o), n)
        return out

    def clear(self) -> None:
        self.L.llama_memory_clear(self.mem, True)


_quiet_log = None


def _install_quiet_log():
    global _quiet_log
    import ctypes
    import llama_cpp as L

    verbose = os.environ.get("LLAMACPP_PEER_VERBOSE") == "1"

    @L.llama_log_callback
    def cb(level, text, user_data):
        # ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continuation of the last line
        if verbose or level in (3, 4):
            sys.stderr.write(ctypes.string_at(text).decode(errors="replace"))
    _quiet_log = cb


def _engine(path: str, n_seq: int, seq_ctx: int, extra: dict) -> Engine:
    if not Path(path).exists():
        raise FileNotFoundError(f"{path} is missing: run `python benchmarks/llamacpp_peer.py --make-gguf "
                                f"--models {Path(path).parent}` first")
    _install_quiet_log()
    eng = Engine(path, n_seq, seq_ctx, threads=int(extra.get("threads", 2)),
                 unified=bool(extra.get("llamacpp_unified", False)))
    eng.settings["gguf"] = Path(path).name
    return eng


def generate_batch(w, models: Path, extra: dict) -> dict:
    """throughput.py's llama.cpp worker: start-up (load, context, one warm-up
    request) timed apart from the measured batch, as for the other engines."""
    t0 = time.perf_counter()
    seq_ctx = max(len(p) + n for p, n in zip(w.prompts, w.output_lens))
    eng = _engine(str(gguf_path(models, w.model, extra.get("llamacpp_type", "bf16"))), len(w.prompts), seq_ctx, extra)
    eng.generate([w.prompts[0][:16]], [2])
    eng.clear()
    startup = time.perf_counter() - t0
    t = time.perf_counter()
    outs = eng.generate(w.prompts, w.output_lens)
    wall = time.perf_counter() - t
    from throughput import _digest
    import llama_cpp
    return dict(wall=wall, startup=startup, tokens=_digest(outs), num_out=sum(map(len, outs)),
                first8=[o[:8] for o in outs], version=llama_cpp.__version__, settings=eng.settings)


def single_stream(path: str, prompt: list[int], n_out: int, extra: dict) -> dict:
    """One request: prefill_s from the start of the prompt's decode to its first
    token; decode tok/s over the other ``n_out - 1`` tokens."""
    t0 = time.perf_counter()
    eng = _engine(path, 1, len(prompt) + n_out, extra)
    eng.generate([prompt[:16]], [2])
    eng.clear()
    startup = time.perf_counter() - t0
    times: list[float] = []
    t = time.perf_counter()
    out = eng.generate([prompt], [n_out], times)[0]
    import llama_cpp
    return dict(startup=startup, prefill_s=times[0] - t, decode_tok_s=(n_out - 1) / (times[-1] - times[0]),
                tokens=out, version=llama_cpp.__version__, settings=eng.settings)


# ============================================================================ CLI

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--make-gguf", action="store_true", required=True)
    ap.add_argument("--models", type=Path, default=HERE / "models")
    ap.add_argument("--force", action="store_true", help="convert again even if the .gguf exists")
    ap.add_argument("--outtype", default="bf16", choices=["bf16", "f16", "f32"],
                    help="the converter's --outtype; the benchmarks use bf16 (anything else is named <model>-<type>.gguf)")
    ap.add_argument("names", nargs="*", default=["w0", "w1"])
    args = ap.parse_args()
    venv_py = VENV / "bin" / "python"
    if Path(sys.prefix).resolve() != VENV.resolve():
        os.execv(str(venv_py), [str(venv_py), __file__, *sys.argv[1:]])
    for name in args.names:
        out = gguf_path(args.models, name, args.outtype)
        if out.exists() and not args.force:
            print(f"[llamacpp_peer] {out} exists, skipping (--force to convert again)")
            continue
        make_gguf(args.models / name, out, args.outtype)


if __name__ == "__main__":
    main()
