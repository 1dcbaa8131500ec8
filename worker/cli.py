"""The ``roseinfer`` command: the engine's commands, the worker's, and the producer's, under one parser.

It lives in ``worker/`` because it may import everything; the engine's own commands (``roseinfer/cli.py``) and
the producer's (``producer/cli.py``) know nothing of each other.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sys
import typing
import warnings

from pydantic import ValidationError

from producer.batch_io import at_least
from producer.connection import QUEUE_URLS_ENV, InvalidRedisURL, queue_urls
from producer.protocol import DEFAULT_QUEUE, installed_version
from producer.reasoning import REASONING_PARSERS
from producer.tool_calls import TOOL_CALL_PARSERS
from roseinfer.config import ConfigError, EngineConfig, engine_options
from worker.settings import ENV_PREFIX, WorkerSettings, unknown_env_vars


def worker_command(redis_url: str, queue: str, model: str, *options: str) -> list[str]:
    """The argv of a ``roseinfer worker`` process (for benchmarks and tests that start one)."""
    argv = [sys.executable, "-m", "worker.cli", "worker", "--redis-url", redis_url, "--queue", queue, "--model", model]
    return [*argv, *options]


def engine_flags(config: EngineConfig) -> list[str]:
    """The ``roseinfer worker`` flags that give a worker this engine config (the model aside)."""
    flags: list[str] = []
    for opt in engine_options():
        value = getattr(config, opt.name)
        if opt.name == "model" or value == opt.default:
            continue
        if isinstance(value, bool):
            flags.append(opt.flag if value else "--no-" + opt.flag[2:])
        else:
            flags += [opt.flag, str(value)]
    return flags


def describe_settings_error(exc: ValidationError) -> str:
    """One line: each problem with the flag and the variable that set it."""
    problems = []
    for err in exc.errors():
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = "unknown setting"
        # The engine's own checks (of the whole) name their option first: "dtype must be one of ...".
        name = str(err["loc"][0]) if err.get("loc") else msg.split(" ", 1)[0]
        if name in WorkerSettings.model_fields:
            problems.append(f"--{name.replace('_', '-')} / {ENV_PREFIX}{name.upper()}: {msg}")
        else:
            problems.append(msg)
    return "; ".join(problems)


def _bool_field(annotation: object) -> bool:
    return annotation is bool or bool in typing.get_args(annotation)


def _add_settings_flags(p: argparse.ArgumentParser) -> None:
    """A flag per setting; values stay strings here and are converted and checked by WorkerSettings."""
    for name, info in WorkerSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        shown = info.get_default(call_default_factory=True)
        default = "" if "default:" in (info.description or "") else f"default: {shown}; "
        text = f"{info.description} ({default}env {ENV_PREFIX}{name.upper()})"
        if _bool_field(info.annotation):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif typing.get_origin(info.annotation) is list:
            p.add_argument(flag, action="append", default=None, metavar=name.upper(), help=text)
        else:
            p.add_argument(flag, default=None, metavar=name.upper(), help=text)


def load_settings(args: argparse.Namespace, **fixed: object) -> WorkerSettings:
    """Flags given on the command line, the rest from ROSEINFER_* variables and defaults."""
    given = {name: getattr(args, name, None) for name in WorkerSettings.model_fields}
    if given["redis_url"] == "":  # (the variable's message named ROSEINFER_REDIS_URL: the flag's own words)
        raise InvalidRedisURL("--redis-url is empty: give a Redis URL, or leave the flag out")
    if given["redis_url"] is None and "redis_url" not in fixed:  # the queue's entry in ROSEINFER_QUEUE_URLS, as the
        # producers read it (before ROSEINFER_REDIS_URL): a worker sharing their env file served another Redis
        queue = given["queue"] or os.environ.get(f"{ENV_PREFIX}QUEUE") or DEFAULT_QUEUE
        given["redis_url"] = queue_urls(os.environ.get(QUEUE_URLS_ENV)).get(queue)
    return WorkerSettings(**{name: v for name, v in given.items() if v is not None}, **fixed)


def worker(args: argparse.Namespace) -> int:
    settings = load_settings(args)  # every configuration error surfaces here, before Redis or the model
    from worker.main import run_worker

    level = "DEBUG" if args.verbose else settings.log_level
    logging.getLogger().setLevel(level)  # (the engine's own process takes it from here)
    return run_worker(settings, logging_level=level)


def demo(args: argparse.Namespace) -> int:
    from worker.demo import run_demo

    if not args.verbose:  # the tokens stream on stdout: the worker's per-job lines (stderr) broke into them
        for name in ("rq", "roseinfer.worker"):
            logging.getLogger(name).setLevel(logging.WARNING)

    return run_demo(args.prompt, model=args.model, dtype=args.dtype, max_tokens=args.max_tokens)


def _as_browsers_send(origin: str) -> str:
    """An allowed origin as a browser's ``Origin`` header writes it (scheme and host in lower case, no default
    port), which the server compares byte for byte: "HTTP://Good.Example" or "http://good.example:80" matched no
    request. ConfigError for anything but scheme://host[:port] or *."""
    if origin == "*":
        return origin
    found = re.fullmatch(r"([A-Za-z][A-Za-z0-9+.-]*)://([^/\s?#:]+|\[[0-9A-Fa-f:.]+\])(?::(\d+))?", origin)
    if found is None:
        raise ConfigError(
            f"--allowed-origins (or ROSEINFER_ALLOWED_ORIGINS) {origin!r}: an origin is scheme://host[:port], as a "
            "browser sends it (e.g. http://localhost:3000, no path or trailing slash), or *"
        )
    scheme, host, port = found.group(1).lower(), found.group(2).lower(), found.group(3)
    default = {"http": "80", "https": "443"}.get(scheme)
    return f"{scheme}://{host}" + (f":{port}" if port is not None and port != default else "")


