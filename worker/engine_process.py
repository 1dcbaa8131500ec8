"""The engine in a process of its own, driven through the ``Pump``'s interface.

In one process the worker's threads (the puller reading jobs, the sender writing events and results) and the
engine's step loop share one interpreter lock: each piece of Python they run stalls the engine's next kernel
launch, and on a fast engine with short jobs that cost a third of its speed (vLLM's engine core runs apart from its
front end for the same reason). With ``--engine-process`` the ``Pump`` and the engine run in a child process that
steps without waiting for the parent; the parent keeps Redis, RQ and the jobs' bookkeeping.

Messages go over two pipes, one each way (the child reads its own on a thread). Parent to child: ``("jobs", [...])``
(submits, batched), ``("cancel", [job_id, ...], reason)``, ``("stop",)``. Child to parent: ``("ready", facts, the
model's description: its sampling defaults, context length and tokenizer's JSON)``, ``("step", events, facts, [step
seconds, ...])`` after each engine step, ``("alive",)`` while a step admits jobs, ``("canceled", {job_id: [event,
...]}, facts)``, ``("error", text)`` if the child's loop itself fails (first of all, ``("error", text, "config")``
for a bad option). The child decides when a step's text is handed out (``event_interval_ms`` / ``max_events_per_s``,
as ``BatchWorker`` does in-process), dies with its parent, and a full pipe slows the engine down rather than drop
anything. A child that holds jobs and sends nothing for ``step_timeout`` seconds is taken for hung (a stuck kernel
or lock): it prints its threads' stacks and is killed, and its jobs fail retryably, as if it had died.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from roseinfer.config import ConfigError
from worker.pump import EngineBroken, JobEvent, Pump
from worker.watchdog import AwakeClock

log = logging.getLogger("roseinfer.worker")

# How long the parent's ``step`` waits for the child's next message: short, so the worker's loop still takes
# arrivals and reports promptly while the engine works.
_WAIT_S = 0.005


class EngineProcessDied(RuntimeError):
    """The engine's process ended (a crash, the OOM killer): the worker cannot go on without it."""


@dataclass(frozen=True)
class EngineFacts:
    """What the parent reads of the engine (metrics, status): a snapshot sent with every step."""

    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    kv_free_blocks: int = 0
    kv_blocks: int = 1
    preemptions: int = 0
    running: int = 0
    waiting: int = 0


def _facts(engine: Any) -> EngineFacts:
    kv = getattr(engine, "kv", None)
    stats = getattr(engine, "stats", None)
    scheduler = getattr(engine, "scheduler", None)
    return EngineFacts(
        getattr(stats, "num_prompt_tokens_computed", 0),
        getattr(stats, "num_prompt_tokens_cached", 0),
        getattr(kv, "num_free_blocks", 0),
        getattr(kv, "num_blocks", 1),
        getattr(scheduler, "num_preemptions", 0),
        getattr(scheduler, "num_running", 0),
        getattr(scheduler, "num_waiting", 0),
    )


def build_engine(model: str, options: dict[str, Any], spare_a_core: bool = False) -> Any:
    """The engine, as ``roseinfer worker`` builds it. ``spare_a_core``: on a CPU, unless ``num_threads`` is set,
    math threads on every core but one, which the worker's own process then has to itself (on two cores, short
    jobs ran a quarter faster so, and no faster with both cores and the worker sharing them)."""
    from roseinfer import LLM

    if spare_a_core:
        options = sparing_a_core(options)
    return LLM(model, **options).engine


def sparing_a_core(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with one math thread fewer than torch's default, on a CPU where ``num_threads`` is not set (nor
    ``OMP_NUM_THREADS``, which torch's default follows: a count the operator set lost one)."""
    told = options.get("num_threads") is not None or os.environ.get("OMP_NUM_THREADS", "").strip()
    if told or options.get("device", "cpu") != "cpu":
        return options
    import torch

    threads = max(1, torch.get_num_threads() - 1)
    log.info("engine process: %d math threads, a core left to the worker", threads)
    return {**options, "num_threads": threads}


def _kill(proc: multiprocessing.process.BaseProcess) -> None:
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=10)


