"""Redis for one machine: a private ``redis-server`` on a free port, or fakeredis' embedded TCP server."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from redis import Redis
from redis.backoff import NoBackoff
from redis.retry import Retry

_FOLDER_PREFIX = "roseinfer-redis-"  # a private server's folder: the one name stop_private_redis removes
_PR_SET_PDEATHSIG = 1  # (linux/prctl.h)
MIN_REDIS = (6, 2)  # LMOVE and BLMOVE (the pull), GETDEL, XADD's NOMKSTREAM, exclusive XRANGE starts


def redis_server_version(server: str) -> tuple[int, ...] | None:
    """``redis-server --version``'s version (``v=7.0.15``), or None where it cannot be read."""
    try:
        said = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"v=(\d+)\.(\d+)", said)
    return (int(found[1]), int(found[2])) if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_private_redis(
    server: str = "redis-server", port: int | None = None, own_session: bool = False
) -> tuple[str, subprocess.Popen | None]:
    """A throwaway redis-server (nothing saved) on ``port`` (default: a free one); (url, process), or (url, None)
    when it cannot start (or is older than ``MIN_REDIS``: fakeredis serves then). ``own_session``: out of the
    caller's process group, for a command that stops it itself on every signal (``serve --embedded``): a terminal's
    Ctrl-C reaches the whole group, and the Redis died under the command's shutdown (its cancels and its jobs' ends
    refused: 36 s, a traceback a request). Others keep it in their group, so that a signal to the group (timeout,
    a closed terminal) ends it with them."""
    if shutil.which(server) is None or (redis_server_version(server) or MIN_REDIS) < MIN_REDIS:
        return f"redis://127.0.0.1:{port or free_port()}/0", None
    for _ in range(1 if port else 5):  # a free port can be taken by another process before ours binds it
        url, proc = _start_redis_on(server, port or free_port(), own_session)
        if proc is not None:
            return url, proc
    return url, None


def stop_private_redis(proc: subprocess.Popen | None) -> None:
    """Stops a server ``start_private_redis`` started and waits for it (no redis-server outlives the command that
    started it), then removes the empty folder it was given."""
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if (folder := _own_folder(proc)) is not None:
        shutil.rmtree(folder, ignore_errors=True)


def _own_folder(proc: subprocess.Popen) -> Path | None:
    """The ``--dir`` ``_start_redis_on`` made for ``proc``; None for any other (no server's own data is removed)."""
    args = [str(a) for a in proc.args] if isinstance(proc.args, (list, tuple)) else []
    if "--dir" not in args[:-1]:
        return None
    folder = Path(args[args.index("--dir") + 1])
    own = folder.parent == Path(tempfile.gettempdir()) and folder.name.startswith(_FOLDER_PREFIX)
    return folder if own else None


def _start_redis_on(server: str, port: int, own_session: bool = False) -> tuple[str, subprocess.Popen | None]:
    url = f"redis://127.0.0.1:{port}/0"
    cmd = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    folder = tempfile.mkdtemp(prefix=_FOLDER_PREFIX)  # (empty: a dump.rdb in the working folder is never loaded)
    proc = subprocess.Popen(
        [*cmd, "--dir", folder], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=own_session, preexec_fn=_parent_death_signal(),
    )  # fmt: skip
    if serves(proc, port):
        return url, proc
    proc.kill()
    stop_private_redis(proc)  # (waited for, its folder removed)
    return url, None


def _parent_death_signal() -> Callable[[], None] | None:
    """For the child: a SIGTERM from the kernel when the thread that started it ends, so that a command killed
    outright (SIGKILL, the OOM killer) does not leave its redis-server serving for good (``serve --embedded``'s,
    in its own session, not even a signal to the group reached it). Linux only, and only from the main thread
    (a thread's end would stop the server under a command still using it)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # (looked up here: the child only calls it)
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def die_with_parent() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: no signal would come
            os._exit(1)

    return die_with_parent


def serves(proc: subprocess.Popen, port: int, timeout: float = 5.0) -> bool:
    """Whether the server started as ``proc`` answers on ``port`` itself (waited for up to ``timeout``): a free
    port another process took first answers as that one's server, which would be shared, and flushed."""
    deadline = time.monotonic() + timeout
    with Redis(port=port) as client:
        while proc.poll() is None and time.monotonic() < deadline:  # (exited: it could not bind the port)
            try:
                return int(client.info("server")["process_id"]) == proc.pid
            except Exception:
                time.sleep(0.05)
    return False


def start_embedded_redis() -> str:
    """A Redis-protocol server inside this process; returns its URL."""
    from fakeredis import TcpFakeServer

    port = free_port()
    server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    server.daemon_threads = True  # connection threads must not keep the process alive at exit
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"redis://127.0.0.1:{port}/0"


def embedded_connection(url: str) -> Redis:
    """A client for the embedded server. It has no INFO command, so tell RQ the version it emulates. After it refuses
    a command it does not know (CONFIG, INFO: probes the worker makes), fakeredis' TCP server sometimes drops
    the connection (1 connection in ~100; `roseinfer demo` failed 1 run in 8): such a command goes again on a fresh
    one (the dropped connection had not run it)."""
    conn = Redis.from_url(url, retry=Retry(NoBackoff(), 3))
    setattr(conn, "__rq_redis_server_version", (8, 0, 0))
    return conn
