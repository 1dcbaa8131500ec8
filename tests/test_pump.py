"""The worker's Redis-free core with a fake engine: admission off the step loop, one event per job per step,
failures that stay with their job, a failing step, cancels and deadlines; then the RQ worker around it on
fakeredis (no Redis server, no model)."""

from __future__ import annotations

import json
import threading
import time

import fakeredis
import pytest
import redis
from conftest import refuse_lua

from producer import Client, JobCanceled, JobFailed
from roseinfer.llm_engine import ContextLengthExceeded
from roseinfer.outputs import CompletionOutput, RequestOutput
from worker.puller import DID_NOT_BLOCK_S
from worker.pump import Pump


class FakeEngine:
    """Each request emits one token a step (text "t<i>") until it has ``max_tokens``."""

    tokenizer = "a tokenizer"  # copied for the pump's tokenizing thread

    def __init__(self) -> None:
        self.requests: dict[str, dict] = {}
        self.fail_steps = 0  # the next steps that raise
        self.waiting: set[str] = set()  # requests left out of the steps (behind max_num_seqs) until taken out of it
        self.steps = 0

    def tokenize(self, prompt, tokenizer=None):
        text = prompt["prompt"]
        if "break the tokenizer" in text:
            raise RuntimeError("tokenizer bug")
        return text, [ord(c) % 50 for c in text]

    def tokenize_many(self, prompts, tokenizer=None):  # the engine's contract: each result or its exception
        out = []
        for prompt in prompts:
            try:
                out.append(self.tokenize(prompt, tokenizer))
            except Exception as exc:
                out.append(exc)
        return out

    def add_request(self, request_id, prompt, params=None, priority=0) -> None:
        if "too long" in prompt.get("prompt", ""):
            raise ContextLengthExceeded("the prompt has 9999 tokens, but this model allows at most 100")
        if "engine bug" in prompt.get("prompt", ""):
            raise KeyError("engine bug at admission")
        self.requests[request_id] = {"left": params.max_tokens, "made": 0, "held": 0, "began": None}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def take_undelivered(self) -> list:
        return []  # its steps make their outputs at once

    def running_request_ids(self) -> list[str]:
        return [rid for rid in self.requests if rid not in self.waiting]

    def running_since(self, request_id):
        return self.requests[request_id]["began"] if request_id in self.requests else None

    def abort_request(self, request_id):
        req = self.requests.pop(request_id, None)
        return [] if req is None else [self._out(request_id, req, "abort")]

    def step(self, flush=True):
        """One token "t<k>" a request; as the real engine's "delta" outputs, a step with ``flush=False`` gives a
        request no output between its first and its last (what it made waits for a flushed step)."""
        self.steps += 1
        time.sleep(self.step_s)
        if self.fail_steps:
            self.fail_steps -= 1
            raise IndexError("injected fault inside a step")
        outs = []
        for rid, req in list(self.requests.items()):
            if rid in self.waiting:
                continue
            if req["began"] is None:
                req["began"] = time.monotonic()
            req["made"] += 1
            req["held"] += 1
            done = req["made"] >= req["left"]
            if done:
                del self.requests[rid]
            if done or flush or req["made"] == 1:
                outs.append(self._out(rid, req, "length" if done else None))
        return outs

    step_s = 0.0  # how long a step sleeps

    @staticmethod
    def _out(rid, req, reason):
        """What the request made since its last output."""
        ids = list(range(req["made"] - req["held"] + 1, req["made"] + 1))
        req["held"] = 0
        completion = CompletionOutput(0, "", list(range(1, req["made"] + 1)), reason)
        return RequestOutput(rid, None, [1, 2], [completion], reason is not None, "".join(f"t{i}" for i in ids), ids)


def _params(max_tokens=3):
    from roseinfer import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0)


def _run(pump: Pump, limit: int = 200) -> list:
    events = []
    for _ in range(limit):
        events += pump.step()
        if not pump.has_work():
            return events
        time.sleep(0.001)
    raise AssertionError("the pump never finished")


def test_jobs_are_tokenized_off_the_loop_and_stream_one_event_per_step():
    pump = Pump(FakeEngine())
    pump.submit("a", {"prompt": "hello"}, _params(3))
    pump.submit("b", {"prompt": "world"}, _params(2))
    events = _run(pump)
    by_job = {j: [e for e in events if e.job_id == j] for j in ("a", "b")}
    assert [e.text for e in by_job["a"]] == ["t1", "t2", "t3"] and by_job["a"][-1].finish_reason == "length"
    assert [e.token_ids for e in by_job["b"]] == [[1], [2]] and by_job["b"][-1].output is not None
    assert len(pump) == 0
    pump.close()


def test_the_last_event_of_n_samples_gives_sample_0s_stop_reason_beside_its_finish_reason():
    """n > 1, the job ending on sample 1's length while sample 0 had stopped on "a": the last event said "stop"
    (sample 0's, the job's) with sample 1's stop reason, none, as if an EOS had ended it."""
    engine = FakeEngine()
    pump = Pump(engine)
    pump.submit("a", {"prompt": "hello"}, _params(3))
    samples = [CompletionOutput(0, "xa", [1, 2], "stop", "a"), CompletionOutput(1, "yyy", [3, 4, 5], "length")]
    engine.step = lambda flush=True: [RequestOutput("a", None, [1, 2], samples, True, "y", [5], 1)]
    events = []
    for _ in range(200):
        events += pump.step()
        if events:
            break
        time.sleep(0.01)
    [last] = events
    assert (last.index, last.finish_reason, last.stop_reason) == (1, "stop", "a")
    pump.close()


def test_a_job_that_breaks_the_tokenizer_or_the_engine_fails_alone():
    engine = FakeEngine()
    pump = Pump(engine)
    pump.submit("good", {"prompt": "fine"}, _params(2))
    pump.submit("tok", {"prompt": "break the tokenizer"}, _params(2))
    pump.submit("long", {"prompt": "too long"}, _params(2))
    pump.submit("bug", {"prompt": "engine bug"}, _params(2))
    events = {e.job_id: e for e in _run(pump) if e.finished}
    assert events["good"].finish_reason == "length"
    assert events["tok"].finish_reason == "error" and "tokenizer bug" in events["tok"].error
    assert events["long"].error == "the prompt has 9999 tokens, but this model allows at most 100"
    assert events["long"].error_code == "context_length_exceeded" and events["tok"].error_code is None
    assert "KeyError" in events["bug"].error and not events["bug"].retryable
    pump.close()


def test_prompts_tokenized_ahead_on_another_thread_are_taken_as_they_are():
    engine = FakeEngine()
    batches = []
    inner = engine.tokenize_many
    engine.tokenize_many = lambda prompts, tokenizer=None: batches.append(len(prompts)) or inner(prompts, tokenizer)
    pump = Pump(engine)
    prompts = [{"prompt": "hello"}, {"prompt": "break the tokenizer"}]
    ahead = []
    puller = threading.Thread(target=lambda: ahead.extend(pump.tokenize_ahead(prompts)))
    puller.start()
    puller.join()
    pump.submit("a", prompts[0], _params(2), tokenized=ahead[0])
    pump.submit("tok", prompts[1], _params(2), tokenized=ahead[1])
    pump.submit("late", {"prompt": "world"}, _params(1))  # not tokenized ahead: in the pump's own batch
    events = {e.job_id: e for e in _run(pump) if e.finished}
    assert events["a"].finish_reason == "length" and events["late"].finish_reason == "length"
    assert events["tok"].finish_reason == "error" and "tokenizer bug" in events["tok"].error
    assert batches == [2, 1]  # the two ahead once, never again at their submit
    assert Pump(engine, tokenize_in_thread=False).tokenize_ahead(prompts) is None  # tokenized on the step loop
    pump.close()


def test_a_failing_step_fails_its_jobs_retryably_and_the_pump_goes_on():
    engine = FakeEngine()
    pump = Pump(engine, tokenize_in_thread=False)
    pump.submit("a", {"prompt": "x"}, _params(5))
    pump.submit("b", {"prompt": "y"}, _params(5))
    pump.step()  # both admitted and stepped once
    engine.fail_steps = 1
    failed = pump.step()
    assert {e.job_id for e in failed} == {"a", "b"}
    assert all(e.finish_reason == "error" and e.retryable and "injected fault" in e.error for e in failed)
    assert not engine.requests and len(pump) == 0  # their engine requests were aborted
    pump.submit("c", {"prompt": "z"}, _params(2))
    assert [e.finish_reason for e in _run(pump) if e.finished] == ["length"]


