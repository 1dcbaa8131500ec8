"""Where a burst's time goes inside a real ``roseinfer worker``: its steps, pulls and sends, timed in the worker.

The worker runs as a child process with its step (``Pump.step``), its pulls (``Puller._pull_once``, and the
reading of what a pull took, ``Puller.read``), its prompt tokenizing (``LLMEngine.tokenize_many``) and its sends
(``Sender._send_until_done``) timed; a private redis-server carries the jobs. After the warm-up jobs bench-queue
gives a worker, every job is submitted at once, as ``roseinfer bench-queue`` does, and the parent prints, from the
first submit: when the pulls and reads ran, the first steps, when the last job was admitted, and the steps' count,
median and sum. It is the tool that showed where the tiny model's through-Redis time went (README, "Queue benchmark").

    python3 benchmarks/worker_timeline.py --model tiny --jobs 256 --tokens 128 --max-num-seqs 256
"""

from __future__ import annotations

import argparse
import atexit
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def serve(out: str, argv: list[str]) -> int:
    """The child: a worker whose steps, pulls, reads, tokenizing and sends are timed, written to ``out`` at exit."""
    from roseinfer import llm_engine
    from worker import batch_worker, puller, pump, sender
    from worker.cli import main

    spans: list[tuple[str, float, float, int | None, str]] = []

    def timed(cls, name: str, size=None) -> None:
        inner = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            t0 = time.time()
            result = inner(self, *args, **kwargs)
            n = size(self, args, result) if size else None
            spans.append((f"{cls.__name__}.{name}", t0, time.time(), n, threading.current_thread().name))
            return result

        setattr(cls, name, wrapper)

    timed(pump.Pump, "step", lambda s, a, r: len(s.engine.running_request_ids()))  # running after the step
    timed(puller.Puller, "_pull_once")
    timed(puller.Puller, "read", lambda s, a, r: len(r))
    timed(llm_engine.LLMEngine, "tokenize_many", lambda s, a, r: len(r))
    timed(sender.Sender, "_send_until_done")
    timed(batch_worker.BatchWorker, "_succeed", lambda s, a, r: len(a[0]))  # the results of jobs a step ended
    atexit.register(lambda: Path(out).write_text(json.dumps(spans)))
    return main(argv)


def report(spans: list, t0: float, submitted: float, results: list[dict]) -> None:
    spans = sorted((s for s in spans if s[2] >= t0), key=lambda s: s[1])
    ms = lambda t: (t - t0) * 1e3  # noqa: E731
    end = max(r["timings"]["finished_at"] for r in results)
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    ttft = sorted(r["timings"]["ttft_s"] for r in results)
    print(f"submit done at {ms(submitted):.1f} ms; last result at {ms(end):.1f} ms; {tokens / (end - t0):.0f} tok/s")
    print(f"TTFT p50 {ttft[len(ttft) // 2] * 1e3:.0f} ms, max {ttft[-1] * 1e3:.0f} ms")
    steps = [s for s in spans if s[0] == "Pump.step"]
    working = [s for s in steps if s[3]]
    print("\nfrom the first submit (ms)   took (ms)  what                          n (a span that began before the")
    print("                                             burst, as a blocking pull, starts below zero)")
    shown = 0
    for name, a, b, n, thread in spans:
        if name == "Pump.step" and not n:
            continue  # the loop waiting for prompts to be tokenized
        if shown < 40:
            print(f"{ms(a):>26.1f} {(b - a) * 1e3:>10.2f}  {name:<29} {n if n is not None else ''} ({thread})")
        shown += 1
    full = max((s[3] for s in working), default=0)
    everyone = next((s for s in working if s[3] == full), None)
    if working:
        took = [(b - a) * 1e3 for _, a, b, _, _ in working]
        print(
            f"\n{len(working)} steps with work: first at {ms(working[0][1]):.1f} ms, all {full} running after the "
            f"step at {ms(everyone[1]):.1f} ms; median {statistics.median(took):.2f} ms, sum {sum(took):.0f} ms"
        )
    sends = [(b - a) * 1e3 for name, a, b, _, _ in spans if name == "Sender._send_until_done"]
    if sends:
        print(f"{len(sends)} sends, {sum(sends):.0f} ms in all")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--jobs", type=int, default=256)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--serve", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # the child: OUT, then worker argv
    args = p.parse_args()
    if args.serve:
        return serve(args.serve[0], args.serve[1:])

    from producer import Client
    from roseinfer.bench import load_prompts, resolve_model_arg
    from worker.bench_queue import WARM_UP_TOKENS, _chat_jobs, _wait_for_worker, warm_up_convs
    from worker.local_redis import start_private_redis

    resolve_model_arg(args)
    url, redis_proc = start_private_redis()
    if redis_proc is None:
        raise SystemExit("no redis-server could be started")
    out = Path(tempfile.mkdtemp(prefix="roseinfer-timeline-")) / "spans.json"
    worker_argv = ["worker", "--redis-url", url, "--queue", "timeline", "--model", args.model]
    worker_argv += ["--max-num-seqs", str(args.max_num_seqs), "--dtype", args.dtype]
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(out), *worker_argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = Client(url, queue="timeline")
        _wait_for_worker(client.connection, "timeline", proc)
        convs = load_prompts(argparse.Namespace(num_prompts=args.jobs, prompts=None, input_len=0))
        # The warm-up bench-queue gives its workers: the engine's first-use costs paid before the clock.
        for job in client.submit_many(_chat_jobs(warm_up_convs(convs, args.jobs), WARM_UP_TOKENS)):
            job.result(timeout=300)
        t0 = time.time()
        jobs = client.submit_many(_chat_jobs(convs, args.tokens))
        submitted = time.time()
        results = [job.result(timeout=600) for job in jobs]
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        redis_proc.terminate()
    report(json.loads(out.read_text()), t0, submitted, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
