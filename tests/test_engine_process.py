"""The engine in a process of its own (``--engine-process``): the Pump's interface over a pipe, with the fake
engine of ``test_pump`` in a spawned child. Jobs end as they do in-process, a cancel keeps every piece of text, a
dead child fails its jobs retryably and stops the worker, and the RQ worker serves through it on fakeredis."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import fakeredis
import pytest
from test_pump import FakeEngine, _params, _run

from producer import Client, JobCanceled, JobFailed
from worker.engine_process import EngineProcess, EngineProcessDied, sparing_a_core
from worker.pump import Pump


def fake_engine(step_s: float = 0.0) -> FakeEngine:
    """Built in the child (by reference: this module is importable there)."""
    engine = FakeEngine()
    engine.step_s = step_s
    return engine


def broken_engine() -> FakeEngine:
    raise OSError("no such model file")


def engine_whose_abort_breaks() -> FakeEngine:
    """Its abort raises: the child's loop fails (not a step: no job of it is to blame) and the child exits."""
    engine = FakeEngine()
    engine.step_s = 0.01

    def abort_request(request_id):
        raise RuntimeError("abort broke")

    engine.abort_request = abort_request
    return engine


def engine_that_hangs_on_its_third_step(holding_the_lock: bool = False) -> FakeEngine:
    """A stuck kernel or lock: the third step never returns. ``holding_the_lock``: stuck in C code that keeps the
    interpreter lock, so the child's command-reading thread stops too."""
    import ctypes

    engine = FakeEngine()
    step = engine.step

    def hanging_step(flush=True):
        if engine.steps == 2:
            ctypes.PyDLL(None).sleep(3600) if holding_the_lock else time.sleep(3600)
        return step(flush)

    engine.step = hanging_step
    return engine


def engine_slow_to_admit() -> FakeEngine:
    """Each admission takes 0.4 s (a resumed seeded job replaying its draws on a CPU)."""
    engine = FakeEngine()
    add = engine.add_request

    def slow_add(*args, **kwargs):
        time.sleep(0.4)
        return add(*args, **kwargs)

    engine.add_request = slow_add
    return engine


def engine_slow_to_tokenize() -> FakeEngine:
    """Its prompts take 3 s to tokenize, all together (a burst of long prompts on one thread)."""
    engine = FakeEngine()
    tokenize_many = engine.tokenize_many

    def slow(prompts, tokenizer=None):
        time.sleep(3.0)
        return tokenize_many(prompts, tokenizer)

    engine.tokenize_many = slow
    return engine


def engine_with_a_slow_first_step() -> FakeEngine:
    """Its first step takes 1.5 s, then returns as any other."""
    engine = FakeEngine()
    step = engine.step

    def slow_step(flush=True):
        if engine.steps == 0:
            time.sleep(1.5)
        return step(flush)

    engine.step = slow_step
    return engine


def engine_that_recommends() -> FakeEngine:
    """An engine whose model's generation config recommends settings (``LLMEngine.sampling_defaults``)."""
    engine = FakeEngine()
    engine.sampling_defaults = {"temperature": 0.6, "top_p": 0.9}
    engine.tokenizer_json = lambda: '{"model": "its tokenizer"}'
    engine.chat_template_doc = lambda: '{"chat_template": "its template"}'
    engine.max_model_len = 4096
    return engine


def _drain(pump, limit_s: float = 10.0) -> list:
    events, until = [], time.monotonic() + limit_s
    while pump.has_work():
        assert time.monotonic() < until, "the jobs never ended"
        events += pump.step()
    return events


def _by_job(events) -> dict[str, tuple[str, str | None, str | None]]:
    """Each job's text (its pieces joined), finish reason and error."""
    out: dict[str, list] = {}
    for e in events:
        text, _, _ = out.get(e.job_id, ("", None, None))
        out[e.job_id] = (text + e.text, e.finish_reason, e.error)
    return out


@pytest.mark.slow
def test_jobs_end_in_the_engine_process_as_they_do_in_process():
    jobs = [("a", "hello", 4), ("b", "too long", 2), ("c", "engine bug", 2), ("d", "break the tokenizer", 2)]
    jobs += [("e", "x", 7)]
    local = Pump(FakeEngine())
    remote = EngineProcess(partial(fake_engine))
    try:
        for pump in (local, remote):
            for job_id, prompt, n in jobs:
                pump.submit(job_id, {"prompt": prompt}, _params(n))
        with pytest.raises(ValueError, match="already in flight"):
            remote.submit("a", {"prompt": "again"}, _params(1))
        got, expected = _by_job(_drain(remote)), _by_job(_run(local))
        assert got == expected
        assert got["a"] == ("t1t2t3t4", "length", None) and "9999 tokens" in got["b"][2]
        assert remote.pid != os.getpid() and remote.facts.prompt_tokens_computed == 0
        assert len(remote) == 0 and not remote.has_unfinished_requests()
    finally:
        local.close()
        remote.close()
    assert remote._proc.exitcode == 0  # stopped when asked, not killed


@pytest.mark.slow
def test_a_job_that_cannot_be_sent_to_the_engine_process_fails_alone():
    """Pickled past Python's recursion limit (a schema nested hundreds deep, before the payload bounded it), a job
    raised out of the worker's loop: the worker exited, and the jobs sent with it never reached the engine."""
    deep: dict = {}
    for _ in range(5000):
        deep = {"x": deep}
    remote = EngineProcess(partial(fake_engine))
    try:
        remote.submit("before", {"prompt": "hello"}, _params(3))
        remote.submit("deep", {"prompt": "hello", "schema": deep}, _params(3))
        remote.submit("after", {"prompt": "hello"}, _params(2))
        got = _by_job(_drain(remote))
    finally:
        remote.close()
    assert got["before"][:2] == ("t1t2t3", "length") and got["after"][:2] == ("t1t2", "length")
    assert got["deep"][1] == "error" and "cannot be sent to the engine process" in got["deep"][2]