def test_steps_that_keep_failing_with_new_jobs_each_time_break_the_pump():
    """A sticky accelerator error fails every step: the pump failed each step's jobs and went on, and the worker
    took the queue's jobs one step at a time, spending a retry of each. A failed step between good ones does not."""
    from worker.pump import MAX_FAILED_STEPS, EngineBroken

    engine = FakeEngine()
    pump = Pump(engine, tokenize_in_thread=False)
    pump.submit("a", {"prompt": "x"}, _params(5))
    pump.step()
    engine.fail_steps = 1  # one failure, then good steps: goes on
    pump.step()
    pump.submit("b", {"prompt": "y"}, _params(2))
    assert [e.finish_reason for e in _run(pump) if e.finished] == ["length"]
    engine.fail_steps = 10**9
    for i in range(MAX_FAILED_STEPS - 1):
        pump.submit(f"c{i}", {"prompt": "z"}, _params(5))
        assert all(e.retryable for e in pump.step() if e.finished)
    pump.submit("last", {"prompt": "z"}, _params(5))
    with pytest.raises(EngineBroken, match=f"{MAX_FAILED_STEPS} engine steps in a row failed"):
        pump.step()


def test_cancel_and_deadline():
    engine = FakeEngine()
    pump = Pump(engine, tokenize_in_thread=False)
    pump.submit("a", {"prompt": "x"}, _params(100))
    pump.submit("late", {"prompt": "y"}, _params(100), timeout=0.05)
    first = pump.step()  # (past the deadline already on a machine that stalled 50 ms)
    [event] = pump.cancel("a")
    assert event.finish_reason == "abort" and event.output is not None and "a" not in engine.requests
    assert pump.cancel("a") == []
    time.sleep(0.06)
    ended = [e for e in first + pump.step() if e.finished]
    assert [(e.job_id, e.finish_reason) for e in ended] == [("late", "error")] and "timeout" in ended[0].error
    assert ended[0].timed_out and not ended[0].retryable and ended[0].error_type == "timeout"
    assert not engine.requests


def test_a_timeout_counts_from_the_jobs_first_step_not_its_wait_for_a_place_in_the_batch():
    """RQ's job_timeout limits a job's run: one held in the worker behind max_num_seqs failed with a timeout, no
    token made (and spent a retry on it)."""
    engine = FakeEngine()
    engine.waiting = {"queued"}
    pump = Pump(engine, tokenize_in_thread=False)
    pump.submit("queued", {"prompt": "x"}, _params(100), timeout=0.1)
    pump.step()
    time.sleep(0.15)  # past its timeout's length, never stepped
    assert pump.step() == [] and "queued" in pump
    engine.waiting = set()
    began = time.monotonic()
    events = []
    while not any(e.finished for e in events):
        events += pump.step()
        time.sleep(0.005)
    ended = time.monotonic()
    assert events[-1].timed_out and events[-1].error_type == "timeout"
    assert ended - began >= 0.1 and len(events) > 1  # its own 0.1 s of steps, from its first


def test_a_cancel_ends_with_what_the_engine_held_since_the_last_flush():
    """Steps with flush=False leave a running job's new text in the engine: its cancel event carries that text
    and its token ids, so the stream still adds up to the partial result."""
    pump = Pump(FakeEngine(), tokenize_in_thread=False)
    pump.submit("a", {"prompt": "x"}, _params(100))
    first = pump.step()  # admitted, and its first token out at once
    held = [pump.step(flush=False) for _ in range(3)]
    [event] = pump.cancel("a")
    assert [(e.text, e.token_ids) for e in first] == [("t1", [1])] and held == [[], [], []]
    assert (event.finish_reason, event.text, event.token_ids) == ("abort", "t2t3t4", [2, 3, 4])


def test_a_deadline_belongs_to_its_job_not_to_an_earlier_one_of_the_same_id():
    pump = Pump(FakeEngine(), tokenize_in_thread=False)
    pump.submit("a", {"prompt": "x"}, _params(100), timeout=0.05)
    pump.step()
    pump.cancel("a")
    pump.submit("a", {"prompt": "x"}, _params(100), timeout=60)  # a retry, here again
    time.sleep(0.06)
    assert not [e for e in pump.step() if e.finished]  # the first attempt's deadline is not this one's
    for i in range(500):  # jobs that end before their deadline leave nothing behind for long
        pump.submit(f"j{i}", {"prompt": "x"}, _params(100), timeout=60)
        pump.cancel(f"j{i}")
    assert len(pump._deadlines) <= 2 * len(pump) + 64


@pytest.fixture
def fake_worker(request):
    """The RQ worker over a fake engine, on fakeredis (no server) refusing Lua: the plain-command path, for a Redis
    that forbids scripts (the Lua path runs against real servers elsewhere); settings from the test's
    ``worker_settings`` mark."""
    from worker.batch_worker import BatchWorker
    from worker.settings import WorkerSettings

    server = fakeredis.FakeServer()
    conn = refuse_lua(fakeredis.FakeRedis(server=server))
    setattr(conn, "__rq_redis_server_version", (8, 0, 0))
    engine = FakeEngine()
    marker = request.node.get_closest_marker("worker_settings")
    kwargs = {"idle_wait": 0.2, **(marker.kwargs if marker else {})}  # stop() noticed within 0.2 s, not a second
    settings = WorkerSettings(queue="fake", model="fake", heartbeat_interval=1, **kwargs)
    worker = BatchWorker(engine, settings, conn)
    thread = threading.Thread(target=worker.work, kwargs={"logging_level": "WARNING"}, daemon=True)
    thread.start()
    client_conn = fakeredis.FakeRedis(server=server)
    yield worker, engine, Client(connection=client_conn, queue="fake")
    worker.request_stop()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_burst_worker_whose_last_pull_took_a_job_that_came_then_exits_once_it_ran():
    """A burst worker found the queues empty and stopped its puller; the pull under way took a job that came at that
    moment, and ran it. Its puller gone, nothing could find the queues empty again: it ran on for good, idle."""
    from worker.batch_worker import BatchWorker
    from worker.settings import WorkerSettings

    server = fakeredis.FakeServer()
    conn = refuse_lua(fakeredis.FakeRedis(server=server))
    setattr(conn, "__rq_redis_server_version", (8, 0, 0))
    worker = BatchWorker(FakeEngine(), WorkerSettings(queue="fake", model="fake", idle_wait=0.2), conn)
    client = Client(connection=fakeredis.FakeRedis(server=server), queue="fake")
    first, late, real_done = client.submit("first", max_tokens=3), [], worker._done

    def done(burst: bool) -> bool:  # the queues found empty: a job comes, and the puller takes it, that moment
        finished = real_done(burst)
        if finished and not late:
            late.append(client.submit("late", max_tokens=3))
            worker.puller.wake()
            deadline = time.monotonic() + 10
            while late[0].status() != "started" and time.monotonic() < deadline:
                time.sleep(0.005)
        return finished

    worker._done = done
    thread = threading.Thread(target=worker.work, kwargs={"burst": True, "logging_level": "WARNING"}, daemon=True)
    thread.start()
    thread.join(timeout=10)
    alive = thread.is_alive()
    worker.request_stop()
    thread.join(timeout=10)
    assert not alive, "the burst worker ran on after its last job"
    assert first.result(timeout=1)["usage"]["completion_tokens"] == 3
    assert late[0].result(timeout=1)["usage"]["completion_tokens"] == 3  # (taken by the last pull: run, not left)


def test_the_rq_worker_keeps_serving_through_a_refused_job_and_a_failing_step(fake_worker):
    worker, engine, client = fake_worker
    good = client.submit("fine", max_tokens=4)
    assert good.result(timeout=10)["usage"]["completion_tokens"] == 4
    assert "".join(good.stream(timeout=5)) == "t1t2t3t4"
    refused = client.submit("too long", max_tokens=4)
    with pytest.raises(JobFailed, match="allows at most 100"):
        refused.result(timeout=10)
    engine.fail_steps = 1
    victim = client.submit("victim", max_tokens=3)  # failed by the step, retried (retries=2), then done
    assert victim.result(timeout=10)["usage"]["completion_tokens"] == 3
    assert victim.rq_job.retries_left == 1
    assert worker.sender.round_trips > 0 and worker.sender._emit is None


@pytest.mark.parametrize(
    "step_ms",
    [
        pytest.param(30, marks=[pytest.mark.worker_settings(event_interval_ms=20), pytest.mark.slow]),
        # (an interval far past the steps: a loaded machine's slower steps still share events)
        pytest.param(2, marks=pytest.mark.worker_settings(event_interval_ms=200)),
    ],
    ids=["steps longer than the event interval", "short steps"],
)
def test_a_running_jobs_text_goes_out_every_event_interval_whatever_the_step_time(fake_worker, step_ms):
    """The engine keeps a running job's new text until the worker asks for it, on the step before it sends events:
    with steps longer than the interval every step's text goes out with it; with short ones, about one event an
    interval. Either way the text streams while the job runs, and the pieces add up to the result."""
    _worker, engine, client = fake_worker
    engine.step_s = step_ms / 1000
    job = client.submit("stream me", max_tokens=40)
    result = job.result(timeout=30)
    events = list(job.events(timeout=5))
    assert "".join(e["text"] for e in events) == "".join(f"t{i}" for i in range(1, 41))
    assert [t for e in events for t in e["token_ids"]] == list(range(1, 41)) == result["token_ids"]
    if step_ms == 30:  # each step ended past the interval: one event a token
        assert len(events) >= 35, len(events)
    else:  # 40 steps of 2 ms (and the loop's own time) in 200 ms intervals: a few events of several tokens
        assert 2 <= len(events) < 20, len(events)


