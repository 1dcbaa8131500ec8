"""`roseinfer batch` through one worker against the same rows in-process: tokens per second each way, interleaved
repeats, medians. The rows are chat prompts from the standard workload (greedy, a fixed number of new tokens); the
in-process run adds them all to the engine as `roseinfer batch` keeps `--max-in-flight` of them in the worker.

    python3 benchmarks/batch_throughput.py [--rows 10000] [--tokens 32] [--model tiny|smollm2-135m-instruct]
        [--repeats 3] [--max-in-flight 256] [--worker-flag=--engine-process ...]

Each through-Redis run starts a fresh `roseinfer worker` on a private redis-server (no run profits from another's
prefix cache); each in-process run builds a fresh engine likewise. Model loading is outside both timings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rows(n: int, tokens: int) -> list[dict]:
    workload = json.loads((ROOT / "roseinfer/data/prompts64.json").read_text())
    return [
        {
            "custom_id": f"row-{i}",
            "messages": [{"role": "user", "content": f"{workload[i % len(workload)]} (item {i})"}],
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        for i in range(n)
    ]


def in_process(model: str, data: list[dict], max_num_seqs: int) -> float:
    from roseinfer import LLM, SamplingParams

    llm = LLM(model, dtype="float32", max_num_seqs=max_num_seqs)
    params = SamplingParams(temperature=0, max_tokens=data[0]["max_tokens"], ignore_eos=True)
    # The same warm-up job the worker gets before its clock (first-use costs were timed on this side only).
    llm.generate([{"messages": [{"role": "user", "content": "warm up"}]}], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.engine.kv.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate([{"messages": r["messages"]} for r in data], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def through_worker(
    model: str, data: list[dict], max_num_seqs: int, max_in_flight: int, folder: Path, flags: list[str]
) -> float:
    from producer import Client
    from producer.batch import run_batch
    from worker.cli import worker_command
    from worker.local_redis import start_private_redis, stop_private_redis

    url, redis_proc = start_private_redis("redis-server")
    if redis_proc is None:
        raise SystemExit("redis-server did not start")
    src, out = folder / "in.jsonl", folder / f"out-{time.time_ns()}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in data))
    queue = "bench-batch"
    cmd = worker_command(url, queue, model, "--max-num-seqs", str(max_num_seqs), "--dtype", "float32", *flags)
    worker = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = Client(url, queue=queue)
        warm = client.submit(messages=[{"role": "user", "content": "warm up"}], max_tokens=2)
        warm.result(timeout=600)  # the worker is up and its model loaded
        start = time.perf_counter()
        summary = run_batch(client, src, out, max_in_flight=max_in_flight, log_interval=3600)
        seconds = time.perf_counter() - start
        if summary["succeeded"] != len(data):
            raise SystemExit(f"the batch did not complete: {summary}")
        tokens = sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"] for line in out.open())
        return tokens / seconds
    finally:
        worker.terminate()
        worker.wait(timeout=60)
        stop_private_redis(redis_proc)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--model", default="tiny")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-in-flight", type=int, default=256)
    p.add_argument(
        "--worker-flag", action="append", default=[], metavar="FLAG",
        help="a flag for the worker only, repeatable: --worker-flag=--engine-process",
    )  # fmt: skip
    args = p.parse_args()
    from roseinfer.cpu_features import describe

    model = args.model
    if model == "tiny":
        from roseinfer.tiny_models import save_tiny_chat_model

        model = save_tiny_chat_model(tempfile.mkdtemp(prefix="roseinfer-tiny-"), max_position_embeddings=2048)
    data = rows(args.rows, args.tokens)
    folder = Path(tempfile.mkdtemp(prefix="roseinfer-batch-bench-"))
    local, queued = [], []
    for _ in range(args.repeats):  # interleaved: drift of the machine hits both ways alike
        local.append(in_process(model, data, args.max_num_seqs))
        queued.append(through_worker(model, data, args.max_num_seqs, args.max_in_flight, folder, args.worker_flag))
    print(
        json.dumps(
            {
                "cpu": describe(),
                "model": args.model,
                "worker_flags": args.worker_flag,
                "rows": args.rows,
                "tokens_per_row": args.tokens,
                "in_process_tok_s": round(statistics.median(local), 1),
                "through_worker_tok_s": round(statistics.median(queued), 1),
                "ratio": round(statistics.median(queued) / statistics.median(local), 3),
                "in_process_runs": [round(x, 1) for x in local],
                "through_worker_runs": [round(x, 1) for x in queued],
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
