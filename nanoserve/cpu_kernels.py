"""CPU kernels: the C sources in ``nanoserve/csrc``, built and called through ctypes.

Platform code behind the kernels layer's seam (``kernels.Backend``): nothing on
the reading path imports this module; ``cpu_backend.py`` does, when it builds
the CPU backend. Every function here computes what its torch reference in
``kernels.py`` computes, on bf16 tensors on a CPU with AVX-512 (the attention's
dot products take AVX-512 BF16's instruction where the CPU has it):

* ``paged_attention`` / ``store_kvcache`` (csrc/attention.c, csrc/row_ops.c):
  decodes through ``decode_attention`` (cascade attention where many sequences
  share a long prefix), prefill chunks through ``chunk_attention``, both within
  a sliding window where the layer has one;
* ``rms_norm``, ``rotary``, ``silu_and_mul``, ``gelu_tanh_and_mul`` (csrc/row_ops.c): bit
  for bit the torch references' results;
* ``argmax``: greedy sampling over bf16 logits, torch's rules;
* ``linear`` (csrc/linear.c): bf16 weights, fp32 arithmetic, for a CPU with no
  bf16 matrix instructions (F.linear's products, summed in one fixed order);
  ``moe_linear`` the same for every expert of a mixture-of-experts layer in one call.

The libraries are built on first use with the system C compiler (``$CC``),
``-march=native``, and cached on disk under ``$NANOSERVE_CACHE_DIR`` (default
``~/.cache/nanoserve``) keyed by the sources, the flags and this CPU. A build
that fails raises RuntimeError saying why; the caller then takes another backend.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

CSRC = Path(__file__).resolve().parent / "csrc"

# Cascade attention pays where many sequences share a long prefix; with few
# sequences or a short prefix one pass is as fast (RESULTS.md, "cascade").
CASCADE_MIN_SEQS = 8
CASCADE_MIN_TOKENS = 256


# --------------------------------------------------------------------------- building

def _cache_dir() -> Path:
    return Path(os.environ.get("NANOSERVE_CACHE_DIR") or Path.home() / ".cache" / "nanoserve")


def _cpu_flags() -> str:
    """-march=native builds for this CPU, so the built library is keyed by it."""
    try:
        return next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def build_library(source: Path, defines: list[str] = ()) -> ctypes.CDLL:
    """Build ``source`` (with csrc/ on the include path) once per source, headers,
    flags and CPU, cache it on disk, and load it."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", f"-I{CSRC}", *defines]
    texts = [source.read_text()] + [h.read_text() for h in sorted(CSRC.glob("*.h"))]
    key = hashlib.sha256("\0".join([*texts, cc, *flags, _cpu_flags()]).encode()).hexdigest()[:16]
    path = _cache_dir() / f"{source.stem}_{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            so = Path(tmp) / "out.so"
            r = subprocess.run([cc, *flags, str(source), "-o", str(so), "-lm"], capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"building the C kernel {source.name} failed: {r.stderr.strip()[:500]}")
            os.replace(so, path)  # atomic: another process may be building the same file
    # libgomp is already loaded by torch under the same soname, so the kernels'
    # OpenMP threads are torch's own pool, not a second one competing for cores.
    return ctypes.CDLL(str(path))


_P, _I64, _F32, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


def _declare(lib: ctypes.CDLL, signatures: dict[str, tuple[list, object]]) -> ctypes.CDLL:
    for name, (args, res) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