def _die_with_parent() -> None:
    """The kernel kills this process when its parent dies, even in the middle of a step (Linux). A parent that died
    before this ran (killed while the child started: its imports take a while) left it orphaned already, the signal
    never sent: it would load the model, holding the GPU for minutes, for no one."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the pipe's end stops it after its step
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid != os.getppid():
        os._exit(1)


def _start(proc: multiprocessing.process.BaseProcess) -> None:
    """``proc`` started from the main thread, or else from a thread of its own that lives as long as the child: the
    kernel sends the child's death signal when the *thread* that started it ends (``_die_with_parent``), and an
    engine built on a short-lived thread (a library's helper thread, an executor's) was killed at once under a live
    worker."""
    if threading.current_thread() is threading.main_thread():
        proc.start()
        return
    started: list[BaseException | None] = []

    def start_and_stay() -> None:
        try:
            proc.start()
            started.append(None)
        except BaseException as exc:
            started.append(exc)
            return
        multiprocessing.connection.wait([proc.sentinel])  # (ready once the child ended: it reaps nothing)

    thread = threading.Thread(target=start_and_stay, name="roseinfer-engine-starter", daemon=True)
    thread.start()
    while not started:
        thread.join(0.01)
    if started[0] is not None:
        raise started[0]


def _read_commands(commands: Any, inbox: queue.SimpleQueue) -> None:
    """The child's reading thread: the parent's messages, as they come, so that the parent never waits on a full
    pipe while this process itself waits to send (each would wait on the other); None once the parent is gone."""
    try:
        while True:
            inbox.put(commands.recv())
    except (EOFError, OSError):
        inbox.put(None)
    except BaseException:  # a message that does not unpickle, say: heard as the parent gone, not as silence for good
        log.exception("the engine process cannot read its worker's messages")
        inbox.put(None)


def _take_commands(inbox: queue.SimpleQueue, wait: float | None) -> list:
    """Every message waiting, after waiting up to ``wait`` s for the first (None: until one comes)."""
    got = []
    with contextlib.suppress(queue.Empty):
        got.append(inbox.get(timeout=wait) if wait != 0 else inbox.get_nowait())
        while True:
            got.append(inbox.get_nowait())
    return got


class _SaysAlive:
    """Tells the parent, at most ten times a second, that the child admits jobs: a step that admits many (a resumed
    seeded job replays its draws: on a CPU, milliseconds a token) is not a hung one."""

    def __init__(self, conn: Any) -> None:
        self.conn, self.last = conn, 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self.last >= 0.1:
            self.last = now
            self.conn.send(("alive",))


def _serve(
    commands: Any, conn: Any, build: Callable[[], Any], interval_s: float, events_per_s: int, level: int
) -> None:
    """The child: build the engine, then step it while taking the parent's commands between steps."""
    _die_with_parent()
    with contextlib.suppress(AttributeError, OSError, ValueError, RuntimeError):  # (no usable stderr: no stacks)
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's watchdog asks for stacks first
    # The worker decides when this stops (it drains first): a Ctrl-C, or systemd's SIGTERM to the whole group,
    # reaches both. Its death kills this one anyway.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s engine: %(message)s")
    try:
        engine = build()
        pump = Pump(engine)
    except ConfigError as exc:  # a bad option: the parent raises it again, and the command prints it
        conn.send(("error", str(exc), "config"))
        return
    except Exception as exc:
        log.exception("the engine could not start")
        conn.send(("error", f"the engine could not start: {type(exc).__name__}: {exc}"))
        return
    about = {
        "sampling_defaults": dict(getattr(engine, "sampling_defaults", {})),
        "max_model_len": getattr(engine, "max_model_len", None),
        "tokenizer_json": getattr(engine, "tokenizer_json", lambda: None)(),
        "chat_template_doc": getattr(engine, "chat_template_doc", lambda: None)(),
        "numerics": getattr(engine, "numerics", ""),
    }
    conn.send(("ready", _facts(engine), about))
    pump.on_admitted = _SaysAlive(conn)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_commands, args=(commands, inbox), name="roseinfer-commands", daemon=True).start()
    next_flush, step_s, said_alive = 0.0, 0.0, time.monotonic()
    try:
        while True:
            busy = engine.has_unfinished_requests()
            # Idle: block until the parent sends something. Prompts being tokenized: look again shortly.
            wait = 0.0 if busy else (0.001 if pump.has_work() else None)
            for message in _take_commands(inbox, wait):
                kind = message[0] if message is not None else "stop"  # None: the parent is gone
                if kind == "jobs":
                    for job_id, prompt, params, timeout, prefix, priority, logprobs in message[1]:
                        pump.submit(job_id, prompt, params, timeout, prefix, priority, prefix_logprobs=logprobs)
                elif kind == "cancel":
                    conn.send(("canceled", pump.cancel_many(message[1], message[2]), _facts(engine)))
                elif kind == "stop":
                    return
            if not pump.has_work():
                continue
            began = time.monotonic()
            flush = began + step_s >= next_flush
            if flush:
                next_flush = began + max(interval_s, len(pump) / events_per_s)
            events = pump.step(flush=flush)
            step_s = time.monotonic() - began
            if events or busy:
                conn.send(("step", events, _facts(engine), pump.take_step_times()))
            elif time.monotonic() - said_alive >= 0.25:  # only tokenizing (not a step, as in process): not hung
                conn.send(("alive",))
            else:
                continue
            said_alive = time.monotonic()
    except (EOFError, BrokenPipeError, KeyboardInterrupt):  # the parent is gone
        return
    except EngineBroken as exc:  # (the parent raises it again: its jobs go back untouched, as in process)
        with contextlib.suppress(OSError):
            conn.send(("broken", str(exc)))
    except Exception as exc:
        log.exception("the engine process failed")
        with contextlib.suppress(OSError):
            conn.send(("error", f"the engine process failed: {type(exc).__name__}: {exc}"))
    finally:
        pump.close()


