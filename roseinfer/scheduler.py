"""The scheduler decides, each step, which requests run and how many tokens each one computes.

Decodes go first, then chunks of prefills that were already started, then new requests from the waiting
queue, all under one token budget. When the KV pool runs dry, the newest running request is preempted:
its blocks are freed and it goes back to the front of the waiting queue to be recomputed later.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from roseinfer.block_manager import KVCacheManager
from roseinfer.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed for it in this step, starting at seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    num_batched_tokens: int
    preempted: list[Sequence]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
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
        self._waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take ``seq`` out of the engine and free its blocks (also used for aborts)."""
        if self._by_id.pop(seq.request_id, None) is None:
            return
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        taken: set[int] = set()  # id() of sequences scheduled this step; never preempted

        # Decodes first, then started prefills: a long prompt never stalls tokens already streaming.
        order = [s for s in self._running if s.num_uncomputed_tokens == 1]
        order += [s for s in self._running if s.num_uncomputed_tokens > 1]
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.kv.allocate_slots(seq, n):
                victim = self._pick_victim(taken)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, n))
                taken.add(id(seq))
                budget -= n

        # Admit waiting requests only when nothing had to be preempted: the pool is tight otherwise.
        while not preempted and self._waiting and budget > 0 and len(self._running) < self.max_num_seqs:
            seq = self._waiting[0]
            computed = self.kv.get_computed_blocks(seq)
            n = min(seq.num_tokens - len(computed) * self.kv.block_size, budget)
            if not self.kv.allocate_slots(seq, n, computed):
                break
            self._waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            taken.add(id(seq))
            budget -= n

        return SchedulerOutput(scheduled, self.max_num_batched_tokens - budget, preempted)

    def _pick_victim(self, taken: set[int]) -> Sequence:
        for seq in reversed(self._running):
            if id(seq) not in taken:
                return seq
        raise RuntimeError("KV cache too small to run even one request; raise the KV cache memory budget")

    def _preempt(self, seq: Sequence) -> None:
        self._running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(seq)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Record what the forward computed; sampled tokens are appended by the engine."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
