"""Scheduler unit tests, and a property-based test that drives the real
Scheduler + BlockManager with fake requests while simulating the engine
(append a token when a step reaches the end, finish and abort at random) and
checks the invariants of both after every operation.

The fake request has exactly the fields the scheduler reads and writes."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import itertools

from nanoserve.kvcache import BlockManager
from nanoserve.scheduler import RequestStatus, Scheduler, SchedulerConfig


_CLOCK = itertools.count()  # arrival times in the order requests are made


@dataclass(eq=False)
class FakeRequest:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    cache_salt: str | None = None
    skip_reading_prefix_cache: bool = False
    block_hashes: list[bytes] = field(default_factory=list)
    num_output_placeholders: int = 0
    max_num_tokens: int = 10**9
    parent_id: str | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=lambda: next(_CLOCK))
    lora_int_id: int | None = None
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def make(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
         prefix_caching=True, policy="fcfs") -> Scheduler:
    bm = BlockManager(num_blocks, block_size, prefix_caching)
    return Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, policy), bm)


def add(sched: Scheduler, rid: str, n: int, start: int = 0, priority: int = 0) -> FakeRequest:
    req = FakeRequest(rid, list(range(start, start + n)), priority=priority)
    sched.add_request(req)
    return req


def plan(out) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def num_batched_tokens(out) -> int:
    return sum(s.num_new_tokens for s in out.scheduled)


def decode(out) -> None:
    """What the engine does after a step: a token for each request that sampled."""
    for s in out.scheduled:
        if s.will_sample:
            s.request.token_ids.append(7)


# ---------------------------------------------------------------- admission and budget

def test_fcfs_admission_and_states():
    sched = make()
    a, b = add(sched, "a", 5), add(sched, "b", 3, 100)
    out = sched.schedule()
    assert plan(out) == [("a", 5), ("b", 3)]
    assert a.status == b.status == RequestStatus.RUNNING
    assert a.num_computed_tokens == 5 and num_batched_tokens(out) == 8
    assert all(s.will_sample for s in out.scheduled)


def test_duplicate_request_id_is_rejected():
    sched = make()
    add(sched, "a", 3)
    with pytest.raises(ValueError, match="already in use"):
        add(sched, "a", 3)


@pytest.mark.parametrize("field_name", ["max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_loras"])
def test_config_rejects_zero_limits(field_name):
    with pytest.raises(ValueError, match=field_name):
        SchedulerConfig(**{field_name: 0})


def test_token_budget_is_respected_and_the_rest_is_chunked():
    sched = make(max_num_batched_tokens=10)
    add(sched, "a", 6)
    add(sched, "b", 7, 100)
    add(sched, "c", 2, 200)
    out = sched.schedule()
    assert plan(out) == [("a", 6), ("b", 4)]  # b gets what is left; c waits
    assert [s.will_sample for s in out.scheduled] == [True, False]
    decode(out)
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 3), ("c", 2)]  # decode first, then the rest of b
    assert num_batched_tokens(out) <= 10


def test_chunked_prefill_samples_only_on_the_last_chunk():
    sched = make(max_num_batched_tokens=8)
    req = add(sched, "a", 20)
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        chunks.append((out.scheduled[0].start, out.scheduled[0].num_new_tokens, out.scheduled[0].will_sample))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert req.num_computed_tokens == 20


def test_output_placeholders_are_computed_up_to_the_last_needed_position():
    """Async scheduling: a request whose sampled token is still on the device is
    scheduled for that token (one, sampling) before it lands, never past
    max_num_tokens - 1 (the token in flight is then its last), and a block that the
    unknown token completes is hashed only once the token is known."""
    sched = make(block_size=4)
    a = add(sched, "a", 7)
    a.max_num_tokens = 10
    assert plan(out := sched.schedule()) == [("a", 7)] and out.scheduled[0].will_sample
    a.num_output_placeholders = 1  # step 1 launched: its token (position 7) on the device
    out = sched.schedule()
    assert plan(out) == [("a", 1)] and out.scheduled[0].will_sample and out.scheduled[0].start == 7
    hashes = sched.block_manager.req_hashes["a"]
    assert len(hashes) == 1  # block 1 (positions 4-7) is full, but position 7's token is not known yet
    a.token_ids.append(70)  # step 2 launched, then step 1 lands
    out = sched.schedule()
    assert plan(out) == [("a", 1)] and out.scheduled[0].will_sample and out.scheduled[0].start == 8
    assert len(hashes) == 2  # known now: hashed
    a.token_ids.append(71)  # step 3 launched, then step 2 lands: step 3's token will be the 10th
    assert plan(sched.schedule()) == []  # so nothing more to compute (max_num_tokens - 1 = 9 computed)
    b = add(sched, "b", 3)  # normal mode: no placeholders, the cap never binds
    assert plan(sched.schedule()) == [("b", 3)]


def test_max_num_seqs_is_respected():
    sched = make(max_num_seqs=2)
    for i in range(4):
        add(sched, f"r{i}", 3, 10 * i)
    out = sched.schedule()
    assert plan(out) == [("r0", 3), ("r1", 3)]
    assert len(sched.running) == 2 and len(sched.waiting) == 2
    decode(out)
    sched.finish_request("r0", RequestStatus.FINISHED_STOPPED)
    out = sched.schedule()
    assert plan(out) == [("r1", 1), ("r2", 3)]  # a slot opened: the next in arrival order


def test_waiting_head_that_does_not_fit_blocks_those_behind_it():
    # FCFS: a small request behind a large one does not jump the queue.
    sched = make(num_blocks=4, block_size=4)
    add(sched, "a", 8)
    add(sched, "big", 12, 100)
    add(sched, "small", 1, 200)
    out = sched.schedule()
    assert plan(out) == [("a", 8)]
    assert [r.request_id for r in sched.waiting.values()] == ["big", "small"]


def test_scheduled_requests_carry_their_block_tables_and_stats_come_from_the_scheduler():
    """The engine needs nothing from the block manager: each scheduled request
    carries its block table (which the next steps do not change), and the KV
    numbers come with the scheduler's own."""
    sched = make(block_size=4)
    add(sched, "a", 4)
    first = sched.schedule()
    assert first.scheduled[0].block_table == sched.block_manager.req_to_blocks["a"] == [0]
    decode(first)
    second = sched.schedule()  # the 5th token needs a second block
    assert second.scheduled[0].block_table == [0, 1] and first.scheduled[0].block_table == [0]
    stats = sched.make_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_preemptions) == (1, 0, 0)
    assert stats.kv_cache.num_total_blocks == 64 and stats.kv_cache.num_free_blocks == 62
    assert stats.kv_cache.peak_kv_blocks == 2 and stats.kv_cache.kv_unused_fraction_at_peak == 3 / 8