class EngineProcess:
    """The ``Pump`` (and the engine facts ``BatchWorker`` reads) for an engine running in a child process.

    ``build`` makes the engine in the child: a picklable callable, ``functools.partial(build_engine, model,
    options)`` for a real one. ``cancel`` answers with the job's last events as ``Pump.cancel`` does, after at
    most the step the child is running. If the child dies, or holds jobs and says nothing for ``step_timeout``
    seconds (hung: then it is killed), ``step`` fails every job in flight, retryably, and ``failure`` says why: the
    worker cannot serve without its engine. ``step_timeout`` 0 waits for good."""

    def __init__(
        self,
        build: Callable[[], Any],
        event_interval_ms: int = 20,
        max_events_per_s: int = 2000,
        start_timeout: float | None = None,
        step_timeout: float = 300.0,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds threads (and torch's pools)
        child_commands, self._commands = ctx.Pipe(duplex=False)  # one pipe each way
        self._conn, child_events = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_serve,
            args=(
                child_commands, child_events, build, event_interval_ms / 1000, max_events_per_s,
                logging.getLogger().level,
            ),
            name="roseinfer-engine",
            daemon=True,
        )  # fmt: skip
        _start(self._proc)
        # At exit, before multiprocessing's own join of its daemon children (which waits for good on this one: it
        # ignores the SIGTERM that join sends first), as when the worker fails before it closes this.
        weakref.finalize(self, _kill, self._proc)
        child_commands.close()
        child_events.close()
        self._jobs: set[str] = set()
        self._outbox: list[tuple] = []  # submits since the last step, sent together
        self._events: list[JobEvent] = []  # arrived while a cancel waited for its answer
        self._step_times: list[float] = []  # the child's engine steps, for the step histogram
        self._failure: str | None = None  # why the child is gone, once it is (``failure``)
        self._failed_once = False  # a step met the child gone (its jobs failed; those never sent, not the first time)
        self._broken: EngineBroken | None = None  # the child said it broke while a cancel waited: the next step says
        self._step_timeout = step_timeout
        # The watchdog's clock: a pause of the whole process group (SIGSTOP, a paused container) is no hang.
        self._clock = AwakeClock(min(1.0, step_timeout / 4) if step_timeout else 1.0)
        self._quiet_since = self._clock()  # the child's last message, or when it last owed none
        self._sending_since: float | None = None  # when the send under way began
        self._closed = threading.Event()
        self._killing = threading.Lock()  # the send watchdog's thread and the step loop may both find it hung
        if step_timeout:
            threading.Thread(target=self._watch_sends, name="roseinfer-engine-watchdog", daemon=True).start()
        # As long as it lives, unless ``start_timeout`` says otherwise: loading (or first downloading) a large
        # model takes what it takes, as in process; a child that dies says so at once.
        until = None if start_timeout is None else time.monotonic() + start_timeout
        while not self._conn.poll(1.0) and self._proc.is_alive():
            if until is not None and time.monotonic() > until:
                self.close()
                raise EngineProcessDied(f"the engine process did not start within {start_timeout:.0f} s")
        self.facts, about = self._receive_first()
        self.sampling_defaults = about["sampling_defaults"]  # (the model's, for jobs' unset fields)
        self.max_model_len: int | None = about["max_model_len"]
        self._tokenizer_json: str | None = about["tokenizer_json"]
        self._chat_template_doc: str | None = about["chat_template_doc"]
        self.numerics: str = about["numerics"]  # (the engine's, for the fingerprint)
        # This process loaded what the engine's does (torch, transformers: ~440k objects) but builds no engine to
        # freeze them: a full collection here took 230 ms, every tenth 256-job burst or so, and stalled the pulls.
        from roseinfer.llm_engine import settle_garbage_collector

        settle_garbage_collector()

    def _receive_first(self) -> tuple[EngineFacts, dict[str, Any]]:
        kind, *rest = self._recv()
        if kind == "ready":
            return rest[0], rest[1]
        self.close()
        if kind == "error" and rest[1:] == ["config"]:
            raise ConfigError(rest[0])
        raise EngineProcessDied(rest[0] if kind == "error" else f"unexpected first message {kind!r}")

    def tokenizer_json(self) -> str | None:
        """The engine's ``LLMEngine.tokenizer_json``, as it said when ready."""
        return self._tokenizer_json

    def chat_template_doc(self) -> str | None:
        """The engine's ``LLMEngine.chat_template_doc``, as it said when ready."""
        return self._chat_template_doc

    # ----- the Pump's interface -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._jobs

    def job_ids(self) -> list[str]:
        return list(self._jobs)

    def has_work(self) -> bool:
        """Jobs in the child, or events here not handed out yet (a job's last event that came in while its cancel,
        which crossed its end, waited for the child's answer)."""
        return bool(self._jobs or self._events)

    def submit(
        self,
        job_id: str,
        prompt: Any,
        params: Any,
        timeout: float | None = None,
        output_prefix: list[int] | None = None,
        priority: int = 0,
        tokenized: None = None,  # prompts are tokenized in the child: ``tokenize_ahead`` starts none here
        prefix_logprobs: list[dict[int, float]] | None = None,
    ) -> None:
        if job_id in self._jobs:
            raise ValueError(f"job {job_id!r} is already in flight")
        self._jobs.add(job_id)
        self._outbox.append((job_id, prompt, params, timeout, output_prefix or None, priority, prefix_logprobs))

    def tokenize_ahead(self, prompts: list[Any]) -> None:
        """The child tokenizes each prompt it is sent (``Pump.tokenize_ahead``): nothing starts here."""
        return None

    def cancel(self, job_id: str, reason: str | None = None) -> list[JobEvent]:
        return self.cancel_many([job_id], reason).get(job_id, [])

    def cancel_many(self, job_ids: list[str], reason: str | None = None) -> dict[str, list[JobEvent]]:
        """``Pump.cancel_many``: one round trip to the child for all of them."""
        here = [job_id for job_id in job_ids if job_id in self._jobs]
        if not here:
            return {}
        self._jobs.difference_update(here)
        answers = None
        try:
            if self.failure is not None:  # (a child still exiting reads on, and answers nothing: no wait for it)
                raise EngineProcessDied(self.failure)
            self._send_outbox()
            self._send(("cancel", here, reason))
            while answers is None:
                message = self._recv_in_time()
                if message[0] == "canceled":
                    answers, self.facts = message[1], message[2]  # the blocks the cancels freed show at once
                else:
                    self._take(message)
        except (EngineProcessDied, EngineBroken) as exc:  # what they made since their last events died with the engine
            if isinstance(exc, EngineBroken):  # (raised at the next step: the jobs left go back, as in process)
                self._broken = exc
            self._outbox = [job for job in self._outbox if job[0] not in here]  # (ended: no longer unsent)
            finish = "abort" if reason is None else "error"
            return {job_id: [JobEvent(job_id, finish_reason=finish, error=reason)] for job_id in here}
        # Pieces the child made before the cancel and not yet handed out come first, as in-process.
        if any(e.job_id in answers for e in self._events):
            for job_id, events in answers.items():
                events[:0] = [e for e in self._events if e.job_id == job_id]
            self._events = [e for e in self._events if e.job_id not in answers]
        return answers

    @property
    def failure(self) -> str | None:
        """Why the child is gone (an error it sent, or its exit: seen at once, even while no job runs), or None."""
        if self._failure is None and not self._proc.is_alive():
            self._failure = self._exited()
        return self._failure

    def step(self, flush: bool = True) -> list[JobEvent]:
        """The events of the steps the child ran since the last call (``flush`` is the child's to decide): waits
        a few ms for one if none came yet. Once the child is gone, every job still here fails, retryably."""
        if self._broken is not None:  # (said while a cancel waited: the cancel's jobs ended, the rest go back)
            broken, self._broken = self._broken, None
            raise broken
        try:
            if self.failure is not None:  # (it may still be exiting: no end of the pipe to wait for)
                self._read_what_is_left()
                raise EngineProcessDied(self.failure)
            while self._conn.poll(0):  # what came first: an error there, jobs sent after it would have spent a retry
                self._take(self._recv())
            self._send_outbox()  # the watchdog's clock starts when the child is sent jobs, not at a submit
            if not self._jobs:
                self._quiet_since = self._clock()  # it owes nothing
            elif self._overdue(self._clock()):
                raise self._hung_and_read()
            if not self._events and self._conn.poll(_WAIT_S):
                self._take(self._recv())
            while self._conn.poll(0):
                self._take(self._recv())
        except EngineProcessDied as exc:
            # The jobs never sent to it (the last pulls') are left out the first time: ``unsent`` names them, to be
            # handed back with their retries untouched (failed here, each spent a retry for a death not its own, and
            # one with none left failed for good). A later step fails whatever of them is still here.
            keep = set() if self._failed_once else {job[0] for job in self._outbox}
            done = {e.job_id for e in self._events if e.finished}
            failing = [j for j in self._jobs if j not in done and j not in keep]
            if failing:  # (said again at a later step only for jobs it fails then: a second "its 0 jobs" was noise)
                log.error("%s: failing its %d jobs", exc, len(failing))
            elif not self._failed_once:
                log.error("%s", exc)
            self._failed_once = True
            error = str(exc)  # (whether it runs again is its retries', said beside it: one with none left does not)
            self._events += [
                JobEvent(j, finish_reason="error", error=error, retryable=True, error_type="server_error")
                for j in failing
            ]
            self._outbox = [job for job in self._outbox if job[0] in keep]
        return self.pending_events()

    def unsent(self) -> list[str]:
        """The jobs submitted here and not yet sent to the child: none of them reached the engine."""
        return [job[0] for job in self._outbox]

    def pending_events(self) -> list[JobEvent]:
        """The events read from the child and not handed out yet, without a wait: after ``cancel_many``, those of
        jobs that ended in the child before the cancel reached it (a stop handed them back to the queue, their
        finished work thrown away)."""
        events, self._events = self._events, []
        for event in events:
            if event.finished:
                self._jobs.discard(event.job_id)
        return events

    def take_step_times(self) -> list[float]:
        """``Pump.take_step_times``: the child's (the parent's ``step`` only waits on the pipe)."""
        times, self._step_times = self._step_times, []
        return times

    def close(self) -> None:
        if self.failure is None:
            with contextlib.suppress(EngineProcessDied):
                self._send(("stop",))  # (watched too: a hung child's full pipe would hold it)
        self._closed.set()
        until = time.monotonic() + 10
        while self._proc.is_alive() and time.monotonic() < until:  # what it still sends must not hold it up
            with contextlib.suppress(EOFError, OSError):
                if self._conn.poll(0.05):
                    self._conn.recv()
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10)
        self._conn.close()
        self._commands.close()

    # ----- what BatchWorker reads of an engine ----------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self._jobs)  # ``step`` waits for the child itself: never a reason to sleep here

    @property
    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(
            num_prompt_tokens_computed=self.facts.prompt_tokens_computed,
            num_prompt_tokens_cached=self.facts.prompt_tokens_cached,
        )

    @property
    def kv(self) -> SimpleNamespace:
        return SimpleNamespace(num_free_blocks=self.facts.kv_free_blocks, num_blocks=self.facts.kv_blocks)

    @property
    def scheduler(self) -> SimpleNamespace:
        f = self.facts
        return SimpleNamespace(num_preemptions=f.preemptions, num_running=f.running, num_waiting=f.waiting)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    # ----- the pipe -------------------------------------------------------------------------------
    def _send_outbox(self) -> None:
        if not self._outbox:
            return
        jobs, self._outbox = self._outbox, []
        if len(self._jobs) <= len(jobs):  # it held none before these: it owes a step from now on, not from their
            self._quiet_since = self._clock()  # submit (a worker held up between the two killed a healthy child)
        try:
            self._send(("jobs", jobs))
        except EngineProcessDied:
            self._outbox[:0] = jobs  # never reached an engine: ``unsent``, handed back with retries untouched
            raise
        except Exception:  # one that cannot be pickled (nested past the recursion limit): nothing was written
            for i, job in enumerate(jobs):  # one at a time: that one fails alone
                try:
                    self._send(("jobs", [job]))
                except EngineProcessDied:
                    self._outbox[:0] = jobs[i:]
                    raise
                except Exception as exc:
                    self._jobs.discard(job[0])
                    log.error("job %s cannot be sent to the engine process: %r", job[0], exc)
                    error = f"the job cannot be sent to the engine process: {exc!r}"
                    self._events.append(
                        JobEvent(job[0], finish_reason="error", error=error, error_type="invalid_request")
                    )

    def _send(self, message: tuple) -> None:
        self._sending_since = self._clock()
        try:
            self._commands.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as exc:
            raise self._died() from exc
        finally:
            self._sending_since = None

    def _recv(self) -> tuple:
        try:
            message = self._conn.recv()
        except (EOFError, ConnectionResetError, OSError) as exc:
            raise self._died() from exc
        self._quiet_since = self._clock()
        return message

    def _recv_in_time(self) -> tuple:
        """The child's next message, waiting no longer than the watchdog allows (a cancel waits on a step)."""
        while self._step_timeout and not self._poll(0.5):
            if self._overdue(self._clock()):
                raise self._hung_and_read()
        return self._recv()

    def _poll(self, wait: float) -> bool:
        try:
            return self._conn.poll(wait)
        except (EOFError, OSError) as exc:
            raise self._died() from exc

    def _overdue(self, now: float) -> bool:
        return bool(self._step_timeout) and now - self._quiet_since > self._step_timeout and not self._conn.poll(0)

    def _hung(self, what: str = "made no step") -> EngineProcessDied:
        """Kill a child that held jobs and said nothing (or took no command) for ``step_timeout`` s, after it printed
        where it is stuck. The failure is set first: the puller takes no job from then on. Found by both watchdogs
        (a send slow past the timeout, then the step after it): one kill, and the first one's reason."""
        with self._killing:
            if self._failure is None:
                self._failure = f"the engine process {what} for {self._step_timeout:.0f} s (hung) and was killed"
                log.error("%s; %d jobs held; its stacks first:", self._failure, len(self._jobs))
                with contextlib.suppress(OSError, TypeError):
                    os.kill(self._proc.pid, signal.SIGUSR1)
                    time.sleep(1)  # for the stacks to reach the log
            _kill(self._proc)
            return EngineProcessDied(self._failure)

    def _hung_and_read(self) -> EngineProcessDied:
        """``_hung``, then what the child sent meanwhile (the second its stacks took): a step it finished after all
        ends its jobs as they ended, not failed. (The send watchdog's thread reads nothing: the step loop does.)"""
        died = self._hung()
        self._read_what_is_left()
        return died

    def _watch_sends(self) -> None:
        """A send waits while the child's pipe is full, which a child hung holding the interpreter lock (in C code)
        never empties: the one wait the step loop cannot time itself. Watched from here."""
        while not self._closed.wait(min(1.0, self._step_timeout / 4)):
            since, now = self._sending_since, self._clock()  # (read every tick: a pause shows as one)
            if since is not None and now - since > self._step_timeout and self._proc.is_alive():
                self._hung("took no command")  # the stuck send then fails: the child's end is gone

    def _take(self, message: tuple) -> None:
        """A message of the child's (an "alive" one only restarts the watchdog's clock, as every message does)."""
        kind = message[0]
        if kind == "step":
            self._events += message[1]
            self.facts = message[2]
            self._step_times += message[3]
        elif kind == "error":
            self._failure = message[1]
            raise EngineProcessDied(message[1])
        elif kind == "broken":  # steps kept failing: the worker hands its jobs back, as with an engine in process
            self._failure = message[1]
            raise EngineBroken(message[1])

    def _read_what_is_left(self) -> None:
        """What a child that is gone sent before it went, in order: its last steps' events (jobs they ended end so,
        not failed) and its error (the reason given, not just its exit code)."""
        with contextlib.suppress(EOFError, OSError):
            while self._conn.poll(0):
                message = self._conn.recv()
                if message[0] in ("error", "broken"):
                    self._failure = message[1]
                elif message[0] == "step":
                    self._take(message)

    def _exited(self) -> str:
        """How the child that is gone went: its exit code, or the signal that killed it."""
        self._proc.join(timeout=1)  # (the send watchdog's is_alive may have reaped it a moment before its code was set)
        code = self._proc.exitcode
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"the engine process was killed by {signal.Signals(-code).name}"
        return f"the engine process exited (exit code {'unknown' if code is None else code})"

    def _died(self) -> EngineProcessDied:
        self._proc.join(timeout=5)
        self._failure = self._failure or self._exited()
        return EngineProcessDied(self._failure)
