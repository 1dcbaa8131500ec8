"""Where a batch's rows come from and where its outputs go: JSONL (OpenAI batch lines, or plain rows), Parquet, or
(input only) a Hugging Face ``datasets`` folder (``Dataset.save_to_disk``; the ``datasets`` extra).

Rows are read one at a time (Parquet in record batches), and outputs are written as jobs end, so a run's memory is
bounded by the jobs in flight and the set of ids already done, never by the file. A Parquet output is written to a
temporary file beside it and renamed over it when the run ends or is interrupted (the file is then whole); a rerun
copies the rows of the last one in record batches and goes on after them.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import logging
import os
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger("roseinfer.batch")

FORMATS = ("jsonl", "parquet", "hf")
OUTPUT_FORMATS = ("jsonl", "parquet")
_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
OUTPUT_EXTENSIONS = frozenset(_EXTENSIONS)  # (every format an extension names is an output's too)
# Columns a Parquet output adds to the input's.
ADDED_COLUMNS = ("output", "finish_reason", "prompt_tokens", "completion_tokens", "error", "job_id")
# Payload defaults a run may set for every row that names none (``--max-tokens`` ...).
DEFAULT_FIELDS = ("max_tokens", "temperature", "seed", "n", "response_format")
_BATCH_ROWS = 1024  # Parquet rows read or written at a time (a Parquet output's row group)
_BOM = b"\xef\xbb\xbf"
OUTPUT_LINE_START = b'{"id": "batch_req_'  # how json.dumps writes every output line (batch.output_line's dict)


def at_least(kind: Callable[[str], float], low: float, inclusive: bool = True) -> Callable[[str], float]:
    """An argparse type for a number flag of ``roseinfer batch``: ``kind`` of at least ``low`` (above it, when not
    ``inclusive``); NaN never passes. ``--max-in-flight 0`` submitted nothing and waited forever."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not (value >= low if inclusive else value > low):
            raise argparse.ArgumentTypeError(f"must be {'at least' if inclusive else 'above'} {low}, got {text}")
        return value

    return parse


def format_of(path: str | Path, given: str | None = None, flag: str = "--format") -> str:
    """The file's format: ``given`` (``flag``), else its extension."""
    if given is not None:
        if given not in FORMATS:
            raise ValueError(f"the format is one of {FORMATS}, got {given!r}")
        return given
    if Path(path).is_dir():
        return "hf"
    suffix = Path(path).suffix.lower()
    if suffix in (".csv", ".tsv"):  # (--format has no such choice: "pass --format" led nowhere)
        raise ValueError(f"{path}: {suffix[1:].upper()} is not read; convert it to JSONL or Parquet")
    if suffix in (".gz", ".zst", ".bz2", ".xz", ".zip"):  # ("pass --format jsonl" led to a bad row a line)
        raise ValueError(
            f"{path}: a compressed file ({suffix}) is neither read nor written: decompress an input first, and name "
            "an output .jsonl or .parquet"
        )
    if suffix not in _EXTENSIONS:
        raise ValueError(f"{path}: cannot tell its format from {suffix or 'no extension'!r}; pass {flag}")
    return _EXTENSIONS[suffix]


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("Parquet needs pyarrow: pip install 'roseinfer[parquet]'") from None
    return pa, pq


def _parquet_input(path: Path) -> Any:
    """The input as a ``ParquetFile``; a file that is not one is said with its path (pyarrow's own error names
    none: "Parquet magic bytes not found in footer")."""
    pq = _pyarrow()[1]
    try:
        return pq.ParquetFile(path)
    except ValueError as exc:  # (pyarrow's ArrowInvalid is one)
        raise ValueError(f"{path} is not a Parquet file ({exc})") from None


