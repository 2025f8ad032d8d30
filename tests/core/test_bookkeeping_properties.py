"""Property tests of the block bookkeeping (no torch).

A rule-based state machine drives a BlockManager through random allocate /
append / free / preempt / cache_full_blocks operations on tiny pools, with and
without prefix caching, and checks the pool's invariants after every step. A
second property drives the Scheduler with random requests until all finish; a
third adds speculative drafts, right and wrong, to every decode (over 2,000
scheduler steps and 1,000 verify steps a run): no block leaks or stays with a
rejected draft, none enters the prefix cache, and the outputs are plain decoding's.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagedllm.engine.block_manager import BlockManager, hash_block
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence, SequenceStatus

# a tiny alphabet so that prompts share prefixes and the cache gets hits
TOKENS = st.integers(0, 2)
# publish a sequence's full blocks right after allocating it, mostly
PUBLISH = st.integers(0, 3).map(bool)


def chained_hash(seq: Sequence, i: int) -> int:
    """The design's hash of block ``i``: its tokens chained to all before it."""
    h = 0
    for j in range(i + 1):
        h = hash_block(h, seq.block_tokens(j))
    return h


def snapshot(bm: BlockManager):
    return (
        list(bm.free_blocks),
        list(bm.ref_counts),
        dict(bm.hash_to_block),
        list(bm.block_hash),
        list(bm.block_token_ids),
    )


