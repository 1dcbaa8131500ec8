"""How long one job's stream stalls while other jobs' allowed success or failure callbacks run.

    python3 benchmarks/callback_stall.py [--model PATH] [--jobs 10] [--callback-s 0.2] [--repeats 2] [--end failure]

One streaming job of 400 tokens (engine steps of 10 ms at least) and ``--jobs`` short jobs each naming an allowed
callback that sleeps ``--callback-s``, on a worker in this process over a private redis-server: a success callback,
or (``--end failure``) a failure callback of a job refused for a field it should not hold. Prints the largest gap
between the streaming job's events, with and without the callbacks, interleaved.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from rq import Callback, Queue
from rq.serializers import JSONSerializer

from producer import Client
from worker.local_redis import start_private_redis, stop_private_redis
from worker.main import build_worker
from worker.settings import WorkerSettings

sys.path.insert(0, str(Path(__file__).parent))  # (the worker imports the callback by its name)
from worker_recovery import tiny_chat_model


def slow_callback(job, connection, *result_or_error) -> None:
    time.sleep(float(os.environ["CALLBACK_STALL_S"]))  # (imported by name apart from __main__: told by environment)


def largest_gap(url: str, model: str, jobs: int, callbacks: bool, end: str) -> float:
    queue = f"stall-{time.monotonic_ns()}"
    settings = WorkerSettings(
        redis_url=url, queue=queue, model=model, idle_wait=0.2, allow_callback=["callback_stall.slow_callback"]
    )
    worker = build_worker(settings)
    step = worker.engine.step
    worker.engine.step = lambda *a, **k: (time.sleep(0.01), step(*a, **k))[1]  # 400 steps: 4 s at least
    thread = threading.Thread(target=worker.work, kwargs={"logging_level": "WARNING"}, daemon=True)
    thread.start()
    try:
        client = Client(url, queue=queue)
        long = client.submit("stream me", max_tokens=400, ignore_eos=True)
        arrivals: list[float] = []
        follower = threading.Thread(target=lambda: [arrivals.append(time.monotonic()) for _ in long.stream(timeout=60)])
        follower.start()
        rq_queue = Queue(queue, connection=client.connection, serializer=JSONSerializer)
        for i in range(jobs):
            hook = {f"on_{end}": Callback("callback_stall.slow_callback")} if callbacks else {}
            refused = {"bogus": 1} if end == "failure" else {}  # (fails as it comes, its failure callback with it)
            rq_queue.enqueue("worker.jobs.generate", prompt=f"short {i}", max_tokens=4, **refused, **hook)
        follower.join()
        return max(b - a for a, b in itertools.pairwise(arrivals))
    finally:
        worker.request_stop()
        thread.join(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: a tiny random Llama with the default tokenizer")
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--callback-s", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--end", choices=["success", "failure"], default="success", help="the callback the jobs name")
    args = parser.parse_args()
    os.environ["CALLBACK_STALL_S"] = str(args.callback_s)
    model = args.model or tiny_chat_model()
    url, redis_proc = start_private_redis()
    if redis_proc is None:
        raise SystemExit("no redis-server could be started")
    try:
        gaps: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for callbacks in (False, True):
                gaps[callbacks].append(largest_gap(url, model, args.jobs, callbacks, args.end))
    finally:
        stop_private_redis(redis_proc)
    for callbacks, values in gaps.items():
        label = f"{args.jobs} jobs with a {args.callback_s:g} s {args.end} callback" if callbacks else "no callbacks"
        runs = ", ".join(f"{v:.3f}" for v in values)
        print(f"{label:>32}: largest gap {statistics.median(values):.3f} s (runs: {runs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
