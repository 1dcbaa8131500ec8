"""Options are declared once: the engine config feeds the worker's settings and every engine flag; the job payload
and SamplingParams agree on the sampling fields, their defaults and their bounds."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from producer.schema import JobRequest
from roseinfer import EngineConfig, SamplingParams
from roseinfer.config import add_engine_arguments, engine_config_from_args, engine_options
from worker.cli import build_parser, engine_flags, load_settings
from worker.settings import WorkerSettings, unknown_env_vars

# Engine-only sampling fields (not in the payload) and why.
ENGINE_ONLY = {
    "stop_strings": "derived from stop",
    "output_kind": "how the engine hands outputs back: the worker streams every step",
}
# Payload fields that are not sampling fields.
PAYLOAD_ONLY = {
    "prompt",
    "messages",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "truncation",
    "prompt_token_ids",
    "custom_id",
    "metadata",
    "top_logprobs",
    "priority",
    "notify",
    "response_format",
    "thinking",  # where the constraint begins: a part of the engine's structured_outputs
    "stream_options",  # what the events carry: the worker's, not the engine's
}


def _sampling_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(SamplingParams) if f.name not in ENGINE_ONLY]


def test_every_engine_option_is_a_worker_setting_with_the_engine_default_and_help():
    for opt in engine_options():
        info = WorkerSettings.model_fields[opt.name]
        assert info.default == opt.default, opt.name
        assert info.description == opt.help and opt.help
    assert WorkerSettings().engine_config() == EngineConfig()


def test_every_engine_option_is_a_bench_and_worker_flag():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("worker", "bench", "bench-queue", "generate"):
        flags = {s for a in sub.choices[command]._actions for s in a.option_strings}
        for opt in engine_options():
            if command == "generate" and opt.name == "seed":
                continue  # there --seed is the sampling seed
            assert opt.flag in flags, (command, opt.flag)


def test_worker_help_gives_description_default_and_variable_of_every_flag(capsys):
    from worker.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["worker", "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name, info in WorkerSettings.model_fields.items():
        assert f"env ROSEINFER_{name.upper()}" in text, name
        assert " ".join(info.description.split()) in text, name


def test_engine_flags_round_trip_through_the_worker_settings():
    config = EngineConfig(dtype="bfloat16", max_num_seqs=7, block_size=16, enable_prefix_caching=False)
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    from worker.cli import add_parsers

    add_parsers(sub)
    args = parser.parse_args(["worker", *engine_flags(config)])
    assert load_settings(args).engine_config() == config
    bench = argparse.ArgumentParser()
    add_engine_arguments(bench)
    assert engine_config_from_args(bench.parse_args(engine_flags(config))) == config


def test_none_unsets_a_setting_its_help_says_may_be_unset(monkeypatch):
    """--drain-timeout's help says "none: no limit"; none (from a flag or ROSEINFER_*) was 'not a valid number', so
    a compose file's ROSEINFER_DRAIN_TIMEOUT could not say "no limit". A text setting keeps the word."""
    parser = argparse.ArgumentParser()
    from worker.cli import add_parsers

    add_parsers(parser.add_subparsers())
    flags = ["--drain-timeout", "none", "--metrics-port", "None", "--max-model-len", "none", "--name", "none"]
    settings = load_settings(parser.parse_args(["worker", *flags]))
    assert (settings.drain_timeout, settings.metrics_port, settings.max_model_len) == (None, None, None)
    assert settings.name == "none"
    monkeypatch.setenv("ROSEINFER_DRAIN_TIMEOUT", "none")
    monkeypatch.setenv("ROSEINFER_MAX_IN_FLIGHT", "")
    settings = WorkerSettings()
    assert settings.drain_timeout is None and settings.max_in_flight is None
    with pytest.raises(ValidationError, match="drain_timeout"):
        WorkerSettings(drain_timeout="never")
    with pytest.raises(ValidationError, match="drain_timeout"):  # (past a thread's longest wait: the stop raised)
        WorkerSettings(drain_timeout=1e10)


@pytest.mark.parametrize(
    ("settings", "phrase"),
    [
        ({"dtype": "fp32"}, "dtype must be one of"),
        ({"max_num_seqs": "lots"}, "max_num_seqs"),
        ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
        ({"kv_cache_memory": "4ib"}, "kv_cache_memory"),  # a unit "i" alone was a KeyError, no message
        ({"block_size": "0"}, "block_size must be a positive integer"),
        ({"device": "tpu"}, "device"),
        ({"quantization": "int4"}, "quantization must be one of int8"),
        ({"quantization": "int8", "device": "cuda"}, "int8 runs on CPU"),
        ({"int8_output_layer": "true"}, "int8_output_layer needs quantization int8"),
        ({"heartbeat_interval": "0"}, "heartbeat_interval"),
        # Past what Redis's EXPIRE takes: every event write of every job failed (stream), canceled jobs kept
        # their hashes for good (result); a heartbeat's wait past threading.TIMEOUT_MAX stopped the heartbeats.
        ({"stream_ttl": str(10**17)}, "stream_ttl"),
        ({"result_ttl": str(10**17)}, "result_ttl"),
        ({"heartbeat_interval": str(10**10)}, "heartbeat_interval"),
        ({"stream_maxlen": str(10**19)}, "stream_maxlen"),  # past XADD's MAXLEN: every event write failed
        ({"queue": "hi,lo"}, "cannot hold a comma"),  # RQ's list of a worker's queues: two to `rq info`
        ({"queue": "roseinfer:p10"}, "is named as a priority lane"),  # (served at 0, with a lane roseinfer:p10:p10)
        ({"queue": " "}, "cannot be empty or blank"),  # a queue no producer uses: the worker sat idle
        # Absurd sizes, said before the model loads: after it, they hung, ran out of memory or raised deep inside.
        ({"engine_step_timeout": "0.001"}, "a second at least"),  # every step took it for hung: a restart loop
        ({"engine_step_timeout": "inf"}, "engine_step_timeout"),
        ({"seed": str(2**64)}, r"seed must be an integer from 0 to 2\*\*64 - 1"),  # torch's manual_seed overflowed
        ({"num_threads": "1000000"}, "num_threads must be an integer from 1 to"),
        ({"kv_cache_memory": "99999TiB"}, "kv_cache_memory is at most 1PiB"),  # a block list grew until OOM
        ({"kv_cache_memory": "inf"}, "kv_cache_memory cannot read"),
        ({"max_num_seqs": str(10**12)}, "max_num_seqs is at most"),
        ({"block_size": str(10**9)}, "block_size is at most"),
        ({"max_num_batched_tokens": str(10**12)}, "max_num_batched_tokens is at most"),
    ],
)
def test_bad_settings_are_refused_by_the_engine_rules_before_anything_loads(settings, phrase):
    with pytest.raises(ValidationError, match=phrase):
        WorkerSettings(**settings)


