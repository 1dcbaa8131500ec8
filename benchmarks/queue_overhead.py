"""What the queue costs a worker whose engine runs elsewhere (a GPU): the worker's own Python and Redis work, alone.

A fake engine stands in for the model: each step runs ``--step-python-ms`` of Python (holding the interpreter lock,
as a GPU engine's scheduling, packing and output objects do), then sleeps ``--step-ms`` (the CPU and the interpreter
lock are free meanwhile, as while a GPU computes) and gives every running request one token ("word "); like the real
engine with output kind "delta", a step called with ``flush=False`` gives a request no output between its first and
its last.
The same jobs run twice, interleaved ``--repeats`` times:

- in-process: the fake engine stepped directly, every request added at once, outputs at the end only (what
  `roseinfer bench` does);
- through Redis: a real ``BatchWorker`` over the same fake engine in this process, fed by a producer process that
  submits every job at once to a private redis-server and waits for every result.

Printed: both times, their ratio (what the worker issue's "through Redis / in-process" is when the engine is not
the bottleneck), the first token's latency, and the CPU seconds each worker thread and redis-server spent per
thousand tokens. Unlike `roseinfer bench-queue --model tiny`, the engine's own math does not share the machine's
cores, so on a 2-core machine these figures move by a few percent, not by tens.

    python3 benchmarks/queue_overhead.py --jobs 256 --tokens 128 --step-ms 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from roseinfer.llm_engine import settle_garbage_collector
from roseinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput

PIECE = "word "


class SleepingEngine:
    """One token a step for every running request, after a sleep that stands for the device's step."""

    tokenizer = None  # nothing to copy for the worker's tokenizing thread

    def __init__(self, step_s: float, python_s: float = 0.0) -> None:
        self.step_s = step_s
        self.python_s = python_s
        self.requests: dict[str, dict] = {}
        # As the real engine leaves the collector: without it, a full collection (15-28 ms, the loaded modules
        # walked) fell inside one burst in five through Redis, and its first token came 15-20 ms later.
        settle_garbage_collector()

    def tokenize_many(self, prompts, tokenizer=None):
        return [(None, [1] * 16) for _ in prompts]

    def add_request(self, request_id, prompt, params=None, priority=0, output_prefix=None) -> None:
        self.requests[request_id] = {
            "max": params.max_tokens, "ids": [], "text": "", "t0": time.perf_counter(), "held": 0,
            "began": time.monotonic(),
        }  # fmt: skip

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def take_undelivered(self) -> list:
        return []  # its steps make their outputs at once

    def running_request_ids(self) -> list[str]:
        return list(self.requests)

    def running_since(self, request_id):
        return self.requests[request_id]["began"] if request_id in self.requests else None  # (each runs at once)

    def abort_request(self, request_id):
        req = self.requests.pop(request_id, None)
        return [] if req is None else [self._out(request_id, req, "abort")]

    def step(self, flush=True):
        deadline = time.perf_counter() + self.python_s
        while time.perf_counter() < deadline:  # the host's Python of a step: the interpreter lock held, a core busy
            pass
        time.sleep(self.step_s)
        outs = []
        for rid, req in list(self.requests.items()):
            req["ids"].append(len(req["ids"]) + 1)
            req["text"] += PIECE
            req["held"] += 1
            done = len(req["ids"]) >= req["max"]
            if done:
                del self.requests[rid]
            if done or flush or len(req["ids"]) == 1:
                outs.append(self._out(rid, req, "length" if done else None))
        return outs

    @staticmethod
    def _out(rid, req, reason):
        """What the request added since its last output (its whole output too, once it ended)."""
        now = time.perf_counter()
        held, req["held"] = req["held"], 0
        ids = req["ids"][len(req["ids"]) - held :]
        completion = CompletionOutput(0, req["text"], req["ids"], reason)
        metrics = RequestMetrics(req["t0"], now, now if reason else None)
        return RequestOutput(rid, None, [1] * 16, [completion], reason is not None, PIECE * held, ids, 0, metrics)


def run_in_process(jobs: int, tokens: int, step_s: float, python_s: float) -> float:
    from roseinfer import SamplingParams

    engine = SleepingEngine(step_s, python_s)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i in range(jobs):
        engine.add_request(f"r{i}", {"prompt_token_ids": [1] * 16}, params)
    while engine.has_unfinished_requests():
        engine.step(flush=False)
    return time.perf_counter() - start


