"""What goes where in Redis: key names and the shape of token events and results.

Any language can speak this protocol; README.md shows it with redis-cli.

- ``roseinfer:tokens:<job_id>``  pub/sub channel, one JSON message per event (live only).
- ``roseinfer:stream:<job_id>``  stream holding the same events (replayable, bounded, expires): each entry has
  one field, ``event``, holding the same JSON as the channel's message.
- ``rq:results:<job_id>``  RQ's result stream: its latest entry's ``return_value`` holds the final result (JSON in
  base64, as RQ's JSON serializer stores a return value), for every ending: finished, failed, canceled. Stored
  once: ``job.return_value()`` reads the same entry.

Every event has ``n`` (0, 1, 2, ... within the job), ``text`` (the new piece: one or more tokens' text) and
``token_ids`` (a list).
The last event also has ``finish_reason`` (``stop``, ``length``, ``abort`` or ``error``), ``usage`` (JSON),
and ``error`` when the job failed. A subscriber merging the channel with the stream drops events whose ``n``
it already has. An event with ``reset: true`` starts the output over: everything before it is void (a retried job
whose earlier output could not be resumed), and its own text is the new output's first piece.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import zlib
from base64 import b64decode, b64encode
from datetime import datetime
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rq.executions import Execution
    from rq.results import Result

    from producer.schema import Ending, JobRequest

# Carried by every event and result as "v". 2: stream entries hold the event's JSON in one field; results and job
# status are written before a job's final event. 3: the result is stored once, in RQ's result stream (no
# ``roseinfer:result:<id>`` key). Clients read version 1 entries too.
PROTOCOL_VERSION = 3
JOB_FUNCTION = "worker.jobs.generate"
DEFAULT_QUEUE = "roseinfer"
# The job hash field naming the attempt that owns the job (set when an attempt starts it): a worker writes a job's
# events, result and status only while it holds this; one that stalled past its heartbeat and lost the job to a
# retry drops its copy without writing.
OWNER_FIELD = "roseinfer_owner"
# The job hash field holding the ``created_at`` of the job whose output its token stream holds (set at its first
# start, in RQ's form, ``utcformat``): a stream found under another is an earlier job's of the same id, which a
# stock RQ enqueue left (``Client.submit`` clears it), so a start deletes it rather than resume the old job's text
# as the new one's. ``stream_is_earlier_jobs`` says when.
STREAM_OF_FIELD = "roseinfer_stream_of"
# The job hash field holding the id of its stream's last entry when its attempt started (none: an empty stream): a
# dead worker's attempt that added none streamed nothing, and goes back to its queue with its retries untouched.
RESUMED_FROM_FIELD = "roseinfer_resumed_from"
# The job hash field naming the model and tokenizer its last attempt ran on (``model_identity``): a retry on a
# worker of another (a fleet mid-rollout, a queue two models serve) starts over, where it resumed half a job made
# by one model with the other (and token ids of one vocabulary read as another's).
MODEL_FIELD = "roseinfer_model"
UNCHECKED = "-"  # the mark of a job whose hash had no created_at at its first start (written by hand): never checked


def stream_is_earlier_jobs(
    mark: str | None, created: str | None, created_ms: int | None, first_entry_ms: int | None
) -> bool:
    """Whether a job's token stream (its first entry written at ``first_entry_ms``, by Redis's clock; None: empty)
    is an earlier job's of the same id, by the job's mark (``STREAM_OF_FIELD``) and its ``created_at`` (RQ's form,
    and in ms). Unmarked (started by a worker before marks, or by the stock RQ path; its start's write lost in a
    failover): the stream is the job's own unless it began before the job was created. The start script (worker/
    job_start.py) holds the same rule."""
    if created is None or mark in (UNCHECKED, created) or first_entry_ms is None:
        return False
    return mark is not None or created_ms is None or first_entry_ms < created_ms


def mark_of(mark: str | None, created: str | None) -> str:
    """What a start writes as the job's mark: its ``created_at``, or ``UNCHECKED`` for a hash that has none (and
    for good: a later save of RQ's writes one, the time of that save)."""
    if mark == UNCHECKED:
        return mark
    return created if created is not None else (mark or UNCHECKED)


