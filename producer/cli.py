"""``roseinfer submit | result | cancel | status | batch``: the producer's commands (no engine needed)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from rq.job import Job

from producer.batch_io import OUTPUT_EXTENSIONS, at_least
from producer.client import DEFAULT_JOB_TIMEOUT, DEFAULT_REDIS_URL, Client, validate
from producer.connection import QUEUE_URLS_ENV, REDIS_UNAVAILABLE, InvalidRedisURL, queue_urls, redacted_url
from producer.generation_job import GenerationJob
from producer.job_errors import InvalidRequest, JobError, ResultNotKept, StreamRestarted
from producer.protocol import (
    BULK_PRIORITY,
    DEFAULT_QUEUE,
    InvalidQueueName,
    check_queue_name,
    mixed_models,
    queue_of_lane,
    stream_key,
)
from producer.reasoning import REASONING_PARSERS
from producer.schema import MODEL_RECOMMENDED, JobRequest
from producer.tool_calls import TOOL_CALL_PARSERS

# Payload fields that take a JSON value on the command line (a flag of their own each).
_JSON_FLAGS = (
    "messages",  # a whole conversation (a system message, earlier turns) in place of the prompt
    "metadata",
    "structured_outputs",
    "response_format",
    "logit_bias",
    "stream_options",
    "tools",
    "chat_template_kwargs",
)
# Payload fields that get no derived flag: the prompt is the positional argument, the others take JSON.
_NOT_FLAGS = ("prompt", *_JSON_FLAGS)
_SCALARS = (bool, int, float, str)
_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_METAVARS = {bool: "BOOL", int: "INT", float: "FLOAT", str: "TEXT"}
_BOUNDS = {"ge": ">= {}", "gt": "> {}", "le": "<= {}", "lt": "< {}", "max_length": "at most {} characters"}

DEFAULT_MAX_IN_FLIGHT = 256
DEFAULT_LOG_INTERVAL = 10.0


@dataclass(frozen=True)
class PayloadFlag:
    """A ``roseinfer submit`` flag for one JobRequest field, derived from its annotation."""

    field: str
    flags: tuple[str, ...]
    kinds: tuple[type, ...]  # the scalar types a value may take, tried in the annotation's order
    repeatable: bool  # a list field: the flag may be given several times
    help: str

    def convert(self, text: str) -> Any:
        for kind in self.kinds:
            if kind is bool:
                if text.lower() in ("true", "false"):
                    return text.lower() == "true"
                continue
            try:
                return kind(text)
            except ValueError:
                continue
        words = " or ".join(_TYPE_WORDS[k] for k in self.kinds)
        raise InvalidRequest(f"invalid job: {self.field}: {text!r} is not {words}")


def _members(annotation: Any) -> list[Any]:
    """A field's types, None and Annotated stripped: ``NonNegInt | None`` -> ``[int]``."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _members(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [m for arg in get_args(annotation) for m in _members(arg)]
    return [] if annotation is type(None) else [annotation]


def _bounds(annotation: Any, metadata: list[Any], listed: bool = False) -> list[str]:
    """``>= 0.0``, ``<= 2.0``, ... from the field's constraints and those of Annotated types inside it.
    ``listed``: a list field, whose own length bound counts values, not characters."""
    found = [(m, listed) for m in metadata]
    stack = [annotation]
    while stack:
        a = stack.pop()
        if get_origin(a) is Annotated:
            for extra in get_args(a)[1:]:
                found.extend((m, False) for m in getattr(extra, "metadata", [extra]))
        stack.extend(get_args(a)[:1] if get_origin(a) is Annotated else get_args(a))
    out = []
    for m, of_list in found:
        for attr, form in _BOUNDS.items():
            if attr == "max_length" and of_list:
                form = "at most {} values"
            if getattr(m, attr, None) is not None and form.format(getattr(m, attr)) not in out:
                out.append(form.format(getattr(m, attr)))
    return out


