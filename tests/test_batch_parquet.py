"""``roseinfer batch`` with Parquet and plain rows: the input's columns kept, per-run defaults (a response format,
n samples), resume after Ctrl-C, and a rerun with other settings refused."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
from pathlib import Path

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ThreadWorker, stuck_worker

import producer.batch as batch_mod
from producer import Client
from producer import cli as producer_cli
from producer.batch import Progress, parse_line, run_batch
from producer.batch_io import ParquetSink, RowOptions

SCHEMA = {
    "type": "object",
    "properties": {"topic": {"enum": ["sea", "sky", "land"]}, "level": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["topic", "level"],
    "additionalProperties": False,
}


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="roseinfer")
    producer_cli.add_parsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def served(redis_url, tiny_chat_model):
    w = ThreadWorker(redis_url, tiny_chat_model, max_num_seqs=8, heartbeat_interval=1)
    yield w, Client(redis_url, queue=w.queue)
    w.stop()


def _table(path, n: int, tag: str) -> list[str]:
    ids = [f"q{i}" for i in range(n)]
    table = pa.table(
        {
            "qid": ids,
            "question": [f"Question {i} about the {tag}: what is it?" for i in range(n)],
            "difficulty": [i % 3 for i in range(n)],
            "tags": [["a", tag] for _ in range(n)],
        }
    )
    pq.write_table(table, path)
    return ids


@pytest.mark.slow
def test_parquet_in_parquet_out_keeps_columns_with_a_schema_and_n_samples(served, tmp_path):
    _, client = served
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    ids = _table(src, 12, tmp_path.name)
    options = RowOptions(
        "question", None, "qid", {"max_tokens": 40, "n": 2, "temperature": 0.8, "seed": 1, "response_format": {
            "type": "json_schema", "json_schema": {"name": "label", "schema": SCHEMA, "strict": True}}},
    )  # fmt: skip
    summary = run_batch(client, src, out, options=options, max_in_flight=5, poll_interval=0.05)
    assert summary["succeeded"] == 12 and summary["failed"] == 0
    assert pq.ParquetFile(out).metadata.num_row_groups == 1  # not one a poll
    table = pq.read_table(out)
    assert table.column_names == ["qid", "question", "difficulty", "tags", "output", "finish_reason"] + [
        "prompt_tokens", "completion_tokens", "error", "job_id"
    ]  # fmt: skip
    assert table.schema.field("tags").type == pa.list_(pa.string()) and table.schema.field("output").type == pa.list_(
        pa.string()
    )
    rows = table.to_pylist()
    assert sorted(r["qid"] for r in rows) == sorted(ids)
    for r in rows:
        assert r["difficulty"] == int(r["qid"][1:]) % 3 and r["tags"][0] == "a" and r["error"] is None
        assert len(r["output"]) == 2 and r["finish_reason"] == ["stop", "stop"] and r["prompt_tokens"] > 0
        for text in r["output"]:
            jsonschema.validate(json.loads(text), SCHEMA)
    # The same run again: every row is done already; with other settings it is refused, not mixed.
    again = run_batch(client, src, out, options=options, poll_interval=0.05)
    assert (again["skipped"], again["succeeded"]) == (12, 0)
    assert pq.ParquetFile(out).metadata.num_row_groups == 1  # the rows carried over, as one row group again
    other = RowOptions("question", None, "qid", {**options.defaults, "max_tokens": 41})
    with pytest.raises(ValueError, match="holds rows made with other settings") as refused:
        run_batch(client, src, out, options=other)
    # The one difference, not both settings whole (the schema twice: a kilobyte to search)
    assert "(defaults.max_tokens: 40 in the output, 41 now)" in str(refused.value), refused.value
    assert pq.read_table(out).num_rows == 12


@pytest.mark.slow
def test_ctrl_c_with_a_parquet_output_leaves_a_whole_file_and_the_rerun_completes_it(
    served, redis_url, tmp_path, monkeypatch, capsys
):
    worker, _ = served
    out, ids, argv = _parquet_run(tmp_path, redis_url, worker.queue)
    argv += ["--temperature", "0"]
    real_tick = Progress.tick

    def interrupt():
        raise KeyboardInterrupt

    monkeypatch.setattr(Progress, "tick", _once_a_row_is_done(interrupt))
    assert producer_cli.batch(_parse(argv)) == 130
    first = pq.read_table(out).to_pylist()  # a whole Parquet file, footer and all
    assert 0 < len(first) < 16
    command = capsys.readouterr().err.strip().splitlines()[-1].strip()
    assert "--prompt-column question" in command and "--max-tokens 12" in command
    monkeypatch.setattr(Progress, "tick", real_tick)
    assert producer_cli.batch(_parse(shlex.split(command)[1:])) == 0
    rows = pq.read_table(out).to_pylist()
    assert sorted(r["qid"] for r in rows) == sorted(ids)  # each row once
    assert {r["qid"]: r["output"] for r in rows if r["qid"] in {f["qid"] for f in first}} == {
        f["qid"]: f["output"] for f in first
    }
    # Another --max-tokens on the same output: one line, exit 2.
    argv[argv.index("12")] = "13"
    capsys.readouterr()
    assert producer_cli.batch(_parse(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "other settings" in err[0]


@pytest.mark.slow
def test_plain_jsonl_rows_with_columns_and_a_bad_row_into_parquet(served, tmp_path):
    _, client = served
    src, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    rows = [{"id": i, "text": f"Plain row {i} {tmp_path.name}", "extra": "kept?"} for i in range(5)]
    rows.append({"id": 5, "text": 42})
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    options = RowOptions("text", None, "id", {"max_tokens": 4, "temperature": 0})
    summary = run_batch(client, src, out, options=options, poll_interval=0.05)
    assert (summary["succeeded"], summary["failed"], summary["failures"]) == (5, 1, {"invalid_request": 1})
    table = pq.read_table(out)
    assert table.column_names[0] == "id" and "extra" not in table.column_names  # JSONL rows have no schema
    rows = {r["id"]: r for r in table.to_pylist()}
    assert sorted(rows) == ["0", "1", "2", "3", "4", "5"]  # the bad row too, failed
    assert rows.pop("5")["error"].startswith("invalid_request: ")
    assert all(len(r["output"]) > 0 and r["error"] is None for r in rows.values())
    # Its rows' jobs released once the file is whole, as a JSONL output's are: they were kept a day, ~10 KB a row.
    from producer.batch import RELEASED_TTL_S

    ttls = [client.connection.ttl(f"rq:job:{r['job_id']}") for r in rows.values()]
    assert all(0 < ttl <= RELEASED_TTL_S for ttl in ttls), ttls
    rerun = tmp_path / "rerun.jsonl"  # (a rerun releases only its own rows: the first, carried over, are not read)
    rerun.write_text(json.dumps({"id": 6, "text": f"Row 6 {tmp_path.name}"}) + "\n")
    run_batch(client, rerun, out, options=options, poll_interval=0.05)
    assert len(pq.read_table(out)) == 6


def test_the_columns_an_output_adds_must_not_be_in_the_input(tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["x"], "output": ["clash"]}), src)
    with pytest.raises(ValueError, match="output"):
        batch_mod.dry_run(src, tmp_path / "out.parquet")


@pytest.mark.slow
def test_a_datasets_folder_in_parquet_out(served, tmp_path):
    datasets = pytest.importorskip("datasets")
    _, client = served
    folder, out = tmp_path / "ds", tmp_path / "out.parquet"
    ds = datasets.Dataset.from_dict(
        {"text": [f"Dataset row {i} {tmp_path.name}" for i in range(8)], "label": list(range(8))}
    )
    ds.shuffle(seed=1).select(range(6)).save_to_disk(str(folder))  # an indices mapping: rows in that order
    counts = batch_mod.dry_run(folder, out, options=RowOptions("text", None, None, {"max_tokens": 3}))
    assert (counts["total"], counts["valid"]) == (6, 6)
    summary = run_batch(client, folder, out, options=RowOptions("text", None, None, {"max_tokens": 3}))
    assert summary["succeeded"] == 6
    rows = pq.read_table(out).to_pylist()
    expected = {f"row-{i + 1}": row["label"] for i, row in enumerate(datasets.load_from_disk(str(folder)))}
    assert {r["custom_id"]: r["label"] for r in rows} == expected and all(r["output"] for r in rows)


def test_a_custom_id_column_without_id_column_is_refused_before_any_job(tmp_path):
    """The output names rows row-N in its custom_id column unless told otherwise: an input column of that name
    would overwrite those ids, and a rerun would find none of its rows done and run them all again."""
    import fakeredis

    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"custom_id": ["q1", "q2"], "prompt": ["a", "b"]}), source)
    client = Client(connection=fakeredis.FakeRedis())
    for out in ("out.parquet", "out.jsonl"):  # into JSONL, its ids were dropped without a word, rows named row-N
        with pytest.raises(ValueError, match="pass --id-column custom_id"):
            run_batch(client, source, tmp_path / out, log_interval=1e9)
        assert client.queue.count == 0 and not (tmp_path / out).exists()


def test_a_jsonl_plain_row_with_a_custom_id_it_would_not_be_named_by_is_a_bad_row():
    """Read by --prompt-column, a row's own custom_id was dropped (the row named row-3): said on the row, whose
    error keeps its row number; named by --id-column, it is read."""
    options = RowOptions("question", None, None, {})
    with pytest.raises(ValueError, match=r"this row has a field 'custom_id'.*pass --id-column custom_id") as caught:
        parse_line(3, b'{"custom_id": "q-17", "question": "hi"}', options=options)
    assert caught.value.custom_id == "row-3"
    assert parse_line(3, b'{"question": "hi"}', options=options).custom_id == "row-3"
    named = RowOptions("question", None, "custom_id", {})
    assert parse_line(3, b'{"custom_id": "q-17", "question": "hi"}', options=named).custom_id == "q-17"


def test_a_row_asking_for_other_n_than_the_parquet_output_holds_fails_alone(tmp_path):
    """The output column holds --n samples a row: a JSONL line asking for 3 into a 1-sample output would have
    lost two of them unsaid; it fails before it runs, and the line beside it goes in."""
    import fakeredis

    source = tmp_path / "in.jsonl"
    lines = [{"custom_id": "three", "prompt": "p", "n": 3}, {"custom_id": "one", "prompt": "q"}]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    client = Client(connection=fakeredis.FakeRedis())
    with stuck_worker(client):
        summary = run_batch(
            client, source, tmp_path / "out.parquet", log_interval=1e9, timeout=0.01, poll_interval=0.01
        )
    errors = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert {e["custom_id"]: e["error"]["code"] for e in errors} == {"three": "invalid_request", "one": "timeout"}
    assert "n=3" in errors[0]["error"]["message"] and summary["total"] == 2  # "one" ran out of time: never ends
    rows = {r["custom_id"]: r["error"] for r in pq.read_table(tmp_path / "out.parquet").to_pylist()}
    assert rows["three"].startswith("invalid_request: ") and rows["one"].startswith("timeout: ")


def test_a_row_refused_before_it_ran_is_a_failed_row_of_the_parquet_output(tmp_path):
    """The same table out as in: a row refused before any job (no prompt, a bad value) was missing from it, where
    a row whose job failed was there with its error."""
    import fakeredis

    source = tmp_path / "in.parquet"
    table = {"qid": ["a", "b", "c", "b"], "question": ["fine", None, "also fine", "b again"], "label": [1, 2, 3, 4]}
    pq.write_table(pa.table(table), source)
    client = Client(connection=fakeredis.FakeRedis())
    options = RowOptions("question", None, "qid", {})
    with stuck_worker(client):
        summary = run_batch(
            client,
            source,
            tmp_path / "out.parquet",
            options=options,
            log_interval=1e9,
            timeout=0.01,
            poll_interval=0.01,
        )
    listed = pq.read_table(tmp_path / "out.parquet").to_pylist()
    rows = {r["qid"]: r for r in listed}
    assert sorted(rows) == ["a", "b", "c"] and len(listed) == 3  # one row an id: the second "b" is a duplicate
    assert summary["failures"]["duplicate_custom_id"] == 1
    assert rows["b"]["label"] == 2 and rows["b"]["job_id"] is None and rows["b"]["output"] is None
    assert rows["b"]["error"].startswith("invalid_request: ")


@pytest.mark.slow  # two runs through a worker
@pytest.mark.redis
def test_a_row_done_before_and_refused_now_keeps_its_one_row_in_the_parquet_output(served, tmp_path):
    """A row that succeeded, then was changed to one refused before it runs (no prompt): its error row was written
    beside the success row carried over, one id twice in the output, for good."""
    _, client = served
    source, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    table = {"qid": ["a", "b"], "question": ["Say hi", "Say bye"]}
    pq.write_table(pa.table(table), source)
    options = RowOptions("question", None, "qid", {"max_tokens": 2})
    assert run_batch(client, source, out, options=options, log_interval=1e9, poll_interval=0.05)["succeeded"] == 2
    pq.write_table(pa.table({"qid": ["a", "b"], "question": ["Say hi", None]}), source)  # "b" refused now
    summary = run_batch(client, source, out, options=options, log_interval=1e9, poll_interval=0.05)
    assert summary["skipped"] == 1 and summary["failures"] == {"invalid_request": 1}
    listed = pq.read_table(out).to_pylist()
    assert sorted(r["qid"] for r in listed) == ["a", "b"]  # each once: "b" keeps the row it was made with
    assert all(r["error"] is None for r in listed)


def test_a_parquet_row_that_is_not_utf8_fails_alone(tmp_path):
    """Parquet does not check its strings: one bad cell made the whole record batch undecodable, and the run
    stopped. Now that row fails, saying which column, and the rows around it go on."""
    import fakeredis

    source = tmp_path / "in.parquet"
    questions = pa.array([b"fine", b"bad \xff byte", b"also fine"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"qid": ["a", "b", "c"], "question": questions}), source)
    client = Client(connection=fakeredis.FakeRedis())
    options = RowOptions("question", None, "qid", {})
    with stuck_worker(client):
        summary = run_batch(
            client, source, tmp_path / "out.jsonl", options=options, log_interval=1e9, timeout=0.01, poll_interval=0.01
        )
    errors = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    by_line = {e["line"]: e["error"] for e in errors}
    assert {line: e["code"] for line, e in by_line.items()} == {1: "timeout", 2: "invalid_request", 3: "timeout"}
    assert by_line[2]["message"] == "column 'question' is not UTF-8: invalid start byte (byte 0xff)"
    assert summary["total"] == 3  # "a" and "c" ran out of time: their worker never ends them


def test_text_columns_stored_as_binary_are_read_as_text(tmp_path):
    """Spark and other writers store text as Parquet binary: the cells came as bytes, which no JSON payload holds.
    Every row failed (a role in bytes is no role), or with text roles the whole run stopped at its first row with a
    TypeError. They are read as the UTF-8 text they hold."""
    import fakeredis

    source = tmp_path / "in.parquet"
    message = pa.struct([("role", pa.binary()), ("content", pa.binary())])
    chats = pa.array([[{"role": b"user", "content": b"Hi there"}], [{"role": b"user", "content": b"bad \xff"}]],
                     pa.list_(message))  # fmt: skip
    pq.write_table(pa.table({"qid": ["a", "b"], "chat": chats, "question": [b"Who?", b"What?"]}), source)
    client = Client(connection=fakeredis.FakeRedis())
    with stuck_worker(client):
        run_batch(client, source, tmp_path / "out.jsonl", options=RowOptions(None, "chat", "qid", {}), timeout=0.01,
                  poll_interval=0.01, log_interval=1e9)  # fmt: skip
    errors = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert {e["custom_id"]: e["error"]["code"] for e in errors} == {"a": "timeout", "b": "invalid_request"}
    assert next(e for e in errors if e["custom_id"] == "b")["error"]["message"].startswith(
        "column 'chat' is not UTF-8: "
    )  # (named, as a string column's)
    [key] = client.connection.keys("rq:job:*")  # row a's job, sent as text
    assert client.job(key.decode()[len("rq:job:") :]).rq_job.kwargs["messages"] == [
        {"role": "user", "content": "Hi there"}
    ]
    line = parse_line(1, {"qid": "a", "question": b"Who?"}, options=RowOptions("question", None, "qid", {}))
    assert line.payload["prompt"] == "Who?"
    row = {"qid": "a", "chat": [{"role": "user", "content": b"Hi"}]}
    assert parse_line(1, row, options=RowOptions(None, "chat", "qid", {})).payload["messages"][0]["content"] == "Hi"


def test_an_id_column_stored_as_binary_names_its_rows_and_their_resume(tmp_path):
    """A Spark-written table's prompts were read from binary, its ids not: every row failed ("the id column 'qid'
    must hold a non-empty string or integer, got b'q1'"), and a rerun's rows done were named "b'q1'"."""
    from producer.batch_io import open_lines

    schema = pa.schema([("qid", pa.binary()), ("question", pa.binary())])
    options = RowOptions("question", None, "qid", {})
    line = parse_line(1, {"qid": b"q1", "question": b"Who?"}, options=options)
    assert line.custom_id == "q1" and line.payload["prompt"] == "Who?"
    with pytest.raises(ValueError, match="not UTF-8"):
        parse_line(2, {"qid": b"bad \xff", "question": b"Who?"}, options=options)
    out = tmp_path / "out.parquet"
    with open_lines(tmp_path / "errors.jsonl", "w") as err:
        sink = ParquetSink(out, schema, "qid", 1)
        sink.open(err)
        line.row = {"qid": b"q1", "question": b"Who?"}  # (as a Parquet input's row comes)
        usage = {"prompt_tokens": 1, "completion_tokens": 1}
        sink.result(line, {}, {"id": line.job_id, "text": "t", "finish_reason": "stop", "usage": usage})
        sink.close()
    assert pq.read_table(out).column("qid").to_pylist() == [b"q1"]  # (the input's column, as it was)
    assert list(ParquetSink(out, schema, "qid", 1).done()) == ["q1"]