@pytest.mark.slow
def test_a_cancel_keeps_the_text_the_child_made_before_it():
    """Pieces the child sent before the cancel reached it, not yet taken by the worker, end with the job: the
    stream still adds up to the partial result, as in-process."""
    pump = EngineProcess(partial(fake_engine, 0.002), event_interval_ms=0)  # a piece every step
    try:
        pump.submit("a", {"prompt": "x"}, _params(10_000))
        pump.submit("b", {"prompt": "y"}, _params(10_000))
        first = []
        while not first:
            first = pump.step()
        time.sleep(0.3)  # ~150 more steps' pieces wait in the pipe (more than 10 even on a loaded machine)
        *earlier, event = pump.cancel("a")
        assert event.finish_reason == "abort" and event.output is not None
        assert all(not e.finished and e.job_id == "a" for e in earlier)
        pieces = [e for e in first if e.job_id == "a"] + earlier + [event]
        made = [t for e in pieces for t in e.token_ids]
        assert made == list(range(1, len(made) + 1)) and len(made) > 10
        assert "".join(e.text for e in pieces) == "".join(f"t{i}" for i in made)
        assert "a" not in pump and pump.cancel("a") == []
        assert all(e.job_id == "b" for e in pump.step())  # nothing of "a" comes after its end
        pump.submit("c", {"prompt": "z"}, _params(10_000))
        time.sleep(0.1)
        ended = pump.cancel_many(["b", "c", "nobody"], "the worker stops")  # one round trip for all
        assert sorted(ended) == ["b", "c"] and all(e[-1].finish_reason == "error" for e in ended.values())
        assert not pump.has_work() and not pump.step()
    finally:
        pump.close()


@pytest.mark.slow
def test_the_engine_process_ignores_the_signals_meant_for_its_worker():
    """A Ctrl-C or systemd's SIGTERM reaches the whole process group: the worker drains, its engine goes on."""
    pump = EngineProcess(partial(fake_engine))
    try:
        os.kill(pump.pid, signal.SIGTERM)
        os.kill(pump.pid, signal.SIGINT)
        pump.submit("a", {"prompt": "x"}, _params(3))
        assert _by_job(_drain(pump))["a"] == ("t1t2t3", "length", None)
    finally:
        pump.close()


@pytest.mark.slow
def test_an_engine_process_that_dies_while_idle_is_seen_at_once():
    """The parent looked at the pipe only while jobs ran: an idle worker went on pulling jobs for a dead child,
    and each failed (a retry spent) before the worker stopped."""
    pump = EngineProcess(partial(fake_engine))
    try:
        assert pump.failure is None
        os.kill(pump.pid, signal.SIGKILL)
        until = time.monotonic() + 10
        while pump.failure is None and time.monotonic() < until:
            time.sleep(0.01)
        assert pump.failure == "the engine process was killed by SIGKILL" and not pump.has_work()
    finally:
        pump.close()


@pytest.mark.slow
def test_an_error_of_the_childs_loop_fails_every_job_at_once():
    """An error outside a step (here a cancel's): the child sends it and exits, which may take a while (a real
    engine's teardown). Every other job still in it fails at the next step, retryably, not once its end is seen."""
    pump = EngineProcess(partial(engine_whose_abort_breaks))
    try:
        for job_id in "abc":
            pump.submit(job_id, {"prompt": "x"}, _params(10_000))
        while not pump.step():
            pass
        [ended] = pump.cancel("a")
        assert ended.finish_reason == "abort"
        failed = {e.job_id: e for e in pump.step() if e.finished}
        assert sorted(failed) == ["b", "c"] and all(e.retryable and "abort broke" in e.error for e in failed.values())
        assert not pump.has_work()
    finally:
        pump.close()


def engine_whose_steps_keep_failing() -> FakeEngine:
    engine = FakeEngine()
    engine.fail_steps = 100
    return engine


def test_a_cancel_that_meets_the_engine_process_broken_ends_its_jobs_and_the_next_step_says_broken(monkeypatch):
    """The child said it broke (its steps kept failing) while a cancel waited for its answer: EngineBroken escaped
    the cancel, whose jobs were gone from the engine's list already, so a stop-job's job was handed back to run
    again (the stop lost) and a client's cancel got no result and no last event."""
    from worker.pump import EngineBroken

    pump = EngineProcess(partial(fake_engine, 0.01))
    try:
        for job_id in ("a", "b"):
            pump.submit(job_id, {"prompt": "x"}, _params(500))
        pump.step()
        monkeypatch.setattr(pump, "_recv_in_time", lambda: ("broken", "3 engine steps in a row failed"))
        assert [(e.finish_reason, e.error) for e in pump.cancel_many(["a"])["a"]][-1:] == [("abort", None)]
        with pytest.raises(EngineBroken, match="3 engine steps in a row failed"):
            pump.step()
        assert pump.job_ids() == ["b"]  # (handed back by the worker, with its retries untouched)
    finally:
        pump._proc.kill()  # (the child is well, only said broken here: a broken one ends itself; close waited 10 s)
        pump.close()


def test_an_engine_process_built_on_a_thread_that_ends_lives_on():
    """The kernel sends the child's death signal when the thread that started it ends, not its process: an engine
    built on a short-lived thread (a library's helper thread, an executor's) was killed at once under a live
    worker, and every job failed."""
    built: list[EngineProcess] = []
    thread = threading.Thread(target=lambda: built.append(EngineProcess(partial(fake_engine))))
    thread.start()
    thread.join()
    [pump] = built
    try:
        time.sleep(0.5)
        pump.submit("a", {"prompt": "x"}, _params(3))
        assert [(e.job_id, e.finish_reason) for e in _drain(pump) if e.finished] == [("a", "length")]
        assert pump.failure is None
    finally:
        pump.close()
    assert not pump._proc.is_alive()


