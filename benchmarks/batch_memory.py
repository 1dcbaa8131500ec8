"""Peak memory of the `roseinfer batch` process: a dry run over a large input (1,000,000 rows by default), and a
real run of fewer rows through a private redis-server and a worker on the tiny model. Each runs as a child process;
its peak resident set (VmHWM) is printed.

    python3 benchmarks/batch_memory.py [--rows 1000000] [--real-rows 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_rows(path: Path, rows: int) -> None:
    with path.open("w") as f:
        for i in range(rows):
            row = {"custom_id": f"row-{i}", "messages": [{"role": "user", "content": f"Label item {i}: is it red?"}]}
            f.write(json.dumps({**row, "max_tokens": 4, "temperature": 0}) + "\n")


def child_peak_mb(cmd: list[str]) -> tuple[float, float]:
    """(peak resident MB, seconds) of ``cmd`` run to its end: its VmHWM, read from /proc while it runs (Linux)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak_kb = 0
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        peak_kb = max(peak_kb, int(line.split()[1]))
        except (FileNotFoundError, ProcessLookupError):
            pass
        time.sleep(0.05)
    return peak_kb / 1024, time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--real-rows", type=int, default=20_000)
    p.add_argument("--part", choices=["dry", "real"], default=None, help="(internal) one measurement")
    args = p.parse_args()
    if args.part is None:  # each measurement in a fresh process: ru_maxrss of children is a running maximum
        for part in ("dry", "real"):
            subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--part",
                    part,
                    "--rows",
                    str(args.rows),
                    "--real-rows",
                    str(args.real_rows),
                ],
                check=True,
            )
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="batch-memory-"))
    cli = [sys.executable, "-m", "worker.cli", "batch"]
    if args.part in ("dry", "both"):
        src = tmp / "in.jsonl"
        write_rows(src, args.rows)
        mb, seconds = child_peak_mb([*cli, str(src), "-o", str(tmp / "out.jsonl"), "--dry-run"])
        size = src.stat().st_size / 2**20
        print(f"dry run, {args.rows} rows ({size:.0f} MB of JSONL): peak {mb:.0f} MB resident, {seconds:.1f} s")
        src.unlink()
    if args.part == "dry":
        return 0
    from worker.cli import worker_command
    from worker.local_redis import start_private_redis, stop_private_redis

    url, redis_proc = start_private_redis()
    if redis_proc is None:
        raise SystemExit("needs redis-server")
    from roseinfer.tiny_models import save_tiny_chat_model

    model = save_tiny_chat_model(tmp / "tiny", max_position_embeddings=512)
    worker = subprocess.Popen(
        worker_command(url, "mem", model, "--max-num-seqs", "256"), stderr=subprocess.DEVNULL, env=dict(os.environ)
    )
    try:
        src = tmp / "real.jsonl"
        write_rows(src, args.real_rows)
        cmd = [*cli, str(src), "-o", str(tmp / "real.out.jsonl"), "--redis-url", url, "--queue", "mem"]
        mb, seconds = child_peak_mb(cmd)
        done = sum(1 for _ in (tmp / "real.out.jsonl").open())
        print(
            f"real run, {args.real_rows} rows through a worker (tiny model): {done} done, peak {mb:.0f} MB resident, "
            f"{seconds:.1f} s"
        )
    finally:
        worker.terminate()
        worker.wait(timeout=60)
        stop_private_redis(redis_proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
