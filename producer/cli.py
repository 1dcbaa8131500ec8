"""``roseinfer submit | result | cancel | status | batch``: the producer's commands (no engine needed)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from producer.client import DEFAULT_REDIS_URL, Client, JobError
from producer.protocol import DEFAULT_QUEUE

_SAMPLING = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "seed": int,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": float,
}


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=os.environ.get("ROSEINFER_REDIS_URL", DEFAULT_REDIS_URL))
    p.add_argument("--queue", default=os.environ.get("ROSEINFER_QUEUE", DEFAULT_QUEUE))


def _client(args: argparse.Namespace) -> Client:
    return Client(args.redis_url, args.queue)


def submit(args: argparse.Namespace) -> int:
    fields = {name: getattr(args, name) for name in _SAMPLING if getattr(args, name) is not None}
    if args.stop:
        fields["stop"] = args.stop
    if args.ignore_eos:
        fields["ignore_eos"] = True
    prompt = args.prompt if args.prompt != "-" else sys.stdin.read()
    if args.raw:
        job = _client(args).submit(prompt, **fields)
    else:
        job = _client(args).submit(messages=[{"role": "user", "content": prompt}], **fields)
    if not args.stream and not args.wait:
        print(job.id)
        return 0
    print(f"job {job.id}", file=sys.stderr)
    try:
        if args.stream:
            for piece in job.stream(timeout=args.timeout):
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
        result = job.result(timeout=args.timeout)
    except JobError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.stream:
        u = result["usage"]
        print(
            f"[{result['finish_reason']}; {u['prompt_tokens']} prompt + {u['completion_tokens']} completion tokens; "
            f"ttft {result['timings']['ttft_s']:.3f} s]",
            file=sys.stderr,
        )
    else:
        print(json.dumps(result, ensure_ascii=False))
    return 0


def result(args: argparse.Namespace) -> int:
    try:
        print(json.dumps(_client(args).job(args.job_id).result(timeout=args.timeout), ensure_ascii=False))
    except JobError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def cancel(args: argparse.Namespace) -> int:
    job = _client(args).job(args.job_id)
    if job.cancel():
        print(f"canceled {job.id}")
        return 0
    print(f"job {job.id} is {job.status()}: nothing to cancel", file=sys.stderr)
    return 1


def status(args: argparse.Namespace) -> int:
    st = _client(args).status()
    if args.json:
        print(json.dumps(st))
        return 0
    print(
        f"queue {st['queue']}: {st['queued']} queued, {st['in_flight']} in flight, {st['finished']} finished, "
        f"{st['failed']} failed, {st['canceled']} canceled"
    )
    print(f"{len(st['workers'])} workers, {st['tokens_per_s']:.1f} tokens/s")
    for w in st["workers"]:
        print(f"  {w['name']}  {w['state']:<8} {w['model']}  {w['in_flight']} in flight  {w['tokens_per_s']:.1f} tok/s")
    return 0


def batch(args: argparse.Namespace) -> int:
    from producer.batch import run_batch

    summary = run_batch(
        _client(args),
        args.input,
        args.output,
        errors_path=args.errors,
        max_in_flight=args.max_in_flight,
        timeout=args.timeout,
    )
    print(json.dumps(summary), file=sys.stderr)
    return 0 if summary["failed"] == 0 else 1


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="enqueue a prompt (chat template applied unless --raw)")
    p.add_argument("prompt", help="the prompt, or - to read it from stdin")
    p.add_argument("--stream", action="store_true", help="print the text as it is generated")
    p.add_argument("--wait", action="store_true", help="wait and print the result as JSON")
    p.add_argument("--raw", action="store_true", help="send as a plain prompt, without the chat template")
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float, default=None)
    for name, kind in _SAMPLING.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    add_connection_arguments(p)
    p.set_defaults(func=submit)

    p = sub.add_parser("result", help="wait for a job's result and print it as JSON")
    p.add_argument("job_id")
    p.add_argument("--timeout", type=float, default=None)
    add_connection_arguments(p)
    p.set_defaults(func=result)

    p = sub.add_parser("cancel", help="cancel a queued or running job")
    p.add_argument("job_id")
    add_connection_arguments(p)
    p.set_defaults(func=cancel)

    p = sub.add_parser("status", help="queue depth, workers, jobs in flight, tokens/s")
    p.add_argument("--json", action="store_true")
    add_connection_arguments(p)
    p.set_defaults(func=status)

    p = sub.add_parser("batch", help="a JSONL of requests in (OpenAI batch lines or {'prompt': ...}), outputs out")
    p.add_argument("input")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--errors", default=None, help="bad lines and failed jobs (default: OUTPUT.errors.jsonl)")
    p.add_argument("--max-in-flight", type=int, default=256)
    p.add_argument("--timeout", type=float, default=None, help="give up on a job after this many seconds")
    add_connection_arguments(p)
    p.set_defaults(func=batch)
