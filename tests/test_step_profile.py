"""``roseinfer bench --profile``: the split of a decode step adds up to the step, and puts its time where it goes."""

from __future__ import annotations

import pytest

from roseinfer import LLM, SamplingParams
from roseinfer.cpu_features import NAMED, describe
from roseinfer.models.linear import Linear
from roseinfer.sampler import Sampler
from roseinfer.step_profile import PARTS, profile_decode


@pytest.mark.slow
def test_the_parts_of_a_decode_step_add_up_and_the_timers_come_off(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", max_num_seqs=8)
    engine = llm.engine
    call, forward = Linear.__call__, engine.attn_backend.forward
    prompts = [{"prompt_token_ids": list(range(1 + i, 9 + i))} for i in range(6)]
    report = profile_decode(engine, prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), steps=8)
    assert (report["batch"], report["steps"]) == (6, 8)
    parts = report["ms_per_step"]
    assert set(parts) == set(PARTS) and all(v >= 0 for v in parts.values())
    timed = sum(v for part, v in parts.items() if part != "python and scheduling")  # the rest is the step's
    assert timed <= 1.05 * report["step_ms"] + 0.05  # no time counted twice (nested timers would)
    assert parts["dense layers"] > 0 and parts["output layer"] > 0 and parts["attention"] > 0
    assert 0 < report["dense_share"] < 1 and 1 < report["step_over_dense"] < report["step_over_dense_layers"]
    # Everything patched is back, and the profiled requests are gone.
    assert Linear.__call__ is call and engine.attn_backend.forward == forward
    assert isinstance(engine.runner.sampler, Sampler)
    assert not engine.has_unfinished_requests()


def test_cpu_features_name_what_the_cpu_has(monkeypatch):
    import roseinfer.cpu_features as cpu

    monkeypatch.setattr(cpu, "model_name", lambda: "Some EPYC")
    monkeypatch.setattr(cpu, "flags", lambda: frozenset({"fpu", "avx2", "avx512f", "amx_tile", "sse2"}))
    assert describe() == "Some EPYC (avx2 avx512f amx_tile)"  # in NAMED's order, nothing else
    monkeypatch.setattr(cpu, "flags", lambda: frozenset({"sse2"}))
    assert describe() == f"Some EPYC (none of {', '.join(NAMED)})"


def test_the_median_of_an_even_count_of_runs_is_not_their_best():
    """The median of two runs was the upper one: the GPU queue's "median" was its better pair."""
    from roseinfer.bench import median_run

    assert median_run([3.0, 1.0], rate=float) == 1.0
    assert median_run([5.0, 1.0, 3.0], rate=float) == 3.0
    assert median_run([4.0, 1.0, 3.0, 2.0], rate=float) == 2.0


def test_a_percentile_is_the_nearest_rank():
    """Of 64 values p99 was the second largest (a rounded index)."""
    from roseinfer.bench import percentile

    assert percentile(list(range(64)), 0.99) == 63 and percentile(list(range(64)), 0.5) == 31
    assert percentile([5.0], 0.5) == 5.0 and percentile([], 0.5) is None