@functools.cache
def attention_library(group: int, head_dim: int, flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """csrc/attention.c for one head shape (constant sizes keep a K/V row in registers);
    ``flags`` are extra compiler flags (the tests build without AVX-512 BF16 with them)."""
    if head_dim % 32:
        raise RuntimeError(f"the C attention kernels need head_dim % 32 == 0, got {head_dim}")
    lib = build_library(CSRC / "attention.c", [f"-DGROUP={group}", f"-DHEAD_DIM={head_dim}", *flags])
    return _declare(lib, {
        "decode_attention": ([_P, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _F32, _I64, _I64, _P, _P, _P, _I64,
                              _I32], None),
        "chunk_attention": ([_P, _P, _P, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _F32, _I64, _I32], None),
        "prefix_attention": ([_P, _P, _P, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _F32, _I32], None),
    })


@functools.cache
def row_ops_library() -> ctypes.CDLL:
    """csrc/row_ops.c: the shape-free kernels."""
    return _declare(build_library(CSRC / "row_ops.c"), {
        "argmax_rows": ([_P, _I64, _I64, _I64, _P, _I32], None),
        "rms_norm": ([_P, _I64, _P, _P, _I64, _I64, _I64, _F32, _I32], None),
        "rotary": ([_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _I32], None),
        "silu_and_mul": ([_P, _P, _I64, _I64, _P, _I32], None),
        "store_kvcache": ([_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _I64], _I64),
    })


@functools.cache
def linear_library() -> ctypes.CDLL:
    """csrc/linear.c."""
    return _declare(build_library(CSRC / "linear.c"),
                    {"linear": ([_P, _I64, _I64, _P, _I64, _P, _P, _I32, _I32], _I32),
                     "moe_linear": ([_P, _I64, _I64, _P, _I64, _P, _I64, _P, _I32, _I32], _I32)})


# --------------------------------------------------------------------------- attention

def _check_attention_inputs(query, k_cache, v_cache) -> None:
    if not query.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16:
        raise ValueError("the C attention kernels take bf16 query and caches")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the C attention kernels need contiguous caches")


def window_masks(seq_lens: torch.Tensor, sliding_window: int | None) -> bool:
    """Whether a step's sliding window hides a key from some query: a sequence is longer than it
    (kernels without a window run the step through paged_attention_torch then). Reads seq_lens on the host."""
    return sliding_window is not None and int(seq_lens.max()) > sliding_window


def is_decode_only(query_start_loc: torch.Tensor) -> bool:
    """Every sequence of the step has exactly one query token (its next decode)."""
    return torch.equal(query_start_loc, torch.arange(query_start_loc.shape[0], dtype=query_start_loc.dtype,
                                                     device=query_start_loc.device))


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    """kernels.paged_attention_torch in C: the decodes of the step in one
    decode_attention call, its multi-token chunks in one chunk_attention call, both
    within the sliding window where one masks a key (neither reads a block before it).
    No soft cap (Gemma 2's): cpu_backend._pick_attention gives a soft-capped model the reference."""
    if logits_soft_cap is not None:
        raise ValueError("the C attention kernels do not soft-cap attention scores (Gemma 2)")
    window = sliding_window if window_masks(seq_lens, sliding_window) else None
    _check_attention_inputs(query, k_cache, v_cache)
    query = query.contiguous()  # the kernels index rows directly
    num_seqs = seq_lens.shape[0]
    if is_decode_only(query_start_loc):
        return decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, window)  # all decodes
    out = torch.empty_like(query)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    decodes = torch.nonzero(q_lens == 1).flatten()
    if decodes.numel():
        rows = query_start_loc[decodes].long()
        out[rows] = decode_attention(query[rows], k_cache, v_cache, block_tables[decodes],
                                     seq_lens[decodes], scale, window)
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    table = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    qsl = query_start_loc.to(torch.int32).contiguous()
    group = num_heads // num_kv_heads
    if group <= CHUNK_MAX_GROUP:
        _chunk_attention(query, k_cache, v_cache, table, lens, qsl, out, scale, window)
    elif num_kv_heads == 1:  # MQA of many heads (MLA's: DeepSeek-V3's 128): each head sees the one KV head alike
        for h in range(0, num_heads, CHUNK_MAX_GROUP):
            heads = slice(h, h + CHUNK_MAX_GROUP)
            part = out[:, heads].contiguous()  # the decodes' rows as written above; the chunks' written now
            _chunk_attention(query[:, heads].contiguous(), k_cache, v_cache, table, lens, qsl, part, scale, window)
            out[:, heads] = part
    else:
        raise ValueError(f"the C chunk attention takes at most {CHUNK_MAX_GROUP} query heads per KV head, "
                         f"got {group}")
    return out