@dataclass
class RowOptions:
    """How plain rows (a Parquet table, or JSONL rows of data) become jobs, and the run's per-row defaults."""

    prompt_column: str | None = None  # the column holding a plain prompt
    messages_column: str | None = None  # the column holding chat messages
    id_column: str | None = None  # the column holding each row's id (default: its row number)
    defaults: dict[str, Any] = field(default_factory=dict)  # payload fields for rows that name none
    chat: bool = False  # the prompt column as the user's message (the chat template applied), not a raw prompt
    system: str | None = None  # with ``chat``: a system message before it
    tool_call_parser: str | None = None  # the model's own tool-call format, for OpenAI lines' tool_choice "auto"
    reasoning_parser: str | None = None  # how OpenAI chat lines' thinking is told from their answers

    @property
    def plain(self) -> bool:
        return self.prompt_column is not None or self.messages_column is not None

    def for_format(self, fmt: str) -> RowOptions:
        """A table (Parquet, a datasets folder) is always plain rows: prompts in the ``prompt`` column unless told."""
        if fmt in ("parquet", "hf") and not self.plain:
            return dataclasses.replace(self, prompt_column="prompt")
        if self.chat and self.prompt_column is None:
            raise ValueError("--chat sends a prompt column as the user's message: name it with --prompt-column")
        return self

    def fingerprint(self) -> dict[str, Any]:
        """What makes two runs' rows different jobs: kept beside the output, a rerun with others is refused."""
        columns = {"prompt_column": self.prompt_column, "messages_column": self.messages_column}
        chat = {"chat": True, "system": self.system} if self.chat else {}  # (absent as before when not asked)
        parser = {"tool_call_parser": self.tool_call_parser} if self.tool_call_parser else {}
        parser |= {"reasoning_parser": self.reasoning_parser} if self.reasoning_parser else {}
        return {**columns, "id_column": self.id_column, "defaults": self.defaults, **chat, **parser}


# ----- input ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Undecodable:
    """A Parquet row with a string cell that is not UTF-8: a bad row of its own (never decoded with replacements:
    the job would run on a damaged prompt)."""

    reason: str


def read_rows(path: Path, fmt: str) -> Iterator[tuple[int, bytes | dict[str, Any] | Undecodable]]:
    """(row number from 1, the row): a JSONL line's bytes (blank lines skipped; decoded strictly by the parser, so a
    line that is not UTF-8 is a bad line of its own), or a Parquet row as a dict (``Undecodable`` if not UTF-8)."""
    if fmt == "jsonl":
        yield from _jsonl_lines(path)
        return
    if fmt == "hf":
        batches: Iterator[Any] = (b for b in _dataset(path).data.to_batches(max_chunksize=_BATCH_ROWS))
    else:
        batches = _parquet_input(path).iter_batches(batch_size=_BATCH_ROWS)
    number = 0
    for batch in batches:  # memory-mapped or read a record batch at a time: never the whole table as rows
        try:
            rows: list[Any] = batch.to_pylist()
        except UnicodeDecodeError:  # Parquet does not check its strings: find the bad rows, keep the others
            rows = [_row_or_why(batch, i) for i in range(batch.num_rows)]
        for row in rows:
            number += 1
            yield number, row


def _row_or_why(batch: Any, i: int) -> dict[str, Any] | Undecodable:
    try:
        return batch.slice(i, 1).to_pylist()[0]
    except UnicodeDecodeError:
        for name, column in zip(batch.schema.names, batch.columns):
            try:
                column.slice(i, 1).to_pylist()
            except UnicodeDecodeError as exc:
                return Undecodable(f"column {name!r} is not UTF-8: {exc.reason} (byte {exc.object[exc.start]:#04x})")
        raise