def _write_rows(sink: ParquetSink, first: int, count: int) -> None:
    for number in range(first, first + count):
        line = parse_line(number, {"prompt": f"p{number}"}, options=RowOptions("prompt"))
        usage = {"prompt_tokens": 1, "completion_tokens": 1}
        sink.result(line, {}, {"id": line.job_id, "text": "t", "finish_reason": "stop", "usage": usage})
        sink.flush()  # as after every poll


def test_a_parquet_output_gets_a_row_group_each_1024_rows_not_each_poll(tmp_path):
    """A row group a poll: 2,000 rows made 1,975 row groups and a footer of 1.6 MB."""
    from producer.batch_io import open_lines

    out = tmp_path / "out.parquet"

    def run(first: int, count: int):
        with open_lines(tmp_path / "errors.jsonl", "w") as err:
            sink = ParquetSink(out, None, "custom_id", 1)
            sink.open(err)
            _write_rows(sink, first, count)
            sink.close()
        return pq.ParquetFile(out).metadata

    meta = run(1, 1500)
    assert (meta.num_rows, meta.num_row_groups, meta.row_group(0).num_rows) == (1500, 2, 1024)
    meta = run(1501, 10)  # a rerun: the rows carried over, 10 more
    assert (meta.num_rows, meta.num_row_groups, meta.row_group(1).num_rows) == (1510, 2, 486)


