"""``roseinfer worker`` and ``roseinfer demo``."""

from __future__ import annotations

import argparse
import sys

from worker.settings import WorkerSettings

_FLAGS = {  # flag -> type; unset flags fall back to ROSEINFER_* variables, then the defaults
    "redis_url": str,
    "queue": str,
    "name": str,
    "model": str,
    "dtype": str,
    "device": str,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "max_model_len": int,
    "block_size": int,
    "kv_cache_memory": str,
    "num_threads": int,
    "max_in_flight": int,
    "heartbeat_interval": int,
    "heartbeat_grace": int,
    "maintenance_interval": int,
}


def worker_command(redis_url: str, queue: str, model: str, *options: str) -> list[str]:
    """The argv of a ``roseinfer worker`` process (for benchmarks and tests that start one)."""
    return [
        sys.executable,
        "-m",
        "roseinfer.cli",
        "worker",
        "--redis-url",
        redis_url,
        "--queue",
        queue,
        "--model",
        model,
        *options,
    ]


def worker(args: argparse.Namespace) -> int:
    from worker.main import run_worker

    overrides = {name: getattr(args, name) for name in _FLAGS if getattr(args, name) is not None}
    if args.burst:
        overrides["burst"] = True
    return run_worker(WorkerSettings(**overrides), logging_level="DEBUG" if args.verbose else "INFO")


def demo(args: argparse.Namespace) -> int:
    from worker.demo import run_demo

    return run_demo(args.prompt, model=args.model, dtype=args.dtype, max_tokens=args.max_tokens)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="serve a Redis queue: many jobs at once in one engine")
    for name, kind in _FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    p.add_argument("--burst", action="store_true", help="quit when the queue is empty and all jobs are done")
    p.set_defaults(func=worker)

    p = sub.add_parser("demo", help="the whole flow on one machine: embedded Redis, a worker, jobs, live tokens")
    p.add_argument("prompt", nargs="*")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-tokens", type=int, default=64)
    p.set_defaults(func=demo)
