"""Redis faults a fleet meets: a Redis that refuses writes (full memory) is back-pressure, not death; an eviction
policy gets a loud warning, or a refusal to start."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ThreadWorker, no_redis_server, slow_engine_steps, steady_port, with_slow_steps
from redis import Redis
from rq.command import send_shutdown_command

from producer import Client, JobCanceled, JobFailed
from worker.local_redis import free_port, serves, start_private_redis, stop_private_redis
from worker.main import UnsafeRedis, check_eviction_policy

pytestmark = pytest.mark.redis


@pytest.fixture
def own_redis():
    """A redis-server of this test's own: its settings are changed here."""
    url, proc = start_private_redis()
    if proc is None:
        no_redis_server("could not start redis-server")
    yield url, Redis.from_url(url)
    stop_private_redis(proc)


def test_a_private_redis_never_takes_a_port_another_server_answers_on(own_redis, monkeypatch):
    import worker.local_redis as local_redis

    taken_url, taken = own_redis
    taken_port = taken.connection_pool.connection_kwargs["port"]
    assert start_private_redis(port=taken_port)[1] is None  # ours could not bind: the answer came from the other
    ports = iter([taken_port, free_port()])  # a free port another process took first, then a free one
    monkeypatch.setattr(local_redis, "free_port", lambda: next(ports))
    url, proc = start_private_redis()
    try:
        assert proc is not None and url != taken_url
        assert int(Redis.from_url(url).info("server")["process_id"]) == proc.pid
    finally:
        stop_private_redis(proc)


def test_a_stopped_private_redis_is_gone_with_its_folder(tmp_path):
    """`roseinfer serve --embedded` and the benches only sent SIGTERM: their redis-server outlived them (orphaned,
    for the time its exit took) and each start left a folder in the temporary directory. A server's own folder,
    one it was not given by start_private_redis, stays."""
    _, proc = start_private_redis()
    if proc is None:
        no_redis_server("could not start redis-server")
    folder = Path(proc.args[proc.args.index("--dir") + 1])
    assert folder.is_dir()
    assert os.getpgid(proc.pid) == os.getpgid(0)  # (in its caller's group: a signal to the group, a timeout's, ends it)
    stop_private_redis(proc)
    assert proc.returncode is not None and not folder.exists()
    cmd = ["redis-server", "--port", str(free_port()), "--save", "", "--dir", str(tmp_path)]
    other = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    stop_private_redis(other)
    assert other.returncode is not None and tmp_path.is_dir()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_private_redis_ends_with_a_command_killed_outright():
    """A command SIGKILLed (the OOM killer, kill -9) left its redis-server serving for good: ``serve --embedded``'s,
    in its own session, is out of reach of a signal to the group too. The kernel now ends it with its parent."""
    code = (
        "from worker.local_redis import start_private_redis; import time\n"
        "url, proc = start_private_redis(own_session=True); print(proc.pid, url, flush=True); time.sleep(60)"
    )
    command = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid, url = command.stdout.readline().split()
    assert Redis.from_url(url).ping()
    command.kill()
    command.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):  # (gone, or a zombie the machine's init has not reaped yet)
            if Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
                time.sleep(0.05)
                continue
        break
    else:
        os.kill(int(pid), 9)
        pytest.fail("the redis-server outlived the command that started it")


