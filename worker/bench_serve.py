"""``roseinfer bench-serve``: what the OpenAI-compatible server costs. The same jobs (chat prompts of the bench
workload, greedy, EOS ignored) go to one ``roseinfer worker`` process through a private redis-server, either
submitted directly (``Client.submit_many``, results awaited) or as concurrent streamed requests to a
``roseinfer serve`` process (server-sent events read with httpx). Repeats are interleaved; medians of tokens/s and
the streamed requests' TTFT (to the first text chunk) p50/p99 are printed."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from roseinfer.bench import DEFAULT_WORKLOAD, counting, percentile
from roseinfer.config import DTYPES
from worker.bench_queue import _wait_for_worker, last_result_written
from worker.cli import worker_command
from worker.local_redis import free_port, start_private_redis, stop_private_redis


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32", choices=DTYPES)  # (refused here, not by the worker it starts)
    p.add_argument("--num-prompts", type=counting(1), default=64)
    p.add_argument("--max-tokens", type=counting(1), default=64)
    p.add_argument("--repeats", type=counting(1), default=3)
    p.add_argument(
        "--num-threads",
        type=counting(1),
        default=max(1, (os.cpu_count() or 2) - 1),
        help="the worker's math threads (default: all cores but one, which the server, Redis and the client share, "
        "as on a GPU machine where they do not compete with the model)",
    )


def _messages(args: argparse.Namespace, round_: int) -> list[list[dict]]:
    prompts = json.loads(DEFAULT_WORKLOAD.read_text())
    # A round tag keeps the prefix cache from serving one round what the last one computed.
    return [[{"role": "user", "content": f"[{round_}] {prompts[i % len(prompts)]}"}] for i in range(args.num_prompts)]


def _direct(client, args, round_: int) -> tuple[float, list[float]]:
    start = time.time()
    jobs = client.submit_many(
        [
            {"messages": m, "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
            for m in _messages(args, round_)
        ]
    )
    results = [job.result(timeout=600) for job in jobs]
    # The last result's write, not when this loop read it (result() polls).
    seconds = last_result_written(client, jobs) - start
    rate = sum(r["usage"]["completion_tokens"] for r in results) / seconds
    return rate, [r["timings"]["first_token_at"] - start for r in results]


async def _served(url: str, model: str, args, round_: int) -> tuple[float, list[float]]:
    import httpx

    async def one(http: httpx.AsyncClient, messages) -> tuple[int, float]:
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent, ttft, tokens = time.perf_counter(), None, 0
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - sent
        return tokens, ttft if ttft is not None else float("nan")

    limits = httpx.Limits(max_connections=args.num_prompts + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()
        rows = await asyncio.gather(*(one(http, m) for m in _messages(args, round_)))
        seconds = time.perf_counter() - start
    return sum(t for t, _ in rows) / seconds, [ttft for _, ttft in rows]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(args: argparse.Namespace) -> int:
    import httpx

    from producer import Client

    url, redis_proc = start_private_redis()
    if redis_proc is None:
        raise SystemExit("bench-serve needs redis-server")
    queue, port = "bench-serve", free_port()
    flags = ["--dtype", args.dtype, "--num-threads", str(args.num_threads)]
    log = tempfile.NamedTemporaryFile(prefix="roseinfer-bench-worker-", suffix=".log")  # noqa: SIM115 (closed below)
    worker = subprocess.Popen(worker_command(url, queue, args.model, *flags), stderr=log)
    server = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "serve", "--redis-url", url, "--queue", queue, "--port", str(port)],
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        client = Client(url, queue=queue)
        _wait_for_worker(client.connection, queue, worker, log=log)
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise SystemExit("the server did not come up")
            time.sleep(0.2)
        model = httpx.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"]
        client.submit("warm up", max_tokens=4).result(timeout=300)
        direct, served, ttfts, direct_ttfts = [], [], [], []
        busy = {"direct": {}, "served": {}}  # CPU seconds per process, then cores kept busy, per mode
        procs = {"worker": worker.pid, "redis": redis_proc.pid, "server": server.pid}

        def measured(mode: str, run):
            before = {name: _cpu_seconds(pid) for name, pid in procs.items()}
            own0, wall0 = time.process_time(), time.perf_counter()
            out = run()
            wall = time.perf_counter() - wall0
            cores = {name: (_cpu_seconds(pid) - before[name]) / wall for name, pid in procs.items()}
            cores["client"] = (time.process_time() - own0) / wall
            for name, value in cores.items():
                busy[mode].setdefault(name, []).append(value)
            return out

        for r in range(args.repeats):
            rate, ttft = measured("direct", lambda r=r: _direct(client, args, 2 * r))
            direct.append(rate)
            direct_ttfts += ttft
            rate, ttft = measured("served", lambda r=r: asyncio.run(_served(base, model, args, 2 * r + 1)))
            served.append(rate)
            ttfts += ttft
        d, s = statistics.median(direct), statistics.median(served)
        print(
            json.dumps(
                {
                    "model": args.model,
                    "dtype": args.dtype,
                    "worker_threads": args.num_threads,
                    "requests": args.num_prompts,
                    "max_tokens": args.max_tokens,
                    "direct_tokens_per_s": round(d, 1),
                    "served_tokens_per_s": round(s, 1),
                    "server_keeps": round(s / d, 3),
                    "direct_ttft_p50_ms": round(percentile(direct_ttfts, 0.5) * 1e3, 1),
                    "served_ttft_p50_ms": round(percentile(ttfts, 0.5) * 1e3, 1),
                    "served_ttft_p99_ms": round(percentile(ttfts, 0.99) * 1e3, 1),
                    # Cores each process kept busy, medians over the runs of each mode (of the machine's).
                    "cores_busy": {
                        mode: {name: round(statistics.median(v), 2) for name, v in values.items()}
                        for mode, values in busy.items()
                    },
                    "direct_runs": [round(x, 1) for x in direct],
                    "served_runs": [round(x, 1) for x in served],
                }
            )
        )
    finally:
        for proc in (server, worker):
            proc.terminate()
            proc.wait(timeout=60)
        log.close()
        stop_private_redis(redis_proc)
    return 0