def created_form(created_at: datetime) -> tuple[str, int]:
    """A job's ``created_at`` in RQ's form (what RQ writes back whenever it saves the job) and in ms."""
    from rq.utils import utcformat

    return utcformat(created_at), int(created_at.timestamp() * 1000)


def queue_stream_check(pipe: Any, job: Any) -> None:
    """Queue on ``pipe`` what ``stream_check`` reads of RQ's ``job``: two replies (read with
    ``raise_on_error=False``)."""
    pipe.hmget(job.key, "created_at", STREAM_OF_FIELD)
    pipe.xrange(stream_key(job.id), count=1)


def stream_check(created_at: datetime, hash_fields: Any, first: Any) -> tuple[bool, str | None]:
    """``stream_is_earlier_jobs`` for a job RQ read as created at ``created_at``, from ``queue_stream_check``'s
    replies: whether its token stream is an earlier job's of its id (to delete), and the mark a start writes (None:
    it stands). (Of a hash without ``created_at``, RQ's reading gives the time it read it: the hash says none.)"""
    raw_created, raw_mark = hash_fields
    created, created_ms = created_form(created_at) if raw_created else (None, None)  # ('' is none, to RQ too)
    mark = raw_mark.decode(errors="backslashreplace") if raw_mark is not None else None  # (written by hand)
    first_ms = None
    if first and not isinstance(first, Exception):  # (an empty stream, or a key of another type: none)
        entry_id = first[0][0]
        first_ms = int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[0])
    written = mark_of(mark, created)
    return stream_is_earlier_jobs(mark, created, created_ms, first_ms), (None if written == mark else written)


# A worker's lease: while it exists, no job this worker runs can have been retried elsewhere (it expires before
# the jobs' own heartbeats do, and only a lapsed heartbeat lets RQ requeue a job), so the worker's events skip the
# per-event ownership check. Extended only while it exists; once lapsed, set again only after every job held is
# found still owned.
LEASE_KEY = "roseinfer:lease:{worker}"
# In RQ's worker hash: which start of the worker of that name registered it (a frozen worker, thawed after another
# took its name over, finds another's there: it stops).
START_FIELD = "roseinfer_start"
# Worker statistics (a hash per worker, expiring with it): generated tokens, steps, jobs in flight.
STATS_KEY = "roseinfer:stats:{worker}"
# A worker's tokenizer (its tokenizer.json), by the digest its statistics name: the server names logprobs' tokens
# with it. Written once per tokenizer, kept (a few MB per model served).
TOKENIZER_KEY = "roseinfer:tokenizer:{digest}"
# A worker's chat template and the special tokens it reads (``LLMEngine.chat_template_doc``), by its digest in the
# worker's statistics: the server renders a chat's prompt with it (``/tokenize`` of messages). Kept, as the tokenizer.
TEMPLATE_KEY = "roseinfer:template:{digest}"


def tokenizer_digest(tokenizer_json: str) -> str:
    return hashlib.sha256(tokenizer_json.encode()).hexdigest()[:16]


def model_identity(model: str, tokenizer_json: str | None) -> str:
    """What ``MODEL_FIELD`` holds: the worker's ``--model`` and its tokenizer's digest."""
    return f"{model}|{tokenizer_digest(tokenizer_json) if tokenizer_json else ''}"


def mixed_models(queue: str, served: list[str]) -> str:
    """The workers on the queue name several models (a rollout, a mistake, one model at several paths): a job names
    no model and runs on whichever worker takes it first, so the answer may come from any of them (said by the
    server, ``roseinfer status`` and a worker as it starts)."""
    return (
        f"the workers on queue {queue!r} serve several models ({', '.join(served)}), and a job runs on whichever "
        "takes it: give each model a queue of its own, and one model at several paths one --served-model-name"
    )


# Priority lanes: a job of priority p (lower runs first, as in vLLM) goes into the RQ queue lane_name(queue, p); the
# default priority 0 is the queue itself, so `rq info` shows each lane as a queue of its own.
MIN_PRIORITY, MAX_PRIORITY = -100, 100
BULK_PRIORITY = 10  # `roseinfer batch`'s default: bulk work makes way for interactive jobs (0)