def test_an_eviction_policy_is_warned_about_or_refused(own_redis, caplog, capsys):
    url, conn = own_redis
    conn.config_set("maxmemory-policy", "allkeys-lru")
    with caplog.at_level(logging.WARNING, logger="roseinfer.worker"):
        check_eviction_policy(conn, required=False)
    assert "maxmemory-policy allkeys-lru" in caplog.text and "noeviction" in caplog.text
    with pytest.raises(UnsafeRedis, match="refusing to start"):
        check_eviction_policy(conn, required=True)
    with pytest.warns(RuntimeWarning, match="maxmemory-policy allkeys-lru"):
        Client(url, queue="evict").submit("x", max_tokens=1)
    from worker.cli import main

    capsys.readouterr()
    assert main(["submit", "x", "--redis-url", url, "--queue", "evict"]) == 0  # the command's: one line, as its own
    warned = [line for line in capsys.readouterr().err.splitlines() if "maxmemory-policy" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: Redis evicts keys"), warned
    conn.config_set("maxmemory-policy", "noeviction")
    check_eviction_policy(conn, required=True)  # a safe Redis: nothing to say


@pytest.mark.slow
def test_require_noeviction_refuses_to_start_in_one_line(own_redis, tiny_chat_model):
    url, conn = own_redis
    conn.config_set("maxmemory-policy", "volatile-lru")
    env = {**os.environ, "ROSEINFER_REQUIRE_NOEVICTION": "true"}
    cmd = [sys.executable, "-m", "worker.cli", "worker", "--redis-url", url, "--model", tiny_chat_model]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2
    # One error line and no traceback. (Where Triton is installed, the dev extra, its C extension may print
    # nanobind's leak report after it as the interpreter exits: not ours, so not the last line.)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: Redis evicts keys under memory pressure")
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_full_redis_pauses_the_worker_and_loses_nothing(own_redis, tiny_chat_model, monkeypatch):
    url, conn = own_redis
    w = ThreadWorker(url, tiny_chat_model, heartbeat_interval=1, max_num_seqs=4)
    real_step = w.worker.engine.step

    def slow_step(flush=True):  # a few seconds of work, so Redis fills while the jobs run
        time.sleep(0.01)
        return real_step(flush=flush)

    monkeypatch.setattr(w.worker.engine, "step", slow_step)
    try:
        client = Client(url, queue=w.queue)
        jobs = client.submit_many([{"prompt": f"full {i}", "max_tokens": 150, "ignore_eos": True} for i in range(4)])
        next(iter(jobs[0].events(timeout=30)))
        used = int(conn.info("memory")["used_memory"])
        conn.config_set("maxmemory", used // 2)  # noeviction: every write is refused from now on
        deadline = time.monotonic() + 30
        while w.worker.sender.refusing is None and time.monotonic() < deadline:  # its next write is refused
            time.sleep(0.05)
        time.sleep(1)  # and it goes on through a few more refused writes
        assert w.thread.is_alive()
        assert w.worker.sender.refusing is not None and "OutOfMemoryError" in w.worker.sender.refusing
        conn.config_set("maxmemory", 0)
        for job in jobs:
            result = job.result(timeout=60)
            assert result["usage"]["completion_tokens"] == 150
            events = list(job.events(timeout=10))
            assert [e["n"] for e in events] == list(range(len(events)))  # no event lost, none twice
            assert "".join(e["text"] for e in events) == result["text"]
        assert w.worker.sender.refusing is None
    finally:
        conn.config_set("maxmemory", 0)
        w.stop()


@pytest.mark.slow  # a worker and seconds of steps
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (it dies: the point)
@pytest.mark.parametrize("taken_in", [True, False], ids=["in-flight", "on-their-way"])
def test_a_worker_dying_of_an_error_it_does_not_know_hands_its_jobs_back(
    own_redis, tiny_chat_model, monkeypatch, taken_in
):
    """An error the worker does not wait out (an ACL refusal here; MASTERDOWN before it was one to wait out) ended
    the worker with its jobs "started": they sat there until its heartbeat lapsed, then RQ's clean-up failed them
    (no retries left) as abandoned. They go back to their queue for another worker: those running, and those the
    puller started that the step loop had yet to take in (its maintenance comes first; CI met it once)."""
    import redis

    url, conn = own_redis
    w = ThreadWorker(url, tiny_chat_model, heartbeat_interval=1, maintenance_interval=1, max_num_seqs=4)
    slow_engine_steps(monkeypatch, w.worker.engine, 0.01)

    on_their_way = []
    entered = threading.Event()

    def refused(*args, **kwargs):
        entered.set()
        deadline = time.monotonic() + 30
        while not taken_in and not w.worker.puller.unapplied() and time.monotonic() < deadline:
            time.sleep(0.01)  # (the maintenance after the pull, before the loop takes the jobs in)
        on_their_way.append(bool(w.worker.puller.unapplied()))
        raise redis.exceptions.NoPermissionError("this user has no permissions to run the 'set' command")

    if not taken_in:
        monkeypatch.setattr(w.worker, "run_maintenance_tasks", refused)
    try:
        client = Client(url, queue=w.queue, retries=0)
        # On their way: sent while the loop is inside its maintenance, so the puller starts them meanwhile.
        assert taken_in or entered.wait(30)
        jobs = client.submit_many([{"prompt": f"long {i}", "max_tokens": 200, "ignore_eos": True} for i in range(2)])
        deadline = time.monotonic() + 30
        while taken_in and not all(job.id in w.worker.in_flight for job in jobs) and time.monotonic() < deadline:
            time.sleep(0.01)
        if taken_in:
            assert all(job.id in w.worker.in_flight for job in jobs)  # (else the jobs were never taken at all)
            monkeypatch.setattr(w.worker.maintenance, "lock", refused)  # its next maintenance
        w.thread.join(timeout=40)
        assert not w.thread.is_alive()
        assert on_their_way == [not taken_in]  # it died of the refusal, with the jobs where the case puts them
        assert [job.status() for job in jobs] == ["queued", "queued"]
        assert sorted(conn.lrange(f"rq:queue:{w.queue}", 0, -1)) == sorted(job.id.encode() for job in jobs)
    finally:
        if w.thread.is_alive():
            w.stop()


@pytest.mark.slow  # a worker and seconds of heartbeats
def test_an_idle_worker_registers_again_after_redis_lost_its_data(own_redis, tiny_chat_model):
    """Only a send looked at the registration, and an idle worker sends nothing: after Redis restarted empty, `rq
    info`, Worker.all and `roseinfer status` listed no worker until a job came (its heartbeat recreated a hash RQ
    cannot list). Its heartbeat looks too."""
    from rq import Worker

    url, conn = own_redis
    w = ThreadWorker(url, tiny_chat_model, heartbeat_interval=1)
    try:
        deadline = time.monotonic() + 30
        while w.worker.name not in [x.name for x in Worker.all(connection=conn)] and time.monotonic() < deadline:
            time.sleep(0.1)
        conn.flushall()  # (this test's own Redis) as a restart without persistence leaves it
        deadline = time.monotonic() + 15
        while w.worker.name not in [x.name for x in Worker.all(connection=conn)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert w.worker.name in [x.name for x in Worker.all(connection=conn)]
        assert conn.hexists(w.worker.key, "birth") and Client(url, queue=w.queue).status()["workers"]
    finally:
        w.stop()


def _worker_streaming(url: str, queue: str, model: str) -> subprocess.Popen:
    """A worker process whose four jobs have started (and stream, for seconds)."""
    from worker.cli import worker_command

    cmd = with_slow_steps(worker_command(url, queue, model, "--max-num-seqs", "4", "--heartbeat-interval", "1"))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    client = Client(url, queue=queue)
    jobs = [client.submit(f"p{i}", max_tokens=240, ignore_eos=True) for i in range(4)]
    deadline = time.time() + 60
    while not all(job.status() == "started" for job in jobs):
        if time.time() > deadline or proc.poll() is not None:
            proc.kill()
            raise AssertionError(f"the worker never started the jobs: {proc.communicate()[1][-3000:]}")
        time.sleep(0.05)
    return proc


@pytest.mark.slow  # a worker process, and seconds of waiting
def test_a_second_stop_signal_stops_a_worker_whose_redis_is_gone(own_redis, tiny_chat_model):
    """A cold stop does not wait for Redis: with Redis gone and jobs streaming, the step loop filled the sender's
    queue and blocked there, so two SIGTERMs never stopped the worker. It exits within seconds; RQ's clean-up
    requeues its jobs once its heartbeat lapses."""
    import signal

    url, conn = own_redis
    proc = _worker_streaming(url, "gone", tiny_chat_model)
    try:
        conn.shutdown(nosave=True)  # Redis goes away while the jobs stream
        time.sleep(4)  # the sender waits on Redis; the steps' writes pile up behind it
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)  # before the fix: still running, until Redis came back
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "second stop signal" in err and re.search(r"worker \S+ stopped", err), err[-3000:]


@pytest.mark.slow
def test_a_redis_that_stops_answering_is_a_redis_that_is_down(tiny_chat_model):
    """A Redis that holds its connections open but answers nothing (a dead host, a partition, a paused VM; here a
    SIGSTOP) hung every command for the kernel's ~15 minutes without a word, and two SIGTERMs did not stop the
    worker. Its commands time out, it says Redis is unavailable, and a cold stop ends it within seconds."""
    import signal

    url, redis_proc = start_private_redis()
    if redis_proc is None:
        no_redis_server("could not start redis-server")
    proc = None
    try:
        proc = _worker_streaming(url, "mute", tiny_chat_model)
        redis_proc.send_signal(signal.SIGSTOP)  # connections stay open; nothing answers
        time.sleep(8)  # past the worker's socket timeout (idle wait + 5 s)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        # Before: still waiting on its first reply (RQ's socket timeout, 415 s); then ~46 s, one command's timeout
        # after another on the way out. Now its patience (5 s), a command's timeout, and 3 s for the way out.
        _, err = proc.communicate(timeout=30)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        redis_proc.send_signal(signal.SIGCONT)
        stop_private_redis(redis_proc)
    assert "Redis unavailable" in err and re.search(r"worker \S+ stopped", err), err[-3000:]


@pytest.mark.slow
def test_a_follower_rides_out_a_redis_restart():
    """A Redis restart (or a failover) ended every stream and wait with a ConnectionError ("check --redis-url"),
    though the jobs went on: the follower waits for Redis and reads on from where it was."""
    import json
    import threading

    from producer.protocol import stream_key

    port = steady_port()  # (stopped and started again on it)
    url, first = start_private_redis(port=port)
    if first is None:
        no_redis_server("could not start redis-server")
    conn = Redis.from_url(url)
    job = Client(url, queue="rides").job("rides-1")
    conn.hset("rq:job:rides-1", "status", "started")
    conn.xadd(stream_key("rides-1"), {"event": json.dumps({"n": 0, "text": "Hello", "token_ids": [1]})})
    got, errors, waited, restarted = [], [], [], None
    follower = threading.Thread(target=lambda: _follow(job, got, errors), daemon=True)
    follower.start()
    waiter = threading.Thread(target=lambda: _follow(job, waited, waited, result=True), daemon=True)
    waiter.start()
    try:
        deadline = time.time() + 10
        while not got and time.time() < deadline:
            time.sleep(0.05)
        stop_private_redis(first)  # Redis goes away, and comes back empty (no AOF), as the worker writes what it holds
        time.sleep(1)
        _, restarted = start_private_redis(port=port)
        # The worker writes the job's hash back a moment later (its next round trip or heartbeat): meanwhile the wait
        # for the result said NoSuchJob, of a job the worker then finished.
        time.sleep(1.5)
        conn.hset("rq:job:rides-1", "status", "finished")
        last = {"n": 1, "text": " world", "token_ids": [2], "finish_reason": "stop", "usage": {}}
        conn.xadd(stream_key("rides-1"), {"event": json.dumps(last)})
        follower.join(timeout=30)
        waiter.join(timeout=30)
    finally:
        for proc in (first, restarted):
            if proc is not None and proc.poll() is None:
                stop_private_redis(proc)
    assert errors == [] and [e["text"] for e in got] == ["Hello", " world"]
    # The wait for the result rode it out too: it saw the job end (finished, its result not written by hand here).
    [outcome] = waited
    assert isinstance(outcome, JobFailed) and "result" in str(outcome), outcome


@pytest.mark.slow
def test_followers_read_on_when_their_primary_is_made_a_replica_and_back(own_redis):
    """REPLICAOF on the primary a plain URL names (by hand, or a tool's) ends every blocked XREAD with UNBLOCKED:
    every stream follower, sync and async (the server's SSE streams, all at once), ended with that error."""
    import asyncio
    import json
    import threading

    from producer import AsyncClient
    from producer.protocol import stream_key

    url, conn = own_redis
    for job_id in ("demoted-1", "demoted-2"):
        conn.hset(f"rq:job:{job_id}", "status", "started")
        conn.xadd(stream_key(job_id), {"event": json.dumps({"n": 0, "text": "Hello", "token_ids": [1]})})
    got, errors = [], []
    follower = threading.Thread(target=lambda: _follow(Client(url, queue="q").job("demoted-1"), got, errors))
    follower.start()

    async def follow_async() -> list:
        async with AsyncClient(url, queue="q") as client:
            return [event["text"] async for event in client.job("demoted-2").events(timeout=30)]

    followed: list = []
    async_follower = threading.Thread(target=lambda: followed.append(asyncio.run(follow_async())))
    async_follower.start()
    time.sleep(1.5)  # (both blocked in their reads)
    conn.replicaof("127.0.0.1", free_port())  # (a primary that is not there: it serves reads, stale)
    time.sleep(1.5)
    conn.replicaof("NO", "ONE")
    last = {"n": 1, "text": " world", "token_ids": [2], "finish_reason": "stop", "usage": {}}
    for job_id in ("demoted-1", "demoted-2"):
        conn.hset(f"rq:job:{job_id}", "status", "finished")
        conn.xadd(stream_key(job_id), {"event": json.dumps(last)})
    follower.join(30)
    async_follower.join(30)
    assert errors == [] and [e["text"] for e in got] == ["Hello", " world"]
    assert followed == [["Hello", " world"]]


@pytest.mark.slow
def test_an_async_follower_rides_out_a_redis_restart_as_the_sync_one_does():
    """AsyncClient's streams and waits (every request of the server) ended with a ConnectionError at a Redis
    restart, the jobs going on; the sync client's waited for Redis and read on."""
    import asyncio
    import json

    from producer import AsyncClient
    from producer.protocol import stream_key

    port = steady_port()  # (stopped and started again on it)
    url, first = start_private_redis(port=port)
    if first is None:
        no_redis_server("could not start redis-server")
    conn = Redis.from_url(url)
    conn.hset("rq:job:rides-2", "status", "started")
    conn.xadd(stream_key("rides-2"), {"event": json.dumps({"n": 0, "text": "Hello", "token_ids": [1]})})
    restarted = None

    async def follow_and_wait() -> tuple[list, BaseException | None]:
        nonlocal restarted
        async with AsyncClient(url, queue="rides") as client:
            job = client.job("rides-2")
            got: list = []

            async def follow() -> None:
                async for event in job.events(timeout=30):
                    got.append(event["text"])

            followed = asyncio.create_task(follow())
            waited = asyncio.create_task(job.result(timeout=30))
            for _ in range(200):
                if got:
                    break
                await asyncio.sleep(0.05)
            stop_private_redis(first)  # Redis goes away, and comes back empty, as in the sync test above
            await asyncio.sleep(1)
            _, restarted = start_private_redis(port=port)
            await asyncio.sleep(1.5)  # (the worker writes the job's hash back a moment later, as above)
            conn.hset("rq:job:rides-2", "status", "finished")
            last = {"n": 1, "text": " world", "token_ids": [2], "finish_reason": "stop", "usage": {}}
            conn.xadd(stream_key("rides-2"), {"event": json.dumps(last)})
            await followed
            outcome = (await asyncio.gather(waited, return_exceptions=True))[0]
            return got, outcome

    try:
        got, outcome = asyncio.run(follow_and_wait())
    finally:
        for proc in (first, restarted):
            if proc is not None and proc.poll() is None:
                stop_private_redis(proc)
    assert got == ["Hello", " world"]
    assert isinstance(outcome, JobFailed) and "result" in str(outcome), outcome  # the end seen, not the outage


def _follow(job, got: list, errors: list, result: bool = False) -> None:
    try:
        got.extend([job.result(timeout=30)] if result else job.events(timeout=30))
    except Exception as exc:  # (asserted)
        errors.append(exc)


@pytest.mark.slow
def test_rq_commands_reach_a_worker_whose_reconnect_timed_out(tiny_chat_model):
    """A reconnect that times out (a host that takes the connection and answers nothing: a partition, a half-dead
    node) ended RQ's command listener for good, and the worker ignored stop-job and shutdown from then on. It
    waits the outage out as it waits out a refused connection, and hears commands once Redis is back."""
    port = steady_port()  # (stopped, held silent, and started again on it)
    url, redis_proc = start_private_redis(port=port)
    if redis_proc is None:
        no_redis_server("could not start redis-server")
    worker = ThreadWorker(url, tiny_chat_model)
    silent = socket.socket()
    held: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 30
        # Started whole (its command listener, then its sender's scripts, its puller, its heartbeat): a Redis gone
        # in the middle of its start is an error of the start (CI met it, the test's worker dead of it).
        while getattr(worker.worker._heartbeat, "_thread", None) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert worker.worker.pubsub_thread is not None and worker.thread.is_alive()
        stop_private_redis(redis_proc)
        # The port answers again, but nothing on it speaks: the listener's reconnect connects, then times out.
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        silent.bind(("127.0.0.1", port))
        silent.listen(64)
        silent.settimeout(0.2)
        until = time.monotonic() + 15  # a try every 2 s; a reply waited for a socket timeout (6 s)
        while time.monotonic() < until:
            with contextlib.suppress(TimeoutError):
                held.append(silent.accept()[0])
        assert held, "nothing reconnected"
        for conn in [*held, silent]:
            conn.close()
        _, redis_proc = start_private_redis(port=port)
        conn, channel = Redis.from_url(url), f"rq:pubsub:{worker.worker.name}"
        deadline = time.monotonic() + 30  # the listener's next try (every 2 s) subscribes again
        while not conn.pubsub_numsub(channel)[0][1] and time.monotonic() < deadline:
            time.sleep(0.1)
        # (before: the listener had died at the timeout, ``pubsub thread exiting on Timeout reading from socket``)
        assert conn.pubsub_numsub(channel)[0][1] == 1, "the listener never subscribed again"
        send_shutdown_command(conn, worker.worker.name)
        worker.thread.join(timeout=30)
        assert not worker.thread.is_alive(), "the worker did not hear the shutdown command"
        assert worker.errors == []  # it stopped for the command, not of the outage
    finally:
        for conn in [*held, silent]:
            conn.close()
        worker.stop()
        if redis_proc is not None:
            stop_private_redis(redis_proc)


@pytest.mark.slow  # a second or more: the full suite's (the fast lane stays under a minute)
def test_a_worker_stopping_while_redis_refuses_writes_lets_go_of_its_metrics_port(own_redis, tiny_chat_model):
    """A stop while Redis refuses writes (a primary demoted by a failover, a full Redis): a refused delete on the
    way out raised out of the worker, its engine and metrics server left running and the port held, so a worker
    started again in that process could not serve its metrics."""
    url, conn = own_redis
    port = free_port()
    worker = ThreadWorker(url, tiny_chat_model, metrics_port=port)
    assert Client(url, queue=worker.queue).submit("hi", max_tokens=2).result(timeout=60)["text"] is not None
    conn.replicaof("127.0.0.1", free_port())  # a replica now, of a primary that is not there: writes refused
    worker.stop()
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))  # free