def _jsonl_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """A JSONL file's non-blank lines with their numbers; a UTF-8 BOM before the first one is not part of it."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM) :]
            if raw.strip():
                yield number, raw


# A JSONL input's first bytes that say it is no UTF-8 text at all: each of its lines was a bad row ("not UTF-8").
_NOT_TEXT = {
    b"\x1f\x8b": "is gzip-compressed: decompress it first, e.g. gunzip -k {path}",
    b"\x28\xb5\x2f\xfd": "is zstd-compressed: decompress it first, e.g. zstd -d {path}",
    b"BZh": "is bzip2-compressed: decompress it first, e.g. bunzip2 -k {path}",
    b"\xfd7zXZ": "is xz-compressed: decompress it first, e.g. unxz -k {path}",
    b"PK\x03\x04": "is a zip archive: unzip it first",
    b"PAR1": "is a Parquet file: name it with a .parquet extension, or pass --format parquet",
    b"\xff\xfe": "is UTF-16 text: convert it to UTF-8 first, e.g. iconv -f UTF-16 -t UTF-8 {path} > rows.jsonl",
    b"\xfe\xff": "is UTF-16 text: convert it to UTF-8 first, e.g. iconv -f UTF-16 -t UTF-8 {path} > rows.jsonl",
}


def jsonl_input_problem(path: Path) -> str | None:
    """Why a JSONL input is no JSON Lines at all, where its start shows it: compressed, UTF-16, a JSON array or
    JSON written over many lines (each of its lines was a bad row, but for a last object, which ran alone)."""
    shown = shlex.quote(str(path))
    with path.open("rb") as f:
        head = f.read(4)
    for magic, why in _NOT_TEXT.items():
        if head.startswith(magic):
            return f"{path} {why.format(path=shown)}"
    first = next(_jsonl_lines(path), None)
    if first is not None and first[1].lstrip().startswith(b"["):
        return (
            f"{path} holds a JSON array, not JSON Lines (one object a line): convert it first, e.g. "
            f"jq -c '.[]' {shown} > rows.jsonl"
        )
    if first is not None and first[1].strip() == b"{":  # (no JSON Lines row is a lone brace)
        return (
            f"{path} holds JSON written over many lines, not JSON Lines (one object a line): convert it first, e.g. "
            f"jq -c . {shown} > rows.jsonl"
        )
    return None


def _dataset(path: Path) -> Any:
    try:
        from datasets import Dataset, load_from_disk
    except ImportError:
        raise ValueError("a datasets folder needs the datasets package: pip install 'roseinfer[datasets]'") from None
    ds = load_from_disk(str(path))
    if not isinstance(ds, Dataset):
        raise ValueError(f"{path} holds several splits ({', '.join(ds)}): name one split's folder")
    if getattr(ds, "_indices", None) is None:  # its table is its rows, in order: read as it is
        return ds
    return ds.flatten_indices()  # a selected or shuffled dataset: its rows in their order (a copy in its cache)


def count_rows(path: Path, fmt: str) -> int:
    if fmt == "hf":
        return len(_dataset(path))
    if fmt == "parquet":
        return _parquet_input(path).metadata.num_rows
    return sum(1 for _ in _jsonl_lines(path))


def input_columns(path: Path, fmt: str) -> Any:
    """The table's schema (its columns go into a Parquet output), or None for JSONL."""
    if fmt == "hf":
        return _dataset(path).data.schema.remove_metadata()
    return _parquet_input(path).schema_arrow if fmt == "parquet" else None


# ----- output --------------------------------------------------------------------------------------------
def open_lines(path: Path, mode: str) -> TextIO:
    """A JSONL file to write. A lone surrogate (a \\u escape of half a UTF-16 pair) can only sit inside a JSON
    string there, where backslashreplace writes it as that same escape: the line stays valid JSON, never raises."""
    return path.open(mode, encoding="utf-8", errors="backslashreplace")


def payload_digest(job_id: str) -> int:
    """The part of a batch job id that depends on the request alone (not on a run id), as a small int: a rerun
    keeps one per row done."""
    return int(job_id.rsplit("-", 1)[-1][:12], 16)


