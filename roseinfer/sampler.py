"""Turns a batch of logits into next tokens, vectorised over the batch.

Greedy rows take the argmax. Random rows are sampled by inverting their distribution's running sum at one uniform
draw each, from the request's own generator when it has a seed: the same seed and prompt then give the same tokens
whatever else shares the batch (bit for bit on the CPU's own kernels; the PyTorch attention path, a GPU's or
ROSEINFER_CPU_KERNELS=0, pads across the batch and its logits move by ~1e-6 with it: a near tie may go either way),
and a resumed request replays one draw per token. (An exponential race, argmax of
p / q with q ~ Exp(1), draws a whole vocabulary of noise per token: on a CPU that alone cost more than the rest.)
On a CPU the C kernel ``kernels.sample_rows`` does a row's temperature, filters and draw in one place from the same
uniform numbers (PyTorch's ops took ten passes over the vocabulary and a float64 copy of it: a 64-row step sampled
at temperature 0.7 and top_p 0.9 in 47 ms against 3 in the kernel); the PyTorch ops run on a GPU.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from roseinfer.kernels import RowProcessors, argmax_rows, can_sample_rows, logprob_rows, sample_rows
from roseinfer.sequence import Sequence
from roseinfer.structured_output import GrammarMasks


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token id: logprob} for the sampled token and the top-N, or None when not asked for.
    logprobs: list[dict[int, float] | None]
    # (request, index in its prompt of the first entry, entries): prompt tokens' logprobs this step computed.
    prompt_logprobs: list[tuple[Sequence, int, list[dict[int, float]]]] = field(default_factory=list)


# Prompt positions whose logits are made at once for prompt_logprobs: a whole chunk's would be tokens x vocabulary.
PROMPT_LOGPROBS_ROWS = 256


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """A request's own generator. CUDA's Philox takes all 64 bits of a seed, the CPU's MT19937 only its low 32: there
    a seed outside [0, 2**32) is hashed down first, so seeds that differ only in their high bits still differ."""
    generator = torch.Generator(device=device)
    seed %= 2**64
    if generator.device.type == "cpu" and seed >= 2**32:
        seed = int.from_bytes(hashlib.blake2b(seed.to_bytes(8, "little"), digest_size=4).digest(), "little")
    generator.manual_seed(seed)
    return generator


def draw_uniform(generator: torch.Generator, n: int = 1) -> torch.Tensor:
    """``n`` float64 draws in [0, 1) from ``generator``, on its device: what ``Sampler`` takes per sampled token."""
    return torch.rand(n, dtype=torch.float64, generator=generator, device=generator.device)


def advance_generator(generator: torch.Generator, num_draws: int) -> None:
    """Move a request's generator past ``num_draws`` samples, as ``Sampler`` draws them (one ``draw_uniform`` per
    sampled token): a resumed seeded request then draws what an uninterrupted run would draw next."""
    if generator.device.type == "cpu":  # MT19937 draws serially: n at once are the same as n one by one
        if num_draws:
            draw_uniform(generator, num_draws)
        return
    for _ in range(num_draws):  # Philox advances per call, not per number
        draw_uniform(generator)


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device`` without waiting for the device: on a GPU through pinned memory and a
    non-blocking copy (a plain copy there waits for every kernel queued before it, the whole forward)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``, as ``to_device`` copies a list."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class PendingSample:
    """A step's tokens (and logprobs) on their way to the host: ``result()`` waits for them. On a GPU everything a
    step samples comes back through non-blocking copies to pinned memory behind one event, so the host is free
    until then and waits once; on a CPU it is there already."""

    def __init__(
        self,
        done: SamplerOutput | None = None,
        host: list[torch.Tensor] | None = None,
        event=None,
        finish: Callable[[list[list]], SamplerOutput] | None = None,
    ) -> None:
        self._done, self._host, self._event, self._finish = done, host, event, finish
        self.prompt_logprobs: list[tuple[Sequence, int, list[dict[int, float]]]] = []  # given to the result

    def wait(self) -> None:
        """Until the device is done with the step (its pinned inputs free to refill), its result left unread."""
        if self._done is None and self._event is not None:
            self._event.synchronize()

    def result(self) -> SamplerOutput:
        if self._done is None:
            if self._event is not None:
                self._event.synchronize()
            self._done = self._finish([t.tolist() for t in self._host])
        self._done.prompt_logprobs = self.prompt_logprobs
        return self._done


def _tokens_only(lists: list[list]) -> SamplerOutput:
    return SamplerOutput(lists[0], [None] * len(lists[0]))


class Sampler:
    def __init__(self, eos_token_ids: list[int], seed: int, device: torch.device) -> None:
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], masks: GrammarMasks | None = None) -> SamplerOutput:
        return self.start(logits, seqs, masks).result()

    def start(self, logits: torch.Tensor, seqs: list[Sequence], masks: GrammarMasks | None = None) -> PendingSample:
        """Queue the step's sampling on the device and return at once: nothing here waits for the device (no
        blocking copy, no value read back, no shape that depends on one), so the host's one wait is ``result()``."""
        params = [s.params for s in seqs]
        want_logprobs = [p.logprobs is not None for p in params]
        processed = any(p.uses_penalties or p.min_tokens or p.logit_bias for p in params)
        if masks is None:
            if not processed and not any(want_logprobs) and all(p.greedy for p in params):
                if logits.device.type != "cuda":
                    return PendingSample(SamplerOutput(argmax_rows(logits), [None] * len(seqs)))
                return self._fetch([logits.float().argmax(dim=-1)], _tokens_only)
            if can_sample_rows(logits):  # straight from the model's logits: no float32 copy of the batch
                processors = self._row_processors(seqs, logits.shape[1]) if processed else None
                tokens = self._sample_rows(logits, seqs, processors)
                if not any(want_logprobs):
                    return self._fetch([tokens], _tokens_only)
                return PendingSample(self._kernel_logprobs(logits, tokens, params))
        logits = logits.float()

        raw_logprobs = None
        if any(want_logprobs):  # the model's, under the structured output's mask (vLLM masks before its sampler)
            raw_logprobs = torch.log_softmax(logits if masks is None else self._masked(logits, masks), dim=-1)
        unconstrained = logits
        logits = logits.clone(memory_format=torch.contiguous_format)  # (one flat view for the logit bias)
        self._apply_logit_bias(logits, seqs)
        self._apply_penalties(logits, seqs)
        self._block_early_stop(logits, seqs)
        if masks is not None:
            self._apply_grammar(logits, unconstrained, masks)

        if can_sample_rows(logits):
            tokens = self._sample_rows(logits, seqs)
        else:
            tokens = logits.argmax(dim=-1)
            random_rows = [i for i, p in enumerate(params) if not p.greedy]
            if random_rows:
                rows = to_device(random_rows, torch.long, logits.device)
                tokens[rows] = self._sample(logits[rows], [seqs[i] for i in random_rows])
        if raw_logprobs is None:
            return self._fetch([tokens], _tokens_only)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        copies, finish = self._logprobs(raw_logprobs, tokens, params, rows)
        return self._fetch([tokens, *copies], finish)

    def prompt_logprobs(self, logits: torch.Tensor, targets: list[int], nums: list[int]) -> list[dict[int, float]]:
        """Per row of ``logits`` (a prompt position's), the logprob of the prompt token that follows it and the
        top ``nums[row]`` alternatives, as a sampled token's logprobs are given (the model's distribution). Waits
        for the device: only steps that compute such prompts pay it."""
        raw = torch.log_softmax(logits.float(), dim=-1)
        chosen = raw.gather(1, to_device(targets, torch.long, raw.device)[:, None]).squeeze(1).tolist()
        k = min(max(nums), raw.shape[-1])  # (a vocabulary under 20 tokens: topk raised, and failed the step)
        top_vals, top_ids = _top_in_id_order(raw, k)
        return [
            _logprob_entry(ids, vals, n, target, value)
            for target, value, n, vals, ids in zip(targets, chosen, nums, top_vals.tolist(), top_ids.tolist())
        ]

    def _fetch(self, tensors: list[torch.Tensor], finish: Callable[[list[list]], SamplerOutput]) -> PendingSample:
        """The step's results copied to the host behind one event (on a GPU), turned into a ``SamplerOutput`` by
        ``finish`` once there."""
        if self.device.type != "cuda":
            return PendingSample(host=tensors, finish=finish)
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for h, t in zip(host, tensors):
            h.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingSample(host=host, event=event, finish=finish)

    # ----- logits processors -----------------------------------------------------------------------
    def _apply_logit_bias(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Each row's ``logit_bias`` added to its tokens' logits, all rows in one kernel (before the penalties, as
        vLLM orders them). A request's ids and biases go to the device once, not at every step."""
        device = logits.device
        rows: list[int] = []
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, seq in enumerate(seqs):
            if bias := seq.params.logit_bias:
                if seq.logit_bias is None:
                    seq.logit_bias = (
                        to_device(list(bias), torch.long, device),
                        to_device(list(bias.values()), torch.float32, device),
                    )
                rows.append(i)
                parts.append(seq.logit_bias)
        if not rows:
            return
        counts = [len(ids) for ids, _ in parts]
        row_of = torch.repeat_interleave(
            to_device(rows, torch.long, device), to_device(counts, torch.long, device), output_size=sum(counts)
        )  # (output_size given: no wait for the device to learn it)
        flat = row_of * logits.shape[1] + torch.cat([ids for ids, _ in parts])
        logits.view(-1).index_add_(0, flat, torch.cat([biases for _, biases in parts]))  # (a kernel that never waits)

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Repetition penalty over each row's prompt and output, frequency and presence penalties over its output,
        as vLLM: the penalised rows at once, from one upload of their token histories."""
        rows = [i for i, s in enumerate(seqs) if s.params.uses_penalties]
        if not rows:
            return
        vocab, device = logits.shape[1], logits.device
        seen_rows: list[int] = []  # (row, token) pairs: every token a row has seen, and each output token
        seen_ids: list[int] = []
        out_rows: list[int] = []
        out_ids: list[int] = []
        for j, i in enumerate(rows):  # cost is the penalised rows' history, as before
            seq, p = seqs[i], seqs[i].params
            if p.repetition_penalty != 1:
                seen_rows += [j] * seq.num_tokens
                seen_ids += seq.token_ids
            if (p.frequency_penalty or p.presence_penalty) and seq.num_output_tokens:
                out = seq.output_token_ids
                out_rows += [j] * len(out)
                out_ids += out
        chosen = [seqs[i].params for i in rows]
        idx = to_device(rows, torch.long, device)
        sub = logits[idx]
        # Flat (row * vocab + token) indexes, filled by index_fill_ / scatter_add_: kernels that never wait for the
        # device, as indexing with two index tensors can.
        if seen_ids:
            pairs = to_device([seen_rows, seen_ids], torch.long, device)
            flat = pairs[0] * vocab + pairs[1].clamp_(0, vocab - 1)
            seen = torch.zeros(sub.numel(), dtype=torch.bool, device=device).index_fill_(0, flat, True).view_as(sub)
            penalty = to_device([p.repetition_penalty for p in chosen], torch.float32, device)[:, None]
            sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
        if out_ids:
            pairs = to_device([out_rows, out_ids], torch.long, device)
            flat = pairs[0] * vocab + pairs[1].clamp_(0, vocab - 1)
            ones = torch.ones(flat.shape, dtype=sub.dtype, device=device)
            counts = torch.zeros(sub.numel(), dtype=sub.dtype, device=device).scatter_add_(0, flat, ones).view_as(sub)
            frequency = to_device([p.frequency_penalty for p in chosen], torch.float32, device)[:, None]
            presence = to_device([p.presence_penalty for p in chosen], torch.float32, device)[:, None]
            sub -= frequency * counts + presence * (counts > 0).float()
        logits[idx] = sub

    def _block_early_stop(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Before min_tokens are out, EOS and stop tokens cannot be chosen."""
        rows: list[int] = []
        ids: list[int] = []
        for i, seq in enumerate(seqs):
            banned = self._banned(seq, logits.shape[1])
            rows += [i] * len(banned)
            ids += banned
        if ids:
            pairs = to_device([rows, ids], torch.long, logits.device)
            # (not ``logits[rows, ids] = -inf``: on a GPU that copies the number from the host, waiting for the forward)
            logits.view(-1).index_fill_(0, pairs[0] * logits.shape[1] + pairs[1], float("-inf"))

    def _banned(self, seq: Sequence, vocab: int) -> list[int]:
        """The tokens a row cannot choose yet: EOS and its stop tokens until min_tokens are out (EOS with
        ``ignore_eos`` too, as vLLM's: the first min_tokens tokens are never EOS)."""
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            return []
        banned = list(p.stop_token_ids or []) + self.eos_token_ids
        # Ids past the vocabulary (a config's EOS, a job's stop id) can never be sampled: nothing to ban.
        return [t for t in banned if t < vocab]

    def _row_processors(self, seqs: list[Sequence], vocab: int) -> RowProcessors:
        """The logit bias, penalties and min_tokens bans of each row, for the CPU kernel to apply as
        ``_apply_logit_bias``, ``_apply_penalties`` and ``_block_early_stop`` do."""
        params = [s.params for s in seqs]
        return RowProcessors(
            bias=[p.logit_bias or {} for p in params],
            history=[self._history(s) if p.repetition_penalty != 1 else [] for s, p in zip(seqs, params)],
            repetition=[p.repetition_penalty for p in params],
            output=[
                s.output_token_ids if p.frequency_penalty or p.presence_penalty else [] for s, p in zip(seqs, params)
            ],
            frequency=[p.frequency_penalty for p in params],
            presence=[p.presence_penalty for p in params],
            banned=[self._banned(s, vocab) for s in seqs],
        )

    @staticmethod
    def _history(seq: Sequence) -> torch.Tensor:
        """Every token ``seq`` has seen (its prompt, then its output), for the repetition penalty."""
        if seq.prompt_ids is None:
            seq.prompt_ids = torch.tensor(seq.prompt_token_ids, dtype=torch.int64)
        return torch.cat((seq.prompt_ids, torch.tensor(seq.output_token_ids, dtype=torch.int64)))

    def _masked(self, logits: torch.Tensor, masks: GrammarMasks) -> torch.Tensor:
        """A copy of ``logits`` with what each constrained row's structured output forbids at -inf."""
        out = logits.clone()
        allowed = _upload(masks.allowed(logits.shape[1]), logits.device)
        rows = to_device(masks.rows, torch.long, logits.device)
        out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
        return out

    def _apply_grammar(self, logits: torch.Tensor, unconstrained: torch.Tensor, masks: GrammarMasks) -> None:
        """Tokens a row's structured output does not allow cannot be chosen. When min_tokens banned all it allows
        (the constraint is complete, only EOS may follow), the constraint wins: the row keeps what it allows."""
        allowed = _upload(masks.allowed(logits.shape[1]), logits.device)
        whole = len(masks.rows) == logits.shape[0]  # every row constrained: no gather, no scatter
        rows = slice(None) if whole else to_device(masks.rows, torch.long, logits.device)
        sub = logits if whole else logits[rows]
        sub.masked_fill_(~allowed, float("-inf"))
        # A row left with nothing takes what its mask allows of its unpenalised logits; chosen on the device (an
        # ``if`` on it would wait for the device).
        empty = torch.isneginf(sub).all(dim=-1, keepdim=True)
        fallback = unconstrained[rows].masked_fill(~allowed, float("-inf"))
        sub.copy_(torch.where(empty, fallback, sub))
        if not whole:
            logits[rows] = sub

    # ----- sampling --------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.params for s in seqs]
        device = logits.device
        temps = to_device([p.temperature for p in params], torch.float32, device)
        logits = logits / temps[:, None]
        rows = [i for i, p in enumerate(params) if p.uses_filters]  # the others keep their whole distribution
        if rows:
            chosen = [params[i] for i in rows]
            idx = to_device(rows, torch.long, device)
            logits[idx] = apply_filters(
                logits[idx],
                top_k=[p.top_k if p.top_k > 0 else 0 for p in chosen],
                top_p=[p.top_p for p in chosen],
                min_p=[p.min_p for p in chosen],
            )
        return sample_inverse_cdf(logits, self._draws(seqs))

    def _draws(self, seqs: list[Sequence]) -> torch.Tensor:
        """One uniform draw per row: the unseeded rows' from the engine's generator, in one call; each seeded
        row's from its own."""
        device = self.generator.device
        u = torch.empty(len(seqs), dtype=torch.float64, device=device)
        unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
        if unseeded:
            u[to_device(unseeded, torch.long, device)] = draw_uniform(self.generator, len(unseeded))
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                u[i : i + 1] = draw_uniform(seq.generator)
        return u

    def _sample_rows(
        self, logits: torch.Tensor, seqs: list[Sequence], processors: RowProcessors | None = None
    ) -> torch.Tensor:
        """Every row's token in the CPU kernel: greedy rows' argmax, and the random rows' draws from the same
        uniform numbers as ``_sample`` takes (a seeded request draws the same sequence of them either way)."""
        params = [s.params for s in seqs]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        u = torch.zeros(len(seqs), dtype=torch.float64)
        if random_rows:
            u[random_rows] = self._draws([seqs[i] for i in random_rows])
        return sample_rows(
            logits,
            temperature=[p.temperature for p in params],
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params],
            u=u,
            processors=processors,
        )

    @staticmethod
    def _kernel_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: list) -> SamplerOutput:
        """The step's output with the requested logprobs of the model's logits, from the CPU kernel."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        nums = [min(params[i].logprobs, logits.shape[-1]) for i in rows]  # (past the vocabulary: unset memory)
        every = len(rows) == len(params)  # (the usual case: no copy of the batch's logits)
        chosen, top_vals, top_ids = logprob_rows(
            logits if every else logits[rows], tokens if every else tokens[rows], nums
        )
        token_list = tokens.tolist()
        out: list[dict[int, float] | None] = [None] * len(params)
        for j, (i, n, vals, ids) in enumerate(zip(rows, nums, top_vals.tolist(), top_ids.tolist())):
            out[i] = _logprob_entry(ids[:n], vals[:n], n, token_list[i], chosen[j].item())  # (past n: not filled)
        return SamplerOutput(token_list, out)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, tokens: torch.Tensor, params: list, rows: list[int]
    ) -> tuple[list[torch.Tensor], Callable[[list[list]], SamplerOutput]]:
        """The device tensors the requested logprobs are read from, and how to make the step's output of them
        (with the tokens, the first list) once they are on the host."""
        idx = to_device(rows, torch.long, raw.device)
        sub = raw[idx]
        picked = tokens[idx]
        chosen = sub.gather(1, picked[:, None]).squeeze(1)
        k = min(max(params[i].logprobs for i in rows), sub.shape[-1])  # (topk past the vocabulary raised)
        top_vals, top_ids = _top_in_id_order(sub, k)

        def finish(lists: list[list]) -> SamplerOutput:
            token_list, chosen_l, vals_l, ids_l = lists
            out: list[dict[int, float] | None] = [None] * len(params)
            for j, i in enumerate(rows):
                n = params[i].logprobs
                out[i] = _logprob_entry(ids_l[j], vals_l[j], n, token_list[i], chosen_l[j])
            return SamplerOutput(token_list, out)

        return [chosen, top_vals, top_ids], finish


TIE_MARGIN = 64  # tokens past a top k taken too: equal to the k-th, the lowest ids of them are kept


def _top_in_id_order(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` largest values and their ids, equal values in the order of their ids (the CPU kernel's):
    topk kept its own choice among tokens tied at its cut, so which tied token a row's top n held depended on its
    neighbours' widest k. From ``TIE_MARGIN`` more candidates, sorted by (value, id), reading nothing back (a tie of
    more tokens than that at the cut is still topk's to choose from)."""
    if k == 0:
        return x[:, :0], x[:, :0].long()
    vals, ids = x.topk(min(k + TIE_MARGIN, x.shape[-1]), dim=-1)
    return _in_id_order(vals, ids, k)