def test_a_redis_urls_own_socket_timeouts_are_seconds_above_zero():
    """A URL's own timeouts win over the worker's: 0 made every socket non-blocking, each command failed as a Redis
    still starting, and the worker loaded its model and waited for good; -1 was a traceback."""
    from producer.connection import InvalidRedisURL, connect, connect_async

    for query in ("socket_timeout=0", "socket_timeout=-1", "socket_connect_timeout=soon", "socket_timeout=inf"):
        for make in (connect, connect_async):
            with pytest.raises(InvalidRedisURL, match=f"{query.split('=')[0]}=.*a number of seconds above 0"):
                make(f"redis://:secret@127.0.0.1:1/0?{query}")
    assert connect("redis://127.0.0.1:1/0?socket_timeout=2.5").connection_pool.connection_kwargs["socket_timeout"]
    with pytest.raises(InvalidRedisURL) as said:  # (a password given as an option is not said either)
        connect("redis://127.0.0.1:1/0?password=hush&socket_timeout=0")
    assert "hush" not in str(said.value) and "password=***" in str(said.value)


def test_a_cuda_device_this_machine_lacks_is_one_line_before_the_model_loads():
    """torch's own error came as a traceback (an AttributeError on a CPU build), or after the load."""
    import torch

    from roseinfer import LLM
    from roseinfer.config import ConfigError

    index = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ConfigError, match=f"^device cuda:{index}: this machine has {index} CUDA device"):
        LLM("no-such-model-folder", device=f"cuda:{index}")  # (the device is said first: no load was tried)
    # So is the GPU benchmark's (torch's AssertionError "Torch not compiled with CUDA enabled", a traceback).
    from worker.cli import main

    assert main(["bench", "--device", f"cuda:{index}", "--skip-hf", "--model", "no-such-model-folder"]) == 2


def test_a_metrics_port_taken_is_said_before_the_model_loads():
    """Found as the worker started, after its model's load (minutes of a GPU's); under `serve --embedded` the
    worker's thread died and the server answered 503s."""
    import socket

    from roseinfer.config import ConfigError
    from worker.main import build_worker

    with socket.create_server(("0.0.0.0", 0)) as busy:
        port = busy.getsockname()[1]
        settings = WorkerSettings(redis_url="redis://127.0.0.1:1/0", model="no-such-model-folder", metrics_port=port)
        with pytest.raises(ConfigError, match=f"^--metrics-port {port}: "):  # (not the model: no load was tried)
            build_worker(settings)


@pytest.mark.parametrize("name", ["tokenizer", "chat_template"])
def test_an_engine_given_no_text_for_its_tokenizer_or_template_says_so_before_the_load(name):
    """``LLM(model, tokenizer=5)`` failed inside the model's load, with transformers' error."""
    from roseinfer.config import EngineConfig

    for value in (5, "", ["a"]):
        with pytest.raises(ValueError, match=f"^{name} must be a non-empty string, got"):
            EngineConfig(model="tiny", **{name: value})


def test_decode_graphs_are_captured_up_to_512_sequences_whatever_max_num_seqs():
    """One capture a batch size: max_num_seqs 100,000 meant 6,250 captures at start (10**12 hung listing them).
    Larger decode batches run eager, as vLLM's past its largest capture."""
    from roseinfer.cuda_graphs import graph_batch_sizes

    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(65536) == [1, 2, 4, 8, *range(16, 513, 16)]


def test_unknown_roseinfer_variables_are_named_with_a_suggestion():
    warnings = unknown_env_vars({"ROSEINFER_MAX_NUM_SEQ": "8", "ROSEINFER_QUEUE": "q", "PATH": "/bin"})
    assert warnings == [
        "warning: ROSEINFER_MAX_NUM_SEQ is not a roseinfer setting and is ignored; did you mean ROSEINFER_MAX_NUM_SEQS?"
    ]
    assert unknown_env_vars({"ROSEINFER_CPU_KERNELS": "0", "ROSEINFER_CACHE_DIR": "/tmp"}) == []
    # Named by the part after the prefix: the prefix's likeness alone suggested ROSEINFER_BURST for ROSEINFER_PORT.
    assert unknown_env_vars({"ROSEINFER_PORT": "9000"}) == [
        "warning: ROSEINFER_PORT is not a roseinfer setting and is ignored"
    ]