def _output_of_20_rows(tmp_path: Path) -> Path:
    """A whole Parquet output of an earlier run: 20 rows."""
    from producer.batch_io import open_lines

    out = tmp_path / "out.parquet"
    with open_lines(tmp_path / "errors.jsonl", "w") as err:
        sink = ParquetSink(out, None, "custom_id", 1)
        sink.open(err)
        _write_rows(sink, 1, 20)
        sink.close()
    return out


def test_ctrl_c_while_the_earlier_rows_are_carried_over_leaves_the_output_as_it_was(tmp_path, monkeypatch):
    """The carry-over of a large output's earlier rows ran before the run's try: a Ctrl-C there left the writer
    open and a .partial beside the output. The output stays whole and nothing is left beside it."""
    from producer.batch_io import open_lines

    out = _output_of_20_rows(tmp_path)
    before = out.read_bytes()

    def interrupted(self, row):
        raise KeyboardInterrupt

    monkeypatch.setattr(ParquetSink, "_add", interrupted)
    with open_lines(tmp_path / "errors.jsonl", "w") as err, pytest.raises(KeyboardInterrupt):
        ParquetSink(out, None, "custom_id", 1).open(err)
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["errors.jsonl", "out.parquet"]


@pytest.mark.parametrize("fails", ["a row group", "the footer"])
def test_a_disk_full_under_a_parquet_run_leaves_the_output_as_it_was(tmp_path, monkeypatch, fails):
    """A row group's write failed (ENOSPC), then pyarrow's close wrote no footer and said nothing: the file without
    one replaced a whole output, every row of the earlier runs lost, and the resume command said it was no Parquet
    file. The output stays as it was, and the run stops on the system's error."""
    import errno

    from producer.batch_io import open_lines

    out = _output_of_20_rows(tmp_path)
    before = out.read_bytes()
    with open_lines(tmp_path / "errors.jsonl", "w") as err:
        sink = ParquetSink(out, None, "custom_id", 1)
        sink.open(err)
        if fails == "a row group":

            def full(*args, **kwargs):
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(sink._writer, "write_table", full)
            with pytest.raises(OSError, match="No space left"):
                _write_rows(sink, 21, 1100)  # (a row group's worth: written as it fills)
        else:
            _write_rows(sink, 21, 10)
            monkeypatch.setattr(sink._writer, "close", lambda: None)  # (no footer, and not a word of it)
        with pytest.raises(OSError, match="not written whole"):
            sink.close()
    assert out.read_bytes() == before and pq.ParquetFile(out).metadata.num_rows == 20
    assert not (tmp_path / "out.parquet.partial").exists()


