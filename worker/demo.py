"""``roseinfer demo``: the whole flow on one machine with no Redis installed.

An embedded Redis (fakeredis' TCP server), a batching worker, a producer that submits a few chat prompts,
one job's tokens printed live as they stream, then every result.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

DEMO_PROMPTS = [
    "Write a haiku about a lighthouse.",
    "Explain in two sentences why the sky is blue.",
    "Give three tips for learning a new language.",
    "What is continuous batching in LLM inference?",
]


def run_demo(prompts: list[str], model: str | None, dtype: str | None, max_tokens: int) -> int:
    from producer import Client, JobError
    from roseinfer.config import ConfigError
    from worker.local_redis import embedded_connection, start_embedded_redis
    from worker.main import build_worker
    from worker.settings import WorkerSettings

    if any(not p.strip() for p in prompts):  # (generate and submit refuse it too)
        raise ConfigError("a prompt is empty: give text, or no prompt for the demo's own")
    given = {k: v for k, v in {"model": model, "dtype": dtype}.items() if v is not None}  # (else ROSEINFER_*)
    # (a bad setting said before the embedded Redis starts, not after; its URL is the embedded one, not the env's)
    WorkerSettings(redis_url="redis://127.0.0.1:6379/0", burst=True, **given)
    url = start_embedded_redis()
    print(f"embedded Redis at {url}", file=sys.stderr)
    settings = WorkerSettings(redis_url=url, burst=True, **given)
    worker = build_worker(settings, embedded_connection(url))
    client = Client(connection=embedded_connection(url), queue=settings.queue)  # (ROSEINFER_QUEUE's, if set)
    jobs = client.submit_many(
        [
            {"messages": [{"role": "user", "content": p}], "max_tokens": max_tokens, "temperature": 0.0}
            for p in prompts or DEMO_PROMPTS
        ]
    )
    print(f"submitted {len(jobs)} jobs to queue {client.queue.name!r}\n", file=sys.stderr)

    def consume() -> None:
        first = jobs[0]
        print(f"--- job {first.id}, streaming live ---")
        try:
            for piece in first.stream():
                sys.stdout.write(piece)
                sys.stdout.flush()
        except JobError as exc:  # (a prompt past the context, say: its line below says why)
            print(f"[{type(exc).__name__}]", end="")
        print("\n")
        for job in jobs:
            try:
                r = job.result()
            except JobError as exc:  # one job's end, said in its place: the others' results still come
                print(f"--- job {job.id}: {exc} ---\n")
                continue
            ttft = (r.get("timings") or {}).get("ttft_s")
            print(
                f"--- job {job.id}: {r['finish_reason']}, {r['usage']['completion_tokens']} tokens, "
                f"ttft {'-' if ttft is None else f'{ttft:.2f} s'} ---\n{r['text']}\n"
            )

    consumer = threading.Thread(target=consume, daemon=True)  # a worker that fails must not leave it waiting
    consumer.start()
    start = time.perf_counter()
    worker.work(burst=True, logging_level="WARNING")
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (the worker's: a Ctrl-C now only said "stop" again)
    st = client.status()
    if worker.stop_requested and st["finished"] + st["failed"] < len(jobs):  # (Ctrl-C: what it handed back, no
        print(f"\ninterrupted: {st['finished']} of {len(jobs)} jobs finished", file=sys.stderr)  # worker runs)
        return 130
    consumer.join()
    st = client.status()
    print(f"{st['finished']} finished, {st['failed']} failed in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0 if st["finished"] == len(jobs) else 1  # a demo that failed a job says so to the shell too