def payload_flags() -> list[PayloadFlag]:
    """One flag per JobRequest field of scalar type (int, float, bool, str) or list of one; others are skipped."""
    flags = []
    for name, field in JobRequest.model_fields.items():
        if name in _NOT_FLAGS:
            continue
        kinds: list[type] = []
        repeatable, expressible, choices = False, True, ()
        for m in _members(field.annotation):
            if get_origin(m) is Literal and all(isinstance(a, str) for a in get_args(m)):
                m, choices = str, get_args(m)  # (a word of a few: the payload's check names them if wrong)
            if get_origin(m) is list:
                repeatable = True
                items = _members(get_args(m)[0])
                expressible &= len(items) == 1 and items[0] in _SCALARS
                m = items[0] if items else None
            if m in _SCALARS:
                kinds += [m] if m not in kinds else []
            else:
                expressible = False
        if not expressible or not kinds:
            continue
        # a list-only field (stop_token_ids) gives one value per flag: --stop-token-id 2 --stop-token-id 7
        singular = name.endswith("s") and _is_list_only(field.annotation)
        names = ("--" + name[:-1].replace("_", "-"),) if singular else ()
        names += ("--" + name.replace("_", "-"),)
        default = "none" if field.default is None else json.dumps(field.default)
        detail = [] if kinds == [bool] else [" or ".join(_TYPE_WORDS[k] for k in kinds)]  # a switch: no value
        detail = [f"one of {', '.join(choices)}"] if choices else detail
        detail += _bounds(field.annotation, field.metadata, repeatable)
        if repeatable:
            detail.append("repeatable")
        if "default:" not in (field.description or ""):  # (a description may say its default in words)
            recommended = (
                "the model's recommendation (its generation config), else " if name in MODEL_RECOMMENDED else ""
            )
            detail.append(f"default: {recommended}{default}")
        help_text = f"{field.description or name}" + (f" ({'; '.join(detail)})" if detail else "")
        flags.append(PayloadFlag(name, names, tuple(kinds), repeatable, help_text.replace("%", "%%")))
    return flags


def _is_list_only(annotation: Any) -> bool:
    return all(get_origin(m) is list for m in _members(annotation))


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    # None: not given here, so resolved from the environment when connecting (and left out of a resume command).
    p.add_argument(
        "--redis-url",
        default=None,
        help="the Redis the workers serve (default: the queue's in $ROSEINFER_QUEUE_URLS, else "
        f"$ROSEINFER_REDIS_URL, else {DEFAULT_REDIS_URL})",
    )
    p.add_argument(
        "--queue", default=None, help=f"the queue name (default: $ROSEINFER_QUEUE if set, else {DEFAULT_QUEUE})"
    )


def target(args: argparse.Namespace) -> tuple[str, str]:
    """(Redis URL, queue): the queue from --queue, else the environment, else the default; its Redis from
    --redis-url, else the queue's entry in ROSEINFER_QUEUE_URLS, else ROSEINFER_REDIS_URL, else the default."""
    # (an empty --queue or ROSEINFER_QUEUE is refused, as the worker refuses it: not the default queue)
    queue = args.queue if args.queue is not None else os.environ.get("ROSEINFER_QUEUE", DEFAULT_QUEUE)
    try:
        check_queue_name(queue)
    except InvalidQueueName as exc:
        raise InvalidQueueName(f"--queue / ROSEINFER_QUEUE {queue!r}: {exc}") from None
    mapped = queue_urls(os.environ.get(QUEUE_URLS_ENV)).get(queue)
    # (an empty one is refused, as the worker refuses it: not taken for the default, another Redis than meant)
    if args.redis_url is not None and not args.redis_url.strip():
        raise InvalidRedisURL("--redis-url is empty: give a Redis URL, or leave the flag out")
    env_url = os.environ.get("ROSEINFER_REDIS_URL")
    if not args.redis_url and not mapped and env_url is not None and not env_url.strip():
        raise InvalidRedisURL(
            f"ROSEINFER_REDIS_URL is set but empty: give a Redis URL, or unset it ({DEFAULT_REDIS_URL})"
        )
    url = args.redis_url or mapped or env_url or DEFAULT_REDIS_URL
    return url, queue


def url_settings(args: argparse.Namespace) -> str:
    """Where to fix the Redis URL a command could not reach: the queue's ROSEINFER_QUEUE_URLS entry where that gave
    it (which an error naming only --redis-url and ROSEINFER_REDIS_URL left unsaid): a producer command's, or the
    worker's, which reads it too."""
    if hasattr(args, "queue") and hasattr(args, "redis_url") and not args.redis_url:
        with contextlib.suppress(InvalidRedisURL, InvalidQueueName):
            queue = target(args)[1]
            if queue in queue_urls(os.environ.get(QUEUE_URLS_ENV)):
                return f"{QUEUE_URLS_ENV} (its entry for queue {queue!r})"
    return "--redis-url or ROSEINFER_REDIS_URL"


def _client(args: argparse.Namespace, **options: Any) -> Client:
    return Client(*target(args), **options)


def _stdin_text() -> str:
    """The prompt piped in: UTF-8 (a BOM is no text); other bytes are the request's fault, in one line."""
    raw = getattr(sys.stdin, "buffer", None)  # (a stdin of text already, as a test's, has none)
    try:
        text = (raw.read().decode("utf-8") if raw is not None else sys.stdin.read()).removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the prompt on stdin is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not text.strip():  # (a chat ran an empty user message: an empty pipe is a mistake, not a question)
        raise InvalidRequest("the prompt on stdin is empty")
    return text


