"""Shared fixtures: tiny random models saved as transformers folders, the default model's folder, and
helpers that run transformers' own greedy generate as the reference."""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import random
import re
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# This machine sets PYTHONDONTWRITEBYTECODE: each test worker rewrote every test module's asserts and compiled the
# project again on every run (some 7 s of CPU a worker before its first test). Kept in __pycache__, which git ignores.
sys.dont_write_bytecode = False


def pytest_xdist_auto_num_workers(config) -> int | None:
    """``-n auto``: xdist's own count (the cores), and one more. Many tests wait (on Redis, a timer, a process they
    started) and left a core idle: the full suite took 12.6 minutes on 2 workers of 2 cores, 8.8 on 3."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own variable decides
    from xdist.plugin import pytest_xdist_auto_num_workers as xdist_count

    return xdist_count(config) + 1


def pytest_sessionstart(session) -> None:
    # pytest-xdist's controller runs no test: importing torch there held every worker's start back by 3 s.
    if session.config.pluginmanager.hasplugin("dsession"):
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _exit_at_once_when_done(session)
    # Under pytest-xdist (README's `-n auto`) the workers share the cores: torch's default of every core in each, and
    # in each worker process a test starts, made them fight (the fast lane took longer on 2 workers than on 1).
    if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
        threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # (before torch loads OpenMP; started processes too)
    import torch

    if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # Without a GPU the Triton kernels run in Triton's interpreter: decided before any test module imports them.
    if os.environ.get("TRITON_INTERPRET") is None and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _exit_at_once_when_done(session) -> None:
    """A pytest-xdist worker has sent its every result when it exits: Python's last collection of what torch, triton
    and the tests leave (it cannot stay frozen: triton prints its objects as leaks) took 3 s of each worker's end.
    Registered before torch loads, so that what torch and the tests register at exit runs first."""
    pid = os.getpid()

    def exit_now() -> None:
        if os.getpid() == pid:  # (not in a process forked from the worker)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(int(session.exitstatus))

    atexit.register(exit_now)


def pytest_collection_finish(session) -> None:
    # torch, transformers and the test modules are some 400,000 objects that live to the end: frozen, the full
    # collections each engine's build runs skip them.
    gc.freeze()


def pytest_unconfigure(config) -> None:
    gc.unfreeze()  # (left frozen, triton's objects outlive the interpreter and it prints each as a leak)


# The fast lanes README.md names. A file marked slow as a whole is not even imported there: test_server's HTTP
# stack alone takes seconds to import.
FAST_LANES = ("not slow", "not slow and not redis")


def pytest_ignore_collect(collection_path, config) -> bool | None:
    fast = config.getoption("markexpr") in FAST_LANES and collection_path.suffix == ".py"
    if fast and re.search(r"^pytestmark = pytest\.mark\.slow\b", collection_path.read_text(), re.MULTILINE):
        return True
    return None


def pytest_collection_modifyitems(items) -> None:
    # A test that takes a real Redis server is marked so, whatever file it sits in: `-m "not redis"` skips them all.
    for item in items:
        if "redis_url" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.redis)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from roseinfer.tiny_models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> str:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=512,
        initializer_range=0.3,
        eos_token_id=None,
        bos_token_id=None,
    )
    path = tmp_path_factory.mktemp("tiny-gpt2")
    GPT2LMHeadModel(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """The default model as a safetensors folder (converted from its GGUF once, then cached)."""
    from roseinfer.model_loader import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smol_tokenizer(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.fixture(scope="session")
def tiny_longrope(tmp_path_factory) -> str:
    """A tiny Phi-3 with LongRoPE (an original length of 64 in a context of 256), its q and k projections scaled up
    so attention is peaked: a random model's is flat, and which factors rotate it would hardly show. Its reference
    is ``hf_greedy(..., use_cache=False)``: each step a forward over the whole sequence, the long factors once it
    passes 64, which transformers 5.24's cached generate equals (it recomputes its cache there); 5.18's does not."""
    import torch
    from transformers import AutoModelForCausalLM, Phi3Config

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0, 1.0, 1.5, 2.0], "long_factor": [1.0, 3.0, 9.0, 20.0]}  # fmt: skip
    config = Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                        pad_token_id=None, eos_token_id=None, original_max_position_embeddings=64,
                        rope_parameters=rope)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.qkv_proj.weight[: 2 * 64] *= 25  # q's and k's rows of the fused projection
    path = str(tmp_path_factory.mktemp("tiny-longrope"))
    model.save_pretrained(path)
    return path


def hf_greedy(
    model_path: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype: str = "float32",
    device: str = "cpu",
    logit_biases: list[dict[int, float] | None] | None = None,
    use_cache: bool = True,
) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding), new tokens only; ``logit_biases``: each
    prompt's, as transformers' ``sequence_bias`` of one-token sequences; ``use_cache=False``: each step one forward
    over the whole sequence."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
    out = []
    for i, ids in enumerate(prompts):
        bias = logit_biases[i] if logit_biases else None
        with torch.inference_mode():
            gen = model.generate(
                torch.tensor([ids], device=device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
                use_cache=use_cache,
                **({"sequence_bias": {(t,): b for t, b in bias.items()}} if bias else {}),
            )
        out.append(gen[0, len(ids) :].tolist())
    return out


@pytest.fixture
def no_kernels(monkeypatch):
    """Run the plain PyTorch twins of the C kernels (the path CUDA takes)."""
    import roseinfer.kernels as kernels

    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "_tried", True)


def no_redis_server(why: str) -> None:
    """A test that needs a redis-server of its own skips without one, saying why; in CI (``CI_REQUIRE_REDIS``,
    set by ``.ci/run`` once it made sure one is installed) it fails: every integration test skipped was green."""
    if os.environ.get("CI_REQUIRE_REDIS"):
        pytest.fail(f"CI_REQUIRE_REDIS is set, but {why}")
    pytest.skip(why)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    """A real Redis server of the tests' own, on a free port (none is shared with anything else)."""
    from worker.local_redis import redis_server_version, start_private_redis, stop_private_redis

    server = os.environ.get("ROSEINFER_TEST_REDIS_SERVER", "redis-server")
    if (version := redis_server_version(server)) is not None and version < (6, 2):  # (LMOVE, GETDEL: 6.2)
        no_redis_server(f"{server} is Redis {'.'.join(map(str, version))}: these tests need 6.2 or later")
    url, proc = start_private_redis(server)
    if proc is None:
        no_redis_server("could not start redis-server")
    yield url
    stop_private_redis(proc)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, smol_tokenizer) -> str:
    """A tiny random Llama with the default model's tokenizer and chat template: loads in a second."""
    from roseinfer.tiny_models import save_tiny_chat_model

    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), smol_tokenizer)