@pytest.mark.slow
def test_a_batch_rides_out_a_redis_restart_and_writes_every_row_once(tiny_chat_model, tmp_path):
    """A Redis restart mid-run (its data kept, AOF on: a failover or an upgrade) ended a long batch at once. The run
    waits for Redis, goes on where it was, and its output holds every row once."""
    import threading

    from producer.batch import run_batch

    port = steady_port()  # (stopped and started again on it)
    url = f"redis://127.0.0.1:{port}/0"
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
               "--appendfsync", "always", "--dir", str(tmp_path)]  # fmt: skip

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if serves(proc, port, timeout=10):  # (its own: not another's on the port)
            return proc
        proc.kill()
        raise RuntimeError("redis-server did not start")

    redis_proc = start()
    worker = ThreadWorker(url, tiny_chat_model)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"custom_id": f"row-{i}", "prompt": f"Story {i}:", "max_tokens": 48, "ignore_eos": True} for i in range(40)]
    src.write_text("".join(json.dumps(row) + "\n" for row in rows))
    got: dict = {}
    run = threading.Thread(target=lambda: got.update(run_batch(Client(url, queue=worker.queue), src, out,
                                                               max_in_flight=8, poll_interval=0.05)))  # fmt: skip
    try:
        run.start()
        deadline = time.monotonic() + 60
        while not (out.exists() and out.read_text().count("\n") >= 4) and time.monotonic() < deadline:
            time.sleep(0.05)
        stop_private_redis(redis_proc)  # (its AOF written: nothing lost)
        time.sleep(3)
        redis_proc = start()
        run.join(timeout=180)
        assert not run.is_alive(), "the run never ended"
    finally:
        worker.stop()
        stop_private_redis(redis_proc)
    assert got["succeeded"] == 40 and got["failed"] == 0
    written = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
    assert sorted(written) == sorted(row["custom_id"] for row in rows)  # each once


