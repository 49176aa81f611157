"""Scheduler layer: who runs this step, and how many tokens each.

This module owns the waiting and running queues, the request states, the token
budget of a step, chunked prefill, preemption, and admission against KV
capacity (by asking the block manager). It is vLLM v1's scheduler in small:
every step is a list of (request, num_new_tokens) in which decodes (1 token)
and prefill chunks (many) share one forward pass. Each scheduled request
carries its block table, so the engine hands the model runner its inputs
without ever asking the block manager itself.

On a request's path: the engine's ``add_request`` puts it in the waiting queue
(``Scheduler.add_request``); each step ``LLMEngine.schedule_step`` calls
``Scheduler.schedule``, which asks kvcache's ``BlockManager`` for prefix-cache hits
(``get_computed_blocks``) and slots (``allocate_slots``); the ``SchedulerOutput`` it
returns becomes the model runner's inputs in ``LLMEngine.build_inputs``. When the
step lands the engine ends finished requests with ``finish_request``, which frees
their blocks.

Rules:
* running requests first, in admission order, then waiting ones in arrival order,
  while the token budget (``max_num_batched_tokens``), ``max_num_seqs`` and the
  free blocks last;
* a prompt longer than what is left of the budget is prefilled in chunks (or, without chunked
  prefill, waits for a step with room for all of it);
* when a running request needs a block and none is free, the most recently
  admitted running request is preempted: its blocks are freed and it goes back
  to the front of the waiting queue, to be recomputed (its cached prefix blocks
  may still hit).
* vLLM's ``priority`` policy orders both queues by (priority, arrival) instead,
  lower values first: the one preempted is the running request last in that order,
  and a preempted one waits in its place by it.
* speculative decoding: a running request's draft tokens (Request.spec_token_ids) ride
  in its decode's chunk, counted in the budget and given slots as any token is; each step
  says how many drafts the engine may propose after it (vLLM's num_spec_tokens_to_schedule:
  num_speculative_tokens, or with a dynamic schedule the k for this step's batch size);
* with LoRA, the running requests use at most ``max_loras`` distinct adapters (the
  device's slots), so every step does: as vLLM's, a waiting request whose adapter
  would be one too many is passed over, in its place, until one of them finishes;
* async scheduling: a request's sampled token may still be on the device when the
  next step is scheduled (``Request.num_output_placeholders``): that token is
  scheduled as its next input all the same; a step dropped before its launch takes
  back the prefix hashes of the blocks it was to write (``drop_unwritten``);
* with a sliding window on every layer, the blocks no window still reads go back
  to the pool as a request moves on (``BlockManager.free_skipped_blocks``).

It does not import torch: it moves request objects and integers only.
"""
from __future__ import annotations

import bisect
import enum
import heapq
import itertools
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # type hints only: the scheduler imports neither the engine nor (through kvcache) torch
    from nanoserve.engine import Request
    from nanoserve.kvcache import BlockManager, KVCacheStats

logger = logging.getLogger("nanoserve.scheduler")


class RequestStatus(enum.Enum):
    """Each member's value, and its OpenAI finish_reason (None while not finished).
    ``finish_reason`` and ``is_finished`` are plain attributes: every step reads
    them for every request."""
    WAITING = "waiting", None
    RUNNING = "running", None
    PREEMPTED = "preempted", None  # back in the waiting queue, to be recomputed
    FINISHED_STOPPED = "finished_stopped", "stop"
    FINISHED_LENGTH = "finished_length", "length"
    FINISHED_REPETITION = "finished_repetition", "repetition"  # vLLM's repetition_detection
    FINISHED_ABORTED = "finished_aborted", "abort"

    def __new__(cls, value: str, finish_reason: str | None):
        member = object.__new__(cls)
        member._value_ = value
        member.finish_reason = finish_reason
        member.is_finished = finish_reason is not None
        return member


SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    policy: str = "fcfs"
    max_loras: int | None = None  # distinct LoRA adapters the running requests may use (None: LoRA is off)
    num_spec_tokens: int = 0      # speculative decoding's num_speculative_tokens (0: off)
    # vLLM's dynamic speculative decoding: batch size -> drafts a step allows, 1 to max_num_seqs
    # (engine.build_dynamic_sd_schedule_lookup); None: num_spec_tokens at every size
    dynamic_sd_lookup: list[int] | None = None
    # False: a prompt is computed whole in one step, never in chunks (vLLM's, for encoder models: their
    # attention is bidirectional); one that does not fit what is left of the step's budget waits
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_loras"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")


