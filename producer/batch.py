"""``roseinfer batch``: rows in (OpenAI batch lines or plain rows, JSONL or Parquet), their outputs out; resumable.

Each line gets a job id derived from its custom_id and content, so a rerun after a crash picks up jobs that
are still queued or already finished instead of generating them again, and skips lines already in the output.
Rows taken from an earlier run's jobs are counted (``reused``); a run id (``--fresh``) gives every line new job ids.
Bad lines and failed jobs go to the errors file (rewritten each run, so failures are retried); none stops the run.

This file runs it (submit, settle, resume, stop); ``batch_lines`` turns rows into jobs and results into output
lines, ``batch_io`` reads the input and writes the output (JSONL or Parquet).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from pydantic import ValidationError
from redis.exceptions import ResponseError

from producer.batch_io import (
    OUTPUT_FORMATS,
    JSONLSink,
    ParquetSink,
    RowOptions,
    count_rows,
    format_of,
    input_columns,
    jsonl_input_problem,
    open_lines,
    partial_path,
    payload_digest,
    read_rows,
)
from producer.batch_lines import ENDPOINTS as ENDPOINTS  # (their home before batch_lines: still found here)
from producer.batch_lines import ID_FIELD, UNREAD_ID, BadLine, Line, error_line, output_line, parse_line
from producer.batch_lines import REQUESTS as REQUESTS
from producer.batch_lines import job_id_for as job_id_for
from producer.chat_render import template_messages
from producer.client import Client
from producer.connection import REDIS_UNAVAILABLE, longest_block_s, redis_waits
from producer.job_errors import JobIdTaken
from producer.protocol import (
    BULK_PRIORITY,
    DEFAULT_QUEUE,
    STREAM_TTL_AFTER_END_S,
    done_key,
    read_result,
    result_from_entries,
    result_key,
)
from producer.schema import JobRequest
from producer.token_names import TokenNames, digest_of, load_names

log = logging.getLogger("roseinfer.batch")

# Statuses of an earlier run's job that will still give (or gave) a result: followed, not submitted again.
_LIVE = ("queued", "started", "scheduled", "deferred")
RUN_ID = re.compile(r"[A-Za-z0-9]{1,32}")


REDIS_PATIENCE_S = 600.0  # a run waits this long for a Redis that went away (a failover takes seconds to a minute)


class BatchInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM, SIGHUP: ``signum``) during a batch. The output then holds complete lines only; ``summary``
    counts what was done."""

    def __init__(self, summary: dict[str, int], signum: int = signal.SIGINT, in_output: int | None = None) -> None:
        super().__init__()
        self.summary, self.signum = summary, signum
        self.in_output = in_output  # the rows the output holds (``skipped`` counts those the reader reached)


class _Signaled(KeyboardInterrupt):
    def __init__(self, signum: int) -> None:
        super().__init__()
        self.signum = signum


class BatchStopped(RuntimeError):
    """A run stopped by a failure of no row's (Redis gone, a disk full). As after Ctrl-C, the output holds complete
    lines only and ``summary`` counts what was done; the jobs submitted go on in the workers, and a rerun resumes
    ``resume_when`` the failure is over."""

    resume_when = "once that is fixed"

    def __init__(self, summary: dict[str, int], message: str) -> None:
        super().__init__(message)
        self.summary = summary
        self.in_output: int | None = None  # as BatchInterrupted's, set as it leaves run_batch


class RedisLost(BatchStopped):
    """Redis went away during a batch for longer than ``REDIS_PATIENCE_S``."""

    resume_when = "once Redis answers"

    def __init__(self, summary: dict[str, int], cause: Exception) -> None:
        super().__init__(summary, f"Redis unavailable for over {REDIS_PATIENCE_S:g} s during the run ({cause})")


class FilesFailed(BatchStopped):
    """The system failed the run midway (its output or errors file unwritable: a disk full, a folder gone; its
    input unreadable): said with the counts and the command that resumes, not a bare errno read as a bad flag."""

    def __init__(self, summary: dict[str, int], cause: OSError) -> None:
        super().__init__(summary, f"the run stopped on the system's error ({cause})")


def new_run_id() -> str:
    return secrets.token_hex(4)