def test_prefix_hit_skips_cached_tokens_but_computes_the_last():
    sched = make(block_size=4)
    a = add(sched, "a", 8)
    decode(sched.schedule())
    b = add(sched, "b", 8)  # same 8 tokens: both blocks cached, the last token is recomputed
    out = sched.schedule()
    s = next(s for s in out.scheduled if s.request is b)
    assert (s.start, s.num_new_tokens) == (4, 4)
    assert b.num_cached_tokens == 4
    assert sched.block_manager.req_to_blocks["b"][0] == sched.block_manager.req_to_blocks["a"][0]
    assert sched.block_manager.prefix_cache_hits == 4 and a.num_cached_tokens == 0


def test_same_step_admission_can_hit_blocks_filled_in_that_step():
    sched = make(block_size=4)
    add(sched, "a", 9)
    add(sched, "b", 9)
    out = sched.schedule()
    assert plan(out) == [("a", 9), ("b", 1)]


def test_finish_and_abort_free_blocks():
    sched = make(num_blocks=8)
    add(sched, "a", 6)
    add(sched, "b", 6, 100)
    sched.schedule()
    add(sched, "c", 3, 200)  # still waiting: abort must take it out of the queue
    sched.finish_request("a", RequestStatus.FINISHED_STOPPED)
    sched.finish_request("c", RequestStatus.FINISHED_ABORTED)
    sched.finish_request("b", RequestStatus.FINISHED_LENGTH)
    sched.finish_request("b", RequestStatus.FINISHED_ABORTED)  # twice: a no-op
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 8
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert RequestStatus.FINISHED_LENGTH.is_finished and not RequestStatus.PREEMPTED.is_finished