@pytest.mark.slow
def test_rows_a_killed_parquet_run_had_not_written_come_back_from_redis(served, tmp_path, monkeypatch):
    """Rows wait in memory for a whole row group; a run killed outright (no footer: its .partial is not read)
    loses none of them: the rerun takes their jobs' results, still in Redis."""
    _, client = served
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    ids = _table(src, 10, tmp_path.name)
    options = RowOptions("question", None, "qid", {"max_tokens": 3, "temperature": 0})
    monkeypatch.setattr(ParquetSink, "close", lambda self: None)  # killed: nothing written, no footer, no rename
    assert run_batch(client, src, out, options=options, poll_interval=0.05)["succeeded"] == 10
    assert not out.exists()
    monkeypatch.undo()
    summary = run_batch(client, src, out, options=options, poll_interval=0.05)
    assert (summary["succeeded"], summary["reused"]) == (10, 10)
    assert sorted(pq.read_table(out).column("qid").to_pylist()) == sorted(ids)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_stop_a_parquet_run_as_ctrl_c_does(name, served, redis_url, tmp_path, monkeypatch):
    """They left no output at all (only Ctrl-C was handled): now a whole file, and the rerun completes it. The exit
    status is 128 plus the signal (it was Ctrl-C's 130 for both)."""
    worker, _ = served
    number = getattr(signal, name)
    received: list[int] = []

    def noted(signum, frame):  # without the run's own handler the signal is noted here, not the end of pytest
        received.append(signum)

    before = signal.signal(number, noted)
    try:
        out, ids, argv = _parquet_run(tmp_path, redis_url, worker.queue)
        real_tick = Progress.tick
        monkeypatch.setattr(Progress, "tick", _once_a_row_is_done(lambda: os.kill(os.getpid(), number)))
        assert producer_cli.batch(_parse(argv)) == 128 + number  # as a shell reports it: 143, 129
        assert received == [] and signal.getsignal(number) is noted  # the run's handler took it, then gave back
        first = pq.read_table(out).to_pylist()
        assert 0 < len(first) < 16 and not out.with_name(out.name + ".partial").exists()
        monkeypatch.setattr(Progress, "tick", real_tick)
        assert producer_cli.batch(_parse(argv)) == 0
        assert sorted(r["qid"] for r in pq.read_table(out).to_pylist()) == sorted(ids)
    finally:
        signal.signal(number, before)