def _in_id_order(vals: torch.Tensor, ids: torch.Tensor, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk``'s values and ids (largest first) with equal values in the order of their ids; the first ``k``."""
    ids, by_id = ids.sort(dim=-1)
    vals, by_value = vals.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, by_value)
    return (vals, ids) if k is None else (vals[:, :k], ids[:, :k])


def _logprob_entry(top_ids: list[int], top_vals: list[float], n: int, token: int, value: float) -> dict[int, float]:
    """{token id: logprob}: the top ``n`` alternatives (of the batch's widest top, ``top_ids``), then ``token`` (the
    sampled or the prompt's) where it is not one."""
    # Ties in the order of their ids, as the CPU kernel gives them, before the cut at n (``_top_in_id_order`` took the
    # lowest ids of a tie at its cut).
    ranked = sorted(zip(top_ids, top_vals), key=lambda pair: (-pair[1], pair[0]))[:n]
    # A structured output may allow fewer tokens than asked for: what it forbids (-inf) is no alternative; nor is a
    # NaN or infinite logprob of a model's NaN or infinite logit (JSON has neither).
    entry = {t: v for t, v in ranked if math.isfinite(v)}
    entry[token] = value if math.isfinite(value) else -9999.0  # finite, as vLLM keeps it (max() let a NaN through)
    return entry