@pytest.mark.slow  # a second or more: the full suite's (the fast lane stays under a minute)
def test_a_client_whose_acl_user_has_no_channels_waits_on_the_stream_instead():
    """Redis 7 gives a new ACL user no channel rights by default: ``result()`` subscribed to the job's channel and
    raised NoPermissionError at once, where the async client (which reads the stream) waited. It waits now."""
    import threading

    from producer import JobCanceled

    url, proc = start_private_redis()
    if proc is None:
        no_redis_server("could not start redis-server")
    try:
        admin = Redis.from_url(url)
        admin.execute_command("ACL", "SETUSER", "app", "on", ">pw", "~*", "+@all", "resetchannels")
        job = Client(url.replace("redis://", "redis://app:pw@"), queue="nobody").submit("hi")
        with pytest.raises(TimeoutError):
            job.result(timeout=0.5)
        threading.Timer(0.3, lambda: admin.hset(f"rq:job:{job.id}", "status", "canceled")).start()
        started = time.monotonic()
        with pytest.raises(JobCanceled):
            job.result(timeout=5)
        assert time.monotonic() - started < 3
        # Nor blocking reads (-@blocking): each look went on at once, thousands of round trips a second.
        admin.execute_command("ACL", "SETUSER", "app", "-@blocking")
        job = Client(url.replace("redis://", "redis://app:pw@"), queue="nobody").submit("hi")
        admin.config_resetstat()
        with pytest.raises(TimeoutError):
            job.result(timeout=1)
        assert admin.info("commandstats")["cmdstat_hget"]["calls"] <= 5
        threading.Timer(0.3, lambda: admin.hset(f"rq:job:{job.id}", "status", "canceled")).start()
        started = time.monotonic()
        with pytest.raises(JobCanceled):
            job.result(timeout=5)
        assert time.monotonic() - started < 3
    finally:
        stop_private_redis(proc)