# ---------------------------------------------------------------- preemption

def test_preempts_the_most_recently_admitted_when_blocks_run_out():
    sched = make(num_blocks=4, block_size=4)
    a, b, c = add(sched, "a", 4), add(sched, "b", 4, 100), add(sched, "c", 4, 200)
    out = sched.schedule()  # 3 of 4 blocks
    decode(out)
    out = sched.schedule()  # a's 5th token takes the last block; b needs one: c is preempted
    assert plan(out) == [("a", 1), ("b", 1)]
    assert out.preempted == ["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert list(sched.waiting.values()) == [c] and sched.running == [a, b]
    assert "c" not in sched.block_manager.req_to_blocks
    assert sched.num_preemptions == 1


def test_a_request_preempts_itself_when_it_is_the_newest():
    sched = make(num_blocks=3, block_size=4)
    a, b = add(sched, "a", 3), add(sched, "b", 8, 100)
    decode(sched.schedule())  # a: 4 tokens in 1 block, b: 9 tokens needing a 3rd block
    out = sched.schedule()
    assert plan(out) == [("a", 1)]  # a needs no new block (its 4th slot is free)
    assert out.preempted == ["b"]   # b is the newest running request: it yields itself
    assert b.status == RequestStatus.PREEMPTED and list(sched.waiting.values()) == [b]
    assert sched.block_manager.num_free_blocks == 2


def test_preempted_request_goes_to_the_front_of_the_waiting_queue():
    sched = make(num_blocks=3, block_size=4)
    add(sched, "a", 4)
    add(sched, "b", 4, 100)
    decode(sched.schedule())
    add(sched, "new", 1, 300)
    out = sched.schedule()
    assert out.preempted == ["b"]
    assert [r.request_id for r in sched.waiting.values()] == ["b", "new"]


def test_no_admission_in_a_step_that_preempted():
    # b shares a's tokens, so after its preemption it would fit again at once
    # through the prefix cache (a still holds the shared block); re-admitting it
    # in the same step would only thrash. As vLLM: nothing is admitted after a preemption.
    sched = make(num_blocks=3, block_size=4)
    add(sched, "a", 2)
    add(sched, "b", 2)
    for _ in range(3):
        out = sched.schedule()
        decode(out)
    assert sched.block_manager.num_free_blocks == 1  # a and b hold one block each
    out = sched.schedule()  # a's 5th token takes the last block; b needs one too
    assert out.preempted == ["b"] and plan(out) == [("a", 1)]
    assert sched.block_manager.get_computed_blocks(sched.requests["b"].token_ids)  # it would hit
    out = sched.schedule()
    assert ("b", 1) in plan(out)  # admitted the step after, computing only its last token


# ---------------------------------------------------------------- the priority policy (vLLM's)

@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_max_loras_passes_over_a_request_whose_adapter_is_one_too_many(policy):
    """vLLM's max_loras: the running requests use at most 2 adapters. A waiting request whose
    adapter would be a third is passed over (requests behind it go first) and keeps its place in
    line; it is admitted once the last request of an adapter finishes."""
    sched = Scheduler(SchedulerConfig(8, 64, 64, policy, max_loras=2), BlockManager(64, 4, True))
    for rid, lora in [("a", 1), ("b", 2), ("c", 3), ("base", None), ("a2", 1), ("d", 4)]:
        sched.add_request(FakeRequest(rid, list(range(len(rid) * 10, len(rid) * 10 + 4)), lora_int_id=lora))
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a", "b", "base", "a2"]
    assert list(sched.waiting) == ["c", "d"] or policy == "priority"  # its order is its heap's
    decode(out)
    sched.finish_request("b", RequestStatus.FINISHED_STOPPED)
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("base", 1), ("a2", 1), ("c", 4)] and list(sched.waiting) == ["d"]


def test_priority_admits_lower_values_first_then_by_arrival():
    sched = make(max_num_seqs=1, policy="priority")
    add(sched, "late", 2, 0, priority=1)
    add(sched, "first", 2, 10, priority=0)
    add(sched, "second", 2, 20, priority=0)
    add(sched, "urgent", 2, 30, priority=-5)
    order = []
    for _ in range(4):
        out = sched.schedule()
        order += [s.request.request_id for s in out.scheduled]
        for s in out.scheduled:
            sched.finish_request(s.request.request_id, RequestStatus.FINISHED_STOPPED)
    assert order == ["urgent", "first", "second", "late"]
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        SchedulerConfig(policy="lifo")


