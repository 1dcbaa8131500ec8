"""Decode steps replayed from CUDA graphs: a small model's decode step is hundreds of tiny kernels, and launching
them one by one from Python costs more than running them.

One graph per batch-size bucket (1, 2, 4, 8, then steps of 16 up to ``max_num_seqs`` or 512), captured once at
start over persistent input buffers. A step fills the buffers of the smallest bucket that holds its batch (two
copies from pinned host memory: the per-token ints and the block tables) and replays; the padding rows have no
context and store nothing. Prefill and mixed steps, and decode batches past the largest bucket, run eagerly.

Built with ``capture=False``, the same buffers and buckets run each step eagerly instead of replaying: how a machine
without CUDA (the test suite on CPU, under Triton's interpreter) exercises everything here but the capture itself.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from roseinfer.models import CausalLM

log = logging.getLogger(__name__)


MAX_GRAPH_BATCH = 512  # larger decode batches run eager, as vLLM's past its largest capture (one capture a size)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    largest = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [s for s in (1, 2, 4, 8) if s < largest]
    sizes += list(range(16, largest, 16))
    return sorted(set(sizes + [largest]))


class DecodeGraphs:
    """The captured decode graphs of one engine, and the persistent buffers they read."""

    def __init__(
        self,
        model: CausalLM,
        attn_backend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        self.model, self.attn_backend, self.kv_caches = model, attn_backend, kv_caches
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        # Rows: input ids, positions, slots, context lengths, rotary rows (a LongRoPE model's; else positions
        # again). One pinned host copy, one device copy per step.
        pin = device.type == "cuda"  # pinning needs a CUDA device
        self.ints_host = torch.zeros(5, self.max_batch, dtype=torch.long, pin_memory=pin)
        self.ints = torch.zeros(5, self.max_batch, dtype=torch.long, device=device)
        self.tables_host = torch.zeros(self.max_batch, max_blocks_per_seq, dtype=torch.int32, pin_memory=pin)
        self.tables = torch.zeros(self.max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._ints_np, self._tables_np = self.ints_host.numpy(), self.tables_host.numpy()
        # Per row: (owner, entries written) of the table in tables_host; a steady batch copies one entry a block.
        self._rows: list[tuple[object, int]] = [(None, 0)] * self.max_batch
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays: Counter[int] = Counter()  # replays per batch size, for tests and stats
        self.out: torch.Tensor | None = None
        if capture:
            self._capture()

    def _forward(self, bs: int) -> torch.Tensor:
        ids, pos, slots, ctx, rotary = (self.ints[i, :bs] for i in range(5))
        meta = self.attn_backend.decode_metadata(pos, slots, self.tables[:bs], ctx)
        return self.model.forward(ids, rotary, meta, self.kv_caches)

    @torch.inference_mode()
    def _capture(self) -> None:
        start = time.perf_counter()
        self.ints[2].fill_(-1)  # every row padding while capturing: nothing is written to the KV cache
        pool = None
        for bs in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
            warm = self._forward(bs)  # compiles the kernels and settles the allocator before capture
            if self.out is None:
                self.out = torch.empty(self.max_batch, *warm.shape[1:], dtype=warm.dtype, device=warm.device)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.out[:bs] = self._forward(bs)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        log.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1fs",
            len(self.sizes),
            ",".join(map(str, self.sizes)),
            time.perf_counter() - start,
        )

    def bucket(self, n: int) -> int | None:
        """The batch size of the graph that runs n decodes, or None when n is past the largest."""
        return next((s for s in self.sizes if s >= n), None)

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        block_tables: list[list[int]],
        owners: list[object],
        rope_rows: list[int] | None = None,
    ) -> torch.Tensor:
        """Hidden states [n, hidden] of n decodes (one token each; context = position + 1). ``owners``: what
        each row's table belongs to (its request's state, a new object when the table is rebuilt, as after a
        preemption); a row whose owner is unchanged has only the blocks appended since copied. ``rope_rows``:
        each token's rotary row where it is not its position (LongRoPE)."""
        n = len(input_ids)
        bs = self.bucket(n)
        ints = self._ints_np
        ints[0, :n] = input_ids
        ints[1, :n] = positions
        ints[2, :n] = slots
        ints[3, :n] = positions
        ints[3, :n] += 1
        ints[4, :n] = positions if rope_rows is None else rope_rows
        ints[0:2, n:bs] = 0
        ints[4, n:bs] = 0
        ints[2, n:bs] = -1  # padding rows store nothing
        ints[3, n:bs] = 0  # and see nothing
        tables, rows = self._tables_np, self._rows
        for i, (owner, t) in enumerate(zip(owners, block_tables)):
            known = rows[i]
            done = known[1] if known[0] == owner else 0  # owners compare requests by identity
            if done < len(t):
                tables[i, done : len(t)] = t[done:]
                rows[i] = (owner, len(t))
        # The previous step's sampling synchronised with the device, so these buffers are free to refill.
        self.ints.copy_(self.ints_host, non_blocking=True)
        self.tables[:bs].copy_(self.tables_host[:bs], non_blocking=True)
        self.replays[bs] += 1
        if not self.graphs:  # built without capture: the same step, run eagerly over the same buffers
            return self._forward(bs)[:n]
        self.graphs[bs].replay()
        return self.out[:n]
