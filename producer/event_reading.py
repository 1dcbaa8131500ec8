"""Reading a job's events: its stream's entries in order (a cursor over the replay stream), the waits on its
channel, its end as the caller should see it, and a follower's patience through a Redis outage."""

from __future__ import annotations

import json
import math
import time
from typing import TYPE_CHECKING, Any

from producer.job_errors import JobCanceled, JobFailed, StreamGap, StreamRestarted, checked
from producer.protocol import (
    event_from_stream,
    is_last,
    result_key,
    stream_key,
)
from producer.wire import StreamEvent

if TYPE_CHECKING:
    from producer.client import Client

# A finished job's final event goes out in the worker's next write after its result: a reader that finds the job
# finished and its stream short of that event waits this long for it before calling the stream expired.
FINAL_EVENT_GRACE_S = 2.0


def deadline_after(timeout: float | None) -> float | None:
    """The monotonic time a wait of ``timeout`` seconds ends; None for no end (None, or infinity: a wait in
    milliseconds of it was an OverflowError). A timeout of another type, or NaN (every wait against it went on for
    ever), is refused in its own words."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, got {type(timeout).__name__} {timeout!r}")
    if isinstance(timeout, float) and math.isnan(timeout):  # (an int is never NaN, and may pass a float's range)
        raise ValueError("timeout must be a number of seconds or None, got NaN")
    try:
        return None if timeout == math.inf else time.monotonic() + timeout
    except OverflowError:  # (an int past a float's range: a wait as infinity's, or none for a negative one)
        return None if timeout > 0 else time.monotonic()


REPLAY_PAGE = 1024  # stream entries a read of the backlog takes (one XRANGE of 100,000 held Redis 40 ms)


class EventCursor:
    """Where a reader of a job's stream is, and the events each batch of entries it reads holds (checked against
    the protocol; with ``skip_void``, those a later reset in the batch makes void are left out)."""

    def __init__(self, job_id: str, skip_void: bool = False) -> None:
        self.job_id, self.skip_void = job_id, skip_void
        self.last_id: bytes | str = "0-0"
        self.next_n = 0
        self.missing: tuple[int, int] | None = None  # events trimmed before they were read (no reset since)
        self._seen: dict[int, dict[str, Any]] = {}  # the events read since the last reset, by number

    def next_entry(self) -> str:
        """The id of the first stream entry this reader has not read (XRANGE's start)."""
        if self.last_id in ("0-0", b"0-0"):
            return "-"
        ms, _, seq = (self.last_id.decode() if isinstance(self.last_id, bytes) else self.last_id).partition("-")
        return f"{ms}-{int(seq) + 1}"

    def hold(self, page: list, held: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``held`` (events read, not yet handed out) with the events of ``page`` (a read of the backlog): a reset in
        it voids what was held."""
        events = self.take(page)
        return events if events and events[0].get("reset") else held + events

    def take(self, entries: list) -> list[dict[str, Any]]:
        if not entries:
            return []
        events = [checked(StreamEvent, event_from_stream(fields), self.job_id) for _id, fields in entries]
        self.last_id = entries[-1][0]
        resets = [i for i, e in enumerate(events) if e.get("reset")] if self.skip_void else []
        out = events[resets[-1] :] if resets else events
        kept = []
        for event in out:
            # An event read already, as it was (written twice: a write tried again after Redis refused part of it),
            # is left out; event 0 again after others is a restart (the stream expired), unless it follows itself.
            n = event["n"]
            if not event.get("reset") and self._seen.get(n) == event and (n > 0 or self.next_n == 1):
                continue
            if event["n"] == 0 and self.next_n:
                event["reset"] = True
            if event.get("reset"):
                self._seen = {}
            self._seen[n] = dict(event)
            kept.append(event)
            if event.get("reset"):  # the text starts over: what was missed before it is void anyway
                self.missing = None
            elif event["n"] > self.next_n and self.missing is None:
                self.missing = (self.next_n, event["n"] - 1)
            self.next_n = event["n"] + 1
        if self.missing is not None and kept and is_last(kept[-1]):
            raise StreamGap(self.job_id, *self.missing)  # the output ended without them: it is not whole
        return kept


def piece_of(job_id: str, event: dict[str, Any], index: int, read_any: bool) -> str:
    """The text ``event`` adds to sample ``index``; ``StreamRestarted`` for a reset after text was read."""
    if event.get("reset") and read_any:
        raise StreamRestarted(job_id)
    return event["text"] if event.get("index", 0) == index else ""


def ends_sample(event: dict[str, Any], index: int) -> bool:
    """``event`` is the last of sample ``index`` while others go on (n > 1): nothing more of it follows."""
    return "sample_finish_reason" in event and event.get("index", 0) == index


def raise_at_a_bad_end(job_id: str, event: dict[str, Any], read_any: bool = True) -> None:
    """After its text: a last event of a failed job raises ``JobFailed``; of one canceled (or stopped) while it ran,
    ``JobCanceled``, as for one canceled while queued (``read_any``: whether the follower handed out text)."""
    if event.get("finish_reason") == "error":
        raise JobFailed.of_event(job_id, event)
    if event.get("finish_reason") == "abort":
        made = "the text above is what it made first" if read_any else "it had made no text"
        raise JobCanceled(job_id, f"the job was canceled; {made}")


def failed_just_now(status: str, entries: list[Any], redis_time: tuple[int, int]) -> bool:
    """A failure whose latest result entry is RQ's own record, written in the last seconds (by Redis's clock,
    ``redis_time``: a client's clock 2 s off read it as old, or every failure as new): the worker writes the job's
    result (its error, what it made) a round trip after it."""
    if status != "failed" or not entries:
        return False
    seconds, micros = redis_time
    return seconds * 1000 + micros // 1000 - _entry_millis(entries) < FINAL_EVENT_GRACE_S * 1000


def _entry_millis(entries: list[Any]) -> int:
    """When the first of a stream's ``entries`` was written: its id's milliseconds (Redis's clock)."""
    entry_id = entries[0][0]
    return int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[0])


def stream_wait_ends(deadline: float | None, may_come: bool) -> float:
    """When a follower of a finished job that read no final event gives up on its stream: after
    ``FINAL_EVENT_GRACE_S`` where it ``may_come`` (its stream is there, or the job ended in the last seconds: a
    worker writes a job's last event a round trip after its result and status, and the stream of a job of one step
    holds nothing before it), else at once (expired); never past the caller's deadline (a job long over cost every
    ``stream()`` 3 s, and one with a timeout under that a TimeoutError, its result there)."""
    now = time.monotonic()
    return min(now + FINAL_EVENT_GRACE_S, math.inf if deadline is None else deadline) if may_come else now


def queue_end_reads(pipe: Any, job_id: str) -> None:
    """Queue on ``pipe`` what ``final_event_may_come`` reads: the stream's existence, Redis's clock, the result's
    latest entry."""
    pipe.exists(stream_key(job_id))
    pipe.time()
    pipe.xrevrange(result_key(job_id), count=1)


def final_event_may_come(replies: list[Any]) -> bool:
    """From ``queue_end_reads``' replies: the stream is there, or the result was written in the last
    ``FINAL_EVENT_GRACE_S`` (by Redis's clock: no client's clock is compared with it)."""
    stream_left, (seconds, micros), entries = replies
    if stream_left:
        return True
    return bool(entries) and seconds * 1000 + micros // 1000 - _entry_millis(entries) < FINAL_EVENT_GRACE_S * 1000


def ending_event_may_come(replies: list[Any]) -> bool:
    """As ``final_event_may_come``, for a job that was running and ended otherwise (canceled, stopped, failed): also
    while it has no result yet (its worker writes the result and last event a step after the status)."""
    return not replies[2] or final_event_may_come(replies)


def time_left(deadline: float | None) -> float | None:
    """Seconds to ``deadline`` (None: no end), at least a millisecond: a last read still goes out."""
    return None if deadline is None else max(0.001, deadline - time.monotonic())


def sample_text(result: dict[str, Any], index: int) -> str:
    """The text of sample ``index`` of a result (one with n > 1 holds them in ``choices``)."""
    choices = result.get("choices") or [{"index": 0, "text": result.get("text", "")}]
    return next((c.get("text", "") for c in choices if c.get("index", 0) == index), "")


def rest_from_result(result: dict[str, Any], index: int, read: str, gap: StreamGap) -> str:
    """What the result of sample ``index`` holds past ``read``, the text a stream gave before it fell short (it
    expired, was trimmed, or never got its last events: a worker that died between its result and them); ``gap``
    raised where ``read`` is not the output's start (a hole in it)."""
    rest = _past(sample_text(result, index), read)
    if rest is None:
        raise gap
    return rest


def text_before_its_end(exc: Exception, index: int, read: str) -> str:
    """What a job that was canceled or failed made (sample ``index``) past ``read``, the text its stream gave, from
    its result: its stream expired (10 minutes after the end) or stopped short of it, and the result held the rest
    (or all of it, where none was read); nothing where ``read`` is not that text's start."""
    result = getattr(exc, "result", None)
    return (_past(sample_text(result, index), read) or "") if isinstance(result, dict) else ""


def _past(text: str, read: str) -> str | None:
    """``text`` past ``read``, its start; None where ``read`` is not its start."""
    return text[len(read) :] if text.startswith(read) else None


REDIS_PATIENCE_S = 30.0  # a follower waits out a Redis restart or failover this long, then raises
# A job's hash missing this soon after an outage is not yet taken for gone: a Redis restarted empty, its workers
# write their running jobs back (at their next round trip, or heartbeat: 10 s by default), and finish them.
AFTER_OUTAGE_S = 15.0


class Outage:
    """A follower's patience with a Redis that went away (a restart, a Sentinel failover): it tries again with
    backoff, for up to ``REDIS_PATIENCE_S`` at a time and never past the caller's deadline, then raises the error.
    Without it every stream and wait died with the restart, the jobs going on. A Redis the client never reached
    (a wrong URL) is no outage: its error is raised at once (a typo waited 30 s)."""

    def __init__(self, deadline: float | None, client: Client) -> None:
        self.deadline, self.since, self.backoff, self.client = deadline, None, 0.1, client
        self.ended_at: float | None = None  # when the last outage met ended (this client's clock)

    def wait(self, exc: Exception) -> None:
        time.sleep(self.pause(exc))

    def pause(self, exc: Exception) -> float:
        """The seconds to wait before trying again after ``exc``; raises it once patience (or the deadline) ran out."""
        if not self.client.reached:
            raise exc
        now = time.monotonic()
        self.since = self.since if self.since is not None else now
        end = self.since + REDIS_PATIENCE_S
        end = end if self.deadline is None else min(end, self.deadline)
        if now >= end:
            raise exc
        pause = min(self.backoff, end - now)
        self.backoff = min(self.backoff * 2, 2.0)
        return pause

    def over(self) -> None:
        if self.since is not None:
            self.ended_at = time.monotonic()
        self.since, self.backoff = None, 0.1
        self.client.reached = True

    def ended_within(self, seconds: float) -> bool:
        """Whether an outage this wait met ended less than ``seconds`` ago (a Redis restarted empty: its workers
        write their running jobs' hashes back within a round trip or a heartbeat of noticing)."""
        return self.ended_at is not None and time.monotonic() - self.ended_at < seconds


def ends_the_wait(message: dict[str, Any] | None) -> bool:
    """Whether a message read on a job's channel ends a wait for its result: its final event (the one with a
    finish reason), or anything not ours to read (the next look at the result decides)."""
    if not message or message["type"] != "message":
        return False
    try:
        event = json.loads(message["data"])
    except ValueError:
        return True
    return not isinstance(event, dict) or is_last(event)


def wait_for_subscribed(pubsub: Any, seconds: float) -> None:
    """Read a channel until Redis confirms the subscription, or for ``seconds``: the look again that follows goes
    out on another connection, and Redis could serve it first, then publish the job's end to nobody."""
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        message = pubsub.get_message(timeout=left)
        if message and message["type"] == "subscribe":
            return


def wait_for_final_event(pubsub: Any, seconds: float) -> None:
    """Read a job's channel until its final event, or for ``seconds``."""
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        if ends_the_wait(pubsub.get_message(timeout=left)):
            return
