"""The wire protocol from another language: a Node.js script (tests/conformance/node/conformance.mjs) drives a real
worker with raw Redis commands only, as any client would from README.md. It needs `node` and the `redis` npm
package (`cd tests/conformance/node && npm install`); without them the test is skipped, saying which is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ThreadWorker, slow_engine_steps

NODE_DIR = Path(__file__).parent / "conformance" / "node"
NODE = shutil.which("node")


def _missing() -> str | None:
    if NODE is None:
        return "node is not on PATH"
    if not (NODE_DIR / "node_modules" / "redis").is_dir():
        return f"the redis npm package is not installed: run `npm install` in {NODE_DIR}"
    return None


MISSING = _missing()
# (.ci/run installed it: not to skip silently there)
if MISSING is not None and os.environ.get("CI_REQUIRE_NODE_CONFORMANCE"):
    raise RuntimeError(f"CI_REQUIRE_NODE_CONFORMANCE is set, but {MISSING}")


# Skipped at collection, so that a machine without node does not build the model fixtures for nothing.
@pytest.mark.slow
@pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
def test_node_client_follows_the_wire_protocol(redis_url, tiny_chat_model, monkeypatch):
    worker = ThreadWorker(redis_url, tiny_chat_model, heartbeat_interval=1)
    slow_engine_steps(monkeypatch, worker.worker.engine)  # its running job of 200 tokens is canceled mid-way
    env = {**os.environ, "REDIS_URL": redis_url, "ROSEINFER_QUEUE": worker.queue}
    try:
        # Every wait in the script is bounded (60 s); this limit only guards against node itself stalling.
        proc = subprocess.run(
            [NODE, "conformance.mjs"], cwd=NODE_DIR, env=env, capture_output=True, text=True, timeout=600
        )
    except subprocess.TimeoutExpired as exc:
        # The partial output comes back as bytes whatever `text` says.
        partial = b"".join(part or b"" for part in (exc.stdout, exc.stderr)).decode(errors="replace")
        pytest.fail(f"conformance.mjs did not finish in {exc.timeout} s; its output:\n{partial}")
    finally:
        worker.stop()
    output = proc.stdout + (f"\nstderr:\n{proc.stderr}" if proc.stderr else "")
    assert proc.returncode == 0, f"conformance.mjs exited with {proc.returncode}:\n{output}"