def sample_inverse_cdf(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the token where the distribution's running sum first passes ``u`` (float64 in [0, 1)) of its
    total: a draw from softmax(logits), -inf never drawn. The probabilities are summed in float64, so a token deep
    in the vocabulary keeps its share of [0, 1) (a float32 sum there moves in steps of ~6e-8)."""
    cdf = torch.softmax(logits, dim=-1).double().cumsum_(dim=-1)
    total = cdf[:, -1]
    # Kept below the total: a draw that rounds up to it would land past the last token that can be drawn.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    # A row with no distribution (a NaN, a +inf: a penalty or temperature that overflowed, a model that did) has a
    # NaN cdf, and the search lands one past the vocabulary, an id that fails the next step for the whole batch:
    # such a row takes its argmax (a NaN's place, where it has one), as the CPU kernel's rows do. Chosen on the
    # device (an ``if`` would wait for it).
    return torch.where(total.isfinite(), drawn, logits.argmax(dim=-1))


def apply_filters(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Mask to -inf what top-k, top-p (nucleus) and min-p leave out, per row. 0 / 1.0 / 0.0 disable each. As vLLM
    V1: min-p and top-k first (they commute: min-p compares each probability with the largest), then top-p over
    what they kept, renormalized."""
    if logits.device.type != "cpu":  # a GPU sorts a batch of vocabularies in microseconds, and must not wait here
        return _filters_over_sorted_vocabulary(logits, top_k, top_p, min_p)
    out = torch.empty_like(logits)
    rows = list(range(logits.shape[0]))
    for width in (256, 4096, None):  # the rows a narrower look did not settle look again, wider
        sub = logits if len(rows) == logits.shape[0] else logits[rows]
        args = ([top_k[i] for i in rows], [top_p[i] for i in rows], [min_p[i] for i in rows])
        if width is None or width >= logits.shape[1]:
            out[rows] = _filters_over_sorted_vocabulary(sub, *args)
            return out
        filtered, settled = _filters_over_candidates(sub, *args, width)
        done = [j for j, ok in enumerate(settled) if ok]
        out[[rows[j] for j in done]] = filtered[done]
        rows = [rows[j] for j, ok in enumerate(settled) if not ok]
        if not rows:
            return out
    return out


def _filters_over_candidates(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float], width: int
) -> tuple[torch.Tensor, list[bool]]:
    """``apply_filters`` from each row's ``width`` largest logits, and per row whether that settled it: not where it
    keeps its last candidate (it may keep more), or asks top-k for ``width`` or more. On a CPU a 49k vocabulary's
    sort cost ~3.6 ms a row, some 15 times its top 256. A token past the candidates is never larger than the last
    of them, and every filter drops by value or by rank, so a row that drops its last candidate drops all after it."""
    device = logits.device
    # Equal values in the order of their ids, as the CPU kernel and the sorted vocabulary take them: top-p keeps the
    # first of equal tokens, and topk's order among them is its own (the same seed drew another token there).
    vals, ids = _in_id_order(*logits.topk(width, dim=-1))
    top = vals[:, :1]
    # top-k and min-p keep by value: at least the k-th largest, and within log(min_p) of the largest.
    k = to_device([min(x, width) for x in top_k], torch.long, device)
    kth = torch.where(k[:, None] > 0, vals.gather(1, (k - 1).clamp(min=0)[:, None]), float("-inf"))
    log_min_p = to_device(min_p, torch.float32, device).log()[:, None]
    floor_kept = (logits >= kth) & (logits - top >= log_min_p)  # over the whole row: top-p renormalizes over it
    mass = torch.where(floor_kept, torch.exp(logits - top), 0.0).sum(dim=-1, keepdim=True)
    kept = (vals >= kth) & (vals - top >= log_min_p)
    kept[:, 0] = True
    probs = torch.where(kept, torch.exp(vals - top), 0.0) / mass
    p = to_device(top_p, torch.float32, device)[:, None]
    kept &= ~((probs.cumsum(dim=-1) - probs >= p) & (p < 1))
    kept[:, 0] = True
    # (a cut among tokens equal to the last candidate: topk chose which of them are candidates, so looked at wider)
    edge = (torch.where(kept, vals, float("inf")).min(dim=-1).values == vals[:, -1]).tolist()
    settled = [not last and not tied and k < width for last, tied, k in zip(kept[:, -1].tolist(), edge, top_k)]
    filtered = vals.masked_fill(~kept, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, ids, filtered), settled


def _filters_over_sorted_vocabulary(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # (equal values in the order of their ids)
    vocab = logits.shape[1]
    ranks = torch.arange(vocab, device=device)[None, :]
    k = to_device(top_k, torch.long, device)
    k = torch.where(k > 0, k, vocab).clamp(max=vocab)
    # Every token tied with the k-th stays (as vLLM's top-k): which of equal tokens to drop is no one's to say.
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    remove = (ranks >= k[:, None]) & (sorted_logits < kth)
    # min-p in log space (p_i < min_p * p_max): no softmax needed, and min_p 0 (log -inf) drops nothing.
    remove |= sorted_logits - sorted_logits[:, :1] < to_device(min_p, torch.float32, device).log()[:, None]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
    # (top_p 1 keeps all: in float32 the running sum reaches 1.0 before the vocabulary ends.)
    mass_before = probs.cumsum(dim=-1) - probs
    p = to_device(top_p, torch.float32, device)[:, None]
    remove |= (mass_before >= p) & (p < 1)
    remove[:, 0] = False
    filtered = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, filtered)