@pytest.mark.slow  # a second or so: the full suite's
def test_a_client_whose_acl_user_has_no_blocking_reads_follows_a_stream_by_looking():
    """Redis refuses XREAD to a user without @blocking (non-blocking too): result() waited by looking, but stream()
    and the async client's events raised NoPermissionError, after the job was submitted. Both look now."""
    import asyncio

    from producer import AsyncClient
    from producer.protocol import STREAM_FIELD, make_event, stream_key

    url, proc = start_private_redis()
    if proc is None:
        no_redis_server("could not start redis-server")
    try:
        admin = Redis.from_url(url)
        admin.execute_command("ACL", "SETUSER", "app", "on", ">pw", "~*", "&*", "+@all", "-@blocking")
        app_url = url.replace("redis://", "redis://app:pw@")
        pieces = ["Hello", ",", " world"]

        def work(job_id: str) -> None:  # a worker's events, written by hand as the text comes
            admin.hset(f"rq:job:{job_id}", "status", "started")
            for n, text in enumerate(pieces):
                time.sleep(0.1)
                end = ("stop", {}) if n == len(pieces) - 1 else ()
                admin.xadd(stream_key(job_id), {STREAM_FIELD: json.dumps(make_event(n, text, [n], *end))})
            admin.hset(f"rq:job:{job_id}", "status", "finished")

        job = Client(app_url, queue="nobody").submit("hi")
        threading.Thread(target=work, args=(job.id,), daemon=True).start()
        assert "".join(job.stream(timeout=10)) == "Hello, world"

        async def follow() -> str:
            client = AsyncClient(app_url, queue="nobody")
            try:
                job = await client.submit("hi")
                threading.Thread(target=work, args=(job.id,), daemon=True).start()
                return "".join([piece async for piece in job.stream(timeout=10)])
            finally:
                await client.close()

        assert asyncio.run(follow()) == "Hello, world"
    finally:
        stop_private_redis(proc)