class JSONLSink:
    """OpenAI batch output lines, appended; bad rows and failed jobs in the errors file (rewritten each run)."""

    keeps_flushed_rows = True  # a row flushed is in the file for a rerun: its job's result is no longer needed

    def __init__(self, path: Path) -> None:
        self.path = path
        self.errors: TextIO | None = None
        self._out: TextIO | None = None

    def done(self, cut: bool = True) -> dict[str, int]:
        """custom_id -> payload digest of the rows already in the output. A last line cut short (a crash mid-write)
        is cut off (``cut``; a dry run changes nothing), so that the rows appended next start on a line of their
        own; its request runs again. A file of something else is refused: it was appended to (a pretty-printed
        ``results.json`` lost its last line to the cut, in a dry run too)."""
        done: dict[str, int] = {}
        if not self.path.exists():
            return done
        first, offset, text_end = True, 0, 0
        bad: list[tuple[int, int, bytes]] = []  # (line number, offset, text) of lines that are no output line
        with self.path.open("rb") as f:  # line by line: an output of millions of rows is never held in memory
            for number, raw in enumerate(f, 1):
                start, offset = offset, offset + len(raw)
                if not raw.strip():
                    continue
                text_end = offset
                try:
                    line = json.loads(raw)
                    done[line["custom_id"]] = payload_digest(line["response"]["request_id"])
                except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError, ValueError):
                    if first and not _cut_short_output_line(raw, ended=True):
                        raise ValueError(
                            f"{self.path} exists and is not a batch output (its first line is not an output "
                            "line): give a new output path, or remove that file"
                        ) from None
                    bad.append((number, start, raw))
                    continue
                first = False
        # The last line cut short, a newline added since (by an editor), is a crash's too; any other line that is no
        # output line is an edit by hand: its row ran again and the file stayed no JSONL (its id twice, once torn).
        last = bad[-1] if bad and bad[-1][1] + len(bad[-1][2]) == text_end else None
        ended = last is not None and last[2].endswith(b"\n")
        # (without its newline, any text that is no JSON, as a crash left it; JSON that is no output line is an edit)
        torn = (
            last
            if last is not None and (_cut_short_output_line(last[2], ended=True) if ended else not _is_json(last[2]))
            else None
        )
        edited = [number for number, _, _ in bad if torn is None or number != torn[0]]
        if edited:
            shown = ", ".join(map(str, edited[:5])) + (f" and {len(edited) - 5} more" if len(edited) > 5 else "")
            raise ValueError(
                f"{self.path}: line {shown} is not an output line (edited by hand?): its row would run again and "
                "the file hold it twice; fix or remove that line, then run again"
            )
        if cut and torn and ended:  # (after the look: a file not ours is left whole)
            log.warning("%s: removing a last line cut short (%d bytes); its request runs again", self.path,
                        len(torn[2]))  # fmt: skip
            with self.path.open("r+b") as f:
                f.truncate(torn[1])
        if cut:
            _cut_partial_last_line(self.path)
        return done

    def refuse(self, payload: dict[str, Any]) -> str | None:
        """Why this output cannot hold the output of a job of ``payload`` (None: it can)."""
        return None

    def open(self, errors: TextIO, output: bool = True) -> None:
        """Errors go to ``errors`` from now on; the output is opened too unless ``output`` is False (a dry run)."""
        self.errors = errors
        if output:
            self._out = open_lines(self.path, "a")

    def result(self, line: Any, out_line: dict[str, Any], result: dict[str, Any]) -> None:
        assert self._out is not None
        self._out.write(json.dumps(out_line, ensure_ascii=False) + "\n")

    def error(self, error: dict[str, Any], line: Any | None = None) -> None:
        _write_error(self.errors, error)

    def flush(self) -> None:
        """Every line settled so far reaches the file (a killed run keeps them; the rerun skips them), which must
        still be the output: one deleted or moved meanwhile took the lines into a file no one reads, the run ended
        "all succeeded", and its rows' results expired ten minutes later (``_release``)."""
        if self._out is not None:
            self._out.flush()
            try:
                ours = os.path.samestat(os.fstat(self._out.fileno()), os.stat(self.path))
            except FileNotFoundError:
                ours = False
            if not ours:
                raise OSError(errno.ENOENT, "the output was deleted or moved while the run wrote it", str(self.path))
        _flush(self.errors)

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None


