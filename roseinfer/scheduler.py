"""The scheduler decides, each step, which requests run and how many tokens each one computes.

Decodes go first, then chunks of prefills that were already started, then new requests from the waiting
queue, all under one token budget. The waiting queue is ordered by priority (lower first, as in vLLM), then by
arrival. When the KV pool runs dry, the running request that comes last in that order is preempted: its blocks are
freed and it goes back to the waiting queue (in its place by that order) to be recomputed later. A waiting request
that comes before a running one in that order takes its place when there is no slot or no blocks for it.

The step contract: ``schedule()`` says what runs (a ``SchedulerOutput``, every field fixed when it is made),
the model runner computes it, and ``update_from_output()`` is the one place that records the result on the
requests. Only the scheduler changes ``Sequence.num_computed_tokens``.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator
from dataclasses import dataclass

from roseinfer.block_manager import KVCacheManager, PrefixHit
from roseinfer.sampler import SamplerOutput
from roseinfer.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledRequest:
    """One request's part of a step. A decode computes one token and samples the next; anything else is a
    prefill (a whole prompt, a chunk of one, or a preempted request's recompute)."""

    seq: Sequence
    start: int  # position of its first token computed this step: its num_computed_tokens when scheduled
    num_tokens: int  # tokens computed this step: positions start .. start + num_tokens - 1
    samples: bool  # the step reaches its last known token, so a new token is sampled for it
    is_prefill: bool  # False for a decode (num_tokens == 1 and samples), also a prompt's last single token
    block_ids: list[int]  # its block table for this step (a copy: later allocations do not change it)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # the decodes first, then the prefills
    num_decodes: int  # scheduled[:num_decodes] are the decodes
    num_batched_tokens: int
    preempted: list[Sequence]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, long_rope_from: int = 0
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # A LongRoPE model's original length (0: none): a request longer than it rotates by the long factors.
        self.long_rope_from = long_rope_from
        self._waiting: list[Sequence] = []  # by (priority, arrival)
        self._arrivals = 0
        self._running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self._admitted: list[Sequence] = []  # admitted by the last ``schedule``: ``forget_step`` undoes them
        self.num_preemptions = 0

    # ----- read-only views for outside code --------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_unfinished(self) -> int:
        return len(self._by_id)

    def has_unfinished(self) -> bool:
        return bool(self._by_id)

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def running(self) -> Iterator[Sequence]:
        return iter(tuple(self._running))

    def waiting(self) -> Iterator[Sequence]:
        return iter(tuple(self._waiting))

    # ----- changes ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self._by_id[seq.request_id] = seq
        seq.arrival_order = self._arrivals
        self._arrivals += 1
        self._wait(seq)

    def _wait(self, seq: Sequence) -> None:
        bisect.insort(self._waiting, seq, key=_order)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take ``seq`` out of the engine and free its blocks (also used for aborts)."""
        if self._by_id.pop(seq.request_id, None) is None:
            return
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self.kv.free(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def forget_step(self) -> None:
        """The step last scheduled never ran (its forward failed, or it was interrupted before): the blocks it
        registered in the prefix cache hold no K/V, so no hash is kept (the cache refills as requests run), and a
        request admitted in it on a prefix hit starts over (the hit may be on those blocks: two requests with one
        prompt, a later sample of a request). Requests that ran before keep the K/V earlier steps wrote."""
        self.kv.reset_prefix_cache()
        for seq in self._admitted:
            if seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens > 0:
                if seq.num_preemptions == 0:  # admitted again, and counted then: not twice in the hit rate
                    self.kv.uncount_admission(seq)
                if seq.first_scheduled_at_step:  # (its time in the queue goes on: a job's timeout began at it)
                    seq.first_scheduled_time = None
                self._preempt(seq, counted=False)
        self._admitted = []

    def schedule(self) -> SchedulerOutput:
        self._admitted = []
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledRequest] = []
        prefills: list[ScheduledRequest] = []
        preempted: list[Sequence] = []
        taken: set[str] = set()  # request ids scheduled this step
        if self.long_rope_from:
            self._recompute_past_original_length()
        if self.kv.sliding_window:  # K/V that fell out of the window: their blocks go back to the pool first
            for seq in self._running:
                self.kv.free_outside_window(seq)
        preempted += self._make_room()
        num_made_room = len(preempted)

        for seq in self._step_order():
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.kv.allocate_slots(seq, n):
                victim = self._pick_victim()
                if victim.request_id in taken:  # scheduled earlier this step: its part of the step is undone
                    budget += self._unschedule(victim, decodes, prefills, taken)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self._add_scheduled(seq, n, decodes, prefills)
                taken.add(seq.request_id)
                budget -= n

        # Admit waiting requests only when nothing had to be preempted for the running ones: the pool is tight
        # otherwise (room made for a request that comes first by priority does not count).
        tight = len(preempted) > num_made_room
        while not tight and self._waiting and budget > 0 and len(self._running) < self.max_num_seqs:
            seq = self._waiting[0]
            self._choose_rope(seq)
            if seq.leader is not None and not self._leader_holds_prompt(seq.leader):
                break  # a later sample of a request: it waits to share its first sample's prompt blocks
            hit = self.kv.lookup_computed_blocks(seq)
            n = min(seq.num_tokens - hit.num_tokens, budget)
            if not self.kv.allocate_slots(seq, n, hit):
                break
            self.kv.count_admission(seq, hit)
            self._admit(seq, n, hit, decodes, prefills, taken)
            budget -= n

        return SchedulerOutput(decodes + prefills, len(decodes), self.max_num_batched_tokens - budget, preempted)

    def _choose_rope(self, seq: Sequence) -> None:
        """A request longer than a LongRoPE model's original length rotates by the long factors (its blocks hash
        from another root): set before its blocks are looked up."""
        if self.long_rope_from and not seq.long_rope and seq.num_tokens > self.long_rope_from:
            seq.long_rope = True
            seq.block_hashes = []

    def _recompute_past_original_length(self) -> None:
        """A running request that just passed a LongRoPE model's original length holds K/V rotated by the short
        factors: it is preempted, to be recomputed with the long ones, as transformers recomputes its cache then
        (once a request; counted as a preemption, which it is)."""
        for seq in [s for s in self._running if not s.long_rope and s.num_tokens > self.long_rope_from]:
            self._preempt(seq)
            self._choose_rope(seq)

    def _make_room(self) -> list[Sequence]:
        """Preempt running requests that come after the first waiting one by priority while it lacks a slot, the
        blocks of its first chunk or a budget for it: it is admitted in their place. None is preempted where even
        all of them would not let it in this step (blocks, the budget the others leave, a first sample still taking
        the prompt): their K/V would be thrown away for nothing, their slots left idle."""
        if not (self._waiting and self._running):
            return []
        head = self._waiting[0]
        self._choose_rope(head)
        later = sorted((s for s in self._running if _order(s) >= _order(head)), key=_order)
        if not later or (len(self._running) < self.max_num_seqs and self._head_fits(head)):
            return []
        if head.leader is not None and not self._leader_holds_prompt(head.leader):
            return []
        if len(self._running) - len(later) >= self.max_num_seqs or not self._head_fits(head, without=later):
            return []
        preempted: list[Sequence] = []
        while later and not (len(self._running) < self.max_num_seqs and self._head_fits(head)):
            victim = later[-1]  # the last by priority
            if len(self._running) < self.max_num_seqs and self._budget_left() == 0:
                # The budget is what it lacks, and prefills take it: a decode preempted frees a token that a prefill
                # then takes, its K/V thrown away for nothing. The last prefill by priority goes instead.
                victim = next((s for s in reversed(later) if s.num_uncomputed_tokens > 1), victim)
            later.remove(victim)
            self._preempt(victim)
            preempted.append(victim)
        return preempted

    def _budget_left(self) -> int:
        """The tokens of the step's budget the running requests leave."""
        return max(0, self.max_num_batched_tokens - sum(s.num_uncomputed_tokens for s in self._running))

    def _head_fits(self, head: Sequence, without: list[Sequence] | tuple[()] = ()) -> bool:
        """Whether the free blocks hold what the running requests take this step and then ``head``'s first chunk,
        as the admission loop would size it (after its prefix hit, within the budget they leave). ``without``:
        were these requests preempted first (their blocks and their budget back). No budget left: it does not fit."""
        budget, needed, skipped = self.max_num_batched_tokens, 0, {id(s) for s in without}
        for seq in self._step_order():
            if id(seq) in skipped:
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            needed += self._blocks_for(seq, seq.num_computed_tokens + n)
            budget -= n
        if budget == 0:  # the admission loop would take no chunk of it this step
            return False
        freed = self.kv.freed_by([s.request_id for s in without]) if without else set()
        hit = self.kv.lookup_computed_blocks(head)  # not counted in the hit-rate stats: admission counts it
        n = min(head.num_tokens - hit.num_tokens, budget)
        needed += self.kv.blocks_needed(hit.num_tokens + n) - len(hit.block_ids)
        # Hit blocks no running request holds sit in the free pool: reviving them takes them out of it.
        needed += sum(1 for b in hit.block_ids if self.kv.blocks[b].ref_count == 0 or b in freed)
        return self.kv.num_free_blocks + len(freed) >= needed

    def _step_order(self) -> list[Sequence]:
        """The running requests, decodes first, then started prefills: a long prompt never stalls tokens already
        streaming."""
        order = [s for s in self._running if s.num_uncomputed_tokens == 1]
        order += [s for s in self._running if s.num_uncomputed_tokens > 1]
        return order

    def _leader_holds_prompt(self, leader: Sequence) -> bool:
        """The first sample of a request has blocks for all of its prompt's full blocks (registered in the prefix
        cache as they are allocated), or it ended: the other samples are admitted and find them there. Without a
        prefix cache there is nothing to share, and nothing to wait for."""
        if not self.kv.enable_prefix_caching or leader.status is SequenceStatus.FINISHED:
            return True
        num_full = leader.num_prompt_tokens // self.kv.block_size
        return leader.status is SequenceStatus.RUNNING and len(self.kv.get_block_ids(leader.request_id)) >= num_full

    def _blocks_for(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs to hold ``num_tokens`` tokens."""
        held = len(self.kv.get_block_ids(seq.request_id)) if seq.status is SequenceStatus.RUNNING else 0
        return max(0, -(-num_tokens // self.kv.block_size) - held)

    def _admit(
        self,
        seq: Sequence,
        n: int,
        hit: PrefixHit,
        decodes: list[ScheduledRequest],
        prefills: list[ScheduledRequest],
        taken: set[str],
    ) -> None:
        self._waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        seq.first_scheduled_at_step = seq.first_scheduled_time is None
        if seq.first_scheduled_at_step:
            seq.first_scheduled_time = time.monotonic()
        if seq.preempted_at is not None:  # its wait after a preemption is over
            seq.preempted_s += time.monotonic() - seq.preempted_at
            seq.preempted_at = None
        # The KV manager reports the prefix hit; recording it as computed is the scheduler's job.
        seq.num_computed_tokens = hit.num_tokens
        if seq.num_preemptions == 0:  # set once, as vLLM: a recompute's hit on its own freed blocks is no cache hit
            seq.num_cached_tokens = min(hit.num_tokens, seq.num_prompt_tokens)  # (a resumed output's hit is not)
        self._running.append(seq)
        self._admitted.append(seq)
        self._add_scheduled(seq, n, decodes, prefills)
        taken.add(seq.request_id)

    def _add_scheduled(
        self, seq: Sequence, n: int, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest]
    ) -> None:
        start = seq.num_computed_tokens
        samples = start + n == seq.num_tokens
        is_prefill = not (n == 1 and samples)
        item = ScheduledRequest(seq, start, n, samples, is_prefill, list(self.kv.get_block_ids(seq.request_id)))
        (prefills if is_prefill else decodes).append(item)

    def _pick_victim(self) -> Sequence:
        """The running request that comes last by (priority, arrival), scheduled this step or not (as vLLM)."""
        if not self._running:
            raise RuntimeError("KV cache too small to run even one request; raise the KV cache memory budget")
        return max(self._running, key=_order)

    def _unschedule(
        self, seq: Sequence, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest], taken: set[str]
    ) -> int:
        """Take ``seq``'s item out of this step; returns its tokens, given back to the budget."""
        taken.discard(seq.request_id)
        # Blocks its allocation registered this step will not be written: they must not serve a prefix hit.
        self.kv.uncache_uncomputed(seq.request_id, seq.num_computed_tokens)
        for items in (decodes, prefills):
            for i, item in enumerate(items):
                if item.seq is seq:
                    del items[i]
                    return item.num_tokens
        raise ValueError(f"{seq.request_id!r} is not scheduled this step")

    def _preempt(self, seq: Sequence, counted: bool = True) -> None:
        self._running.remove(seq)
        self.kv.free(seq.request_id)
        seq.table_epoch += 1  # (counted or not: its next table is a new one)
        seq.num_computed_tokens = 0  # its K/V are gone: recomputed from the start when it is admitted again
        seq.status = SequenceStatus.WAITING
        if counted:  # (a step that never ran undoes an admission: no preemption)
            seq.num_preemptions += 1
            self.num_preemptions += 1
        if seq.num_preemptions:  # waiting again for a place: not its running time (a job's timeout)
            seq.preempted_at = time.monotonic()
        self._wait(seq)

    def update_from_output(
        self, out: SchedulerOutput, sampled: SamplerOutput, now: float
    ) -> list[tuple[Sequence, int]]:
        """Record a step's result on its requests: the tokens computed, and for each request that samples
        (in the order of ``out.scheduled``, as ``sampled`` lists them) its new token, logprobs and first-token
        time. Returns (request, new token) for those, for the engine's output processing."""
        num_samples = sum(item.samples for item in out.scheduled)
        if num_samples != len(sampled.token_ids):  # checked first: a bad output changes no request
            raise ValueError(f"{len(sampled.token_ids)} sampled tokens for {num_samples} requests that sample")
        for seq, first, entries in sampled.prompt_logprobs:
            have = seq.prompt_logprobs
            if have is not None and 0 <= len(have) - first < len(entries):  # (a recompute's are there already)
                have.extend(entries[len(have) - first :])
        new_tokens: list[tuple[Sequence, int]] = []
        i = 0
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens = item.start + item.num_tokens
            if not item.samples:
                continue
            token, logprobs = sampled.token_ids[i], sampled.logprobs[i]
            i += 1
            if seq.is_finished:  # ended while the step ran (a stop string found in its last token's text)
                continue
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if logprobs is not None and seq.logprobs is not None:
                seq.logprobs.append(logprobs)
            new_tokens.append((seq, token))
        return new_tokens


def _order(seq: Sequence) -> tuple[int, int]:
    """Who comes first: lower priority value, then earlier arrival."""
    return seq.priority, seq.arrival_order