def _parquet_run(tmp_path, redis_url: str, queue: str):
    """A Parquet input of 16 rows and the ``batch`` argv that runs it into a Parquet output: (output, ids, argv)."""
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    ids = _table(src, 16, tmp_path.name)
    argv = ["batch", str(src), "-o", str(out), "--max-in-flight", "3", "--redis-url", redis_url, "--queue"]
    argv += [queue, "--prompt-column", "question", "--id-column", "qid", "--max-tokens", "12"]
    return out, ids, argv


def _once_a_row_is_done(act):
    """A ``Progress.tick`` that calls ``act`` once, at the first poll after a row was written (mid-run: jobs still in
    flight, since at most --max-in-flight are done by then), then ticks as usual."""
    real_tick, acted = Progress.tick, [False]

    def tick(self):
        if self.done > self.already and not acted[0]:
            acted[0] = True
            act()
        real_tick(self)

    return tick


def test_a_plain_datasets_folder_is_read_without_a_copy_into_it(tmp_path):
    """Only a selected or shuffled dataset (an indices mapping) needs its rows rewritten in order; a plain one was
    copied whole into its own folder at every run (a read-only folder would fail)."""
    datasets = pytest.importorskip("datasets")
    from producer.batch_io import count_rows, input_columns, read_rows

    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"q": [f"question {i}" for i in range(5)]}).save_to_disk(str(folder))
    before = sorted(p.name for p in folder.iterdir())
    assert count_rows(folder, "hf") == 5 and input_columns(folder, "hf").names == ["q"]
    assert [row["q"] for _, row in read_rows(folder, "hf")] == [f"question {i}" for i in range(5)]
    assert sorted(p.name for p in folder.iterdir()) == before