def _as_parquet_reads(schema: Any) -> Any:
    """``schema`` as Parquet gives it back: a dataset's ``timestamp[s]`` is stored as ``timestamp[ms]``, its
    ``date64`` as ``date32``."""
    pa, pq = _pyarrow()
    sink = pa.BufferOutputStream()
    pq.write_table(schema.empty_table(), sink)
    return pq.ParquetFile(pa.BufferReader(sink.getvalue())).schema_arrow


def partial_path(path: Path) -> Path:
    """Where a Parquet output is written until its run closes it (a run killed outright leaves this alone)."""
    return path.with_name(path.name + ".partial")


class ParquetSink:
    """The input's columns with the run's added ones (``ADDED_COLUMNS``), a row per job as it ends. Failed rows
    are written with their ``error`` (and to the errors file) and run again on a rerun."""

    def __init__(self, path: Path, columns: Any, id_column: str, n: int, reasoning: bool = False) -> None:
        """``reasoning``: the run tells a chat's thinking from its answer (--reasoning-parser): a ``reasoning``
        column beside ``output``, which holds the answer alone."""
        pa, _ = _pyarrow()
        self.path = path
        self.errors: TextIO | None = None
        self.tmp = partial_path(path)
        base = columns if columns is not None else pa.schema([])
        if id_column not in base.names:  # rows named by number (row-N), or JSONL rows: the id gets a column
            base = base.append(pa.field(id_column, pa.string()))
        clash = [name for name in (*ADDED_COLUMNS, *(["reasoning"] if reasoning else [])) if name in base.names]
        if clash:
            raise ValueError(f"the input already has the columns {clash} that the output adds; rename them")
        per_sample = pa.list_(pa.string()) if n > 1 else pa.string()  # with --n above 1, a list: one per sample
        added = [("output", per_sample), *([("reasoning", per_sample)] if reasoning else [])]
        added += [("finish_reason", per_sample), ("prompt_tokens", pa.int64())]
        added += [("completion_tokens", pa.int64()), ("error", pa.string()), ("job_id", pa.string())]
        self.schema = base
        for name, kind in added:
            self.schema = self.schema.append(pa.field(name, kind))
        self._stored = _as_parquet_reads(self.schema)  # what a rerun finds in the file this run writes
        self.id_column, self.n, self.reasoning = id_column, n, reasoning
        self._keeps_input = columns is not None  # a Parquet input's columns are carried over
        self._rows: list[dict[str, Any]] = []
        self._writer: Any = None
        self._written = 0  # rows in the row groups written (-1 once a write failed)
        self._carried = 0  # rows of the last run's output, carried over: the first in this run's
        self.whole = False  # the run's output closed whole, in the output's place

    def refuse(self, payload: dict[str, Any]) -> str | None:
        """Why this output cannot hold the output of a job of ``payload``: its ``output`` column holds the run's
        number of samples a row (``--n``), so a row asking for another would lose samples or have none to give."""
        n = payload.get("n", 1)
        if n != self.n:
            return f"this row asks for n={n} samples; this Parquet output holds {self.n} a row (run with --n {n})"
        return None

    def done(self, cut: bool = True) -> dict[str, int]:
        """custom_id -> payload digest of the rows of the last run that succeeded (failed rows run again)."""
        done: dict[str, int] = {}
        for batch in self._previous_batches():
            for cid, job_id, error in zip(*(batch.column(c).to_pylist() for c in (self.id_column, "job_id", "error"))):
                if error is None and job_id:  # (a binary id column, as Spark writes text: its text, as rows read it)
                    name = cid.decode("utf-8", "replace") if isinstance(cid, bytes) else str(cid)
                    done[name] = payload_digest(job_id)
        return done

    def _previous_batches(self) -> Iterator[Any]:
        if not self.path.exists():
            return
        _, pq = _pyarrow()
        try:
            f = pq.ParquetFile(self.path)
        except Exception as exc:  # pyarrow raises its own error types for a file that is not Parquet
            raise ValueError(f"{self.path} exists and is not a Parquet file ({exc}); move it away") from None
        if not self._stored.equals(f.schema_arrow, check_metadata=False):
            raise ValueError(f"{self.path} has other columns than this run writes: write to a new output")
        yield from f.iter_batches(batch_size=_BATCH_ROWS)

    def open(self, errors: TextIO, output: bool = True) -> None:
        """Errors go to ``errors`` from now on; the output is started too unless ``output`` is False (a dry run):
        the last run's successful rows first, carried over."""
        self.errors = errors
        if not output:
            return
        _, pq = _pyarrow()
        self._writer = pq.ParquetWriter(self.tmp, self.schema)
        try:
            for batch in self._previous_batches():
                for row in batch.to_pylist():
                    if row["error"] is None:
                        self._add(row)
                        self._carried += 1
        except BaseException:  # (Ctrl-C in a long carry-over) the output stays as it was, no .partial beside it
            self._writer.close()
            self._writer = None
            self.tmp.unlink(missing_ok=True)
            raise

    def result(self, line: Any, out_line: dict[str, Any], result: dict[str, Any]) -> None:
        samples = result.get("choices") or [result]
        texts, reasons = [c["text"] for c in samples], [c.get("finish_reason") for c in samples]
        thoughts: list[str | None] = [None] * len(texts)
        if line.reasoning is not None:  # (the answer alone in output: null while the output was thinking, cut short)
            thoughts, texts = map(list, zip(*(line.reasoning.split(text) for text in texts)))  # type: ignore[assignment]
        usage = result.get("usage") or {}
        thinking = {"reasoning": thoughts if self.n > 1 else thoughts[0]} if self.reasoning else {}
        self._add(
            {
                **self._input_row(line),
                "output": texts if self.n > 1 else texts[0],
                **thinking,
                "finish_reason": reasons if self.n > 1 else reasons[0],
                "prompt_tokens": usage.get("prompt_tokens"),
                "completion_tokens": usage.get("completion_tokens"),
                "error": None,
                "job_id": result.get("id"),
            }
        )

    def error(self, error: dict[str, Any], line: Any | None = None) -> None:
        _write_error(self.errors, error)
        if line is not None:
            message = f"{error['error']['code']}: {error['error']['message']}"
            self._add({**self._input_row(line), "error": message, "job_id": line.job_id or None})

    def _input_row(self, line: Any) -> dict[str, Any]:
        row = dict(line.row) if self._keeps_input and line.row is not None else {}
        return {self.id_column: line.custom_id, **row}

    def _add(self, row: dict[str, Any]) -> None:
        """A row of the output; a row group is written each ``_BATCH_ROWS`` rows (see ``flush``)."""
        if self._writer is None:
            return  # a dry run: no output
        self._rows.append(row)
        if len(self._rows) >= _BATCH_ROWS:
            self._write_rows()

    def _write_rows(self) -> None:
        if self._rows and self._writer is not None:
            pa, _ = _pyarrow()
            # Taken first: a Ctrl-C between the write and the reset wrote the row group again at close.
            rows, self._rows = self._rows, []
            written = self._written
            self._written = -1  # (a write that fails: the file is not whole, whatever its close says)
            self._writer.write_table(pa.Table.from_pylist(rows, schema=self.schema))  # one row group
            self._written = written + len(rows)

    keeps_flushed_rows = False  # (see flush: a rerun takes the rows of a killed run from their jobs' results)

    def flush(self) -> None:
        """The errors file only. Rows wait for a whole row group: a run killed outright leaves a ``.partial``
        without its footer, which no rerun reads whatever it holds, so rows written early would save nothing; the
        rerun takes those rows from their jobs' results, still in Redis (kept a day), and Ctrl-C or SIGTERM
        write them at ``close``. A row group per poll made a footer larger than the data."""
        _flush(self.errors)

    def close(self) -> None:
        """Write what is buffered, close the file (its footer makes it whole) and put it in the output's place, once
        it reads whole: a write that failed (a disk full) left a file without its footer, which pyarrow's close does
        not say, and it replaced a whole output, every row of the earlier runs lost."""
        if self._writer is None:
            return
        try:
            if self._written >= 0:
                self._write_rows()
            _flush(self.errors)
        finally:
            writer, self._writer = self._writer, None
            writer.close()
        _, pq = _pyarrow()
        try:
            rows, why = pq.ParquetFile(self.tmp).metadata.num_rows, "a write to it failed"
        except Exception as exc:  # (pyarrow's own error types: no footer, say)
            rows, why = None, f"{exc}"
        if rows is None or rows != self._written:
            self.tmp.unlink(missing_ok=True)
            why = why if rows is None or self._written < 0 else f"{rows} rows in it of {self._written} written"
            raise OSError(errno.EIO, f"its new output was not written whole ({why}); {self.path} is as it was")
        os.replace(self.tmp, self.path)
        self.whole = True

    def rows_written(self) -> Iterator[list[str]]:
        """The jobs of the rows this run wrote that succeeded, a batch at a time, read back from the output once it
        is whole (``whole``): their results are no longer needed (``batch._release``). Read back, not held: a
        million ids were ~90 MB."""
        if not self.whole:
            return
        _, pq = _pyarrow()
        skip = self._carried  # (the carried rows come first: written as the output opened)
        for batch in pq.ParquetFile(self.path).iter_batches(batch_size=_BATCH_ROWS * 8, columns=["job_id", "error"]):
            ids, errors = batch.column(0).to_pylist(), batch.column(1).to_pylist()
            ours = [job_id for job_id, error in zip(ids[skip:], errors[skip:]) if job_id and error is None]
            skip = max(0, skip - len(ids))
            if ours:
                yield ours


