"""``roseinfer bench-queue``: the ``roseinfer bench`` workload through Redis (producer -> worker -> results).

Prints, measured in one run on the same prompts:
- the engine in-process (tokens/s), the reference;
- the same jobs streamed in-process: the worker's ``Pump`` over the same engine, text handed out at the worker's
  event cadence, no Redis; what streaming costs apart from the queue;
- the same jobs through Redis and a fresh ``roseinfer worker`` process (tokens/s, and its share of the in-process
  figure), the two interleaved --repeats times and compared by their medians, each side past the same warm-up jobs;
- TTFT p50/p99 of the jobs submitted at once, beside the in-process engine's, and of jobs arriving one by one
  while a full batch decodes;
- a stock ``rq worker`` (SimpleWorker, model loaded once) running transformers ``generate`` per job.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from producer.batch_io import at_least
from roseinfer.bench import (
    add_workload_arguments,
    build_llm,
    counting,
    describe_sampling,
    hf_sampling,
    load_prompts,
    median_run,
    percentile,
    resolve_model_arg,
    run_roseinfer,
    sampling_of,
)
from roseinfer.config import engine_config_from_args, output_file
from worker.cli import engine_flags, worker_command
from worker.local_redis import start_private_redis, stop_private_redis


def _wait_for_worker(conn, queue: str, proc: subprocess.Popen, timeout: float = 300, log: Any = None) -> None:
    """Until the worker process has registered; ``log``, a file its output goes to: the last line it wrote is said
    if it exits first ("the worker exited with code 2" alone hid a bad flag's one-line error)."""
    from rq import Queue
    from rq.worker import Worker

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the worker exited with code {proc.returncode}{_last_line(log)}")
        if Worker.count(queue=Queue(queue, connection=conn)):
            return
        time.sleep(0.2)
    raise SystemExit("the worker did not start")


def run_streamed(llm, convs, max_tokens: int, sampling: dict | None = None) -> dict[str, Any]:
    """Every job at once through the worker's ``Pump`` over ``llm``'s engine, no Redis: delta text made when a
    hand-over is due, as ``BatchWorker`` flushes (``event_interval_ms``, longer with many jobs in flight), so the
    engine does the worker's streaming work. Prompts are tokenized before the clock starts, as in ``run_roseinfer``."""
    from roseinfer import SamplingParams
    from worker.pump import Pump
    from worker.settings import WorkerSettings

    defaults = WorkerSettings.model_fields
    interval_s = defaults["event_interval_ms"].default / 1000
    events_per_s = defaults["max_events_per_s"].default
    engine = llm.engine
    prompts = [{"prompt_token_ids": engine.apply_chat_template(c)} for c in convs]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind="delta", **(sampling or GREEDY))
    pump = Pump(engine, tokenize_in_thread=False)
    texts: dict[str, list[str]] = {}
    tokens = 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        pump.submit(f"streamed-{i}", prompt, params)
    next_hand_over, step_s = start, 0.0
    while pump.has_work():
        began = time.perf_counter()
        flush = began + step_s >= next_hand_over
        if flush:
            next_hand_over = began + max(interval_s, len(pump) / events_per_s)
        for event in pump.step(flush=flush):
            texts.setdefault(event.job_id, []).append(event.text)
            tokens += len(event.token_ids)
        step_s = time.perf_counter() - began
    seconds = time.perf_counter() - start
    pump.close()
    return _row("roseinfer streamed in-process (its Pump)", len(texts), tokens, seconds)


def _row(system: str, requests: int, tokens: int, seconds: float) -> dict[str, Any]:
    """One system's figures, as ``RunResult.summary`` gives the in-process run's."""
    return {
        "system": system,
        "requests": requests,
        "generated_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
    }


GREEDY = {"temperature": 0.0}


def _chat_jobs(convs: list[list[dict]], max_tokens: int, sampling: dict | None = None) -> list[dict[str, Any]]:
    return [{"messages": c, "max_tokens": max_tokens, "ignore_eos": True, **(sampling or GREEDY)} for c in convs]


WARM_UP_TOKENS = 8


def warm_up_convs(convs: list[list[dict]], count: int) -> list[list[dict]]:
    """``count`` jobs like the workload's, for the engine's first-use costs (its GEMM primitives for each row
    count, its buffers) to be paid before the clock: the same user turns under a system turn of their own. Their
    blocks stay in a worker's prefix cache (with the tiny tokenizer the template's first block is shared with the
    workload), so the in-process engine runs them after each cache reset too: both sides time from the same cache."""
    return [[{"role": "system", "content": f"Warm-up {i}."}, *convs[i % len(convs)]] for i in range(count)]