@pytest.mark.worker_settings(max_in_flight=3, max_num_seqs=2)
def test_the_puller_takes_jobs_only_as_far_as_the_worker_has_room(fake_worker):
    """Jobs are pulled on a thread of their own while the engine steps, never more than ``max_in_flight`` held
    (taken but not yet in flight counts): the rest wait in Redis, where another worker can take them."""
    worker, _engine, client = fake_worker
    held, waiting, stop = [], [], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            # By id: a job counts once as it moves from the puller's hands to in_flight (counters count it twice).
            held.append(len(set(worker.in_flight) | set(worker.puller._unapplied)))
            waiting.append(client.connection.llen("rq:queue:fake"))
            time.sleep(0.0005)

    jobs = client.submit_many([{"prompt": f"job {i}", "max_tokens": 40} for i in range(12)])
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    results = [job.result(timeout=30) for job in jobs]
    stop.set()
    watcher.join()
    assert [r["usage"]["completion_tokens"] for r in results] == [40] * 12
    assert max(held) <= 3
    assert max(waiting) >= 12 - 3  # not all taken at once


@pytest.mark.slow  # seconds: the full suite's
def test_a_worker_whose_last_results_are_sent_looks_for_jobs_at_once(fake_worker, monkeypatch):
    """Once its last job's results are sent, a worker with nothing in flight wakes its puller, which then blocks on
    the queues. Before, the pull after a job's end could not block (the results were still being sent) and the
    next look came ``LOOK_AGAIN_S`` later: a burst arriving meanwhile waited for it (here made 60 s to show it)."""
    import worker.puller

    bw, _engine, client = fake_worker
    monkeypatch.setattr(worker.puller, "LOOK_AGAIN_S", 60.0)
    real_send = bw.sender._send_until_done

    def slow_send(batches) -> None:  # a job's results still being sent when the puller looks after its end
        time.sleep(0.2)
        real_send(batches)

    monkeypatch.setattr(bw.sender, "_send_until_done", slow_send)
    for prompt in ("one", "two", "three"):  # each submitted as the one before ends
        assert client.submit(prompt, max_tokens=3).result(timeout=10)["usage"]["completion_tokens"] == 3


@pytest.mark.slow
def test_an_idle_worker_on_a_redis_that_does_not_block_does_not_spin(fake_worker):
    """fakeredis answers an empty BLMOVE at once, timeout or not: the idle puller took that for a blocked wait and
    pulled again straight away, a core's worth of round trips (this suite's fake workers, ``serve --embedded``)."""
    worker, _, client = fake_worker
    calls = []
    real = worker.connection.blmove
    worker.connection.blmove = lambda *a, **k: calls.append(1) or real(*a, **k)
    time.sleep(1.0)
    assert 2 <= len(calls) <= 1.0 / DID_NOT_BLOCK_S  # it still looks, every DID_NOT_BLOCK_S at most
    assert client.submit("still served", max_tokens=2).result(timeout=10)["usage"]["completion_tokens"] == 2


@pytest.mark.worker_settings(max_in_flight=300, max_num_seqs=300)
@pytest.mark.parametrize(
    "busy", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["idle worker", "busy worker"]
)
def test_a_burst_reaches_the_engine_whole_when_idle_and_in_slices_when_busy(fake_worker, busy):
    """150 jobs queued at once: an idle worker hands them to the engine in one pull (one prefill starts them all);
    one whose engine is stepping hands them over a slice at a time (the engine starts on the first while the rest
    are marked started). Either way every job once, in queue order."""
    from worker.puller import HAND_OVER

    worker, engine, client = fake_worker
    admitted: list[str] = []
    real_add = engine.add_request

    def add_request(request_id, prompt, params=None, priority=0):
        admitted.append(request_id)
        return real_add(request_id, prompt, params, priority)

    engine.add_request = add_request
    handed: list[int] = []
    real_read = worker.puller.read

    def read(pulled, unreadable=()):
        arrivals = real_read(pulled, unreadable)
        if arrivals:
            handed.append(len(arrivals))
        return arrivals

    worker.puller.read = read
    first = []
    if busy:
        engine.step_s = 0.002
        first = [client.submit("a long one", max_tokens=2000)]
        next(iter(first[0].events(timeout=10)))  # it runs
    jobs = client.submit_many([{"prompt": f"job {i}", "max_tokens": 3} for i in range(150)])
    assert [r["usage"]["completion_tokens"] for r in (job.result(timeout=30) for job in jobs)] == [3] * 150
    assert admitted == [job.id for job in first + jobs]
    handed = handed[len(first) :] if busy else handed
    assert sum(handed) == 150
    if busy:
        assert max(handed) <= HAND_OVER < 150
    else:
        assert handed == [150]
    for job in first:
        job.cancel()


def test_a_job_canceled_while_its_prompt_is_tokenized_ends_with_a_last_event_and_a_result(fake_worker, monkeypatch):
    """Canceled after it started but before the engine took it (a long prompt still being tokenized): it ends as
    any canceled running job, with a final "abort" event that ends its followers' waits, and a canceled result."""
    worker, engine, client = fake_worker
    tokenize = engine.tokenize_many
    held = threading.Event()  # (the prompt's reading ends once the cancel has ended the job, however slow the machine)
    monkeypatch.setattr(engine, "tokenize_many", lambda *a, **k: (held.wait(30), tokenize(*a, **k))[1])
    job = client.submit("x", max_tokens=50)
    deadline = time.time() + 10
    while job.id not in worker.in_flight and time.time() < deadline:
        time.sleep(0.01)
    # Taken, its prompt being read (a queued job's cancel would pass what follows too).
    assert job.status() == "started" and job.id in worker.in_flight and not engine.requests
    assert job.cancel()
    events = list(job.events(timeout=10))
    held.set()
    assert [(e["text"], e["finish_reason"]) for e in events] == [("", "abort")]
    with pytest.raises(JobCanceled) as canceled:
        job.result(timeout=10)
    assert canceled.value.result["status"] == "canceled" and canceled.value.result["finish_reason"] == "abort"


@pytest.mark.slow  # a second or more: the full suite's (the fast lane stays under a minute)
@pytest.mark.parametrize("blip", [False, True], ids=["", "through-a-redis-blip"])
def test_a_stop_hands_back_at_once_the_jobs_not_generating_yet_and_finishes_the_others(fake_worker, monkeypatch, blip):
    """One SIGTERM (docker stop, Kubernetes) drained every job held, those still waiting to run too: they started
    only after the others ended, and the orchestrator's kill came first. They go back to their queue at once (also
    when Redis failed the first try: that try counted as done, and they ran here)."""
    worker, engine, client = fake_worker
    apply_arrivals, blips = worker._apply_arrivals, [blip]

    def blipping() -> None:  # the first one after the stop signal meets Redis away, with ``blip``
        if worker._stop_requested and blips and blips.pop():
            raise redis.exceptions.ConnectionError("injected: Redis away for a moment")
        apply_arrivals()

    monkeypatch.setattr(worker, "_apply_arrivals", blipping)
    engine.step_s = 0.01
    running = client.submit("runs", max_tokens=150)  # ~1.5 s of steps
    next(iter(running.events(timeout=10)))
    tokenize = engine.tokenize_many

    def slow(prompts, tokenizer=None):  # (a long prompt still being read: no token yet)
        if any("slow" in p["prompt"] for p in prompts):
            time.sleep(2)
        return tokenize(prompts, tokenizer)

    monkeypatch.setattr(engine, "tokenize_many", slow)
    waiting = client.submit("slow to read", max_tokens=3)
    deadline = time.time() + 10
    while waiting.id not in worker.in_flight and time.time() < deadline:
        time.sleep(0.01)
    assert waiting.id in worker.in_flight  # (one never taken would be in its queue as well)
    worker.request_stop()
    deadline = time.time() + 10
    while waiting.id not in client.queue.job_ids and time.time() < deadline:
        time.sleep(0.02)
    assert waiting.status() == "queued" and client.queue.job_ids == [waiting.id]
    assert running.result(timeout=10)["usage"]["completion_tokens"] == 150  # the one generating finished