def test_a_roseinfer_variable_not_in_capitals_is_named_as_the_worker_reads_it(monkeypatch):
    """The worker's settings read ROSEINFER_Max_Num_Seqs (pydantic takes names in any case), yet the warning said it
    was ignored; the producer commands read capitals only, so a lower-case queue split a worker from its producers."""
    monkeypatch.setenv("ROSEINFER_Max_Num_Seqs", "3")
    assert WorkerSettings(model="m").max_num_seqs == 3
    [warning] = unknown_env_vars({"ROSEINFER_Max_Num_Seqs": "3", "roseinfer_queue": "q"})[1:]
    assert (
        "roseinfer_queue is read by the worker as ROSEINFER_QUEUE" in warning and "write it ROSEINFER_QUEUE" in warning
    )
    assert "write it ROSEINFER_MAX_NUM_SEQS" in unknown_env_vars({"ROSEINFER_Max_Num_Seqs": "3"})[0]
    # An engine or server variable is read in capitals alone, by everything: not "read by the worker".
    cpu = unknown_env_vars({"roseinfer_cpu_kernels": "0"})
    assert cpu == ["warning: roseinfer_cpu_kernels is ignored: write it ROSEINFER_CPU_KERNELS"]


def test_the_workers_socket_timeout_follows_the_pulls_real_wait():
    """A pull blocks 0.2 s at a time (a worker serves two lanes or more): --idle-wait 60 set a 65 s socket timeout,
    and a Redis that stopped answering went unnoticed that long, for a wait that never came."""
    assert WorkerSettings(model="m", idle_wait=60).socket_timeout == WorkerSettings(model="m").socket_timeout == 6