def _write_error(errors: TextIO | None, error: dict[str, Any]) -> None:
    assert errors is not None, "open the sink first"
    errors.write(json.dumps(error, ensure_ascii=False) + "\n")


def _flush(errors: TextIO | None) -> None:
    if errors is not None:
        errors.flush()


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return True


def _cut_short_output_line(raw: bytes, ended: bool = False) -> bool:
    """Whether a line that is not an output line may be the start of one a crash cut short: no newline (``ended``:
    one added since), not JSON, and it begins as every output line does (a one-line ``notes.txt`` was cut off, a
    ``results.json`` appended to)."""
    if raw.endswith(b"\n"):
        if not ended:
            return False
        raw = raw.rstrip(b"\r\n")
    if not (raw.startswith(OUTPUT_LINE_START) or OUTPUT_LINE_START.startswith(raw)):
        return False
    try:
        json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return True
    return False


def _cut_partial_last_line(path: Path) -> None:
    with path.open("r+b") as f:
        size = f.seek(0, 2)
        end = size
        while end > 0:  # back to the last newline, a block at a time
            start = max(0, end - 65536)
            f.seek(start)
            block = f.read(end - start)
            newline = block.rfind(b"\n")
            if newline != -1:
                end = start + newline + 1
                break
            end = start
        if end < size:
            f.seek(end)
            try:  # a whole last line without its newline (written by hand, or by another tool) is kept
                json.loads(f.read(size - end))
            except (json.JSONDecodeError, UnicodeDecodeError):
                log.warning("%s: removing a last line cut short (%d bytes); its request runs again", path, size - end)
                f.truncate(end)
            else:
                f.seek(size)
                f.write(b"\n")