def test_priority_preempts_the_lowest_priority_and_it_waits_in_its_place():
    """vLLM's: the running request with the largest (priority, arrival) is preempted, though admitted
    first; back in the queue it comes before a later request of the same priority."""
    sched = make(num_blocks=4, block_size=4, policy="priority")
    low = add(sched, "low", 3, 0, priority=2)
    decode(sched.schedule())
    high, mid = add(sched, "high", 4, 100, priority=0), add(sched, "mid", 4, 200, priority=1)
    out = sched.schedule()
    assert plan(out) == [("low", 1), ("high", 4), ("mid", 4)] and sched.running == [high, mid, low]
    decode(out)
    add(sched, "low2", 1, 300, priority=2)
    out = sched.schedule()  # high's 5th token takes the last block; mid needs one: low goes
    assert out.preempted == ["low"] and plan(out) == [("high", 1), ("mid", 1)]
    assert low.status == RequestStatus.PREEMPTED and sched.running == [high, mid]
    sched.finish_request("high", RequestStatus.FINISHED_STOPPED)
    sched.finish_request("mid", RequestStatus.FINISHED_STOPPED)
    assert [s.request.request_id for s in sched.schedule().scheduled] == ["low", "low2"]


def test_preempted_request_is_recomputed_with_its_outputs_and_may_hit_the_cache():
    sched = make(num_blocks=3, block_size=4)
    a, b = add(sched, "a", 4), add(sched, "b", 7, 100)
    out = sched.schedule()
    decode(out)  # b now has 8 tokens: 2 full blocks' worth, one block cached
    out = sched.schedule()
    assert out.preempted == ["b"]
    sched.finish_request("a", RequestStatus.FINISHED_STOPPED)
    out = sched.schedule()
    s, = out.scheduled
    assert s.request is b and s.start == 4 and s.num_new_tokens == 4  # block 0 hit, the rest recomputed
    assert b.status == RequestStatus.RUNNING
    assert b.num_cached_tokens == 0  # reported for the first admission only


# ---------------------------------------------------------------- property-based