@pytest.mark.parametrize(
    ("fmt", "options", "message"),
    [
        ("parquet", RowOptions("nope", None, None, {}), "--prompt-column 'nope': .* has no such column"),
        ("parquet", RowOptions("q", None, "qid", {}), "--id-column 'qid': .* has no such column .it has q, other."),
        ("jsonl", RowOptions(None, None, "qid", {}), "--id-column names the id column of plain rows"),
    ],
)
def test_a_column_the_input_lacks_is_one_error_before_any_row(tmp_path, fmt, options, message):
    """It failed every row on its own (3,000 errors saying a prompt must hold text), and --id-column without a
    prompt column on JSONL was ignored: every row failed with 'qid: unknown field'."""
    import fakeredis

    source = tmp_path / f"in.{fmt}"
    if fmt == "parquet":
        pq.write_table(pa.table({"q": ["a", "b"], "other": [1, 2]}), source)
    else:
        source.write_text(json.dumps({"qid": "a", "prompt": "x"}) + "\n")
    client = Client(connection=fakeredis.FakeRedis())
    with pytest.raises(ValueError, match=message):
        run_batch(client, source, tmp_path / "out.jsonl", options=options, log_interval=1e9)
    assert client.queue.count == 0 and sorted(p.name for p in tmp_path.iterdir()) == [source.name]


