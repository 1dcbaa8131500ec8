"""Turns a batch of logits into next tokens, vectorised over the batch.

Greedy rows take the argmax. Random rows are sampled with the exponential race (argmax of p / q with
q ~ Exp(1)), which lets a seeded request draw its noise from its own generator: the same seed and prompt
then give the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from roseinfer.kernels import argmax_rows
from roseinfer.sequence import Sequence
from roseinfer.structured_output import GrammarMasks


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token id: logprob} for the sampled token and the top-N, or None when not asked for.
    logprobs: list[dict[int, float] | None]


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """A request's own generator. CUDA's Philox takes all 64 bits of a seed, the CPU's MT19937 only its low 32: there
    a seed outside [0, 2**32) is hashed down first, so seeds that differ only in their high bits still differ."""
    generator = torch.Generator(device=device)
    seed %= 2**64
    if generator.device.type == "cpu" and seed >= 2**32:
        seed = int.from_bytes(hashlib.blake2b(seed.to_bytes(8, "little"), digest_size=4).digest(), "little")
    generator.manual_seed(seed)
    return generator


def advance_generator(generator: torch.Generator, num_draws: int, vocab_size: int) -> None:
    """Move a request's generator past ``num_draws`` samples, as ``Sampler`` draws them (one ``exponential_`` of
    a float32 vocabulary-sized row per sampled token): a resumed seeded request then draws what an uninterrupted
    run would draw next."""
    row = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
    for _ in range(num_draws):
        row.exponential_(generator=generator)


class PendingSample:
    """A step's tokens on their way to the host: ``result()`` waits for them. Greedy rows on a GPU come back
    through one non-blocking copy, so the host is free until then; anything else is sampled at once."""

    def __init__(self, done: SamplerOutput | None = None, host: torch.Tensor | None = None, event=None) -> None:
        self._done, self._host, self._event = done, host, event

    def result(self) -> SamplerOutput:
        if self._done is None:
            self._event.synchronize()
            tokens = self._host.tolist()
            self._done = SamplerOutput(tokens, [None] * len(tokens))
        return self._done


class Sampler:
    def __init__(self, eos_token_ids: list[int], seed: int, device: torch.device) -> None:
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._pinned: torch.Tensor | None = None  # the host side of start()'s copies, grown as needed

    def start(self, logits: torch.Tensor, seqs: list[Sequence], masks: GrammarMasks | None = None) -> PendingSample:
        """Sample without waiting where that is possible (greedy rows on a GPU), else as ``__call__``."""
        plain = masks is None and all(
            s.params.greedy and not s.params.uses_penalties and s.params.min_tokens == 0 and s.params.logprobs is None
            for s in seqs
        )
        if not plain or logits.device.type != "cuda":
            return PendingSample(self(logits, seqs, masks))
        tokens = logits.float().argmax(dim=-1)
        if self._pinned is None or self._pinned.shape[0] < len(seqs):
            self._pinned = torch.empty(max(len(seqs), 256), dtype=torch.long, pin_memory=True)
        host = self._pinned[: len(seqs)]
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingSample(host=host, event=event)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], masks: GrammarMasks | None = None) -> SamplerOutput:
        params = [s.params for s in seqs]
        want_logprobs = [p.logprobs is not None for p in params]
        plain = all(p.greedy and not p.uses_penalties and p.min_tokens == 0 for p in params)
        if not any(want_logprobs) and plain and masks is None:
            return SamplerOutput(argmax_rows(logits), [None] * len(seqs))
        logits = logits.float()

        raw_logprobs = None
        if any(want_logprobs):  # the model's, under the structured output's mask (vLLM masks before its sampler)
            raw_logprobs = torch.log_softmax(logits if masks is None else self._masked(logits, masks), dim=-1)
        unconstrained = logits
        logits = logits.clone()
        self._apply_penalties(logits, seqs)
        self._block_early_stop(logits, seqs)
        if masks is not None:
            self._apply_grammar(logits, unconstrained, masks)

        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            tokens[rows] = self._sample(logits[rows], [seqs[i] for i in random_rows])
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(raw_logprobs, tokens, params))

    # ----- logits processors -----------------------------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows = [i for i, s in enumerate(seqs) if s.params.uses_penalties]
        if not rows:
            return
        vocab = logits.shape[1]
        for i in rows:  # one request's token history; cost is its length, only for penalised rows
            seq, p = seqs[i], seqs[i].params
            row = logits[i]
            if p.repetition_penalty != 1:
                seen = torch.tensor(seq.token_ids, device=logits.device).clamp_(0, vocab - 1).unique()
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.frequency_penalty or p.presence_penalty) and seq.num_output_tokens:
                out = torch.tensor(seq.output_token_ids, device=logits.device).clamp_(0, vocab - 1)
                counts = torch.zeros(vocab, device=logits.device).index_add_(
                    0, out, torch.ones(len(out), device=logits.device)
                )
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()

    def _block_early_stop(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Before min_tokens are out, EOS and stop tokens cannot be chosen."""
        vocab = logits.shape[1]
        for i, seq in enumerate(seqs):
            p = seq.params
            if seq.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids or [])
                if not p.ignore_eos:
                    banned += self.eos_token_ids
                # Ids past the vocabulary (a config's EOS, a job's stop id) can never be sampled: nothing to ban.
                banned = [t for t in banned if t < vocab]
                if banned:
                    logits[i, banned] = float("-inf")

    @staticmethod
    def _masked(logits: torch.Tensor, masks: GrammarMasks) -> torch.Tensor:
        """A copy of ``logits`` with what each constrained row's structured output forbids at -inf."""
        out = logits.clone()
        allowed = masks.allowed(logits.shape[1]).to(logits.device)
        rows = torch.tensor(masks.rows, device=logits.device)
        out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
        return out

    @staticmethod
    def _apply_grammar(logits: torch.Tensor, unconstrained: torch.Tensor, masks: GrammarMasks) -> None:
        """Tokens a row's structured output does not allow cannot be chosen. When min_tokens banned all it allows
        (the constraint is complete, only EOS may follow), the constraint wins: the row keeps what it allows."""
        allowed = masks.allowed(logits.shape[1]).to(logits.device)
        whole = len(masks.rows) == logits.shape[0]  # every row constrained: no gather, no scatter
        rows = slice(None) if whole else torch.tensor(masks.rows, device=logits.device)
        sub = logits if whole else logits[rows]
        sub.masked_fill_(~allowed, float("-inf"))
        empty = torch.isneginf(sub).all(dim=-1)
        if empty.any():
            sub[empty] = unconstrained[rows][empty].masked_fill(~allowed[empty], float("-inf"))
        if not whole:
            logits[rows] = sub

    # ----- sampling --------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.params for s in seqs]
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temps[:, None]
        rows = [i for i, p in enumerate(params) if p.uses_filters]  # the others keep their whole distribution
        if rows:
            chosen = [params[i] for i in rows]
            logits[rows] = apply_filters(
                logits[rows],
                top_k=[p.top_k if p.top_k > 0 else 0 for p in chosen],
                top_p=[p.top_p for p in chosen],
                min_p=[p.min_p for p in chosen],
            )
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                generator=self.generator
            )
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                noise[i].exponential_(generator=seq.generator)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: torch.Tensor, params: list) -> list[dict[int, float] | None]:
        out: list[dict[int, float] | None] = [None] * len(params)
        if raw is None:
            return out
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        idx = torch.tensor(rows, device=raw.device)
        sub = raw[idx]
        chosen = sub.gather(1, tokens[idx][:, None]).squeeze(1).tolist()
        k = max(params[i].logprobs for i in rows)
        top_vals, top_ids = sub.topk(k, dim=-1) if k else (sub[:, :0], sub[:, :0].long())
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        tok_list = tokens[idx].tolist()
        for j, i in enumerate(rows):
            n = params[i].logprobs
            # A structured output may allow fewer tokens than asked for: what it forbids (-inf) is no alternative.
            entry = {t: v for t, v in zip(top_ids[j][:n], top_vals[j][:n]) if v != float("-inf")}
            entry[tok_list[j]] = max(chosen[j], -9999.0)  # finite, as vLLM keeps it: JSON has no -Infinity
            out[i] = entry
        return out


def apply_filters(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Mask to -inf what top-k, top-p (nucleus) and min-p leave out, per row. 0 / 1.0 / 0.0 disable each. As vLLM
    V1: min-p and top-k first (they commute: min-p compares each probability with the largest), then top-p over
    what they kept, renormalized."""
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    ranks = torch.arange(vocab, device=device)[None, :]
    k = torch.tensor(top_k, device=device)
    k = torch.where(k > 0, k, vocab).clamp(max=vocab)
    # Every token tied with the k-th stays (as vLLM's top-k): which of equal tokens to drop is no one's to say.
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    remove = (ranks >= k[:, None]) & (sorted_logits < kth)
    # min-p in log space (p_i < min_p * p_max): no softmax needed, and min_p 0 (log -inf) drops nothing.
    remove |= sorted_logits - sorted_logits[:, :1] < torch.tensor(min_p, device=device).log()[:, None]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
    # (top_p 1 keeps all: in float32 the running sum reaches 1.0 before the vocabulary ends.)
    mass_before = probs.cumsum(dim=-1) - probs
    p = torch.tensor(top_p, device=device)[:, None]
    remove |= (mass_before >= p) & (p < 1)
    remove[:, 0] = False
    filtered = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, filtered)
