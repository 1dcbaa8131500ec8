"""Where a burst's time goes inside a real ``roseinfer worker``: its steps, pulls and sends, timed in the worker.

The worker runs as a child process with its step (``Pump.step``), its pulls (``Puller._pull_once``, and the
reading of what a pull took, ``Puller.read``), its prompt tokenizing (``LLMEngine.tokenize_many``) and its sends
(``Sender._send_until_done``) timed; a private redis-server carries the jobs. After the warm-up jobs bench-queue
gives a worker, every job is submitted at once, as ``roseinfer bench-queue`` does, and the parent prints, from the
first submit: when the pulls and reads ran, the first steps, when the last job was admitted, and the steps' count,
median and sum. It is the tool that showed where the tiny model's through-Redis time went (README, "Queue benchmark").

    python3 benchmarks/worker_timeline.py --model tiny --jobs 256 --tokens 128 --max-num-seqs 256

On a GPU: ``--device cuda --model random:smollm2-135m --tokenizer FOLDER --dtype bfloat16`` (``gpu_check.sh
timeline``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
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

    # Jobs running after the step; for the step that ended them all, the jobs it ended (0: the loop waiting for
    # prompts to be tokenized).
    timed(pump.Pump, "step", lambda s, a, r: len(s.engine.running_request_ids()) or len(r))
    timed(puller.Puller, "_pull_once")
    timed(puller.Puller, "read", lambda s, a, r: len(r))
    timed(llm_engine.LLMEngine, "tokenize_many", lambda s, a, r: len(r))
    timed(sender.Sender, "_send_until_done")
    timed(batch_worker.BatchWorker, "_succeed", lambda s, a, r: len(a[0]))  # the results of jobs a step ended
    # The Python threads' native ids, for the parent's CPU accounting (torch's math threads are not among them),
    # looked at again only when a thread started (the pool's tokenizing threads start with the first burst).
    names = {str(t.native_id): t.name for t in threading.enumerate()}
    timed_step = pump.Pump.step

    def step_naming_threads(self, *args, **kwargs):
        if threading.active_count() > len(names):
            names.update({str(t.native_id): t.name for t in threading.enumerate()})
        return timed_step(self, *args, **kwargs)

    pump.Pump.step = step_naming_threads
    atexit.register(lambda: Path(out).write_text(json.dumps({"spans": spans, "threads": names})))
    return main(argv)


def report(spans: list, t0: float, submitted: float, results: list[dict]) -> None:
    spans = sorted((s for s in spans if s[2] >= t0), key=lambda s: s[1])
    ms = lambda t: (t - t0) * 1e3  # noqa: E731
    end = max(r["timings"]["finished_at"] for r in results)
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    ttft = sorted(r["timings"]["ttft_s"] for r in results)
    # (the last job's end in the engine: its result is written a moment after, 3-5% of a tiny model's window)
    print(f"submit done at {ms(submitted):.1f} ms; last job ended at {ms(end):.1f} ms; {tokens / (end - t0):.0f} tok/s")
    print(f"TTFT p50 {ttft[len(ttft) // 2] * 1e3:.0f} ms, max {ttft[-1] * 1e3:.0f} ms")
    steps = [s for s in spans if s[0] == "Pump.step"]
    working = [s for s in steps if s[3]]
    print("\nfrom the first submit (ms)   took (ms)  what                          n (a span that began before the")
    print("                                             burst, as a blocking pull, starts below zero)")
    shown = [s for s in spans if s[0] != "Pump.step" or s[3]]  # (not the loop waiting for prompts to tokenize)
    for i, (name, a, b, n, thread) in enumerate(shown):
        if i < 40 or i >= len(shown) - 12:  # the start and the end, where the queue's time goes
            if i == len(shown) - 12 and i > 40:
                print(f"{'...':>26}")
            print(f"{ms(a):>26.1f} {(b - a) * 1e3:>10.2f}  {name:<29} {n if n is not None else ''} ({thread})")
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
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder, for a random:SHAPE model's chat prompts")
    p.add_argument("--worker-flag", action="append", default=[], help="one more worker flag (--engine-process)")
    p.add_argument("--worker-log", metavar="PATH", help="append the worker's output here (default: dropped)")
    p.add_argument("--serve", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # the child: OUT, then worker argv
    args = p.parse_args()
    if os.environ.get("GPU_CHECK_PARSE_ONLY"):  # (gpu_check.sh's check of its command lines: parsed, nothing run)
        return 0
    if args.serve:
        return serve(args.serve[0], args.serve[1:])

    from producer import Client
    from roseinfer.bench import load_prompts, resolve_model_arg
    from worker.bench_queue import WARM_UP_TOKENS, _chat_jobs, _wait_for_worker, warm_up_convs, worker_log
    from worker.local_redis import start_private_redis, stop_private_redis

    resolve_model_arg(args)
    url, redis_proc = start_private_redis()
    if redis_proc is None:
        raise SystemExit("no redis-server could be started")
    out = Path(tempfile.mkdtemp(prefix="roseinfer-timeline-")) / "spans.json"
    worker_argv = ["worker", "--redis-url", url, "--queue", "timeline", "--model", args.model]
    worker_argv += ["--max-num-seqs", str(args.max_num_seqs), "--dtype", args.dtype, "--device", args.device]
    worker_argv += (["--tokenizer", args.tokenizer] if args.tokenizer else []) + args.worker_flag
    with worker_log(args.worker_log) as log:
        proc = subprocess.Popen([sys.executable, __file__, "--serve", str(out), *worker_argv], stdout=log, stderr=log)
    try:
        client = Client(url, queue="timeline")
        _wait_for_worker(client.connection, "timeline", proc)
        convs = load_prompts(argparse.Namespace(num_prompts=args.jobs, prompts=None, input_len=0))
        # The warm-up bench-queue gives its workers: the engine's first-use costs paid before the clock.
        for job in client.submit_many(_chat_jobs(warm_up_convs(convs, args.jobs), WARM_UP_TOKENS)):
            job.result(timeout=300)
        before = cpu_seconds(proc.pid, client.connection)
        t0 = time.time()
        jobs = client.submit_many(_chat_jobs(convs, args.tokens))
        submitted = time.time()
        results = [job.result(timeout=600) for job in jobs]
        after = cpu_seconds(proc.pid, client.connection)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        stop_private_redis(redis_proc)
    written = json.loads(out.read_text())
    report(written["spans"], t0, submitted, results)
    report_cpu(before, after, written["threads"], str(proc.pid))
    return 0


NATIVE = "threads Python did not start (torch's math)"  # with one math thread: none


def report_cpu(before: dict[str, float], after: dict[str, float], threads: dict[str, str], step_loop: str) -> None:
    """Each one's CPU over the burst: the engine (the step loop and torch's math threads), the rest of the worker
    by thread, redis-server and this process."""
    cpu: dict[str, float] = {}
    for key, seconds in after.items():
        name = threads.get(key, NATIVE) if key.isdigit() else key
        name = "the step loop" if key == step_loop else name.split("_")[0]  # the tokenizing pool's threads as one
        cpu[name] = cpu.get(name, 0.0) + seconds - before.get(key, 0.0)
    engine = sum(v for k, v in cpu.items() if k in ("the step loop", NATIVE))
    shown = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in cpu.items() if v >= 5e-4)
    print(f"CPU from the first submit to the last result read (ms): {shown}")
    print(f"outside the engine: {(sum(cpu.values()) - engine) * 1e3:.0f} ms of CPU; the engine: {engine * 1e3:.0f} ms")


def cpu_seconds(pid: int, connection) -> dict[str, float]:
    """CPU seconds so far of each of the worker's threads (by native id), of redis-server and of this process (the
    producer's submit and the result reads): on two cores every one of them takes time from the engine's math."""
    seconds: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):  # a thread that ended meanwhile
            seconds[task.name] = int((task / "schedstat").read_text().split()[0]) / 1e9
    info = connection.info("cpu")
    seconds["redis-server"] = info["used_cpu_user"] + info["used_cpu_sys"]
    seconds["producer and result reads"] = time.process_time()
    return seconds


if __name__ == "__main__":
    raise SystemExit(main())
