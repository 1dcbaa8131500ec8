"""Redis writes off the step loop: a thread that sends what the steps produced, in order.

The step loop hands over, after each step, the events it produced (stream entries and pub/sub messages), the
job-ending work in order behind them (results, RQ's success and failure paths), and the jobs whose status to
watch. The thread sends everything that piled up since its last round trip in one pipeline, reads the statuses in
the same round trip, then runs the job-ending work; a job's last event is held back and sent after that work wrote
its status and result, so a follower that sees the last event finds the result there. The queue between them is
bounded: when Redis falls behind (or is away), the step loop waits instead of dropping anything; unsent work is kept
and retried with backoff.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from redis.exceptions import NoScriptError, ResponseError
from rq.job import Job

from producer.connection import REDIS_DOWN, REDIS_UNAVAILABLE, redis_waits, wrong_type
from producer.protocol import channel_key
from worker import job_finish, job_start
from worker.intake import MOVE_SCRIPT, load_script
from worker.publisher import Event, Publisher

log = logging.getLogger("roseinfer.worker")

# Every event of a round trip in one command: packing hundreds of XADD/PUBLISH commands in Python costs the step
# loop more (they share the GIL) than Redis spends running them. KEYS: per event its stream and its job's hash;
# ARGV: maxlen, the worker's lease key ('': none), this worker's key of the last send written and this send's number
# (a send tried again after its reply was lost, when the first try ran, writes nothing twice), whether these are
# final events ('1': a job this worker failed is written its last one; a running job RQ's clean-up failed as
# abandoned, this worker stalled, gets no more), whether to publish ('0': the Redis user may not; followers read
# the streams), then per event: the
# stream's TTL to set (0: none), channel, the
# event's JSON (the stream entry's one field and the message), the attempt that must own the job ('': any). An
# event of a job that another attempt owns now, or that was requeued meanwhile, is not written (fencing: this
# worker stalled past its heartbeat); the reply lists those events. While the lease exists no job of this worker
# can have gone elsewhere, so the per-event check is skipped (one EXISTS a round trip, not an HMGET an event). A
# job hash that is gone does not fence: Redis may have lost its data (the worker writes the hashes back), and a
# deleted job is a cancel. A channel nobody listens to gets no PUBLISH (most jobs have no live follower): one
# PUBSUB NUMSUB for all channels instead, and everything is published while any pattern subscriber exists. The
# script runs at once, so a follower that subscribed before it gets the message, and one that subscribes after
# reads the entry from the stream (the protocol: subscribe first, then replay the stream). A stream key overwritten
# with another type while its job runs (by hand) is replaced: its error aborted the script, and every later event of
# the round trip, other jobs' too, was lost.
_EMIT = """
local maxlen, a, lost, finals, publishes = ARGV[1], 7, {}, ARGV[5] == '1', ARGV[6] == '1'
if redis.call('GET', ARGV[3]) == ARGV[4] then return lost end
redis.call('SET', ARGV[3], ARGV[4], 'EX', 3600)
local leased = ARGV[2] ~= '' and redis.call('EXISTS', ARGV[2]) == 1
local everyone, heard = publishes and redis.call('PUBSUB', 'NUMPAT') > 0, {}
if publishes and not everyone then
  local channels = {}
  for k = 8, #ARGV, 4 do channels[#channels + 1] = ARGV[k] end
  for first = 1, #channels, 1000 do
    local counts = redis.call('PUBSUB', 'NUMSUB', unpack(channels, first, math.min(first + 999, #channels)))
    for k = 1, #counts, 2 do if counts[k + 1] > 0 then heard[counts[k]] = true end end
  end
end
for i = 1, #KEYS, 2 do
  local owner = ARGV[a + 3]
  local job = (owner ~= '' and not leased) and redis.pcall('HMGET', KEYS[i + 1], 'roseinfer_owner', 'status') or {}
  -- A job hash overwritten with another type (by hand): not this attempt's job any more. Its error aborted the
  -- script, and every other event of the round trip, other jobs' final ones too, was lost.
  if job.err then job = {'', ''} end
  if not job[1] or (job[1] == owner and job[2] ~= 'queued' and (finals or job[2] ~= 'failed')) then
    local added = redis.pcall('XADD', KEYS[i], 'MAXLEN', '~', maxlen, '*', 'event', ARGV[a + 2])
    if type(added) == 'table' and added.err then
      if not string.find(added.err, 'WRONGTYPE', 1, true) then return redis.error_reply(added.err) end
      redis.call('DEL', KEYS[i])
      redis.call('XADD', KEYS[i], 'MAXLEN', '~', maxlen, '*', 'event', ARGV[a + 2])
    end
    if everyone or heard[ARGV[a + 1]] then redis.call('PUBLISH', ARGV[a + 1], ARGV[a + 2]) end
    if ARGV[a] ~= '0' then redis.call('EXPIRE', KEYS[i], ARGV[a]) end
  else
    lost[#lost + 1] = (i - 1) / 2
  end
  a = a + 4
end
return lost
"""
# The lease (``LEASE_KEY``), set at each heartbeat in one script. KEYS: the lease, then per job held its hash and
# its started registry; ARGV: the lease's longest milliseconds, the margin before a registry entry lapses, then per
# job its owner here and its registry member. Set only while every job is still this worker's (a lapse may have let
# RQ requeue one), and never past any job's registry entry less the margin, by Redis's clock: a stall of Redis
# outlived the entries (their scores are absolute, the lease's TTL was not) and RQ requeued jobs whose events then
# went out unchecked, from two attempts. A job's entry gone while it has not ended here (RQ's clean-up took it for
# abandoned, and requeued, scheduled or failed it) ends the lease too: it was granted whole. A job "queued" or
# "scheduled" that still has its entry was not requeued (RQ's requeues take the entry out with it): a stale copy of
# it was saved over its status (``job.save()`` of the object ``enqueue`` returned), which says "started" again (the
# events refused meanwhile go out once the step loop finds it ours). 1 if set; 0: the lease is gone, and every event
# is checked.
_LEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ms, margin, a = tonumber(ARGV[1]), tonumber(ARGV[2]), 3
for i = 2, #KEYS, 2 do
  local job = redis.call('HMGET', KEYS[i], 'roseinfer_owner', 'status')
  local score = redis.call('ZSCORE', KEYS[i + 1], ARGV[a + 1])
  local requeued = job[2] == 'queued' or job[2] == 'scheduled'
  if requeued and score and job[1] == ARGV[a] then
    redis.call('HSET', KEYS[i], 'status', 'started')  -- a stale copy saved over it: it runs here, as it says again
    requeued = false
  end
  if job[1] and (job[1] ~= ARGV[a] or requeued or job[2] == 'failed') then
    ms = 0 break
  end
  if score then ms = math.min(ms, math.floor(tonumber(score) * 1000) - margin - now)
  elseif job[1] and (job[2] == 'started' or job[2] == 'deferred') then ms = 0 break end  -- (one ended has none)
  a = a + 2
end
if ms <= 0 then redis.call('DEL', KEYS[1]) return 0 end
redis.call('SET', KEYS[1], 1, 'PX', ms)
return 1
"""


def _nothing() -> None:
    pass


def _is_final(event: Event) -> bool:
    return event[1].get("finish_reason") is not None


# The statuses that end a job here: canceled, stopped, or the hash gone.
_ENDING = (b"canceled", b"stopped", None)


@dataclass
class Batch:
    """One step's hand-over."""

    events: list[Event] = field(default_factory=list)  # running jobs' events
    tasks: list[Callable[[], None]] = field(default_factory=list)  # job endings, run after the events, in order
    finals: list[Event] = field(default_factory=list)  # jobs' last events: sent after the job endings
    watch: list[tuple[str, str]] | None = None  # (job id, job key) to read statuses of; None: keep the last


def _counted(replies: list[Any], counts: int, after: int) -> list[Any]:
    """A round trip's replies, the first error raised, but for the ``counts`` lengths before the last ``after``: a
    queue or canceled registry of another type (set by hand) counts 0. Its error failed the round trip, every
    event of every job dropped, for as long as the key stayed."""
    first = len(replies) - after - counts
    for i, reply in enumerate(replies):
        if isinstance(reply, Exception):
            if first <= i < first + counts and wrong_type(reply):
                replies[i] = 0
            else:
                raise reply
    return replies


class Sender:
    def __init__(
        self,
        connection: Redis,
        publisher: Publisher,
        on_statuses: Callable[[list[tuple[str, bytes | None]], bool], None],
        on_lost: Callable[[list[tuple[str, str]]], None] = lambda lost: None,
        queue_keys: list[str] | None = None,
        max_pending: int = 64,
        status_interval: float = 0.1,
    ) -> None:
        self.connection = connection
        self.publisher = publisher
        # Called on the sender thread with the (job id, status) pairs whose status ends the job (canceled, stopped,
        # the hash gone) and whether the worker is still registered.
        self.on_statuses = on_statuses
        # Called on the sender thread with the jobs whose events were refused: another attempt owns them now.
        self.on_lost = on_lost
        self._queue: queue.Queue[Batch | None] = queue.Queue(maxsize=max_pending)
        self._watch: list[tuple[str, str]] = []
        self._idle = threading.Event()
        self._idle.set()
        # Batches handed over and not yet sent, counted under a lock: an empty queue alone is not idle (a batch
        # handed over between the sender's look at it and its setting the flag would be waited for by no one).
        self._unsent = 0
        self._unsent_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="roseinfer-sender", daemon=True)
        self.worker_key: str | None = None
        # A scratch list of job ids, for reading their statuses: its own per sender (the worker names it after itself).
        self.status_list = f"roseinfer:statuses:{uuid.uuid4().hex}"
        self.sent_key = f"roseinfer:sent:{uuid.uuid4().hex}"  # the number of the last send the event script wrote
        self._sends = 0
        self._last_try = ""  # the send last tried without Lua: tried again, its number says whether it landed
        self.sorts_statuses = True  # statuses read by one SORT (``_probe_sort``), else an HGET per job
        self.publishes = True  # events published on their jobs' channels too (``_probe_publish``)
        self.error: BaseException | None = None  # what stopped the thread, re-raised on the step loop
        self.round_trips = 0
        self.refusing: str | None = None  # why Redis refuses our writes right now, for `roseinfer status`
        # A cold stop: past this time (time.monotonic()) what Redis refuses is dropped, not waited for (RQ's
        # clean-up takes the jobs once this worker's heartbeat lapses).
        self.give_up_at: float | None = None
        # Jobs waiting in the queues, read in each round trip: the step loop pulls only when some wait, instead of
        # asking Redis (an empty LMOVE) at every step.
        self.queue_keys = queue_keys or []
        self.canceled_keys: list[str] = []  # RQ's canceled registries of the lanes: read each round trip
        self._canceled_counts: dict[str, int] = {}
        self.queued = 0
        self.queued_by_key: dict[str, int] = {}  # jobs waiting per queue key, as last read
        self.depths_read_at = 0.0  # when (monotonic) those were read
        self.on_round_trip: Callable[[float], None] | None = None  # seconds of each reading round trip
        self.on_jobs_waiting: Callable[[], None] | None = None  # called when a round trip saw jobs in the queues
        self.on_idle: Callable[[], None] | None = None  # called when everything handed over is sent
        self.status_interval = status_interval
        self._next_status_read = 0.0
        self._emit = None  # the event script, where the server runs Lua (the embedded fakeredis too)
        self.lease_script = None
        self.finish_script = None  # ends finished jobs as RQ would (``job_finish``)
        self.move_script = None  # takes jobs off a queue until it is empty (``intake.MOVE_SCRIPT``)
        self.start_script = None  # starts pulled jobs as RQ would (``job_start``)
        self.lease_key = ""  # the worker's lease (``LEASE_KEY``): set by the worker, kept by its heartbeats
        self._listed: frozenset[bytes] = frozenset()  # the job ids in the scratch list of statuses
        # (job id, attempt) whose end here was dropped: its last event, in the same round trip, is not sent
        self._dropped_finals: set[tuple[str, str]] = set()
        self._amends: dict[tuple[str, str], dict[str, Any] | None] = {}  # last events to change before they go out
        # (job id, attempt) -> its events the script refused, and those of it that came after, in order: held until
        # the step loop says whether the job is still that attempt's (``release_held``: sent again, checked) or not
        # (``discard_held``). A job requeued while it ran here and taken back by this worker went on with a gap.
        self._held: dict[tuple[str, str], list[Event]] = {}
        self._released: list[Event] = []
        self._held_lock = threading.Lock()
        self._thread_gone = False  # (under _held_lock) the thread ended: events let go since are sent by their caller
        self._next_birth_check = 0.0

    def _probe_sort(self) -> None:
        """Whether this Redis lets us read statuses with SORT's GET patterns (an ACL user limited to some keys
        may not): one command for every job's status instead of one per job."""
        try:
            self.connection.sort(self.status_list, by="nosort", get=f"{Job.key_for('*')}->status")
        except REDIS_DOWN:
            raise
        except Exception as exc:
            log.info("this Redis refuses SORT ... GET (%s): statuses are read with an HGET per job", exc)
            self.sorts_statuses = False

    def _probe_publish(self) -> None:
        """Whether this Redis user may publish on the jobs' channels (a managed Redis's users get no channel by
        default): a refused PUBLISH failed every round trip, its events and its reads of cancels with it."""
        try:
            self.connection.execute_command("PUBSUB", "NUMPAT")
            self.connection.publish(channel_key("probe"), "")  # (no job has that id: nobody hears it)
        except REDIS_DOWN:
            raise
        except Exception as exc:
            log.warning(
                "this Redis user may not publish on roseinfer:tokens:* (%s): each job's events go to its stream "
                "alone, which followers read (grant it &roseinfer:tokens:* and +@pubsub for live channels)",
                exc,
            )
            self.publishes = False

    def _load_scripts(self) -> None:
        try:
            # Run, not only loaded: a user allowed SCRIPT but not EVALSHA (an ACL's -evalsha) took the Lua path, and
            # its worker, listed as serving, took no job (every pull, beat and write refused) for good.
            self.connection.evalsha(self.connection.script_load("return 1"), 0)
        except REDIS_DOWN:
            raise
        except Exception:
            log.info("this Redis runs no Lua scripts: events go out as one command each")
            return
        # Loaded now and called by their SHA (``load_script``). Redis losing its scripts (a restart) reloads them.
        self._emit = load_script(self.connection, _EMIT)
        self.lease_script = self.connection.register_script(_LEASE)
        self.finish_script = job_finish.register(self.connection)
        self.move_script = load_script(self.connection, MOVE_SCRIPT)
        self.start_script = job_start.register(self.connection)

    @property
    def runs_scripts(self) -> bool:
        """Whether this Redis runs Lua scripts (one whose ACL or host forbids them does not)."""
        return self._emit is not None

    def start(self) -> None:
        self._load_scripts()
        self._probe_sort()
        self._probe_publish()
        self._thread.start()

    def put(self, batch: Batch) -> None:
        """Hand a step's work over; blocks while ``max_pending`` batches wait (Redis slower than the engine)."""
        if self.error is not None:
            raise self.error
        if batch.events or batch.tasks or batch.finals or batch.watch is not None:
            with self._unsent_lock:  # (the thread's death is said under it: else idle was cleared after it set it)
                if self.error is not None:
                    raise self.error
                self._unsent += 1
                self._idle.clear()
            while True:  # (may block: outside the lock, which the sender takes once it sent)
                try:
                    self._queue.put(batch, timeout=0.25)
                    return
                except queue.Full:
                    if self.error is not None:  # the sender thread stopped: nothing will take it, ever
                        raise self.error from None
                    if self._giving_up() and self.refusing is not None:
                        log.error(
                            "the worker stops and Redis refuses writes (%s): a step's writes dropped", self.refusing
                        )
                        self._sent(1)
                        return

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything handed over is sent; False on timeout."""
        return self._idle.wait(timeout)

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def stop(self, timeout: float = 30.0) -> None:
        self.drain(timeout)
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        if not self._thread.is_alive():  # events a callback thread let go as it ended go out here, or from it
            with self._held_lock:
                self._thread_gone = True
                released, self._released = self._released, []
            if released:
                self._send_released(released)
        with contextlib.suppress(*REDIS_UNAVAILABLE):  # (they expire)
            self.connection.delete(self.status_list, self.sent_key)

    # ----- the thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                first = self._queue.get()
                if first is None:
                    return
                batches = [first]
                while True:  # everything that piled up meanwhile goes in the same round trip
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        self._send_until_done(batches)
                        return
                    batches.append(more)
                self._send_until_done(batches)
                if self._sent(len(batches)) and self.on_idle is not None:
                    self.on_idle()
        except BaseException as exc:  # a bug here must not leave the step loop waiting forever
            log.exception("the sender thread stopped")
            with self._unsent_lock:
                self.error = exc
                self._idle.set()

    def _giving_up(self) -> bool:
        return self.give_up_at is not None and time.monotonic() >= self.give_up_at

    def _sent(self, num_batches: int) -> bool:
        """``num_batches`` are done with (sent, or dropped); whether nothing is left unsent."""
        with self._unsent_lock:
            self._unsent -= num_batches
            idle = self._unsent == 0
            if idle:
                self._idle.set()
        return idle

    def _send_until_done(self, batches: list[Batch]) -> None:
        for batch in batches:
            if batch.watch is not None:
                self._watch = batch.watch
        events = [e for batch in batches for e in batch.events]
        tasks = [t for batch in batches for t in batch.tasks]
        finals = [e for batch in batches for e in batch.finals]
        with self._held_lock:  # (released before these: they come first; a held job's new events wait with it)
            released, self._released = self._released, []
            events, finals = self._divert(events), self._divert(finals)
        if released:
            self._send_released(released)
        # An error Redis will give again (not a wait: those are retried) drops what failed, never this thread: the
        # step loop would wait on it for good.
        try:
            send = self._next_send()  # the same on every try: a try after a lost reply that ran writes nothing
            self.retrying(lambda: self._send(events, True, send), f"{len(events)} events kept")
        except Exception as exc:
            self._failed(exc, f"writing {len(events)} events failed; they are dropped (their jobs' results still go)")
        for task in tasks:
            try:
                self.retrying(task, "while ending a job")
            except Exception as exc:
                self._failed(exc, "ending a job failed")
        with self._held_lock:  # (a job held since the look above, its event refused this round trip: its last
            finals = self._amended(self._divert(finals))  # event waits behind that one, not before it)
            released, self._released = self._released, []  # (let go by a task here, or by a callback thread)
        if released:
            self._send_released(released)
        if self._dropped_finals:  # (cleared each round trip: a job that ended without a last event, one put off
            # for a retry, left its id, and its next run here lost its own)
            dropped, self._dropped_finals = self._dropped_finals, set()
            finals = [final for final in finals if (final[0], final[3]) not in dropped]
        if finals:  # after the results and statuses they announce
            try:
                send = self._next_send()
                self.retrying(lambda: self._send(finals, False, send), f"{len(finals)} final events kept")
            except Exception as exc:
                self._failed(exc, f"writing {len(finals)} final events failed; they are dropped")

    def _failed(self, exc: Exception, what: str) -> None:
        """A write given up: with its stack, but Redis still away at a stop that gave up on it, in a line (the jobs
        not handed back are said apart; "their results still go" was false there)."""
        if self._giving_up() and isinstance(exc, (*REDIS_UNAVAILABLE, ResponseError)):
            log.warning("Redis unavailable at the stop (%s: %s): a write given up", type(exc).__name__, exc)
        else:
            log.exception(what)

    @property
    def holds_events(self) -> bool:
        """Events refused wait for the step loop's word on their jobs, or to go out again."""
        return bool(self._held or self._released)

    def hold(self, job_id: str, owner: str) -> None:
        """Events of ``job_id`` by attempt ``owner`` wait from now until ``release_held`` (its end is written
        elsewhere: its last event goes after it)."""
        with self._held_lock:
            self._held.setdefault((job_id, owner), [])

    def release_held(self, job_id: str, owner: str) -> None:
        """The events held for ``job_id`` of attempt ``owner`` go out again, first, each checked again."""
        with self._held_lock:
            self._released += self._held.pop((job_id, owner), [])
            gone = self._thread_gone
            released, self._released = (self._released, []) if gone else ([], self._released)
        if gone:  # a cold stop left its callback running: its end written after the thread ended, its last event
            self._send_released(released)  # waited for good (its result there, the stream never ended)
        elif threading.current_thread() is not self._thread:  # (this thread sends them after its tasks: a put of
            self.put(Batch(tasks=[_nothing]))  # its own would wait on a full queue for good) wakes the thread

    def amend_final(self, job_id: str, owner: str, fields: dict[str, Any] | None) -> None:
        """The last event of ``job_id`` by attempt ``owner``, not sent yet, goes out with ``fields`` (a field given
        None is taken out), or not at all where ``fields`` is None: its end changed after the event was made (a
        success callback that raised failed the job: its "stop" said otherwise)."""
        with self._held_lock:
            self._amends[(job_id, owner)] = fields
            held = self._held.get((job_id, owner))
            if held is not None:
                held[:] = self._amended(held)

    def _amended(self, events: list[Event]) -> list[Event]:
        """``events`` with the amendments of their last events made (under ``_held_lock``)."""
        if not self._amends:
            return events
        out = []
        for event in events:
            if _is_final(event) and (event[0], event[3]) in self._amends:
                fields = self._amends.pop((event[0], event[3]))
                if fields is None:
                    continue
                for name, value in fields.items():
                    if value is None:
                        event[1].pop(name, None)
                    else:
                        event[1][name] = value
            out.append(event)
        return out

    def discard_held(self, job_id: str, owner: str) -> None:
        """The events held for ``job_id`` of attempt ``owner`` are dropped: the job is another attempt's now."""
        with self._held_lock:
            self._held.pop((job_id, owner), None)

    def _divert(self, events: list[Event]) -> list[Event]:
        """``events`` but those of held jobs, which join their held events (under ``_held_lock``)."""
        if not self._held:
            return events
        kept = []
        for event in events:
            held = self._held.get((event[0], event[3]))
            if held is None:
                kept.append(event)
            else:
                held.append(event)
        return kept

    def _send_released(self, released: list[Event]) -> None:
        """Held events let go, each checked (no lease), in order: running ones first, then any last one."""
        for finals in (False, True):
            part = [e for e in released if _is_final(e) == finals]
            if finals:  # (held again if the running ones were refused again: behind them)
                with self._held_lock:
                    part = self._amended(self._divert(part))
            if not part:
                continue
            send = self._next_send()
            try:
                self.retrying(
                    lambda p=part, f=finals, n=send: self._with_scripts(lambda: self._send_checked(p, f, n)),
                    f"{len(part)} events kept",
                )
            except Exception:
                log.exception("writing %d events held back failed; they are dropped", len(part))

    def drop_final(self, job_id: str, owner: str) -> None:
        """The last event of ``job_id`` by attempt ``owner``, waiting to go out after its end (which was dropped: a
        task of this round trip), is not sent: the job ended elsewhere (RQ's clean-up failed it), and the stream
        would end it a second time."""
        self._dropped_finals.add((job_id, owner))

    def retrying(self, action: Callable[[], None], what: str) -> None:
        """Run ``action`` until Redis takes it: unreachable or refusing writes (full memory), it waits with
        backoff, keeping everything (and the step loop waits once the queue is full); logged once a minute."""
        backoff, next_log = 0.25, 0.0
        while True:
            try:
                action()
                if next_log:
                    log.warning("Redis takes writes again")
                    self.refusing = None
                return
            except (*REDIS_UNAVAILABLE, ResponseError) as exc:
                if not redis_waits(exc) or self._giving_up():
                    raise
                self.refusing = f"{type(exc).__name__}: {exc}"
                if time.monotonic() >= next_log:
                    log.error("Redis unavailable (%s); %s, retrying with backoff", self.refusing, what)
                    next_log = time.monotonic() + 60
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _next_send(self) -> str:
        with self._held_lock:  # (after a cold stop, a callback thread sends beside the stop: numbers stay one each)
            self._sends += 1
            return str(self._sends)

    def _send(self, events: list[Event], read: bool, send: str) -> None:
        """Write ``events`` (as send number ``send``); with ``read``, also read the statuses, the queue's length and
        the registration."""
        self._with_scripts(lambda: self._send_once(events, read, send))

    def _with_scripts(self, action: Callable[[], None]) -> None:
        """``action``, again once the scripts are loaded where Redis lost them (a restart): nothing of it was
        written then."""
        try:
            action()
        except NoScriptError:
            log.warning("Redis lost its scripts (a restart?): loading them again")
            self._load_scripts()
            action()

    def _send_once(self, events: list[Event], read: bool, send: str) -> None:
        if not read:  # final events: each checked, lease or not (a job never gets two)
            self._send_checked(events, True, send)
            return
        # Every job's status (cancels) every status_interval (100 ms: a status written by hand from another
        # language, ``HSET status canceled``, or a deleted hash lands within that), and at once when RQ's canceled
        # registry of a lane changed (``job.cancel()`` adds the job there). Not at every round trip: a fast
        # engine's round trips would then read every job's status every few milliseconds.
        mono = time.monotonic()
        watch = list(self._watch) if mono >= self._next_status_read else []
        if watch:
            self._next_status_read = mono + self.status_interval
        started = time.perf_counter()
        queue_keys = list(self.queue_keys)  # the step loop may change the lanes meanwhile
        # Between two status reads only: a cancel then reads every status at once (a fast engine's round trips
        # come every few ms); a round trip that reads them anyway needs no count.
        canceled_keys = list(self.canceled_keys) if not watch else []
        # `birth` is written only by registration (heartbeats recreate the key without it): gone, Redis lost its
        # data. Looked at with every read of statuses (a hash gone is then no cancel), and at least once a second.
        check_birth = bool(self.worker_key) and (bool(watch) or mono >= self._next_birth_check)
        if check_birth:
            self._next_birth_check = mono + 1.0
        try:
            # Without Lua, in MULTI: a round trip Redis refused part of (full memory) and that was tried again wrote
            # its first events two or three times (the script's send number keeps them once otherwise).
            with self.connection.pipeline(transaction=self._emit is None) as pipe:
                self._queue_events(pipe, events, send)
                read_statuses = self._queue_status_reads(pipe, watch)
                for key in queue_keys:
                    pipe.llen(key)
                for key in canceled_keys:
                    pipe.zcard(key)
                if check_birth:
                    pipe.hexists(self.worker_key, "birth")
                replies = _counted(
                    pipe.execute(raise_on_error=False), len(queue_keys) + len(canceled_keys), check_birth
                )
        except Exception:
            self._listed = frozenset()  # what the scratch list holds is unknown now: written again next time
            raise
        if self.on_round_trip is not None:
            self.on_round_trip(time.perf_counter() - started)
        self._report_lost(events, replies)
        self.round_trips += 1
        registered = bool(replies[-1]) if check_birth else True
        tail = len(queue_keys) + len(canceled_keys) + check_birth
        depths = replies[len(replies) - tail : len(replies) - check_birth]
        self.queued_by_key = dict(zip(queue_keys, depths))
        self.depths_read_at = time.monotonic()
        self.queued = sum(self.queued_by_key.values())
        if self.queued and self.on_jobs_waiting is not None:
            self.on_jobs_waiting()
        if canceled_keys:
            canceled = dict(zip(canceled_keys, depths[len(queue_keys) :]))
            if canceled != self._canceled_counts:  # a job was canceled (or the registry cleaned): statuses next
                if self._canceled_counts:  # (the first counts are where to start from)
                    self._next_status_read = 0.0
                self._canceled_counts = canceled
        statuses = read_statuses(replies[: len(replies) - tail])
        self.on_statuses([(job_id, s) for job_id, s in statuses if s in _ENDING], registered)

    def _send_checked(self, events: list[Event], finals: bool, send: str) -> None:
        """Write ``events``, each checked whatever the lease (``finals``: jobs' last events)."""
        with self.connection.pipeline(transaction=self._emit is None) as pipe:  # (MULTI without Lua: once)
            self._queue_events(pipe, events, send, lease="", finals=finals)
            replies = pipe.execute()
        self._report_lost(events, replies)

    def _queue_status_reads(
        self, pipe, watch: list[tuple[str, str]]
    ) -> Callable[[list], list[tuple[str, bytes | None]]]:
        """Queue the reads of the watched jobs' statuses on ``pipe``; returns what reads them from the replies
        before the round trip's tail. One SORT reads them all (the ids into a scratch list of this worker's, then
        SORT's GETs take each job hash's status, nil where the hash is gone), not a command per job; where Redis
        refuses SORT's patterns (an ACL user limited to some keys), an HGET per job."""
        if not watch:
            return lambda replies: []
        if not self.sorts_statuses:
            for _job_id, key in watch:
                pipe.hget(key, "status")
            return lambda replies: [(job_id, s) for (job_id, _), s in zip(watch, replies[-len(watch) :])]
        # The list is kept between reads and written again only when a job joined (or it holds many that left):
        # a batch that runs for a while costs one SORT a read, not RPUSH + SORT + DEL.
        ids = {job_id.encode(): job_id for job_id, _ in watch}
        if not self._listed.issuperset(ids) or len(self._listed) > 2 * len(ids) + 16:
            pipe.delete(self.status_list)
            pipe.rpush(self.status_list, *ids)
            pipe.expire(self.status_list, 3600)  # what a worker that died leaves goes within the hour
            self._listed = frozenset(ids)
        pipe.sort(self.status_list, by="nosort", get=["#", f"{Job.key_for('*')}->status"])

        def read(replies: list) -> list[tuple[str, bytes | None]]:
            pairs = replies[-1]  # (id, status) pairs; ids of jobs that left since are not ours now
            found = [(ids[i], status) for i, status in zip(pairs[::2], pairs[1::2]) if i in ids]
            if len(found) < len(ids):  # the list is gone (Redis lost its data): written again next time
                self._listed = frozenset()
            return found

        return read

    def _report_lost(self, events: list[Event], replies: list) -> None:
        """The events the script refused (its reply, first in the round trip): their jobs are another attempt's
        than the one that wrote them (reported as (job id, that attempt), so a later attempt here is kept)."""
        if self._emit is not None and events and replies[0]:
            refused = [events[int(i)] for i in replies[0]]
            with self._held_lock:  # (before the report: the step loop may answer it at once)
                for event in refused:
                    self._held.setdefault((event[0], event[3]), []).append(event)
            self.on_lost(sorted({(event[0], event[3]) for event in refused}))

    def _queue_events(
        self, pipe, events: list[Event], send: str, lease: str | None = None, finals: bool = False
    ) -> None:
        if self._emit is None:  # (without Lua, in MULTI: the send's number goes in with its events, as the script's)
            retried, self._last_try = send == self._last_try, send
            if events and not (retried and self.connection.get(self.sent_key) == send.encode()):  # (it landed)
                pipe.set(self.sent_key, send, ex=3600)
                self.publisher.queue_writes(pipe, events, self.publishes)
        elif events:
            keys, args = self.publisher.script_args(events)
            lease = self.lease_key if lease is None else lease
            head = [self.publisher.maxlen, lease, self.sent_key, send, int(finals), int(self.publishes)]
            pipe.evalsha(self._emit.sha, len(keys), *keys, *head, *args)