def test_every_roseinfer_variable_the_code_reads_is_known():
    """A variable read somewhere but missing from the known list made every command warn that it is ignored."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    read = set()
    for package in ("roseinfer", "worker", "producer"):
        for path in (root / package).rglob("*.py"):
            text = path.read_text()
            read |= set(re.findall(r"(?:environ(?:\.get\(|\[)|env_switch\(|env_choice\()\s*[\"'](ROSEINFER_\w+)", text))
    assert {"ROSEINFER_BF16_GEMM", "ROSEINFER_MALLOC_TUNING", "ROSEINFER_CACHE_DIR", "ROSEINFER_CPU_KERNELS"} <= read
    assert unknown_env_vars(dict.fromkeys(read, "1")) == []


@pytest.mark.parametrize(
    ("argv", "env", "phrase"),
    [
        # The engine's check of the whole names the flag too, as a field's does.
        (["worker", "--dtype", "fp32"], {}, "error: --dtype / ROSEINFER_DTYPE: dtype must be one of float32, bfloat16"),
        (["worker"], {"ROSEINFER_MAX_NUM_SEQS": "lots"}, "error: --max-num-seqs / ROSEINFER_MAX_NUM_SEQS"),
        (["bench", "--block-size", "0"], {}, "error: block_size must be a positive integer"),
        (["worker"], {"ROSEINFER_ALLOW_CALLBACK": "a.b"}, "error: ROSEINFER_ALLOW_CALLBACK does not parse"),
        # Taken, and never used: the server serves what the queue's workers hold.
        (["serve", "--model", "other-model"], {}, "error: --model is for --embedded"),
        # (it served its own Redis all the same, the one named left alone)
        (["serve", "--embedded", "--redis-url", "redis://10.0.0.5:6379/0"], {}, "error: --redis-url is for a server"),
    ],
)
def test_configuration_errors_are_one_line_and_exit_2_before_connecting(argv, env, phrase, monkeypatch, capsys):
    from worker.cli import main

    # A Redis URL nothing answers on: a configuration error must come first, not a connection attempt.
    for name, value in {"ROSEINFER_REDIS_URL": "redis://127.0.0.1:1/0", **env}.items():
        monkeypatch.setenv(name, value)
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(phrase), err
    assert "Traceback" not in err and "Redis" not in err


def test_serves_flag_mistakes_are_said_before_its_port_is_looked_at(capsys):
    """The port was probed first: with another server on it (the compose stack's on 8000), a flag mistake was said
    as "cannot listen"; fixed, it came out after the listener left."""
    import socket

    from worker.cli import main

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        assert main(["serve", "--port", port, "--model", "other-model"]) == 2
        assert "error: --model is for --embedded" in capsys.readouterr().err
        assert main(["serve", "--port", port, "--embedded", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
        assert "error: --redis-url is for a server" in capsys.readouterr().err
        assert main(["serve", "--port", port, "--redis-url", "redis://127.0.0.1:1/0"]) == 2
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.slow  # a Python process: the fast lane starts one of those (tests/test_engine_process.py)
def test_version_and_the_unknown_variable_warning_on_the_command_line():
    env = {**os.environ, "ROSEINFER_QUEU": "typo"}
    out = subprocess.run([sys.executable, "-m", "worker.cli", "--version"], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.startswith("roseinfer ")
    assert "ROSEINFER_QUEU is not a roseinfer setting" in out.stderr and "ROSEINFER_QUEUE?" in out.stderr


def test_payload_and_sampling_params_declare_the_same_fields_and_defaults():
    sampling = _sampling_fields()
    assert set(JobRequest.model_fields) - PAYLOAD_ONLY == {f.name for f in sampling}
    for f in sampling:  # but max_tokens: a job's is OpenAI's (none: the context), the offline API's vLLM's (16)
        if f.name != "max_tokens":
            assert JobRequest.model_fields[f.name].default == f.default, f.name
    kwargs = JobRequest.model_validate({"prompt": "x"}).sampling_kwargs()
    assert set(kwargs) == {f.name for f in sampling}
    assert SamplingParams(**kwargs) == SamplingParams(max_tokens=None)
    assert SamplingParams().max_tokens == 16 and SamplingParams().temperature == 1.0  # (vLLM's defaults)


PROBES = [
    -(10**30),
    -(2**63) - 1,
    -(2**63),
    -3,
    -2,
    -1,
    -0.5,
    0,
    0.5,
    1,
    1.5,
    2,
    2.5,
    20,
    21,
    64,
    65,
    2**31 - 1,
    2**31,
    2**63 - 1,
    2**63,
    10**30,
]


@pytest.mark.parametrize("name", [f.name for f in _sampling_fields()])
def test_payload_and_sampling_params_accept_and_refuse_the_same_values(name):
    probes = PROBES + [True, "x", None, [1], [-1], [2**31], ["a"], [""], "stop"]
    for value in probes:
        payload_ok = _accepts(lambda v: JobRequest.model_validate({"prompt": "x", name: v}), value)
        if name == "logprobs" and isinstance(value, bool):
            continue  # the payload's chat form (true + top_logprobs) maps to an int before the engine sees it
        engine_ok = _accepts(lambda v: SamplingParams(**{"max_tokens": None, name: v}), value)  # (the payload's)
        assert payload_ok == engine_ok, (name, value, payload_ok, engine_ok)


def test_payload_and_sampling_params_bound_logit_bias_alike():
    """The payload's string keys are the engine's token ids: both take and refuse the same biases."""
    probes = [{}, {"0": 100}, {"0": -100}, {"0": 100.5}, {"0": -101}, {"5": float("nan")}, {"5": float("inf")}]
    probes += [{"2147483647": 1}, {"2147483648": 1}, {str(i): 1 for i in range(1024)}, {str(i): 1 for i in range(1025)}]
    for value in probes:
        payload_ok = _accepts(lambda v: JobRequest.model_validate({"prompt": "x", "logit_bias": v}), value)
        engine_ok = _accepts(lambda v: SamplingParams(logit_bias={int(k): b for k, b in v.items()}), value)
        assert payload_ok == engine_ok, (value if len(value) < 3 else len(value), payload_ok)
    kwargs = JobRequest.model_validate({"prompt": "x", "logit_bias": {"7": 1, 9: -2}}).sampling_kwargs()
    assert kwargs["logit_bias"] == {7: 1.0, 9: -2.0}  # a Python caller's int keys are taken too
    for twice in ({"5": 1, "05": -1}, {5: 1, "5": -1}):  # one token, two biases: refused, not the last one taken
        with pytest.raises(ValueError, match=r"same token, 5|names a token twice"):
            JobRequest.model_validate({"prompt": "x", "logit_bias": twice})


def _accepts(build, value) -> bool:
    try:
        build(value)
    except (ValueError, TypeError):
        return False
    return True


def test_min_tokens_above_max_tokens_is_refused_by_both():
    with pytest.raises(ValueError, match="min_tokens"):
        JobRequest.model_validate({"prompt": "x", "min_tokens": 5, "max_tokens": 2})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)
    json.dumps(SamplingParams().__dict__)  # plain values only


def test_generate_runs_without_a_seed_and_a_model_that_is_not_there_is_one_line(tiny_chat_model, capsys):
    """``roseinfer generate`` took its sampling seed flag's None as the engine's seed and refused to start unless
    given --seed; a model path that does not exist was transformers' 50-line traceback."""
    from worker.cli import main

    assert main(["generate", "Hello", "--model", tiny_chat_model, "--max-tokens", "3", "--temperature", "0"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["completion_tokens"] <= 3 and line["finish_reason"] in ("length", "stop")
    assert main(["generate", "Hello", "--model", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such model folder or file: /nonexistent/model" in err
    assert main(["generate", "Hello", "--model", "tiy"]) == 2  # a built-in name mistyped: taken for a hub id
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.rstrip().endswith("or tiny; did you mean tiny?)"), err


def test_generate_answers_every_prompt_it_can_and_says_which_it_cannot(tiny_chat_model, capsys, monkeypatch):
    """A prompt past the context was a traceback that lost every other prompt's answer; no prompt at all loaded the
    model, printed nothing and exited 0."""
    import io

    from worker.cli import main

    long = "sea " * 3000
    assert main(["generate", "Hi", long, "There", "--model", tiny_chat_model, "--max-tokens", "2"]) == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [sorted(line) for line in lines] == [["completion_tokens", "finish_reason", "text"], ["error"],
                                                ["completion_tokens", "finish_reason", "text"]]  # fmt: skip
    assert "this model allows at most" in lines[1]["error"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n \n"))
    assert main(["generate", "--model", "/nonexistent/model"]) == 2  # (said before the model loads)
    assert "no prompts" in capsys.readouterr().err


def test_generate_answers_a_line_per_stdin_line_and_keeps_the_answers_written_when_stopped(
    tiny_chat_model, capsys, monkeypatch
):
    """A blank stdin line was dropped, putting every later answer a line up from its prompt; Ctrl-C lost every
    answer already made (nothing was printed until the last prompt finished)."""
    import io

    from roseinfer.llm_engine import LLMEngine
    from worker.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n\nThere\n"))
    flags = ["--model", tiny_chat_model, "--max-tokens", "2", "--max-num-seqs", "1"]
    assert main(["generate", *flags]) == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 3 and "text" in lines[0] and lines[1] == {"error": "a blank prompt"} and "text" in lines[2]
    real_step, steps = LLMEngine.step, []

    def interrupted(self, *args, **kwargs):
        steps.append(1)
        if len(steps) == 6:  # one request at a time, at most 3 steps each: the first is done, the third is not
            raise KeyboardInterrupt
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "step", interrupted)
    assert main(["generate", "one", "two", "three", *flags]) == 130
    captured = capsys.readouterr()
    done = [json.loads(line) for line in captured.out.splitlines()]
    assert 1 <= len(done) < 3 and all("text" in line for line in done)
    assert f"the first {len(done)} of 3 prompts' answers were written" in captured.err
    # Said once, last: a second "interrupted" followed it, and the progress bar was drawn again after both.
    assert captured.err.rstrip().splitlines()[-1].startswith("interrupted: the first") and (
        "interrupted" not in captured.err.rstrip().splitlines()[-2]
    )


def test_a_model_cache_that_cannot_be_used_is_said_to_be_the_cache_not_the_model(tmp_path, monkeypatch, capsys):
    """ROSEINFER_CACHE_DIR naming a file was "cannot load model 'smollm2-135m-instruct' ... did you mean
    smollm2-135m-instruct?": the name given, suggested back, and the variable never named. It is said before the GGUF
    file is read (that took 12 s on a slow CPU, to then fail on the cache)."""
    import gguf

    from worker.cli import main

    def no_parse(*args, **kwargs):
        raise AssertionError("the GGUF file was read before the cache was checked")

    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    taken = tmp_path / "a-file"
    taken.write_text("x")
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(taken))
    assert main(["generate", "hi", "--model", "smollm2-135m-instruct"]) == 2
    err = capsys.readouterr().err
    assert f"the model cache {taken} cannot be used" in err and "ROSEINFER_CACHE_DIR" in err
    assert "did you mean" not in err


def test_a_bad_value_generate_took_from_the_environment_is_said_to_come_from_there(monkeypatch, capsys):
    """ROSEINFER_DTYPE=bf16 said "dtype must be one of ...", no variable named: the command line had none."""
    from worker.cli import main

    monkeypatch.setenv("ROSEINFER_DTYPE", "bf16")
    assert main(["generate", "hi"]) == 2
    assert "from the environment: ROSEINFER_DTYPE='bf16'" in capsys.readouterr().err


def test_generate_reads_the_model_device_and_dtype_settings_under_its_flags(tiny_chat_model, monkeypatch, capsys):
    """``demo`` and the worker read ROSEINFER_MODEL, _DEVICE and _DTYPE; ``generate`` ran the default model in float32
    on the CPU whatever they said (``docker compose exec worker roseinfer generate hi``)."""
    from worker.cli import build_parser

    monkeypatch.setenv("ROSEINFER_MODEL", tiny_chat_model)
    monkeypatch.setenv("ROSEINFER_DTYPE", "bfloat16")
    args = build_parser().parse_args(["generate", "Hello"])
    assert (args.model, args.dtype, args.device) == (tiny_chat_model, "bfloat16", "cpu")
    assert build_parser().parse_args(["generate", "Hello", "--dtype", "float32"]).dtype == "float32"  # (flags win)
    monkeypatch.delenv("ROSEINFER_MODEL")
    assert build_parser().parse_args(["generate", "Hello"]).model != tiny_chat_model


@pytest.mark.slow  # two engines
def test_generate_reads_prompts_from_stdin_without_their_line_ends_or_byte_order_mark(
    tiny_chat_model, capsys, monkeypatch
):
    """A file written on Windows gave prompts ending in "\r", the first one starting with a BOM."""
    import io

    from worker.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("\ufeffHello\r\n\r\nHello\r\n"))
    assert main(["generate", "--model", tiny_chat_model, "--max-tokens", "3", "--temperature", "0"]) == 1
    first, blank, second = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert blank == {"error": "a blank prompt"}  # (its line's "\r" is not a prompt)
    assert main(["generate", "Hello", "--model", tiny_chat_model, "--max-tokens", "3", "--temperature", "0"]) == 0
    assert first == second == json.loads(capsys.readouterr().out)  # the same prompt: "Hello"


def test_generate_refuses_a_prompt_that_is_not_utf8_before_the_model_loads(tiny_chat_model, capsys, monkeypatch):
    """Bytes on stdin that are not UTF-8 came through as lone surrogates: the model loaded, then the tokenizer's
    TypeError, a traceback and exit 1."""
    import io

    from roseinfer import LLM
    from worker.cli import main

    monkeypatch.setattr(LLM, "from_config", lambda *a, **k: pytest.fail("the model loaded"))
    stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9\n"), encoding="utf-8", errors="surrogateescape")
    monkeypatch.setattr("sys.stdin", stdin)
    assert main(["generate", "--model", tiny_chat_model]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stdin is not UTF-8 text" in err
    assert main(["generate", b"caf\xe9".decode("utf-8", "surrogateescape"), "--model", tiny_chat_model]) == 2
    assert "a prompt argument is not UTF-8 text" in capsys.readouterr().err


def test_a_file_that_is_no_model_or_a_tokenizer_that_is_not_there_is_one_line(tiny_chat_model, tmp_path, capsys):
    """Both were a traceback and exit 1, where every other configuration error is one line and exit 2."""
    from worker.cli import main

    notes = tmp_path / "notes.txt"
    notes.write_text("not a model")
    assert main(["generate", "Hello", "--model", str(notes)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "neither a model folder nor a .gguf file" in err
    assert main(["generate", "Hello", "--model", tiny_chat_model, "--tokenizer", str(tmp_path / "no-tok")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot load tokenizer" in err


def test_bench_samples_as_asked_and_refuses_a_bad_temperature_in_one_line(tiny_chat_model, tmp_path, capsys):
    """``roseinfer bench --temperature T --top-p P`` times a sampled workload (greedy was all it measured, and on a
    CPU sampling had cost more than the model); a bad value is one line and exit 2, before anything loads."""
    from worker.cli import main

    out = tmp_path / "bench.json"
    argv = ["bench", "--model", tiny_chat_model, "--skip-hf", "--num-prompts", "4", "--max-tokens", "4"]
    assert main([*argv, "--temperature", "0.8", "--top-p", "0.9", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["sampling"] == {"temperature": 0.8, "top_p": 0.9}
    assert figures["results"][0]["generated_tokens"] == 16
    assert "temperature 0.8, top_p 0.9" in capsys.readouterr().out
    assert main([*argv, "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "temperature must be a number in [0, 2]" in err


def test_a_command_with_defaults_of_its_own_shows_them_in_its_help():
    """``roseinfer bench-redis --help`` said --model defaults to smollm2-135m-instruct; it runs the tiny model."""
    import argparse

    from worker.bench_redis import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    model = next(a for a in p._actions if a.dest == "model")
    assert model.default == "tiny" and model.help.endswith("(tiny)") and p.parse_args([]).model == "tiny"
    # generate's own (greedy, 128 tokens, unlike submit's and SamplingParams' temperature 1.0) were not shown at all
    from worker.cli import build_parser

    generate = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    assert "(default: 128)" in generate and "(default: 0.0, greedy)" in generate


def test_the_tiny_model_is_a_model_name_for_every_command(tmp_path, monkeypatch, capsys):
    """``--model tiny`` worked for the benchmarks only: a worker took it for a hub id and waited on the network. It
    is built once into the cache, the same on every machine (seeded), so a fleet's workers serve one model."""
    from roseinfer.model_loader import resolve_model
    from worker.cli import main

    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path))
    path = resolve_model("tiny")
    built = (Path(path) / "model.safetensors").read_bytes()
    assert resolve_model("tiny") == path and (Path(path) / "model.safetensors").read_bytes() == built
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(elsewhere))  # another machine
    assert (Path(resolve_model("tiny")) / "model.safetensors").read_bytes() == built
    assert main(["generate", "Hello", "--model", "tiny", "--max-tokens", "3", "--temperature", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["completion_tokens"] == 3


def test_a_model_folder_named_as_a_built_in_model_is_that_folder(tmp_path, monkeypatch, tiny_llama):
    """A clone of the hub's SmolLM2-135M-Instruct (or a folder called tiny) in the working folder: the name matched
    the built-in default (the GGUF dequantized) or the random tiny model first, and the folder was never read."""
    import shutil

    import roseinfer.model_loader as loader

    def no_default():
        raise AssertionError("the built-in default was looked for")

    monkeypatch.setattr(loader, "default_gguf_path", no_default)
    monkeypatch.chdir(tmp_path)
    for name in ("SmolLM2-135M-Instruct", "tiny"):
        shutil.copytree(tiny_llama, tmp_path / name)
        assert loader.resolve_model(name) == name


def test_a_benchmarks_counts_below_one_are_refused_before_the_model_loads(capsys, tmp_path):
    """0 tokens, prompts or repeats failed after the model loaded (a ValueError, a median of nothing, a division
    by zero), as did --json into a folder that is not there."""
    from worker.cli import build_parser

    for flags in (["--max-tokens", "0"], ["--repeats", "0"], ["--num-prompts", "0"], ["--hf-batch-size", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", *flags])
        assert "must be at least 1" in capsys.readouterr().err
    # The queue's benchmarks too: a median of nothing after the model loaded and the worker started (a traceback).
    for command in ("bench-queue", "bench-priority", "bench-serve"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--repeats", "0"])
        assert "must be at least 1" in capsys.readouterr().err
        with pytest.raises(SystemExit):  # (bench-priority's and bench-serve's worker refused it, once started)
            build_parser().parse_args([command, "--dtype", "float64"])
        assert "invalid choice: 'float64'" in capsys.readouterr().err
    # Output files too, in the parse (bench-queue's were found after its whole run; a folder, by both).
    for command, flag, path, said in (("bench", "--json", "/no/such/folder/x.json", "no folder /no/such/folder"),
                                      ("bench", "--json", str(tmp_path), "is a folder; name a file in it"),
                                      ("bench-queue", "--json", str(tmp_path), "is a folder; name a file in it"),
                                      ("bench-queue", "--worker-log", "/no/such/w.log", "no folder /no/such"),
                                      ("bench-queue", "--arrival-interval", "-1", "must be at least 0"),
                                      ("bench", "--hf-single", "-1", "must be at least 0"),  # (ran all but one)
                                      ("bench-queue", "--stock-jobs", "-1", "must be at least 0")):  # fmt: skip
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, flag, path])
        assert said in capsys.readouterr().err
    # The other benchmarks' bad counts: a bad option's exit 2, as the others', not 1 (0 new tokens: a traceback).
    from worker.cli import main

    for argv in (["bench-resume", "--jobs", "0"], ["bench-dataset", "--what", "n", "--new-tokens", "0"]):
        assert main(argv) == 2
        assert capsys.readouterr().err.startswith(f"error: {argv[0]}: ")
    assert main(["bench", "--prompts", str(tmp_path)]) == 2
    assert f"prompts file {tmp_path} is a folder" in capsys.readouterr().err


def test_a_benchmarks_worker_that_exits_at_its_start_has_its_last_line_said():
    """bench-priority and bench-serve dropped their worker's output: a bad flag's one-line error came out as "the
    worker exited with code 2" alone."""
    import subprocess
    import sys
    import tempfile

    import fakeredis

    from worker.bench_queue import _wait_for_worker

    with tempfile.NamedTemporaryFile() as log:
        code = "import sys; print('loading', file=sys.stderr); print('error: --dtype bogus', file=sys.stderr); exit(2)"
        proc = subprocess.Popen([sys.executable, "-c", code], stderr=log)
        with pytest.raises(SystemExit, match=r"^the worker exited with code 2: error: --dtype bogus$"):
            _wait_for_worker(fakeredis.FakeRedis(), "q", proc, timeout=30, log=log)


def test_serve_embedded_stops_its_redis_server_when_an_option_is_refused(monkeypatch):
    """A mistyped --dtype or --model: one line and exit 2, and the redis-server it had started ran on, orphaned."""
    from pydantic import ValidationError

    import worker.local_redis as local_redis
    from worker.cli import build_parser
    from worker.embedded import serve_embedded

    class Server:
        stopped = False
        args = ()

        def terminate(self):
            Server.stopped = True

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(local_redis, "start_private_redis", lambda **_: ("redis://127.0.0.1:1/0", Server()))
    with pytest.raises(ValidationError):
        serve_embedded(build_parser().parse_args(["serve", "--embedded", "--dtype", "bf16"]))
    assert Server.stopped


def test_the_workers_log_level_is_a_setting_its_engine_process_follows(monkeypatch):
    """INFO was forced on the worker (a line per batch of jobs, thousands an hour): RQ's --logging-level and vLLM's
    VLLM_LOGGING_LEVEL let an operator keep only what went wrong."""
    import logging

    import worker.cli as worker_cli
    import worker.main

    seen = {}
    monkeypatch.setattr(worker.main, "run_worker", lambda settings, logging_level: seen.update(level=logging_level))
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)  # (put back after the test)
    monkeypatch.setenv("ROSEINFER_LOG_LEVEL", "warning")
    worker_cli.worker(build_parser().parse_args(["worker"]))
    assert seen["level"] == "WARNING" and root.level == logging.WARNING
    worker_cli.worker(build_parser().parse_args(["-v", "worker", "--log-level", "ERROR"]))
    assert seen["level"] == "DEBUG" and root.level == logging.DEBUG


def test_the_payloads_list_and_constraint_bounds_are_the_engines():
    """Written twice (the producer holds no engine): a job the payload takes must not fail in the engine."""
    import producer.schema as payload
    import roseinfer.sampling_params as engine

    stops = ("MAX_STOP_STRINGS", "MAX_STOP_CHARS", "MAX_STOP_TOKEN_IDS")
    names = (*stops, "MAX_CONSTRAINT_CHARS", "MAX_LOGIT_BIAS_TOKENS")
    for name in (*names, "MAX_N"):
        assert getattr(payload, name) == getattr(engine, name), name


def test_the_engines_own_switches_read_the_usual_words_and_refuse_the_rest(monkeypatch, tmp_path):
    """``ROSEINFER_CPU_KERNELS=false`` meant off and kept the kernels on (only "0" was off); a misspelt
    ``ROSEINFER_BF16_GEMM`` was the timing's choice, in silence."""
    import roseinfer.kernels as kernels
    from roseinfer.config import ConfigError, env_choice, env_switch

    for word, on in [("1", True), ("TRUE", True), ("yes", True), (" on ", True), ("0", False), ("false", False),
                     ("No", False), ("off", False), ("", True)]:  # fmt: skip
        monkeypatch.setenv("ROSEINFER_CPU_KERNELS", word)
        assert env_switch("ROSEINFER_CPU_KERNELS", True) is on, word
    monkeypatch.setenv("ROSEINFER_CPU_KERNELS", "flase")
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setattr(kernels, "_lib", None)
    with pytest.raises(ConfigError, match=r"ROSEINFER_CPU_KERNELS='flase': write 1 or 0"):
        kernels.cpu_kernels()
    monkeypatch.setenv("ROSEINFER_CPU_KERNELS", "false")
    assert kernels.cpu_kernels() is None  # off, as asked (not built)
    monkeypatch.setenv("ROSEINFER_BF16_GEMM", "Float32")
    assert env_choice("ROSEINFER_BF16_GEMM", ("bfloat16", "float32")) == "float32"
    monkeypatch.setenv("ROSEINFER_BF16_GEMM", "fp32")
    with pytest.raises(ConfigError, match="write one of bfloat16, float32, or leave it unset"):
        env_choice("ROSEINFER_BF16_GEMM", ("bfloat16", "float32"))
    # Refused by any engine at its start, also one that would never read it (float32 weights here).
    from roseinfer import LLM
    from roseinfer.tiny_models import save_tiny_llama

    model = save_tiny_llama(tmp_path / "tiny")
    with pytest.raises(ConfigError, match="ROSEINFER_BF16_GEMM='fp32'"):
        LLM(model, dtype="float32")
    monkeypatch.delenv("ROSEINFER_BF16_GEMM")
    monkeypatch.setenv("ROSEINFER_MALLOC_TUNING", "nope")
    with pytest.raises(ConfigError, match="ROSEINFER_MALLOC_TUNING='nope'"):
        LLM(model, dtype="float32")


def test_an_empty_cache_dir_variable_is_unset_as_every_engine_variable_is(monkeypatch, tmp_path):
    """``ROSEINFER_CACHE_DIR=""`` was ``Path("")``: converted models and compiled kernels went into the working folder
    (in Docker, beside the app and not on its volume). A ``~`` in it is the home folder."""
    from pathlib import Path

    from roseinfer.config import cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", "")
    assert cache_dir() == Path.home() / ".cache" / "roseinfer"
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", "~/models")
    assert cache_dir() == tmp_path / "models"


def test_webhook_hosts_are_hosts_and_ports_compared_as_a_webhooks_url_is_read():
    """A job's webhook host is read lower case: "https://h" or "" were taken, matched no webhook, and every webhook
    to that host was refused at its job. A name's case is not the operator's to get right. A host alone allowed any
    port of it, and a job set the Host header too: any service on that machine, or behind its proxy, was reached."""
    from types import SimpleNamespace

    from worker.intake import HookPolicy
    from worker.settings import WorkerSettings

    given = ["Hooks.Example.com", "10.0.0.1", "[::1]", "h:8443", "[::1]:8080"]
    hosts = WorkerSettings(allow_webhook_host=given).allow_webhook_host
    assert hosts == ["hooks.example.com", "10.0.0.1", "::1", "h:8443", "[::1]:8080"]
    for bad in ("https://hooks.example.com", "", "hooks.example.com/path", "h:0", "h:65536", "h:port"):
        with pytest.raises(ValueError, match="a host name or address, and a port"):
            WorkerSettings(allow_webhook_host=[bad])
    policy = HookPolicy(webhook_hosts=frozenset(hosts))
    for url, allowed in [
        ("http://hooks.example.com/done", True), ("https://hooks.example.com/done", True),
        ("http://hooks.example.com:80/", True), ("http://hooks.example.com:6379/", False),
        ("https://h:8443/", True), ("http://h/", False), ("http://[::1]:8080/", True), ("http://[::1]:9/", False),
        ("http://10.0.0.1:99999/", False), ("ftp://10.0.0.1/", False), ("http://10.0.0.2/", False),
    ]:  # fmt: skip
        assert policy._allows(url) is allowed, url
    for headers, refused in [({"Authorization": "Bearer t"}, False), ({"HOST": "metadata.internal"}, True),
                             ({"Transfer-Encoding": "chunked"}, True)]:  # fmt: skip
        hook = SimpleNamespace(url="http://hooks.example.com/done", headers=headers, to_dict=dict)
        job = SimpleNamespace(webhooks=[hook])
        assert bool(policy.strip(job)) is refused and (job.webhooks == []) is refused, headers


@pytest.mark.redis
def test_a_pull_blocks_the_bound_the_socket_timeout_counts_on_whatever_it_is_asked(redis_url):
    """One lane blocked the whole wait asked (up to 60 s), past the worker's socket timeout (taken for an outage)."""
    import time

    from redis import Redis
    from rq import Queue
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from worker.intake import MULTI_LANE_WAIT_S, pull

    conn = Redis.from_url(redis_url)
    started = time.monotonic()
    assert pull([Queue("empty-lane", connection=conn)], 1, 5, conn, Job, JSONSerializer) == ([], [])
    assert time.monotonic() - started < MULTI_LANE_WAIT_S + 2  # (the bug blocked the 5 s asked)


@pytest.mark.parametrize("text", ["not json", '{"a": 1}', "[]", '["a", 3]', '["a", ""]'])
def test_a_bench_prompts_file_that_is_no_list_of_prompts_is_one_line(tmp_path, text):
    """``--prompts`` (and bench-queue's, bench-redis's) of no list of prompt strings: a JSONDecodeError, a TypeError
    or a ZeroDivisionError traceback."""
    import argparse

    from roseinfer.bench import load_prompts
    from roseinfer.config import ConfigError

    path = tmp_path / "prompts.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"prompts file {path}"):
        load_prompts(argparse.Namespace(input_len=0, prompts=str(path), num_prompts=4))
    path.write_text('["one", "two"]')
    assert (
        load_prompts(argparse.Namespace(input_len=0, prompts=str(path), num_prompts=3))[2][0]["content"]
        == "(Round 2.) one"
    )


def test_a_benchs_prompts_differ_from_their_start_so_the_prefix_cache_serves_none_whole():
    """--input-len made 14 distinct prompts of any --num-prompts, and a workload's repeats were its own prompts: the
    prefix cache served them, while transformers computed each. Each differs from its first words now."""
    import argparse

    from roseinfer.bench import load_prompts

    for input_len, count in ((40, 100), (0, 150)):
        texts = [c[0]["content"] for c in load_prompts(argparse.Namespace(input_len=input_len, prompts=None,
                                                                           num_prompts=count))]  # fmt: skip
        assert len(texts) == count and len(set(texts)) == count, input_len
        if input_len:  # (its first word a number: no two share a first block)
            assert all(len(t.split()) == input_len for t in texts) and len({t.split()[0] for t in texts}) == count
        else:  # (a repeat begins with its round, not with the prompt it repeats)
            assert all(t.startswith("(Round ") for t in texts[64:]) and not any(t.startswith("(") for t in texts[:64])


@pytest.mark.parametrize(
    ("response_format", "said"),
    [({"type": "json_schema"}, "type 'json_schema' needs its json_schema"),
     ({"type": "json_object", "json_schema": {"name": "x", "schema": {}}}, "not 'json_object'")],
)  # fmt: skip
def test_a_response_format_of_a_type_without_its_schema_or_the_other_way_round_says_which(response_format, said):
    """The same words stood for both mistakes (a json_schema type with no schema, a schema under json_object)."""
    from producer.schema import JobRequest

    with pytest.raises(ValueError, match=said):
        JobRequest.model_validate({"prompt": "x", "response_format": response_format})