class InvalidQueueName(ValueError):
    """A queue name no worker serves."""


def check_queue_name(name: str) -> str:
    """A queue's name as workers serve it (``InvalidQueueName`` otherwise): a name a worker refuses took jobs no
    worker could ever run, and they waited for good."""
    if not isinstance(name, str):
        raise InvalidQueueName(f"a queue name is a string, got {type(name).__name__}")
    if "," in name:  # (RQ lists a worker's queues joined by commas: `rq info` showed "hi,lo" as two queues)
        raise InvalidQueueName("a queue name cannot hold a comma: a worker serves one queue (and its priority lanes)")
    if not name.strip():  # (a queue no producer uses: the worker sat idle)
        raise InvalidQueueName("a queue name cannot be empty or blank")
    if lane := re.fullmatch(r"(.+):p([+-]?\d+)", name):
        # (a worker of "jobs:p10" served it at priority 0 with a lane "jobs:p10:p10", and a worker of "jobs" took
        # the jobs of a queue "jobs:p5" as its priority-5 lane)
        raise InvalidQueueName(
            f"{name!r} is named as a priority lane (<queue>:p<priority>), a name kept for lanes: name the queue "
            f"({lane[1]!r}) and give a job its priority; a worker of a queue serves all its lanes"
        )
    return name


def lane_name(queue: str, priority: int) -> str:
    return queue if priority == 0 else f"{queue}:p{priority}"


def lane_priority(queue: str, name: str) -> int | None:
    """The priority of the lane ``name`` of ``queue``, or None if ``name`` is not one of its lanes."""
    if name == queue:
        return 0
    prefix = f"{queue}:p"
    if not name.startswith(prefix):
        return None
    try:
        priority = int(name[len(prefix) :])
    except ValueError:
        return None
    return priority if MIN_PRIORITY <= priority <= MAX_PRIORITY and lane_name(queue, priority) == name else None


def queue_of_lane(name: str) -> str:
    """The queue whose lane ``name`` is (a job's ``origin``), or ``name`` itself: the one its workers serve."""
    base, sep, _ = name.rpartition(":p")
    if sep and base and lane_priority(base, name) not in (None, 0):
        return base
    return name


def lanes(connection: Any, queue: str, odd: list[str] | None = None) -> list[tuple[int, str]]:
    """(priority, queue name) of every lane of ``queue`` RQ knows (``rq:queues``), first-served first. The
    interactive (0) and bulk lanes are always there, so a worker serves both from its start. ``odd``: given, the
    names that look like lanes of ``queue`` but are none (``:p05``, ``:p0``, ``:p101``) are added to it."""
    found = {0: queue, BULK_PRIORITY: lane_name(queue, BULK_PRIORITY)}
    for key in connection.smembers("rq:queues"):
        name = (key.decode() if isinstance(key, bytes) else key).removeprefix("rq:queue:")
        priority = lane_priority(queue, name)
        if priority is not None:
            found[priority] = name
        elif odd is not None and re.fullmatch(rf"{re.escape(queue)}:p[+-]?\d+", name):  # (not roseinfer:prod)
            odd.append(name)
    return sorted(found.items())


def channel_key(job_id: str) -> str:
    return f"roseinfer:tokens:{job_id}"


def stream_key(job_id: str) -> str:
    return f"roseinfer:stream:{job_id}"


def result_key(job_id: str) -> str:
    """RQ's result stream of the job: the result is its latest entry's ``RESULT_FIELD``."""
    return f"rq:results:{job_id}"


RESULT_FIELD = "return_value"


def encode_result(result: dict[str, Any]) -> str:
    """A result as RQ stores a return value (its JSON serializer's bytes in base64), without JSON's optional
    spaces: Redis keeps it for the job's result TTL."""
    return b64encode(json.dumps(result, separators=(",", ":")).encode()).decode()


def read_result(conn: Any, job_id: str) -> Any:
    """Read (or queue on a pipeline) the latest entry of the job's result stream, for ``result_from_entries``.
    Read the job's status before it, in the same pipeline: a worker writes a success's result and status together,
    so a status read as ``finished`` means the result is there (read after, it could miss one written between)."""
    return conn.xrevrange(result_key(job_id), count=1)