def check_invariants(sched: Scheduler, kv: dict[tuple[int, int], tuple[int, ...]]) -> None:
    bm = sched.block_manager
    bs = bm.block_size
    free = set(bm.free_blocks)
    assert len(free) == len(bm.free_blocks)
    assert all(b.ref_cnt >= 0 for b in bm.blocks)
    assert all(bm.blocks[b].ref_cnt == 0 for b in free)
    used = [b for b in bm.blocks if b.ref_cnt > 0]
    assert len(used) + len(free) == bm.num_blocks
    # Who owns what: ref counts are exactly the number of block tables holding a block.
    owners: dict[int, list[tuple[str, int]]] = {}
    for rid, table in bm.req_to_blocks.items():
        assert rid in sched.requests and sched.requests[rid].status == RequestStatus.RUNNING
        for i, b in enumerate(table):
            owners.setdefault(b, []).append((rid, i))
    for b, own in owners.items():
        assert bm.blocks[b].ref_cnt == len(own)
        if len(own) > 1:  # shared only through the prefix cache: a full, hashed, identical prefix
            assert bm.blocks[b].block_hash is not None
            (r0, i0), *rest = own
            assert all(i == i0 for _, i in rest)
            prefix = sched.requests[r0].token_ids[:(i0 + 1) * bs]
            assert len(prefix) == (i0 + 1) * bs
            assert all(sched.requests[r].token_ids[:(i0 + 1) * bs] == prefix for r, _ in rest)
    for req in sched.running:
        table = bm.req_to_blocks[req.request_id]
        assert len(table) * bs >= req.num_computed_tokens
        # Every computed token's KV in the (simulated) cache is this request's.
        for p in range(req.num_computed_tokens):
            assert kv.get((table[p // bs], p % bs)) == tuple(req.token_ids[:p + 1]), (req.request_id, p)
    for req in sched.waiting.values():
        assert req.request_id not in bm.req_to_blocks and req.num_computed_tokens == 0
    assert len(sched.running) <= sched.config.max_num_seqs
    if sched.config.policy == "priority":  # the last running is the one a preemption takes
        order = [(r.priority, r.arrival_time) for r in sched.running]
        assert order == sorted(order)
    assert set(sched.requests) == {r.request_id for r in sched.running} | {r.request_id for r in sched.waiting.values()}
    assert list(sched.waiting) == [r.request_id for r in sched.waiting.values()]
    families: dict[str, set[str]] = {}
    for rid, r in sched.requests.items():
        if r.parent_id is not None:
            families.setdefault(r.parent_id, set()).add(rid)
    assert {p: set(ids) for p, ids in sched.families.items()} == families


class EngineSim:
    """Drives the real Scheduler + BlockManager as the engine would: after each
    schedule() it "stores KV" for the scheduled tokens (a dict from slot to the
    token prefix that slot's KV was computed for), then appends a token to each
    request that sampled and finishes those that stop."""

    def __init__(self, config: dict):
        self.config = config
        self.sched = make(**config)
        self.bm = self.sched.block_manager
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}
        self.counter = 0
        self.empty_steps = 0

    def add(self, tokens: list[int]) -> None:
        tokens = tokens[:self.config["max_model_len"] - 1] or [0]
        request = FakeRequest(f"r{self.counter}", tokens)
        request.parent_id = f"p{self.counter % 6}" if self.counter % 2 else None  # families of n > 1 requests
        request.priority = self.counter * 7 % 3 - 1  # the priority policy's; FCFS never reads it
        self.sched.add_request(request)
        self.counter += 1

    def kill(self, kind: str, k: int) -> None:
        ids = list(self.sched.requests)
        if not ids:
            return
        rid = ids[k % len(ids)]
        if kind == "abort":  # waiting or running
            self.sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        elif self.sched.requests[rid].status == RequestStatus.RUNNING:
            self.sched.finish_request(rid, RequestStatus.FINISHED_STOPPED)

    def step(self, choices: list[int]) -> None:
        sched, bm, bs = self.sched, self.bm, self.bm.block_size
        had_requests = sched.has_unfinished()
        out = sched.schedule()
        event(f"preempted: {bool(out.preempted)}")
        assert num_batched_tokens(out) <= self.config["max_num_batched_tokens"]
        assert len({s.request.request_id for s in out.scheduled}) == len(out.scheduled)
        if had_requests:  # progress: a step with work runs something, or preempts to make room
            self.empty_steps = self.empty_steps + 1 if out.is_empty else 0
            assert (not out.is_empty or out.preempted) and self.empty_steps <= 1
        for s in out.scheduled:
            req = s.request
            assert s.num_new_tokens >= 1 and req.status == RequestStatus.RUNNING
            assert req.num_computed_tokens == s.start + s.num_new_tokens <= req.num_tokens
            if s.start and s.request.num_cached_tokens:
                event("prefix hit")
            table = s.block_table  # what the model runner gets: the table in force
            assert table == bm.req_to_blocks[req.request_id]
            for p in range(s.start, s.start + s.num_new_tokens):  # store_kvcache
                self.kv[(table[p // bs], p % bs)] = tuple(req.token_ids[:p + 1])
        check_invariants(sched, self.kv)  # attention: every scheduled request reads only its own KV
        for s, choice in zip(out.scheduled, choices * 8):
            if not s.will_sample:
                continue
            req = s.request
            req.token_ids.append(choice % 2)
            # The engine's stop rule at max_model_len, plus an occasional stop token.
            if req.num_tokens >= self.config["max_model_len"] or choice == 19:
                sched.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(8, 40))
    per_req = -(-max_model_len // block_size)
    config = dict(num_blocks=draw(st.integers(per_req, per_req + 3)),  # as check_fits: one request fits
                  block_size=block_size, max_num_seqs=draw(st.integers(1, 6)),
                  max_num_batched_tokens=draw(st.integers(1, 24)),
                  max_model_len=max_model_len, prefix_caching=draw(st.booleans()),
                  policy=draw(st.sampled_from(["fcfs", "priority"])))
    # Prompts from a few shared stems over a 2-token alphabet, so prefixes collide.
    stems = draw(st.lists(st.lists(st.integers(0, 1), max_size=20), min_size=1, max_size=3))
    add = st.tuples(st.just("add"), st.integers(0, len(stems) - 1), st.lists(st.integers(0, 1), max_size=12))
    steps = st.tuples(st.just("step"), st.integers(1, 12), st.lists(st.integers(0, 19), min_size=8, max_size=8))
    kill = st.tuples(st.sampled_from(["abort", "finish"]), st.integers(0, 20))
    op = st.one_of(add, add, steps, steps, kill)
    return config, stems, draw(st.lists(op, min_size=10, max_size=50))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_operations_keep_the_invariants(scenario):
    config, stems, ops = scenario
    sim = EngineSim(config)
    for op in ops:
        if op[0] == "add":
            sim.add(stems[op[1]] + op[2])
        elif op[0] == "step":
            for i in range(op[1]):
                sim.step(op[2][i % 8:] + op[2][:i % 8])
        else:
            sim.kill(*op)
        check_invariants(sim.sched, sim.kv)
    for rid in list(sim.sched.requests):
        sim.sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    check_invariants(sim.sched, sim.kv)
    assert sim.bm.num_free_blocks == sim.bm.num_blocks
    assert all(b.ref_cnt == 0 for b in sim.bm.blocks)


def test_a_waiting_prompt_is_hashed_once_not_at_every_schedule(monkeypatch):
    """A prompt that waits for free blocks is looked up in the prefix cache at every
    schedule; its block hashes are kept on the request (vLLM's Request.block_hashes),
    so each block is hashed once. With a sliding window every block of it is looked up."""
    import nanoserve.kvcache as kvcache
    calls = []
    real = kvcache.hash_block
    monkeypatch.setattr(kvcache, "hash_block", lambda parent, ids: calls.append(tuple(ids)) or real(parent, ids))
    sched = Scheduler(SchedulerConfig(8, 64, 64), BlockManager(8, 4, sliding_window=8))  # 7 blocks and the null
    first = add(sched, "a", 12)
    waiting = add(sched, "b", 28, start=100)             # all 7 blocks: waits while "a" holds any
    for expected in ([("a", 12)], [("a", 1)], [("a", 1)], [("a", 1)]):
        out = sched.schedule()
        assert plan(out) == expected and waiting.status == RequestStatus.WAITING
        decode(out)
    assert calls.count(tuple(range(100, 104))) == 1 and len(waiting.block_hashes) == 6  # hashed once
    assert waiting.block_hashes == list(sched.block_manager._hash_chain(waiting.token_ids, None))[:6]
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert plan(sched.schedule()) == [("b", 28)] and first.status == RequestStatus.FINISHED_ABORTED


def test_draft_tokens_ride_in_a_decode_within_the_budget():
    """Speculative decoding: a decode's drafts take slots and budget as any token; the budget cuts them
    short; a preempted request's are dropped (its recomputation samples before it drafts again)."""
    sched = make(num_blocks=4, block_size=4, max_num_batched_tokens=5)
    a, b = add(sched, "a", 4), add(sched, "b", 4)
    assert plan(sched.schedule()) == [("a", 4), ("b", 1)]
    assert plan(sched.schedule()) == [("b", 3)]  # b's prompt, chunked
    for r in (a, b):
        r.token_ids.append(99)
    a.spec_token_ids, b.spec_token_ids = [7, 8, 9], [5, 6]
    out = sched.schedule()
    got = [(s.request.request_id, s.num_new_tokens, list(s.spec_token_ids), s.will_sample) for s in out.scheduled]
    assert got == [("a", 4, [7, 8, 9], True), ("b", 1, [], True)]  # 1 + 3 for a; b's drafts are past the budget
    assert a.num_computed_tokens == 8 and a.spec_token_ids == [] and len(sched.block_manager.req_to_blocks["a"]) == 2
    a.num_computed_tokens = 5  # the engine's roll-back: one draft accepted
    a.token_ids += [7, 3]
    a.spec_token_ids, b.token_ids = [1, 2, 3, 4], b.token_ids + [98]
    out = sched.schedule()  # a's 1 + 4 need a third block: none is free, b is preempted
    assert plan(out) == [("a", 5)] and out.preempted == ["b"] and b.spec_token_ids == []

