import math

import pytest
import torch

import roseinfer.sampler as sampler_module
from roseinfer.sampler import Sampler, apply_filters, seeded_generator
from roseinfer.sampling_params import SamplingParams
from roseinfer.sequence import Sequence


def kept(logits):
    return [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 4))
    out = apply_filters(logits, top_k=[2, 0, 0, 0], top_p=[1.0, 0.7, 1.0, 0.5], min_p=[0.0, 0.0, 0.25, 0.0])
    assert kept(out) == [[0, 1], [0, 1], [0, 1, 2], [0]]
    # kept values are unchanged
    assert torch.equal(out[0, :2], logits[0, :2])


def test_top_p_takes_the_mass_of_what_min_p_kept_as_vllm_v1():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # min_p 0.5 keeps 0.4, 0.3, 0.2; renormalized, the first two hold 0.78 >= 0.75 (of the original, 0.7 < 0.75)
    assert kept(apply_filters(logits, [0], [0.75], [0.5])) == [[0, 1]]


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]]))
    assert kept(apply_filters(logits, [2], [1.0], [0.0])) == [[0, 1, 2, 3]]
    assert kept(apply_filters(logits, [1], [1.0], [0.0])) == [[0]]


def test_filters_follow_the_original_token_order():
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.05, 0.25]]))
    assert kept(apply_filters(logits, [2], [1.0], [0.0])) == [[1, 3]]


def seq(params, tokens=(1, 2, 3), seed=None):
    gen = None
    if params.seed is not None:
        gen = torch.Generator()
        gen.manual_seed(params.seed)
    return Sequence("r", list(tokens), params, None, gen)


def test_seeded_sampling_ignores_the_rest_of_the_batch():
    """20 draws of a seeded row, alone and in a batch of unseeded ones (one draw would match by chance 1 in 50)."""
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    p = SamplingParams(temperature=1.0, seed=7)
    alone, s = Sampler([0], 0, torch.device("cpu")), seq(p)
    solo = [alone(logits[3:4], [s]).token_ids[0] for _ in range(20)]
    together, s = Sampler([0], 123, torch.device("cpu")), seq(p)
    batch = [seq(SamplingParams(temperature=1.0)) for _ in range(8)]
    batch[3] = s
    assert [together(logits, batch).token_ids[3] for _ in range(20)] == solo
    assert len(set(solo)) > 1  # draws, not one token every time


def test_seeds_that_differ_only_in_their_high_bits_draw_differently_on_cpu():
    """MT19937 keeps a seed's low 32 bits: 1, 1 + 2**32 and -2**64 + 1 drew the same noise."""

    def draws(seed):
        return torch.empty(8).exponential_(generator=seeded_generator(seed, torch.device("cpu"))).tolist()

    seeds = [1, 1 + 2**32, 1 + 2**40, 1 - 2**63, -1, 2**32 - 1]
    assert len({tuple(draws(s)) for s in seeds}) == len(seeds)
    assert draws(1 + 2**32) == draws(1 + 2**32)  # still a seed: the same one draws the same
    reference = torch.Generator()
    reference.manual_seed(7)  # a seed below 2**32 draws what torch.manual_seed gives it, as before
    assert draws(7) == torch.empty(8).exponential_(generator=reference).tolist()


def test_penalties_change_the_choice():
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0]])
    sampler = Sampler([3], 0, torch.device("cpu"))
    greedy = SamplingParams(temperature=0)
    assert sampler(logits, [seq(greedy, tokens=(0, 0))]).token_ids == [0]
    rep = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert sampler(logits, [seq(rep, tokens=(0,))]).token_ids == [1]
    s = seq(SamplingParams(temperature=0, frequency_penalty=1.0, max_tokens=5), tokens=(2,))
    s.token_ids += [0]  # one output token: 0
    assert sampler(logits, [s]).token_ids == [1]


