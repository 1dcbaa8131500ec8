"""``roseinfer bench``: roseinfer against transformers ``generate`` on the same prompts, in one process.

Generated tokens per second (model load excluded), TTFT and TPOT percentiles, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from roseinfer.config import (
    TINY_MODEL,
    ConfigError,
    add_engine_arguments,
    engine_config_from_args,
    output_file,
    quantization_name,
)

# The standard workload (64 short chat instructions), shipped inside the package so every checkout has it.
DEFAULT_WORKLOAD = Path(__file__).with_name("data") / "prompts64.json"


@dataclass
class RunResult:
    system: str
    num_requests: int
    generated_tokens: int
    seconds: float
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds

    def summary(self) -> dict:
        pct = percentile
        return {
            "system": self.system,
            "requests": self.num_requests,
            "generated_tokens": self.generated_tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "ttft_p50_ms": _ms(pct(self.ttft_s, 0.5)),
            "ttft_p99_ms": _ms(pct(self.ttft_s, 0.99)),
            "tpot_p50_ms": _ms(pct(self.tpot_s, 0.5)),
            "tpot_p99_ms": _ms(pct(self.tpot_s, 0.99)),
        }


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile: the smallest value with at least ``q`` of them at or below it (of 64 values,
    p99 is the largest; the rounded index made it the second largest)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def median_run(runs: list, rate=lambda r: r.tokens_per_s):
    """The run with the median tokens/s (its other figures come with it): of an even count, the lower of the two
    middle ones (a run, not an average of two; the upper one made the median of two runs their best)."""
    return sorted(runs, key=rate)[(len(runs) - 1) // 2]


def resolve_model_arg(args: argparse.Namespace, chat: bool = True) -> None:
    """``--model tiny``: a tiny random Llama with a small tokenizer (built in a second, no download), whose steps
    take milliseconds as a GPU's do, so a benchmark times the machinery around the model. ``--model random:SHAPE``
    (smollm2-135m, llama-1b): a random-weight model of that shape, with no tokenizer: a benchmark that sends chat
    prompts (``chat``) needs ``--tokenizer`` beside it."""
    if args.model.startswith("random:"):
        from roseinfer.tiny_models import RANDOM_SHAPES, save_random_model

        shape = args.model.split(":", 1)[1]
        if shape not in RANDOM_SHAPES:
            raise ConfigError(f"--model {args.model}: no such shape; known: {', '.join(RANDOM_SHAPES)}")
        if chat and not args.tokenizer:  # (refused before seconds of random weights)
            raise ConfigError(
                f"--model {args.model} has no tokenizer, and this benchmark sends chat prompts: pass --tokenizer FOLDER"
            )
        from roseinfer.model_loader import save_in_cache

        # Built once into the model cache (seeded): a 1B shape took seconds and 2.5 GB of /tmp at every run.
        name = f"random-{shape}-{args.dtype}"
        args.model = str(save_in_cache(name, lambda tmp: save_random_model(shape, args.dtype, tmp)))
    if args.model == TINY_MODEL:
        from roseinfer.model_loader import resolve_model

        args.model = resolve_model(TINY_MODEL)  # (a folder: its workers get the same path)


def build_llm(args: argparse.Namespace):
    config = engine_config_from_args(args)  # a bad option fails here, before torch loads
    from roseinfer import LLM

    return LLM.from_config(config)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 1)


def find_workload(path: str | None) -> Path:
    """--prompts, else ROSEINFER_BENCH_PROMPTS, else the workload shipped with the package."""
    chosen = Path(path or os.environ.get("ROSEINFER_BENCH_PROMPTS") or DEFAULT_WORKLOAD)
    if chosen.is_dir():  # (said "not found": it is there)
        raise ConfigError(f"prompts file {chosen} is a folder: name the JSON file in it")
    if not chosen.is_file():
        raise ConfigError(f"prompts file not found: {chosen}")
    return chosen


def load_prompts(args) -> list[list[dict]]:
    """Chat conversations: the standard workload, or synthetic prompts of about --input-len words. Each is its own
    from its start (a number in a synthetic one, a round's tag on a repeat): the prefix cache served 14 distinct
    synthetic prompts and the workload's repeats, which transformers computed whole."""
    if args.input_len:
        words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()
        texts = [f"{i}: " + " ".join(words[(i + j) % len(words)] for j in range(args.input_len - 1))
                 for i in range(args.num_prompts)]  # fmt: skip
    else:
        chosen = find_workload(args.prompts)
        try:
            texts = json.loads(chosen.read_text(encoding="utf-8"))
        except (ValueError, UnicodeError) as exc:  # (a traceback before)
            raise ConfigError(f"prompts file {chosen} is not JSON ({exc}): a list of prompt strings") from None
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
            raise ConfigError(f"prompts file {chosen} must hold a non-empty JSON list of non-empty prompt strings")
        texts = [t if i < len(texts) else f"(Round {i // len(texts) + 1}.) {t}"
                 for i, t in enumerate((texts * (args.num_prompts // len(texts) + 1))[: args.num_prompts])]  # fmt: skip
    return [[{"role": "user", "content": t}] for t in texts]


def sampling_of(args: argparse.Namespace) -> dict:
    """The workload's sampling settings (``--temperature``, ``--top-p``): greedy by default. Bad ones are a
    ``ConfigError``, as a bad engine option is."""
    from roseinfer.config import ConfigError
    from roseinfer.sampling_params import SamplingParams

    sampling = {"temperature": args.temperature, "top_p": args.top_p}
    try:
        SamplingParams(**sampling)
    except ValueError as exc:
        raise ConfigError(f"--temperature/--top-p: {exc}") from None
    return sampling


def describe_sampling(sampling: dict) -> str:
    if not sampling.get("temperature"):
        return "greedy"
    return f"temperature {sampling['temperature']}, top_p {sampling.get('top_p', 1.0)}"


def hf_sampling(sampling: dict) -> dict:
    """The same settings as transformers' ``generate`` arguments."""
    if not sampling.get("temperature"):
        return {"do_sample": False}
    return {"do_sample": True, "temperature": sampling["temperature"], "top_p": sampling.get("top_p", 1.0), "top_k": 0}


def run_roseinfer(llm, convs, max_tokens: int, sampling: dict | None = None) -> RunResult:
    return run_prompts(llm, [llm.engine.apply_chat_template(c) for c in convs], max_tokens, sampling)


def run_prompts(llm, prompts: list[list[int]], max_tokens: int, sampling: dict | None = None) -> RunResult:
    """Every prompt (token ids) added at once, EOS ignored, greedy unless ``sampling`` (SamplingParams' fields) says
    otherwise; the engine stepped until all end."""
    from roseinfer import SamplingParams

    engine = llm.engine
    sampling = sampling or {"temperature": 0.0}
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind="final_only", **sampling)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"bench-{i}", ids, params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    seconds = time.perf_counter() - start
    result = RunResult(system_name(engine.config), len(prompts), 0, seconds)
    for out in finished:
        n = len(out.outputs[0].token_ids)
        m = out.metrics
        result.generated_tokens += n
        result.ttft_s.append(m.first_token_time - start)  # all arrive at start
        if n > 1:
            result.tpot_s.append((m.finish_time - m.first_token_time) / (n - 1))
    return result


def run_hf(
    model_path: str, dtype: str, convs, max_tokens: int, batch_size: int, tokenizer, sampling: dict | None = None
) -> RunResult:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
    name = "transformers, one at a time" if batch_size == 1 else f"transformers, padded batches of {batch_size}"
    result = RunResult(name, len(texts), 0, 0.0)

    class FirstToken(BaseStreamer):  # put() sees the prompt first, then each new token
        def __init__(self) -> None:
            self.calls, self.first = 0, None

        def put(self, value) -> None:
            self.calls += 1
            if self.calls == 2:
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    # One untimed generate first, as roseinfer's run has its warm-up (and bench_gpu's transformers rows theirs):
    # the first one-at-a-time TTFT was 151 ms against 16 ms for the next, first-use costs timed on one side only.
    warm = tokenizer(texts[:batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        model.generate(**warm, max_new_tokens=2, min_new_tokens=2, pad_token_id=tokenizer.pad_token_id)
    start = time.perf_counter()
    for i in range(0, len(texts), batch_size):
        batch = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        streamer = FirstToken() if batch_size == 1 else None
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                **batch,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=tokenizer.pad_token_id,
                **hf_sampling(sampling or {}),
                streamer=streamer,
            )
        t1 = time.perf_counter()
        new = out.shape[1] - batch["input_ids"].shape[1]
        result.generated_tokens += new * out.shape[0]
        if streamer is not None and streamer.first is not None:
            result.ttft_s.append(streamer.first - t0)
            result.tpot_s.append((t1 - streamer.first) / max(1, new - 1))
    result.seconds = time.perf_counter() - start
    return result


def system_name(config) -> str:
    """``roseinfer``, with its quantization where it has one (its figures are not the float model's)."""
    quantization = quantization_name(config)
    return f"roseinfer {quantization}" if quantization else "roseinfer"


def print_table(results: list[RunResult], dtype: str) -> None:
    base = results[0]
    print(f"\n{'system':<36} {'tok/s':>8} {'ttft p50/p99 ms':>17} {'tpot p50/p99 ms':>17} {'roseinfer is':>13}")
    for r in results:
        s = r.summary()
        ttft = f"{s['ttft_p50_ms']}/{s['ttft_p99_ms']}" if s["ttft_p50_ms"] is not None else "-"
        tpot = f"{s['tpot_p50_ms']}/{s['tpot_p99_ms']}" if s["tpot_p50_ms"] is not None else "-"
        ratio = "" if r is base else f"{base.tokens_per_s / r.tokens_per_s:.2f}x"
        print(f"{r.system + ' (' + dtype + ')':<36} {s['tokens_per_s']:>8} {ttft:>17} {tpot:>17} {ratio:>13}")


def counting(low: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``low`` (0 prompts, tokens or repeats failed after the model
    loaded: a division by zero, a median of nothing)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value

    return parse


def add_workload_arguments(p: argparse.ArgumentParser, sampling: bool = True) -> None:
    """The engine's options and the workload's: what every benchmark of the engine takes."""
    add_engine_arguments(p)
    p.add_argument(
        "--prompts",
        help="JSON list of prompt strings (default: $ROSEINFER_BENCH_PROMPTS if set, else the 64 shipped in "
        "roseinfer/data)",
    )
    p.add_argument("--num-prompts", type=counting(1), default=64)
    p.add_argument("--input-len", type=counting(0), default=0, help="synthetic prompts of this many words instead")
    p.add_argument("--max-tokens", type=counting(1), default=64, help="new tokens per prompt (EOS ignored)")
    if sampling:
        p.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (default 0: greedy)")
        p.add_argument("--top-p", type=float, default=1.0, help="with --temperature, sample from this nucleus")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p)
    p.add_argument("--hf-batch-size", type=counting(1), default=16)
    p.add_argument(
        "--hf-single",
        type=counting(0),
        default=None,
        metavar="N",
        help="prompts for the one-at-a-time baseline (default: all; 0 skips it)",
    )
    p.add_argument("--skip-hf", action="store_true", help="run roseinfer alone")
    p.add_argument(
        "--repeats",
        type=counting(1),
        default=1,
        help="runs of roseinfer: on CPU interleaved with transformers', medians compared; on CUDA transformers runs "
        "once, after",
    )
    p.add_argument("--json", metavar="PATH", type=output_file, help="write the figures here")
    p.add_argument(
        "--skip-hf-compiled", action="store_true", help="on CUDA, leave out transformers' static-cache compiled run"
    )
    p.add_argument("--latency", action="store_true", help="on CUDA, also time one sequence against the weight floor")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also print where a decode step of the whole batch goes (dense layers, output layer, attention, "
        "elementwise kernels, sampling, Python) and the step's cost over its matrix products (step_over_dense: the "
        "dense layers and the output layer) and over the dense layers alone (step_over_dense_layers)",
    )


def main(args: argparse.Namespace) -> int:
    from roseinfer import SamplingParams
    from roseinfer.cpu_features import describe

    engine_config_from_args(args)  # a bad option fails here, before torch loads
    sampling = sampling_of(args)  # so does a bad --temperature or --top-p
    convs = load_prompts(args)
    print(f"cpu: {describe()}")
    resolve_model_arg(args)
    t = time.perf_counter()
    llm = build_llm(args)
    print(
        f"torch threads: {__import__('torch').get_num_threads()} (the engine's); "
        f"loaded {args.model} ({args.dtype}, {args.device}) in {time.perf_counter() - t:.1f}s; "
        f"{len(convs)} prompts x {args.max_tokens} new tokens, {describe_sampling(sampling)}, EOS ignored"
    )
    llm.chat(convs[:4], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    tok, path = llm.get_tokenizer(), llm.engine.model_path
    # This machine's speed drifts by several percent from minute to minute: with --repeats the systems run in
    # interleaved pairs, so both see the same drift, and the median runs are compared.
    ours, padded = [], []
    for rep in range(args.repeats):
        llm.engine.kv.reset_prefix_cache()  # no help from the warm-up's blocks, or an earlier run's
        ours.append(run_roseinfer(llm, convs, args.max_tokens, sampling))
        line = f"{ours[-1].system}: {ours[-1].tokens_per_s:.1f} tok/s"
        if not args.skip_hf:
            padded.append(run_hf(path, args.dtype, convs, args.max_tokens, args.hf_batch_size, tok, sampling))
            ratio = ours[-1].tokens_per_s / padded[-1].tokens_per_s
            line += f"; {padded[-1].system}: {padded[-1].tokens_per_s:.1f} tok/s ({ratio:.2f}x)"
        print(f"run {rep + 1}/{args.repeats}: {line}", flush=True)
    results = [median_run(ours)] + ([median_run(padded)] if padded else [])
    if not args.skip_hf:
        n_single = len(convs) if args.hf_single is None else args.hf_single
        if n_single:
            results.append(run_hf(path, args.dtype, convs[:n_single], args.max_tokens, 1, tok, sampling))
    if args.repeats > 1:
        print(f"\nmedian of {args.repeats} runs each:")
    print_table(results, args.dtype)
    profile = None
    if args.profile:
        from roseinfer.step_profile import profile_decode

        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, **sampling)
        profile = profile_decode(llm.engine, [{"messages": c} for c in convs], params)
        print("\ndecode step profile:", json.dumps(profile))
    if args.json:
        payload = {
            "cpu": describe(),
            "profile": profile,
            "dtype": args.dtype,
            "quantization": llm.engine.config.quantization,
            "model": args.model,
            "max_tokens": args.max_tokens,
            "sampling": sampling,
            "results": [r.summary() for r in results],
            "runs": {"roseinfer": [r.summary() for r in ours], "padded": [r.summary() for r in padded]},
        }
        if len(results) > 1:
            payload["speedup_vs"] = {r.system: round(results[0].tokens_per_s / r.tokens_per_s, 2) for r in results[1:]}
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0