_PRODUCER = """
import json, sys, time
from producer import Client
url, queue, jobs, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
client = Client(url, queue=queue)
payload = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": tokens, "temperature": 0.0}
start = time.time()
submitted = client.submit_many([payload] * jobs)
results = [job.result(timeout=600) for job in submitted]
from worker.bench_queue import last_result_written
print(json.dumps({"start": start, "end": last_result_written(client, submitted),
                  "ttft": sorted(r["timings"]["ttft_s"] for r in results),
                  "tokens": sum(r["usage"]["completion_tokens"] for r in results)}))
"""


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread of a process (Linux): by Python's thread name for this process's threads."""
    names = {t.native_id: t.name for t in threading.enumerate()} if pid == os.getpid() else {}
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(task.name), "other threads")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def run_through_redis(
    url: str,
    queue: str,
    jobs: int,
    tokens: int,
    step_s: float,
    python_s: float,
    redis_pid: int,
    engine_process: bool = False,
) -> dict:
    from worker.batch_worker import BatchWorker
    from worker.main import connect
    from worker.settings import WorkerSettings

    settings = WorkerSettings(redis_url=url, queue=queue, model="fake", max_num_seqs=jobs, idle_wait=0.2)
    if engine_process:  # the fake engine in a process of its own, as ``--engine-process`` runs a real one
        from worker.engine_process import EngineProcess

        make = partial(SleepingEngine, step_s, python_s)
        engine = EngineProcess(make, settings.event_interval_ms, settings.max_events_per_s)
        worker = BatchWorker(engine, settings, connect(url), engine)
    else:
        worker = BatchWorker(SleepingEngine(step_s, python_s), settings, connect(url))
    thread = threading.Thread(target=worker.work, kwargs={"logging_level": "WARNING"}, daemon=True)
    thread.start()
    time.sleep(1.0)  # registered, idle, blocking on the queue
    before, redis_before = _thread_cpu(os.getpid()), _thread_cpu(redis_pid)
    cmd = [sys.executable, "-c", _PRODUCER, url, queue, str(jobs), str(tokens)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    figures = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout)
    after, redis_after = _thread_cpu(os.getpid()), _thread_cpu(redis_pid)
    worker.request_stop()
    thread.join(timeout=60)
    cpu = {name: after[name] - before.get(name, 0.0) for name in after if after[name] - before.get(name, 0.0) > 0}
    cpu["redis-server"] = sum(redis_after.values()) - sum(redis_before.values())
    figures["cpu"] = cpu
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=256)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--step-ms", type=float, default=2.0, help="the fake device's step time")
    p.add_argument(
        "--step-python-ms", type=float, default=0.0, help="Python run before each step's sleep (the host's share)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engine-process", action="store_true", help="the fake engine in a process of its own")
    p.add_argument("--py-spy", metavar="FILE", help="record this process with py-spy during the last run (raw format)")
    args = p.parse_args()

    from worker.local_redis import start_private_redis, stop_private_redis

    url, redis_proc = start_private_redis()
    if redis_proc is None:
        raise SystemExit("no redis-server could be started")
    ratios, rows = [], []
    try:
        for rep in range(args.repeats):
            engine_s = run_in_process(args.jobs, args.tokens, args.step_ms / 1000, args.step_python_ms / 1000)
            spy = None
            if args.py_spy and rep == args.repeats - 1:
                spy = subprocess.Popen(
                    ["py-spy", "record", "--threads", "--nonblocking", "--rate", "250", "--format", "raw", "-o",
                     args.py_spy, "--pid", str(os.getpid())], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                time.sleep(1.0)
            got = run_through_redis(
                url,
                f"overhead-{rep}",
                args.jobs,
                args.tokens,
                args.step_ms / 1000,
                args.step_python_ms / 1000,
                redis_proc.pid,
                args.engine_process,
            )
            if spy is not None:
                spy.send_signal(2)
                spy.wait()
            queue_s = got["end"] - got["start"]
            ratios.append(engine_s / queue_s)
            ttft = got["ttft"][len(got["ttft"]) // 2]
            per_k = {k: round(v / got["tokens"] * 1000, 4) for k, v in sorted(got["cpu"].items())}
            rows.append(per_k)
            print(
                f"run {rep + 1}: in-process {engine_s:.2f} s, through Redis {queue_s:.2f} s "
                f"({ratios[-1]:.1%}); TTFT p50 {ttft * 1e3:.0f} ms; CPU s per 1,000 tokens {per_k}",
                flush=True,
            )
    finally:
        stop_private_redis(redis_proc)
    print(
        f"{args.jobs} jobs x {args.tokens} tokens, steps of {args.step_python_ms} ms of Python + {args.step_ms} ms "
        f"asleep: through Redis keeps "
        f"{statistics.median(ratios):.1%} of in-process (median of {args.repeats})"
    )


if __name__ == "__main__":
    main()
