"""Redis Sentinel: ``redis+sentinel://`` URLs everywhere a Redis URL is taken, and a failover mid-run with real
``redis-server`` and sentinel processes on loopback ports."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
from conftest import ThreadWorker, no_redis_server, slow_engine_steps
from redis import Redis

from producer import Client
from producer.connection import InvalidRedisURL, SentinelURL, parse_sentinel_url
from producer.protocol import event_from_stream
from worker.local_redis import free_port, serves

OPTIONS = {"ssl_ca_certs": "/ca.pem", "ssl_cert_reqs": "none", "socket_timeout": 2.0, "ssl_check_hostname": False}


@pytest.mark.parametrize(
    "url, parsed",
    [
        ("redis://127.0.0.1:6379/0", None),
        ("redis+sentinel://h1:26379/mymaster", SentinelURL([("h1", 26379)], "mymaster")),
        (
            "redis+sentinel://:s%40cret@h1:26379,h2:26380/svc/3?sentinel_password=pw",
            SentinelURL([("h1", 26379), ("h2", 26380)], "svc", 3, None, "s@cret", False, "pw"),
        ),
        ("rediss+sentinel://user:pw@[::1]:26379/svc", SentinelURL([("::1", 26379)], "svc", 0, "user", "pw", True)),
        ("redis+sentinel://:pa/ss@h:26379/svc", SentinelURL([("h", 26379)], "svc", 0, None, "pa/ss")),  # (was ':pa')
        # The primary's options, as a plain URL's (they were dropped: a private CA could not be given)
        (
            "rediss+sentinel://h:26379/svc?ssl_ca_certs=/ca.pem&ssl_cert_reqs=none&socket_timeout=2&ssl_check_hostname=0",
            SentinelURL([("h", 26379)], "svc", 0, None, None, True, None, OPTIONS),
        ),
    ],
)
def test_sentinel_urls_are_read(url, parsed):
    assert parse_sentinel_url(url) == parsed


def test_a_sentinel_urls_options_reach_its_primarys_connections():
    from producer.connection import connect, connect_async

    url = "rediss+sentinel://h:26379/svc/2?ssl_ca_certs=/ca.pem&ssl_cert_reqs=none&socket_timeout=2"
    for client in (connect(url, socket_timeout=9), connect_async(url, socket_timeout=9)):
        kwargs = client.connection_pool.connection_kwargs
        shown = (kwargs["ssl_ca_certs"], kwargs["ssl_cert_reqs"], kwargs["socket_timeout"], kwargs["db"])
        assert shown == ("/ca.pem", "none", 2.0, 2)  # (the URL's own win over the caller's)


@pytest.mark.parametrize(
    ("url", "phrase"),
    [
        ("redis://127.0.0.1:6379/0?ssl_cert_reqs=none", "an option its connection does not take"),  # (not rediss)
        ("redis://:secret@127.0.0.1:6379/0?sslcertreqs=none", "does not take"),  # a typo
        ("redis+sentinel://:secret@h:26379/svc?ssl_cert_reqs=none", "for rediss\\+sentinel:// only"),
        ("redis+sentinel://h:26379/svc?socket_timout=2&password=secret", "does not take .*socket_timout"),
        ("redis+sentinel://h:26379/svc?timeout=5", "does not take .*timeout"),  # (a pool's, not a connection's)
    ],
)
def test_an_option_a_connection_cannot_take_is_refused_at_once_not_at_the_first_command(url, phrase):
    """A typo or a TLS option on a plain URL: redis-py passed it on, and the first command raised a TypeError
    traceback (status, worker, serve); a Sentinel URL dropped it without a word."""
    from producer.connection import connect, connect_async

    for make in (connect, connect_async):
        with pytest.raises(InvalidRedisURL, match=phrase) as info:
            make(url)
        assert "secret" not in str(info.value)


@pytest.mark.parametrize(
    "url, phrase",
    [
        ("redis+sentinel://h1/svc", "host:port"),
        ("redis+sentinel://:secret@h1:26379", "/service"),
        ("redis+sentinel://h1:26379/svc/notadb", "/service"),
    ],
)
def test_a_bad_sentinel_url_says_why_without_its_password(url, phrase):
    with pytest.raises(InvalidRedisURL, match=phrase) as info:
        parse_sentinel_url(url)
    assert "secret" not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "default:secret@myhost:6379/0",  # (no scheme: the whole URL was said)
        "redis://:Xy/secret@redis.example:6379/0",  # (a '/' in the password: its rest was said as the database)
        "redis://:secret@[::1/0",  # (a traceback)
        "redis+sentinel://:x/secret@h/svc",  # (the sentinel address said was the password's start)
        "redis://user:pa?secret@127.0.0.1:1/0",  # (a '?' in the password: read as the query's start)
    ],
)
def test_a_malformed_redis_url_is_one_error_that_never_says_its_password(url):
    from producer.connection import connect, connect_async, queue_urls

    for make in (connect, connect_async):
        with pytest.raises(InvalidRedisURL) as info:
            make(url)
        assert "secret" not in str(info.value) and "***@" in str(info.value)
    with pytest.raises(InvalidRedisURL) as info:  # (a ';' in a password split the list there)
        queue_urls("chat=redis://:top;secret@h:6379/0")
    assert "secret" not in str(info.value)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/abc", "rediss://:secret@h:6380/0x1"])
def test_a_database_that_is_not_a_number_is_refused_not_taken_for_0(url):
    """redis-py ignores a path it cannot read: ``roseinfer submit`` put its job in database 0, and said nothing."""
    from producer.connection import connect, connect_async

    for make in (connect, connect_async):
        with pytest.raises(InvalidRedisURL, match="is not a number") as info:
            make(url)
        assert "secret" not in str(info.value)
    assert connect("redis://127.0.0.1:6379/3").connection_pool.connection_kwargs["db"] == 3


class PortTaken(Exception):
    """A port picked as free was another process's by the time a server of the setup bound it."""