@pytest.mark.parametrize(("given", "shown"), [(1.5, "1.5"), (None, "None"), (True, "True"), ("", "''")])
def test_a_bad_id_in_the_id_column_is_named_in_its_error(given, shown):
    from producer.batch import BadLine

    with pytest.raises(BadLine, match=rf"^the id column 'qid' must hold a non-empty string or integer, got {shown}$"):
        parse_line(1, {"qid": given, "question": "x"}, options=RowOptions("question", None, "qid", {}))


def test_chat_rows_send_the_prompt_column_as_the_users_message():
    """A raw prompt is what an instruct model continues: ``--chat`` (and ``--system``) apply its chat template."""
    options = RowOptions("question", None, "qid", {}, chat=True, system="Label the question.")
    line = parse_line(1, {"qid": "a", "question": "Who was Napoleon?"}, options=options)
    assert (
        line.payload["messages"]
        == [
            {"role": "system", "content": "Label the question."},
            {"role": "user", "content": "Who was Napoleon?"},
        ]
        and "prompt" not in line.payload
        and line.url == "/v1/chat/completions"
    )
    plain = RowOptions("question", None, "qid", {})
    assert parse_line(1, {"qid": "a", "question": "Who?"}, options=plain).payload["prompt"] == "Who?"
    assert "chat" not in plain.fingerprint() and options.fingerprint()["system"] == "Label the question."
    with pytest.raises(ValueError, match="--chat sends a prompt column"):
        RowOptions(None, None, None, {}, chat=True).for_format("jsonl")


def test_a_datasets_folder_with_times_and_dates_reruns_into_its_parquet_output(tmp_path):
    """Parquet stores a dataset's timestamp[s], date64 and time32[s] columns as timestamp[ms], date32 and
    time32[ms]: a rerun compared the file with the dataset's own types and refused to carry over or retry any row."""
    import datetime

    import fakeredis

    datasets = pytest.importorskip("datasets")
    table = pa.table(
        {
            "prompt": ["a", "b"],
            "when": pa.array([datetime.datetime(2026, 1, 1, 12), None], pa.timestamp("s")),
            "day": pa.array([datetime.date(2026, 1, 2), None], pa.date64()),
            "at": pa.array([datetime.time(9, 30), None], pa.time32("s")),
        }
    )
    folder, out = tmp_path / "ds", tmp_path / "out.parquet"
    datasets.Dataset(table).save_to_disk(str(folder))
    client = Client(connection=fakeredis.FakeRedis())
    for run in range(2):  # no worker: every row times out, and the rerun tries them again
        with stuck_worker(client):
            summary = run_batch(client, folder, out, log_interval=1e9, timeout=0.01, poll_interval=0.01)
        assert summary["total"] == 2 and summary["failures"] == {"timeout": 2}, run
    rows = sorted(pq.read_table(out).to_pylist(), key=lambda r: r["when"] is None)  # (written as their jobs end)
    assert [r["when"] for r in rows] == [datetime.datetime(2026, 1, 1, 12), None]
    assert [r["day"] for r in rows] == [datetime.date(2026, 1, 2), None]