def result_from_entries(entries: list[Any]) -> dict[str, Any] | None:
    """The result held by the latest entry of a result stream (``XREVRANGE rq:results:<id> + - COUNT 1``), or None:
    no entry yet, or RQ's own record of a failure or retry, which has none."""
    if not entries:
        return None
    _, fields = entries[0]
    raw = fields.get(RESULT_FIELD.encode(), fields.get(RESULT_FIELD))
    return None if raw is None else json.loads(b64decode(raw))


def failure_result(
    job_id: str,
    req: JobRequest | Ending | None,
    error: str,
    status: str = "failed",
    error_type: str | None = None,
    error_code: str | None = None,
) -> dict[str, Any]:
    result = {
        "v": PROTOCOL_VERSION,
        "id": job_id,
        "custom_id": req.custom_id if req else None,
        "status": status,
        "error": error,
        "finish_reason": "error",
    }
    if error_type is not None:
        result["error_type"] = error_type
    if error_code is not None:
        result["error_code"] = error_code
    if req is not None and req.metadata is not None:  # (echoed as a finished job's is: a batch's rows are told apart)
        result["metadata"] = req.metadata
    return result


def canceled_result(
    job_id: str, req: JobRequest | Ending | None, reason: str, made: dict[int, tuple[str, list[int]]] | None = None
) -> dict[str, Any]:
    """The result of a job canceled where no worker runs it (finish ``abort``, as the engine's own aborts); ``made``:
    per sample, what its earlier attempts streamed (``streamed_output``), kept as a canceled running job's is."""
    result = {**failure_result(job_id, req, reason, status="canceled"), "finish_reason": "abort"}
    if made:
        result["text"], result["token_ids"] = made.get(0, ("", []))
        if len(made) > 1 or 0 not in made:
            result["choices"] = [
                {"index": i, "text": text, "token_ids": ids, "finish_reason": "abort", "stop_reason": None}
                for i, (text, ids) in sorted(made.items())
            ]
    return result


def streamed_output(events: list[dict[str, Any]]) -> dict[int, tuple[str, list[int]]] | None:
    """Per sample, the text and token ids a job's stream holds since its start or last reset (what its earlier
    attempts made, as a retry resumes from it); None where the stream cannot say (trimmed: it starts past event 0
    with no reset, or skips one)."""
    start = max((i for i, e in enumerate(events) if e.get("reset") or e.get("n") == 0), default=None)
    if start is None:
        return None if events else {}
    since = events[start:]
    if any(b.get("n") != a.get("n", 0) + 1 for a, b in itertools.pairwise(since)):
        return None
    made: dict[int, tuple[str, list[int]]] = {}
    for event in since:
        text, ids = made.get(event.get("index", 0), ("", []))
        made[event.get("index", 0)] = text + event.get("text", ""), ids + list(event.get("token_ids", []))
    return {i: out for i, out in made.items() if out[0] or out[1]}


def result_entry(
    result: dict[str, Any],
    kind: Result.Type,
    worker_name: str,
    *,
    error: str | None = None,
    execution: Execution | None = None,
    ended: datetime | None = None,
) -> dict[str, Any]:
    """An entry of RQ's result stream, field for field as RQ's ``Result.serialize`` writes it, whose return value is
    the roseinfer result: the one place a result is stored.
    RQ's ``job.return_value()`` reads it for a finished job; ``latest_result().return_value`` for any ending."""
    entry: dict[str, Any] = {"type": kind.value, "worker_name": worker_name}
    if error is not None:
        entry["exc_string"] = b64encode(zlib.compress(error.encode())).decode()
    entry["return_value"] = encode_result(result)
    if execution is not None:
        entry["execution_id"] = execution.id
        entry["execution_started_at"] = execution.created_at.timestamp()
    if ended is not None:
        entry["execution_ended_at"] = ended.timestamp()
    return entry


def done_key(name: str) -> str:
    """A job submitted with ``notify: name`` has its id pushed onto this list when it ends (any way but a retry)."""
    return f"roseinfer:done:{name}"


def rejected_key(queue: str) -> str:
    """Jobs RQ could not read (a sorted set of ids by time): never run, their reason in their result."""
    return f"roseinfer:rejected:{queue}"


