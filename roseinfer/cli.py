"""The engine's commands (``bench``, ``generate``): no queue here. The ``roseinfer`` command adds the worker's and
the producer's commands to these (``worker/cli.py``)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from roseinfer.config import ConfigError, add_engine_arguments, engine_config_from_args, set_engine_defaults

# generate's flags that default to ROSEINFER_<NAME>, as demo's and the worker's
ENV_DEFAULTS = ("model", "device", "dtype")


def _generate(args: argparse.Namespace) -> int:
    try:
        config = engine_config_from_args(args)
    except ConfigError as exc:  # (a value from the environment, said so: the error named no variable)
        env = {name: os.environ.get(f"ROSEINFER_{name.upper()}", "") for name in ENV_DEFAULTS}
        taken = [f"ROSEINFER_{name.upper()}={v!r}" for name, v in env.items() if v and getattr(args, name) == v]
        raise ConfigError(f"{exc} (from the environment: {', '.join(taken)})" if taken else str(exc)) from None
    from roseinfer import LLM, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    prompts = [_utf8(p, "a prompt argument") for p in args.prompt] or _stdin_prompts()
    if not any(p.strip() for p in prompts):  # (before the model loads)
        raise ConfigError("no prompts: give them as arguments, or one a line on stdin")
    llm = LLM.from_config(config)
    # A line per prompt, in order: one the model cannot take (past its context, a blank line of stdin) is an error
    # line of its own, not a traceback that lost every answer nor a line left out that put the next answers a
    # line up from their prompts.
    chats = llm.engine.tokenize_many([{"messages": [{"role": "user", "content": p}]} for p in prompts])
    refused = {i: "a blank prompt" for i, p in enumerate(prompts) if not p.strip()}
    refused.update({i: str(chat) for i, chat in enumerate(chats) if isinstance(chat, Exception) and i not in refused})
    taken = [(i, chat[1]) for i, chat in enumerate(chats) if i not in refused]
    for i, ids in taken:
        try:
            llm.engine.check_prompt_tokens(len(ids))
        except ValueError as exc:
            refused[i] = str(exc)
    runs = [(i, {"prompt_token_ids": ids}) for i, ids in taken if i not in refused]
    # Each answer printed once those before it are, as they finish: Ctrl-C (or a crash) keeps every line written.
    lines = {i: json.dumps({"error": why}) for i, why in refused.items()}
    written = 0

    def write_ready() -> None:
        nonlocal written
        while written in lines:
            print(lines.pop(written), flush=True)
            written += 1

    finished = llm.finished_in_turn([r for _, r in runs], params, use_tqdm=len(runs) > 1)
    try:
        write_ready()
        for k, out in finished:
            c = out.outputs[0]
            answer = {"text": c.text, "finish_reason": c.finish_reason, "completion_tokens": len(c.token_ids)}
            lines[runs[k][0]] = json.dumps(answer)
            write_ready()
    except KeyboardInterrupt:
        finished.close()  # (its progress bar closed first: it was drawn again after the line below)
        print(f"interrupted: the first {written} of {len(prompts)} prompts' answers were written", file=sys.stderr)
        return 130  # (as the command's own: the line above says it, not a second "interrupted")
    return 0 if not refused else 1


def _stdin_prompts() -> list[str]:
    """A prompt per line of stdin, blank ones too (answered by an error line, so that line N of the output is line
    N's answer), read as UTF-8 before the model loads (other bytes reached the tokenizer as lone surrogates: a
    TypeError after the load); a file written on Windows: its line ends and BOM are not the prompt's."""
    raw = getattr(sys.stdin, "buffer", None)  # (a stdin of text already, as a test's, has none)
    text = sys.stdin.read() if raw is None else _utf8(raw.read(), "stdin")
    lines = [line.rstrip("\r") for line in text.removeprefix("\ufeff").split("\n")]
    return lines[:-1] if lines and not lines[-1] else lines  # (the last line's end ends no prompt)


def _utf8(value: str | bytes, where: str) -> str:
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else value.encode("utf-8").decode("utf-8")
    except UnicodeError as exc:
        raise ConfigError(f"{where} is not UTF-8 text ({exc.reason})") from None


def _bench(args: argparse.Namespace) -> int:
    """On CUDA the GPU benchmark (transformers' compiled generate beside it, a latency row), else the CPU one."""
    if args.device.startswith("cuda"):
        from roseinfer import bench_gpu  # imports torch: only where the run needs it (options are checked first)

        return bench_gpu.main(args)
    from roseinfer import bench

    return bench.main(args)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from roseinfer import bench, bench_dataset, bench_resume

    p = sub.add_parser("bench", help="roseinfer against transformers generate on the standard workload")
    bench.add_arguments(p)
    p.set_defaults(func=_bench)

    p = sub.add_parser("bench-resume", help="a retried job resumed from its streamed tokens vs regenerated")
    bench_resume.add_arguments(p)
    p.set_defaults(func=bench_resume.main)

    p = sub.add_parser("bench-dataset", help="structured outputs and n samples: what each costs, in-process")
    bench_dataset.add_arguments(p)
    p.set_defaults(func=bench_dataset.main)

    p = sub.add_parser("generate", help="answer chat prompts offline (arguments, or one per stdin line)")
    p.add_argument("prompt", nargs="*")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens an answer makes at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: %(default)s, greedy)")
    # Not the engine's seed option (left out below): its own name, or the engine would take None as its seed.
    p.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="sampling seed (default: none)")
    add_engine_arguments(p, exclude=("seed",))
    # As ``demo`` and the worker read them (``docker compose exec worker roseinfer generate hi`` ran the default
    # model in float32 on the CPU, saying nothing): under the flags, over the engine's defaults.
    given = {name: os.environ.get(f"ROSEINFER_{name.upper()}", "") for name in ENV_DEFAULTS}
    set_engine_defaults(p, **{name: value for name, value in given.items() if value})
    p.set_defaults(func=_generate)