@contextlib.contextmanager
def stuck_worker(client, after: float = 0.0):
    """A worker that takes every queued job (after ``after`` seconds) and never ends it: its status says started."""
    stop = threading.Event()

    def take() -> None:
        stop.wait(after)
        conn = client.connection
        while not stop.wait(0.01):
            for key in conn.keys("rq:queue:*"):
                while (job_id := conn.lpop(key)) is not None:
                    conn.hset(b"rq:job:" + job_id, "status", "started")

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def refuse_lua(conn):
    """``conn`` (fakeredis, which runs Lua since lupa is installed) refusing scripts, as a Redis whose ACL or host
    forbids them: the worker's plain-command path."""
    import redis

    inner = conn.execute_command

    def execute_command(*args, **options):
        if str(args[0]).split()[0].upper() in {"EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO", "SCRIPT", "FCALL"}:
            raise redis.ResponseError(f"unknown command '{args[0]}'")
        return inner(*args, **options)

    conn.execute_command = execute_command
    return conn


def requeue_as_resumed(client, payload: dict, events: list[dict]):
    """A new job of ``payload`` on ``client``'s queue, as if an earlier attempt streamed ``events`` and died and the
    job was requeued (its hash keeps the start, its stream those events): the worker resumes after them. Made in
    a queue nobody serves, then moved over. Returns its handle."""
    from rq.utils import now

    from producer import Client
    from producer.protocol import STREAM_OF_FIELD

    job_id = f"resumed-{uuid.uuid4().hex[:8]}"
    parked = Client(connection=client.connection, queue=f"parked-{job_id}").submit(**payload, job_id=job_id)
    for event in events:  # (after the submit: an id's stream left by no job is an old job's, which a submit clears)
        client.connection.xadd(f"roseinfer:stream:{job_id}", {"event": json.dumps(event)})
    job = parked.rq_job
    job.started_at = now()
    job.save()
    conn = client.connection  # the stream is this job's: as the earlier attempt's start marked it
    conn.hset(job.key, STREAM_OF_FIELD, conn.hget(job.key, "created_at"))
    client.connection.delete(f"rq:queue:parked-{job_id}")
    client.queue.enqueue_job(job)
    return client.job(job_id)


def tpot_histogram(worker) -> tuple[float, float]:
    """A worker's time-per-output-token histogram: (observations, their sum)."""
    registry = worker.metrics.registry
    name = "roseinfer_time_per_output_token_seconds"
    return registry.get_sample_value(f"{name}_count") or 0.0, registry.get_sample_value(f"{name}_sum") or 0.0