def request_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The job payload the flags describe, validated by JobRequest: InvalidRequest before Redis is touched."""
    if args.prompt is None and not getattr(args, "prompt_token_ids", None) and args.messages is None:
        raise InvalidRequest("give a prompt (or - to read it from stdin), --messages JSON, or --prompt-token-id ...")
    if args.prompt is not None and args.messages is not None:  # (which one was meant is not ours to guess)
        raise InvalidRequest("give a prompt or --messages, not both")
    if args.raw and args.messages is not None:  # (it was dropped without a word)
        raise InvalidRequest("--raw sends the prompt argument without the chat template: it takes no --messages")
    request: dict[str, Any] = {}
    if args.prompt is not None:  # none with --prompt-token-id: the ids are the prompt
        prompt = args.prompt if args.prompt != "-" else _stdin_text()
        if not prompt.strip():  # (as --raw refuses it; a chat ran an empty user message)
            raise InvalidRequest("the prompt is empty")
        request = {"prompt": prompt} if args.raw else {"messages": [{"role": "user", "content": prompt}]}
    for flag in payload_flags():
        value = getattr(args, flag.field)
        if value is None:
            continue
        if isinstance(value, bool):  # --ignore-eos / --no-ignore-eos
            request[flag.field] = value
        elif flag.repeatable:
            request[flag.field] = [flag.convert(v) for v in value]
        else:
            request[flag.field] = flag.convert(value)
    for name in _JSON_FLAGS:
        value = getattr(args, name)
        if value is None:
            continue
        label = f"invalid job: {name}"
        request[name] = _response_format(value, label) if name == "response_format" else _json_value(label, value)
    validate(request)
    return request


def _report(exc: JobError, print_result: bool = True) -> int:
    """A job that ended without a result: what the worker stored (partial text of a canceled job) on stdout,
    the reason on stderr."""
    if exc.result is not None and print_result:
        print(json.dumps(exc.result, ensure_ascii=False))
        what = "what it had generated" if exc.result.get("text") else "what the worker stored"
        print(f"error: {exc} ({what} is on stdout)", file=sys.stderr)
    else:
        print(f"error: {exc}", file=sys.stderr)
    return 1


def submit(args: argparse.Namespace) -> int:
    request = request_from_args(args)
    if args.timeout is not None and not (args.stream or args.wait):  # (a submit alone waits for nothing)
        raise InvalidRequest("--timeout bounds the wait of --stream or --wait: give one of them")
    if args.stream and args.wait:  # (--wait was dropped unsaid: the text streamed, no result printed)
        raise InvalidRequest("--stream prints the text as it comes, --wait the result as JSON: give one of them")
    if args.stream and request.get("n", 1) > 1:  # it printed sample 0 alone, and exited 0
        raise InvalidRequest("--stream prints one sample; with --n over 1 use --wait (the result holds every sample)")
    client = _client(args)
    job = client.submit(**request)
    if not args.stream and not args.wait:
        print(job.id)
        return 0
    print(f"job {job.id}", file=sys.stderr)
    return _follow(client, job, args.stream, args.timeout, args=args)


def stream(args: argparse.Namespace) -> int:
    """``roseinfer stream JOB_ID``: a job's text from its first token (replayed, then live), as ``submit --stream``
    prints it, from any shell, at any time: after a Ctrl-C, or for a job submitted elsewhere."""
    client = _client(args)
    job = client.job(args.job_id)
    status = job.status()  # (a first look: a wrong URL is said as such, before any wait)
    client.reached = True
    # (a job of result_ttl 0 is deleted as it finishes; its stream is kept a while, and replayed)
    if status == "missing" and not client.connection.exists(stream_key(job.id)):
        print(f"error: no job {args.job_id} on this Redis (never submitted, or expired)", file=sys.stderr)
        return 1
    if (n := job.samples() or 1) > 1:  # (submit --stream refuses them too: it printed sample 0 alone, and exited 0)
        raise InvalidRequest(f"job {job.id} makes {n} samples: `{_command('result', job.id, args)}` prints them all")
    live = status in ("queued", "started", "deferred", "scheduled")  # (a job over needs no worker)
    # The job's own queue (an id is Redis-wide), not --queue: a warning about another queue sent users astray.
    origin = client.connection.hget(Job.key_for(job.id), "origin")
    queue = queue_of_lane(origin.decode(errors="replace")) if origin else None
    return _follow(client, job, True, args.timeout, warn=live, queue=queue, args=args)


def _follow(
    client: Client,
    job: GenerationJob,
    streamed: bool,
    timeout: float | None,
    warn: bool = True,
    queue: str | None = None,
    args: argparse.Namespace | None = None,
) -> int:
    """Wait for ``job``: its text printed as it comes (``streamed``), then its usage; or its result as JSON.
    ``warn``: say so if no live worker serves the queue (or ``queue``: a wait that could last for good). ``args``:
    the command's, whose Redis and queue the hints printed after an interruption name."""
    if warn and (warning := client.no_worker_warning(queue)) is not None:
        print(warning, file=sys.stderr)
    restarted = line_open = False  # line_open: text out on stdout with no line end after it
    deadline = None if timeout is None else time.monotonic() + timeout  # the stream and the result's wait

    def left() -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    try:
        while streamed:
            try:
                for piece in job.stream(timeout=left()):
                    sys.stdout.write(piece)
                    sys.stdout.flush()
                    line_open = not piece.endswith("\n")
            except StreamRestarted:
                print("\n[the job restarted from the beginning; what is above is void]", file=sys.stderr)
                restarted = True
                continue
            sys.stdout.write("\n")
            line_open = False
            break
        result = job.result(timeout=left())
    except JobError as exc:
        if not (streamed and isinstance(exc, ResultNotKept)):
            _end_the_text_line(line_open)
            return _report(exc, print_result=not streamed)  # streamed: its text is already out
        result = None  # finished, its text out: result_ttl 0 keeps no result (it exited 1, as a failed job does)
    except REDIS_UNAVAILABLE as exc:  # (the submit went in: the URL is right, not to be checked)
        _end_the_text_line(line_open)
        return _lost_redis(job.id, exc, args, "stream" if streamed else "result")
    except KeyboardInterrupt:  # only the wait stops: said, with how to stop the job too
        again = _follow_or_cancel(job.id, args, streamed)
        print(f"\ninterrupted: job {job.id} goes on in the workers; {again}", file=sys.stderr)
        return 130
    except TimeoutError as exc:  # --timeout ran out: the job goes on all the same
        _end_the_text_line(line_open)
        said = str(exc)
        if timeout is not None:  # the --timeout given, not what was left of it for the last wait
            said = re.sub(r"within \S+ s", f"within {timeout:g} s", said, count=1)
        print(f"error: {said}; it goes on in the workers: {_follow_or_cancel(job.id, args, streamed)}", file=sys.stderr)
        return 124  # as timeout(1)
    if restarted:  # stdout (a file, a pipe) holds void text before the answer: not a clean success
        print(f"error: job {job.id}'s output restarted after some of it went out: stdout holds void text before its "
              f"answer; `{_command('result', job.id, args)}` prints the answer alone", file=sys.stderr)  # fmt: skip
        return 1
    if streamed and result is None:
        print("[finished; its result is not kept (result_ttl 0, or expired)]", file=sys.stderr)
    elif streamed:
        u, ttft = result["usage"], (result.get("timings") or {}).get("ttft_s")
        print(
            f"[{result['finish_reason']}; {u['prompt_tokens']} prompt + {u['completion_tokens']} completion tokens; "
            f"ttft {'-' if ttft is None else f'{ttft:.3f} s'}]",
            file=sys.stderr,
        )
    else:
        print(json.dumps(result, ensure_ascii=False))
    return 0