def test_logit_bias_moves_its_rows_tokens_before_the_penalties_and_leaves_logprobs_the_models():
    """OpenAI's logit_bias: +100 makes a token the choice, -100 bans it from draws too; other rows are untouched;
    the bias comes before the repetition penalty (vLLM's order); logprobs are the model's (vLLM's raw logprobs)."""
    logits = torch.tensor([[5.0, 4.9, 0.0, -1.0]] * 3)
    sampler = Sampler([9], 0, torch.device("cpu"))
    up = SamplingParams(temperature=0, logit_bias={3: 100}, logprobs=1)
    down = SamplingParams(temperature=0, logit_bias={0: -0.2})
    out = sampler(logits, [seq(up), seq(down), seq(SamplingParams(temperature=0))])
    assert out.token_ids == [3, 1, 0]
    assert out.logprobs[0][3] == torch.log_softmax(logits[0], dim=-1)[3].item()
    # Biased to 6.0, then divided by the penalty (token 0 was seen): 4.0 < 4.9. Penalised first, 0 would win.
    both = SamplingParams(temperature=0, logit_bias={0: 1.0}, repetition_penalty=1.5)
    assert sampler(logits[:1], [seq(both, tokens=(0,))]).token_ids == [1]
    ban = SamplingParams(temperature=1.0, logit_bias={0: -100, 1: -100})
    draws = {sampler(logits[:1], [seq(ban)]).token_ids[0] for _ in range(200)}
    assert draws == {2, 3}


@pytest.mark.parametrize("path", ["kernel", "pytorch"])
def test_min_tokens_blocks_eos_and_stop_tokens(path, monkeypatch):
    if path == "pytorch":  # (the GPU's)
        monkeypatch.setattr(sampler_module, "can_sample_rows", lambda logits: False)
    logits = torch.tensor([[9.0, -5.0, 8.0, -1.0]] * 3)
    seqs = [seq(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])), seq(SamplingParams(temperature=0))]
    # ignore_eos too, as vLLM's: EOS would not end it, but the first min_tokens tokens are still never EOS
    seqs.append(seq(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)))
    assert Sampler([0], 0, torch.device("cpu"))(logits, seqs).token_ids == [3, 0, 2]


@pytest.mark.parametrize("path", ["kernel", "pytorch"])
def test_tied_alternatives_come_in_the_order_of_their_ids_on_either_path(path, monkeypatch):
    """bfloat16 logits tie often: a request's top logprobs listed them in the kernel's order or topk's, by whether
    a structured output shared its batch (or on a GPU)."""
    if path == "pytorch":
        monkeypatch.setattr(sampler_module, "can_sample_rows", lambda logits: False)
    logits = torch.full((1, 500), -3.0)
    logits[0, [300, 40, 7]] = 2.0
    logits[0, 9] = 1.0
    out = Sampler([0], 0, torch.device("cpu"))(logits, [seq(SamplingParams(temperature=0, logprobs=4))])
    assert out.token_ids == [7] and list(out.logprobs[0]) == [7, 40, 300, 9]
    # A tie across a row's cut keeps its lowest ids, whatever top its neighbours ask for, a tie wider than the
    # widest top too (topk kept its own choice of it: the third alternative changed with the batch).
    logits[0, [461, 462]] = 2.0
    logits[0, 100:160] = 2.0
    for others in (0, 1, 8):
        batch = [seq(SamplingParams(temperature=0, logprobs=2))] + [
            seq(SamplingParams(temperature=0, logprobs=others)) for _ in range(1 if others else 0)
        ]
        out = Sampler([0], 0, torch.device("cpu"))(logits.expand(len(batch), -1).contiguous(), batch)
        assert list(out.logprobs[0]) == [7, 40], others
        if others:
            assert list(out.logprobs[1]) == [7, 40, 100, 101, 102, 103, 104, 105][:others], others


def test_top_p_keeps_the_same_tied_tokens_on_every_path():
    """bfloat16 logits tie often: where top-p's cut fell among equal tokens, the CPU kernel kept them in id order and
    the PyTorch paths in topk's or an unstable sort's: the same seed drew other tokens on a CPU with a compiler,
    without one, and on a GPU (59 and 124 of 800 rows here kept other members)."""
    import random

    from roseinfer.kernels import can_sample_rows, filter_rows
    from roseinfer.sampler import _filters_over_sorted_vocabulary, apply_filters

    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        vocab = rng.choice([300, 5000, 20000])
        logits = (torch.randn(4, vocab, generator=gen) * rng.choice([0.3, 1, 3, 10])).bfloat16().float()
        k = [rng.choice([0, 1, 3, 50, 256, 300, 4096]) for _ in range(4)]
        p = [rng.choice([1.0, 0.99, 0.9, 0.5, 0.1]) for _ in range(4)]
        min_p = [rng.choice([0.0, 0.0, 0.01, 0.2]) for _ in range(4)]
        kept = [apply_filters(logits, k, p, min_p), _filters_over_sorted_vocabulary(logits, k, p, min_p)]
        if can_sample_rows(logits):
            kept.append(filter_rows(logits, k, p, min_p))
        masks = [torch.isfinite(x) for x in kept]
        assert all(torch.equal(m, masks[0]) for m in masks[1:]), (vocab, k, p, min_p)
    # A tie across the first look's 256 candidates, cut by top-p: topk chose which of it were candidates.
    logits = torch.full((1, 5000), -20.0)
    order = torch.randperm(5000, generator=gen)
    logits[0, order[:200]] = torch.linspace(5, 4, 200)
    logits[0, order[200:400]] = 3.0
    kept = [apply_filters(logits, [0], [0.85], [0.0]), _filters_over_sorted_vocabulary(logits, [0], [0.85], [0.0])]
    assert torch.equal(torch.isfinite(kept[0]), torch.isfinite(kept[1]))