class SentinelSetup:
    """A primary and a replica (AOF on, fsync every second) and one sentinel watching them, on free ports."""

    def __init__(self, tmp_path) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.primary, self.replica, self.sentinel = free_port(), free_port(), free_port()
        for port, extra in ((self.primary, []), (self.replica, ["--replicaof", "127.0.0.1", str(self.primary)])):
            folder = tmp_path / f"redis-{port}"
            folder.mkdir()
            cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes"]
            self._start([*cmd, "--appendfsync", "everysec", "--dir", str(folder), *extra], port)
        conf = tmp_path / "sentinel.conf"
        conf.write_text(
            f"port {self.sentinel}\nbind 127.0.0.1\ndir {tmp_path}\n"
            f"sentinel monitor roseinfer 127.0.0.1 {self.primary} 1\n"
            "sentinel down-after-milliseconds roseinfer 2000\nsentinel failover-timeout roseinfer 10000\n"
        )
        self._start(["redis-server", str(conf), "--sentinel"], self.sentinel)
        self.url = f"redis+sentinel://127.0.0.1:{self.sentinel}/roseinfer"
        deadline = time.time() + 30
        while not self._replica_known():
            assert time.time() < deadline, "the sentinel never saw the replica"
            time.sleep(0.1)

    def _start(self, cmd: list[str], port: int) -> None:
        """Started and answering on ``port`` itself: a free port another process took first (a test on the other
        xdist worker) would have this setup fail over someone else's Redis."""
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        if not serves(proc, port, timeout=10):
            self.stop()
            raise PortTaken(port)

    def _replica_known(self) -> bool:
        try:
            s = Redis(port=self.sentinel)
            return (
                bool(s.sentinel_slaves("roseinfer"))
                and Redis(port=self.replica).info("replication")["master_link_status"] == "up"
            )
        except Exception:
            return False

    def primary_port(self) -> int:
        return int(Redis(port=self.sentinel).sentinel_get_master_addr_by_name("roseinfer")[1])

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # (a replica stopped while it syncs can take longer)
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def sentinel(tmp_path):
    if shutil.which("redis-server") is None:
        no_redis_server("redis-server is not installed")
    for attempt in range(3):
        try:
            setup = SentinelSetup(tmp_path / f"try-{attempt}")
            break
        except PortTaken:
            continue
    else:
        pytest.fail("three sets of free ports were each taken before the servers bound them")
    yield setup
    setup.stop()


@pytest.mark.slow
def test_a_sentinel_failover_mid_run_loses_no_job(sentinel, tiny_chat_model, monkeypatch):
    """Until Sentinel demotes the old primary, the worker keeps writing to it, and those writes are gone once it
    resyncs from the new one (README: what a failover loses). What must hold: no job is lost (a job whose end was
    lost is requeued by maintenance and resumed from its stream on the new primary), the worker serves on, and no
    stream repeats an event."""
    worker = ThreadWorker(
        sentinel.url,
        tiny_chat_model,
        max_num_seqs=4,
        event_interval_ms=0,
        heartbeat_interval=1,
        heartbeat_grace=2,
        maintenance_interval=1,
    )
    # Steps of 5 ms at least: 40 jobs of 200 tokens, 4 at a time, run for 10 s on any CPU (a fast one had ended them
    # all before the failover did)
    slow_engine_steps(monkeypatch, worker.worker.engine, 0.005)
    try:
        client = Client(sentinel.url, queue=worker.queue)
        jobs = client.submit_many(
            [{"prompt": f"Failover {i}", "max_tokens": 200, "ignore_eos": True, "temperature": 0.0} for i in range(40)]
        )
        while not any(job.status() == "finished" for job in jobs):
            time.sleep(0.02)
        before = sentinel.primary_port()
        Redis(port=sentinel.sentinel).execute_command("SENTINEL", "FAILOVER", "roseinfer")
        deadline = time.time() + 60
        while sentinel.primary_port() == before or Redis(port=before).info("replication")["role"] != "slave":
            assert time.time() < deadline, "no failover"
            time.sleep(0.1)
        unfinished = sum(job.status() != "finished" for job in jobs)
        primary = Redis(port=sentinel.replica)
        deadline = time.time() + 120
        while not all(primary.hget(f"rq:job:{job.id}", "status") == b"finished" for job in jobs):
            assert time.time() < deadline, "jobs lost in the failover"
            time.sleep(0.2)
        results = [job.result(timeout=10) for job in jobs]
    finally:
        worker.stop()
    assert sentinel.primary_port() == sentinel.replica
    assert unfinished >= 8, unfinished  # jobs ran across the failover
    for job, res in zip(jobs, results):
        assert res["usage"]["completion_tokens"] == 200
        ns = [event_from_stream(f)["n"] for _id, f in primary.xrange(f"roseinfer:stream:{job.id}")]
        assert ns == sorted(set(ns))  # in order and none twice


