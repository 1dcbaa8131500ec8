"""``roseinfer bench-redis``: what generated tokens cost Redis, through a real ``roseinfer worker`` and a private
``redis-server``.

Jobs are submitted while the queue is suspended (``rq suspend``), so submission and generation are counted apart;
then the statistics are reset, the queue resumed, and every job run to its end with one subscriber following the
first job's channel (``--follow all``: a pattern subscriber on every channel, so every event is published).
Printed per generated token: commands by command (``INFO commandstats``; commands run inside Lua scripts count
too), Redis CPU (``INFO cpu``), round trips, bytes in and out (``INFO stats``); and bytes a finished job keeps once
its stream has expired (``MEMORY USAGE`` of its hash and its result in RQ's result stream), and how many 30,000
tokens/s workers one Redis core would serve at that CPU cost.
"""

from __future__ import annotations

import argparse
import subprocess
import threading
import time
from typing import Any

from redis import Redis
from redis.exceptions import ResponseError

from producer import Client
from producer.protocol import channel_key, result_key
from roseinfer.bench import add_workload_arguments, load_prompts, resolve_model_arg
from roseinfer.config import engine_config_from_args, set_engine_defaults
from worker.bench_queue import _wait_for_worker
from worker.cli import engine_flags, worker_command
from worker.local_redis import start_private_redis, stop_private_redis

_WORKER_RATE = 30_000  # tokens/s of one GPU worker, the fleet figure the issue asks about


def _cpu_seconds(info: dict[str, Any]) -> float:
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def _follow(url: str, channel: str | None, stop: threading.Event, counter: list[int]) -> None:
    """One subscriber: on one job's channel (a client streaming its job), or on every job's (a dashboard)."""
    pubsub = Redis.from_url(url).pubsub(ignore_subscribe_messages=True)
    if channel is None:
        pubsub.psubscribe("roseinfer:tokens:*")
    else:
        pubsub.subscribe(channel)
    while not stop.is_set():
        if pubsub.get_message(timeout=0.2):
            counter[0] += 1
    pubsub.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    url, redis_proc = start_private_redis()
    if redis_proc is None:
        raise SystemExit("no redis-server could be started")
    conn = Redis.from_url(url)
    for name, value in args.redis_config:  # a deployment's settings, as README recommends them
        try:
            conn.config_set(name, value)
        except ResponseError as exc:
            stop_private_redis(redis_proc)
            raise SystemExit(f"--redis-config {name}={value}: redis-server refused it ({exc})") from None
    queue = "bench-redis"
    config = engine_config_from_args(args)
    cmd = worker_command(url, queue, config.model, *engine_flags(config))
    worker = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stop, messages = threading.Event(), [0]
    try:
        client = Client(url, queue=queue)
        _wait_for_worker(conn, queue, worker)
        convs = load_prompts(args)
        conn.set("rq:suspended", 1)  # what `rq suspend` does: nothing is pulled while the jobs go in
        time.sleep(1.5)  # the worker looks at the flag once a second
        jobs = client.submit_many(
            [{"messages": c, "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True} for c in convs]
        )
        channel = None if args.follow == "all" else channel_key(jobs[0].id)
        follower = threading.Thread(target=_follow, args=(url, channel, stop, messages), daemon=True)
        follower.start()
        time.sleep(0.5)
        conn.config_resetstat()
        cpu0 = _cpu_seconds(conn.info("cpu"))
        counted_from = time.time()  # (Redis's counters: reset just before)
        conn.delete("rq:suspended")
        results = [job.result(timeout=3600) for job in jobs]
        # Tokens/s from the first job's start: the worker reads the suspension once a second, and up to that second
        # of idle time was counted (0.4-0.95 s against a 0.1 s run of the tiny model). Redis's rates over the
        # window of its counters.
        ended = time.time()
        seconds = ended - min(r["timings"]["started_at"] for r in results)
        counted = ended - counted_from
        cpu = _cpu_seconds(conn.info("cpu")) - cpu0
        stats_by_command = conn.info("commandstats")
        commands = {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats_by_command.items()}
        usec = {k.removeprefix("cmdstat_"): v["usec"] for k, v in stats_by_command.items()}
        stats = conn.info("stats")
        tokens = sum(r["usage"]["completion_tokens"] for r in results)
        kept_by_key = {"job hash": 0, "result": 0}
        for job in jobs:
            for what, key in zip(kept_by_key, (f"rq:job:{job.id}", result_key(job.id))):
                kept_by_key[what] += conn.memory_usage(key, samples=0) or 0
        kept = sum(kept_by_key.values())
    finally:
        stop.set()
        worker.terminate()
        worker.wait(timeout=120)
        stop_private_redis(redis_proc)
    us_per_token = cpu / tokens * 1e6
    return {
        "follower": "every channel (PSUBSCRIBE)" if args.follow == "all" else "one job's channel",
        "jobs": len(jobs),
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "commands_per_token": round(sum(commands.values()) / tokens, 3),
        "commands_by_command_per_token": {k: round(v / tokens, 4) for k, v in sorted(commands.items())},
        "redis_cpu_us_per_token": round(us_per_token, 2),
        # Inside a script a command counts both on its own and in the script's time (evalsha).
        "command_us_per_token_by_command": {k: round(v / tokens, 3) for k, v in sorted(usec.items()) if v},
        # A read event is a client's round trip (a pipeline or a script call); a write, replies or pushed messages.
        "round_trips_per_s": round(stats["total_reads_processed"] / counted, 1),
        "writes_per_s": round(stats["total_writes_processed"] / counted, 1),
        "bytes_in_per_token": round(stats["total_net_input_bytes"] / tokens, 1),
        "bytes_out_per_token": round(stats["total_net_output_bytes"] / tokens, 1),
        "bytes_kept_per_token_after_stream_expiry": round(kept / tokens, 1),
        "bytes_kept_per_token_by_key": {k: round(v / tokens, 1) for k, v in kept_by_key.items()},
        "pubsub_messages_received": messages[0],
        "workers_of_30k_tokens_per_s_per_redis_core": round(1e6 / us_per_token / _WORKER_RATE, 1),
    }


def _setting(text: str) -> tuple[str, str]:
    name, eq, value = text.partition("=")
    if not (name and eq):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name, value


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p, sampling=False)
    p.add_argument(
        "--follow", choices=("one", "all"), default="one",
        help="the one subscriber follows one job's channel (a client), or every job's with a pattern (a dashboard: "
        "every event is then published)",
    )  # fmt: skip
    p.add_argument(
        "--redis-config", action="append", default=[], metavar="NAME=VALUE", type=_setting,
        help="a setting of the private redis-server (CONFIG SET), e.g. stream-node-max-bytes=1024; repeatable",
    )  # fmt: skip
    set_engine_defaults(p, model="tiny", num_prompts=128, max_tokens=512)


def main(args: argparse.Namespace) -> int:
    resolve_model_arg(args)
    figures = run(args)
    width = max(len(k) for k in figures)
    for key, value in figures.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for name, per_token in sorted(value.items(), key=lambda kv: -kv[1]):
                print(f"    {name:<16} {per_token}")
        else:
            print(f"{key:<{width}} {value}")
    return 0
