"""The model runner only runs: it packs a scheduled batch into tensors, runs the forward, samples."""

from __future__ import annotations

import torch

from roseinfer.attention import AttentionBackend
from roseinfer.models import CausalLM, rope_row_offset
from roseinfer.sampler import PROMPT_LOGPROBS_ROWS, PendingSample, Sampler, SamplerOutput
from roseinfer.scheduler import SchedulerOutput
from roseinfer.sequence import Sequence
from roseinfer.structured_output import PendingMasks


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        attn_backend: AttentionBackend,
        num_blocks: int,
        device: torch.device,
        sampler: Sampler,
        cuda_graph_max_seqs: int = 0,
        max_blocks_per_seq: int = 0,
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
        # Decode-only steps of up to cuda_graph_max_seqs requests replay captured graphs (0: every step eager).
        self.graphs = None
        graphs_fit = attn_backend.supports_cuda_graphs and model.cuda_graphs_safe
        if cuda_graph_max_seqs and device.type == "cuda" and graphs_fit:
            from roseinfer.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(
                model, attn_backend, self.kv_caches, cuda_graph_max_seqs, max_blocks_per_seq, device
            )

    def execute(self, sched: SchedulerOutput, masks: PendingMasks | None = None) -> SamplerOutput:
        """Run one step. Returns one sampled token per scheduled request that samples, in the order of
        ``sched.scheduled`` (requests in the middle of a prefill sample nothing). ``masks``: the structured-output
        masks of those rows, filling while the forward runs."""
        return self.launch(sched, masks).result()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, masks: PendingMasks | None = None) -> PendingSample:
        """``execute`` without waiting for the device where it can: the host is free until ``result()``."""
        if self.graphs is not None and sched.num_decodes == len(sched.scheduled) <= self.graphs.max_batch:
            return self._execute_graph(sched, masks)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs = []
        prompt_rows: list[int] = []  # rows whose logits give a prompt token's logprob (prompt_logprobs)
        prompt_owners: list[tuple[Sequence, int, int]] = []  # (request, index of its first such token, count)
        rotary_rows: list[int] = []  # each token's rotary row, where it is not its position (LongRoPE)
        # Packed in the scheduler's order: its decodes first, then its prefills, as the backends expect.
        for item in sched.scheduled:
            start, end, table = item.start, item.start + item.num_tokens, item.block_ids
            if item.seq.needs_prompt_logprobs:
                # Position p gives the logprob of prompt token p + 1; those already had (a recompute) are skipped.
                first = max(start, len(item.seq.prompt_logprobs) - 1)
                last = min(end, item.seq.num_prompt_tokens - 1)
                if first < last:
                    prompt_rows += range(len(input_ids) + first - start, len(input_ids) + last - start)
                    prompt_owners.append((item.seq, first + 1, last - first))
            input_ids += item.seq.token_ids[start:end]
            positions += range(start, end)
            if self.model.long_rope_from:
                offset = rope_row_offset(item.seq.long_rope, self.model.long_rope_from)
                rotary_rows += range(start + offset, end + offset)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(item.seq)
        pos = torch.tensor(positions, device=self.device)
        meta = self.attn_backend.build_metadata(sched.scheduled, sched.num_decodes, pos, slots)
        # Copied before the forward is queued: a blocking copy after it waits for the whole forward on a GPU, and
        # the host's work on the last step's outputs would no longer run beside it.
        picked = torch.tensor(sample_rows, device=self.device) if 0 < len(sample_rows) < len(input_ids) else None
        rotary = torch.tensor(rotary_rows, device=self.device) if rotary_rows else pos
        hidden = self.model.forward(torch.tensor(input_ids, device=self.device), rotary, meta, self.kv_caches)
        if not sample_seqs:
            pending = PendingSample(SamplerOutput([], []))
        else:
            logits = self.model.compute_logits(hidden if picked is None else hidden[picked])
            pending = self.sampler.start(logits, sample_seqs, masks.get() if masks is not None else None)
        if prompt_rows:  # (after the step's sampling is queued)
            pending.prompt_logprobs = self._prompt_logprobs(hidden, prompt_rows, prompt_owners)
        return pending

    def _prompt_logprobs(
        self, hidden: torch.Tensor, rows: list[int], owners: list[tuple[Sequence, int, int]]
    ) -> list[tuple[Sequence, int, list[dict[int, float]]]]:
        """The prompt tokens' logprobs of ``rows`` (packed positions), a slice of rows at a time, per owner."""
        targets: list[int] = []
        nums: list[int] = []
        for seq, first, count in owners:
            targets += seq.token_ids[first : first + count]
            nums += [seq.params.prompt_logprobs] * count
        entries: list[dict[int, float]] = []
        for i in range(0, len(rows), PROMPT_LOGPROBS_ROWS):
            idx = torch.tensor(rows[i : i + PROMPT_LOGPROBS_ROWS], device=self.device)
            logits = self.model.compute_logits(hidden[idx])
            entries += self.sampler.prompt_logprobs(
                logits, targets[i : i + PROMPT_LOGPROBS_ROWS], nums[i : i + PROMPT_LOGPROBS_ROWS]
            )
        out, k = [], 0
        for seq, first, count in owners:
            out.append((seq, first, entries[k : k + count]))
            k += count
        return out

    def _execute_graph(self, sched: SchedulerOutput, masks: PendingMasks | None) -> PendingSample:
        """A decode-only step through the captured graph of its batch size; every request samples."""
        bs = self.block_size
        input_ids, positions, slots, tables, seqs, owners = [], [], [], [], [], []
        for item in sched.scheduled:
            p, table, seq = item.start, item.block_ids, item.seq
            input_ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            tables.append(table)
            seqs.append(seq)
            # A preempted request's table (or one a failed step's undone admission freed) is rebuilt from scratch:
            # its owner changes with its table's epoch.
            owners.append((seq, seq.table_epoch))
        rows = None
        if self.model.long_rope_from:
            rows = [p + rope_row_offset(s.long_rope, self.model.long_rope_from) for p, s in zip(positions, seqs)]
        hidden = self.graphs.run(input_ids, positions, slots, tables, owners, rows)
        logits = self.model.compute_logits(hidden)
        return self.sampler.start(logits, seqs, masks.get() if masks is not None else None)