def test_a_warm_stop_of_a_busy_worker_is_recorded_as_rqs_is(fake_worker):
    """RQ's worker writes when a warm stop came while it was busy (``Worker.shutdown_requested_date``, shown by
    rq-dashboard); this one kept it to itself while it drained."""
    from rq import Worker
    from rq.utils import now

    worker, engine, client = fake_worker
    engine.step_s = 0.005
    job = client.submit("endless", max_tokens=10**6)
    next(iter(job.events(timeout=10)))
    before = now()
    worker.request_stop()
    deadline = time.time() + 10
    while Worker.find_by_key(worker.key, connection=client.connection).shutdown_requested_date is None:
        assert time.time() < deadline, "no shutdown_requested_date"
        time.sleep(0.02)
    said = Worker.find_by_key(worker.key, connection=client.connection).shutdown_requested_date
    assert abs((said - before).total_seconds()) < 5


def test_a_third_stop_signal_does_not_put_off_the_cold_stops_patience(fake_worker):
    """Each signal after the first set the sender's patience anew: one repeated (a supervisor, Ctrl-C held) kept the
    cold stop waiting on Redis."""
    worker, _, _ = fake_worker
    worker.request_stop()
    worker.request_stop()
    second = worker.sender.give_up_at
    time.sleep(0.05)
    worker.request_stop()
    assert second is not None and worker.sender.give_up_at == second


@pytest.mark.worker_settings(drain_timeout=0.5)
def test_past_the_drain_timeout_a_stop_hands_back_what_still_runs(fake_worker):
    worker, engine, client = fake_worker
    engine.step_s = 0.005
    job = client.submit("endless", max_tokens=10**6)
    next(iter(job.events(timeout=10)))
    stopped_at = time.monotonic()
    worker.request_stop()
    # The sender gives up on a Redis that refuses writes from the drain timeout on, set at the signal: set only by the
    # loop's drain check, a loop held in the sender's put by an outage never reached it, and the worker never left.
    from worker.hand_back import HAND_BACK_PATIENCE_S

    assert worker.sender.give_up_at is not None
    assert 0 <= worker.sender.give_up_at - (stopped_at + 0.5 + HAND_BACK_PATIENCE_S) < 1
    deadline = time.time() + 10
    while job.id not in client.queue.job_ids and time.time() < deadline:
        time.sleep(0.02)
    assert job.status() == "queued" and 0.5 <= time.monotonic() - stopped_at < 5


def test_handing_jobs_back_hands_each_back_once_when_redis_fails_midway(fake_worker, monkeypatch):
    """The second stop signal hands every job in flight back to the front of its queue, in the order they were taken;
    Redis failing after the first of them makes the worker try again, and the jobs already back are not queued
    twice."""
    import redis
    from rq.queue import Queue

    worker, _, client = fake_worker
    jobs = [client.submit(f"long {i}", max_tokens=10**6) for i in range(3)]
    deadline = time.time() + 10
    while len(worker.in_flight) < 3 and time.time() < deadline:
        time.sleep(0.01)
    enqueue, calls = Queue._enqueue_job, []

    def flaky(self, job, *args, **kwargs):
        calls.append(job.id)
        if len(calls) == 2:
            raise redis.exceptions.ConnectionError("Redis went away")
        return enqueue(self, job, *args, **kwargs)

    monkeypatch.setattr(Queue, "_enqueue_job", flaky)
    worker.request_stop()
    worker.request_stop()  # the second signal: hand them back
    deadline = time.time() + 10
    while worker.in_flight and time.time() < deadline:
        time.sleep(0.05)
    assert client.queue.job_ids == [job.id for job in jobs]  # each once, in the order they were taken


def test_handing_jobs_back_leaves_a_job_changed_meanwhile_as_it_was_made(fake_worker, monkeypatch):
    """Jobs canceled, deleted or given new meta by their clients just before the second stop signal hands them back
    (after the worker's last look at them): the canceled one stays canceled, the deleted one gone, and the one given
    new meta goes back with it. The copy taken at the pull was queued again whatever became of the job: a cancel
    undone, a deleted job back, the client's meta rolled back."""
    worker, _, client = fake_worker
    jobs = [client.submit(f"long {i}", max_tokens=10**6) for i in range(4)]
    deadline = time.time() + 10
    while len(worker.in_flight) < 4 and time.time() < deadline:
        time.sleep(0.01)
    drain = worker.sender.drain

    def then_changed(*args, **kwargs):
        drain(*args, **kwargs)
        if jobs[2].rq_job.meta.get("note"):
            return  # (changed once, at the first drain)
        conn = client.connection
        conn.hset(f"rq:job:{jobs[0].id}", "status", "canceled")  # as another language cancels
        conn.delete(f"rq:job:{jobs[1].id}")
        rq_job = jobs[2].rq_job
        rq_job.meta["note"] = "kept"
        rq_job.save_meta()

    monkeypatch.setattr(worker.sender, "drain", then_changed)
    worker.request_stop()
    worker.request_stop()
    deadline = time.time() + 10
    while worker.in_flight and time.time() < deadline:
        time.sleep(0.05)
    assert client.queue.job_ids == [jobs[2].id, jobs[3].id]
    assert jobs[0].status() == "canceled" and not client.connection.exists(f"rq:job:{jobs[1].id}")
    assert jobs[2].rq_job.meta["note"] == "kept" and jobs[2].status() == "queued"
    # The canceled and the deleted ones end as a cancel ends: an abort event; for the canceled one, its partial
    # result and a TTL (they had their execution cleaned up, nothing more: followers waited, the hash stayed for good).
    for job in jobs[:2]:
        assert [e.get("finish_reason") for e in job.events(timeout=5)][-1] == "abort"
    with pytest.raises(JobCanceled) as info:
        jobs[0].result(timeout=5)
    assert info.value.result is not None and info.value.result["usage"]["completion_tokens"] > 0
    assert client.connection.ttl(f"rq:job:{jobs[0].id}") > 0


def test_a_stop_job_command_heard_just_before_a_cold_stop_stops_the_job(fake_worker, monkeypatch):
    """RQ's stop-job for a running job, heard during a step, then the second stop signal before the loop read it: the
    job went back to its queue (the command lost) and another worker ran it to its end. It ends stopped."""
    worker, engine, client = fake_worker
    job, other = client.submit("stop me", max_tokens=10**6), client.submit("hand me back", max_tokens=10**6)
    real_step, held, inside, let_go = engine.step, threading.Event(), threading.Event(), threading.Event()

    def step(*args, **kwargs):
        if held.is_set() and not let_go.is_set():
            inside.set()
            let_go.wait(10)  # a step under way while the command and the signals come
        return real_step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", step)
    deadline = time.time() + 10
    while len(worker.in_flight) < 2 and time.time() < deadline:
        time.sleep(0.01)
    held.set()
    assert inside.wait(10)
    worker.handle_payload({"data": json.dumps({"command": "stop-job", "job_id": job.id}).encode()})  # (its listener)
    worker.request_stop()
    worker.request_stop()
    let_go.set()
    deadline = time.time() + 10
    while worker.in_flight and time.time() < deadline:
        time.sleep(0.05)
    assert job.status() == "stopped" and client.queue.job_ids == [other.id]
    with pytest.raises(JobCanceled, match="job stopped"):
        job.result(timeout=5)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (it dies: the point)
def test_a_worker_dying_of_an_error_its_hand_back_meets_again_still_hands_its_jobs_back(fake_worker, monkeypatch):
    """A job that fails to go into the engine with an error the worker does not know: kept to be taken in again, it
    raised again in the dying worker's hand-back, which handed back nothing, every job left "started" until RQ's
    clean-up failed it. They go back with Redis's writes alone."""
    worker, engine, client = fake_worker
    engine.step_s = 0.01
    running = [client.submit(f"long {i}", max_tokens=10**6) for i in range(2)]
    deadline = time.time() + 10
    while len(worker.in_flight) < 2 and time.time() < deadline:
        time.sleep(0.01)
    real_submit = worker.pump.submit

    def submit(job_id, *args, **kwargs):
        if job_id == "bad-job":
            raise RuntimeError("a bug while taking in one job")
        return real_submit(job_id, *args, **kwargs)

    monkeypatch.setattr(worker.pump, "submit", submit)
    bad = client.submit("bad", max_tokens=5, job_id="bad-job")
    deadline = time.time() + 10
    while any(job.status() == "started" for job in [*running, bad]) and time.time() < deadline:
        time.sleep(0.05)
    assert sorted(client.queue.job_ids) == sorted(job.id for job in [*running, bad])
    assert [job.status() for job in [*running, bad]] == ["queued"] * 3
    assert all(job.rq_job.retries_left == 2 for job in running)  # (no retry spent: RQ's clean-up did not take them)