# csrc/attention.c's ROWS: a chunk tile holds ROWS / GROUP query tokens' rows, at least one token's
CHUNK_MAX_GROUP = 32


def _chunk_attention(query, k_cache, v_cache, table, lens, qsl, out, scale, window) -> None:
    """chunk_attention over query's heads (contiguous), into out (contiguous, query's shape)."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    attention_library(num_heads // num_kv_heads, head_dim).chunk_attention(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), table.stride(0),
        lens.data_ptr(), qsl.data_ptr(), out.data_ptr(), lens.shape[0], num_kv_heads, block_size, float(scale),
        window or 0, torch.get_num_threads())


def decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale,
                     sliding_window: int | None = None) -> torch.Tensor:
    """One query token per sequence: query [seqs, heads, d] bf16 -> the same.
    Where the sequences share a long enough prefix, cascade attention: the shared
    part once for all (prefix_attention), then each one's own tail, merged. With a
    sliding window each sees its last sliding_window keys, and nothing is shared
    (the blocks before windows are the null block in every table: kvcache)."""
    n, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    _check_attention_inputs(query, k_cache, v_cache)
    lib = attention_library(num_heads // num_kv_heads, head_dim)
    query = query.contiguous()
    table = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    threads = torch.get_num_threads()
    start, partials = 0, (None, None, None)
    shared = shared_prefix_blocks(table, lens, block_size) if n >= CASCADE_MIN_SEQS and not sliding_window else 0
    if shared * block_size >= CASCADE_MIN_TOKENS:
        start = shared * block_size
        o_pre = torch.empty(n, num_heads, head_dim, dtype=torch.float32)
        m_pre, l_pre = torch.empty(n, num_heads), torch.empty(n, num_heads)
        prefix_table = table[0, :shared].contiguous()  # held: C reads it through a raw pointer
        lib.prefix_attention(query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), prefix_table.data_ptr(),
                             start, o_pre.data_ptr(), m_pre.data_ptr(), l_pre.data_ptr(), n, num_kv_heads,
                             block_size, float(scale), threads)
        partials = (o_pre.data_ptr(), m_pre.data_ptr(), l_pre.data_ptr())
    lib.decode_attention(query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(),
                         table.stride(0), lens.data_ptr(), out.data_ptr(), n, num_kv_heads, block_size,
                         float(scale), heads_per_task(n, num_kv_heads, threads), start, *partials,
                         sliding_window or 0, threads)
    return out


def heads_per_task(num_seqs: int, num_kv_heads: int, threads: int) -> int:
    """Most kv heads per task (longest contiguous reads) that still leaves every
    thread a few tasks: a batch of one sequence is split across its heads."""
    for hb in range(num_kv_heads, 0, -1):
        if num_kv_heads % hb == 0 and num_seqs * (num_kv_heads // hb) >= 2 * threads:
            return hb
    return 1


def shared_prefix_blocks(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> int:
    """How many leading blocks every sequence's table has in common (the prefix
    cache hands one physical block to all requests with the same prefix), leaving
    each sequence at least its last token of its own."""
    same = (block_tables == block_tables[:1]).all(0)
    common = int(same.to(torch.int32).cumprod(0).sum())
    return min(common, (int(seq_lens.min()) - 1) // block_size)


def store_kvcache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """kernels.store_kvcache_torch as one memcpy per row and cache."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if not (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and key.stride()[1:] == value.stride()[1:] == (head_dim, 1)):
        raise ValueError("the C store_kvcache takes bf16 key/value with contiguous heads and contiguous caches")
    slots = slot_mapping.to(torch.int64).contiguous()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    bad = row_ops_library().store_kvcache(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                          k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                                          key.shape[0], num_kv_heads * head_dim, num_slots)
    if bad:
        raise IndexError(f"store_kvcache: {bad} slots outside the cache's {num_slots} (or below -1)")


