"""The ``roseinfer`` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _generate(args: argparse.Namespace) -> int:
    from roseinfer import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    convs = [[{"role": "user", "content": p}] for p in prompts]
    for out in llm.chat(convs, params, use_tqdm=len(convs) > 1):
        c = out.outputs[0]
        print(json.dumps({"text": c.text, "finish_reason": c.finish_reason, "completion_tokens": len(c.token_ids)}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="roseinfer", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    from roseinfer import bench

    p = sub.add_parser("bench", help="roseinfer against transformers generate on the standard workload")
    bench.add_arguments(p)
    p.set_defaults(func=bench.main)

    from worker import bench_queue

    p = sub.add_parser("bench-queue", help="the bench workload through Redis and a worker, vs in-process and stock rq")
    bench_queue.add_arguments(p)
    p.set_defaults(func=bench_queue.main)

    p = sub.add_parser("generate", help="answer chat prompts offline (arguments, or one per stdin line)")
    p.add_argument("prompt", nargs="*")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=_generate)

    from producer import cli as producer_cli
    from worker import cli as worker_cli

    worker_cli.add_parsers(sub)
    producer_cli.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose or args.command in ("worker", "demo") else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
    )
    import redis  # here, not at the top: the engine's modules never import the queue's

    from producer.client import InvalidRequest

    try:
        return args.func(args)
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        print(f"error: cannot reach Redis ({exc}); check --redis-url or ROSEINFER_REDIS_URL", file=sys.stderr)
        return 2
    except InvalidRequest as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
