"""The watchdog of an engine that runs in the worker's own process: a step that never returns (a stuck kernel or
lock) cannot be interrupted from another thread, and meanwhile the heartbeats, on a thread of their own, kept the
worker's jobs claimed for good. Past ``engine_step_timeout`` the watchdog prints every thread's stack and ends the
process, as a crash would: the heartbeats stop, another worker recovers the jobs (RQ's abandoned jobs, retried
where their policy allows), and a supervisor restarts this one. (With ``--engine-process`` the parent kills its
child instead, and fails the jobs itself: ``worker/engine_process.py``.)"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("roseinfer.worker")

EXIT_HUNG = 70  # EX_SOFTWARE: the engine hung
LAST_WORDS_S = 2.0
PAUSED_S = 2.0  # a look this much later than its thread's tick: the process was stopped meanwhile


class AwakeClock:
    """``time.monotonic()`` less the time the process was stopped (SIGSTOP, Ctrl-Z, a paused container or VM): the
    monotonic clock runs on meanwhile, and a watchdog woken after such a pause took the step under way for hung (the
    worker exited 70, or killed a healthy engine process and failed its jobs). Read at least every ``tick`` s (a
    watchdog's thread does): a read later than that by ``PAUSED_S`` counts the excess as stopped."""

    def __init__(self, tick: float) -> None:
        self.tick = tick
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._stopped = 0.0

    def __call__(self) -> float:
        with self._lock:
            now = time.monotonic()
            if now - self._last > self.tick + PAUSED_S:
                self._stopped += now - self._last - self.tick
            self._last = now
            return now - self._stopped


class StepWatchdog:
    """``began()`` before a step and ``ended()`` after it; a step longer than ``timeout`` s ends the process."""

    def __init__(self, timeout: float, last_words: Callable[[], None] | None = None) -> None:
        self.timeout = timeout
        self.last_words = last_words  # run before the exit, for at most LAST_WORDS_S (Redis may be what hangs)
        self._tick = min(1.0, timeout / 4)
        self._clock = AwakeClock(self._tick)
        self._began: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="roseinfer-step-watchdog", daemon=True)

    def start(self) -> None:
        if self.timeout:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def began(self) -> None:
        self._began = self._clock()

    def ended(self) -> None:
        self._began = None

    def _watch(self) -> None:
        while not self._stop.wait(self._tick):
            began, now = self._began, self._clock()
            if began is not None and now - began > self.timeout:
                log.critical("an engine step has run for %.0f s (hung): every thread's stack, then the process ends "
                             "(exit %d) for its supervisor to restart it; its jobs go to other workers",
                             now - began, EXIT_HUNG)  # fmt: skip
                try:
                    faulthandler.dump_traceback(file=_stderr(), all_threads=True)
                    if self.last_words is not None:
                        said = threading.Thread(target=self.last_words, name="roseinfer-last-words", daemon=True)
                        said.start()
                        said.join(LAST_WORDS_S)
                finally:  # no usable stderr must not leave the process hung: the exit is the point
                    os._exit(EXIT_HUNG)


def _stderr():
    """Where stacks can be written: ``sys.stderr`` if it is a real file, else file descriptor 2 (a worker whose
    stderr was replaced by a stream with no descriptor, or set to None)."""
    try:
        sys.stderr.flush()
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return 2
