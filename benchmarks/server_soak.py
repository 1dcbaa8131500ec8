"""The OpenAI server under waves of concurrent requests: whether every request is answered and its memory and open
files level off.

A private redis-server, a ``roseinfer worker`` and ``roseinfer serve`` (child processes); the official ``openai``
client sends each wave's requests all at once: chat completions, streamed chat completions with usage, text
completions of two prompts, and streams its client drops after the first chunk. After each wave it prints the
server's resident memory and open file descriptors and any request that failed; it exits 1 if one did. It found
redis-py 8's pool of 100 connections answering the 101st concurrent request with a 503.

    python3 benchmarks/server_soak.py --waves 30 --concurrency 300
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024


async def _request(client, model: str, i: int) -> str | None:
    """Request ``i`` of its kind (by ``i % 4``); None once answered, else what went wrong."""
    import openai

    chat = [{"role": "user", "content": f"hello {i}"}]
    try:
        if i % 4 == 0:
            await client.chat.completions.create(model=model, messages=chat, max_tokens=6, temperature=0)
        elif i % 4 == 1:
            stream = await client.chat.completions.create(
                model=model, messages=chat, max_tokens=6, stream=True, stream_options={"include_usage": True}
            )
            async for _ in stream:
                pass
        elif i % 4 == 2:
            await client.completions.create(model=model, prompt=[f"a {i}", f"b {i}"], max_tokens=4)
        else:  # a client that goes away mid-stream: the server cancels its job
            stream = await client.chat.completions.create(model=model, messages=chat, max_tokens=64, stream=True)
            async for _ in stream:
                break
            await stream.close()
    except openai.APIError as exc:
        return f"{type(exc).__name__}: {str(exc)[:100]}"
    return None


async def _waves(args: argparse.Namespace, port: int, server: subprocess.Popen) -> int:
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    deadline = time.monotonic() + 300
    model = None
    while model is None:  # the server up and a worker serving
        try:
            served = (await client.models.list()).data
            model = served[0].id if served else None
        except openai.APIConnectionError:
            pass
        except openai.APIStatusError as exc:  # (503 until a worker registers: not yet, not a failure)
            if exc.status_code != 503:
                raise
        if time.monotonic() > deadline:
            sys.exit("no worker served within 300 s")
        await asyncio.sleep(0.5)
    print(f"{'wave':>4} {'requests':>8} {'s':>5} {'server MiB':>10} {'open files':>10}  failed")
    failed = 0
    for wave in range(args.waves):
        began = time.time()
        base = wave * args.concurrency
        errors = [
            e for e in await asyncio.gather(*(_request(client, model, base + i) for i in range(args.concurrency))) if e
        ]
        failed += len(errors)
        kinds = {e: errors.count(e) for e in set(errors)}
        took, files, rss = time.time() - began, len(os.listdir(f"/proc/{server.pid}/fd")), _rss_mib(server.pid)
        done = base + args.concurrency
        print(f"{wave:>4} {done:>8} {took:>5.1f} {rss:>10.0f} {files:>10}  {kinds or ''}", flush=True)
    print(f"requests that failed: {failed}")
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--waves", type=int, default=30)
    p.add_argument("--concurrency", type=int, default=300, help="requests sent at once in each wave")
    args = p.parse_args()
    if args.waves < 1 or args.concurrency < 1:
        p.error("--waves and --concurrency take 1 or more")

    from worker.cli import worker_command
    from worker.local_redis import free_port, start_private_redis, stop_private_redis

    url, redis_proc = start_private_redis()
    if redis_proc is None:
        sys.exit("needs redis-server on PATH")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    port = free_port()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
    worker = subprocess.Popen(worker_command(url, "server-soak", args.model), **quiet)
    serve = [sys.executable, "-m", "worker.cli", "serve", "--redis-url", url, "--queue", "server-soak"]
    server = subprocess.Popen([*serve, "--port", str(port)], **quiet)
    try:
        return asyncio.run(_waves(args, port, server))
    finally:
        for proc in (server, worker):
            proc.terminate()
            proc.wait(timeout=120)
        stop_private_redis(redis_proc)


if __name__ == "__main__":
    sys.exit(main())