@pytest.mark.redis
@pytest.mark.slow  # a callback of seconds
def test_jobs_ended_behind_a_slow_allowed_callback_are_beaten_until_their_ends_are_written(redis_url, monkeypatch):
    """A job leaves in_flight once its end is queued for the sender, which runs an allowed success callback in
    line. Behind one slower than the heartbeat TTL, the jobs that ended next went unbeaten: RQ's clean-up took them
    for abandoned, ran them again (a retry spent), and dropped their ends here as another attempt's."""
    import uuid

    from redis import Redis
    from rq import Callback, Queue, Retry
    from rq.serializers import JSONSerializer

    from worker.batch_worker import BatchWorker
    from worker.settings import WorkerSettings

    name, conn = f"cb-{uuid.uuid4().hex[:8]}", Redis.from_url(redis_url)
    settings = WorkerSettings(
        redis_url=redis_url, queue=name, model="fake", idle_wait=0.2, heartbeat_interval=1, heartbeat_grace=2,
        maintenance_interval=1, allow_callback=["hook_probe.slow"],
    )  # fmt: skip
    engine = FakeEngine()
    engine.step_s = 0.01
    worker = BatchWorker(engine, settings, conn)
    queue = Queue(name, connection=conn, serializer=JSONSerializer)
    slow = queue.enqueue("worker.jobs.generate", prompt="a", max_tokens=2, on_success=Callback("hook_probe.slow", 30))
    behind = queue.enqueue("worker.jobs.generate", prompt="b", max_tokens=4, retry=Retry(max=1))
    submitted, real_submit = [], worker.pump.submit
    monkeypatch.setattr(
        worker.pump, "submit", lambda job_id, *a, **k: (submitted.append(job_id), real_submit(job_id, *a, **k))[1]
    )
    thread = threading.Thread(target=worker.work, kwargs={"logging_level": "WARNING"}, daemon=True)
    thread.start()
    try:
        client = Client(redis_url, queue=name)
        assert client.job(slow.id).result(timeout=30)["usage"]["completion_tokens"] == 2
        assert client.job(behind.id).result(timeout=30)["usage"]["completion_tokens"] == 4
        time.sleep(1.5)  # (RQ's clean-up, a second apart, would have taken it by now)
    finally:
        worker.request_stop()
        thread.join(timeout=30)
    assert submitted.count(behind.id) == 1 and behind.get_status(refresh=True) == "finished"
    assert behind.retries_left == 1 and queue.failed_job_registry.get_job_ids() == []


@pytest.mark.slow  # seconds: the sender held up past the heartbeat TTL
@pytest.mark.worker_settings(heartbeat_grace=2, maintenance_interval=1)
def test_a_job_failed_at_its_start_is_beaten_while_its_end_waits_in_the_sender(fake_worker, monkeypatch):
    """A job that can never run fails alone; its end waits in the sender behind others' (an allowed callback, a
    Redis stall). It went unbeaten there: past the heartbeat TTL, RQ's clean-up took it for abandoned and retried
    it, and it failed twice."""
    from rq import Queue, Retry
    from rq.results import Result
    from rq.serializers import JSONSerializer

    worker, _, client = fake_worker
    real_fail = worker._fail

    def held_up(*args, **kwargs) -> None:
        worker._tasks.append(lambda: time.sleep(5))  # the sender busy before its end: past the TTL of 3 s
        real_fail(*args, **kwargs)

    monkeypatch.setattr(worker, "_fail", held_up)
    queue = Queue("fake", connection=client.connection, serializer=JSONSerializer)
    bad = queue.enqueue("worker.jobs.generate", prompt="c", max_tokens=-1, retry=Retry(max=1))
    statuses, deadline = [], time.monotonic() + 30
    while not statuses or statuses[-1] != "failed":
        assert time.monotonic() < deadline, statuses
        statuses.append(bad.get_status(refresh=True))
        time.sleep(0.05)
    started = statuses.index("started")
    assert set(statuses[started:-1]) == {"started"}  # never handed back to its queue meanwhile
    with pytest.raises(JobFailed, match="max_tokens"):
        client.job(bad.id).result(timeout=30)
    time.sleep(1.5)  # (a clean-up a second apart, and a second failure, would have come by now)
    assert len(Result.all(bad, serializer=JSONSerializer)) == 1 and bad.get_status(refresh=True) == "failed"
    assert queue.failed_job_registry.get_job_ids() == [bad.id] and queue.count == 0


def test_a_cancel_landing_between_the_pull_and_the_start_is_kept_without_lua(fake_worker, monkeypatch):
    """A Redis that refuses scripts: the start is RQ's own writes, whose HSET of status started overwrote a cancel
    that landed after the pull took the job (a client that left at once). The job ran to its end, finished and in
    the canceled registry both. Its cancel stands now, and it ends canceled within a step."""
    worker, _, client = fake_worker
    mark_started, canceled = worker.mark_started, []

    def cancel_first(pulled, *args, **kwargs):
        for job, _ in pulled:
            if job.id not in canceled:
                canceled.append(job.id)
                client.connection.hset(f"rq:job:{job.id}", "status", "canceled")  # as another language cancels
        return mark_started(pulled, *args, **kwargs)

    monkeypatch.setattr(worker, "mark_started", cancel_first)
    job = client.submit("long", max_tokens=10**6)
    with pytest.raises(JobCanceled):
        job.result(timeout=10)
    assert job.status() == "canceled" and canceled == [job.id]


def test_a_start_whose_exec_reply_was_lost_is_not_made_twice_without_lua(fake_worker, monkeypatch):
    """redis-py says a reply lost while watching as a WatchError: the start (Redis without Lua) was made again under
    a second execution, the first left in the started registry to lapse, and RQ's clean-up then failed the job as
    abandoned while it ran. The start that landed is taken for this one."""
    from redis.client import Pipeline

    from producer.protocol import OWNER_FIELD

    _, _, client = fake_worker
    execute, lost = Pipeline.execute, []

    def reply_lost(self, raise_on_error=True):
        starts = self.transaction and any(OWNER_FIELD in args for args, _ in self.command_stack)
        replies = execute(self, raise_on_error)
        if starts and not lost:
            lost.append(True)
            raise redis.WatchError("A ConnectionError occurred on while watching one or more keys")
        return replies

    monkeypatch.setattr(Pipeline, "execute", reply_lost)
    job = client.submit("long", max_tokens=10**6)
    deadline = time.monotonic() + 10
    while job.status() != "started" and time.monotonic() < deadline:
        time.sleep(0.02)
    started = client.connection.zrange("rq:wip:fake", 0, -1)
    assert lost and len(started) == 1 and started[0].decode().startswith(job.id), started
    owner = client.connection.hget(f"rq:job:{job.id}", OWNER_FIELD).decode()
    assert started[0].decode() == f"{job.id}:{owner}"
    job.cancel()


def test_a_results_metadata_is_the_submitted_one_with_one_sample_or_many(fake_worker):
    _, _, client = fake_worker
    one = client.submit("a", max_tokens=2, metadata={"user": "alice"})
    many = client.submit("b", max_tokens=2, n=2, temperature=1.0, metadata={"user": "bob"})
    assert one.result(timeout=10)["metadata"] == {"user": "alice"}
    assert many.result(timeout=10)["metadata"] == {"user": "bob"}


def test_a_job_id_pushed_twice_runs_once_and_the_worker_serves_on(fake_worker):
    """The same id twice on the queue (a producer's push tried again) is one job: it runs once, ends with one last
    event, and the worker (which raised "already in flight" and stopped) serves the next job."""
    from rq.utils import now, utcformat

    from producer.client import validate

    worker, _, client = fake_worker
    lane = client.lane(0)
    mapping = client._job_hash(lane, validate({"prompt": "twice", "max_tokens": 3}), utcformat(now()))
    with client.connection.pipeline() as pipe:  # one transaction: the id twice in one RPUSH
        pipe.hset("rq:job:pushed-twice", mapping=mapping)
        pipe.rpush(lane.key, "pushed-twice", "pushed-twice")
        pipe.execute()
    job = client.job("pushed-twice")
    assert job.result(timeout=10)["usage"]["completion_tokens"] == 3
    events = list(job.events(timeout=5))
    assert [e["n"] for e in events] == list(range(len(events))) and "finish_reason" in events[-1]
    assert client.submit("next", max_tokens=2).result(timeout=10)["usage"]["completion_tokens"] == 2
    deadline = time.time() + 5
    while worker.in_flight and time.time() < deadline:
        time.sleep(0.01)
    assert not worker.in_flight


def test_a_failed_step_with_retries_left_minus_one_fails_the_job_with_its_end(fake_worker):
    """``retries_left -1`` in a hand-written hash is none left (RQ's should_retry): the job fails for good, so its
    followers get a last event and a result (the worker took -1 as a retry to come and wrote neither)."""
    from producer import JobFailed

    _, engine, client = fake_worker
    stamp = "2026-11-22T00:00:00.000000Z"
    data = json.dumps(["worker.jobs.generate", None, [], {"prompt": "hi", "max_tokens": 3}])
    fields = {"data": data, "origin": "fake", "status": "queued", "created_at": stamp, "enqueued_at": stamp}
    engine.fail_steps = 1
    client.connection.hset("rq:job:minus-one", mapping={**fields, "retries_left": -1})
    client.connection.rpush(client.queue.key, "minus-one")
    job = client.job("minus-one")
    with pytest.raises(JobFailed, match="injected fault"):
        job.result(timeout=10)
    assert list(job.events(timeout=5))[-1]["finish_reason"] == "error"