def test_chat_rows_thinking_is_a_reasoning_column_and_their_constraint_waits_for_it(tmp_path):
    """--reasoning-parser for plain chat rows (a dataset of reasoning traces): the Parquet output's ``output`` holds
    the answer and a ``reasoning`` column the thinking (null where there was none; --n samples a list each); a
    run's --response-format lets the model think first (the job's ``thinking``), as the server's chat does. A
    plain completion row is no chat: nothing is told apart."""
    options = RowOptions("question", None, "qid", {"response_format": {"type": "json_object"}}, chat=True,
                         reasoning_parser="deepseek_r1")  # fmt: skip
    line = parse_line(1, {"qid": "a", "question": "Sky?"}, options=options)
    assert line.payload["thinking"] == "first" and line.reasoning is not None
    plain = parse_line(2, {"qid": "b", "question": "Sky?"}, options=RowOptions("question", reasoning_parser="qwen3"))
    assert plain.reasoning is None and "thinking" not in plain.payload
    usage = {"prompt_tokens": 1, "completion_tokens": 5}
    for n, text, want in ((1, '<think>Blue, I think.</think>{"sky": "blue"}', ("Blue, I think.", '{"sky": "blue"}')),
                          (2, "Still thinking", (["Still thinking", "Still thinking"], [None, None]))):  # fmt: skip
        path = tmp_path / f"out{n}.parquet"
        sink = ParquetSink(path, None, "qid", n, reasoning=True)
        with open(tmp_path / "errors.jsonl", "w") as errors:
            sink.open(errors)
            samples = [{"index": i, "text": text, "finish_reason": "length"} for i in range(n)]
            sink.result(line, {}, {"id": line.job_id, "text": text, "choices": samples if n > 1 else None,
                                   "finish_reason": "stop", "usage": usage})  # fmt: skip
            sink.close()
        [row] = pq.read_table(path).to_pylist()
        assert (row["reasoning"], row["output"]) == want
    assert "reasoning" not in pq.read_schema(_sink_file(tmp_path)).names
    out = batch_mod.output_line(line, {"id": "j", "model": "m", "text": '<think>Hm.</think>{"a": 1}', "usage": usage,
                                       "finish_reason": "stop", "timings": {"finished_at": 1.0}})  # fmt: skip
    message = out["response"]["body"]["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("Hm.", '{"a": 1}')  # (a JSONL output of the same rows)


def _sink_file(tmp_path) -> str:
    """A Parquet output of a run without --reasoning-parser: no reasoning column."""
    path = tmp_path / "plain.parquet"
    sink = ParquetSink(path, None, "qid", 1)
    with open(tmp_path / "errors2.jsonl", "w") as errors:
        sink.open(errors)
        sink.close()
    return str(path)


def test_plain_jsonl_rows_that_cannot_be_read_are_failed_rows_of_the_parquet_output(tmp_path):
    """A plain row's id is its number where no column names it, but a row that was no JSON object was refused before
    its id was worked out: the Parquet output, which holds every row of the input, lost it."""
    import fakeredis

    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "a"}\nnot json\n[1]\n{"prompt": 5}\n')
    client = Client(connection=fakeredis.FakeRedis())
    with stuck_worker(client):
        run_batch(
            client, source, tmp_path / "out.parquet", options=RowOptions("prompt", None, None, {}), log_interval=1e9,
            timeout=0.01, poll_interval=0.01, output_format="parquet",
        )  # fmt: skip
    rows = {r["custom_id"]: r for r in pq.read_table(tmp_path / "out.parquet").to_pylist()}
    assert sorted(rows) == ["row-1", "row-2", "row-3", "row-4"]
    assert rows["row-2"]["error"].startswith("invalid_request: not JSON")
    assert rows["row-3"]["error"] == "invalid_request: a line must be a JSON object"


def test_an_interrupted_run_says_the_rows_its_output_holds_for_jsonl_alone(tmp_path, monkeypatch):
    """A JSONL output holds every row flushed; a Parquet one is whole only once closed (a disk full leaves it as it
    was) and holds failed rows too: the count of rows in it was said for both, the Parquet one's wrong."""
    import fakeredis

    import producer.batch as batch_mod
    from producer import Client

    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(batch_mod, "_submit", interrupt)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "prompt": "x"}) + "\n")
    held = {}
    for name in ("out.jsonl", "out.parquet"):
        with pytest.raises(batch_mod.BatchInterrupted) as stopped:
            batch_mod.run_batch(Client(connection=fakeredis.FakeRedis(), queue="q"), src, tmp_path / name)
        held[name] = stopped.value.in_output
    assert held == {"out.jsonl": 0, "out.parquet": None}
