"""The model runner only runs: it packs a scheduled batch into tensors, runs the forward, samples."""

from __future__ import annotations

import torch

from roseinfer.attention import AttentionBackend
from roseinfer.models import CausalLM
from roseinfer.sampler import Sampler, SamplerOutput
from roseinfer.scheduler import SchedulerOutput
from roseinfer.structured_output import PendingMasks


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        attn_backend: AttentionBackend,
        num_blocks: int,
        device: torch.device,
        sampler: Sampler,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.block_size = attn_backend.block_size
        self.device = device
        self.sampler = sampler
        # Laid out as the backend reads them; the model hands each layer's pair to that same backend.
        self.kv_caches = attn_backend.allocate_kv_caches(
            model.num_layers, num_blocks, model.num_kv_heads, model.head_dim
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, masks: PendingMasks | None = None) -> SamplerOutput:
        """Run one step. Returns one sampled token per scheduled request that samples, in the order of
        ``sched.scheduled`` (requests in the middle of a prefill sample nothing). ``masks``: the structured-output
        masks of those rows, filling while the forward runs."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs = []
        # Packed in the scheduler's order: its decodes first, then its prefills, as the backends expect.
        for item in sched.scheduled:
            start, end, table = item.start, item.start + item.num_tokens, item.block_ids
            input_ids += item.seq.token_ids[start:end]
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(item.seq)
        pos = torch.tensor(positions, device=self.device)
        meta = self.attn_backend.build_metadata(sched.scheduled, sched.num_decodes, pos, slots)
        hidden = self.model.forward(torch.tensor(input_ids, device=self.device), pos, meta, self.kv_caches)
        if not sample_seqs:
            return SamplerOutput([], [])
        if len(sample_rows) < hidden.shape[0]:
            hidden = hidden[torch.tensor(sample_rows, device=self.device)]
        logits = self.model.compute_logits(hidden)
        return self.sampler(logits, sample_seqs, masks.get() if masks is not None else None)
