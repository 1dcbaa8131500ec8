"""``roseinfer bench-dataset``: what dataset generation's two engine features cost, in-process, interleaved repeats,
medians.

- ``structured``: the same chat prompts with a JSON schema, then free-form with each request held to the length
  its JSON output had (EOS ignored), so both runs generate the same tokens in the same batch shapes and differ only
  by the constraint; throughput of each, the schema's cost in percent, and how many of the schema's outputs that
  finished with ``stop`` parse and validate.
- ``n``: one request with n samples of a long prompt against n separate requests of it submitted at once (each its
  own seed), with the prefix cache (separate requests admitted together share the prompt's blocks here too) and
  without it (each computes the prompt, as in an engine without that sharing); prompt tokens computed and seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from roseinfer.bench import DEFAULT_WORKLOAD
from roseinfer.config import ConfigError, add_engine_arguments, engine_config_from_args

# A label with a fixed set, a score and a short reason: the shape of most labelling datasets.
SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"enum": ["science", "history", "art", "technology", "nature", "other"]},
        "difficulty": {"type": "integer", "minimum": 1, "maximum": 5},
        "summary": {"type": "string", "maxLength": 120},
    },
    "required": ["topic", "difficulty", "summary"],
    "additionalProperties": False,
}
INSTRUCTION = "Label this request as JSON with its topic, a difficulty from 1 to 5 and a one-line summary: "


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--what", choices=("structured", "n", "both"), default="both")
    p.add_argument("--prompts", type=int, default=64, help="structured: prompts per run")
    p.add_argument("--tokens", type=int, default=64, help="structured: max_tokens per prompt")
    p.add_argument("--n", type=int, default=8, help="n: samples per request")
    p.add_argument("--prompt-tokens", type=int, default=500, help="n: the prompt's length in tokens")
    p.add_argument("--new-tokens", type=int, default=32, help="n: tokens per sample")
    p.add_argument("--repeats", type=int, default=3)
    add_engine_arguments(p)


def _drain(engine, tag: str) -> tuple[float, dict[str, Any]]:
    outputs: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    return time.perf_counter(), {k: v for k, v in outputs.items() if k.startswith(tag)}


def _structured(engine, args, SamplingParams) -> dict[str, Any]:
    import jsonschema

    workload = json.loads(DEFAULT_WORKLOAD.read_text())
    prompts = [{"messages": [{"role": "user", "content": INSTRUCTION + workload[i % len(workload)]}]}
               for i in range(args.prompts)]  # fmt: skip
    constrained = SamplingParams(temperature=0.7, seed=1, max_tokens=args.tokens, structured_outputs={"json": SCHEMA})
    rates: dict[str, list[float]] = {"free": [], "json_schema": []}
    lengths: list[int] = []
    stopped = valid = 0
    for r in range(args.repeats + 1):  # the first round warms up (llguidance's tokenizer, caches)
        for kind in ("json_schema", "free"):
            engine.kv.reset_prefix_cache()  # the same prompts each way: none starts with the other's blocks
            tag = f"{kind}-{r}-"
            start = time.perf_counter()
            for i, prompt in enumerate(prompts):
                params = constrained
                if kind == "free":
                    params = SamplingParams(temperature=0.7, seed=1, max_tokens=lengths[i], ignore_eos=True)
                engine.add_request(f"{tag}{i}", prompt, params)
            end, outs = _drain(engine, tag)
            if kind == "json_schema":
                lengths = [len(outs[f"{tag}{i}"].outputs[0].token_ids) for i in range(len(prompts))]
            tokens = sum(len(o.outputs[0].token_ids) for o in outs.values())
            if r == 0:
                continue
            rates[kind].append(tokens / (end - start))
            if kind == "json_schema":
                for o in outs.values():
                    if o.outputs[0].finish_reason == "stop":
                        stopped += 1
                        try:
                            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
                            valid += 1
                        except (ValueError, jsonschema.ValidationError):
                            pass
    free, constrained = statistics.median(rates["free"]), statistics.median(rates["json_schema"])
    return {
        "prompts": args.prompts,
        "max_tokens": args.tokens,
        "free_tok_s": round(free, 1),
        "json_schema_tok_s": round(constrained, 1),
        "json_schema_cost_pct": round(100 * (1 - constrained / free), 1),
        "json_schema_stop_finished": stopped,
        "json_schema_stop_finished_valid": valid,
        "free_runs_tok_s": [round(x, 1) for x in rates["free"]],
        "json_schema_runs_tok_s": [round(x, 1) for x in rates["json_schema"]],
    }


def _long_prompt(engine, num_tokens: int) -> list[int]:
    workload = json.loads(DEFAULT_WORKLOAD.read_text())
    ids: list[int] = []
    i = 0
    while len(ids) < num_tokens:
        ids += engine.tokenizer.encode(workload[i % len(workload)] + "\n")
        i += 1
    return ids[:num_tokens]


def _n_samples(engine, args, SamplingParams) -> dict[str, Any]:
    prompt = {"prompt_token_ids": _long_prompt(engine, args.prompt_tokens)}
    ways = ("n", "separate", "separate_no_prefix_cache")
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    computed: dict[str, int] = {}
    caching = engine.kv.enable_prefix_caching
    for r in range(args.repeats + 1):
        for way in ways:
            engine.kv.reset_prefix_cache()  # each way starts cold: the prompt is not cached yet
            engine.kv.enable_prefix_caching = caching and way != "separate_no_prefix_cache"
            before = engine.stats.num_prefill_tokens
            tag = f"{way}-{r}-"
            start = time.perf_counter()
            if way == "n":
                params = SamplingParams(temperature=0.8, seed=r, max_tokens=args.new_tokens, ignore_eos=True, n=args.n)
                engine.add_request(f"{tag}0", prompt, params)
            else:
                for i in range(args.n):
                    params = SamplingParams(temperature=0.8, seed=r * 1000 + i, max_tokens=args.new_tokens,
                                            ignore_eos=True)  # fmt: skip
                    engine.add_request(f"{tag}{i}", prompt, params)
            end, _ = _drain(engine, tag)
            if r == 0:
                continue
            seconds[way].append(end - start)
            computed[way] = engine.stats.num_prefill_tokens - before
    engine.kv.enable_prefix_caching = caching
    report: dict[str, Any] = {"n": args.n, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens}
    n_s = statistics.median(seconds["n"])
    for way in ways:
        report[f"{way}_prompt_tokens_computed"] = computed[way]
        report[f"{way}_s"] = round(statistics.median(seconds[way]), 3)
        report[f"{way}_runs_s"] = [round(x, 3) for x in seconds[way]]
        if way != "n":
            report[f"n_over_{way}"] = round(n_s / statistics.median(seconds[way]), 3)
    return report


def main(args: argparse.Namespace) -> int:
    from roseinfer import LLM, SamplingParams
    from roseinfer.cpu_features import describe as cpu

    counts = (args.repeats, args.n, args.prompts, args.tokens, args.prompt_tokens, args.new_tokens)
    if min(counts) < 1:  # (exit 2, a bad option's, not 1; 0 tokens was a traceback after the load)
        raise ConfigError(
            "bench-dataset: --repeats, --n, --prompts, --tokens, --prompt-tokens and --new-tokens are >= 1"
        )
    config = engine_config_from_args(args)
    engine = LLM.from_config(config).engine
    if args.what != "structured" and args.prompt_tokens + args.new_tokens > engine.max_model_len:
        raise ConfigError(
            f"bench-dataset: --prompt-tokens {args.prompt_tokens} plus --new-tokens {args.new_tokens} are past the "
            f"model's context ({engine.max_model_len} tokens)"
        )
    report: dict[str, Any] = {"model": config.model, "dtype": config.dtype, "cpu": cpu()}
    if args.what in ("structured", "both"):
        report["structured"] = _structured(engine, args, SamplingParams)
    if args.what in ("n", "both"):
        report["n_samples"] = _n_samples(engine, args, SamplingParams)
    print(json.dumps(report))
    return 0
