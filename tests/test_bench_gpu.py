"""``roseinfer bench --device cuda``'s own code (``roseinfer/bench_gpu.py``), run on the CPU with torch.cuda's
device name, synchronisation and timing events stood in. A GPU is lent to few sessions and for minutes: a benchmark
that breaks on code it shares with the CPU path must break here first. It checks the run's shape, not its speed;
transformers' compiled run needs a GPU and is left out (``--skip-hf-compiled``)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from roseinfer import bench_gpu
from roseinfer.config import ConfigError
from worker.cli import build_parser, main

pytestmark = pytest.mark.slow


class _HostEvent:
    """torch.cuda.Event's timing, by the host's clock (on the CPU every kernel has ended when its call returns)."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.at - self.at) * 1e3


@pytest.fixture
def cuda_calls_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "cpu (stand-in)")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", _HostEvent)


def _bench(*argv: str):
    return build_parser().parse_args(["bench", "--device", "cpu", "--dtype", "float32", *argv])


def test_the_gpu_benchmark_runs_every_row_on_token_prompts(cuda_calls_on_cpu, tiny_llama, tmp_path, capsys):
    """A model with no tokenizer gets random token ids of the workload's lengths; the latency row counts each weight
    once (a CPU layer's packed copy of its weight has no storage to count: it broke the row)."""
    out = tmp_path / "gpu.json"
    args = _bench(
        *("--model", tiny_llama, "--num-prompts", "6", "--max-tokens", "5", "--repeats", "2", "--latency"),
        *("--hf-batch-size", "4", "--skip-hf-compiled", "--json", str(out)),
    )
    assert bench_gpu.main(args) == 0
    text = capsys.readouterr().out
    assert (
        "run 2/2: roseinfer" in text
        and "a token; weights" in text
        and "x the floor)" in text
        and "as issue 14 counts it" in text
    )
    figures = json.loads(out.read_text())
    assert [r["system"] for r in figures["results"]] == ["roseinfer", "transformers eager, padded"]
    assert all(r["generated_tokens"] == 30 for r in figures["results"])
    assert len(figures["runs"]) == 2 and figures["weight_floor_ms"] > 0
    assert figures["weight_floor_one_way_ms"] == pytest.approx(2 * figures["weight_floor_ms"], abs=2e-3)
    from roseinfer import LLM

    llm = LLM(tiny_llama, dtype="float32")
    params = sum(p.numel() for p in _hf_parameters(tiny_llama))
    assert bench_gpu.weight_bytes(llm) == 4 * params  # float32: every weight of the checkpoint, once


def test_the_gpu_benchmark_sends_chat_prompts_when_the_model_has_a_tokenizer(
    cuda_calls_on_cpu, tiny_chat_model, capsys
):
    args = _bench("--model", tiny_chat_model, "--num-prompts", "3", "--max-tokens", "4", "--skip-hf")
    assert bench_gpu.main(args) == 0
    assert "3 prompts x 4 new tokens, greedy" in capsys.readouterr().out


def test_a_random_shape_is_checked_before_any_weights_are_made(cuda_calls_on_cpu, capsys):
    with pytest.raises(ConfigError, match="no such shape; known: smollm2-135m, llama-1b"):
        bench_gpu.main(_bench("--model", "random:smollm2-1b"))
    # The CPU benchmark and the queue's send chat prompts: a random model (no tokenizer) needs --tokenizer.
    for command in ("bench", "bench-queue"):
        assert main([command, "--model", "random:smollm2-135m"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "has no tokenizer" in err and "--tokenizer" in err


def _hf_parameters(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).parameters()  # (tied weights: one parameter)


def test_a_random_shape_is_built_once_into_the_model_cache(tmp_path, monkeypatch):
    """Every run wrote a new copy into /tmp and left it there (the 1B shape: 2.5 GB and seconds each time)."""
    import argparse

    from roseinfer.bench import resolve_model_arg
    from roseinfer.tiny_models import RANDOM_SHAPES

    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path))
    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    monkeypatch.setitem(RANDOM_SHAPES, "test-tiny", shape)
    paths = []
    for _ in range(2):
        args = argparse.Namespace(model="random:test-tiny", dtype="bfloat16", tokenizer=None)
        resolve_model_arg(args, chat=False)
        paths.append(args.model)
    assert paths[0] == paths[1] == str(tmp_path / "random-test-tiny-bfloat16")
    folders = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert folders == ["random-test-tiny-bfloat16"]  # (no half-written folder)
    assert json.loads((tmp_path / paths[0] / "config.json").read_text())["hidden_size"] == 32


@pytest.mark.slow  # a Python process per command line
def test_every_command_line_of_the_gpu_check_parses():
    """``bench-queue`` had stopped taking ``--skip-hf`` while gpu_check.sh still passed it: both queue runs, the
    first thing a rare GPU session measures, would have ended in 2 s with a usage error. Parsed here on every CI."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    parts = ["queue", "tests", "smol", "1b", "queue-engine-process", "timeline", "queue-profile"]
    env = {**os.environ, "GPU_CHECK_PARSE_ONLY": "1"}
    out = subprocess.run(["bash", "benchmarks/gpu_check.sh", *parts], cwd=root, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "error:" not in out.stderr, out.stderr
    assert out.stdout.count("== ") == len(parts) + 1  # (each part, then done)