def check_pool(bm: BlockManager, live: list[Sequence]) -> None:
    """The invariants of the pool, given every sequence that holds blocks."""
    all_blocks = set(range(bm.num_blocks))
    free = list(bm.free_blocks)
    assert len(free) == len(set(free)), "a block is in the free list twice"
    assert set(free) <= all_blocks
    held = Counter(b for s in live for b in s.block_table)
    referenced = {b for b in all_blocks if bm.ref_counts[b] > 0}
    # no block is both free and referenced; together they are the pool
    assert not (set(free) & referenced)
    assert set(free) | referenced == all_blocks
    assert bm.num_free_blocks + len(referenced) == bm.num_blocks
    # ref count == number of block tables holding the block
    for b in all_blocks:
        assert bm.ref_counts[b] == held[b], f"block {b}"
    for s in live:
        assert len(set(s.block_table)) == len(s.block_table), "a table holds a block twice"
    # the prefix cache: hash <-> block is one-to-one and consistent
    for h, b in bm.hash_to_block.items():
        assert bm.block_hash[b] == h
        assert bm.block_token_ids[b] is not None
        assert len(bm.block_token_ids[b]) == bm.block_size
    for b in all_blocks:
        h = bm.block_hash[b]
        if h is None:
            assert bm.block_token_ids[b] is None
        else:
            assert bm.hash_to_block.get(h) == b
    if not bm.enable_prefix_caching:
        assert bm.hash_to_block == {}
    # a cached block that a sequence holds holds that sequence's tokens, at a
    # full-block position, under that sequence's chained hash
    for s in live:
        for i, b in enumerate(s.block_table):
            if bm.block_hash[b] is not None:
                assert i < s.num_full_blocks
                assert bm.block_token_ids[b] == tuple(s.block_tokens(i))
                assert bm.block_hash[b] == chained_hash(s, i)


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(1, 8),
        block_size=st.integers(1, 4),
        caching=st.booleans(),
    )
    def setup(self, num_blocks, block_size, caching):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.block_size = block_size
        self.live: list[Sequence] = []  # hold blocks
        self.waiting: list[Sequence] = []  # preempted, hold none
        self.prompts: list[list[int]] = []

    # --- helpers ---------------------------------------------------------------
    def _allocate(self, seq: Sequence, publish: bool) -> None:
        predicted = self.bm.can_allocate(seq)
        before = snapshot(self.bm)
        ok = self.bm.allocate(seq)
        assert ok == predicted, "can_allocate disagrees with allocate"
        if ok and publish:
            # as the scheduler does when it admits a sequence
            self.bm.cache_full_blocks(seq, len(seq))
        event(f"allocate ok={ok} hit={ok and seq.num_cached_tokens > 0}")
        if ok:
            assert len(seq.block_table) == seq.num_blocks
            bs = self.block_size
            # hits are whole blocks, and never the block of the last token
            assert seq.num_cached_tokens % bs == 0
            assert seq.num_cached_tokens <= ((len(seq) - 1) // bs) * bs
            assert seq.num_computed_tokens == seq.num_cached_tokens
            if not self.bm.enable_prefix_caching:
                assert seq.num_cached_tokens == 0
            self.live.append(seq)
        else:
            assert snapshot(self.bm) == before, "a failed allocate changed the pool"
            assert seq.block_table == []
            self.waiting.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        tokens = list(seq.token_ids)
        self.bm.free(seq)
        seq.reset_for_recompute()
        self.live.remove(seq)
        self.waiting.append(seq)
        assert seq.token_ids == tokens and seq.block_table == []
        assert seq.num_computed_tokens == 0

    # --- rules -------------------------------------------------------------------
    @rule(data=st.data())
    def allocate(self, data):
        # prompts up to a little more than the pool holds
        cap = self.bm.num_blocks * self.block_size + 2
        tokens = data.draw(st.lists(TOKENS, min_size=1, max_size=min(cap, 12)))
        self.prompts.append(tokens)
        self._allocate(Sequence(tokens, self.block_size), data.draw(PUBLISH))

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def allocate_sharing_a_prefix(self, data):
        # a prompt that starts like an earlier one, so the prefix cache hits
        base = data.draw(st.sampled_from(self.prompts))
        k = data.draw(st.one_of(st.just(len(base)), st.integers(1, len(base))))
        tokens = base[:k] + data.draw(st.lists(TOKENS, max_size=2 * self.block_size))
        self._allocate(Sequence(tokens, self.block_size), data.draw(PUBLISH))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def readmit(self, data):
        seq = data.draw(st.sampled_from(self.waiting))
        self.waiting.remove(seq)
        self._allocate(seq, data.draw(PUBLISH))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=TOKENS)
    def append(self, data, token):
        seq = data.draw(st.sampled_from(self.live))
        # as in the engine: the step that produced the last token wrote the
        # K/V of every token before it
        seq.num_computed_tokens = len(seq)
        old_blocks = list(seq.block_table)
        seq.append_token(token)
        write_from = seq.num_computed_tokens // self.block_size
        shared = [i for i in range(write_from, len(old_blocks)) if self.bm.ref_counts[old_blocks[i]] > 1]
        missing = seq.num_blocks - len(seq.block_table)
        fits = missing + len(shared) <= self.bm.num_free_blocks
        before = snapshot(self.bm)
        assert self.bm.can_append_slot(seq) == fits
        ok = self.bm.append_slot(seq)
        assert ok == fits
        if ok:
            copies = self.bm.take_copies()
            assert len(seq.block_table) == seq.num_blocks
            for i, old in enumerate(old_blocks):
                if i in shared:
                    # copy-on-write: a private copy replaces the shared block
                    new = seq.block_table[i]
                    assert new != old and self.bm.ref_counts[new] == 1
                    assert (old, new) in copies
                    event("copy-on-write")
                else:
                    assert seq.block_table[i] == old
            assert len(copies) == len(shared)
            # at most one new block per token, and only at a block boundary
            assert len(seq.block_table) - len(old_blocks) == (
                1 if (len(seq) - 1) % self.block_size == 0 else 0
            )
        else:
            event("append_slot failed")
            assert snapshot(self.bm) == before
            assert seq.block_table == old_blocks
            # the scheduler's answer: give the pool back and recompute later
            self._preempt(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = parent.fork(index=parent.index + 1)
        refs_before = list(self.bm.ref_counts)
        free_before = self.bm.num_free_blocks
        self.bm.fork(parent, child)
        # sharing takes no block from the pool
        assert self.bm.num_free_blocks == free_before
        assert child.block_table == parent.block_table
        for b in set(parent.block_table):
            assert self.bm.ref_counts[b] == refs_before[b] + parent.block_table.count(b)
        self.live.append(child)
        event("fork")

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def cache(self, data):
        seq = data.draw(st.sampled_from(self.live))
        num_tokens = data.draw(st.integers(0, len(seq)))
        cached_before = dict(self.bm.hash_to_block)
        free_before = list(self.bm.free_blocks)
        self.bm.cache_full_blocks(seq, num_tokens)
        # publishing only adds entries and never moves blocks
        assert list(self.bm.free_blocks) == free_before
        for h, b in cached_before.items():
            assert self.bm.hash_to_block[h] == b

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        n_free = self.bm.num_free_blocks
        # blocks no other live sequence holds come back
        others = Counter(b for s in self.live if s is not seq for b in s.block_table)
        private = [b for b in seq.block_table if others[b] == 0]
        self.bm.free(seq)
        self.live.remove(seq)
        assert seq.block_table == []
        assert self.bm.num_free_blocks == n_free + len(private)
        # blocks holding a cached hash go to the tail, last block first; the others
        # join the empty blocks, which come out lowest id first, before any cached one
        free = list(self.bm.free_blocks)
        cached = [b for b in private if self.bm.block_hash[b] is not None]
        if cached:
            assert free[-len(cached) :] == cached[::-1]
        empty = [b for b in free if self.bm.block_hash[b] is None]
        assert free[: len(empty)] == sorted(empty)
        assert set(private) - set(cached) <= set(empty)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data):
        self._preempt(data.draw(st.sampled_from(self.live)))

    @rule(roll=st.integers(0, 4))
    def reset_prefix_cache(self, roll):
        if roll:
            return  # rarely: it empties the cache the other rules try to hit
        self.bm.reset_prefix_cache()
        assert self.bm.hash_to_block == {}

    # --- invariants -------------------------------------------------------------
    @invariant()
    def pool_is_consistent(self):
        if hasattr(self, "bm"):
            check_pool(self.bm, self.live)
            for s in self.waiting:
                assert s.block_table == []

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for s in list(self.live):
            self.bm.free(s)
            self.live.remove(s)
            check_pool(self.bm, self.live)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.ref_counts == [0] * self.bm.num_blocks


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None
)
TestBlockManagerMachine = BlockManagerMachine.TestCase