def encode_logprobs(steps: list[dict[int, float]]) -> list[list[list[float]]]:
    """Logprobs as results and events hold them: per token, ``[[token_id, logprob], ...]`` (JSON keys are strings)."""
    return [[[tid, lp] for tid, lp in step.items()] for step in steps]


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """A job's ``usage``: its prompt counts once, however many samples share it. ``cached_tokens``: of the prompt's,
    those the prefix cache held (OpenAI's ``prompt_tokens_details``), where known."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def make_event(
    n: int,
    text: str,
    token_ids: list[int],
    finish_reason: str | None = None,
    usage: dict[str, int] | None = None,
    error: str | None = None,
    reset: bool = False,
    index: int = 0,
    error_type: str | None = None,
    logprobs: list[dict[int, float]] | None = None,
    sample_finish_reason: str | None = None,
    error_code: str | None = None,
    stop_reason: int | str | None = None,
) -> dict[str, Any]:
    """An event as published on the channel and stored in the stream (JSON, both). ``index``: the sample its piece
    belongs to (jobs with n > 1; left out for sample 0); ``error_type``: whose fault an error is (``ERROR_TYPES``),
    ``error_code`` what it is where a client can act on it (``context_length_exceeded``);
    ``logprobs``: one entry per token id, for a job that asked for them; ``sample_finish_reason``: sample ``index``
    ended with this piece while the job goes on (left out on the job's last event, whose ``finish_reason`` ends
    it); ``usage`` without ``finish_reason``: the usage so far (a job asking for it on every event); ``stop_reason``:
    with either finish reason, the stop string or token id that ended the output (vLLM's)."""
    event: dict[str, Any] = {"v": PROTOCOL_VERSION, "n": n, "text": text, "token_ids": token_ids}
    if logprobs:
        event["logprobs"] = encode_logprobs(logprobs)
    if index:
        event["index"] = index
    if reset:
        event["reset"] = True
    if finish_reason is not None:
        event["finish_reason"] = finish_reason
        event["usage"] = usage or {}
    else:
        if usage is not None:  # a job asking for it on every event: the usage so far
            event["usage"] = usage
        if sample_finish_reason is not None:
            event["sample_finish_reason"] = sample_finish_reason
    if stop_reason is not None and (finish_reason is not None or sample_finish_reason is not None):
        event["stop_reason"] = stop_reason
    if error is not None:
        event["error"] = error
    if error_type is not None:
        event["error_type"] = error_type
    if error_code is not None:
        event["error_code"] = error_code
    return event


# A stream entry's one field: it holds the same JSON as the pub/sub message, so one decoder reads both.
STREAM_FIELD = "event"
# How long a job's stream stays after its last event, by default (the worker's ``stream_ttl_after_end``).
STREAM_TTL_AFTER_END_S = 600


def is_last(event: dict[str, Any]) -> bool:
    """Whether a job's event ends its stream: a finish reason that is not null (the schema allows ``null`` on any
    event, which a follower read as the end, and another as none)."""
    return event.get("finish_reason") is not None


def event_from_message(data: str | bytes) -> dict[str, Any]:
    """An event from a pub/sub message (or a stream entry's ``event`` field)."""
    return json.loads(data)


def event_from_stream(fields: dict[Any, Any]) -> dict[str, Any]:
    """An event from a stream entry. Entries written before the single ``event`` field (one field per event key,
    every value a string) are read too."""
    f = {_text(k): v for k, v in fields.items()}
    if STREAM_FIELD in f:
        return event_from_message(f[STREAM_FIELD])
    f = {k: _text(v) for k, v in f.items()}
    event: dict[str, Any] = {
        "v": 1,
        "n": int(f["n"]),
        "text": f.get("text", ""),
        "token_ids": json.loads(f["token_ids"]),
    }
    if "finish_reason" in f:
        event["finish_reason"] = f["finish_reason"]
        event["usage"] = json.loads(f.get("usage") or "{}")
    if "error" in f:
        event["error"] = f["error"]
    return event


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def installed_version() -> str:
    """roseinfer's version as installed (the CLI's --version, the server's /version)."""
    try:
        return metadata.version("roseinfer")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"