def test_a_redis_older_than_6_2_is_refused_at_the_start_not_failed_at_every_pull(tmp_path):
    """Ubuntu 22.04's Redis is 6.0: the worker loaded its model, said it served, and every pull failed (no
    BLMOVE), a traceback a second for good. ``serve --embedded`` started such a redis-server too."""
    from redis.exceptions import NoPermissionError

    from roseinfer.config import ConfigError
    from worker.local_redis import start_private_redis
    from worker.main import check_redis_version

    class Said:
        def __init__(self, version):
            self.version = version
            self.connection_pool = Redis().connection_pool

        def info(self, section):
            if self.version is None:
                raise NoPermissionError("this user has no permissions to run the 'info' command")
            return {"redis_version": self.version}

    with pytest.raises(ConfigError, match=r"is 6\.0\.16: the worker needs Redis 6\.2 or later"):
        check_redis_version(Said("6.0.16"))
    for fine in ("6.2.0", "7.0.15", "8.2.1", None):  # (None: INFO refused, the version not known)
        check_redis_version(Said(fine))
    old = tmp_path / "redis-server"
    old.write_text("#!/bin/sh\necho 'Redis server v=6.0.16 sha=00000000:0 malloc=jemalloc-5.2.1 bits=64'\n")
    old.chmod(0o755)
    assert start_private_redis(str(old))[1] is None  # (fakeredis serves instead)


def test_the_eviction_policy_is_read_where_config_is_refused_and_an_unknown_one_refuses_require(own_redis):
    """A managed Redis refuses CONFIG (ElastiCache's default policy: volatile-lru): the check said nothing and
    ``--require-noeviction`` let the worker start. INFO tells the policy; a Redis telling neither refuses the flag."""
    from producer.client import eviction_warning

    url, conn = own_redis
    conn.config_set("maxmemory-policy", "volatile-lru")
    conn.execute_command("ACL", "SETUSER", "noconfig", "on", ">pw", "~*", "&*", "+@all", "-config")
    limited = Redis.from_url(url.replace("redis://", "redis://noconfig:pw@"))
    assert "maxmemory-policy volatile-lru" in eviction_warning(limited)
    with pytest.raises(UnsafeRedis, match="volatile-lru"):
        check_eviction_policy(limited, required=True)
    conn.execute_command("ACL", "SETUSER", "noconfig", "-info")
    assert eviction_warning(limited) is None
    with pytest.raises(UnsafeRedis, match="cannot read Redis's maxmemory-policy"):
        check_eviction_policy(limited, required=True)
    check_eviction_policy(limited, required=False)  # (not asked: nothing to refuse)


@pytest.mark.slow
def test_a_redis_user_without_channels_gets_its_streams_and_cancels_and_says_so_once(
    own_redis, tiny_chat_model, caplog
):
    """A managed Redis's users get no channel by default: PUBLISH refused failed every round trip (its events, and
    its reads of cancels: a canceled job ran to its end), and RQ's command channel was retried every 2 s forever.
    The worker says so once and writes the streams alone, which followers read."""
    url, conn = own_redis
    conn.execute_command("ACL", "SETUSER", "nochan", "on", ">pw", "~*", "resetchannels", "+@all")
    limited = url.replace("redis://", "redis://nochan:pw@")
    with caplog.at_level(logging.WARNING):
        worker = ThreadWorker(limited, tiny_chat_model, max_num_seqs=4)
        try:
            client = Client(limited, queue=worker.queue)
            done = client.submit("Hello", max_tokens=6, temperature=0.0, ignore_eos=True)
            pieces = list(done.stream(timeout=60))
            assert "".join(pieces) == done.result(timeout=30)["text"] and len(pieces) >= 1
            long = client.submit("Go on", max_tokens=100_000, ignore_eos=True)
            deadline = time.monotonic() + 30
            while not conn.xlen(f"roseinfer:stream:{long.id}"):
                assert time.monotonic() < deadline, "no event of the long job"
                time.sleep(0.02)
            assert long.cancel()
            with pytest.raises(JobCanceled) as ended:  # its partial result kept
                long.result(timeout=30)
            assert ended.value.result["finish_reason"] == "abort" and ended.value.result["token_ids"]
        finally:
            worker.stop()
    said = caplog.text
    assert said.count("may not publish on roseinfer:tokens:*") == 1
    assert said.count("may not subscribe to RQ's command channel") == 1 and "Traceback" not in said