def test_each_queue_can_live_on_its_own_redis(monkeypatch):
    import argparse

    from producer.cli import target
    from producer.connection import queue_urls

    spec = "chat=redis+sentinel://s1:26379,s2:26379/chat ; bulk=redis://bulk:6379/1"
    assert queue_urls(spec) == {"chat": "redis+sentinel://s1:26379,s2:26379/chat", "bulk": "redis://bulk:6379/1"}
    monkeypatch.setenv("ROSEINFER_QUEUE_URLS", spec)
    monkeypatch.setenv("ROSEINFER_REDIS_URL", "redis://other:6379/0")
    ns = argparse.Namespace
    assert target(ns(redis_url=None, queue="bulk")) == ("redis://bulk:6379/1", "bulk")
    assert target(ns(redis_url=None, queue="misc")) == ("redis://other:6379/0", "misc")
    assert target(ns(redis_url="redis://flag:1/0", queue="bulk")) == ("redis://flag:1/0", "bulk")
    with pytest.raises(InvalidRedisURL, match="queue=URL"):
        queue_urls("chat:redis://a")
    # A worker sharing the producers' env file reads the map as they do (it served ROSEINFER_REDIS_URL's Redis).
    from worker.cli import build_parser, load_settings

    def worker_url(*argv: str) -> str:
        return load_settings(build_parser().parse_args(["worker", *argv])).redis_url

    assert worker_url("--queue", "bulk") == "redis://bulk:6379/1"
    assert worker_url("--queue", "misc") == "redis://other:6379/0"
    assert worker_url("--queue", "bulk", "--redis-url", "redis://flag:1/0") == "redis://flag:1/0"
    monkeypatch.setenv("ROSEINFER_QUEUE", "chat")
    assert worker_url() == "redis+sentinel://s1:26379,s2:26379/chat"


def test_a_queues_redis_that_refuses_the_worker_names_its_entry_in_the_map(monkeypatch, capsys, tmp_path):
    """The worker reads its queue's entry in the map too: a database its Redis lacks said "check --redis-url"."""
    from worker.cli import main
    from worker.local_redis import start_private_redis, stop_private_redis

    url, proc = start_private_redis()
    if proc is None:
        no_redis_server("could not start redis-server")
    try:
        monkeypatch.setenv("ROSEINFER_QUEUE_URLS", f"mapped={url.rsplit('/', 1)[0]}/99")
        assert main(["worker", "--queue", "mapped", "--model", str(tmp_path / "no-model")]) == 2
        err = capsys.readouterr().err
        assert "DB index is out of range" in err and err.endswith(
            "; check ROSEINFER_QUEUE_URLS (its entry for queue 'mapped')\n"
        )
    finally:
        stop_private_redis(proc)


def test_a_queues_redis_that_cannot_be_reached_names_its_entry_in_the_map(monkeypatch, capsys):
    """It said "check --redis-url or ROSEINFER_REDIS_URL", neither of which gave the URL."""
    from worker.cli import main

    monkeypatch.setenv("ROSEINFER_QUEUE_URLS", "mapped=redis://127.0.0.1:1/0")  # (nothing listens on 1)
    assert main(["status", "--queue", "mapped"]) == 2
    assert capsys.readouterr().err.endswith("; check ROSEINFER_QUEUE_URLS (its entry for queue 'mapped')\n")
    assert main(["status", "--queue", "mapped", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert capsys.readouterr().err.endswith("; check --redis-url or ROSEINFER_REDIS_URL\n")


@pytest.mark.slow
def test_a_bad_queue_url_map_is_one_line_and_exit_2():
    import os
    import sys

    env = {**os.environ, "ROSEINFER_QUEUE_URLS": "oops"}
    out = subprocess.run([sys.executable, "-m", "worker.cli", "status"], capture_output=True, text=True, env=env)
    assert out.returncode == 2 and out.stderr.strip().startswith("error: ROSEINFER_QUEUE_URLS takes queue=URL")
    assert "Traceback" not in out.stderr


@pytest.mark.slow  # seconds: the client's retries of a refused connection
def test_a_sentinel_that_does_not_answer_is_one_short_line(capsys):
    """Its "no master" error names every sentinel client it tried, pools and all: a line of 1.5 KB."""
    from worker.cli import main

    assert main(["submit", "hi", "--redis-url", "redis+sentinel://127.0.0.1:1/svc"]) == 2
    err = capsys.readouterr().err
    assert err == "error: cannot reach Redis (No master found for 'svc'); check --redis-url or ROSEINFER_REDIS_URL\n"