def tpot_settled(worker) -> tuple[float, float]:
    """``tpot_histogram`` once no job is in flight and its count held for 0.3 s: an earlier test's last job, ended on
    a shared worker, is observed just after its result."""
    deadline = time.monotonic() + 10
    seen, since = tpot_histogram(worker), time.monotonic()
    while worker.in_flight or time.monotonic() - since < 0.3:
        assert time.monotonic() < deadline, "the worker never settled"
        time.sleep(0.02)
        if (now := tpot_histogram(worker)) != seen:
            seen, since = now, time.monotonic()
    return seen


def tpot_counted_after(worker, count: float) -> None:
    """Until the histogram holds more than ``count`` observations: a job's is observed just after its result is
    written (on the sender's thread)."""
    deadline = time.monotonic() + 10
    while tpot_histogram(worker)[0] <= count:
        assert time.monotonic() < deadline, "no time per token observed"
        time.sleep(0.01)


def expire_together(conn, first: str, then: str) -> bool:
    """``first`` and ``then`` both expire, ``first`` no later than ``then`` but for seconds: both TTLs read in one
    transaction, in milliseconds (two TTL calls in whole seconds straddled a rounding boundary now and then; the
    writes that set them are not always one script's, some are milliseconds apart)."""
    first_ms, then_ms = conn.pipeline(transaction=True).pttl(first).pttl(then).execute()
    return first_ms > 0 and then_ms > 0 and first_ms <= then_ms + 5000


def steady_port() -> int:
    """A free port below the range the system hands out for bind(0) and outgoing connections, in a span of this
    xdist worker's own: a test that stops its Redis and starts it again on the port keeps it (a free_port() another
    worker drew meanwhile took it, and the restart failed)."""
    from worker.local_redis import free_port

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    start = 20000 + 500 * (int(worker) % 20 if worker.isdigit() else 0)
    if start + 500 > low:  # (a system whose range starts low: no span is steady there)
        return free_port()
    for port in random.sample(range(start, start + 500), 500):
        with contextlib.suppress(OSError), socket.create_server(("127.0.0.1", port)):
            return port
    return free_port()


def slow_engine_steps(monkeypatch, engine, seconds: float = 0.02) -> None:
    """Engine steps of at least ``seconds``: a job of 200 tokens runs for seconds on any machine, so a test that
    cancels it or outlasts a short timeout never meets a job that already ended."""
    real_step = engine.step
    monkeypatch.setattr(engine, "step", lambda *args, **kwargs: (time.sleep(seconds), real_step(*args, **kwargs))[1])


# A worker process whose engine steps take 20 ms at least: its jobs run for seconds on any CPU, so a test that
# signals it mid-job never meets jobs that already ended (a fast CPU ran 4 x 250 tiny-model tokens within the 0.2 s
# between two SIGTERMs).
_SLOW_STEPS = """import sys, time
from roseinfer.llm_engine import LLMEngine
step = LLMEngine.step
LLMEngine.step = lambda self, *a, **k: (time.sleep(0.02), step(self, *a, **k))[1]
from worker.cli import main
sys.exit(main(sys.argv[1:]))
"""


def with_slow_steps(cmd: list[str]) -> list[str]:
    """``worker_command``'s ``python -m worker.cli ...`` as a worker whose steps take 20 ms at least."""
    assert cmd[1:3] == ["-m", "worker.cli"], cmd
    return [cmd[0], "-c", _SLOW_STEPS, *cmd[3:]]


class ThreadWorker:
    """A BatchWorker serving one queue from a thread of the test process."""

    def __init__(self, redis_url: str, model: str, **settings) -> None:
        from worker.main import build_worker
        from worker.settings import WorkerSettings

        self.queue = f"q-{uuid.uuid4().hex[:8]}"
        settings.setdefault("idle_wait", 0.2)  # an idle worker notices stop() within this, not a second
        self.settings = WorkerSettings(redis_url=redis_url, queue=self.queue, model=model, **settings)
        self.worker = build_worker(self.settings)
        self.errors: list[BaseException] = []  # what ended work() by raising (a thread's error is only a warning)
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.thread.start()
        self._wait_listed()

    def _wait_listed(self) -> None:
        """Back once clients see the worker (registered, its statistics written), or once its work() ended: a
        server listed no model to a request sent the moment the thread started (CI)."""
        from producer import Client

        client = Client(self.settings.redis_url, queue=self.queue)
        deadline = time.monotonic() + 60
        try:
            while self.thread.is_alive() and self.worker.name not in [row["name"] for row in client.workers()]:
                assert time.monotonic() < deadline, "the worker did not start"
                time.sleep(0.02)
        except BaseException:  # (no worker left running behind a test that never got it)
            self.worker.request_stop()
            self.thread.join(timeout=30)
            raise
        finally:
            client.connection.close()

    def _work(self) -> None:
        try:
            self.worker.work(logging_level="WARNING")
        except BaseException as e:
            self.errors.append(e)
            raise

    def stop(self) -> None:
        self.worker.request_stop()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()