@pytest.mark.slow
def test_a_redis_user_that_may_not_block_says_so_once_and_still_takes_jobs(own_redis, tiny_chat_model, caplog):
    """A managed user without @blocking: an idle worker's BLMOVE was refused with a traceback every second, for good."""
    url, conn = own_redis
    conn.execute_command("ACL", "SETUSER", "noblock", "on", ">pw", "~*", "&*", "+@all", "-@blocking")
    limited = url.replace("redis://", "redis://noblock:pw@")
    with caplog.at_level(logging.WARNING):
        worker = ThreadWorker(limited, tiny_chat_model, max_num_seqs=4)
        try:
            time.sleep(1.5)  # idle: where it would block
            job = Client(limited, queue=worker.queue).submit("Hi", max_tokens=3, ignore_eos=True)
            assert job.result(timeout=30)["usage"]["completion_tokens"] == 3
        finally:
            worker.stop()
    assert caplog.text.count("may not wait on a queue") == 1 and "Traceback" not in caplog.text


@pytest.mark.slow
def test_a_redis_user_that_may_load_scripts_but_not_run_them_takes_jobs(own_redis, tiny_chat_model, caplog):
    """An ACL of -evalsha that leaves SCRIPT: the probe loaded a script and took the Lua path, and the worker, listed
    as serving, took no job (every pull, beat and write refused, three tracebacks a second) for good."""
    url, conn = own_redis
    conn.execute_command("ACL", "SETUSER", "noeval", "on", ">pw", "~*", "&*", "+@all", "-eval", "-evalsha",
                         "-eval_ro", "-evalsha_ro", "-fcall", "-fcall_ro")  # fmt: skip
    limited = url.replace("redis://", "redis://noeval:pw@")
    with caplog.at_level(logging.WARNING):
        worker = ThreadWorker(limited, tiny_chat_model, max_num_seqs=4)
        try:
            job = Client(limited, queue=worker.queue).submit("Hi", max_tokens=3, ignore_eos=True)
            assert job.result(timeout=30)["usage"]["completion_tokens"] == 3
            assert not worker.worker.sender.runs_scripts
        finally:
            worker.stop()
    assert "Traceback" not in caplog.text


def test_a_tls_certificate_not_trusted_here_is_one_error_not_a_wait_for_good():
    """The worker took CERTIFICATE_VERIFY_FAILED for a Redis still starting, and waited on it for good."""
    import redis as redis_py

    from producer.connection import InvalidRedisURL
    from worker.main import wait_for_redis

    class Untrusted(Redis):
        def ping(self, **kwargs):
            raise redis_py.exceptions.ConnectionError(
                "Error 1 connecting to cache.example:6380. [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"
            )

    with pytest.raises(InvalidRedisURL, match="ssl_ca_certs"):
        wait_for_redis(Untrusted(host="cache.example", port=6380))


def test_what_a_redis_that_answers_refuses_is_said_before_the_model_loads(own_redis, monkeypatch):
    """A wrong login, an eviction policy --require-noeviction refuses, a certificate not trusted: each was said only
    after the model had loaded (minutes of a GPU's time), though Redis had answered from the start."""
    import redis as redis_py

    import worker.main as worker_main
    from producer.connection import InvalidRedisURL
    from worker.settings import WorkerSettings

    url, conn = own_redis
    monkeypatch.setattr(worker_main, "build_engine", lambda *a, **k: pytest.fail("the model loaded"))
    conn.execute_command("ACL", "SETUSER", "someone", "on", ">right", "~*", "&*", "+@all")
    wrong = WorkerSettings(redis_url=url.replace("redis://", "redis://someone:wrong@"), queue="q", model="m")
    with pytest.raises(redis_py.exceptions.AuthenticationError):
        worker_main.build_worker(wrong)
    conn.config_set("maxmemory-policy", "allkeys-lru")
    with pytest.raises(UnsafeRedis, match="allkeys-lru"):
        worker_main.build_worker(WorkerSettings(redis_url=url, queue="q", model="m", require_noeviction=True))

    class Untrusted(Redis):
        def ping(self, **kwargs):
            raise redis_py.exceptions.ConnectionError("Error 1 connecting. [SSL: CERTIFICATE_VERIFY_FAILED] failed")

    settings = WorkerSettings(redis_url=url, queue="q", model="m")
    with pytest.raises(InvalidRedisURL, match="ssl_ca_certs"):
        worker_main.build_worker(settings, Untrusted(host="cache.example", port=6380))


def test_the_cli_says_a_refused_login_and_a_full_redis_as_such(own_redis, capsys, monkeypatch):
    """A missing or wrong password read "cannot reach Redis (HELLO must be called ...)" or "(invalid
    username-password ...)"; a full Redis "Redis refused (OutOfMemoryError ...); check --redis-url". ``serve``
    served on with a warning that Redis did not answer, every request a 503, as if it might come back."""
    import producer.server as server
    from worker.cli import main

    url, conn = own_redis
    conn.execute_command("ACL", "SETUSER", "someone", "on", ">right", "~*", "&*", "+@all")
    monkeypatch.setattr(server._StoppingServer, "run", lambda self: pytest.fail("it served"))
    for command in (["status"], ["serve", "--port", "18999"]):
        assert main([*command, "--redis-url", url.replace("redis://", "redis://someone:wrong@")]) == 2
        err = capsys.readouterr().err
        assert "Redis refused the login" in err and "password" in err and "cannot reach" not in err, command
    conn.execute_command("ACL", "SETUSER", "default", "resetpass", ">secret")  # (this connection stays logged in)
    try:
        assert main(["status", "--redis-url", url]) == 2  # no password given: nothing was refused
        err = capsys.readouterr().err
        assert err.startswith("error: this Redis asks for a password and the URL gives none"), err
    finally:
        conn.execute_command("ACL", "SETUSER", "default", "nopass")
    conn.config_set("maxmemory", 1)  # (any write refused: full)
    try:
        assert main(["submit", "x", "--redis-url", url, "--queue", "full"]) == 75
        err = capsys.readouterr().err
        assert "Redis is full" in err and "check --redis-url" not in err
    finally:
        conn.config_set("maxmemory", 0)