def engine_that_fails_then_exits_slowly() -> FakeEngine:
    """Its loop fails at its fifth step (an error, not a crash); then its exit takes 3 s (a real engine's teardown)."""
    engine = FakeEngine()
    engine.step_s = 0.01
    has_work = engine.has_unfinished_requests

    def failing() -> bool:
        if engine.steps == 5:
            threading.Thread(target=time.sleep, args=(3,)).start()  # (holds the exit, as a CUDA teardown would)
            raise RuntimeError("the loop's own error, outside a step")
        return has_work()

    engine.has_unfinished_requests = failing
    return engine


@pytest.mark.slow  # (seconds: the engines' failed steps)
def test_an_engine_process_whose_steps_keep_failing_is_broken_as_an_engine_in_process_is():
    """In process, three failed steps in a row raise EngineBroken and the worker hands the jobs left back with their
    retries untouched; in the child the error failed every job held, retryably, each spending a retry."""
    from worker.pump import EngineBroken

    def drive(pump) -> tuple[list, list[str]]:
        ended = []
        for i in range(4):
            pump.submit(f"j{i}", {"prompt": "x"}, _params(5))
            try:
                deadline = time.monotonic() + 10
                while pump.has_work() and time.monotonic() < deadline:
                    ended += [(e.job_id, e.finish_reason, e.retryable) for e in pump.step() if e.finished]
            except EngineBroken:
                return ended, pump.job_ids()
        raise AssertionError(f"never broken: {ended}")

    in_process = drive(Pump(engine_whose_steps_keep_failing()))
    child = EngineProcess(partial(engine_whose_steps_keep_failing))
    try:
        assert drive(child) == in_process and in_process[1] == ["j2"]
        assert not child.cancel_many(["j2"])["j2"][-1].retryable  # (handed back: the worker's cold hand-back)
    finally:
        child.close()


@pytest.mark.slow  # (seconds: the child's slow exit)
def test_jobs_submitted_once_the_childs_error_came_are_never_sent_and_a_cancel_does_not_wait_for_its_exit():
    """The child's error sat in the pipe while the child exited (seconds, for a real engine): the jobs pulled
    meanwhile were sent to it first and failed, each spending a retry, and a cancel waited for the exit."""
    pump = EngineProcess(partial(engine_that_fails_then_exits_slowly))
    try:
        pump.submit("a", {"prompt": "x"}, _params(10_000))
        pump.step()  # (sent)
        time.sleep(1.0)  # (its error in the pipe, the child still exiting)
        pump.submit("b", {"prompt": "y"}, _params(3))
        ended = {e.job_id: e for e in pump.step() if e.finished}
        assert ended["a"].retryable and "b" not in ended and pump.unsent() == ["b"]
        started = time.monotonic()
        assert pump.cancel_many(["b"])["b"][-1].finish_reason == "abort"
        assert time.monotonic() - started < 1
    finally:
        pump.close()


@pytest.mark.slow
def test_a_dead_engine_process_fails_its_jobs_retryably_and_says_why(caplog):
    """... once in the log: every step after it said again "failing its 0 jobs"; and how it died, by which signal
    (its exit code read "None" where the send watchdog's thread had reaped it a moment before)."""
    pump = EngineProcess(partial(fake_engine, 0.01))
    caplog.set_level("ERROR", logger="roseinfer.worker")
    try:
        pump.submit("a", {"prompt": "x"}, _params(10_000))
        pump.submit("b", {"prompt": "y"}, _params(10_000))
        while not pump.step():
            pass
        os.kill(pump.pid, signal.SIGKILL)  # the OOM killer, say
        ended = []
        for _ in range(100):
            ended += [e for e in pump.step() if e.finished]
            if len(ended) == 2:
                break
        assert sorted(e.job_id for e in ended) == ["a", "b"]
        assert all(e.finish_reason == "error" and e.retryable for e in ended)
        assert ended[0].error == "the engine process was killed by SIGKILL" and pump.failure and not pump.has_work()
        assert pump.cancel("a") == []
        for _ in range(3):
            assert pump.step() == []
        said = [r.getMessage() for r in caplog.records if "engine process" in r.getMessage()]
        assert said == ["the engine process was killed by SIGKILL: failing its 2 jobs"]
    finally:
        pump.close()


def _hanging_with_two_jobs(step_timeout: float) -> EngineProcess:
    """An engine process whose third step hangs, running jobs "a" and "b"."""
    pump = EngineProcess(partial(engine_that_hangs_on_its_third_step), step_timeout=step_timeout)
    pump.submit("a", {"prompt": "x"}, _params(10_000))
    pump.submit("b", {"prompt": "y"}, _params(10_000))
    return pump


def _until_stuck_in_the_third_step(pump: EngineProcess) -> None:
    """Until the child of ``engine_that_hangs_on_its_third_step`` reported two steps, and a moment more: it is stuck
    in the third (a fixed sleep after its first step was not enough on a loaded machine)."""
    deadline, steps = time.monotonic() + 30, 0
    while steps < 2:
        assert time.monotonic() < deadline and pump.failure is None, pump.failure or "no two steps in 30 s"
        pump.step()
        steps += len(pump.take_step_times())
    time.sleep(0.2)  # (from its second step's report to the third's hang: a few bytecodes)


def _ended(pump: EngineProcess, count: int, limit_s: float = 30.0) -> list:
    """The final events of the pump's next steps, until ``count`` jobs ended (or ``limit_s`` passed)."""
    began, ended = time.monotonic(), []
    while len(ended) < count and time.monotonic() - began < limit_s:
        ended += [e for e in pump.step() if e.finished]
    return ended


@pytest.mark.slow
def test_a_hung_engine_process_is_killed_and_its_jobs_fail_retryably():
    pump = _hanging_with_two_jobs(step_timeout=1.5)
    try:
        began = time.monotonic()
        ended = _ended(pump, 2)
        assert sorted(e.job_id for e in ended) == ["a", "b"]
        assert all(e.retryable and e.error_type == "server_error" and "hung" in e.error for e in ended)
        assert "no step for 2 s (hung) and was killed" in pump.failure and not pump.has_work()
        assert time.monotonic() - began < 15 and pump._proc.exitcode == -signal.SIGKILL
    finally:
        pump.close()