@pytest.mark.slow  # seconds of waiting: the full suite's, not the fast lane's
def test_a_job_taken_in_during_a_long_step_is_heartbeaten_from_its_start(fake_worker):
    """Its start wrote the started registry's expiry; the step loop takes it in only after the step under way. Its
    heartbeats count from the start (else one step longer than the grace let RQ requeue a running job)."""
    worker, engine, client = fake_worker
    engine.step_s = 1.0
    jobs = [client.submit("long", max_tokens=10**6)]
    _wait(lambda: jobs[0].id in worker.in_flight)
    jobs.append(client.submit("taken in mid-step", max_tokens=10**6))
    _wait(lambda: jobs[1].status() == "started")
    seen_started = time.monotonic()
    _wait(lambda: jobs[1].id in worker.in_flight)
    try:
        assert worker.in_flight[jobs[1].id].beat_at <= seen_started
    finally:
        for job in jobs:
            job.cancel()
        _wait(lambda: not worker.in_flight)


def _wait(done, limit_s: float = 10.0) -> None:
    deadline = time.time() + limit_s
    while not done():
        assert time.time() < deadline, "waited too long"
        time.sleep(0.005)


@pytest.fixture(params=[pytest.param("redis-server", marks=pytest.mark.redis), "embedded"])
def server_or_embedded(request):
    """A connection to a real redis-server, or to the embedded fakeredis of `roseinfer demo` and `serve --embedded`
    (which runs the worker's Lua scripts too)."""
    if request.param == "embedded":
        from worker.local_redis import embedded_connection, start_embedded_redis

        return embedded_connection(start_embedded_redis())
    from redis import Redis

    return Redis.from_url(request.getfixturevalue("redis_url"))


@pytest.mark.slow  # seconds: the full suite's
def test_a_retry_rq_put_off_comes_back_when_due_and_ends(server_or_embedded):
    """A failed step with retry intervals left (``Retry(max, interval)``, a hash's ``retry_intervals``): RQ puts
    the job in its scheduled registry, which only a scheduler empties. The worker moves it back when due (RQ's
    scheduler, on its heartbeat thread), so it runs again and finishes instead of waiting there for good."""
    import uuid

    from worker.batch_worker import BatchWorker
    from worker.settings import WorkerSettings

    conn = server_or_embedded
    name = f"later-{uuid.uuid4().hex[:8]}"
    engine = FakeEngine()
    worker = BatchWorker(engine, WorkerSettings(queue=name, model="fake", heartbeat_interval=1, idle_wait=0.2), conn)
    thread = threading.Thread(target=worker.work, kwargs={"logging_level": "WARNING"}, daemon=True)
    thread.start()
    try:
        stamp = "2026-11-22T00:00:00.000000Z"
        data = json.dumps(["worker.jobs.generate", None, [], {"prompt": "hi", "max_tokens": 3}])
        fields = {"data": data, "origin": name, "status": "queued", "created_at": stamp, "enqueued_at": stamp}
        engine.fail_steps = 1
        conn.hset(f"rq:job:{name}-j", mapping={**fields, "retries_left": 1, "retry_intervals": "[1]"})
        # A due job whose hash RQ cannot read, first in the registry: it held back every other due job, at every beat.
        conn.hset(f"rq:job:{name}-bad", mapping={**fields, "status": "scheduled", "created_at": "yesterday"})
        conn.zadd(f"rq:scheduled:{name}", {f"{name}-bad": 0})
        conn.sadd("rq:queues", f"rq:queue:{name}")
        conn.rpush(f"rq:queue:{name}", f"{name}-j")
        result = Client(connection=conn, queue=name).job(f"{name}-j").result(timeout=20)
        assert result["usage"]["completion_tokens"] == 3
        assert conn.hget(f"rq:job:{name}-j", "retries_left") == b"0"
        assert conn.zscore(f"roseinfer:rejected:{name}", f"{name}-bad") is not None  # set aside where reported
        assert conn.zscore(f"rq:scheduled:{name}", f"{name}-bad") is None
        assert worker.sender.runs_scripts  # fenced as on a real server: the embedded one runs Lua too
    finally:
        worker.request_stop()
        thread.join(timeout=30)


_SLOW_TO_ADMIT = """
import sys, time
from test_pump import FakeEngine
from redis import Redis
from producer import Client
from worker.batch_worker import BatchWorker
from worker.settings import WorkerSettings

engine = FakeEngine()
add = engine.add_request
engine.add_request = lambda *args, **kwargs: (time.sleep(0.4), add(*args, **kwargs))[1]  # 0.4 s an admission
url, queue = sys.argv[1], sys.argv[2]
settings = WorkerSettings(redis_url=url, queue=queue, model="fake", engine_step_timeout=1, idle_wait=0.2, name=queue)
Client(url, queue=queue).submit_many([{"prompt": f"p{i}", "max_tokens": 2} for i in range(5)])
BatchWorker(engine, settings, Redis.from_url(url)).work(burst=True, logging_level="WARNING")
"""


@pytest.mark.redis
@pytest.mark.slow
def test_a_step_that_admits_for_longer_than_the_watchdog_allows_does_not_end_the_process(redis_url):
    """Admissions are progress: five of 0.4 s in one step (2 s, a resumed seeded job replaying its draws on a CPU
    each) against a watchdog of 1 s; the worker serves them all and exits as a burst worker does."""
    import os
    import subprocess
    import sys
    import uuid

    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.path.dirname(tests)])}
    queue = f"slow-admit-{uuid.uuid4().hex[:6]}"
    done = subprocess.run(
        [sys.executable, "-c", _SLOW_TO_ADMIT, redis_url, queue], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert Client(redis_url, queue=queue).status()["finished"] == 5


_HUNG_WORKER = """
import sys, time
from test_pump import FakeEngine
from redis import Redis
from producer import Client
from worker.batch_worker import BatchWorker
from worker.settings import WorkerSettings

engine = FakeEngine()
real_step = engine.step
engine.step = lambda flush=True: time.sleep(3600) if engine.steps == 1 else real_step(flush)  # the 2nd hangs
url, queue = sys.argv[1], sys.argv[2]
settings = WorkerSettings(redis_url=url, queue=queue, model="fake", engine_step_timeout=1, idle_wait=0.2, name=queue)
Client(url, queue=queue).submit("hangs", max_tokens=5)
BatchWorker(engine, settings, Redis.from_url(url)).work(logging_level="WARNING")
"""


@pytest.mark.redis
@pytest.mark.slow
def test_a_hung_step_of_an_engine_in_the_workers_process_ends_the_process(redis_url):
    """It cannot be interrupted, and the heartbeats (a thread of their own) kept its jobs claimed for good: the
    watchdog prints the stacks and ends the process, as a crash, for other workers to recover the jobs."""
    import os
    import subprocess
    import sys
    import uuid

    from worker.watchdog import EXIT_HUNG

    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.path.dirname(tests)])}
    queue = f"hung-{uuid.uuid4().hex[:6]}"
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _HUNG_WORKER, redis_url, queue], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == EXIT_HUNG, done.stderr[-2000:]
    assert "an engine step has run for" in done.stderr and "in <lambda>" in done.stderr  # where it hung
    assert time.monotonic() - began < 30
    assert len(Client(redis_url, queue=queue).queue.started_job_registry.get_job_ids()) == 1  # for RQ to recover
    # Its death is registered: its supervisor's restart under the same --name is not refused for 8 minutes.
    from worker.batch_worker import name_in_use

    assert name_in_use(Client(redis_url).connection, queue, beat_ttl=40) is None