def serve(args: argparse.Namespace) -> int:
    from producer.cli import target
    from producer.server import run_server  # FastAPI and uvicorn: only this command needs them

    if args.api_key is not None and not args.api_key.strip():  # (--api-key "$KEY", KEY unset: served open)
        raise ConfigError("--api-key is empty (an unset variable?): give the key, or leave the flag out to serve open")
    if args.allowed_origins:  # ("a,b" as one value matched no origin)
        values = [o.strip() for value in args.allowed_origins for o in value.split(",") if o.strip()]
        args.allowed_origins = [_as_browsers_send(origin) for origin in values]
    given = [flag for flag, value in (("--model", args.model), ("--dtype", args.dtype)) if value is not None]
    if given and not args.embedded:  # (they started a server all the same, serving whatever the queue's workers hold)
        raise ConfigError(f"{given[0]} is for --embedded: without it, the queue's workers choose their model")
    if args.embedded and args.redis_url is not None:  # (it served its own Redis all the same, the one named let be)
        raise ConfigError("--redis-url is for a server in front of a queue's workers; --embedded runs its own")
    # The flags first (a mistake in them is said whatever the port), then the port: a port taken said in one line,
    # before "serving", not after it.
    _check_listen(args.host, args.port)
    if not args.embedded:
        return run_server(
            *target(args), host=args.host, port=args.port, api_key=args.api_key, timeout=args.timeout,
            tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
            allowed_origins=args.allowed_origins,
        )  # fmt: skip
    from worker.embedded import serve_embedded

    return serve_embedded(args)


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 1 to 65535."""
    port = at_least(int, 1)(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {text}")
    return int(port)


def _check_listen(host: str, port: int) -> None:
    """Whether the server can listen on host:port: a ConfigError saying why not (a port taken, an address this
    machine does not have)."""
    try:
        # The family of the address (:: and ::1 are IPv6's), as uvicorn resolves it.
        family, *_, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        with socket.create_server(address[:2], family=family):
            pass
    except OSError as exc:
        why = (exc.strerror or str(exc)).split(" (while attempting")[0]  # (create_server's text repeats the address)
        raise ConfigError(f"cannot listen on {host}:{port} ({why}); choose another --host or --port") from None


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker",
        help="serve a Redis queue: many jobs at once in one engine",
        description="Serve a Redis queue with one engine. Every flag can also be set by the environment "
        "variable named in its help; flags win over variables.",
    )
    _add_settings_flags(p)
    p.set_defaults(func=worker)

    from producer.cli import add_connection_arguments

    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server over the queue (chat, text completions, responses)"
    )
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s)")
    p.add_argument("--port", type=port_number, default=8000, help="the port to listen on (default: %(default)s)")
    p.add_argument(
        "--api-key", default=os.environ.get("ROSEINFER_API_KEY") or None,
        help="a bearer token every /v1 request must carry (default: $ROSEINFER_API_KEY, kept out of ps as vLLM's "
        "VLLM_API_KEY is)",
    )  # fmt: skip
    p.add_argument(
        "--timeout", type=at_least(float, 0, inclusive=False), default=600.0,
        help="seconds a request waits for its job (default: %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
        help='the model\'s own tool-call format, read for tool_choice "auto" (vLLM\'s names; hermes: <tool_call> '
        "blocks of Hermes and Qwen; llama3_json: Llama 3.1-3.3's JSON calls; mistral: [TOOL_CALLS]; pythonic: "
        "[f(a=1)], Llama 3.2 and 4); without it, \"auto\" with tools is a 400",
    )  # fmt: skip
    p.add_argument(
        "--reasoning-parser", choices=REASONING_PARSERS, default=None,
        help="tell a reasoning model's thinking from its answer: a chat message's reasoning (vLLM's names; "
        "deepseek_r1: all before </think>; qwen3: a <think> block the output begins with; mistral: [THINK] so)",
    )  # fmt: skip
    p.add_argument(
        "--allowed-origins", nargs="+", metavar="ORIGIN",
        default=os.environ.get("ROSEINFER_ALLOWED_ORIGINS", "").replace(",", " ").split() or None,
        help="web origins whose pages may call the API from a browser (CORS), e.g. http://localhost:3000, or * for "
        "any (default: $ROSEINFER_ALLOWED_ORIGINS, space- or comma-separated, else none: vLLM allows any origin by "
        "default, which lets any web page its users open drive a server on their machine)",
    )  # fmt: skip
    p.add_argument(
        "--embedded", action="store_true",
        help="also start a private Redis and a worker in this process: one command, nothing else to install",
    )  # fmt: skip
    p.add_argument("--model", default=None, help="with --embedded (default: ROSEINFER_MODEL, else the default model)")
    p.add_argument("--dtype", default=None, help="with --embedded (default: ROSEINFER_DTYPE, else float32)")
    add_connection_arguments(p)
    p.set_defaults(func=serve)

    p = sub.add_parser("demo", help="the whole flow on one machine: embedded Redis, a worker, jobs, live tokens")
    p.add_argument(
        "prompt", nargs="*", help='prompts, one an argument: quote a prompt of several words ("Write a haiku")'
    )
    p.add_argument("--model", default=None, help="default: ROSEINFER_MODEL, else the default model")
    p.add_argument("--dtype", default=None, help="default: ROSEINFER_DTYPE, else float32")
    p.add_argument(
        "--max-tokens", type=at_least(int, 1), default=64, help="tokens a job makes at most (default: %(default)s)"
    )
    p.set_defaults(func=demo)

    from worker import bench_priority, bench_queue, bench_redis, bench_serve

    for name, module, help_text in (
        ("bench-queue", bench_queue, "the bench workload through Redis and a worker, vs in-process and stock rq"),
        ("bench-priority", bench_priority, "an interactive job's TTFT on a worker full of bulk jobs, by priority"),
        ("bench-serve", bench_serve, "streamed requests through roseinfer serve vs the same jobs submitted"),
        ("bench-redis", bench_redis, "what generated tokens cost Redis: commands, CPU, bytes (tiny model)"),
    ):
        p = sub.add_parser(name, help=help_text)
        module.add_arguments(p)
        p.set_defaults(func=module.main)


class _Parser(argparse.ArgumentParser):
    """A bad flag or value is one line on stderr, exit 2 (argparse's usage before it was 25 lines for ``submit``)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: typing.Any = None, namespace: typing.Any = None) -> argparse.Namespace:
        # A flag no parser knows is said by the command's parser (argparse's top one said "see roseinfer --help",
        # which lists no command's flags).
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            subparsers = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
            command = subparsers[0].choices.get(getattr(parsed, subparsers[0].dest, None)) if subparsers else None
            (command or self).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    from producer import cli as producer_cli
    from roseinfer import cli as engine_cli

    # (its commands' parsers are of its class: add_subparsers takes the parent's)
    parser = _Parser(prog="roseinfer", description="roseinfer: a job-queue batch inference worker")
    parser.add_argument("--version", action="version", version=f"roseinfer {installed_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    engine_cli.add_parsers(sub)
    add_parsers(sub)
    producer_cli.add_parsers(sub)
    return parser


def _tolerant_output() -> None:
    """A stdout that is not UTF-8 (a Windows console's cp1252, ``PYTHONIOENCODING=ascii``) writes a character it
    lacks as "?": a streamed text's first such character was a UnicodeEncodeError mid-job. (stderr escapes them
    already, Python's default there.)"""
    stream = sys.stdout
    encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "")
    if encoding not in ("utf8", "utf8sig") and hasattr(stream, "reconfigure"):
        stream.reconfigure(errors="replace")


def main(argv: list[str] | None = None) -> int:
    _tolerant_output()
    for warning in unknown_env_vars():
        print(warning, file=sys.stderr)
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose or args.command in ("worker", "demo") else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",  # (the level: a warning told from a start)
    )
    import redis
    from pydantic_settings import SettingsError
    from redis.sentinel import MasterNotFoundError

    from producer import cli as producer_cli
    from producer.connection import REDIS_DOWN, InvalidRedisURL, UnsafeRedis
    from producer.job_errors import InvalidRequest, StreamGap
    from producer.protocol import InvalidQueueName
    from roseinfer.config import ConfigError

    try:
        with warnings.catch_warnings():  # a library's warning (Redis may evict the queue) as one line, as ours are
            warnings.showwarning = _warning_line
            return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`| head`): quietly, as a command killed by SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit's flush would raise again)
        return 141
    except ValidationError as exc:
        print(f"error: {describe_settings_error(exc)}", file=sys.stderr)
    except SettingsError as exc:  # a ROSEINFER_* variable that does not parse (a list that is not JSON, say)
        field = re.search(r'field "(\w+)"', str(exc))
        name = f"ROSEINFER_{field.group(1).upper()}" if field else "a ROSEINFER_* variable"
        print(f"error: {name} does not parse ({exc.__cause__}); list settings take JSON: '[\"a\", \"b\"]'",
              file=sys.stderr)  # fmt: skip
    except (ConfigError, InvalidRequest, UnsafeRedis, InvalidRedisURL, InvalidQueueName) as exc:
        print(f"error: {exc}", file=sys.stderr)
    except REDIS_DOWN as exc:
        # (a Sentinel's "no master" names every sentinel client it tried, pools and all: a line of 1.5 KB)
        why = str(exc).split(" : <")[0] if isinstance(exc, MasterNotFoundError) else str(exc)
        said = _refused_login(exc) or f"cannot reach Redis ({why})"
        print(f"error: {said}; check {producer_cli.url_settings(args)}", file=sys.stderr)
    except redis.exceptions.OutOfMemoryError as exc:  # (no URL at fault: the server is full)
        print(f"error: Redis is full ({exc}): it takes no writes until it has room (maxmemory); the jobs already "
              "queued go on", file=sys.stderr)  # fmt: skip
        return 75  # EX_TEMPFAIL: try again later
    except redis.exceptions.RedisError as exc:  # e.g. a database number the server does not have
        said = _refused_login(exc) or f"Redis refused ({type(exc).__name__}: {exc})"
        print(f"error: {said}; check {producer_cli.url_settings(args)}", file=sys.stderr)
    except StreamGap as exc:  # the stream lost events (a short --stream-maxlen): the result holds them
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except TimeoutError as exc:  # --timeout of a wait, a stream or a result ran out: the job goes on
        print(f"error: {exc}", file=sys.stderr)
        return 124  # as timeout(1)
    except ModuleNotFoundError as exc:  # a plain `pip install roseinfer` is the producer's: the rest are extras
        # (a module in two extras: the engine's but for serve, which runs no engine unless --embedded)
        order = sorted(EXTRAS, key=lambda e: e != ("server" if args.command == "serve" else "engine"))
        extra = next((e for e in order if (exc.name or "").split(".")[0] in EXTRAS[e]), None)
        if extra is None:
            raise
        print(f"error: roseinfer {args.command} needs {exc.name}: pip install 'roseinfer[{extra}]'", file=sys.stderr)
    return 2