@pytest.mark.slow
def test_a_child_tokenizing_for_longer_than_the_watchdog_allows_is_not_hung():
    """Tokenizing is not a step (in process the watchdog never sees it): the child, running none meanwhile, said
    nothing, and was killed as hung with every job failed."""
    _every_job_ends_under_a_watchdog_of_1_s(engine_slow_to_tokenize, 3)


def _every_job_ends_under_a_watchdog_of_1_s(build, jobs: int) -> None:
    pump = EngineProcess(build, step_timeout=1.0)
    try:
        for i in range(jobs):
            pump.submit(f"j{i}", {"prompt": "x"}, _params(2))
        ended = [e for e in _drain(pump, 30) if e.finished]
        assert sorted((e.job_id, e.finish_reason) for e in ended) == [(f"j{i}", "length") for i in range(jobs)]
        assert pump.failure is None
    finally:
        pump.close()


@pytest.mark.slow
def test_a_worker_held_up_between_a_submit_and_its_step_does_not_make_an_idle_child_hung():
    """The watchdog's clock started at the submit, but the job reaches the child at the next step: a worker held up
    between the two (Redis away while it took jobs in) for longer than the watchdog killed a healthy idle child."""
    pump = EngineProcess(partial(fake_engine), step_timeout=1.0)
    try:
        pump.submit("a", {"prompt": "x"}, _params(3))
        time.sleep(1.5)  # the worker's loop, held up
        ended = [e for e in _drain(pump, 30) if e.finished]
        assert [(e.job_id, e.finish_reason) for e in ended] == [("a", "length")] and pump.failure is None
    finally:
        pump.close()


def engine_spinning(step_cpu_s: float) -> FakeEngine:
    """Each step spins ``step_cpu_s`` of CPU time: a step under way when the process is stopped goes on after it."""
    engine = FakeEngine()
    step = engine.step

    def spinning_step(flush=True):
        until = time.process_time() + step_cpu_s
        while time.process_time() < until:
            pass
        return step(flush)

    engine.step = spinning_step
    return engine