def test_top_p_one_keeps_the_whole_vocabulary():
    """In float32 the running mass reaches 1.0 before a 49,152-token vocabulary ends: top_p 1 (off) cut the
    tail of every row whenever another row of the batch used a filter."""
    from roseinfer.sampler import apply_filters

    torch.manual_seed(0)
    logits = torch.randn(4, 49152) * 8
    kept = apply_filters(logits, top_k=[0] * 4, top_p=[1.0] * 4, min_p=[0.0] * 4)
    assert torch.isfinite(kept).all()


def _mixed_batch(vocab: int) -> tuple[list[Sequence], object]:
    """Every kind of row the sampler has: greedy, temperature, filters, a logit bias, penalties, seeds, min_tokens,
    logprobs, and a structured output's mask on two rows."""
    import numpy as np

    from roseinfer.structured_output import GrammarMasks

    rows = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=3),
        SamplingParams(temperature=1.0, min_p=0.1, logit_bias={7: 2.5, 8: -100}),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2, seed=9),
        SamplingParams(temperature=0, min_tokens=4, stop_token_ids=[5], logprobs=3),
        SamplingParams(temperature=1.2, logprobs=0),
    ]
    seqs = [seq(p, tokens=(1, 2, 3, 2, 7)) for p in rows]
    for s in seqs:
        s.token_ids += [4, 2]  # two output tokens each
    bits = np.zeros((2, -(-vocab // 32) * 32), dtype=np.uint8)
    bits[0, [0, 6, 11]] = 1
    bits[1, [5]] = 1  # row 4: only its stop token, which min_tokens bans: the constraint wins
    masks = GrammarMasks([1, 4], torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy()))
    return seqs, masks


def test_sampling_reads_nothing_back_until_its_result(monkeypatch):
    """On a GPU a value read back (``tolist``, ``item``, an ``if`` on a tensor), a list as an index (a blocking
    copy) or a shape decided by values (``nonzero``, a boolean mask) waits for the whole forward queued before it:
    ``start`` must do none of them, so a sampled step overlaps the host's work as a greedy one does. On CPU the same
    code runs, so these are caught here too. (A number put through a tensor index is copied from the host as a
    tensor, and waits too.)"""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 3
    seqs, masks = _mixed_batch(40)
    monkeypatch.setattr(sampler_module, "can_sample_rows", lambda logits: False)
    expected = Sampler([0], 5, torch.device("cpu"))(logits, *_mixed_batch(40))
    monkeypatch.undo()

    def refuse(name):
        def read_back(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{name} inside Sampler.start")

        return read_back

    def checked(inner):
        def index(self, key, *rest):
            keys = key if isinstance(key, tuple) else (key,)
            for k in keys:
                assert not isinstance(k, list), "a list as an index: a blocking host-to-device copy"
                assert not (isinstance(k, torch.Tensor) and k.dtype == torch.bool), "a boolean mask as an index"
            if rest and isinstance(rest[0], (int, float)) and any(isinstance(k, torch.Tensor) for k in keys):
                raise AssertionError("a Python number put through a tensor index: a blocking host-to-device copy")
            return inner(self, key, *rest)

        return index

    sampler = Sampler([0], 5, torch.device("cpu"))
    with monkeypatch.context() as m:
        # The GPU's path: a CPU samples in its C kernel, and its PyTorch filters read back which rows settled.
        m.setattr(sampler_module, "can_sample_rows", lambda logits: False)
        m.setattr(sampler_module, "apply_filters", sampler_module._filters_over_sorted_vocabulary)
        for name in ("tolist", "item", "__bool__", "__int__", "__float__", "nonzero", "unique", "cpu"):
            m.setattr(torch.Tensor, name, refuse(name))
        m.setattr(torch.Tensor, "__getitem__", checked(torch.Tensor.__getitem__))
        m.setattr(torch.Tensor, "__setitem__", checked(torch.Tensor.__setitem__))
        pending = sampler.start(logits, seqs, masks)
    got = pending.result()
    assert got == expected
    assert got.token_ids[4] == 5  # the structured output's one token, though min_tokens bans it
    assert set(got.logprobs[4]) >= {5} and len(got.logprobs[4]) <= 4
    assert got.logprobs[0] is None and set(got.logprobs[5]) == {got.token_ids[5]}


@pytest.mark.slow  # a second or more: the full suite's (the fast lane stays under a minute)
def test_filters_from_the_top_candidates_equal_the_whole_sorted_vocabulary():
    """On CPU the filters look at each row's largest logits only, falling back to a whole sort where a row keeps
    a token past them: the kept tokens and their values are those of the sort, on peaked and flat rows, ties, every
    filter alone and together."""
    from roseinfer.sampler import _filters_over_candidates, _filters_over_sorted_vocabulary

    gen = torch.Generator().manual_seed(0)
    fallbacks = 0
    for case in range(42):
        vocab = [300, 5000, 49152][case % 3]
        rows = 8
        scale = [0.5, 3.0, 12.0][case % 4 % 3]  # flat to peaked
        logits = torch.randn(rows, vocab, generator=gen) * scale
        if case % 5 == 0:
            logits = logits.round()  # many exact ties
        if case % 7 == 0:
            logits[0, 100:] = float("-inf")  # a row already masked by a structured output
        r = torch.randint(0, 4, (3, rows), generator=gen).tolist()
        top_k = [[0, 1, 7, 200][i] for i in r[0]]
        top_p = [[1.0, 0.5, 0.9, 0.99][i] for i in r[1]]
        min_p = [[0.0, 0.01, 0.1, 0.0][i] for i in r[2]]
        expected = _filters_over_sorted_vocabulary(logits, top_k, top_p, min_p)
        got, settled = _filters_over_candidates(logits, top_k, top_p, min_p, 256)
        fallbacks += settled.count(False)
        rows = [i for i, ok in enumerate(settled) if ok]
        got, expected, logits = got[rows], expected[rows], logits[rows]
        assert torch.equal(got[torch.isfinite(got)], logits[torch.isfinite(got)])  # kept values unchanged
        if case % 5 == 0:  # which of two tied tokens top-p keeps is the order's: the kept values must agree
            assert torch.equal(got.sort(dim=-1).values, expected.sort(dim=-1).values), case
        else:
            assert torch.equal(torch.isfinite(got), torch.isfinite(expected)), case
    assert fallbacks < 42 * 8 // 3  # most rows settle from their candidates; the rest go on to a wider look
    # The whole path, with the rows the first look left over: the same as a sort of every row.
    logits = torch.randn(64, 49152, generator=gen) * 2
    top_k, top_p, min_p = [0, 5, 300, 0] * 16, [0.95, 1.0, 0.9, 0.999] * 16, [0.0, 0.0, 0.05, 0.0] * 16
    expected = _filters_over_sorted_vocabulary(logits, top_k, top_p, min_p)
    assert torch.equal(torch.isfinite(apply_filters(logits, top_k, top_p, min_p)), torch.isfinite(expected))


def test_draws_follow_the_distribution_and_never_take_a_masked_token():
    """20,000 draws of one row against its probabilities, one token at -inf among them; and a draw at the very top
    of [0, 1) lands on the last token that can be drawn, not on a masked one after it."""
    from roseinfer.sampler import sample_inverse_cdf

    logits = torch.tensor([[2.0, 1.0, float("-inf"), 0.0, -1.0, float("-inf")]])
    probs = torch.softmax(logits, dim=-1)[0]
    u = torch.rand(20000, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    drawn = sample_inverse_cdf(logits.expand(20000, -1), u)
    freq = torch.bincount(drawn, minlength=6).double() / 20000
    assert freq[2] == 0 and freq[5] == 0
    assert torch.allclose(freq, probs.double(), atol=0.01), (freq, probs)
    top = torch.tensor([1 - 2**-53], dtype=torch.float64)
    assert sample_inverse_cdf(logits, top).tolist() == [4]
    assert sample_inverse_cdf(logits, torch.zeros(1, dtype=torch.float64)).tolist() == [0]


def test_a_seeded_rows_draws_are_one_a_token_and_advance_replays_them():
    from roseinfer.sampler import advance_generator, draw_uniform

    straight = seeded_generator(11, torch.device("cpu"))
    run = [draw_uniform(straight).item() for _ in range(7)]
    resumed = seeded_generator(11, torch.device("cpu"))
    advance_generator(resumed, 4)
    assert [draw_uniform(resumed).item() for _ in range(3)] == run[4:]


def _reference_filter(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> tuple[set[int], set[int]]:
    """The filters in float64 over the row sorted by value (equal values in id order): the ids kept, and the ids a
    rounding could decide either way (top-p's running mass within 1e-6 of its target)."""
    v, order = row.double().sort(descending=True, stable=True)
    keep = torch.ones(len(v), dtype=torch.bool)
    if 0 < top_k < len(v):
        keep &= v >= v[top_k - 1]
    if min_p > 0:  # float32, as the kernel and PyTorch compare
        keep &= (row[order] - row[order[0]]) >= torch.tensor(min_p).log()
    keep[0] = True
    unsure = torch.zeros(len(v), dtype=torch.bool)
    if top_p < 1:
        weights = torch.where(keep, torch.exp(v - v[0]), 0.0)
        before = weights.cumsum(0) - weights
        target = top_p * weights.sum()
        unsure = keep & ((before - target).abs() <= 1e-6 * weights.sum())
        keep &= before < target
        keep[0] = True
    return set(order[keep].tolist()), set(order[unsure].tolist())


def test_kernel_filters_keep_what_a_float64_walk_keeps():
    """The CPU kernel's filters (a radix select, no sort) against a float64 walk down the sorted row: peaked and
    flat rows, exact ties (ties at the k-th value all stay; top-p takes equal values in id order), -0 beside +0,
    rows masked to -inf, each filter alone and together."""
    from roseinfer.kernels import can_sample_rows, filter_rows

    if not can_sample_rows(torch.zeros(1, 2)):
        pytest.skip("no C compiler: the CPU samples with PyTorch ops")
    gen = torch.Generator().manual_seed(0)
    for case in range(30):
        vocab = [300, 5000, 49152][case % 3]
        logits = torch.randn(6, vocab, generator=gen) * [0.5, 3.0, 12.0][case % 4 % 3]
        if case % 5 == 0:
            logits = logits.round()  # ties, and -0.0 among the 0.0s
        if case % 7 == 0:
            logits[0, 100:] = float("-inf")
        r = torch.randint(0, 4, (3, 6), generator=gen).tolist()
        top_k = [[0, 1, 7, 200][i] for i in r[0]]
        top_p = [[1.0, 0.5, 0.9, 0.99][i] for i in r[1]]
        min_p = [[0.0, 0.01, 0.1, 0.0][i] for i in r[2]]
        out = filter_rows(logits, top_k, top_p, min_p)
        for row, got, k, p, mp in zip(logits, out, top_k, top_p, min_p):
            kept, unsure = _reference_filter(row, k, p, mp)
            got_kept = set(torch.isfinite(got).nonzero().flatten().tolist())
            finite = set(torch.isfinite(row).nonzero().flatten().tolist())
            assert got_kept ^ (kept & finite) <= unsure, (case, k, p, mp)
            assert torch.equal(got[torch.isfinite(got)], row[torch.isfinite(got)])


@pytest.mark.slow  # a second or more: the full suite's (the fast lane stays under a minute)
def test_kernel_draws_invert_the_running_sum_and_never_take_a_masked_token():
    """The CPU kernel's draw at u lands where the filtered distribution's float64 running sum passes u (to within
    1e-6 of a boundary), reads bfloat16 logits as their float32 values, and never takes a -inf or filtered token;
    a draw at the very top of [0, 1) takes the last token that can be drawn."""
    from roseinfer.kernels import can_sample_rows, sample_rows

    if not can_sample_rows(torch.zeros(1, 2)):
        pytest.skip("no C compiler: the CPU samples with PyTorch ops")
    gen = torch.Generator().manual_seed(3)
    rows = 120
    logits = (torch.randn(rows, 3000, generator=gen) * 2).bfloat16().float()
    logits[:, 2000:2100] = float("-inf")
    temperature = [[0.7, 1.0, 1.3][i % 3] for i in range(rows)]
    top_k = [[0, 0, 40, 0, 500][i % 5] for i in range(rows)]
    top_p = [[1.0, 0.9, 1.0, 0.5][i % 4] for i in range(rows)]
    min_p = [[0.0, 0.0, 0.0, 0.0, 0.0, 0.02][i % 6] for i in range(rows)]
    u = torch.rand(rows, dtype=torch.float64, generator=gen)
    u[:3] = torch.tensor([0.0, 1 - 2**-53, 0.5], dtype=torch.float64)
    got = sample_rows(logits, temperature, top_k, top_p, min_p, u)
    assert torch.equal(sample_rows(logits.bfloat16(), temperature, top_k, top_p, min_p, u), got)
    last_drawable = None
    for r in range(rows):
        x = logits[r] / temperature[r]
        kept, unsure = _reference_filter(x, top_k[r], top_p[r], min_p[r])
        ids = sorted(i for i in kept if torch.isfinite(x[i]))
        weights = torch.zeros(len(x), dtype=torch.float64)
        weights[ids] = torch.exp(x[ids].double() - x.max().double())
        cdf = weights.cumsum(0) / weights.sum()
        token = got[r].item()
        assert token in kept or token in unsure, r
        assert torch.isfinite(x[token]), r
        low = cdf[token - 1].item() if token else 0.0
        assert low - 1e-6 <= u[r].item() <= cdf[token].item() + 1e-6, (r, token)
        last_drawable = ids[-1] if r == 1 else last_drawable
    assert got[0].item() == min(_reference_filter(logits[0] / 0.7, 0, 1.0, 0.0)[0])
    assert got[1].item() == last_drawable


def test_kernel_applies_bias_penalties_and_bans_as_the_pytorch_processors():
    """Greedy rows through the CPU kernel's processors (logit bias, repetition, frequency and presence penalties,
    min_tokens' bans, each alone and together, repeated tokens in the histories) choose what PyTorch's processors
    make the argmax, on bfloat16 and float32 logits."""
    from roseinfer.kernels import can_sample_rows

    if not can_sample_rows(torch.zeros(1, 2)):
        pytest.skip("no C compiler: the CPU samples with PyTorch ops")
    gen = torch.Generator().manual_seed(5)
    vocab, rows = 60, 48
    seqs = []
    for i in range(rows):
        kind = i % 6
        p = SamplingParams(
            temperature=0,
            logit_bias={int(t): float(b) for t, b in zip(torch.randint(0, vocab, (3,), generator=gen), [4, -3, 2.5])}
            if kind in (0, 5)
            else None,
            repetition_penalty=[1.0, 1.8, 1.0, 1.0, 1.3, 1.5][kind],
            frequency_penalty=[0.0, 0.0, 1.5, 0.0, 0.7, 0.4][kind],
            presence_penalty=[0.0, 0.0, 0.0, 2.0, 0.5, 0.3][kind],
            min_tokens=[0, 0, 0, 9, 0, 9][kind],
            stop_token_ids=[int(torch.randint(0, vocab, (1,), generator=gen))],
            max_tokens=20,
        )
        history = torch.randint(0, vocab // 3, (12,), generator=gen).tolist()  # repeats among few tokens
        s = seq(p, tokens=history[:5])
        s.token_ids += history[5:]
        seqs.append(s)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(rows, vocab, generator=gen) * 2).to(dtype)
        kernel = Sampler([7], 0, torch.device("cpu"))(logits, seqs).token_ids
        with pytest.MonkeyPatch.context() as m:
            m.setattr(sampler_module, "can_sample_rows", lambda logits: False)
            expected = Sampler([7], 0, torch.device("cpu"))(logits, seqs).token_ids
        plain = logits.float().argmax(dim=-1).tolist()
        assert kernel == expected, dtype
        assert sum(a != b for a, b in zip(kernel, plain)) >= rows // 6  # the processors did change choices
    # Sharper: each row's most repeated output token t (a logit of either sign) against a token c that nothing
    # touches, set 1e-3 below or above what PyTorch's processors make of t: the argmax tells whether the kernel
    # made the same of t, to 1e-3.
    reference = Sampler([7], 0, torch.device("cpu"))
    logits = torch.full((rows, vocab), -20.0)
    picks = []
    for i, s in enumerate(seqs):
        banned = set(reference._banned(s, vocab))
        outs = [t for t in s.output_token_ids if t not in banned] or [t for t in s.token_ids if t not in banned]
        t = max(outs, key=outs.count)
        c = next(c for c in range(vocab // 3, vocab) if c not in banned and c not in (s.params.logit_bias or {}))
        logits[i, t] = (1.0 if i % 4 < 2 else -1.0) * (0.5 + torch.rand(1, generator=gen).item() * 2.5)
        picks.append((t, c))
    processed = logits.clone()
    reference._apply_logit_bias(processed, seqs)
    reference._apply_penalties(processed, seqs)
    for i, (t, c) in enumerate(picks):
        logits[i, c] = processed[i, t] + (1e-3 if i % 2 else -1e-3)
    got = Sampler([7], 0, torch.device("cpu"))(logits, seqs).token_ids
    assert got == [c if i % 2 else t for i, (t, c) in enumerate(picks)]


def test_kernel_logprobs_are_the_log_softmax_and_its_largest_entries():
    """The CPU kernel's logprobs against PyTorch's log_softmax and topk: the chosen token's and each row's N largest
    (ids in order, equal values in id order), bfloat16 and float32 logits; and through the sampler, a sampled
    batch's logprobs are those of the model's logits, not of the processed ones it drew from."""
    from roseinfer.kernels import can_sample_rows, logprob_rows

    if not can_sample_rows(torch.zeros(1, 2)):
        pytest.skip("no C compiler: the CPU samples with PyTorch ops")
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(12, 5000, generator=gen) * [1.0, 4.0, 15.0][0 if dtype == torch.float32 else 1]).to(dtype)
        logits[3] = logits[3].float().round().to(dtype)  # ties
        tokens = torch.randint(0, 5000, (12,), generator=gen)
        num = [0, 1, 5, 20, 3, 7, 2, 20, 1, 0, 9, 4]
        chosen, vals, ids = logprob_rows(logits, tokens, num)
        ref = torch.log_softmax(logits.float(), dim=-1)
        assert torch.allclose(chosen, ref.gather(1, tokens[:, None]).squeeze(1), atol=2e-5, rtol=0)
        for r, k in enumerate(num):
            order = sorted(range(5000), key=lambda i: (-ref[r, i].item(), i))[:k]
            assert ids[r, :k].tolist() == order, (dtype, r)
            assert torch.allclose(vals[r, :k], ref[r, order], atol=2e-5, rtol=0)
    # A NaN logit: every logprob NaN, as log_softmax gives them (its maximum skipped the NaN: finite alternatives)
    nan = torch.randn(2, 300, generator=gen)
    nan[0, 0], nan[1, 150] = float("nan"), float("nan")
    chosen, vals, _ = logprob_rows(nan, torch.tensor([5, 5]), [3, 3])
    assert torch.isnan(chosen).all() and torch.isnan(vals).all()
    logits = torch.randn(4, 300, generator=gen) * 3
    params = SamplingParams(temperature=0.5, logprobs=4, repetition_penalty=1.5, logit_bias={7: 5.0})
    out = Sampler([0], 1, torch.device("cpu"))(logits, [seq(params, tokens=(7, 8, 9)) for _ in range(4)])
    ref = torch.log_softmax(logits, dim=-1)
    for r, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert set(entry) == set(ref[r].topk(4).indices.tolist()) | {token}
        assert all(abs(v - ref[r, t].item()) < 2e-5 for t, v in entry.items())


def test_kernel_draws_stay_valid_on_odd_rows():
    """Random rows and settings at their edges (a vocabulary of 1 to 5,000, ties, rows partly or wholly at -inf,
    temperatures from 1e-4 to 5, top_k past the vocabulary, top_p 1e-6, min_p 1, biases of +-100, negative
    penalties): every token is in the vocabulary, a sampled row never draws a -inf logit where it has a finite one,
    and min_tokens' bans hold."""
    import random

    from roseinfer.kernels import RowProcessors, can_sample_rows, sample_rows

    if not can_sample_rows(torch.zeros(1, 2)):
        pytest.skip("no C compiler: the CPU samples with PyTorch ops")
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    for _ in range(120):
        rows, n = rng.randint(1, 12), rng.choice([1, 2, 7, 64, 65, 300, 5000])
        x = torch.randn(rows, n, generator=gen) * rng.choice([0.01, 1.0, 30.0])
        if rng.random() < 0.3:
            x = x.round()
        if rng.random() < 0.3:
            x[:, rng.randrange(n) :] = float("-inf")
        if rng.random() < 0.1:
            x[0] = float("-inf")
        temperature = [rng.choice([0.0, 1e-4, 0.5, 1.0, 5.0]) for _ in range(rows)]
        top_k = [rng.choice([0, -1, 1, 3, n, n + 5]) for _ in range(rows)]
        top_p = [rng.choice([1.0, 0.999, 0.5, 1e-6]) for _ in range(rows)]
        min_p = [rng.choice([0.0, 0.5, 1.0]) for _ in range(rows)]
        banned = [[rng.randrange(n)] for _ in range(rows)]
        processors = RowProcessors(
            bias=[{rng.randrange(n): rng.uniform(-100, 100)} for _ in range(rows)],
            history=[[rng.randrange(n) for _ in range(rng.randint(0, 5))] for _ in range(rows)],
            repetition=[rng.choice([1.0, 2.0]) for _ in range(rows)],
            output=[[rng.randrange(n) for _ in range(rng.randint(0, 5))] for _ in range(rows)],
            frequency=[rng.uniform(-2, 2) for _ in range(rows)],
            presence=[rng.uniform(-2, 2) for _ in range(rows)],
            banned=banned,
        )
        u = torch.rand(rows, dtype=torch.float64, generator=gen)
        dtype = rng.choice([torch.float32, torch.bfloat16])
        plain = sample_rows(x.to(dtype), temperature, top_k, top_p, min_p, u).tolist()
        processed = sample_rows(x.to(dtype), temperature, top_k, top_p, min_p, u, processors).tolist()
        for r in range(rows):
            assert 0 <= plain[r] < n and 0 <= processed[r] < n
            finite = torch.isfinite(x[r].to(dtype))
            if temperature[r] > 0 and finite.any():
                assert finite[plain[r]], (r, plain[r])
            if temperature[r] > 0 and finite.sum() > 1:  # (a ban leaves it a finite logit to draw)
                assert processed[r] not in banned[r], (r, processed[r])


def test_a_row_whose_logits_overflowed_takes_its_argmax_on_every_path(monkeypatch):
    """A repetition penalty of 1e-39 divides a seen token's positive logit to +inf (a NaN or +inf from the model
    does the same): that row has no distribution. PyTorch's draw (a GPU's path) then returned the vocabulary's size,
    an id the next step's embedding fails on for the whole batch (a device assert on CUDA); the CPU kernel takes the
    row's argmax. Both take it now, and the other rows still draw."""
    logits = torch.tensor([[0.5, 0.0, 2.0, -1.0, 0.1, 0.2, 0.3, 0.4]] * 3)
    logits[2, 5] = float("nan")
    rows = [
        seq(SamplingParams(temperature=1.0, repetition_penalty=1e-39, seed=1), tokens=(0, 1)),
        seq(SamplingParams(temperature=1.0, seed=2)),
        seq(SamplingParams(temperature=1.0, seed=3)),
    ]
    monkeypatch.setattr(sampler_module, "can_sample_rows", lambda logits: False)
    got = Sampler([0], 0, torch.device("cpu"))(logits.clone(), rows).token_ids
    assert got[0] == 0  # the penalty made token 0 (seen, positive) +inf: the argmax
    assert 0 <= got[1] < 8 and got[2] == 5  # the NaN row: the NaN's place, as argmax has it
    from roseinfer.kernels import can_sample_rows

    monkeypatch.undo()
    if can_sample_rows(logits):  # the CPU kernel agrees on the overflowed row
        assert Sampler([0], 0, torch.device("cpu"))(logits[[0, 2]], [rows[0], rows[2]]).token_ids == [0, 5]


@pytest.mark.parametrize("path", ["kernel", "pytorch"])
def test_logprobs_past_a_small_vocabulary_and_of_nan_logits_are_finite_real_tokens(path, monkeypatch):
    """More alternatives asked than a tiny model has tokens: the kernel gave ids out of unset memory
    (4294967394: 0.0), PyTorch's topk raised and failed the step of every request. A NaN or infinite logit: NaN
    logprobs went out (max(nan, -9999) is nan), which JSON has not, and the two paths named other tokens."""
    if path == "pytorch":
        monkeypatch.setattr(sampler_module, "can_sample_rows", lambda logits: False)
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    out = Sampler([0], 0, torch.device("cpu"))(logits, [seq(SamplingParams(temperature=0, logprobs=20))] * 2)
    assert all(set(entry) == set(range(16)) for entry in out.logprobs)
    assert all(math.isfinite(v) for entry in out.logprobs for v in entry.values())
    logits[0, 5], logits[1, 3] = float("nan"), float("inf")
    out = Sampler([0], 0, torch.device("cpu"))(logits, [seq(SamplingParams(temperature=0, logprobs=2))] * 2)
    assert all(math.isfinite(v) for entry in out.logprobs for v in entry.values())