# --------------------------------------------------------------------------- row-wise ops

# Below this many elements a row-wise op runs on the calling thread alone, as ATen's
# parallel_for does under its grain size: waking the OpenMP team and meeting it at the
# barrier costs more than the work saves, and far more where another process holds a
# core (every op then waits for a team thread to be scheduled; RESULTS.md).
PARALLEL_MIN_ELEMENTS = 32768


def _threads(elements: int) -> int:
    return torch.get_num_threads() if elements >= PARALLEL_MIN_ELEMENTS else 1


def _rows_ok(t: torch.Tensor, n: int) -> bool:
    """bf16, unit stride within a row of n (a multiple of 16), any row stride."""
    return t.dtype == torch.bfloat16 and t.stride(-1) == 1 and n % 16 == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """kernels.rms_norm_torch for x [rows, n] or [rows, heads, n] (heads contiguous)."""
    n = x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    if not (x.dim() in (2, 3) and _rows_ok(x, n) and (x.dim() == 2 or x.stride(1) == n)
            and weight.dtype == torch.bfloat16 and weight.is_contiguous()):
        raise ValueError("the C rms_norm takes bf16 [rows, n] or [rows, heads, n] with n % 16 == 0")
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    row_ops_library().rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0],
                               heads, n, eps, _threads(x.numel()))
    return out


def rotary(q, k, positions, cos_cache, sin_cache):
    """kernels.rotary_torch for q [rows, hq, d], k [rows, hk, d] with contiguous heads (tables r <= d wide)."""
    rows, hq, d = q.shape
    hk, r = k.shape[1], cos_cache.shape[-1]
    if not (_rows_ok(q, d) and _rows_ok(k, d) and q.stride(1) == d and k.stride(1) == d
            and cos_cache.dtype == torch.float32 and cos_cache.is_contiguous() and sin_cache.is_contiguous()
            and (r == d or (r < d and r % 32 == 0))):
        raise ValueError("the C rotary takes bf16 q, k with contiguous heads, head_dim % 16 == 0, "
                         "fp32 cos/sin tables, and rotary dims (partial) % 32 == 0")
    q_out = torch.empty(rows, hq, d, dtype=torch.bfloat16)
    k_out = torch.empty(rows, hk, d, dtype=torch.bfloat16)
    pos = positions.to(torch.int64).contiguous()
    row_ops_library().rotary(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), q_out.data_ptr(),
                             k_out.data_ptr(), rows, hq, hk, d, r, pos.data_ptr(), cos_cache.data_ptr(),
                             sin_cache.data_ptr(), _threads(q.numel() + k.numel()))
    return q_out, k_out


@functools.cache
def _silu_table() -> torch.Tensor:
    """fp32 [65536]: torch's bf16 F.silu of every bf16 bit pattern, by index."""
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return F.silu(bits).float()


@functools.cache
def _gelu_tanh_table() -> torch.Tensor:
    """fp32 [65536]: torch's bf16 F.gelu(approximate="tanh") of every bf16 bit pattern, by index."""
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return F.gelu(bits, approximate="tanh").float()


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """kernels.silu_and_mul_torch for gate_up [rows, 2n] contiguous."""
    return _act_and_mul(gate_up, _silu_table(), "silu_and_mul")


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """kernels.gelu_tanh_and_mul_torch for gate_up [rows, 2n] contiguous: the C silu_and_mul,
    which reads the activation from the table it is given, with GELU's."""
    return _act_and_mul(gate_up, _gelu_tanh_table(), "gelu_tanh_and_mul")


def _act_and_mul(gate_up: torch.Tensor, table: torch.Tensor, name: str) -> torch.Tensor:
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    if not (_rows_ok(gate_up, n) and gate_up.is_contiguous()):
        raise ValueError(f"the C {name} takes contiguous bf16 [rows, 2n] with n % 16 == 0")
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    row_ops_library().silu_and_mul(gate_up.data_ptr(), out.data_ptr(), rows, n, table.data_ptr(),
                                   _threads(gate_up.numel()))
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """kernels.argmax_torch of bf16 logits [rows, vocab], read once: the argmax
    of bf16 values is the argmax of their exact fp32 copies."""
    if logits.dtype != torch.bfloat16 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("the C argmax takes a bf16 [rows, vocab] tensor with unit stride over the vocab")
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    row_ops_library().argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0),
                                  out.data_ptr(), _threads(logits.numel()))
    return out