def _lost_redis(job_id: str, exc: Exception, args: argparse.Namespace | None, verb: str = "result") -> int:
    """Redis went away during a wait, for longer than a follower waits it out (or than ``--timeout``): the job goes
    on in the workers. It said "cannot reach Redis; check --redis-url" with exit 2, as for a wrong URL. ``verb``:
    the command that takes the wait up again (``stream`` for a stream's)."""
    print(f"error: lost Redis while waiting ({exc}); job {job_id} goes on in the workers: "
          f"`{_command(verb, job_id, args)}` once Redis answers", file=sys.stderr)  # fmt: skip
    return 1


def _end_the_text_line(line_open: bool) -> None:
    """A streamed text's last line ended before an error is said (the error read as the text's last words)."""
    if line_open:
        sys.stdout.write("\n")
        sys.stdout.flush()


def _follow_or_cancel(job_id: str, args: argparse.Namespace | None, streamed: bool) -> str:
    """How to take up the wait again, as it was (``streamed``: its text, else its result: a job of n > 1 samples
    has no stream to follow, and ``stream`` refused it), and how to stop the job."""
    again = "follows it again" if streamed else "waits for its result again"
    verb = "stream" if streamed else "result"
    return f"`{_command(verb, job_id, args)}` {again}, `{_command('cancel', job_id, args)}` stops it"


def _command(verb: str, job_id: str, args: argparse.Namespace | None) -> str:
    """``roseinfer VERB JOB_ID`` with the --redis-url and --queue this command was given: pasted as printed, it
    reaches the same Redis (but for a password in the URL, left out: stderr goes to logs)."""
    argv = ["roseinfer", verb, job_id]
    for flag, value in (("--redis-url", getattr(args, "redis_url", None)), ("--queue", getattr(args, "queue", None))):
        if value:
            argv += [flag, redacted_url(value) if flag == "--redis-url" else value]
    return shlex.join(argv)


