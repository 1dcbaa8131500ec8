"""``roseinfer bench-priority``: an interactive job's TTFT on a worker saturated by bulk jobs, submitted at the
interactive priority (0) and at the bulk one (10), through a private redis-server and a ``roseinfer worker``
process. Repeats are interleaved and medians printed; the bulk jobs' greedy outputs are compared between the two
runs (the preemptions a priority job causes must not change them)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time

from producer.protocol import BULK_PRIORITY
from roseinfer.bench import counting
from roseinfer.config import DTYPES
from worker.bench_queue import _wait_for_worker
from worker.cli import worker_command
from worker.local_redis import start_private_redis, stop_private_redis


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32", choices=DTYPES)  # (refused here, not by the worker it starts)
    p.add_argument("--max-num-seqs", type=counting(1), default=8)
    p.add_argument(
        "--bulk-jobs", type=counting(1), default=None, help="bulk jobs in the queue (default: three times the batch)"
    )
    p.add_argument("--bulk-tokens", type=counting(1), default=96)
    p.add_argument("--probe-tokens", type=counting(1), default=8)
    p.add_argument("--repeats", type=counting(1), default=3)


def _probe(client, args, priority: int, round_: int) -> tuple[float, list[list[int]]]:
    """Bulk jobs, then (once they run) one probe job at ``priority``: the probe's TTFT and the bulk outputs."""
    bulk = client.submit_many(
        [
            {
                "prompt": f"Write a long essay, part {i}.",
                "max_tokens": args.bulk_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "priority": BULK_PRIORITY,
            }
            for i in range(args.bulk_jobs)
        ]
    )
    deadline = time.time() + 300
    while client.status()["in_flight"] < args.max_num_seqs and time.time() < deadline:
        time.sleep(0.05)  # the worker is saturated
    time.sleep(0.5)
    probe = client.submit(
        f"Say hello, round {round_}.", max_tokens=args.probe_tokens, temperature=0.0, priority=priority
    )
    ttft = probe.result(timeout=600)["timings"]["ttft_s"]
    outputs = [job.result(timeout=600)["token_ids"] for job in bulk]
    return ttft, outputs


def main(args: argparse.Namespace) -> int:
    from producer import Client

    if args.bulk_jobs is None:  # (the queue stays longer than the batch: a probe waits behind bulk jobs)
        args.bulk_jobs = 3 * args.max_num_seqs

    url, redis_proc = start_private_redis()
    if redis_proc is None:
        raise SystemExit("bench-priority needs redis-server")
    queue = "bench-priority"
    flags = ["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs)]
    log = tempfile.NamedTemporaryFile(prefix="roseinfer-bench-worker-", suffix=".log")  # noqa: SIM115 (closed below)
    worker = subprocess.Popen(worker_command(url, queue, args.model, *flags), stderr=log)
    try:
        client = Client(url, queue=queue)
        _wait_for_worker(client.connection, queue, worker, log=log)
        client.submit("warm up", max_tokens=4).result(timeout=300)
        ttfts: dict[str, list[float]] = {"interactive": [], "bulk": []}
        outputs: dict[str, list] = {}
        for r in range(args.repeats):
            for name, priority in (("interactive", 0), ("bulk", BULK_PRIORITY)):
                ttft, outs = _probe(client, args, priority, r)
                ttfts[name].append(ttft)
                outputs.setdefault(name, outs)
        interactive, bulk = statistics.median(ttfts["interactive"]), statistics.median(ttfts["bulk"])
        print(
            json.dumps(
                {
                    "model": args.model,
                    "dtype": args.dtype,
                    "max_num_seqs": args.max_num_seqs,
                    "bulk_jobs": args.bulk_jobs,
                    "bulk_tokens": args.bulk_tokens,
                    "ttft_interactive_s": round(interactive, 3),
                    "ttft_at_bulk_priority_s": round(bulk, 3),
                    "ratio": round(interactive / bulk, 3),
                    "ttft_interactive_runs_s": [round(t, 3) for t in ttfts["interactive"]],
                    "ttft_at_bulk_priority_runs_s": [round(t, 3) for t in ttfts["bulk"]],
                    "bulk_outputs_unchanged": outputs["interactive"] == outputs["bulk"],
                }
            )
        )
    finally:
        worker.terminate()
        worker.wait(timeout=60)
        log.close()
        stop_private_redis(redis_proc)
    return 0