# --- the scheduler end to end ---------------------------------------------------
request = st.tuples(
    st.integers(0, 6),  # the step it arrives at
    st.lists(TOKENS, min_size=1, max_size=10),  # prompt
    st.integers(1, 6),  # max tokens
    st.booleans(),  # shares its arrival key with the previous request (n > 1)
)


# the pool and batch shapes both scheduler properties draw from
POOL_SHAPES = {"block_size": st.integers(1, 4), "caching": st.booleans(), "max_num_seqs": st.integers(1, 4)}


@settings(max_examples=200, deadline=None)
@given(
    **POOL_SHAPES,
    extra_blocks=st.integers(0, 6),
    extra_tokens=st.integers(-12, 8),
    requests=st.lists(request, min_size=1, max_size=8),
)
def test_scheduler_runs_every_request_to_completion(
    block_size, extra_blocks, caching, max_num_seqs, extra_tokens, requests
):
    # liveness needs: the pool can hold any one sequence at its longest (its
    # final token's K/V is never written). The token budget may be smaller
    # than a prompt (down to 1): such prompts are prefilled in chunks
    longest = max(len(p) + m - 1 for _, p, m, _ in requests)
    num_blocks = -(-longest // block_size) + extra_blocks
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    budget = max(1, longest + extra_tokens)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)

    def gen(idx: int, k: int) -> int:
        return (idx * 7 + k * 3) % 3  # the k-th output of request idx

    seqs: list[Sequence] = []
    max_tokens: dict[int, int] = {}
    arrival = 0
    for idx, (_, prompt, m, tie) in enumerate(requests):
        if not (tie and idx):
            arrival += 1
        s = Sequence(prompt, block_size, request_id=str(idx), arrival=arrival)
        seqs.append(s)
        max_tokens[s.seq_id] = m
    pending = sorted(range(len(requests)), key=lambda i: requests[i][0])

    step_no = 0
    limit = 10 + sum(len(p) + m for _, p, m, _ in requests) * 4
    while pending or sched.has_unfinished():
        assert step_no < limit, "the scheduler stopped making progress"
        while pending and requests[pending[0]][0] <= step_no:
            sched.add(seqs[pending.pop(0)])
        step_no += 1
        if not sched.has_unfinished():
            continue
        running_before = set(map(id, sched.running))
        out = sched.schedule()
        # something always runs: the pool fits the oldest request alone
        assert not out.is_empty
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(out.scheduled) <= max_num_seqs
        scheduled = [s.seq for s in out.scheduled]
        assert len(set(map(id, scheduled))) == len(scheduled)
        if out.preempted:
            event("scheduler: preemption")
            # no admissions in a step that preempted: only old runners run
            assert all(id(s.seq) in running_before for s in out.scheduled)
            # the preempted wait at the front, oldest first
            n = len(out.preempted)
            assert list(sched.waiting)[:n] == sorted(
                out.preempted, key=lambda q: (q.arrival, q.seq_id)
            )
        for s in out.scheduled:
            seq = s.seq
            if s.num_new_tokens > 1 and s.num_computed_tokens > 0:
                event("scheduler: prefill with a prefix hit or a later chunk")
            if not s.samples:
                event("scheduler: a prompt in chunks")
                # only the budget or an empty pool cuts a prompt (or a
                # preempted sequence's recomputation) short; the budget cuts one per step
                assert out.num_batched_tokens == sched.max_num_batched_tokens or bm.num_free_blocks == 0
                if bm.num_free_blocks > 0:
                    assert sum(1 for x in out.scheduled if not x.samples) == 1
                else:
                    event("scheduler: a chunk cut by the pool")
            assert seq.status == SequenceStatus.RUNNING and seq not in out.preempted
            assert s.num_computed_tokens == seq.num_computed_tokens
            assert s.num_computed_tokens + s.num_new_tokens <= len(seq)
            assert s.samples == (s.num_computed_tokens + s.num_new_tokens == len(seq))
            # blocks for what is computed through this step, no more (chunks take theirs as they come)
            assert len(seq.block_table) == -(-(s.num_computed_tokens + s.num_new_tokens) // seq.block_size)
        for p in out.preempted:
            assert p.status == SequenceStatus.WAITING and p.block_table == []
            assert p.num_computed_tokens == 0
        check_pool(bm, sched.running)
        for w in sched.waiting:
            assert w.block_table == []

        sched.update(out)
        for s in out.scheduled:
            seq = s.seq
            if not s.samples:
                continue
            seq.append_token(gen(int(seq.request_id), seq.num_output_tokens))
            if seq.num_output_tokens == max_tokens[seq.seq_id]:
                sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
        check_pool(bm, sched.running)

    for idx, s in enumerate(seqs):
        m = max_tokens[s.seq_id]
        assert s.status == SequenceStatus.FINISHED_LENGTH
        assert s.num_output_tokens == m
        assert s.output_token_ids == [gen(idx, k) for k in range(m)]
        assert s.prompt_token_ids == requests[idx][1]
        assert s.block_table == []
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.ref_counts == [0] * num_blocks
    check_pool(bm, [])


# --- speculative drafts through the scheduler ------------------------------------
WRONG = 100  # drafts the "model" never emits start here (its tokens are TOKENS' 0..2), so one is easy to see


class DrawnDrafts:
    """A draft source whose drafts hypothesis draws: a run of the model's own next tokens (they will be accepted),
    then wrong ones (rejected), never more than the request's remaining output allows."""

    def __init__(self, data: st.DataObject, gen, max_tokens: dict[int, int]) -> None:  # noqa: ANN001
        self.data, self.gen, self.max_tokens = data, gen, max_tokens

    def propose(self, seq: Sequence, max_num_tokens: int, batch_size: int) -> list[int]:
        room = min(max_num_tokens, self.max_tokens[seq.seq_id] - seq.num_output_tokens - 1)
        k = self.data.draw(st.integers(0, max(0, room)), label="drafts")
        right = self.data.draw(st.integers(0, k), label="right drafts")
        n, idx = seq.num_output_tokens, int(seq.request_id)
        return [self.gen(idx, n + i) for i in range(right)] + [WRONG + i for i in range(k - right)]


def verify(bm: BlockManager, seq: Sequence, gen) -> int:  # noqa: ANN001
    """What the engine does after a verify step, with greedy acceptance against ``gen``: keep the drafts up to
    the first wrong one, append the model's token after them, roll the computed length back; returns how many
    drafts were accepted."""
    drafts = seq.discard_draft_tokens()
    n, idx = seq.num_output_tokens, int(seq.request_id)
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == gen(idx, n + accepted):
        accepted += 1
    for t in [*drafts[:accepted], gen(idx, n + accepted)]:
        seq.append_token(t)
    bm.rollback(seq, len(seq) - 1)
    return accepted


@settings(max_examples=150, deadline=None)
@given(
    **POOL_SHAPES,
    extra_blocks=st.integers(0, 8),
    requests=st.lists(st.tuples(st.lists(TOKENS, min_size=1, max_size=8), st.integers(1, 16)), min_size=1, max_size=8),
    data=st.data(),
)
def test_drafts_leave_no_block_behind_and_never_reach_the_prefix_cache(
    block_size, extra_blocks, caching, max_num_seqs, requests, data
):
    """Random drafts (partly right, partly wrong) on every decode of a random batch, with chunked prompts,
    prefix caching and preemption in tiny pools: after every step the pool is consistent and no rejected draft
    sits in a published block; every request ends with plain decoding's tokens and the pool whole."""
    gen = lambda idx, k: (idx * 5 + k * 2) % 3  # noqa: E731 (the model: request idx's k-th output token)
    longest = max(len(p) + m - 1 for p, m in requests)
    bm = BlockManager(-(-longest // block_size) + extra_blocks, block_size, enable_prefix_caching=caching)
    seqs = [Sequence(p, block_size, request_id=str(i), arrival=i) for i, (p, _) in enumerate(requests)]
    max_tokens = {s.seq_id: m for s, (_, m) in zip(seqs, requests)}
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max(8, longest),
                      drafts=DrawnDrafts(data, gen, max_tokens))
    for s in seqs:
        sched.add(s)
    num_steps, limit = 0, 20 + sum(len(p) + m for p, m in requests) * 4
    while sched.has_unfinished():
        num_steps += 1
        assert num_steps < limit, "the scheduler stopped making progress"
        out = sched.schedule()
        if out.preempted:
            event("drafts: preemption")
        sched.update(out)
        for s in out.scheduled:
            seq = s.seq
            if not s.samples:
                continue
            if s.num_draft_tokens:
                accepted = verify(bm, seq, gen)
                event("drafts: all accepted" if accepted == s.num_draft_tokens else
                      "drafts: partly rejected" if accepted else "drafts: all rejected")
            else:
                seq.append_token(gen(int(seq.request_id), seq.num_output_tokens))
            if seq.num_output_tokens >= max_tokens[seq.seq_id]:
                sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
        check_pool(bm, sched.running)
        for seq in sched.running:  # exactly the blocks plain decoding would hold: none kept for rejected drafts
            assert len(seq.block_table) == -(-seq.num_computed_tokens // block_size)
        published = [t for t in bm.block_token_ids if t is not None]
        assert all(t < WRONG for tokens in published for t in tokens), "a rejected draft reached the prefix cache"
    for i, s in enumerate(seqs):
        assert s.output_token_ids == [gen(i, k) for k in range(requests[i][1])]  # lossless: plain decoding's tokens
    assert bm.num_free_blocks == bm.num_blocks and bm.ref_counts == [0] * bm.num_blocks
