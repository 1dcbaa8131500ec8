"""A long-lived worker under a long stream of mixed jobs: whether its memory levels off and every job ends as it should.

A real ``roseinfer worker`` (a child process, a private redis-server) serves waves of jobs of every kind a service
sends: greedy chats, sampled and seeded prompts with stop strings, n = 2, logprobs, JSON-schema outputs, token-id
prompts, prompts longer than the model takes (each must fail alone, as ``invalid_request``), jobs canceled just
after they are submitted, and a job hash written by hand with a payload that is not JSON (moved aside, its status
failed). After each wave it prints the worker's resident memory (its engine process's too, with
``--worker-flag=--engine-process``), Redis's, and how the wave's jobs ended; at the end, the memory's growth over
the second half of the run. It exits 1 if a job ended otherwise than its kind says (a job that should finish
failed, one that should fail finished) or never ended.

    python3 benchmarks/worker_soak.py --model tiny --waves 150 --jobs-per-wave 500
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUEUE = "soak"
_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def payload(i: int, rnd: random.Random) -> tuple[str, dict[str, Any]]:
    """Job ``i``'s kind and payload: every kind in a fixed share, in a seeded order."""
    k, tokens = rnd.random(), rnd.randint(1, 12)
    if k < 0.35:
        return "chat", {"messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": tokens, "temperature": 0}
    if k < 0.55:
        return "sampled", {"prompt": f"once upon a time {i}", "max_tokens": tokens, "temperature": 0.8, "stop": ["a"]}
    if k < 0.65:
        return "n=2", {"prompt": f"two of them {i}", "max_tokens": tokens, "n": 2, "temperature": 1.0}
    if k < 0.75:
        return "logprobs", {"prompt": f"how likely {i}", "max_tokens": tokens, "logprobs": True, "top_logprobs": 2}
    if k < 0.82:
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": _SCHEMA}}
        return "json", {"messages": [{"role": "user", "content": "json"}], "max_tokens": 24, "response_format": fmt}
    if k < 0.87:
        return "too long", {"prompt": "word " * 9000, "max_tokens": tokens}  # past SmolLM2-135M's 8,192 too
    if k < 0.92:
        return "seeded", {"prompt": f"seeded {i}", "seed": i, "temperature": 0.7, "min_tokens": 1, "max_tokens": tokens}
    ids = [5, 6, 7, 8, i % 100 + 1]
    return "token ids", {"prompt_token_ids": ids, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}


def _rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its children (an engine process), in MiB."""
    total, pids = 0, [pid]
    while pids:
        p = pids.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        total += int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])
        pids += [int(c) for c in children]
    return total / 1024


def _hand_written(connection, queue_key: str) -> str:
    """A job hash as another language might write it, with a payload that is not JSON: the worker moves it aside."""
    job_id = f"hand-{uuid.uuid4()}"
    connection.hset(f"rq:job:{job_id}", mapping={"data": b"{not json", "status": "queued", "origin": QUEUE,
                                                 "created_at": "2026-01-01T00:00:00.000000Z"})  # fmt: skip
    connection.rpush(queue_key, job_id)
    return job_id


def _status_within(connection, job_id: str, wanted: bytes, seconds: float) -> bytes | None:
    """The job's status once it is ``wanted``, or as it is after ``seconds``."""
    until = time.monotonic() + seconds
    while (status := connection.hget(f"rq:job:{job_id}", "status")) != wanted and time.monotonic() < until:
        time.sleep(0.05)
    return status