def _warning_line(message: Warning | str, *_where: object, **_kw: object) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _refused_login(exc: Exception) -> str | None:
    """The words for an error that is Redis refusing this client's login (no password given, a wrong one), which
    redis-py raises as several kinds of error; None for any other."""
    from redis.exceptions import AuthenticationError

    text = str(exc)
    # No login sent ("refused" misled): Redis's NOAUTH, which older redis-py says as "Authentication required."
    if any(mark in text for mark in ("NOAUTH", "HELLO must be called", "Authentication required")):
        return "this Redis asks for a password and the URL gives none: redis://:PASSWORD@host:port/0 (or USER:PASSWORD)"
    if isinstance(exc, AuthenticationError) or any(mark in text for mark in ("WRONGPASS", "invalid username-password")):
        return f"Redis refused the login ({text}): the URL's user or password"
    return None


# Which extra installs the packages a command imports (pyproject.toml's optional dependencies).
EXTRAS = {  # (prometheus_client is in both: a worker imports it before torch)
    "server": ("fastapi", "uvicorn", "tokenizers", "prometheus_client"),
    "engine": ("torch", "transformers", "safetensors", "huggingface_hub", "gguf", "accelerate", "llguidance",
               "fakeredis", "lupa", "prometheus_client"),
    "parquet": ("pyarrow",),
    "datasets": ("datasets",),
}  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