def result(args: argparse.Namespace) -> int:
    client = _client(args)
    try:
        print(json.dumps(client.job(args.job_id).result(timeout=args.timeout), ensure_ascii=False))
    except JobError as exc:
        return _report(exc)
    except TimeoutError as exc:
        print(
            f"error: {exc}; it goes on in the workers: {_follow_or_cancel(args.job_id, args, False)}", file=sys.stderr
        )
        return 124
    except REDIS_UNAVAILABLE as exc:
        if not client.reached:  # (never answered: a wrong URL, said as such)
            raise
        return _lost_redis(args.job_id, exc, args)
    except KeyboardInterrupt:  # only the wait stops: said as a stream's is (it was a bare "interrupted")
        print(f"interrupted: job {args.job_id} goes on in the workers; {_follow_or_cancel(args.job_id, args, False)}",
              file=sys.stderr)  # fmt: skip
        return 130
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
    if st["stalled"]:
        print(f"{st['stalled']} started jobs whose worker stopped beating (dead or frozen): a live worker's "
              "maintenance takes them back")  # fmt: skip
    if st["rejected"]:
        print(f"{st['rejected']} jobs put aside unread (a job hash RQ cannot read), each failed with its reason")
    if len(st["lanes"]) > 1:  # queued per priority lane, lowest (first served) first
        print(
            "lanes: " + ", ".join(f"priority {p}: {n}" for p, n in sorted(st["lanes"].items(), key=lambda x: int(x[0])))
        )
    if st.get("redis", "ok") != "ok":
        print(f"Redis is {st['redis']}")
    print(f"{len(st['workers'])} workers, {st['tokens_per_s']:.1f} tokens/s")
    if len(served := sorted({w["model"] for w in st["workers"] if w.get("model")})) > 1:
        print(f"warning: {mixed_models(st['queue'], served)}")  # (as the server says it)
    for w in st["workers"]:
        redis_state = "" if w.get("redis", "ok") == "ok" else f"  Redis refuses writes: {w['redis']}"
        numerics = ", ".join(x for x in (w.get("dtype"), w.get("quantization")) if x)
        print(
            f"  {w['name']}  {w['state']:<8} {w['model']}{f' ({numerics})' if numerics else ''}  {w['in_flight']} in "
            f"flight  {w['tokens_per_s']:.1f} tok/s{redis_state}"
        )
    return 0


def _run_id(text: str) -> str:
    from producer.batch import RUN_ID

    if not RUN_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(f"a run id is 1 to 32 letters and digits, got {text!r}")
    return text


def resume_command(args: argparse.Namespace, run_id: str | None, fresh: bool = False) -> str:
    """The command that resumes this batch: the same one, a --fresh run's id pinned so its jobs are picked up
    (``fresh``: a --fresh run stopped before it began, run again as it was)."""
    argv = ["roseinfer", "batch", args.input, "-o", args.output, *(["--fresh"] if fresh else [])]
    options = (
        ("--errors", args.errors, None),
        ("--max-in-flight", args.max_in_flight, DEFAULT_MAX_IN_FLIGHT),
        ("--timeout", args.timeout, None),
        ("--log-interval", args.log_interval, DEFAULT_LOG_INTERVAL),
        ("--run-id", run_id, None),
        ("--format", args.format, None),
        ("--output-format", args.output_format, None),
        ("--prompt-column", args.prompt_column, None),
        ("--messages-column", args.messages_column, None),
        ("--chat", args.chat or None, None),
        ("--system", args.system, None),
        ("--id-column", args.id_column, None),
        ("--max-tokens", args.max_tokens, None),
        ("--temperature", args.temperature, None),
        ("--seed", args.seed, None),
        ("--n", args.n, None),
        ("--response-format", args.response_format, None),
        ("--tool-call-parser", args.tool_call_parser, None),
        ("--reasoning-parser", args.reasoning_parser, None),
        ("--priority", args.priority, BULK_PRIORITY),
        ("--redis-url", args.redis_url and redacted_url(args.redis_url), None),  # (a password left out: logs)
        ("--queue", args.queue, None),
    )
    for flag, value, default in options:
        if value is True:  # a switch
            argv.append(flag)
        elif value is not None and value != default:
            argv += [flag, str(value)]
    return shlex.join(argv)


def _json_value(label: str, value: str) -> Any:
    """A JSON flag's value: the JSON itself, or ``@FILE`` (curl's way) for a file that holds it. ``label`` starts the
    error's line."""
    text = value
    if value.startswith("@"):
        try:
            text = Path(value[1:]).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"{label} {value}: cannot read it ({exc})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        where = f" {value}" if value.startswith("@") else ""
        raise InvalidRequest(f"{label}{where}: not JSON ({exc})") from None


def _response_format(value: str, label: str = "--response-format") -> dict[str, Any]:
    """``--response-format``: OpenAI's response_format object or a bare JSON schema, given inline, as ``@FILE``, or
    (the way ``batch`` always took it) as a file's path."""
    inline = value.lstrip().startswith("{") or value.startswith("@")
    if not inline and not Path(value).is_file():
        raise InvalidRequest(f"{label} {value}: neither a JSON object nor a file")
    source = value if inline else "@" + value
    parsed = _json_value(label, source)
    if not isinstance(parsed, dict):
        raise InvalidRequest(f"{label} {value}: not a JSON object")
    if parsed.get("type") in ("text", "json_object", "json_schema"):
        return parsed
    stem = Path(source[1:]).stem if source.startswith("@") else ""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", stem)[:64]  # (the API's pattern for a schema's name)
    return {"type": "json_schema", "json_schema": {"name": name or "schema", "schema": parsed}}