def _outcome(job, timeout: float) -> str:
    from producer.job_errors import JobCanceled, JobFailed

    try:
        result = job.result(timeout=timeout)
    except JobCanceled:
        return "canceled"
    except JobFailed as exc:
        return "invalid" if exc.error_type == "invalid_request" else f"failed: {exc.reason[:80]}"
    except TimeoutError:
        return "lost"
    return "canceled" if result.get("status") == "canceled" else "finished"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--waves", type=int, default=60)
    p.add_argument("--jobs-per-wave", type=int, default=500)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--worker-flag", action="append", default=[], help="passed on to the worker (repeat)")
    args = p.parse_args()
    if args.waves < 1 or args.jobs_per_wave < 1:
        p.error("--waves and --jobs-per-wave take 1 or more")

    from producer import Client
    from worker.cli import worker_command
    from worker.local_redis import start_private_redis, stop_private_redis

    url, redis_proc = start_private_redis()
    if redis_proc is None:
        sys.exit("needs redis-server on PATH")
    client = Client(url, queue=QUEUE, result_ttl=60)  # Redis holds the last minute's jobs, not the whole run's
    cmd = worker_command(url, QUEUE, args.model, "--max-num-seqs", str(args.max_num_seqs), "--result-ttl", "60",
                         "--stream-ttl-after-end", "60", *args.worker_flag)  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    log_path = Path(tempfile.mkdtemp(prefix="roseinfer-soak-")) / "worker.log"
    with log_path.open("wb") as log:
        worker = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    rnd, rows, wrong = random.Random(0), [], 0
    try:
        while not client.workers():
            if worker.poll() is not None:
                sys.exit(f"the worker exited ({worker.returncode}) before serving")
            time.sleep(0.5)
        print(f"{'wave':>4} {'jobs':>7} {'s':>5} {'worker MiB':>10} {'Redis MiB':>9}  outcomes")
        for wave in range(args.waves):
            began = time.time()
            kinds, payloads = zip(*(payload(wave * args.jobs_per_wave + i, rnd) for i in range(args.jobs_per_wave)))
            jobs = client.submit_many(payloads)
            canceled = set(range(0, len(jobs), 37))
            for i in canceled:
                jobs[i].cancel()
            hand = _hand_written(client.connection, client.queue.key)
            outcomes: dict[str, int] = {}
            for i, (kind, job) in enumerate(zip(kinds, jobs)):
                got = _outcome(job, timeout=300)
                outcomes[got] = outcomes.get(got, 0) + 1
                expected = {"invalid"} if kind == "too long" else {"finished"}
                if i in canceled:  # (a job canceled after it ended, or with its prompt refused, ends so)
                    expected |= {"canceled"}
                if got not in expected:
                    wrong += 1
                    print(f"  job {job.id} ({kind}{', canceled' if i in canceled else ''}) ended {got!r}")
            status = _status_within(client.connection, hand, b"failed", 10.0)  # (taken after the last job, maybe)
            if status != b"failed":
                wrong += 1
                print(f"  the hand-written job {hand} has status {status!r}, not failed")
            rss = _rss_mib(worker.pid)
            redis_mib = client.connection.info("memory")["used_memory"] / 2**20
            rows.append((wave, rss))
            shown = ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
            took, done = time.time() - began, (wave + 1) * len(jobs)
            print(f"{wave:>4} {done:>7} {took:>5.1f} {rss:>10.0f} {redis_mib:>9.1f}  {shown}", flush=True)
            if worker.poll() is not None:
                print(f"the worker exited ({worker.returncode})")
                return 1
    finally:
        worker.terminate()
        worker.wait(timeout=120)
        stop_private_redis(redis_proc)
    half = rows[len(rows) // 2]
    jobs_after = (rows[-1][0] - half[0]) * args.jobs_per_wave
    if jobs_after:
        growth = (rows[-1][1] - half[1]) / jobs_after * 10_000
        print(f"worker memory: {rows[0][1]:.0f} MiB after the first wave, {half[1]:.0f} at half-way, "
              f"{rows[-1][1]:.0f} at the end ({growth:+.1f} MiB per 10,000 jobs over the second half)")  # fmt: skip
    tracebacks = log_path.read_text(errors="replace").count("Traceback")
    print(f"jobs that ended otherwise than their kind says: {wrong}; tracebacks in the worker's log ({log_path}): "
          f"{tracebacks}")  # fmt: skip
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