@dataclass(slots=True)
class ScheduledRequest:
    request: "Request"
    start: int            # num_computed_tokens before this step: the chunk's first position
    num_new_tokens: int
    # As vLLM's NewRequestData.block_ids: the runner needs nothing from the block
    # manager. The block manager's own list, which it never changes in place.
    block_table: list[int]
    # Whether the chunk reaches the end of the tokens (those still on the device included), so
    # the step samples a token for it (vLLM: not is_prefill_chunk). Fixed here: the request's
    # tokens grow before an async step lands.
    will_sample: bool
    # Speculative decoding: the draft tokens computed after the request's last token in this chunk
    # (vLLM's scheduled_spec_decode_tokens), those the token budget left of Request.spec_token_ids
    spec_token_ids: Sequence[int] = ()


@dataclass(slots=True)
class SchedulerOutput:
    """One step, as schedule() hands it to the engine: the chunks to compute, running
    requests first, then those admitted, and the ids preempted while making room."""
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Speculative decoding: drafts the engine may propose for each request once this step lands (vLLM's)
    num_spec_tokens_to_schedule: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache: KVCacheStats


class Scheduler:
    """vLLM v1's Scheduler in small: ``schedule()`` once a step, ``finish_request`` when
    one ends. It only moves request objects between its queues and asks the block
    manager for blocks; the engine owns what a request holds (tokens, text, outputs)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        # A queue keyed by request id: an aborted waiting request leaves it in O(1), not a scan
        # (one HTTP request may queue prompts x n of them, and a disconnect aborts them all).
        self.waiting: OrderedDict[str, Request] = OrderedDict()
        # The priority policy's order of the waiting: (priority, arrival, count, id), a finished or
        # admitted one's entry dropped when it comes to the top (a heap cannot remove from its middle)
        self.by_priority: list[tuple[int, float, int, str]] = []
        self.pushes = itertools.count()  # ties of both, in the order they came
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.families: dict[str, dict[str, None]] = {}  # n > 1: the live children's ids, by parent id
        self.num_preemptions = 0

    # ---------------------------------------------------------------- queue ops
    def add_request(self, request: "Request") -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self._wait(request)
        self.requests[request.request_id] = request
        if request.parent_id is not None:
            self.families.setdefault(request.parent_id, {})[request.request_id] = None

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Remove a request from its queue and free its blocks (finish or abort)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)  # at most max_num_seqs long
        else:
            del self.waiting[request_id]
        family = self.families.get(request.parent_id)
        if family is not None:
            del family[request_id]
            if not family:
                del self.families[request.parent_id]
        request.status = status
        self.block_manager.free(request_id)
        logger.debug("[scheduler] %s finished (%s), free blocks %d", request_id, status.value,
                     self.block_manager.num_free_blocks)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> "Request | None":
        """The unfinished request of this id, if any."""
        return self.requests.get(request_id)

    def get_request_ids(self) -> list[str]:
        """Every unfinished request's id (a copy: finishing them changes the queues)."""
        return list(self.requests)

    def family(self, parent_id: str) -> list["Request"]:
        """An n > 1 request's children still unfinished (none for any other id)."""
        return [self.requests[rid] for rid in self.families.get(parent_id, ())]

    def lora_users(self, lora_int_id: int) -> list[str]:
        """The ids of the unfinished requests that run with this LoRA adapter."""
        return [r.request_id for r in self.requests.values() if r.lora_int_id == lora_int_id]

    def drop_unwritten(self, out: SchedulerOutput) -> list[int]:
        """Take out of a step not launched yet the chunks of the requests that ended since it was
        scheduled; returns the indices of the chunks kept. The blocks a dropped chunk was to fill
        stay unwritten, so their prefix hashes, registered as it was scheduled, go. A request
        admitted in the same step on prefix-cache hits of those blocks would read KV nobody wrote
        (and cache its own blocks on it): it is preempted, to be recomputed, and its chunk goes too."""
        bm, dropped, unwritten = self.block_manager, set(), set()
        grew = True
        while grew:  # a preempted reader's own blocks are unwritten too: one reader may make another
            grew = False
            for i, s in enumerate(out.scheduled):
                if i in dropped:
                    continue
                if not s.request.status.is_finished:
                    reads = s.block_table[:bm.blocks_needed(s.start)]  # its computed prefix's blocks
                    if unwritten.isdisjoint(reads):
                        continue
                    self._preempt(s.request, out)
                dropped.add(i)
                unwritten.update(s.block_table[s.start // bm.block_size:])  # the blocks its chunk was to write
                grew = True
        bm.forget_unwritten(sorted(unwritten))
        keep = [i for i in range(len(out.scheduled)) if i not in dropped]
        out.scheduled = [out.scheduled[i] for i in keep]
        return keep

    def reject_draft_tokens(self, request: "Request", num_rejected: int) -> None:
        """A speculative step landed (vLLM's update_from_output): the drafts it rejected were computed
        but are not the request's, so its computed tokens go back to before them; their slots stay
        allocated and the next step writes over them."""
        request.num_computed_tokens -= num_rejected

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.num_preemptions,
                              self.block_manager.make_stats())

    def reset_prefix_cache(self) -> None:
        """Forget the hashes of the free blocks: after a failed step (it may have
        left KV unwritten in blocks it registered), and for LLM.reset_prefix_cache
        (vLLM's; the benchmarks' cold starts)."""
        self.block_manager.reset_prefix_cache()

    # ---------------------------------------------------------------- the step
    def schedule(self) -> SchedulerOutput:
        """The next step: running requests first (their decodes and chunks, preempting
        when blocks run out), then waiting ones while the budget lasts. Each chunk's
        ``num_computed_tokens`` advances here, before the step runs, as in vLLM."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:  # as vLLM: after a preemption, admit nothing new this step
            self._schedule_waiting(out, budget)
        out.num_spec_tokens_to_schedule = self._num_spec_tokens(len(out.scheduled))
        return out

    def _num_spec_tokens(self, batch_size: int) -> int:
        """As vLLM's scheduler: the dynamic schedule's k for the requests this step computes (decodes,
        prefill chunks and all), else num_speculative_tokens."""
        lookup = self.config.dynamic_sd_lookup
        return lookup[batch_size] if lookup is not None and batch_size > 0 else self.config.num_spec_tokens

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Runs once per running request per step: hence the locals, and one allocate_slots call
        # when the slots fit (the common case).
        bm, running, scheduled = self.block_manager, self.running, out.scheduled
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            start, end = req.num_computed_tokens, len(req.token_ids)
            if req.num_output_placeholders:  # async scheduling (vLLM's num_output_placeholders): the token
                # still on the device is computed next, but no position past the last one the request needs
                end = min(end + req.num_output_placeholders, req.max_num_tokens - 1)
            # Speculative decoding: a decode's drafts are computed after its last token, their slots and
            # blocks taken as any token's; the budget may cut them short
            spec = req.spec_token_ids
            num_new = min(end + len(spec) - start, budget)
            if num_new <= 0:  # its token in flight is its last: nothing more to compute
                i += 1
                continue
            if bm.sliding_window is not None:  # the blocks before this chunk's first window go back to the pool
                # (a step still in flight may read them: only a later step, which runs after it, writes them)
                bm.free_skipped_blocks(req.request_id, start)
            table = bm.allocate_slots(req.request_id, req.token_ids, start + num_new)
            if table is None and (table := self._preempt_until_fits(req, num_new, out)) is None:
                break  # req itself was preempted: nothing after it is left to schedule
            scheduled.append(ScheduledRequest(req, start, num_new, block_table=table,
                                              will_sample=start + num_new >= end,
                                              spec_token_ids=spec[:max(0, start + num_new - end)] if spec else ()))
            if spec:
                req.spec_token_ids = []  # the engine proposes again once this step lands
            # Advanced before the step runs: a preemption later in this schedule never picks a request
            # already scheduled, so nothing undoes it. With drafts, reject_draft_tokens moves it back
            # past the rejected ones when the step lands.
            req.num_computed_tokens = start + num_new
            budget -= num_new
            i += 1
        return budget

    def _preempt_until_fits(self, req: "Request", num_new: int, out: SchedulerOutput) -> list[int] | None:
        """Slots for ``num_new`` more tokens of ``req``, preempting the most recently
        admitted running requests (never one already scheduled: they come first)
        until they fit: its block table, or None when ``req`` itself had to go."""
        while True:
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return None
            table = self.block_manager.allocate_slots(req.request_id, req.token_ids, req.num_computed_tokens + num_new)
            if table is not None:
                return table

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        # No waiting request has a token in flight (async scheduling): one preempted with
        # a token in flight is not admitted in that schedule, and the token lands before the next.
        bm, passed, loras = self.block_manager, [], None
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self._next_waiting()
            if self.config.max_loras is not None and req.lora_int_id is not None:
                if loras is None:  # the running requests' adapters, the first time a waiting one has one
                    loras = {r.lora_int_id for r in self.running if r.lora_int_id is not None}
                if req.lora_int_id not in loras and len(loras) >= self.config.max_loras:
                    del self.waiting[req.request_id]  # passed over this step, back in its place below
                    passed.append(req)
                    continue
                loras.add(req.lora_int_id)
            hits = ([] if req.skip_reading_prefix_cache
                    else bm.get_computed_blocks(req.token_ids, req.cache_salt, req.block_hashes))
            num_computed = len(hits) * bm.block_size
            num_new = min(req.num_tokens - num_computed, budget)
            if num_new < req.num_tokens - num_computed and not self.config.enable_chunked_prefill:
                break  # it waits for a step with room for all of it (as vLLM's), and so does everyone behind it
            table = bm.allocate_slots(req.request_id, req.token_ids, num_computed + num_new, hits, req.cache_salt,
                                      req.block_hashes)
            if table is None:
                break  # no room: it waits, and so does everyone behind it (head-of-line, as vLLM's)
            bm.record_prefix_query(req.num_tokens, num_computed)
            del self.waiting[req.request_id]
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = num_computed  # reported for the first admission
            req.num_computed_tokens = num_computed + num_new
            req.status = RequestStatus.RUNNING
            self._run(req)
            out.scheduled.append(ScheduledRequest(req, num_computed, num_new, block_table=table,
                                                  will_sample=num_computed + num_new == req.num_tokens))
            budget -= num_new
            logger.debug("[scheduler] admit %s: %d tokens, %d prefix-cached, chunk %d",
                         req.request_id, req.num_tokens, num_computed, num_new)
        for req in reversed(passed):  # each was first in line when passed over: back to the front, in order
            self._wait(req, front=True)

    def _preempt(self, req: "Request", out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.block_manager.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []  # drafts follow a decode: its recomputation samples first
        self._wait(req, front=True)
        self.num_preemptions += 1
        out.preempted.append(req.request_id)
        logger.debug("[scheduler] preempt %s (recompute %d tokens later)", req.request_id, req.num_tokens)

    # ---------------------------------------------------------------- the queues' order
    def _wait(self, req: "Request", front: bool = False) -> None:
        """Into the waiting queue: at its end (FCFS; a preempted one at its front), or by priority."""
        self.waiting[req.request_id] = req
        if self.config.policy == "priority":
            heapq.heappush(self.by_priority, (req.priority, req.arrival_time, next(self.pushes), req.request_id))
        elif front:
            self.waiting.move_to_end(req.request_id, last=False)

    def _next_waiting(self) -> "Request":
        if self.config.policy != "priority":
            return next(iter(self.waiting.values()))
        heap = self.by_priority
        while heap[0][3] not in self.waiting:
            heapq.heappop(heap)  # it finished, or was admitted, since it was pushed
        return self.waiting[heap[0][3]]

    def _run(self, req: "Request") -> None:
        """Into the running list: at its end (FCFS: admission order), or by priority, so that
        the last is always the one to preempt and comes after every one scheduled before it."""
        if self.config.policy == "priority":
            bisect.insort(self.running, req, key=lambda r: (r.priority, r.arrival_time))
        else:
            self.running.append(req)
