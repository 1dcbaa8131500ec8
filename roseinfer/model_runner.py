"""The model runner only runs: it packs a scheduled batch into tensors, runs the forward, samples."""

from __future__ import annotations

import torch

from roseinfer.attention import AttentionMetadata
from roseinfer.kernels import kernels_for
from roseinfer.models import CausalLM
from roseinfer.sampler import Sampler, SamplerOutput
from roseinfer.scheduler import SchedulerOutput


def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * elem


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        sampler: Sampler,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.use_kernels = kernels_for(torch.empty(0, dtype=dtype, device=device)) is not None
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(model.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> SamplerOutput:
        """Run one step. Returns one sampled token per scheduled request that reached its last token,
        in the order of ``sched.scheduled`` (requests in the middle of a prefill sample nothing)."""
        bs = self.block_size
        # Decodes first, then prefill chunks, as the attention expects.
        items = [s for s in sched.scheduled if s.num_tokens == 1] + [s for s in sched.scheduled if s.num_tokens > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_ctx: list[tuple[list[int], int]] = []
        prefill_ctx: list[tuple[list[int], int, int]] = []
        sample_rows: list[int] = []
        sample_seqs = []
        for item in items:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_tokens
            table = seq.block_table
            input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            if n == 1:
                decode_ctx.append((table, start + 1))
            else:
                prefill_ctx.append((table, start, n))
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq)
        pos = torch.tensor(positions, device=self.device)
        meta = AttentionMetadata.build(bs, decode_ctx, prefill_ctx, slots, pos, self.use_kernels)
        hidden = self.model.forward(torch.tensor(input_ids, device=self.device), pos, meta, self.kv_caches)
        if not sample_seqs:
            return SamplerOutput([], [])
        if len(sample_rows) < hidden.shape[0]:
            hidden = hidden[torch.tensor(sample_rows, device=self.device)]
        out = self.sampler(self.model.compute_logits(hidden), sample_seqs)
        # Back to the scheduler's order.
        by_seq = {id(s): (t, lp) for s, t, lp in zip(sample_seqs, out.token_ids, out.logprobs)}
        ordered = [by_seq[id(s.seq)] for s in sched.scheduled if s.samples]
        return SamplerOutput([t for t, _ in ordered], [lp for _, lp in ordered])
