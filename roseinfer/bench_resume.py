"""``roseinfer bench-resume``: what resuming a retried job saves. Jobs killed at a fraction of their tokens (90% by
default) are finished twice, each way timed: resumed (the streamed tokens given back as the start of the output,
one prefill, then only the rest decoded) and regenerated from scratch (what a retry did before). Repeats are
interleaved; medians are printed, with the check that both ways end with the same tokens."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from roseinfer.bench import DEFAULT_WORKLOAD
from roseinfer.config import ConfigError, add_engine_arguments, engine_config_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jobs", type=int, default=8, help="jobs killed and retried together")
    p.add_argument("--tokens", type=int, default=256, help="output tokens per job")
    p.add_argument("--killed-at", type=float, default=0.9, help="the fraction of its tokens a job had streamed")
    p.add_argument("--repeats", type=int, default=3)
    add_engine_arguments(p)


def _finish(engine, prompts: list[str], params, prefixes: list[list[int]] | None, tag: str) -> tuple[float, list]:
    """Seconds from submission until every job ended, and their output token ids."""
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params, output_prefix=prefixes[i] if prefixes else None)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    seconds = time.perf_counter() - start
    return seconds, [outputs[f"{tag}-{i}"] for i in range(len(prompts))]


def main(args: argparse.Namespace) -> int:
    from roseinfer import LLM, SamplingParams

    if not 0 < args.killed_at < 1 or args.jobs < 1 or args.tokens < 2 or args.repeats < 1:
        raise ConfigError("bench-resume: --killed-at in (0, 1), --jobs >= 1, --tokens >= 2, --repeats >= 1")
    config = engine_config_from_args(args)
    config.enable_prefix_caching = False  # the retry lands on a worker that has none of this job's blocks
    llm = LLM.from_config(config)
    engine = llm.engine
    workload = json.loads(DEFAULT_WORKLOAD.read_text())
    prompts = [
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": workload[i % len(workload)]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(args.jobs)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    _, full = _finish(engine, prompts, params, None, "warmup")
    kept = int(args.tokens * args.killed_at)
    prefixes = [ids[:kept] for ids in full]
    resumed_s, regenerated_s, same = [], [], True
    for r in range(args.repeats):
        seconds, outs = _finish(engine, prompts, params, prefixes, f"resume{r}")
        resumed_s.append(seconds)
        same = same and outs == full
        seconds, outs = _finish(engine, prompts, params, None, f"regen{r}")
        regenerated_s.append(seconds)
    resumed, regenerated = statistics.median(resumed_s), statistics.median(regenerated_s)
    print(
        json.dumps(
            {
                "model": config.model,
                "dtype": config.dtype,
                "jobs": args.jobs,
                "tokens": args.tokens,
                "streamed_before_the_kill": kept,
                "resumed_s": round(resumed, 3),
                "regenerated_s": round(regenerated, 3),
                "speedup": round(regenerated / resumed, 2),
                "resumed_runs_s": [round(s, 3) for s in resumed_s],
                "regenerated_runs_s": [round(s, 3) for s in regenerated_s],
                "same_tokens_as_uninterrupted": same,
            }
        )
    )
    return 0