_PAUSED = """
import sys, time
from functools import partial
sys.path.insert(0, sys.argv[2])
from test_engine_process import _drain, _params, engine_spinning
if sys.argv[1] == "process":
    from worker.engine_process import EngineProcess
    pump = EngineProcess(partial(engine_spinning, 0.08), step_timeout=2.0)
    pump.submit("a", {"prompt": "x"}, _params(30))
    pump.step()
    print("ready", flush=True)
    ended = [e for e in _drain(pump, 60) if e.finished]
    print([(e.job_id, e.finish_reason) for e in ended], pump.failure)
    pump.close()
else:
    from worker.watchdog import StepWatchdog
    watchdog = StepWatchdog(2.0)
    watchdog.start()
    watchdog.began()
    print("ready", flush=True)
    until = time.process_time() + 0.3  # a step of 0.3 s of CPU time, stopped in its middle (a loaded machine's
    # 0.3 s of CPU may take a second: the timeout is 2 s)
    while time.process_time() < until:
        pass
    watchdog.ended()
    print([("a", "length")], None)
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["process", "in-process"])
def test_a_worker_stopped_and_continued_is_not_hung(where):
    """A worker stopped (SIGSTOP, Ctrl-Z, a paused container or VM) past its step timeout: the monotonic clock ran on,
    and the watchdog woken after it took the step under way for hung: the worker exited 70, or killed its healthy
    engine process and failed its jobs (a retry spent each)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _PAUSED, where, str(Path(__file__).parent)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline() == "ready\n"
        time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGSTOP)  # (the whole group: an engine process is stopped with it)
        time.sleep(4)  # (past the timeout, and past the clock's tick and PAUSED_S: a pause, as the clock sees it)
        os.killpg(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert (proc.returncode, out) == (0, "[('a', 'length')] None\n"), err[-2000:]


@pytest.mark.slow
def test_a_step_that_admits_for_longer_than_the_watchdog_allows_is_not_hung():
    """Admissions are progress: five of 0.4 s in one step (2 s) against a watchdog of 1 s, and every job ends."""
    _every_job_ends_under_a_watchdog_of_1_s(engine_slow_to_admit, 5)


@pytest.mark.slow
def test_jobs_a_step_ended_while_the_watchdog_took_the_stacks_end_as_they_ended():
    """The watchdog gives the child a second to print its stacks before the kill: a step that ended in that second
    (1.5 s against 1 s) ended its jobs, which end so rather than failed."""
    pump = EngineProcess(engine_with_a_slow_first_step, step_timeout=1.0)
    try:
        pump.submit("a", {"prompt": "x"}, _params(1))
        pump.submit("b", {"prompt": "y"}, _params(1))
        ended = _ended(pump, 2)
        assert "hung" in pump.failure
        assert sorted((e.job_id, e.finish_reason) for e in ended) == [("a", "length"), ("b", "length")]
    finally:
        pump.close()


@pytest.mark.slow
def test_a_send_to_a_hung_engine_process_with_a_full_pipe_ends_at_the_watchdog():
    """The child hangs holding the interpreter lock, so nothing reads its pipe: a big submit filled it, and the
    parent's send waited for good (the step loop's own clock never ran)."""
    pump = EngineProcess(partial(engine_that_hangs_on_its_third_step, True), step_timeout=1.0)
    try:
        pump.submit("first", {"prompt": "x"}, _params(10_000))
        _until_stuck_in_the_third_step(pump)
        for i in range(300):  # ~600 kB of prompts: far past what the pipe holds
            pump.submit(f"big{i}", {"prompt": f"{i} " + "y" * 2000}, _params(10))  # (distinct: pickled apart)
        ended = _ended(pump, 301)
        assert len(ended) == 301 and all(e.retryable for e in ended)
        assert "took no command for 1 s (hung)" in pump.failure
        # Killed by the watchdog's thread, a second after the stacks were asked for. (Polled, not joined: a join
        # here beside that thread's own could see the child reaped by it and return before its exit code was set.)
        deadline = time.monotonic() + 10
        while pump._proc.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pump._proc.exitcode == -signal.SIGKILL
    finally:
        pump.close()


@pytest.mark.slow
def test_a_cancel_waiting_on_a_hung_engine_process_ends_at_the_watchdog():
    pump = _hanging_with_two_jobs(step_timeout=1.5)
    try:
        _until_stuck_in_the_third_step(pump)
        [ended] = pump.cancel("a", "canceled by its producer")
        assert ended.finish_reason == "error" and pump.failure and "hung" in pump.failure
        [b] = [e for e in pump.step() if e.finished]
        assert b.job_id == "b" and b.retryable
    finally:
        pump.close()


@pytest.mark.slow
def test_a_long_idle_spell_before_a_job_is_not_taken_for_a_hang():
    pump = EngineProcess(partial(fake_engine, 0.01), step_timeout=0.5)
    try:
        time.sleep(1.0)  # idle: the child owes nothing
        pump.submit("a", {"prompt": "x"}, _params(20))
        assert _by_job(_drain(pump))["a"][1:] == ("length", None) and pump.failure is None
    finally:
        pump.close()


@pytest.mark.slow
def test_an_engine_that_cannot_start_is_one_clear_error():
    with pytest.raises(EngineProcessDied, match="could not start: OSError: no such model file"):
        EngineProcess(partial(broken_engine))


def engine_that_dies_while_it_loads() -> FakeEngine:
    time.sleep(1.5)  # (past the start's first look)
    os._exit(3)  # killed, as by the OOM killer: no word sent


@pytest.mark.slow
def test_an_engine_process_is_waited_for_while_it_loads_and_its_death_is_seen_at_once():
    """The start waits as long as the child lives (it had a fixed cap of 600 s, which a large model's first load or
    download may pass; in process there is none): the wait must still see a death at once, and outlast its first
    look at the pipe."""
    began = time.monotonic()
    with pytest.raises(EngineProcessDied, match="exit code 3"):
        EngineProcess(engine_that_dies_while_it_loads)
    # (seen at once: the child's own start, which imports torch, took 11 s on a 2-core host loaded by three test
    # workers and another run; the wait it replaced ran 600 s)
    assert time.monotonic() - began < 60
    slow = EngineProcess(partial(engine_slow_to_start, 2.5))  # longer than the start's first look: still waited for
    slow.close()


def engine_slow_to_start(seconds: float) -> FakeEngine:
    time.sleep(seconds)
    return FakeEngine()


def engine_of_a_bad_option() -> FakeEngine:
    from roseinfer.config import ConfigError

    raise ConfigError("kv_cache_memory: 100 bytes hold no KV cache block")


@pytest.mark.slow
def test_a_bad_option_found_by_the_engine_process_is_the_same_error_as_in_process():
    """It was an EngineProcessDied, which the worker's command printed with two tracebacks."""
    from roseinfer.config import ConfigError

    with pytest.raises(ConfigError, match=r"^kv_cache_memory: 100 bytes hold no KV cache block$"):
        EngineProcess(partial(engine_of_a_bad_option))


def _worker_with_engine_process(step_s: float = 0.0, **more_settings):
    from worker.batch_worker import BatchWorker
    from worker.settings import WorkerSettings

    server = fakeredis.FakeServer()
    conn = fakeredis.FakeRedis(server=server)
    setattr(conn, "__rq_redis_server_version", (8, 0, 0))
    engine = EngineProcess(partial(fake_engine, step_s))
    settings = WorkerSettings(
        queue="proc", model="fake", heartbeat_interval=1, idle_wait=0.2, engine_process=True, **more_settings
    )
    worker = BatchWorker(engine, settings, conn, engine)
    crashed: list[BaseException] = []

    def work() -> None:
        try:
            worker.work(logging_level="WARNING")
        except BaseException as exc:
            crashed.append(exc)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return worker, engine, Client(connection=fakeredis.FakeRedis(server=server), queue="proc"), thread, crashed


@pytest.mark.slow  # a second or more: the full suite's (the fast lane stays under a minute)
def test_the_rq_worker_serves_through_an_engine_process():
    worker, engine, client, thread, crashed = _worker_with_engine_process()
    try:
        good = client.submit("fine", max_tokens=4, stream_options={"continuous_usage_stats": True})
        usage = good.result(timeout=20)["usage"]
        assert usage["completion_tokens"] == 4 and "".join(good.stream(timeout=5)) == "t1t2t3t4"
        events = list(good.events(timeout=5))  # the prompt's length crossed from the engine's process
        assert events[-1]["usage"] == usage and all(
            e["usage"]["prompt_tokens"] == usage["prompt_tokens"] for e in events
        )
        with pytest.raises(JobFailed, match="allows at most 100") as refused:
            client.submit("too long", max_tokens=4).result(timeout=20)
        assert refused.value.error_code == "context_length_exceeded"  # (crossed from the engine's process)
        many = client.submit_many([{"prompt": f"job {i}", "max_tokens": 3 + i % 5} for i in range(40)])
        assert [j.result(timeout=20)["usage"]["completion_tokens"] for j in many] == [3 + i % 5 for i in range(40)]
        engine_slow = worker.pump  # a canceled job stops with its partial text, as in-process
        long = client.submit("long", max_tokens=10**6)
        next(iter(long.events(timeout=20)))
        assert long.cancel()
        with pytest.raises(JobCanceled) as canceled:
            long.result(timeout=20)
        partial_result = canceled.value.result
        streamed = [t for e in long.events(timeout=5) for t in e["token_ids"]]
        assert partial_result["finish_reason"] == "abort" and partial_result["token_ids"][:2] == [1, 2]
        assert streamed == partial_result["token_ids"] and long.id not in engine_slow
    finally:
        worker.request_stop()
        thread.join(timeout=30)
    assert not thread.is_alive() and not crashed and engine._proc.exitcode == 0


def test_jobs_submitted_after_the_engine_process_died_are_named_unsent_and_fail_without_it():
    """The worker hands those back to their queues, retries untouched: they never reached the engine."""
    pump = EngineProcess(partial(fake_engine))
    try:
        pump.submit("a", {"prompt": "x"}, _params(10**6))
        pump.step()
        os.kill(pump._proc.pid, signal.SIGKILL)
        pump._proc.join(timeout=10)
        pump.submit("late", {"prompt": "y"}, _params(3))
        assert pump.unsent() == ["late"] and pump.failure is not None
        pump.submit("later", {"prompt": "z"}, _params(3))
        assert [e.finish_reason for e in pump.cancel_many(["late"])["late"]] == ["abort"]  # (its hand-back)
        # The cancel's send to the dead child emptied the outbox: "later" was failed for a retry, though it never
        # reached the engine (a stop-job applied before the hand-back of the rest).
        assert pump.unsent() == ["later"]
        assert pump.cancel_many(["later"]) and pump.unsent() == []  # (its hand-back)
        # Submitted before the step that meets the death (a pull's jobs, then the loop's step): that step failed them
        # with the rest, and the hand-back after it found none unsent. Left out the first time; a step after fails
        # what is still here.
        pump.submit("last", {"prompt": "w"}, _params(3))
        ended = [(e.job_id, e.retryable) for e in pump.step() if e.finished]
        assert ended == [("a", True)] and pump.unsent() == ["last"]
        assert [(e.job_id, e.retryable) for e in pump.step() if e.finished] == [("last", True)]
        assert pump.unsent() == []
    finally:
        pump.close()


def _wait_taken_in(worker, job_id: str) -> None:
    deadline = time.monotonic() + 30
    while job_id not in worker.in_flight:
        assert time.monotonic() < deadline, "the worker never took the job in"
        time.sleep(0.02)


@pytest.mark.slow
def test_a_worker_whose_engine_process_dies_fails_its_jobs_for_retry_and_stops():
    worker, engine, client, thread, crashed = _worker_with_engine_process(step_s=0.01)
    job = client.submit("long", max_tokens=100_000)
    _wait_taken_in(worker, job.id)  # (started is said before the loop takes it in: a death then hands it back)
    os.kill(engine.pid, signal.SIGKILL)
    thread.join(timeout=30)
    assert not thread.is_alive() and isinstance(crashed[0], EngineProcessDied)
    rq_job = job.rq_job
    assert rq_job.get_status() == "queued" and rq_job.retries_left == 1  # retried elsewhere, one retry spent


@pytest.mark.slow
def test_a_stop_job_heard_in_the_step_the_engine_process_died_stops_the_job_instead_of_retrying_it():
    """A stop-job command that came while the step ran, in the step the engine died in: the job failed retryably
    with the rest, and RQ ran it again elsewhere, though a user had stopped it."""
    import json

    from rq.results import Result

    worker, engine, client, thread, crashed = _worker_with_engine_process(step_s=0.01)
    job = client.submit("long", max_tokens=100_000)
    _wait_taken_in(worker, job.id)
    step = engine.step

    def dying_step(flush: bool = True):
        engine.step = step  # once
        message = {"data": json.dumps({"command": "stop-job", "job_id": job.id}).encode()}
        worker.handle_payload(message)  # as RQ's command listener hears it, on its own thread
        os.kill(engine.pid, signal.SIGKILL)
        engine._proc.join(timeout=10)
        return step(flush)

    engine.step = dying_step
    thread.join(timeout=30)
    assert not thread.is_alive() and isinstance(crashed[0], EngineProcessDied)
    rq_job = job.rq_job
    assert rq_job.get_status() == "stopped" and rq_job.retries_left == 2  # stopped, no retry spent
    with pytest.raises(JobCanceled) as ended:
        job.result(timeout=5)
    assert ended.value.result["finish_reason"] == "abort"  # its partial result, as any stopped job's
    assert job.rq_job.latest_result().type == Result.Type.STOPPED


@pytest.mark.slow  # an engine process: the full suite's
def test_the_failure_callbacks_of_the_jobs_an_engine_death_failed_run_on_the_callback_threads():
    """The worker leaves once its engine process died, its jobs failed: it shut the callback threads down before the
    sender had handed them those failures, so their callbacks ran on the sender's own thread, one after another
    (and those past its 30 s on the way out were cut off). They go to the callback threads first now."""
    from rq import Callback, Queue
    from rq.serializers import JSONSerializer

    worker, engine, client, thread, crashed = _worker_with_engine_process(
        step_s=0.01, allow_callback=["hook_probe.record_thread"]
    )
    queue = Queue("proc", connection=client.connection, serializer=JSONSerializer)
    hook = Callback("hook_probe.record_thread")
    jobs = [queue.enqueue("worker.jobs.generate", prompt=f"job {i}", max_tokens=10**5, on_failure=hook) for i in (1, 2)]
    for job in jobs:
        _wait_taken_in(worker, job.id)
    os.kill(engine.pid, signal.SIGKILL)
    thread.join(timeout=30)
    assert not thread.is_alive() and isinstance(crashed[0], EngineProcessDied)
    threads = [client.connection.get(f"hook-probe-thread:{job.id}") for job in jobs]
    assert all(name is not None and name.startswith(b"roseinfer-callback") for name in threads), threads


def test_an_engine_process_on_a_cpu_leaves_the_worker_a_core_unless_told_otherwise(monkeypatch):
    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = torch.get_num_threads()
    assert sparing_a_core({"num_threads": None, "device": "cpu"})["num_threads"] == max(1, cores - 1)
    assert sparing_a_core({"num_threads": 3, "device": "cpu"})["num_threads"] == 3
    assert sparing_a_core({"num_threads": None, "device": "cuda"})["num_threads"] is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # (the operator's count: torch's default follows it)
    assert sparing_a_core({"num_threads": None, "device": "cpu"})["num_threads"] is None


@pytest.mark.slow  # seconds: the full suite's
def test_a_big_submit_while_the_child_sends_fast_does_not_deadlock():
    """The worker writing a large batch of jobs to the child while the child's events fill the pipe back: neither
    side may wait on the other's reading (the child reads its commands on a thread of its own)."""
    pump = EngineProcess(partial(fake_engine), event_interval_ms=0)
    try:
        for i in range(200):
            pump.submit(f"run{i}", {"prompt": "x"}, _params(10**9))
        pump.step()
        time.sleep(0.5)  # the worker busy elsewhere: the child's events fill the pipe back
        for i in range(300):
            pump.submit(f"big{i}", {"prompt": "y" * 20_000}, _params(2))
        done = threading.Event()

        def go() -> None:
            pump.step()
            done.set()

        threading.Thread(target=go, daemon=True).start()
        assert done.wait(20), "the worker and its engine process wait on each other"
        big = {e.job_id for e in _drain_until(pump, lambda ev: {e.job_id for e in ev if e.finished} >= _ids(300))}
        assert _ids(300) <= big
    finally:
        pump.close()


def _ids(n: int) -> set[str]:
    return {f"big{i}" for i in range(n)}


def _drain_until(pump, enough, limit_s: float = 30.0) -> list:
    events, until = [], time.monotonic() + limit_s
    while not enough(events):
        assert time.monotonic() < until, "the jobs never ended"
        events += pump.step()
    return events


_COLLECTOR_PROBE = """
import gc
from functools import partial

import transformers.modeling_utils  # what a worker's process loads (its tokenizer, roseinfer's imports)
from test_engine_process import fake_engine
from worker.engine_process import EngineProcess

loaded = len(gc.get_objects())
pump = EngineProcess(partial(fake_engine))
print(loaded, len(gc.get_objects()))
pump.close()
"""


@pytest.mark.slow
def test_the_workers_side_of_an_engine_process_leaves_what_it_loaded_out_of_collections():
    """The worker's process loads what the engine's does (torch, transformers) but builds no engine, whose start
    freezes them: every full collection walked them all (230 ms with the tiny model, every tenth burst or so)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.path.dirname(tests)])}
    probe = subprocess.run(
        [sys.executable, "-c", _COLLECTOR_PROBE], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    loaded, tracked = map(int, probe.stdout.split())
    assert loaded > 100_000  # torch and transformers are in
    assert tracked < loaded / 10  # and no longer walked by the collector


def engine_that_marks_its_idle_steps(step_s: float, path: str) -> FakeEngine:
    """Touches ``path`` after a step that left it no request: the job's end is made, its cancel comes after it."""
    engine = fake_engine(step_s)
    step = engine.step

    def marking_step(flush=True):
        outs = step(flush)
        if not engine.requests:
            Path(path).touch()
        return outs

    engine.step = marking_step
    return engine


def _wait_for_file(path: Path) -> None:
    until = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < until, "the child never ended the job"
        time.sleep(0.01)
    path.unlink()


@pytest.mark.slow  # an engine process (the fast lane's one is the test of jobs sent after its death)
def test_a_cancel_that_crosses_its_jobs_end_leaves_the_end_to_be_handed_out(tmp_path):
    """The child ended the job while its cancel was on the way: the answer names no such job, and the job's last
    event, read while waiting for it, is still work to hand out (else a quiet worker never steps again to take it,
    and the job stays in flight for good)."""
    idle = tmp_path / "idle"
    pump = EngineProcess(partial(engine_that_marks_its_idle_steps, 0.05, str(idle)))  # 3 steps: longer than
    try:  # step() waits for the first event
        pump.submit("a", {"prompt": "x"}, _params(3))
        pump.step()  # sent; the child runs it to its end on its own
        _wait_for_file(idle)
        assert pump.cancel_many(["a"]) == {}
        assert pump.has_work()
        assert [(e.job_id, e.finish_reason) for e in _drain(pump) if e.finished] == [("a", "length")]
        assert not pump.has_work()
        # A stop's hand-back takes such ends at once, without a step (it sent the job back to the queue, its
        # finished work thrown away).
        pump.submit("b", {"prompt": "x"}, _params(3))
        pump.step()
        _wait_for_file(idle)
        assert pump.cancel_many(["b"]) == {}
        assert [(e.job_id, e.finish_reason) for e in pump.pending_events() if e.finished] == [("b", "length")]
        assert not pump.has_work() and pump.pending_events() == []
    finally:
        pump.close()


@pytest.mark.slow
@pytest.mark.redis
def test_a_worker_that_fails_to_start_closes_its_engine_process(redis_url):
    """A worker that fails before its loop (a name another live worker has) closed nothing: its engine process,
    which ignores SIGTERM, kept multiprocessing's exit waiting for it, and the worker never exited."""
    import uuid

    from redis import Redis

    from roseinfer.config import ConfigError
    from worker.batch_worker import BatchWorker
    from worker.settings import WorkerSettings

    conn = Redis.from_url(redis_url)
    settings = WorkerSettings(queue=f"q-{uuid.uuid4().hex[:8]}", model="fake", name=f"twin-{uuid.uuid4().hex[:6]}")
    first = BatchWorker(FakeEngine(), settings, conn)
    first.register_birth()
    try:
        pump = EngineProcess(partial(fake_engine))
        second = BatchWorker(pump, settings, conn, pump=pump)
        with pytest.raises(ConfigError, match="registered on this Redis already"):
            second.work()
        assert pump.failure is not None  # closed: its child is gone
    finally:
        first.register_death()


@pytest.mark.redis
def test_a_name_a_killed_worker_held_is_taken_over_once_its_heartbeat_lapsed(redis_url, caplog):
    """A worker killed (OOM, SIGKILL) with a fixed --name held it ~8 minutes (RQ's worker_ttl plus 60 s): each
    restart under that name was refused while the GPU idled. Its statistics lapse with its heartbeat; a name whose
    holder has not beaten for a heartbeat TTL is taken over. One whose holder beats is refused."""
    import logging
    import re
    import uuid

    from redis import Redis

    from roseinfer.config import ConfigError
    from worker.batch_worker import BatchWorker
    from worker.settings import WorkerSettings

    conn = Redis.from_url(redis_url)
    name = f"gpu-{uuid.uuid4().hex[:6]}"
    settings = WorkerSettings(queue=f"q-{uuid.uuid4().hex[:8]}", model="fake", name=name, burst=True)
    key, stats = f"rq:worker:{name}", f"roseinfer:stats:{name}"
    conn.hset(key, "birth", "2026-11-25T00:00:00.000000Z")  # the killed worker's, last written 60 s ago
    conn.expire(key, 420)  # (its beats set 480 s: RQ's worker_ttl 420 plus 60)
    conn.hset(stats, "in_flight", 1)  # but beating still: alive
    conn.expire(stats, 30)
    with pytest.raises(ConfigError, match="registered on this Redis already"):
        BatchWorker(FakeEngine(), settings, conn).work(burst=True)
    conn.delete(stats)  # its heartbeat lapsed: dead
    with caplog.at_level(logging.WARNING, logger="roseinfer.worker"):
        assert BatchWorker(FakeEngine(), settings, conn).work(burst=True) is False  # (burst: nothing queued)
    # (60 s, or 61 once half a second passed since the EXPIRE: Redis rounds a TTL to the nearest second)
    said = rf"worker name '{name}' was held by a dead worker \(no beat for 6[01] s\): taken over"
    assert re.search(said, caplog.text)
    assert conn.hexists(key, "death")  # (the new one's own, as it left)


def engine_that_ends_a_job_then_breaks() -> FakeEngine:
    """Its second step ends job "short"; then its loop breaks outside any step (the child sends that step, then its
    error, and exits)."""
    engine = FakeEngine()
    real = engine.has_unfinished_requests

    def has_unfinished_requests():
        if engine.steps >= 2:
            raise RuntimeError("the engine's loop broke")
        return real()

    engine.has_unfinished_requests = has_unfinished_requests
    return engine


@pytest.mark.slow
def test_what_a_dead_child_sent_before_it_went_is_read_first():
    """The child's last messages (a step that ended a job, its error) are read before its jobs fail: the job that
    ended ends so (no retry spent), and the reason is the child's own, not its exit code."""
    pump = EngineProcess(partial(engine_that_ends_a_job_then_breaks))
    try:
        pump.submit("short", {"prompt": "x"}, _params(2))
        pump.submit("long", {"prompt": "y"}, _params(10_000))
        pump._send_outbox()
        until = time.monotonic() + 10
        while pump._proc.is_alive() and time.monotonic() < until:  # it has gone before the parent looks
            time.sleep(0.01)
        ended = {e.job_id: e for e in _drain(pump) if e.finished}
        assert ended["short"].finish_reason == "length"
        assert ended["long"].finish_reason == "error" and ended["long"].retryable
        assert "the engine's loop broke" in ended["long"].error
    finally:
        pump.close()


@pytest.mark.slow
def test_the_models_recommended_settings_reach_the_worker_from_an_engine_process():
    """Jobs are checked in the worker's process, where their unset fields take the model's settings; the worker
    writes the model's tokenizer and chat template to Redis and names its context length from there too."""
    pump = EngineProcess(engine_that_recommends)
    try:
        assert pump.sampling_defaults == {"temperature": 0.6, "top_p": 0.9}
        assert pump.tokenizer_json() == '{"model": "its tokenizer"}' and pump.max_model_len == 4096
        assert pump.chat_template_doc() == '{"chat_template": "its template"}'
    finally:
        pump.close()


def test_a_child_whose_parent_died_before_it_asked_to_die_with_it_stops_at_once():
    """The kernel's parent-death signal is asked for as the child begins: a parent killed before then (the child's
    imports take a while) left it orphaned, the signal never sent, and it loaded the model for no one."""
    code = (
        "import multiprocessing, os, types\n"
        "import worker.engine_process as ep\n"
        "multiprocessing.parent_process = lambda: types.SimpleNamespace(pid=os.getppid() + 12345)\n"  # gone
        "ep._die_with_parent()\n"
        "print('alive')\n"
    )
    orphan = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert orphan.returncode != 0 and "alive" not in orphan.stdout
    code = code.replace("os.getppid() + 12345", "os.getppid()")  # its parent still there: it goes on
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout == "alive\n"


def test_a_message_the_child_cannot_read_ends_it_instead_of_leaving_it_deaf():
    """Its reading thread caught the pipe's end only: any other error (a message that does not unpickle) ended the
    thread without a word, and the child heard nothing more while its worker waited on it."""
    import queue

    from worker.engine_process import _read_commands

    class Pipe:
        def recv(self):
            raise ValueError("cannot unpickle")

    inbox: queue.SimpleQueue = queue.SimpleQueue()
    _read_commands(Pipe(), inbox)
    assert inbox.get(timeout=1) is None


@pytest.mark.slow
def test_a_hang_both_watchdogs_find_is_one_kill_with_the_first_ones_reason(caplog):
    """A send slow past the timeout (the send watchdog's thread kills), then the step after it (the step loop's own
    watchdog): the second killed again, its stacks a second more, and its reason replaced the first's."""
    pump = _hanging_with_two_jobs(step_timeout=60)
    try:
        _until_stuck_in_the_third_step(pump)
        watchdog = threading.Thread(target=pump._hung, args=("took no command",))
        watchdog.start()
        deadline = time.monotonic() + 10
        while pump._failure is None:  # the watchdog's thread is in the second it gives the stacks
            assert time.monotonic() < deadline
            time.sleep(0.01)
        again = pump._hung()  # the step loop's, meanwhile
        assert pump._proc.exitcode == -signal.SIGKILL  # back once the first one's kill is done
        watchdog.join(10)
        assert str(again) == pump.failure and "took no command" in pump.failure
        assert sum("its stacks first" in r.getMessage() for r in caplog.records) == 1
    finally:
        pump.close()