def test_status_says_a_full_redis_is_full_and_a_replica_read_only(own_redis, capsys):
    """While Redis refused writes for want of memory, or as a replica, ``roseinfer status`` said all was well: the
    workers' word on it is itself a write Redis refused."""
    from worker.cli import main

    url, conn = own_redis
    assert Client(url, queue="mem").status()["redis"] == "ok"
    conn.config_set("maxmemory", 1)
    try:
        assert Client(url, queue="mem").status()["redis"].startswith("full: ")
        assert main(["status", "--redis-url", url, "--queue", "mem"]) == 0
        assert "Redis is full: " in capsys.readouterr().out
    finally:
        conn.config_set("maxmemory", 0)
    # A replica (REPLICAOF by hand or a tool's, a failover gone wrong) refuses writes too: "ok", and no worker listed.
    port = free_port()
    conn.replicaof("127.0.0.1", port)
    try:
        assert Client(url, queue="mem").status()["redis"].startswith(f"read-only: a replica of 127.0.0.1:{port}")
        assert main(["status", "--redis-url", url, "--queue", "mem"]) == 0
        assert "Redis is read-only: " in capsys.readouterr().out
    finally:
        conn.replicaof("NO", "ONE")


def _redis_server(*args: str, ready: Path | None = None, port: int | None = None) -> subprocess.Popen:
    """A redis-server of its own with ``args``, once it answers (its socket there, or its port)."""
    proc = subprocess.Popen(["redis-server", "--save", "", "--appendonly", "no", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    if port is not None:  # (its own: a free port another process took first would answer as that one's server)
        if serves(proc, port, timeout=20):
            return proc
    else:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if Redis(unix_socket_path=str(ready)).ping():
                    return proc
            time.sleep(0.05)
    proc.kill()
    pytest.fail(f"redis-server {' '.join(args)} did not answer")


@pytest.mark.slow  # a worker of its own
def test_a_worker_serves_a_redis_on_a_unix_socket(tmp_path, tiny_chat_model):
    """The settings name unix:// URLs, and producers took them: the worker died at its first command (a TCP
    keepalive option a socket's connection does not take), a traceback."""
    sock = tmp_path / "r.sock"
    proc = _redis_server("--port", "0", "--unixsocket", str(sock), "--dir", str(tmp_path), ready=sock)
    try:
        url = f"unix://{sock}?db=3"
        worker = ThreadWorker(url, tiny_chat_model, max_num_seqs=2)
        try:
            job = Client(url, queue=worker.queue).submit("Hi", max_tokens=3, ignore_eos=True)
            assert job.result(timeout=60)["usage"]["completion_tokens"] == 3
            assert Redis(unix_socket_path=str(sock), db=3).exists(f"rq:job:{job.id}")
        finally:
            worker.stop()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_redis_cluster_is_refused_by_name_before_the_model_loads(tmp_path):
    """A cluster node: the worker loaded its model, then said MovedError or CROSSSLOT (a single-shard cluster let
    status pass and failed every submit). It names Redis Cluster now, before the model."""
    from roseinfer.config import ConfigError
    from worker.main import _address, build_worker
    from worker.settings import WorkerSettings

    port = free_port()
    # The bus port is its own: Redis's default (port + 10000) does not exist for a free port above 55535.
    proc = _redis_server("--port", str(port), "--cluster-enabled", "yes", "--cluster-port", str(steady_port()),
                         "--dir", str(tmp_path), "--cluster-config-file", str(tmp_path / "nodes.conf"),
                         port=port)  # fmt: skip
    try:
        settings = WorkerSettings(redis_url=f"redis://127.0.0.1:{port}/0", model=str(tmp_path / "no-model"))
        with pytest.raises(ConfigError, match="is a Redis Cluster node: roseinfer needs one Redis"):
            build_worker(settings)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    from producer.connection import connect

    # Log lines named a socket's or Sentinel's Redis "?:?".
    assert _address(connect(f"unix://{tmp_path}/r.sock")) == f"unix:{tmp_path}/r.sock"
    assert _address(connect("redis+sentinel://h:26379/svc")) == "the primary of Sentinel service 'svc'"


def test_a_certificate_for_another_host_is_told_from_one_not_trusted():
    """A certificate of a trusted CA for another name ("IP address mismatch") was told to give its CA, given."""
    from producer.connection import InvalidRedisURL, connect
    from worker.main import refuse_untrusted_certificate

    conn = connect("rediss://127.0.0.1:6380/0?ssl_ca_certs=/ca.pem")
    mismatch = "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: IP address mismatch, certificate is not"
    with pytest.raises(InvalidRedisURL, match=r"names another host .*ssl_check_hostname=false"):
        refuse_untrusted_certificate(conn, ConnectionError(mismatch))
    untrusted = "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate"
    with pytest.raises(InvalidRedisURL, match=r"is not trusted here .* give its CA"):
        refuse_untrusted_certificate(conn, ConnectionError(untrusted))
