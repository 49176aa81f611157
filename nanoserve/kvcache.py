"""Memory & cache layer: the paged KV cache.

This module owns
* the block pool (``BlockManager``): free list, ref counts, each request's block
  table, ``allocate_slots`` / ``free``;
* prefix caching: a full block's hash chains its parent's hash with its token ids,
  so equal prefixes map to equal blocks; a block whose ref count drops to zero
  stays cached at the end of an LRU free list until allocation takes it;
* with a sliding window on every layer, freeing the blocks no window reads any
  more (their places in a table become the null block, block 0);
* forgetting the hashes of blocks a dropped or failed step never wrote
  (``forget_unwritten``, ``reset_prefix_cache``), so no hit reads KV nobody wrote;
* slot mapping (token position -> slot in the KV tensors);
* sizing and allocating the KV tensors themselves from a memory budget.

It knows nothing of HTTP, text or sampling: requests are ids and token lists.
It hands the scheduler "can this request have these slots?" answers, the block
tables (which reach the model runner in the scheduler's output) and its stats;
the model runner gets the KV tensors, and computes each token's slot with
``compute_slot_mapping``. On a request's path: ``Scheduler.schedule`` calls
``get_computed_blocks`` then ``allocate_slots``; ``Scheduler.finish_request`` calls ``free``.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger("nanoserve.kvcache")


@dataclass(slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and cached


def _salt_hash(cache_salt: str | None) -> bytes | None:
    return None if cache_salt is None else hashlib.sha256(cache_salt.encode()).digest()


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Hash of one full block: SHA-256 of its parent's hash chained with its
    tokens (as vLLM's default, ``prefix_caching_hash_algo="sha256"``). A hit
    hands one request another's KV, so the hash must resist crafted collisions:
    Python's ``hash`` does not (it is not cryptographic, reduces ints mod
    2**61 - 1, and ``hash(None)`` is a constant from Python 3.12), and a prompt
    built to collide with a popular prefix would poison every request sharing it.
    Every block has ``block_size`` tokens, so the encoding is unambiguous."""
    h = hashlib.sha256(parent_hash or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(slots=True)
class KVCacheStats:
    """The block pool's numbers, named as engine.stats() reports them."""
    num_total_blocks: int
    num_free_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int  # in tokens, as vLLM counts them
    prefix_cache_hits: int
    # When the most blocks were held: how many, and the share of their slots
    # that held no token (the paging's internal waste).
    peak_kv_blocks: int
    kv_unused_fraction_at_peak: float


class BlockManager:
    """vLLM's KVCacheManager + BlockPool in one: who owns which block.

    With a ``sliding_window`` (a model whose every layer has one) the blocks wholly
    before every window still to come are freed as requests go on
    (free_skipped_blocks, vLLM's SlidingWindowManager): their places in a table
    become the null block's, block 0, which is never allocated nor written, so a
    kernel that reads the whole table reads zeros there, which its window masks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None):
        null = 0 if sliding_window is not None else None
        if num_blocks < 1 + (null is not None) or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 (2 with a sliding window) and block_size >= 1, got {num_blocks}, "
                             f"{block_size}")
        self.null_block = null
        self.sliding_window = sliding_window
        self.num_blocks = num_blocks - (null is not None)  # those that can be allocated
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # LRU order: allocation pops from the front; freed cached blocks go to the end.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks - self.num_blocks,
                                                                               num_blocks))
        self.cached: dict[bytes, int] = {}               # block hash -> block id
        self.req_to_blocks: dict[str, list[int]] = {}    # the block tables
        self.req_hashes: dict[str, list[bytes]] = {}     # hash chain of each request's full blocks
        self.req_salts: dict[str, str | None] = {}       # see get_computed_blocks
        self.prefix_cache_queries = 0                    # in tokens, as vLLM counts them
        self.prefix_cache_hits = 0
        # Slots in held blocks that no token fills (each request's last block's
        # tail; shared prefix blocks are full). Kept as a running total, and
        # sampled when the held blocks peak: how much the paging wastes then.
        self.req_unused: dict[str, int] = {}             # per request
        self.unused_slots = 0
        self.peak_used_blocks = 0
        self.unused_slots_at_peak = 0

    # ---------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def make_stats(self) -> KVCacheStats:
        peak = self.peak_used_blocks
        return KVCacheStats(self.num_blocks, self.num_free_blocks, self.usage, self.prefix_cache_queries,
                            self.prefix_cache_hits, peak,
                            self.unused_slots_at_peak / max(1, peak * self.block_size))

    # ---------------------------------------------------------------- prefix cache
    def _caches(self, cache_salt: str | None) -> bool:
        """Prefix caching off still lets a salted family (the n completions of one
        prompt) share its own prompt blocks; the salt keeps everyone else out."""
        return self.enable_prefix_caching or cache_salt is not None

    def get_computed_blocks(self, token_ids: list[int], cache_salt: str | None = None,
                            block_hashes: list[bytes] | None = None) -> list[int]:
        """The cached blocks that cover a prefix of ``token_ids``. At least the
        last token is always left to compute (its logits are needed), so a
        prompt that is all cached still recomputes its final block's last token.
        A ``cache_salt`` (as vLLM's) starts the hash chain, so only requests with
        the same salt can share blocks. With a sliding window only the blocks the
        first window to compute reads must be cached (vLLM's SlidingWindowManager):
        the longest such prefix wins, and the blocks before its window are the null block.
        ``block_hashes``: the request's chain so far (vLLM's Request.block_hashes), extended here,
        so that a prompt that waits for free blocks is not hashed again at every schedule."""
        if not self._caches(cache_salt):
            return []
        hits: list[int] = []
        bs = self.block_size
        for h in itertools.islice(self._hash_chain(token_ids, cache_salt, block_hashes), (len(token_ids) - 1) // bs):
            block_id = self.cached.get(h)
            if block_id is None and self.sliding_window is None:
                break
            hits.append(block_id)
        if self.sliding_window is None:
            return hits
        best, run = 0, 0  # the longest prefix whose window is cached; cached blocks in a row before block n
        for n, block_id in enumerate(hits, 1):
            run = run + 1 if block_id is not None else 0
            if run >= n - self._first_window_block(n * bs):
                best = n
        first = self._first_window_block(best * bs)
        return [self.null_block] * first + hits[first:best]

    def _hash_chain(self, token_ids: list[int], cache_salt: str | None,
                    memo: list[bytes] | None = None) -> Iterator[bytes]:
        """The hashes of ``token_ids``' full blocks, in order, each chained to the one
        before. ``memo`` holds those of earlier calls for the same request (whose
        tokens only grow): they are not hashed again, and new ones are added to it."""
        memo = [] if memo is None else memo
        yield from memo
        parent, bs = (memo[-1] if memo else _salt_hash(cache_salt)), self.block_size
        for i in range(len(memo), len(token_ids) // bs):
            parent = hash_block(parent, token_ids[i * bs:(i + 1) * bs])
            memo.append(parent)
            yield parent

    def _first_window_block(self, position: int) -> int:
        """The first block the window of a query at ``position`` reads (kernels.first_window_block)."""
        return max(position - self.sliding_window + 1, 0) // self.block_size

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        if not self.enable_prefix_caching:  # n's family sharing is not the prefix cache
            return
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    # ---------------------------------------------------------------- allocate / free
    def allocate_slots(self, request_id: str, token_ids: list[int], num_tokens: int,
                       computed_blocks: list[int] | None = None, cache_salt: str | None = None,
                       block_hashes: list[bytes] | None = None) -> list[int] | None:
        """Make the request's block table cover its first ``num_tokens`` tokens,
        first taking ``computed_blocks`` (prefix-cache hits) if it has none yet.
        Returns the table, or None, changing nothing, when the free blocks do not
        suffice (as vLLM's allocate_slots). A table is never changed in place (one
        that grows is a new list), so whoever holds one (a step's inputs, on the
        model's thread) may keep it."""
        table = self.req_to_blocks.get(request_id, [])
        if not computed_blocks and num_tokens <= len(table) * self.block_size:
            # most decode steps: the new token fits the last block held, nothing to take
            self._track_unused(request_id, table, num_tokens)
            self._cache_full_blocks(request_id, token_ids, num_tokens)
            return table
        computed_blocks = computed_blocks or []
        # Hits that are on the free list are about to be taken out of it (the null block never is).
        held = [b for b in computed_blocks if b != self.null_block]
        revived = sum(1 for b in held if self.blocks[b].ref_cnt == 0)
        need = self.blocks_needed(num_tokens) - len(table) - len(computed_blocks)
        if need + revived > self.num_free_blocks:
            return None
        for b in held:
            self._touch(b)
        if len(held) < len(computed_blocks):  # the null block has no hash: the chain from the tokens
            self.req_hashes[request_id] = list(itertools.islice(
                self._hash_chain(token_ids, cache_salt, block_hashes), len(computed_blocks)))
        elif computed_blocks:
            self.req_hashes[request_id] = [self.blocks[b].block_hash for b in computed_blocks]
        if computed_blocks or need > 0:  # a new list: see the docstring
            table = table + computed_blocks + [self._pop_free() for _ in range(need)]
        self.req_to_blocks[request_id] = table
        self._track_unused(request_id, table, num_tokens)
        self.req_salts.setdefault(request_id, cache_salt)
        if (need > 0 or computed_blocks) and logger.isEnabledFor(logging.DEBUG):
            logger.debug("[kvcache] %s: +%d blocks, %d prefix-cache hits, table %d, free %d",
                         request_id, max(need, 0), len(computed_blocks), len(table), self.num_free_blocks)
        self._cache_full_blocks(request_id, token_ids, num_tokens)
        return table

    def free(self, request_id: str) -> None:
        """Release a request's blocks. The tail is freed first so that, among
        equally old blocks, a prefix outlives its continuation in the LRU."""
        table = self.req_to_blocks.pop(request_id, [])
        self.unused_slots -= self.req_unused.pop(request_id, 0)
        if table and logger.isEnabledFor(logging.DEBUG):
            logger.debug("[kvcache] free %s: %d blocks back (cached ones stay reusable), free %d",
                         request_id, len(table), self.num_free_blocks + sum(
                             1 for b in table if self.blocks[b].ref_cnt == 1))
        self.req_hashes.pop(request_id, None)
        self.req_salts.pop(request_id, None)
        for b in reversed(table):
            if b != self.null_block:  # freed already, out of the window
                self._release(b)

    def free_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """vLLM's remove_skipped_blocks: the request's blocks wholly before the window of
        its next query (at position ``num_computed_tokens``), which no window still to come
        reads, go back to the pool (a cached one stays reusable); the table (a new list,
        as ever) has the null block in their places."""
        table = self.req_to_blocks.get(request_id)
        n = 0 if table is None else min(self._first_window_block(num_computed_tokens), len(table))
        if n == 0 or table[n - 1] == self.null_block:  # none, or freed up to there already
            return
        table = list(table)
        for i in reversed(range(n)):  # the tail first, as free()
            if table[i] == self.null_block:
                break
            self._release(table[i])
            table[i] = self.null_block
        self.req_to_blocks[request_id] = table

    def forget_unwritten(self, block_ids: list[int]) -> None:
        """Forget the hashes of these blocks: the step that was to write their KV was not run for the
        request that registered them (the engine dropped it, and the readers of them that step:
        Scheduler.drop_unwritten), so no hit may find them. Those free are evicted first."""
        for b in block_ids:
            block = self.blocks[b]
            if b == self.null_block or block.block_hash is None:
                continue
            if self.cached.get(block.block_hash) == b:
                del self.cached[block.block_hash]
            block.block_hash = None
            if block.ref_cnt == 0:  # nothing reusable in it: evict it first
                self.free_blocks.move_to_end(b, last=False)

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_cnt == 0:
                block.block_hash = None
        self.cached = {h: b for h, b in self.cached.items() if self.blocks[b].block_hash == h}

    # ---------------------------------------------------------------- internals
    def _track_unused(self, request_id: str, table: list[int], num_tokens: int) -> None:
        unused = len(table) * self.block_size - num_tokens
        self.unused_slots += unused - self.req_unused.get(request_id, 0)
        self.req_unused[request_id] = unused
        used = self.num_blocks - len(self.free_blocks)
        if used >= self.peak_used_blocks:
            self.peak_used_blocks, self.unused_slots_at_peak = used, self.unused_slots

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_cnt -= 1
        assert block.ref_cnt >= 0, f"block {block_id} freed twice"
        if block.ref_cnt == 0:
            self.free_blocks[block_id] = None
            if block.block_hash is None:  # nothing reusable in it: evict it first
                self.free_blocks.move_to_end(block_id, last=False)

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.free_blocks[block_id]
        block.ref_cnt += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: its content is about to be overwritten
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block_id

    def _cache_full_blocks(self, request_id: str, token_ids: list[int], num_tokens: int) -> None:
        """Register the hashes of blocks that are full once this step's tokens
        are written. Their KV is written in this step before any attention reads
        it (store_kvcache runs before attention in every layer), so a request
        scheduled later in the same step may already hit them."""
        num_full = min(num_tokens, len(token_ids)) // self.block_size
        if num_full <= len(self.req_hashes.get(request_id, ())):  # most decode steps: no block filled up
            return
        salt = self.req_salts.get(request_id)
        if not self._caches(salt):
            return
        hashes = self.req_hashes.setdefault(request_id, [])
        table = self.req_to_blocks[request_id]
        first_new = len(hashes)  # the chain extends hashes, up to block num_full - 1
        for i, h in enumerate(itertools.islice(self._hash_chain(token_ids, salt, hashes), first_new, num_full),
                              first_new):
            block = self.blocks[table[i]]
            if block.block_hash is None:
                block.block_hash = h
                self.cached.setdefault(h, block.block_id)


# ---------------------------------------------------------------- slot mapping

def slot(block_table: list[int], position: int, block_size: int) -> int:
    """Where the token at ``position`` of a sequence lives in the flat KV cache."""
    return block_table[position // block_size] * block_size + position % block_size


def compute_slot_mapping(block_tables: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """``slot`` of each token of a step, for all of them at once (no Python loop per token)."""
    block_ids = block_tables[seq_ids, positions // block_size].long()
    return block_ids * block_size + positions % block_size


# ---------------------------------------------------------------- sizing and allocation

@dataclass(slots=True)
class KVCacheSpec:
    """What one block holds across the layers: its bytes decide how many blocks a budget buys."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    one_tensor: bool = False  # K and V are one tensor (MLA: the cached latent is both key and value)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        tensors = 1 if self.one_tensor else 2
        return tensors * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


@dataclass(slots=True)
class KVCachePlan:
    num_blocks: int
    bytes_per_block: int
    budget_bytes: int
    from_num_blocks: bool = False  # set by --num-kv-blocks, not by a byte budget
    graph_pool_bytes: int = 0      # what the budget left for the CUDA graphs' pool (0: not profiled)

    def describe(self, spec: KVCacheSpec, weight_bytes: int, max_model_len: int, per_request: int,
                 null_blocks: int = 0) -> str:
        """``per_request``: the most blocks one request holds (blocks_per_request); ``null_blocks``:
        1 where a sliding window's null block is in the pool, never allocated."""
        usable = self.num_blocks - null_blocks
        null = f" (and the null block)" if null_blocks else ""
        return (f"weights {weight_bytes / 2**30:.2f} GiB; KV budget {self.budget_bytes / 2**30:.2f} GiB, "
                f"{self.bytes_per_block / 2**10:.1f} KiB per block of {spec.block_size} tokens -> "
                f"{usable} blocks{null}, {usable * spec.block_size} tokens; max concurrency at "
                f"max_model_len={max_model_len}: {usable / per_request:.2f}x")


def blocks_per_request(max_model_len: int, block_size: int, sliding_window: int | None = None,
                       max_num_batched_tokens: int = 0) -> int:
    """The most blocks one request holds at once: its whole length, or where the blocks before a
    sliding window are freed, the window and one step's tokens, plus a block for a window that
    starts inside one (vLLM's SlidingWindowSpec.max_memory_usage_bytes)."""
    whole = -(-max_model_len // block_size)
    if sliding_window is None:
        return whole
    return min(whole, -(-min(sliding_window - 1 + max_num_batched_tokens, max_model_len) // block_size) + 1)


def plan_kv_cache(spec: KVCacheSpec, budget_bytes: int | None, num_kv_blocks: int | None) -> KVCachePlan:
    """How many blocks the budget buys (``num_kv_blocks`` overrides it)."""
    per_block = spec.bytes_per_block
    if num_kv_blocks is not None:
        if num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_kv_blocks}")
        return KVCachePlan(num_kv_blocks, per_block, num_kv_blocks * per_block, from_num_blocks=True)
    if budget_bytes is None or budget_bytes <= 0:
        raise ValueError(f"KV cache budget must be > 0 bytes, got {budget_bytes}: the weights leave no "
                         f"room; set --kv-cache-memory-bytes (CPU) or raise --gpu-memory-utilization")
    if budget_bytes < per_block:  # zero blocks: nothing could ever run
        raise ValueError(
            f"KV cache too small: a budget of {budget_bytes} bytes buys no block of "
            f"{spec.block_size} tokens ({per_block} bytes each). Raise --kv-cache-memory-bytes "
            f"to at least {per_block} (or set --num-kv-blocks).")
    return KVCachePlan(budget_bytes // per_block, per_block, budget_bytes)


def check_fits(plan: KVCachePlan, spec: KVCacheSpec, max_model_len: int, need: int | None = None) -> None:
    """Does one request of max_model_len fit? ``need``: the blocks it takes (a sliding window's
    blocks_per_request and the null block); by default its whole length's."""
    need = need or -(-max_model_len // spec.block_size)
    if plan.num_blocks < need:
        fit_len = plan.num_blocks * spec.block_size
        raise ValueError(
            f"KV cache too small: {plan.num_blocks} blocks hold {fit_len} tokens, but one request "
            f"of max_model_len={max_model_len} needs {need} blocks "
            f"({need * plan.bytes_per_block} bytes). Lower --max-model-len to at most {fit_len}, "
            + (f"or raise --num-kv-blocks to at least {need}." if plan.from_num_blocks else
               f"or raise --kv-cache-memory-bytes to at least {need * plan.bytes_per_block} "
               f"(or --num-kv-blocks to at least {need})."))


def default_cpu_budget(weight_bytes: int) -> int:
    """vLLM-CPU's default KV space is 4 GiB; we also leave room beside the weights
    so that a small machine does not swap."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 * 2**30
    return max(min(4 * 2**30, (total - weight_bytes) // 4), 64 * 2**20)


def available_cpu_memory() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), or None where there is none."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _lora_note(lora_bytes: int) -> tuple[str, str]:
    """What the LoRA slots add to a memory error: their size, and the flags that shrink them."""
    if not lora_bytes:
        return "", ""
    return (f" (with {lora_bytes / 2**30:.2f} GiB of LoRA adapter slots)",
            ", fewer --max-loras or a lower --max-lora-rank")


def check_cpu_memory(weight_bytes: int, kv_bytes: int | None, lora_bytes: int = 0) -> None:
    """Fail before loading, with what to do, when weights (+ an explicit KV
    budget, + the LoRA slots) cannot fit in this machine's memory: swapping or
    the OOM killer is a far worse way to find out."""
    avail = available_cpu_memory()
    if avail is None:
        return
    weight_bytes += lora_bytes
    need = weight_bytes + (kv_bytes or 0)
    with_lora, fix_lora = _lora_note(lora_bytes)
    if need > avail:
        raise ValueError(
            f"not enough memory: the weights need {weight_bytes / 2**30:.2f} GiB{with_lora}"
            + (f" and the KV cache {kv_bytes / 2**30:.2f} GiB" if kv_bytes else "")
            + f", but this machine has {avail / 2**30:.2f} GiB available. Use a smaller model, "
            f"--dtype bfloat16 (half of float32){fix_lora}, or a smaller --kv-cache-memory-bytes")


def check_gpu_memory(weight_bytes: int, device: torch.device, gpu_memory_utilization: float,
                     kv_bytes: int | None = None, lora_bytes: int = 0) -> None:
    """Fail before loading, with what to do, when a rank's weights exceed what
    ``gpu_memory_utilization`` leaves of the GPU (gpu_budget's arithmetic, before
    the weights): else the load dies with a bare CUDA out-of-memory. With an
    explicit KV size (``kv_bytes``; kv_budget then reads no utilization): weights
    and KV cache against the GPU's free memory. ``lora_bytes``: the LoRA slots, counted with the weights."""
    usable, total, used = usable_gpu_memory(device, gpu_memory_utilization)
    weight_bytes += lora_bytes
    with_lora, fix_lora = _lora_note(lora_bytes)
    if kv_bytes is not None and weight_bytes + kv_bytes > total - used:
        raise ValueError(
            f"not enough GPU memory: the weights need {weight_bytes / 2**30:.2f} GiB{with_lora} and the KV cache "
            f"{kv_bytes / 2**30:.2f} GiB, but {device} has {(total - used) / 2**30:.2f} GiB free of "
            f"{total / 2**30:.2f} GiB. Use a smaller model, more GPUs (--tensor-parallel-size){fix_lora}, or a "
            f"smaller --kv-cache-memory-bytes / --num-kv-blocks")
    if kv_bytes is None and weight_bytes > usable:
        raise ValueError(
            f"not enough GPU memory: the weights need {weight_bytes / 2**30:.2f} GiB{with_lora}, but "
            f"--gpu-memory-utilization {gpu_memory_utilization} of {device}'s {total / 2**30:.2f} GiB, less "
            f"{used / 2**30:.2f} GiB in use, leaves {usable / 2**30:.2f} GiB. Use a smaller model, more GPUs "
            f"(--tensor-parallel-size){fix_lora}, or a higher --gpu-memory-utilization")


def usable_gpu_memory(device: torch.device, gpu_memory_utilization: float) -> tuple[int, int, int]:
    """(usable, total, in use) bytes: ``gpu_memory_utilization`` of the GPU less what is in use now."""
    free, total = torch.cuda.mem_get_info(device)
    return int(total * gpu_memory_utilization) - (total - free), total, total - free


def gpu_budget(device: torch.device, gpu_memory_utilization: float, activation_bytes: int) -> int:
    """What the GPU has left under ``gpu_memory_utilization`` after weights and the
    activations measured by a profiling forward."""
    return usable_gpu_memory(device, gpu_memory_utilization)[0] - activation_bytes


@dataclass(slots=True)
class CacheConfig:
    """How every rank sizes its KV cache (EngineConfig's fields, as plain data a
    worker process can be handed)."""
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None   # per rank
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    profile_tokens: int = 8192                 # the profiling forward: a full step's tokens
    profile_rows: int = 256                    # and its sampled rows
    ranks_per_node: int = 1                    # CPU ranks share one machine's default budget
    graph_tokens: int = 0                      # CUDA graphs' largest decode batch (their pool)
    max_num_seqs: int = 256                    # with max_model_len: what the CPU default may hold
    max_model_len: int | None = None
    profile_logprobs: int = 20                 # the most top logprobs a row may ask for (max_logprobs; -1: all)


def kv_budget(cache: CacheConfig, spec: KVCacheSpec, weight_bytes: int, device: torch.device,
              max_position_embeddings: int, profile: Callable[[], tuple[int, int]]) -> tuple[int | None, int]:
    """(the bytes one rank's KV cache may take, the bytes it leaves the CUDA graphs'
    pool). The budget: ``kv_cache_memory_bytes`` if given (None: ``num_kv_blocks``
    decides); on a GPU what ``gpu_memory_utilization`` leaves after the weights and
    ``profile()``'s (step activations, graphs' pool): the model's profiling forwards,
    run only here; on the CPU the default budget (default_cpu_budget)."""
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes, 0
    if cache.num_kv_blocks is not None:
        return None, 0  # the block count decides; nothing to measure
    if device.type == "cuda":
        activations, graph_pool = profile()
        return gpu_budget(device, cache.gpu_memory_utilization, activations + graph_pool), graph_pool
    # No more than max_num_seqs requests of max_model_len tokens could ever
    # use: a small model need not hold (and zero) gigabytes it cannot fill.
    longest = cache.max_model_len or max_position_embeddings
    usable = cache.max_num_seqs * -(-longest // cache.block_size) * spec.bytes_per_block
    return min(default_cpu_budget(weight_bytes * cache.ranks_per_node) // cache.ranks_per_node, usable), 0


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, K and V of shape [num_blocks, block_size, num_kv_heads, head_dim]: one tensor
    passed as both where spec.one_tensor (MLA's latent)."""
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    caches = []
    for _ in range(spec.num_layers):
        k = torch.zeros(shape, dtype=spec.dtype, device=device)
        caches.append((k, k if spec.one_tensor else torch.zeros(shape, dtype=spec.dtype, device=device)))
    return caches


def log_plan(plan: KVCachePlan, spec: KVCacheSpec, weight_bytes: int, max_model_len: int, per_request: int,
             null_blocks: int = 0) -> None:
    logger.info("[kvcache] %s", plan.describe(spec, weight_bytes, max_model_len, per_request, null_blocks))