# --------------------------------------------------------------------------- linear

LINEAR_PANEL = 32  # outputs per panel of the packed weight (csrc/linear.c's NR)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] (K even) -> csrc/linear.c's layout [ceil(N / 32), K / 2, 32, 2]: per
    panel of 32 outputs and pair of inputs, the outputs' two weights side by side
    (outputs past N are zeros)."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or k % 2:
        raise ValueError("the C linear takes a bf16 weight [N, K] with K even")
    padded = -(-n // LINEAR_PANEL) * LINEAR_PANEL
    w = torch.zeros(padded, k, dtype=torch.bfloat16)
    w[:n] = weight
    return w.view(padded // LINEAR_PANEL, LINEAR_PANEL, k // 2, 2).transpose(1, 2).contiguous()


def packed_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the [N, K] weight that pack_linear_weight packed: the same values, gathered
    from their panels (a tied model's embedding lookup, reading its head's packed copy)."""
    rows = packed[ids // LINEAR_PANEL, :, ids % LINEAR_PANEL]
    return rows.reshape(*ids.shape, packed.shape[1] * 2)  # the width spelt out: ids may be empty


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [..., K] (bf16) times the packed weight's [N, K] transposed, plus ``bias`` (fp32,
    padded to the panels' width), in fp32, returned as ``out_dtype`` (bf16 or fp32)."""
    k, width = packed.shape[1] * 2, packed.shape[0] * LINEAR_PANEL
    if x.dtype != torch.bfloat16 or x.shape[-1] != k or out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the C linear takes bf16 [..., {k}] and returns bf16 or fp32")
    if bias is not None and not (bias.dtype == torch.float32 and bias.shape == (width,) and bias.is_contiguous()):
        raise ValueError(f"the C linear takes an fp32 bias padded to {width} outputs")
    rows = x.reshape(-1, k).contiguous()
    out = torch.empty(rows.shape[0], n, dtype=out_dtype)
    if rows.shape[0] and linear_library().linear(rows.data_ptr(), rows.shape[0], k, packed.data_ptr(), n,
                                                 None if bias is None else bias.data_ptr(), out.data_ptr(),
                                                 int(out_dtype == torch.float32), torch.get_num_threads()):
        raise MemoryError(f"the C linear found no memory for {rows.shape[0]} rows widened to fp32")
    return out.view(*x.shape[:-1], n)


def moe_linear(x: torch.Tensor, packed: torch.Tensor, n: int, offsets: torch.Tensor) -> torch.Tensor:
    """Each expert's rows of x [M, K] (bf16; expert e's at offsets[e] .. offsets[e + 1], int64
    [E + 1]) times its packed weight (``packed`` [E, ...]: pack_linear_weight of each expert's
    [N, K]) transposed, in one call: bf16 [M, N], each row linear()'s result for its expert."""
    E, k = packed.shape[0], packed.shape[2] * 2
    if not (x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == k and packed.is_contiguous()
            and offsets.dtype == torch.int64 and offsets.shape == (E + 1,) and offsets.is_contiguous()
            and int(offsets[-1]) == x.shape[0]):
        raise ValueError(f"the C moe_linear takes bf16 [M, {k}] and int64 offsets [{E + 1}] ending at M")
    rows = x.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    if rows.shape[0] and linear_library().moe_linear(rows.data_ptr(), rows.shape[0], k, packed.data_ptr(), E,
                                                     offsets.data_ptr(), n, out.data_ptr(), 0,
                                                     torch.get_num_threads()):
        raise MemoryError(f"the C moe_linear found no memory for {rows.shape[0]} rows widened to fp32")
    return out