def _tokenizer(name: str) -> Any:
    """A transformers tokenizer from a model folder (or a hub id in the local cache): the producer holds no model, so
    ``--count-tokens`` names the one the workers serve (``roseinfer worker --model``'s folder)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError("--count-tokens needs transformers: pip install 'roseinfer[engine]'") from None
    try:  # the names a worker's --model takes (smollm2-135m-instruct, a .gguf): the folder it loads
        from roseinfer.model_loader import resolve_model
    except ImportError:  # no torch here: a folder or a hub id, as given
        resolve_model = str
    try:
        return AutoTokenizer.from_pretrained(resolve_model(name))
    except (OSError, ValueError) as exc:
        raise ValueError(f"--count-tokens {name}: no tokenizer there ({exc})") from None


def batch_options(args: argparse.Namespace):
    """The row options and per-run defaults the flags give."""
    from producer.batch_io import RowOptions

    defaults: dict[str, Any] = {}
    for name in ("max_tokens", "temperature", "seed", "n"):
        if getattr(args, name) is not None:
            defaults[name] = getattr(args, name)
    if args.response_format is not None:
        defaults["response_format"] = _response_format(args.response_format)
    if args.system is not None and not args.chat:
        raise InvalidRequest("--system goes with --chat (a raw prompt has no system message)")
    if args.chat and args.messages_column is not None:
        raise InvalidRequest("--chat makes the prompt column a chat; a messages column is one already")
    if args.prompt_column is not None and args.messages_column is not None:  # (the messages column won, unsaid)
        raise InvalidRequest("--prompt-column or --messages-column: a row's input is one column, not both")
    return RowOptions(
        args.prompt_column, args.messages_column, args.id_column, defaults, args.chat, args.system,
        args.tool_call_parser, args.reasoning_parser,
    )  # fmt: skip


def batch(args: argparse.Namespace) -> int:
    from producer.batch import (
        BatchInterrupted,
        BatchStopped,
        check_resumed_run,
        default_errors_path,
        dry_run,
        new_run_id,
        run_batch,
    )

    if args.count_tokens and not args.dry_run:  # (it counts what a run would take; a run it started instead)
        print("error: --count-tokens goes with --dry-run", file=sys.stderr)
        return 2
    run_id = new_run_id() if args.fresh else args.run_id
    errors = args.errors or default_errors_path(args.output, dry=args.dry_run)
    try:
        options = batch_options(args)
        if args.run_id is not None and not args.fresh:
            check_resumed_run(Path(args.output), args.run_id)
    except (InvalidRequest, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    same = args.format if args.format != "hf" else None  # a datasets folder is an input only
    if Path(args.output).suffix.lower() in OUTPUT_EXTENSIONS:  # its name says (--format jsonl wrote JSONL to x.parquet)
        same = None
    formats = {"input_format": args.format, "output_format": args.output_format or same}
    if args.dry_run:
        try:
            tokenizer = _tokenizer(args.count_tokens) if args.count_tokens else None
            counts = dry_run(
                args.input, args.output, errors_path=errors, run_id=run_id, priority=args.priority, options=options,
                tokenizer=tokenizer, queue=target(args)[1], **formats,
            )  # fmt: skip
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(
            f"dry run: {counts['total']} rows: {counts['valid']} would run, {counts['skipped']} already in "
            f"{args.output}, {counts['failed']} bad" + (f" (see {errors})" if counts["failed"] else "")
            + (f"; {counts['prompt_tokens']} prompt tokens (longest {counts['max_prompt_tokens']})"
               if "prompt_tokens" in counts else ""),
            file=sys.stderr,
        )  # fmt: skip
        print(json.dumps(counts))  # (as a run's summary: the one line on stdout, for `| jq`)
        return 1 if counts["failed"] else 0

    began: list[bool] = []  # (a --fresh run's id is its output's once it began: before, a resume names the old one)

    def fresh_run_taken() -> None:  # (said then: a run killed outright says nothing more; a refused one has no id)
        began.append(True)
        print(f"a fresh run: its jobs' ids name run {run_id}; a rerun without --fresh resumes it", file=sys.stderr)

    try:
        # A --timeout past the jobs' own limit (the client's job_timeout) raises it: the worker's limit ended each
        # attempt first, a timeout retried, and the run's --timeout never came into play.
        limit = {}
        if args.timeout:  # (inf: no limit, -1 as RQ writes it)
            finite = math.isfinite(args.timeout)
            limit["job_timeout"] = max(DEFAULT_JOB_TIMEOUT, math.ceil(args.timeout)) if finite else -1
        summary = run_batch(
            _client(args, **limit),
            args.input,
            args.output,
            errors_path=errors,
            max_in_flight=args.max_in_flight,
            timeout=args.timeout,
            log_interval=args.log_interval,
            run_id=run_id,
            priority=args.priority,
            options=options,
            on_start=fresh_run_taken if args.fresh else None,
            **formats,
        )
    except (KeyboardInterrupt, BatchStopped) as exc:
        s = exc.summary if isinstance(exc, (BatchInterrupted, BatchStopped)) else None
        held = getattr(exc, "in_output", None)  # (``skipped`` counts the rows the reader reached, not all: 9 of 1,000)
        if s and held is not None:
            s = {**s, "in_output": held}
            done = f"{held} rows in {args.output} ({s['succeeded']} of them from this run), {s['failed']} in {errors}"
            detail = f", of {s['total']} in the input"
        else:
            done = f"{s['skipped'] + s['succeeded'] + s['failed']} of {s['total']} rows done" if s else "no row done"
            detail = f" ({s['skipped'] + s['succeeded']} in {args.output}, {s['failed']} in {errors})" if s else ""
        stopped = isinstance(exc, BatchStopped)
        # (a --fresh run's literal command again would start another run: this one is its id pinned instead; stopped
        # before it began, it is the --fresh command again, its id never the output's)
        pinned = args.fresh and bool(began)
        again = "this command (the run's --run-id, not --fresh)" if pinned else "the same command again"
        print(
            f"{exc if stopped else 'interrupted'}: {done}{detail}; jobs already submitted keep running in the "
            "workers.\n"
            f"To resume{' ' + exc.resume_when if stopped else ''}, run {again}: it skips the custom_ids already in "
            f"{args.output} and picks up the jobs still queued or finished in Redis:\n"
            f"  {resume_command(args, run_id if pinned else None, fresh=args.fresh and not pinned)}",
            file=sys.stderr,
        )
        if s:  # the counts so far, as a finished run's summary (a script's `| jq` had nothing to read)
            print(json.dumps(s))
        # 128 plus the signal, as a shell reports a process it ended: 130 for Ctrl-C, 143 SIGTERM, 129 SIGHUP
        return 1 if stopped else 128 + int(getattr(exc, "signum", 2))
    except (OSError, ValueError) as exc:  # no such input, settings that differ from the output's: one line
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary))  # (the one line on stdout, for a script: `| jq .failed`; the rest said on stderr)
    if summary["reused"] and not summary["skipped"]:  # (rows in the output already: a resume, its own jobs)
        print(
            f"note: {summary['reused']} rows were taken from jobs of an earlier run still in Redis (an interrupted run "
            "of this command, or the same lines and settings into another output, whose samples sampled lines "
            "repeat); pass --fresh to generate them again",
            file=sys.stderr,
        )
    return 0 if summary["failed"] == 0 else 1


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="enqueue a prompt (chat template applied unless --raw)")
    p.add_argument(
        "prompt", nargs="?", help="the prompt, or - to read it from stdin (none with --messages or --prompt-token-id)"
    )
    p.add_argument("--stream", action="store_true", help="print the text as it is generated")
    p.add_argument("--wait", action="store_true", help="wait and print the result as JSON")
    p.add_argument("--raw", action="store_true", help="send as a plain prompt, without the chat template")
    p.add_argument(
        "--timeout", type=at_least(float, 0), default=None,
        help="with --stream or --wait: give up waiting after this many seconds (default: wait until the job ends)",
    )  # fmt: skip
    for name in _JSON_FLAGS:
        about = JobRequest.model_fields[name].description or name
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, default=None, metavar="JSON", help=f"{about} (JSON, or @FILE)".replace("%", "%%"))
    for flag in payload_flags():
        if flag.kinds == (bool,) and not flag.repeatable:
            p.add_argument(*flag.flags, dest=flag.field, action=argparse.BooleanOptionalAction, help=flag.help)
        else:
            metavar = "|".join(_METAVARS[k] for k in flag.kinds)
            action = "append" if flag.repeatable else "store"
            p.add_argument(*flag.flags, dest=flag.field, action=action, metavar=metavar, help=flag.help)
    add_connection_arguments(p)
    p.set_defaults(func=submit)

    for name, func, about in (
        ("result", result, "wait for a job's result and print it as JSON"),
        ("stream", stream, "print a job's text from its first token, live (as submit --stream)"),
    ):
        p = sub.add_parser(name, help=about)
        p.add_argument("job_id", help="the id submit printed")
        p.add_argument(
            "--timeout", type=at_least(float, 0), default=None,
            help="give up waiting after this many seconds (default: wait until the job ends)",
        )  # fmt: skip
        add_connection_arguments(p)
        p.set_defaults(func=func)

    p = sub.add_parser("cancel", help="cancel a queued or running job")
    p.add_argument("job_id", help="the id submit printed")
    add_connection_arguments(p)
    p.set_defaults(func=cancel)

    p = sub.add_parser("status", help="queue depth, workers, jobs in flight, tokens/s")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    add_connection_arguments(p)
    p.set_defaults(func=status)

    p = sub.add_parser("batch", help="rows in (OpenAI batch lines or plain rows; JSONL or Parquet), their outputs out")
    p.add_argument("input", help="the rows: .jsonl (OpenAI batch lines or plain rows), .parquet, or a datasets folder")
    p.add_argument(
        "-o", "--output", required=True, help="where the outputs go (.jsonl or .parquet); a rerun resumes it"
    )
    p.add_argument(
        "--errors",
        default=None,
        help="bad lines and failed jobs, rewritten each run (default: the output path with its last suffix "
        "replaced by .errors.jsonl: out.jsonl -> out.errors.jsonl; out.dry-run-errors.jsonl for --dry-run, which so "
        "leaves the last run's errors in place)",
    )
    p.add_argument(
        "--max-in-flight", type=at_least(int, 1), default=DEFAULT_MAX_IN_FLIGHT,
        help="jobs submitted at once (default: %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check every line (as a run would) and submit nothing; exit 1 if any is bad",
    )
    p.add_argument(
        "--count-tokens",
        default=None,
        metavar="MODEL_FOLDER",
        help="with --dry-run: count the prompt tokens of the rows that would run, with this model's tokenizer and "
        "chat template",
    )
    p.add_argument(
        "--priority",
        type=int,
        default=BULK_PRIORITY,
        help="priority of lines that name none: lower runs first; interactive jobs are 0, so a batch makes way "
        f"for them (default: {BULK_PRIORITY})",
    )
    p.add_argument(
        "--timeout",
        type=at_least(float, 0, inclusive=False),
        default=None,
        help="give up on a job this many seconds after it started running, time queued not counted (and cancel it)",
    )
    p.add_argument(
        "--log-interval",
        type=at_least(float, 0),
        default=DEFAULT_LOG_INTERVAL,
        help="seconds between progress lines when stderr is not a terminal (default: %(default)s)",
    )
    rows = p.add_argument_group("formats and plain rows")
    rows.add_argument(
        "--format",
        choices=("jsonl", "parquet", "hf"),
        default=None,
        help="the input's format (and the output's, unless --output-format or its extension says): jsonl, parquet, "
        "or hf (a datasets folder, input only); default: from the extension (a folder is hf)",
    )
    rows.add_argument("--output-format", choices=("jsonl", "parquet"), default=None, help="the output's format")
    rows.add_argument(
        "--prompt-column",
        default=None,
        help="plain rows: the column holding the prompt (a Parquet input's default: prompt); other columns are data, "
        "kept in a Parquet output of a Parquet or dataset input (a JSONL input's rows keep only their id)",
    )
    rows.add_argument("--messages-column", default=None, help="plain rows: the column holding chat messages")
    rows.add_argument(
        "--chat",
        action="store_true",
        help="plain rows: send the prompt column as the user's message, the model's chat template applied (default: "
        "a raw prompt, which an instruct model only continues)",
    )
    rows.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message before each")
    rows.add_argument("--id-column", default=None, help="plain rows: the column holding each row's id (default: row-N)")
    defaults = p.add_argument_group("defaults for rows that set none")
    defaults.add_argument("--max-tokens", type=int, default=None)
    defaults.add_argument("--temperature", type=float, default=None)
    defaults.add_argument("--seed", type=int, default=None)
    defaults.add_argument("--n", type=int, default=None, help="samples per row (a Parquet output then holds a list)")
    defaults.add_argument(
        "--response-format",
        default=None,
        metavar="FILE.json",
        help="constrain every row's output: OpenAI's response_format object, or a bare JSON schema (a file's path, "
        "@FILE, or the JSON itself)",
    )
    p.add_argument(
        "--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
        help='OpenAI lines\' tool_choice "auto": the model\'s own tool-call format to read calls in (as serve\'s)',
    )  # fmt: skip
    p.add_argument(
        "--reasoning-parser", choices=REASONING_PARSERS, default=None,
        help="a reasoning model's thinking told from its answer, as serve's: chat lines' messages' reasoning, and "
        "a Parquet output's reasoning column (chat rows: --chat or --messages-column)",
    )  # fmt: skip
    again = p.add_mutually_exclusive_group()
    again.add_argument(
        "--fresh",
        action="store_true",
        help="generate every row not yet in the output again, even where an earlier run's job for the same line "
        "still holds a result in Redis (new job ids, so sampled lines without a seed get new samples)",
    )
    again.add_argument(
        "--run-id", type=_run_id, default=None, help="resume a --fresh run: the id its interrupted-run message printed"
    )
    add_connection_arguments(p)
    p.set_defaults(func=batch)