@pytest.mark.slow
@pytest.mark.parametrize("stderr", ["None", "io.StringIO()"])
def test_the_step_watchdog_ends_the_process_without_a_usable_stderr(stderr):
    """The stacks go to file descriptor 2 when ``sys.stderr`` has none (None, a StringIO): writing them used to
    raise in the watchdog's thread, which then died and left the hung process running."""
    import subprocess
    import sys

    from worker.watchdog import EXIT_HUNG

    code = (
        f"import io, sys, time\nfrom worker.watchdog import StepWatchdog\nsys.stderr = {stderr}\n"
        "dog = StepWatchdog(0.4)\ndog.start()\ndog.began()\ntime.sleep(30)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_HUNG and "in <module>" in done.stderr


def _fakeredis_worker(queue: str, engine=None, step_s: float = 0.0, burst: bool = False, **settings):
    """A BatchWorker over ``engine`` (a FakeEngine) on a fakeredis server, working on a thread: (worker, engine,
    a client of its queue, the thread, the worker's connection)."""
    from worker.batch_worker import BatchWorker
    from worker.settings import WorkerSettings

    server = fakeredis.FakeServer()
    conn = fakeredis.FakeRedis(server=server)
    setattr(conn, "__rq_redis_server_version", (8, 0, 0))
    engine = engine or FakeEngine()
    engine.step_s = step_s
    settings = {"heartbeat_interval": 1, "idle_wait": 0.2, **settings}
    worker = BatchWorker(engine, WorkerSettings(queue=queue, model="fake", **settings), conn)
    client = Client(connection=fakeredis.FakeRedis(server=server), queue=queue)
    thread = threading.Thread(target=worker.work, kwargs={"burst": burst, "logging_level": "WARNING"}, daemon=True)
    return worker, engine, client, thread, conn


def test_a_worker_that_goes_idle_shows_no_job_in_flight_beside_it():
    """``roseinfer status`` read the worker's state from RQ's hash (written at once) and its jobs in flight from
    the heartbeat's statistics (up to a beat old): "idle, 1 in flight" after the job had ended."""
    worker, _, client, thread, _ = _fakeredis_worker("fake", step_s=0.02, heartbeat_interval=30)
    thread.start()
    try:
        job = client.submit("x", max_tokens=20)
        deadline = time.monotonic() + 10
        while job.id not in worker.in_flight:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        worker._heartbeat.beat()  # a beat while it runs: 1 in flight, the next beat 30 s away
        assert [w["in_flight"] for w in client.workers()] == [1]
        job.result(timeout=10)
        while (row := client.workers()[0])["state"] != "idle":
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert row["in_flight"] == 0
    finally:
        worker.request_stop()
        thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_stop_job_for_an_id_not_here_is_logged_on_one_line(caplog):
    """RQ's stop-job command names any text: its id was logged as it came, a newline and escapes making a line of
    the sender's choosing in the worker's log."""
    import json

    worker, _, _, thread, _ = _fakeredis_worker("f", step_s=0.01)
    forged = "zz\n2026-12-02 04:21:00,000 roseinfer.worker: a forged line \x1b[31m"
    with caplog.at_level("INFO", logger="roseinfer.worker"):
        thread.start()
        try:
            worker.handle_payload({"data": json.dumps({"command": "stop-job", "job_id": forged}).encode()})
            deadline = time.monotonic() + 10
            while "not in flight here" not in caplog.text:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        finally:
            worker.request_stop()
            thread.join(timeout=30)
    assert f"stop-job {forged!r}: not in flight here" in caplog.text and "\x1b" not in caplog.text
    # (the stop of an idle worker said "finishing the 0 in flight (a second signal hands them back)")
    assert "stop signal: no job in flight; stopping" in caplog.text and "the 0 in flight" not in caplog.text


def test_a_stop_job_heard_in_a_step_that_fails_stops_the_job_instead_of_retrying_it():
    """A failed step fails its running jobs to be run again elsewhere; a stop-job heard during that step was then
    "not in flight here, ignored", and RQ ran the stopped job again."""
    import json

    worker, engine, client, thread, _ = _fakeredis_worker("f", step_s=0.01)
    thread.start()
    try:
        job = client.submit("long", max_tokens=100_000)
        deadline = time.monotonic() + 10
        while not (job.id in worker.in_flight and engine.requests):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        step = engine.step

        def failing_step(flush=True):
            engine.step = step  # once
            worker.handle_payload({"data": json.dumps({"command": "stop-job", "job_id": job.id}).encode()})
            worker.puller.stop()  # (the retry would be another worker's: this one pulls no more)
            raise RuntimeError("out of memory")

        engine.step = failing_step
        with pytest.raises(JobCanceled) as ended:
            job.result(timeout=10)
        rq_job = job.rq_job
        assert rq_job.get_status() == "stopped" and rq_job.retries_left == 2  # no retry spent, none to come
        assert ended.value.result["usage"]["completion_tokens"] > 0  # what it made before the failed step, kept
    finally:
        worker.request_stop()
        thread.join(timeout=30)
    assert not thread.is_alive()


@pytest.mark.parametrize("how", ["cancel", "hset"])
def test_a_job_a_client_cancels_during_a_step_that_fails_ends_canceled_not_retried(how):
    """A client's cancel that lands while a step runs, the step then failing (an engine process dying): the job
    failed retryably with the rest, and RQ ran it again though its client had canceled it."""
    from rq.job import Job

    worker, engine, client, thread, conn = _fakeredis_worker("f", step_s=0.01)
    thread.start()
    try:
        job, other = client.submit("long", max_tokens=100_000), client.submit("other", max_tokens=100_000)
        deadline = time.monotonic() + 10
        while not (job.id in worker.in_flight and other.id in worker.in_flight and len(engine.requests) == 2):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        step = engine.step

        def failing_step(flush=True):
            engine.step = step  # once
            worker.puller.stop()  # (the retry would be another worker's: this one pulls no more)
            if how == "cancel":
                assert job.cancel()
            else:  # as a client in another language cancels
                conn.hset(Job.key_for(job.id), "status", "canceled")
            raise RuntimeError("out of memory")

        engine.step = failing_step
        with pytest.raises(JobCanceled) as ended:
            job.result(timeout=10)
        assert ended.value.result["finish_reason"] == "abort"
        assert ended.value.result["usage"]["completion_tokens"] > 0  # what it made before the failed step, kept
        rq_job = job.rq_job
        assert rq_job.get_status() == "canceled" and rq_job.retries_left == 2  # no retry spent, none to come
        assert job.id in client.lane(0).canceled_job_registry.get_job_ids()
        deadline = time.monotonic() + 10
        while other.rq_job.get_status() != "queued":  # the other job, not canceled, is retried as before
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert other.rq_job.retries_left == 1
    finally:
        worker.request_stop()
        thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_copy_of_a_job_that_ended_is_dropped_not_run_again():
    """An id in its queue twice (a producer's RPUSH tried again, a requeue that crossed the job's end) whose second
    copy was pulled after the first had finished: the pull took the finished job for a new one, the start set it
    back to started, and it ran again (a second result, its stream restarted)."""
    engine, admitted = FakeEngine(), []
    add = engine.add_request
    engine.add_request = lambda rid, *a, **k: (admitted.append(rid), add(rid, *a, **k))[1]
    _, engine, client, thread, conn = _fakeredis_worker("dup", engine, burst=True, max_in_flight=1)
    twice, other = client.submit("twice", max_tokens=3), client.submit("other", max_tokens=3)
    lane = client.lane(0)
    conn.rpush(lane.key, twice.id)  # [twice, other, twice]
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert admitted.count(twice.id) == 1 and other.result(timeout=1)["usage"]["completion_tokens"] == 3
    assert twice.status() == "finished" and conn.xlen(f"rq:results:{twice.id}") == 1
    assert conn.llen(lane.key) == 0 and conn.llen(lane.intermediate_queue_key) == 0  # the copy taken off, not left


def test_a_copy_of_a_job_another_worker_runs_is_left_to_it_and_a_dead_workers_runs_here():
    """An id pushed twice whose first copy another worker runs: the pull took the second for a new job, started
    it here (the other worker's end then fenced off, its work lost) and ran it again. A job whose status says
    started by no live execution (its worker died; a status written by hand) still runs here."""
    from producer.protocol import OWNER_FIELD

    engine, admitted = FakeEngine(), []
    add = engine.add_request
    engine.add_request = lambda rid, *a, **k: (admitted.append(rid), add(rid, *a, **k))[1]
    from rq.executions import Execution

    worker, engine, client, thread, conn = _fakeredis_worker("elsewhere", engine, burst=True)
    busy, stale = client.submit("runs elsewhere", max_tokens=3), client.submit("its worker died", max_tokens=3)
    # Ended here, its end not written yet, its entry lapsed on a loaded machine: it ran again, as a retry.
    ending = client.submit("ending here", max_tokens=3)
    lane = client.lane(0)
    for job in (busy, stale, ending):
        conn.hset(job.rq_job.key, mapping={"status": "started", OWNER_FIELD: f"exec-{job.id}"})
    conn.zadd(lane.started_job_registry.key, {f"{busy.id}:exec-{busy.id}": time.time() + 60})  # (the stale one: none)
    worker.executions[f"exec-{ending.id}"] = Execution(f"exec-{ending.id}", ending.id, conn)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert busy.id not in admitted and conn.hget(busy.rq_job.key, OWNER_FIELD) == f"exec-{busy.id}".encode()
    assert ending.id not in admitted
    assert conn.llen(lane.key) == 0 and conn.llen(lane.intermediate_queue_key) == 0  # the copy taken off
    assert stale.id in admitted and stale.result(timeout=1)["usage"]["completion_tokens"] == 3


def _run_one_job_acting_at_its_last_token(queue: str, act) -> tuple:
    """A burst worker runs one job of 3 tokens, ``act(conn, worker, job_id)`` done right after its last token's step
    (before its finish is written): (worker's client, connection, the job)."""
    worker, _, client, thread, conn = _fakeredis_worker(queue, burst=True)
    step = worker.pump.step

    def acting_step(*args, **kwargs):
        events = step(*args, **kwargs)
        for event in events:
            if event.finish_reason == "length":
                act(conn, worker, event.job_id)
        return events

    worker.pump.step = acting_step
    job = client.submit("x", max_tokens=3)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    return client, conn, job


def test_a_job_deleted_as_it_finishes_stays_deleted():
    """RQ's ``job.delete()`` landing between the job's last token and its finish: the finish read the missing hash
    as Redis having lost its data and wrote it back whole, finished, its result kept a day."""
    from rq.job import Job
    from rq.serializers import JSONSerializer

    def delete(conn, worker, job_id):
        Job.fetch(job_id, connection=conn, serializer=JSONSerializer).delete()

    client, conn, job = _run_one_job_acting_at_its_last_token("del", delete)
    assert job.status() == "missing" and not conn.exists(f"rq:results:{job.id}")
    assert not client.lane(0).finished_job_registry.get_job_ids()


def test_a_job_whose_hash_redis_lost_as_it_finishes_is_written_back_finished():
    """Redis restarted empty as the job made its last token, and a heartbeat made the worker's hash again (without
    its registration's ``birth``) before the worker registered anew: the finish took the missing job hash for RQ's
    ``job.delete()`` (the worker's key was there) and dropped the finished job, its result never written."""

    def lose(conn, worker, job_id):
        conn.delete(f"rq:job:{job_id}", worker.key)
        conn.hset(worker.key, "last_heartbeat", "2026-12-02T00:00:00.000000Z")  # (RQ's beat, no birth)

    _, _, job = _run_one_job_acting_at_its_last_token("lost", lose)
    assert job.status() == "finished" and job.result(timeout=1)["usage"]["completion_tokens"] == 3


def test_rq_suspend_sends_back_the_jobs_a_worker_holds_that_made_no_token_yet():
    """``rq suspend`` held back nothing the worker had taken: jobs waiting behind max_num_seqs all started, one
    after another, as the running ones ended (RQ's suspension leaves queued jobs queued). They go back to their
    queue now; the generating one runs to its end; on ``rq resume`` they run."""
    from rq.suspension import resume, suspend

    worker, engine, client, thread, conn = _fakeredis_worker("suspended", step_s=0.02)
    engine.waiting.add("held-b")  # (behind max_num_seqs: no token until let in)
    thread.start()
    try:
        running = client.submit("x", max_tokens=60)
        held = client.submit("y", max_tokens=3, job_id="held-b")
        deadline = time.monotonic() + 10
        while not (held.id in worker.in_flight and running.id in worker.in_flight):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        suspend(conn)
        while held.id in worker.in_flight or held.status() != "queued":
            assert time.monotonic() < deadline, held.status()
            time.sleep(0.01)
        assert running.result(timeout=20)["finish_reason"] == "length"
        assert held.status() == "queued"
        engine.waiting.discard(held.id)
        resume(conn)
        assert held.result(timeout=10)["usage"]["completion_tokens"] == 3
    finally:
        worker.request_stop()
        thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_burst_worker_exits_when_suspended_and_runs_the_scheduled_jobs_already_due():
    """A burst worker waited out a suspension (RQ's exits: "suspended in burst mode"); and a scheduled job already
    due was moved to its queue only as it exited, not run (RQ's burst with its scheduler moves them first)."""
    from datetime import datetime, timedelta, timezone

    from rq import Queue
    from rq.serializers import JSONSerializer
    from rq.suspension import resume, suspend

    from producer.protocol import JOB_FUNCTION

    worker, _, client, thread, conn = _fakeredis_worker("bursting", burst=True)
    suspend(conn)
    queued = client.submit("x", max_tokens=2)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive() and queued.status() == "queued"
    resume(conn)
    worker, _, client, thread, conn = _fakeredis_worker("bursting", burst=True)
    lane = Queue(client.queue.name, connection=conn, serializer=JSONSerializer)
    due = lane.enqueue_at(datetime.now(timezone.utc) - timedelta(seconds=1), JOB_FUNCTION, prompt="due", max_tokens=2)
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive() and due.get_status(refresh=True) == "finished"
    with pytest.raises(ValueError, match="takes no max_jobs"):
        worker.work(max_jobs=1)


def test_a_jobs_metadata_counts_in_its_results_size(monkeypatch):
    """Metadata (up to --max-job-bytes a job) is echoed in the result but was not counted: a step's results went
    in one script call past the bound of a write (past Redis's query buffer, a call sent again for good)."""
    import worker.success_path as success_path

    monkeypatch.setattr(success_path, "WRITE_BYTES", 2**20)
    parts, real_parts = [], success_path._parts
    monkeypatch.setattr(success_path, "_parts", lambda *a: parts.append(real_parts(*a)) or parts[-1])
    _, _, client, thread, _ = _fakeredis_worker("metadata", burst=True)
    note = {"note": "x" * 600_000}
    jobs = [client.submit("x", max_tokens=2, metadata=note, job_id=f"m{i}") for i in range(2)]
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert all(job.result(timeout=5)["metadata"] == note for job in jobs)
    written = [[job.job.id for job, _ in part] for call in parts for part in call]
    assert ["m0"] in written and ["m1"] in written, written  # (600 KB each, against 1 MB a call: two calls)


@pytest.mark.worker_settings(max_result_bytes=2**20)
def test_a_job_whose_output_outgrows_max_result_bytes_fails_as_it_runs_not_at_its_end(fake_worker, monkeypatch):
    """The size was measured at the end only: n = 64 samples with 20 logprobs each and no max_tokens held gigabytes
    in the engine before the job failed (and a few of them took the worker down). It fails once it passes."""
    import worker.batch_worker as batch_worker

    worker, _, client = fake_worker
    monkeypatch.setattr(batch_worker, "piece_bytes", lambda *args: 2**19)  # (each piece half the bound)
    job = client.submit("endless", max_tokens=10**6)
    with pytest.raises(JobFailed, match="more than this worker's --max-result-bytes") as err:
        job.result(timeout=10)
    assert err.value.result["error_type"] == "invalid_request" and job.rq_job.get_status(refresh=True) == "failed"
    *_, end = job.events(timeout=5)
    assert end["finish_reason"] == "error" and end["usage"]["completion_tokens"] < 10**4  # (not at max_tokens)
    monkeypatch.undo()
    assert client.submit("after", max_tokens=5).result(timeout=10)["status"] == "finished"
    # Past it with its end in the same batch (a sample's last piece before the end of n > 1, or an engine process's
    # batch): the pump has handed the job out already and its cancel gives nothing. The unpacking of that raised,
    # the worker died, and the job, requeued, did the same to the next one. The end's own check decides.
    monkeypatch.setattr(batch_worker, "piece_bytes", lambda *args: 2**21)
    monkeypatch.setattr(worker.pump, "cancel", lambda job_id, reason=None: [])
    assert client.submit("ends", max_tokens=5).result(timeout=10)["status"] == "finished"  # (the worker lives on)


def test_a_result_past_max_result_bytes_fails_its_job_alone_and_the_others_finish(monkeypatch):
    """One result is one Redis write: n=64 x 1,900 tokens x 20 logprobs made 100 MB; past 512 MB Redis resets the
    connection, which the worker took for an outage and tried again for good, the jobs ended beside it never
    written. A job whose result would be past --max-result-bytes fails alone, not retried; large results beside each
    other are written in parts."""
    import worker.batch_worker as batch_worker
    import worker.success_path as success_path

    sizes = {"big": 2**30, "large-1": 40 * 2**20, "large-2": 40 * 2**20}
    fake_size = lambda out: sizes.get(out.request_id, 0) if out is not None else 0  # noqa: E731
    monkeypatch.setattr(batch_worker, "result_bytes", fake_size)
    parts, real_parts = [], success_path._parts
    monkeypatch.setattr(success_path, "_parts", lambda *a: parts.append(real_parts(*a)) or parts[-1])
    _, _, client, thread, _ = _fakeredis_worker("results", burst=True)
    jobs = {name: client.submit("x", max_tokens=3, job_id=name) for name in ("big", "large-1", "large-2", "small")}
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    with pytest.raises(JobFailed, match=r"about 1024 MB, past this worker's --max-result-bytes \(64 MB\)") as err:
        jobs["big"].result(timeout=5)
    assert err.value.result["error_type"] == "invalid_request" and "error_code" not in err.value.result
    with pytest.raises(JobFailed, match="--max-result-bytes"):  # its stream too (an error code off v3 broke it)
        list(jobs["big"].stream(timeout=5))
    assert jobs["big"].rq_job.get_status(refresh=True) == "failed"  # (not retried: it would make the same again)
    assert all(jobs[name].result(timeout=5)["status"] == "finished" for name in ("large-1", "large-2", "small"))
    written = [[job.job.id for job, _ in part] for call in parts for part in call]
    assert ["large-1"] in written and "large-2" in written[written.index(["large-1"]) + 1]  # (40 + 40 MB: two writes)
