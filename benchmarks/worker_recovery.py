"""How long a SIGKILLed worker's jobs take to finish on another worker, with the default settings.

    python3 benchmarks/worker_recovery.py [--model PATH]

Default model: a tiny random Llama with the default model's tokenizer (the time measured is RQ's and the
worker's, not the model's). Prints the seconds from the kill to the last result and checks every job's stream.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time

from producer import Client
from worker.cli import worker_command
from worker.local_redis import start_private_redis, stop_private_redis


def tiny_chat_model() -> str:
    from transformers import AutoTokenizer

    from roseinfer.model_loader import resolve_model
    from roseinfer.tiny_models import save_tiny_chat_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    return save_tiny_chat_model(tempfile.mkdtemp(prefix="tiny-chat-"), tok, max_position_embeddings=1024)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--jobs", type=int, default=8)
    args = parser.parse_args()
    model = args.model or tiny_chat_model()
    url, redis = start_private_redis()
    if redis is None:
        raise SystemExit("redis-server not found")
    client = Client(url, queue="recovery")
    jobs = client.submit_many(
        [{"prompt": f"Long {i}", "max_tokens": 400, "ignore_eos": True} for i in range(args.jobs)]
    )

    def worker() -> subprocess.Popen:
        cmd = worker_command(url, "recovery", model, "--max-num-seqs", "2", "--max-num-batched-tokens", "16")
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    first = worker()
    while not any(j.status() == "started" for j in jobs):
        time.sleep(0.05)
    time.sleep(0.5)
    first.kill()
    first.wait()
    killed = time.time()
    stranded = sum(j.status() == "started" for j in jobs)
    second = worker()
    try:
        results = [j.result(timeout=600) for j in jobs]
        seconds = time.time() - killed
        whole = all("".join(j.stream(timeout=10)) == r["text"] for j, r in zip(jobs, results))
    finally:
        second.terminate()
        second.wait()
        stop_private_redis(redis)
    print(
        f"{stranded} jobs in flight at SIGKILL; all {len(jobs)} finished {seconds:.1f} s after the kill "
        f"(defaults: heartbeat 10 s + grace 30 s + maintenance 15 s); streams equal results: {whole}"
    )
    return 0 if whole else 1


if __name__ == "__main__":
    raise SystemExit(main())