def _fresh_cache_then_warm_up(llm, convs: list[list[dict]], count: int) -> None:
    """The in-process engine's cache as a fresh worker's is when its clock starts: empty, then the warm-up jobs."""
    from roseinfer import SamplingParams

    llm.engine.kv.reset_prefix_cache()
    params = SamplingParams(max_tokens=WARM_UP_TOKENS, temperature=0, ignore_eos=True)
    llm.chat(warm_up_convs(convs, count), params, use_tqdm=False)


def _last_line(log: Any) -> str:
    """ ": <the last line written to log>", where ``log`` is a file that can be read back and holds one."""
    try:
        with open(log.name, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = [line for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    except (AttributeError, TypeError, OSError):
        return ""
    return f": {lines[-1]}" if lines else ""


@contextlib.contextmanager
def worker_log(path: str | None) -> Iterator[Any]:
    """Where a benchmark's worker process writes its output: appended to ``path`` (a crash's traceback kept, on
    a lent machine whose minutes are few), or a file dropped at the end (read back for the error of a worker that
    exits at its start)."""
    if path is None:
        with tempfile.NamedTemporaryFile(prefix="roseinfer-bench-worker-", suffix=".log") as log:
            yield log
        return
    with open(path, "ab") as log:  # (the child holds its own copy of the file once started)
        yield log


@contextlib.contextmanager
def fresh_worker(args: argparse.Namespace, url: str, convs, queue: str) -> Iterator[Any]:
    """A fresh ``roseinfer worker`` process (so no run profits from another's prefix cache), registered and past
    its warm-up jobs; yields a producer ``Client`` of its queue."""
    from producer import Client

    client = Client(url, queue=queue)
    config = engine_config_from_args(args)
    cmd = worker_command(url, queue, config.model, *engine_flags(config), *args.worker_flag)
    with worker_log(args.worker_log) as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log)
        try:
            _wait_for_worker(client.connection, queue, proc, log=log)
            for job in client.submit_many(_chat_jobs(warm_up_convs(convs, args.warm_up_jobs), WARM_UP_TOKENS)):
                job.result(timeout=300)
            yield client
        finally:
            proc.terminate()
            proc.wait(timeout=120)


def run_through_redis(args: argparse.Namespace, client, convs, arrivals: bool) -> dict[str, Any]:
    """The workload through ``client``'s worker; with ``arrivals``, then TTFT of jobs arriving one by one while a
    full batch decodes."""
    # Throughput: every job submitted at once, as the in-process run adds every request at once.
    start = time.time()
    jobs = client.submit_many(_chat_jobs(convs, args.max_tokens, sampling_of(args)))
    results = [job.result(timeout=600) for job in jobs]
    seconds = last_result_written(client, jobs) - start
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    batch_ttft = [r["timings"]["ttft_s"] for r in results]
    row = _row("roseinfer through Redis", len(results), tokens, seconds)
    row["ttft_p50_ms"] = round(percentile(batch_ttft, 0.5) * 1e3, 1)
    row["ttft_p99_ms"] = round(percentile(batch_ttft, 0.99) * 1e3, 1)
    if arrivals:
        row.update(_arrival_ttft(args, client, convs))
    return row


def last_result_written(client, jobs) -> float:
    """When the last of ``jobs``' results landed in Redis (its entry's id: Redis's clock, this host's in a bench):
    the window's end, "to the last result". The worker's ``finished_at`` (its last event out of the engine) came
    before the result's write, 3-5% of a tiny model's window."""
    from producer.protocol import result_key

    with client.connection.pipeline(transaction=False) as pipe:
        for job in jobs:
            pipe.xrevrange(result_key(job.id), count=1)
        entries = pipe.execute()
    return max(int(entry[0][0].split(b"-")[0]) for entry in entries) / 1e3


def _arrival_ttft(args: argparse.Namespace, client, convs) -> dict[str, Any]:
    """A full batch decoding, and jobs arriving one by one meanwhile: their TTFT."""
    background = client.submit_many(_chat_jobs(convs, args.max_tokens, sampling_of(args)))
    next(iter(background[0].events(timeout=300)))
    arrivals, sent_at = [], []
    for conv in convs[: args.arrivals]:
        sent_at.append(time.time())
        arrivals.append(client.submit(messages=conv, max_tokens=16, ignore_eos=True, **sampling_of(args)))
        time.sleep(args.arrival_interval)
    ttft = [job.result(timeout=600)["timings"]["ttft_s"] for job in arrivals]
    for job in background:
        job.result(timeout=600)
    # How many came while the batch still ran: those after its end met an idle worker (the p50 mixes both).
    batch_end = last_result_written(client, background)
    return {
        "arrivals": len(ttft),
        "arrivals_during_batch": sum(t < batch_end for t in sent_at),
        "arrival_ttft_p50_ms": round(percentile(ttft, 0.5) * 1e3, 1),
        "arrival_ttft_p99_ms": round(percentile(ttft, 0.99) * 1e3, 1),
    }


_HF: dict[str, Any] = {}


def hf_job(
    messages: list[dict], max_tokens: int, model_path: str, dtype: str, sampling: dict | None = None
) -> dict[str, Any]:
    """The stock-RQ baseline's job: transformers ``generate`` for one prompt (model kept between jobs)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if _HF.get("path") != model_path:
        _HF.update(
            path=model_path,
            tok=AutoTokenizer.from_pretrained(model_path),
            model=AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval(),
        )
    tok, model = _HF["tok"], _HF["model"]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=tok.eos_token_id,
            **hf_sampling(sampling or GREEDY),
        )
    new = out[0, len(ids) :].tolist()
    return {"text": tok.decode(new, skip_special_tokens=True), "completion_tokens": len(new)}


def run_stock_rq(args: argparse.Namespace, url: str, convs, model_path: str) -> dict[str, Any]:
    from redis import Redis
    from rq import Queue
    from rq.serializers import JSONSerializer

    conn = Redis.from_url(url)
    queue = Queue("bench-stock", connection=conn, serializer=JSONSerializer)
    kwargs = {"model_path": model_path, "dtype": args.dtype, "sampling": sampling_of(args)}
    queue.enqueue("worker.bench_queue.hf_job", messages=convs[0], max_tokens=1, **kwargs)  # loads the model
    jobs = [
        queue.enqueue("worker.bench_queue.hf_job", messages=c, max_tokens=args.max_tokens, job_timeout=3600, **kwargs)
        for c in convs[: args.stock_jobs]
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    subprocess.run(
        [
            "rq",
            "worker",
            "-w",
            "rq.worker.SimpleWorker",
            "-S",
            "rq.serializers.JSONSerializer",
            "--burst",
            "-u",
            url,
            "bench-stock",
        ],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for job in jobs:
        job.refresh()
    if any(job.get_status() != "finished" for job in jobs):
        raise SystemExit("stock rq worker: some jobs failed")
    seconds = (max(j.ended_at for j in jobs) - min(j.started_at for j in jobs)).total_seconds()
    tokens = sum(j.return_value()["completion_tokens"] for j in jobs)
    return _row("stock rq worker + transformers generate", len(jobs), tokens, seconds)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p)
    p.add_argument("--repeats", type=counting(1), default=3, help="interleaved runs of each system; medians compared")
    p.add_argument("--json", metavar="PATH", type=output_file, help="write the figures here")
    p.add_argument("--redis-url", default=None, help="default: a private redis-server on a free port")
    p.add_argument("--arrivals", type=int, default=32, help="jobs arriving one by one while a batch decodes")
    p.add_argument("--arrival-interval", type=at_least(float, 0), default=0.25)
    p.add_argument(
        "--warm-up-jobs", type=int, default=None,
        help="jobs run before the clock, in-process and by each fresh worker alike (default: as many as the prompts)",
    )  # fmt: skip
    p.add_argument("--stock-jobs", type=counting(0), default=8, help="jobs for the stock rq worker (0 skips it)")
    p.add_argument(
        "--worker-flag", action="append", default=[], metavar="FLAG",
        help="a flag for the worker through Redis only, repeatable: --worker-flag=--engine-process",
    )  # fmt: skip
    p.add_argument(
        "--worker-log", metavar="PATH", type=output_file, help="append the workers' output here (default: dropped)"
    )


def main(args: argparse.Namespace) -> int:
    if args.warm_up_jobs is not None and args.warm_up_jobs < 0:
        raise SystemExit(f"--warm-up-jobs must be 0 or more, got {args.warm_up_jobs}")
    if args.arrivals < 0:
        raise SystemExit(f"--arrivals must be 0 or more, got {args.arrivals}")
    sampling = sampling_of(args)  # a bad --temperature or --top-p fails here, before the model loads
    convs = load_prompts(args)
    if args.warm_up_jobs is None:
        args.warm_up_jobs = len(convs)
    redis_proc = None
    url = args.redis_url
    if url is None:  # (before the model is built: a machine with no redis-server says so at once)
        url, redis_proc = start_private_redis()
        if redis_proc is None:
            raise SystemExit("no redis-server could be started: pass --redis-url")
    # This machine's speed drifts by several percent from minute to minute: the two systems run in interleaved
    # pairs, so both see the same drift, and the medians are compared.
    engine_rows, streamed_rows, redis_rows = [], [], []
    try:
        resolve_model_arg(args)
        llm = build_llm(args)
        model_path = llm.engine.model_path
        for rep in range(args.repeats):
            # The worker boots first: the three runs of a pair then follow each other within a second or two.
            with fresh_worker(args, url, convs, f"bench-roseinfer-{rep}") as client:
                _fresh_cache_then_warm_up(llm, convs, args.warm_up_jobs)
                row = run_roseinfer(llm, convs, args.max_tokens, sampling).summary()
                row["system"] = "roseinfer engine in-process"
                engine_rows.append(row)
                _fresh_cache_then_warm_up(llm, convs, args.warm_up_jobs)
                streamed_rows.append(run_streamed(llm, convs, args.max_tokens, sampling))
                last = rep == args.repeats - 1 and args.arrivals > 0
                redis_rows.append(run_through_redis(args, client, convs, arrivals=last))
            print(
                f"pair {rep + 1}/{args.repeats}: in-process {row['tokens_per_s']} tok/s, "
                f"streamed in-process {streamed_rows[-1]['tokens_per_s']} tok/s, "
                f"through Redis {redis_rows[-1]['tokens_per_s']} tok/s "
                f"({redis_rows[-1]['tokens_per_s'] / row['tokens_per_s']:.1%})",
                flush=True,
            )
        del llm
        stock = run_stock_rq(args, url, convs, model_path) if args.stock_jobs else None
    finally:
        stop_private_redis(redis_proc)
    engine, streamed, queued = (
        median_run(rows, lambda r: r["tokens_per_s"]) for rows in (engine_rows, streamed_rows, redis_rows)
    )
    share = queued["tokens_per_s"] / engine["tokens_per_s"]
    print(
        f"\n{len(convs)} prompts x {args.max_tokens} new tokens, {args.dtype}, {describe_sampling(sampling)}, "
        "EOS ignored"
    )
    print(f"{'system (median of ' + str(args.repeats) + ' runs)':<44} {'tok/s':>8}")
    for row in (engine, streamed, queued, stock):
        if row:
            print(f"{row['system']:<44} {row['tokens_per_s']:>8}")
    print(f"through Redis keeps {share:.1%} of the in-process tokens/s (medians)")
    print(
        f"streaming alone keeps {streamed['tokens_per_s'] / engine['tokens_per_s']:.1%}; through Redis keeps "
        f"{queued['tokens_per_s'] / streamed['tokens_per_s']:.1%} of the streamed in-process tokens/s (medians)"
    )
    if stock:
        print(f"through Redis vs stock rq worker: {queued['tokens_per_s'] / stock['tokens_per_s']:.1f}x")
    print(
        f"TTFT, {len(convs)} jobs submitted at once: p50 {queued['ttft_p50_ms']} ms, p99 {queued['ttft_p99_ms']} ms "
        f"(in-process, every request added at once: p50 {engine['ttft_p50_ms']} ms, p99 {engine['ttft_p99_ms']} ms)"
    )
    last = redis_rows[-1]
    if "arrivals" in last:  # (--arrivals 0 skips that phase)
        print(
            f"TTFT, {last['arrivals']} jobs arriving every {args.arrival_interval}s while a batch decodes "
            f"({last['arrivals_during_batch']} of them before its end): "
            f"p50 {last['arrival_ttft_p50_ms']} ms, p99 {last['arrival_ttft_p99_ms']} ms"
        )
    if args.json:
        figures = {
            "engine": engine,
            "streamed": streamed,
            "redis": queued,
            "stock_rq": stock,
            "share_of_engine": round(share, 4),
            "sampling": sampling,
            "runs": {"engine": engine_rows, "streamed": streamed_rows, "redis": redis_rows},
        }
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0