def duration(seconds: float) -> str:
    """``42s``, ``3m07s``, ``2h05m``: short enough for a progress line."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """A tqdm bar on a terminal; otherwise a log line every ``log_interval`` seconds, whether jobs end or not."""

    def __init__(
        self, total: int, already: int, failed: int = 0, log_interval: float = 10.0, stream: TextIO | None = None
    ) -> None:
        """``already`` rows are done before the first job (in the output, or bad lines), ``failed`` of them bad."""
        self.stream = stream or sys.stderr
        self.total, self.done, self.already, self.failed, self.tokens = total, already, already, failed, 0
        self.log_interval = log_interval
        self.start = self.last_log = time.monotonic()
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            # (smoothing 0: the rate is the rows made over the time taken, which rows skipped stay out of; tqdm's
            # moving average counted the skipped rows of a resumed run, thousands a second. miniters 1: with
            # smoothing 0 tqdm's own only grows, and after a burst of skipped rows the bar stood still for 20 s)
            self.bar = tqdm(
                total=total, initial=already, unit="row", dynamic_ncols=True, file=self.stream, smoothing=0, miniters=1
            )

    def update(self, tokens: int, failed: bool = False, made_before: bool = False) -> None:
        """A row whose job ended; ``made_before``: its job had ended before this run (its result taken, not made:
        out of the rates, which it made absurd after a resume, and the ETA with them)."""
        if made_before:
            self.skip()
            return
        self.done += 1
        self.failed += failed
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"{self.tokens / self._elapsed():.0f} tok/s", refresh=False)  # (drawn at its pace)

    def skip(self, failed: bool = False) -> None:
        """A row settled without a job (already in the output, or a bad line): done, but not in the rates."""
        self.done += 1
        self.already += 1
        self.failed += failed
        if self.bar is not None:
            self.bar.initial += 1  # (out of its rate and ETA, as the log lines keep it)
            self.bar.update(1)
        self.tick()  # (a resume reads past its done rows in one go: hundreds of thousands, and no log line said so)

    def tick(self) -> None:
        """Called every poll: a log line off a terminal once ``log_interval`` has passed since the last."""
        if self.bar is None and time.monotonic() - self.last_log >= self.log_interval:
            self.last_log = time.monotonic()
            rate = (self.done - self.already) / self._elapsed()
            eta = duration((self.total - self.done) / rate) if rate > 0 else "unknown"
            self._print(
                f"batch: {self.done}/{self.total} rows done ({self.failed} failed), {rate:.2f} rows/s, "
                f"{self.tokens / self._elapsed():.1f} tokens/s, ETA {eta}"
            )

    def finish(self, summary: dict[str, Any], output: Path, errors: Path) -> None:
        self.close()
        elapsed = self._elapsed()
        reused = f" ({summary['reused']} from an earlier run's jobs)" if summary["reused"] else ""
        reasons = ", ".join(f"{n} {code}" for code, n in sorted(summary.get("failures", {}).items()))
        failed = f" ({reasons}; see {errors})" if summary["failed"] else ""
        self._print(
            f"batch: {summary['total']} rows in {duration(elapsed)}: {summary['succeeded']} succeeded{reused}, "
            f"{summary['failed']} failed{failed}, {summary['skipped']} already in {output}; "
            f"{(self.done - self.already) / elapsed:.2f} rows/s, {self.tokens / elapsed:.1f} tokens/s"
        )

    def note(self, text: str) -> None:
        """A line of its own (above the bar on a terminal)."""
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            self._print(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def _elapsed(self) -> float:
        return max(time.monotonic() - self.start, 1e-6)

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)


def default_errors_path(output_path: str | Path, dry: bool = False) -> Path:
    """``out.jsonl`` -> ``out.errors.jsonl`` (``out.dry-run-errors.jsonl`` for a dry run, which so leaves the last
    real run's errors in place): the output's last suffix replaced."""
    return Path(output_path).with_suffix(".dry-run-errors.jsonl" if dry else ".errors.jsonl")


Sink = JSONLSink | ParquetSink


def settings_path(output_path: Path) -> Path:
    """Beside the output: the settings its rows were made with (a rerun with others is refused)."""
    real = Path(os.path.realpath(output_path))  # (a link to the output: the output's own, as its lock)
    own, beside_link = (
        real.with_name(real.name + ".batch.json"),
        output_path.with_name(output_path.name + ".batch.json"),
    )
    # (one a run through the link wrote before this rule is still the output's: its settings and run id stand)
    return beside_link if not own.exists() and beside_link.exists() else own


def _stored_settings(output_path: Path) -> Any:
    """What the output's settings file holds (parsed), or None where there is none to read."""
    try:
        return json.loads(settings_path(output_path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _begun_before_queues(output_path: Path) -> bool:
    """Whether a run began this output before job ids and settings named their queue (its settings file names
    none): its job ids name no queue, so a resume finds that run's jobs and rows, and any queue may go on with it."""
    before = _stored_settings(output_path)
    return isinstance(before, dict) and "id_column" in before and "queue" not in before


def _settings_on(output_path: Path, options: RowOptions, queue: str) -> tuple[dict[str, Any], str]:
    """The run's settings as its output keeps them, and the queue its job ids name (an output begun before ids
    named their queue keeps its ids, on any queue)."""
    if _begun_before_queues(output_path):
        return options.fingerprint(), DEFAULT_QUEUE
    return {**options.fingerprint(), "queue": queue}, queue


def _run_id_of(output_path: Path, run_id: str | None) -> str | None:
    """``run_id``, else the one the output's settings file keeps: a ``--fresh`` run's, which a rerun resumes (one
    killed, by kill -9 or the OOM killer, never printed it; its Parquet rows come back only from its jobs)."""
    if run_id is not None:
        return run_id
    before = _stored_settings(output_path)
    stored = before.get("run_id") if isinstance(before, dict) else None
    return stored if isinstance(stored, str) and RUN_ID.fullmatch(stored) else None


def check_resumed_run(output_path: Path, run_id: str) -> None:
    """``--run-id`` (without ``--fresh``) names the run the output's settings keep, where they keep one: a typo was
    taken as a new run, every row left submitted again under new job ids (the interrupted run's jobs orphaned)."""
    # (a Parquet output appears when its run closes: one killed outright left its .partial alone)
    begun = output_path.exists() or partial_path(output_path).exists()
    before = _stored_settings(output_path) if begun else None
    if not isinstance(before, dict):
        return  # (a new output, or settings left beside one deleted: the run id is this run's)
    stored = before.get("run_id")
    if stored != run_id:
        kept = f"run {stored}" if stored else "a run of no run id (rerun it without --run-id)"
        raise ValueError(
            f"{output_path} was made by {kept}, not run {run_id}: --run-id resumes the output's own run (a new run "
            "of it is --fresh)"
        )


def _differences(before: dict[str, Any], now: dict[str, Any], where: str = "") -> list[str]:
    """Where two settings differ, each as 'defaults.max_tokens: 64 in the output, 32 now' (the whole of both, a
    schema and all, buried the one difference in a kilobyte)."""
    out = []
    for key in sorted(set(before) | set(now)):
        name, old, new = f"{where}{key}", before.get(key), now.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            out += _differences(old, new, name + ".")
        elif old != new:
            out.append(f"{name}: {_shown(old)} in the output, {_shown(new)} now")
    return out


def _shown(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_settings(
    output_path: Path,
    fingerprint: dict[str, Any],
    has_rows: bool,
    write: bool = True,
    run_id: str | None = None,
    input_name: str | None = None,
) -> None:
    """Other settings than those the output's rows were made with are refused; this run's are kept (``write``),
    with its run id (which is not a setting: a rerun may name another, ``--fresh``) and its input's file name (nor
    is that: a sample of a file, then the whole of it, is one output; any other input is said, its rows going in
    beside the others')."""
    before = _stored_settings(output_path) if has_rows else None
    if isinstance(before, dict):
        before.pop("run_id", None)
        earlier = before.pop("input", None)
        if input_name is not None and isinstance(earlier, str) and earlier != input_name:
            log.warning("%s was begun from %s, not %s: its rows stay, and this input's rows go in beside them "
                        "(another output keeps them apart)", output_path, earlier, input_name)  # fmt: skip
    if before is not None and before != fingerprint:
        differ = "; ".join(_differences(before, fingerprint)) if isinstance(before, dict) else "unreadable"
        raise ValueError(
            f"{output_path} holds rows made with other settings ({differ}): write to a new output, or run with the "
            "same settings"
        )
    if write:
        kept = {**fingerprint, **({"run_id": run_id} if run_id is not None else {})}
        kept.update({"input": input_name} if input_name is not None else {})
        settings_path(output_path).write_text(json.dumps(kept, sort_keys=True) + "\n")


def _formats(input_path: Path, input_format: str | None, output_path: Path, output_format: str | None):
    in_fmt, out_fmt = format_of(input_path, input_format), format_of(output_path, output_format, "--output-format")
    if out_fmt not in OUTPUT_FORMATS:
        raise ValueError(f"an output is one of {OUTPUT_FORMATS} (datasets loads Parquet: Dataset.from_parquet)")
    return in_fmt, out_fmt


def _check_columns(input_path: Path, input_format: str, options: RowOptions) -> None:
    """The columns the run reads, in a table's schema (a JSONL file has none to look at): a missing one is one
    error, not one failed row each. So is a JSONL input that is no JSON Lines (see ``jsonl_input_problem``)."""
    if options.id_column is not None and not options.plain:
        raise ValueError("--id-column names the id column of plain rows: give --prompt-column or --messages-column")
    if not input_path.exists():  # (after its format's look: a .gz is said as such; the errno's words before)
        raise ValueError(f"the input {input_path} does not exist")
    problem = jsonl_input_problem(input_path) if input_format == "jsonl" else None
    if problem is not None:
        raise ValueError(problem)
    columns = input_columns(input_path, input_format)
    if columns is None:
        return
    for flag, name in (("--prompt-column", options.prompt_column), ("--messages-column", options.messages_column),
                       ("--id-column", options.id_column)):  # fmt: skip
        if name is not None and name not in columns.names:
            raise ValueError(f"{flag} {name!r}: {input_path} has no such column (it has {', '.join(columns.names)})")
    if options.plain and options.id_column is None and ID_FIELD in columns.names:
        raise ValueError(UNREAD_ID.format(what="the input has a column"))


def _open_sink(output_path: Path, output_format: str, input_path: Path, input_format: str, options: RowOptions) -> Sink:
    if output_format == "jsonl":
        return JSONLSink(output_path)
    id_column = options.id_column or ID_FIELD  # (an input column of that name was refused: _check_columns)
    columns = input_columns(input_path, input_format) if options.plain else None
    reasoning = options.reasoning_parser is not None  # (a reasoning column beside the output)
    return ParquetSink(output_path, columns, id_column, int(options.defaults.get("n", 1)), reasoning)


def check_run_settings(options: RowOptions, priority: int, max_in_flight: int = 1) -> None:
    """The run's defaults and priority, checked once as every job's payload is (JobRequest): a bad one is one
    ValueError before anything is read or written, not an error on every row and a state file that keeps it."""
    if max_in_flight < 1:
        raise ValueError(f"--max-in-flight must be at least 1, got {max_in_flight}")
    values = {**options.defaults, "priority": priority}
    try:
        JobRequest.model_validate({"prompt": "x", **values})
    except ValidationError as exc:
        problems = "; ".join(_settings_problem(error, values) for error in exc.errors())
        raise ValueError(f"bad batch settings: {problems}") from None


def _settings_problem(error: Any, values: dict[str, Any]) -> str:
    """``--temperature 5.0: Input should be ...``: named by the flag that set it (and the place in a nested value)."""
    if not error["loc"]:
        return error["msg"]
    name, *inner = error["loc"]
    flag = "--" + str(name).replace("_", "-")
    where = ".".join(str(part) for part in inner) if inner else values.get(name)
    return f"{flag} {where}: {error['msg']}"


def run_batch(
    client: Client,
    input_path: str | Path,
    output_path: str | Path,
    *,
    errors_path: str | Path | None = None,
    max_in_flight: int = 256,
    timeout: float | None = None,
    poll_interval: float = 0.2,
    log_interval: float = 10.0,
    run_id: str | None = None,
    priority: int = BULK_PRIORITY,
    options: RowOptions | None = None,
    input_format: str | None = None,
    output_format: str | None = None,
    on_start: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run every row of ``input_path`` as a job (``on_start`` called once the run is taken, its settings kept beside
    the output, before any job); returns ``total``, ``skipped`` (already in the output),
    ``succeeded``, ``failed``, ``reused`` (succeeded rows whose job an earlier run had submitted) and ``failures``
    (failed rows by reason).

    ``run_id`` derives new job ids (``job_id_for``): pass a new one to generate again what an earlier run's
    jobs still hold in Redis, the same one to resume that run. Ctrl-C raises BatchInterrupted with the counts.
    """
    if run_id is not None and not RUN_ID.fullmatch(run_id):
        raise ValueError(f"a run id is 1 to 32 letters and digits, got {run_id!r}")
    queue = client.queue.name
    options = options or RowOptions()
    check_run_settings(options, priority, max_in_flight)
    input_path, output_path = Path(input_path), Path(output_path)
    errors_path = Path(errors_path) if errors_path else default_errors_path(output_path)
    _check_paths(errors_path, input_path, output_path)
    in_fmt, out_fmt = _formats(input_path, input_format, output_path, output_format)
    options = options.for_format(in_fmt)
    _check_columns(input_path, in_fmt, options)
    summary: dict[str, Any] = {"total": 0, "skipped": 0, "succeeded": 0, "failed": 0, "reused": 0, "failures": {}}
    progress: Progress | None = None
    done: dict[str, int] | None = None  # (None: the output not read yet)
    sink: Sink | None = None

    def in_output() -> int | None:
        """The rows the output holds: a JSONL output's rows are there once flushed; a Parquet output is whole only
        once closed (one a disk full stopped is as it was), and holds failed rows too: not said."""
        if done is None or sink is None or not sink.keeps_flushed_rows:
            return None
        return len(done) + summary["succeeded"]

    try:
        summary["total"] = count_rows(input_path, in_fmt)  # a first pass that keeps nothing: for progress and ETA
        with _only_run_on(output_path):
            client.connection.ping()  # a Redis that does not answer: one error, and nothing written (settings, errors)
            sink = _open_sink(output_path, out_fmt, input_path, in_fmt, options)
            done = sink.done()
            settings, queue = _settings_on(output_path, options, queue)
            run_id = _run_id_of(output_path, run_id)
            # (a refused run leaves the last errors)
            _check_settings(output_path, settings, bool(done), run_id=run_id, input_name=input_path.name)
            if on_start is not None:
                on_start()
            with _files_failing_stop(summary), open_lines(errors_path, "w") as err, _signals_interrupt():
                progress = Progress(summary["total"], 0, 0, log_interval)
                sink.open(err)
                try:
                    lines = _read_input(
                        input_path, in_fmt, options, done, run_id, queue, summary, priority, sink, progress
                    )
                    try:
                        _run(client, lines, sink, progress, summary, max_in_flight, timeout, poll_interval)
                    except (*REDIS_UNAVAILABLE, ResponseError) as exc:  # (it answered the ping: not a wrong URL)
                        if not redis_waits(exc):
                            raise
                        raise RedisLost(summary, exc) from exc
                finally:  # also on Ctrl-C: every row is written whole, and a Parquet output gets its footer
                    sink.close()
                    _release_written(client, sink)
        progress.finish(summary, output_path, errors_path)
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        raise BatchInterrupted(summary, signum, in_output()) from None
    except BatchStopped as exc:
        exc.in_output = in_output()
        raise
    finally:
        if progress is not None:
            progress.close()
    return summary


@contextmanager
def _files_failing_stop(summary: dict[str, Any]) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise FilesFailed(summary, exc) from exc


def _check_paths(errors_path: Path, input_path: Path, output_path: Path) -> None:
    """The input is read twice (its rows counted first), so it is a file, not a pipe (the count would use it up
    and the run would find no row); the output is read back to resume and appended to, so it is a file too (stdout
    hung, read for rows done); the errors file is rewritten each run: neither is the input, nor one the other. Each
    said before anything is written (a missing errors folder was found once a fresh run had taken its id)."""
    for name, path in (("input", input_path), ("output", output_path)):
        if str(path) == "-":  # (it was a file of that name, or its format could not be told)
            raise ValueError(
                f"the {name} cannot be stdin or stdout ('-'): the input is read twice, the output read back to "
                "resume; give a file path"
            )
    if output_path.exists() and not output_path.is_file():
        raise ValueError(
            f"the output {output_path} is not a regular file: it is read back to resume and appended to; give a "
            "file path"
        )
    if not output_path.parent.is_dir():
        raise ValueError(f"the output's folder {output_path.parent} does not exist")
    if not errors_path.parent.is_dir():
        raise ValueError(f"the errors file's folder {errors_path.parent} does not exist: give --errors another path")
    if errors_path.is_dir():  # (the errno's own words, as the output's own check says them)
        raise ValueError(f"the errors file {errors_path} is a folder: give --errors a file path")
    if input_path.exists() and not (input_path.is_file() or input_path.is_dir()):  # (a folder: a saved dataset)
        raise ValueError(
            f"the input {input_path} is not a regular file (a pipe?): it is read twice, to count its rows first; "
            "save it to a file"
        )
    if output_path.resolve() == input_path.resolve():
        raise ValueError(f"the output {output_path} is the input: give -o another path")
    for name, path in (("input", input_path), ("output", output_path)):
        if errors_path.resolve() == path.resolve():
            raise ValueError(f"the errors file {errors_path} is the {name}: give --errors another path")


@contextmanager
def _only_run_on(output_path: Path) -> Iterator[None]:
    """One run at a time on an output (a lock file beside it, held while the run writes): two at once wrote every
    row twice into a JSONL output, and left a Parquet output corrupt."""
    if not output_path.parent.is_dir():
        raise ValueError(f"the output's folder {output_path.parent} does not exist")
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    real = Path(os.path.realpath(output_path))  # (a link to an output took a lock of its own: two runs wrote it)
    lock_path = real.with_name(real.name + ".lock")
    while True:
        lock = open(lock_path, "a")  # noqa: SIM115 (closed below, or when the run ends)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise ValueError(
                f"another run is writing {output_path} (it holds {lock_path}); wait for it to end"
            ) from None
        except OSError as exc:  # a filesystem without locks (a FUSE bucket mount, NFS without its lock daemon)
            lock.close()
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK, errno.EINVAL):
                raise
            lock_path.unlink(missing_ok=True)
            log.warning("cannot lock %s (%s): nothing keeps a second run off this output", lock_path, exc.strerror)
            yield
            return
        # The file locked must still be the one at the path: a run that ended removed it after this one opened it,
        # and a third run would lock a new file beside this one's lock of the removed one.
        try:
            if os.stat(lock_path).st_ino == os.fstat(lock.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        lock.close()
    with lock:
        try:
            yield
        finally:
            lock_path.unlink(missing_ok=True)  # the lock goes with its run


@contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP (a kill, a closed terminal) stop the run as Ctrl-C does: every row settled is written and
    the output is whole and resumable. The first only: a second one acts as it did before the run. One ignored
    when the run starts stays ignored: ``nohup`` ignores SIGHUP so that a run outlives its terminal."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may handle signals
        yield
        return
    names = [
        name
        for name in ("SIGTERM", "SIGHUP")
        if hasattr(signal, name) and signal.getsignal(getattr(signal, name)) is not signal.SIG_IGN
    ]
    before = {name: signal.getsignal(getattr(signal, name)) for name in names}

    def interrupt(signum: int, frame: Any) -> None:
        _restore(before)
        raise _Signaled(signum)

    for name in names:
        signal.signal(getattr(signal, name), interrupt)
    try:
        yield
    finally:
        _restore(before)


def _restore(handlers: dict[str, Any]) -> None:
    for name, handler in handlers.items():
        signal.signal(getattr(signal, name), handler)


def dry_run(
    input_path: str | Path,
    output_path: str | Path,
    *,
    errors_path: str | Path | None = None,
    run_id: str | None = None,
    priority: int = BULK_PRIORITY,
    options: RowOptions | None = None,
    input_format: str | None = None,
    output_format: str | None = None,
    tokenizer: Any = None,
    queue: str = DEFAULT_QUEUE,
) -> dict[str, Any]:
    """Check every row as ``run_batch`` would on ``queue``, submitting nothing: ``total``, ``valid`` (would run),
    ``skipped`` (already in the output), ``failed`` (bad rows, written to the errors file) and ``failures`` by
    reason. With a
    ``tokenizer`` (a transformers tokenizer: its chat template applied to messages), also ``prompt_tokens`` of the
    rows that would run and the longest one's, ``max_prompt_tokens``."""
    options = options or RowOptions()
    check_run_settings(options, priority)
    input_path, output_path = Path(input_path), Path(output_path)
    errors_path = Path(errors_path) if errors_path else default_errors_path(output_path, dry=True)
    _check_paths(errors_path, input_path, output_path)
    in_fmt, out_fmt = _formats(input_path, input_format, output_path, output_format)
    options = options.for_format(in_fmt)
    _check_columns(input_path, in_fmt, options)
    summary: dict[str, Any] = {"total": count_rows(input_path, in_fmt), "skipped": 0, "succeeded": 0, "failed": 0}
    summary.update(reused=0, failures={})
    # Under the run lock too: it reads (and may cut) the output's last line and rewrites the errors file.
    with _only_run_on(output_path):
        sink = _open_sink(output_path, out_fmt, input_path, in_fmt, options)
        done = sink.done(cut=False)
        settings, queue = _settings_on(output_path, options, queue)
        run_id = _run_id_of(output_path, run_id)
        _check_settings(output_path, settings, bool(done), write=False, input_name=input_path.name)  # as the run
        with open_lines(errors_path, "w") as err, open(os.devnull, "w") as quiet:
            sink.open(err, output=False)
            progress = Progress(summary["total"], 0, 0, log_interval=float("inf"), stream=quiet)
            lines = _read_input(input_path, in_fmt, options, done, run_id, queue, summary, priority, sink, progress)
            valid = prompt_tokens = longest = 0
            for line in lines:
                valid += 1
                if tokenizer is not None:
                    n = count_prompt_tokens(tokenizer, line.payload)
                    prompt_tokens, longest = prompt_tokens + n, max(longest, n)
            sink.flush()
    counts = {k: summary[k] for k in ("total", "skipped", "failed", "failures")}
    if tokenizer is not None:
        counts.update(prompt_tokens=prompt_tokens, max_prompt_tokens=longest)
    return {**counts, "valid": valid}


def count_prompt_tokens(tokenizer: Any, payload: dict[str, Any]) -> int:
    """The prompt's tokens as the worker makes them: the chat template applied to messages, a plain prompt as is."""
    if "messages" in payload:
        job = JobRequest.model_validate(payload)
        messages = template_messages(tokenizer, job)  # (the template's forms: tool calls' arguments, roles)
        return len(tokenizer.apply_chat_template(messages, return_dict=False, **job.template_args()))
    if "prompt_token_ids" in payload:
        return len(payload["prompt_token_ids"])
    return len(tokenizer.encode(payload["prompt"]))


def _read_input(
    path: Path,
    fmt: str,
    options: RowOptions,
    done: dict[str, int],
    run_id: str | None,
    queue: str,
    summary: dict[str, Any],
    priority: int,
    sink: Sink,
    progress: Progress,
) -> Iterator[Line]:
    """The rows still to run, read as they are needed (memory stays bounded by the jobs in flight, plus the ids
    seen); bad rows go to the errors, rows already in the output are counted as they come. A row in the output
    made from another request than this row's (the input changed since) is refused, not mixed in."""
    seen: set[str] = set()
    for number, raw in read_rows(path, fmt):
        try:
            line = parse_line(number, raw, run_id, priority, options, queue)
        except BadLine as exc:
            known = exc.custom_id is not None and exc.custom_id not in seen  # a row of its own in a Parquet output,
            # unless the output holds this id's row from before (kept, as a JSONL output keeps its line: both made
            # one id two rows)
            failed = Line(number, exc.custom_id, "", {}, "", exc.row) if known and exc.custom_id not in done else None
            if known:
                seen.add(exc.custom_id)  # its id is taken: a later row of the same id is a duplicate, not a 2nd row
            error = error_line(number, exc.custom_id, "invalid_request", str(exc), param=exc.param)
            _bad(sink, error, summary, progress, failed)
            continue
        if line.custom_id in seen:
            error = error_line(number, line.custom_id, "duplicate_custom_id", "custom_id already used above")
            _bad(sink, error, summary, progress)
            continue
        seen.add(line.custom_id)
        refused = sink.refuse(line.payload)
        if refused:
            kept = line if line.custom_id not in done else None  # (as above)
            _bad(sink, error_line(number, line.custom_id, "invalid_request", refused), summary, progress, kept)
            continue
        digest = done.get(line.custom_id)
        if digest is None:
            yield line
        elif digest == payload_digest(line.job_id):
            summary["skipped"] += 1
            progress.skip()
        else:
            message = "the output holds this custom_id made from another request (the row or the settings changed)"
            _bad(sink, error_line(number, line.custom_id, "changed_request", message), summary, progress)


def _bad(
    sink: Sink, error: dict[str, Any], summary: dict[str, Any], progress: Progress, line: Line | None = None
) -> None:
    """A row refused before it ran: in the errors, and given its ``line``, in a Parquet output as a failed row."""
    sink.error(error, line)
    _count_failure(summary, error["error"]["code"])
    progress.skip(failed=True)


def _count_failure(summary: dict[str, Any], code: str) -> None:
    summary["failed"] += 1
    summary["failures"][code] = summary["failures"].get(code, 0) + 1


def _run(
    client: Client,
    lines: Iterator[Line],
    sink: Sink,
    progress: Progress,
    summary: dict[str, Any],
    max_in_flight: int,
    timeout: float | None,
    poll_interval: float,
) -> None:
    """Keep jobs in flight and write each row as its job ends. The run's jobs push their ids onto a completion
    list of its own when they end, and the run blocks on it; every job in flight is also looked at now and then
    (``poll_interval``, backing off to 5 s or to ``poll_interval`` if longer), for the endings no job announces (a
    job that expired, one submitted by an earlier run, one canceled by a client older than this one's)."""
    conn = client.connection
    notify = f"batch-{secrets.token_hex(8)}"
    in_flight: dict[str, tuple[Line, float | None]] = {}  # job id -> its line, when it was first seen running
    reused: dict[str, bool] = {}  # job id -> whether it had ended before this run
    more = True
    sweep_every, next_sweep = poll_interval, 0.0
    workers, names = WorkerWatch(client, progress), ModelTokenNames(client)
    pending, outage = Lines(lines), RedisOutage(progress)
    try:
        while more or in_flight or pending.taken_back:
            try:
                picked_up = len(reused)
                more = _submit(client, pending, in_flight, max_in_flight, reused, notify)
                if len(reused) > picked_up:  # an earlier run's jobs: they announce their ends to it, so look now
                    sweep_every, next_sweep = poll_interval, 0.0
                if not in_flight:
                    if pending.taken_back:  # (rows whose ids canceled runs still hold: looked at each poll)
                        time.sleep(poll_interval)
                    continue  # (the input used up: nothing to wait for)
                if time.monotonic() >= next_sweep or outage.since is not None:  # (after an outage: every job)
                    ended = list(in_flight)
                    sweep_every = min(sweep_every * 2, max(poll_interval, 5.0))
                    next_sweep = time.monotonic() + sweep_every
                else:
                    wait = min(longest_block_s(conn), next_sweep - time.monotonic())
                    ended = _wait_for_endings(conn, done_key(notify), wait)
                ended = list(dict.fromkeys(j for j in ended if j in in_flight))  # an id pushed twice (a write again)
                _settle(client, ended, in_flight, reused, sink, progress, summary, timeout, names, pending)
                outage.over()
                progress.tick()
                workers.check()
            except (*REDIS_UNAVAILABLE, ResponseError) as exc:  # a failover, a restart: each step can be taken again
                if not redis_waits(exc):  # (full, read-only or loading for now: waited out as the worker waits)
                    raise
                outage.wait(exc)
    finally:
        # (a list of ids; it expires) not an error on top of Redis gone or busy: that would hide a Ctrl-C
        with contextlib.suppress(*REDIS_UNAVAILABLE, ResponseError):
            conn.delete(done_key(notify))


class ModelTokenNames:
    """A run's token names per model (``TokenizerCache.names`` for a synchronous reader): the tokenizer a live worker
    serving the model wrote to Redis, looked up once a run; by id where there is none."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._by_model: dict[str, TokenNames] = {}

    def __call__(self, model: str) -> TokenNames:
        if model not in self._by_model:
            digest = digest_of(self.client.workers(), model)
            self._by_model[model] = load_names(self.client.connection, digest)
        return self._by_model[model]


WORKER_CHECK_S = 10.0  # how often a run waiting on its jobs looks for a live worker on the queue


class WorkerWatch:
    """Says once when no live worker serves the queue (the run's jobs wait there: a progress line of 0 rows/s told
    nothing of why), and again if the workers come and go."""

    def __init__(self, client: Client, progress: Progress) -> None:
        self.client, self.progress = client, progress
        self.next_check, self.warned = 0.0, False

    def check(self) -> None:
        if time.monotonic() < self.next_check:
            return
        self.next_check = time.monotonic() + WORKER_CHECK_S
        warning = self.client.no_worker_warning()
        if warning is not None and not self.warned:
            self.progress.note(warning)
        self.warned = warning is not None


def _wait_for_endings(conn, key: str, wait: float) -> list[str]:
    """Job ids pushed onto ``key`` within ``wait`` seconds: the first blocks, the rest come in the same call."""
    first = conn.blpop([key], timeout=max(wait, 0.01))
    if first is None:
        return []
    with conn.pipeline() as pipe:  # MULTI: nothing pushed between the read and the delete is lost
        pipe.lrange(key, 0, -1)
        pipe.delete(key)
        rest, _ = pipe.execute()
    return [x.decode() if isinstance(x, bytes) else x for x in [first[1], *rest]]


def _settle(
    client: Client,
    job_ids: list[str],
    in_flight: dict[str, tuple[Line, float | None]],
    reused: dict[str, bool],
    sink: Sink,
    progress: Progress,
    summary: dict[str, Any],
    timeout: float | None,
    names: ModelTokenNames | None = None,
    lines: Lines | None = None,
) -> None:
    """Write the rows of the jobs among ``job_ids`` that ended, and fail those running for longer than ``timeout``
    (from when a look first saw them started: time waiting in the queue, behind other jobs, is not theirs). A job
    Redis lost (no hash, no result: a restart without persistence) goes back to ``lines`` to be submitted again,
    once: its row failed ``job_missing``, though Redis only was at fault."""
    if not job_ids:
        return
    counted = {k: summary[k] for k in ("succeeded", "failed", "reused")}, dict(summary["failures"])
    with client.connection.pipeline(transaction=False) as pipe:
        for job_id in job_ids:  # the status first, as the client reads them
            pipe.hget(f"rq:job:{job_id}", "status")
            read_result(pipe, job_id)
        replies = pipe.execute()
    now = time.monotonic()
    written = []
    for job_id, status, entries in zip(job_ids, replies[::2], replies[1::2]):
        line, started = in_flight[job_id]
        status = status.decode() if status else "missing"
        if started is None and status == "started":
            in_flight[job_id] = (line, now)
        result = result_from_entries(entries)
        if result is not None and result.get("status") == "finished":
            sink.result(line, output_line(line, result, names), result)
            summary["succeeded"] += 1
            made_before = reused.get(job_id)  # (popped below: a long run keeps no ended job's id)
            summary["reused"] += made_before is not None
            progress.update(result["usage"]["completion_tokens"], made_before=bool(made_before))
        elif status == "missing" and result is None and lines is not None and job_id not in lines.lost:
            lines.lost.add(job_id)
            lines.taken_back.append(line)
            del in_flight[job_id]
            reused.pop(job_id, None)
            continue
        elif status in ("failed", "canceled", "stopped", "missing", "finished"):
            reason = (result or {}).get("error") or _failure_reason(client, job_id, status)
            # The worker found the row at fault: the row's error, as one refused here; a prompt past the context by
            # OpenAI's code for it, so those rows can be found, shortened and run again.
            fault = (result or {}).get("error_type") == "invalid_request"
            code = ((result or {}).get("error_code") or "invalid_request") if fault else "job_" + status
            _fail(sink, line, code, reason, summary, progress)
        elif timeout is not None and started is not None and now - started > timeout:
            if not client.job(job_id).cancel():
                continue  # it ended since its status was read: the next look writes its row
            reason = f"no result within {timeout} s of its start: the job was canceled (a rerun submits it again)"
            _fail(sink, line, "timeout", reason, summary, progress)
        else:
            continue
        del in_flight[job_id]
        reused.pop(job_id, None)
        written.append(job_id)
    try:
        sink.flush()
    except OSError:  # (a disk full: those rows never reached the files, and the counts said they had)
        summary.update(counted[0], failures=counted[1])
        raise
    if sink.keeps_flushed_rows:
        _release(client, written)


RELEASED_TTL_S = STREAM_TTL_AFTER_END_S  # a written row's job and result: kept for a look, not for the client's day


def _release_written(client: Client, sink: Sink) -> None:
    """A Parquet output's rows, once it is whole, released as a JSONL output's are at each flush: their jobs kept
    a day, a finished run of the format the dataset guide names held ~10 KB of Redis a row for that day."""
    rows_written = getattr(sink, "rows_written", None)
    if rows_written is None:
        return
    with contextlib.suppress(*REDIS_UNAVAILABLE, ResponseError):  # (a saving, not the run's: they expire in a day)
        for job_ids in rows_written():
            _release(client, job_ids)


def _release(client: Client, job_ids: list[str]) -> None:
    """The jobs of rows now in the output, their results no longer needed (a rerun skips those rows): expired soon,
    not kept the client's ``result_ttl`` (a day). Each finished row held ~6.5 KB of Redis for that day, so a run of a
    million rows filled a Redis with noeviction and ended the run. Only shortened, never lengthened."""
    keys = [key for job_id in job_ids for key in (f"rq:job:{job_id}", result_key(job_id))]
    if not keys:
        return
    with client.connection.pipeline(transaction=False) as pipe:  # (EXPIRE ... LT is Redis 7's; 6.2 is served)
        for key in keys:
            pipe.ttl(key)
        for job_id in job_ids:
            pipe.hmget(f"rq:job:{job_id}", "status", "origin")
        replies = pipe.execute()
        for key, ttl in zip(keys, replies):
            if ttl == -1 or ttl > RELEASED_TTL_S:  # (-2: gone already)
                pipe.expire(key, RELEASED_TTL_S)
        # The registry entry goes when the hash does (RQ's score is its end of life): it counted the row finished
        # (failed: a year) in `rq info` and `roseinfer status` for the client's TTL, its hash gone long since.
        until = time.time() + RELEASED_TTL_S
        for job_id, (status, origin) in zip(job_ids, replies[len(keys) :]):
            registry = _REGISTRY_OF.get(status)
            if registry is not None and origin:
                key = f"rq:{registry}:{origin.decode(errors='replace')}"
                pipe.zadd(key, {job_id: until}, xx=True, lt=True)
        pipe.execute()


_REGISTRY_OF = {b"finished": "finished", b"failed": "failed", b"stopped": "failed", b"canceled": "canceled"}


def _fail(sink: Sink, line: Line, code: str, reason: str, summary: dict[str, Any], progress: Progress) -> None:
    sink.error(error_line(line.number, line.custom_id, code, reason, line.job_id), line)
    _count_failure(summary, code)
    progress.update(0, failed=True)


class Lines:
    """The input's lines, and those a submit took but could not send (Redis went away): handed out again first."""

    def __init__(self, lines: Iterator[Line]) -> None:
        self.lines, self.taken_back = lines, []
        self.tried: set[str] = set()  # job ids of lines taken back: their submit may have gone in, theirs if so
        self.lost: set[str] = set()  # job ids Redis lost (no hash, no result) once: submitted again, once

    def __iter__(self) -> Lines:
        return self

    def __next__(self) -> Line:
        return self.taken_back.pop() if self.taken_back else next(self.lines)

    def take_back(self, taken: list[Line]) -> None:
        self.taken_back.extend(reversed(taken))
        self.tried.update(line.job_id for line in taken)


class RedisOutage:
    """A run waits out Redis going away (a failover, a restart) for ``REDIS_PATIENCE_S``, saying so once a minute;
    past that it ends as Ctrl-C ends it, resumable (``RedisLost``)."""

    def __init__(self, progress: Progress) -> None:
        self.progress, self.since, self.backoff, self.said = progress, None, 0.5, 0.0

    def wait(self, exc: Exception) -> None:
        mono = time.monotonic()
        self.since = self.since or mono
        if mono - self.since > REDIS_PATIENCE_S:
            raise exc
        if mono >= self.said + 60:
            self.progress.note(f"Redis unavailable ({exc}): waiting for it, up to {REDIS_PATIENCE_S:g} s in all")
            self.said = mono
        time.sleep(self.backoff)
        self.backoff = min(self.backoff * 2, 10.0)

    def over(self) -> None:
        if self.since is not None:
            self.progress.note(f"Redis answers again after {time.monotonic() - self.since:.0f} s: the run goes on")
        self.since, self.backoff, self.said = None, 0.5, 0.0


def _submit(
    client: Client,
    lines: Lines,
    in_flight: dict[str, tuple[Line, float | None]],
    limit: int,
    reused: dict[str, bool],
    notify: str | None = None,
) -> bool:
    """Top up to ``limit`` jobs in flight from ``lines``; a line whose job exists from an earlier run is picked
    up, not redone (and its id added to ``reused``). False once ``lines`` is used up."""
    take: list[Line] = []
    more = True
    while len(in_flight) + len(take) < limit:
        line = next(lines, None)
        if line is None:
            more = False
            break
        take.append(line)
    if not take:
        return more
    try:
        stopping = _submit_lines(client, take, in_flight, reused, notify, lines.tried)
    except BaseException:  # (Redis went away) handed out again: a job that went in is then picked up, not doubled
        lines.take_back([line for line in take if line.job_id not in in_flight])
        raise
    lines.taken_back.extend(reversed(stopping))  # (submitted again at the next poll; its submit never went in)
    return more


def _submit_lines(
    client: Client, take: list[Line], in_flight: dict[str, tuple[Line, float | None]], reused: dict[str, bool],
    notify: str | None, tried: set[str],
) -> list[Line]:  # fmt: skip
    """Submit ``take``'s lines, or follow the jobs of theirs live already; those whose id a canceled job's run still
    being stopped holds are returned, to be submitted once it has ended."""
    with client.connection.pipeline(transaction=False) as pipe:
        for line in take:
            pipe.hget(f"rq:job:{line.job_id}", "status")
            pipe.exists(result_key(line.job_id))
        replies = pipe.execute()
    fresh = []
    for line, status, has_result in zip(take, replies[::2], replies[1::2]):
        status = status.decode() if status else None
        if status in _LIVE or (status == "finished" and has_result):
            in_flight[line.job_id] = (line, None)
            if line.job_id not in tried:  # (else this run's own submit went in, its reply lost)
                reused[line.job_id] = status == "finished"
            continue
        # (Failed or canceled last time, or finished with its result expired: submitted again, which clears the old
        # job's stream and result but keeps its hash, whose owner field fences off a run of it still going.)
        fresh.append(line)
    extra = {"notify": notify} if notify else {}  # not part of the payload the job id is derived from
    later: list[Line] = []
    while fresh:
        try:
            client.submit_many([{**line.payload, **extra, "job_id": line.job_id} for line in fresh])
            break
        except JobIdTaken as exc:  # another run of this input submitted them since the look: followed, as its jobs
            taken, stopping = set(exc.job_ids), set(exc.stopping)
            for line in fresh:
                if line.job_id in stopping:  # (an interrupted run's, canceled: its worker ends it within a step)
                    later.append(line)
                elif line.job_id in taken:
                    in_flight[line.job_id] = (line, None)
                    if line.job_id not in tried:
                        reused[line.job_id] = False
            fresh = [line for line in fresh if line.job_id not in taken]
    for line in fresh:
        in_flight[line.job_id] = (line, None)
    return later


def _failure_reason(client: Client, job_id: str, status: str) -> str:
    if status == "missing":
        return "the job disappeared from Redis (expired or deleted)"
    if status == "finished":  # RQ writes a result with the status: this one is gone
        return "the job finished, but its result expired"
    from producer.job_errors import JobError

    try:
        client.job(job_id)._raise_ended(status)
    except JobError as exc:
        return exc.reason
    return status
