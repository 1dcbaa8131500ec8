"""RQ's start of many jobs in one script call: what ``Execution.create`` and ``Job.prepare_for_execution`` write.

Writing them through RQ's objects cost ~100 us of Python a job (an ``Execution`` and two registries built per job,
each command packed alone): a third of what taking a job costs the worker. Here Python only makes each job's
execution id and keys; one script writes every job's execution hash, execution registry entry and job hash fields,
then the shared started registries and the worker's executions set once for the batch. The writes are RQ's own,
field for field and with the same TTLs (``tests/test_queue_units.py`` holds them to what RQ's methods leave).
"""

from __future__ import annotations

import os
from typing import Any
from uuid import UUID

from redis import Redis
from rq.executions import WORKER_EXECUTIONS_KEY_TEMPLATE, Execution, ExecutionRegistry
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.utils import current_timestamp, now, utcformat

from producer.protocol import (
    MODEL_FIELD,
    RESUMED_FROM_FIELD,
    STREAM_OF_FIELD,
    created_form,
    queue_stream_check,
    result_key,
    stream_check,
    stream_key,
)
from worker.intake import load_script

# ARGV: worker name, the time (a float, as RQ writes an execution's), the same as RQ writes a job's, the execution
# TTL, the started registries' score, the execution registries' score, the worker's executions key, the field that
# names a job's owner, the field that marks whose output its stream holds, the field that holds the id of the
# stream's last entry as the attempt starts (``RESUMED_FROM_FIELD``); then per job its hash, id, execution id,
# execution hash, execution registry, started registry, intermediate list, token stream, result stream, and its
# created_at in RQ's form and in ms ('': none). A job canceled since it was pulled keeps that status; one deleted
# meanwhile stays deleted (its hash not written back: the worker reads it as a cancel). RQ's mark of when its
# clean-up first saw the job in the intermediate list goes: left (a day), a later pull of the job would find it
# minutes old, and the clean-up would queue the job again as it starts. A token or result stream key holding
# another type (written by hand) is deleted: every write to it would fail, and with it a whole batch's events or
# ends. So is a token stream of an earlier job of the same id (``producer.protocol.stream_is_earlier_jobs``, whose
# rule this holds). Returns the ids of the jobs whose keys were deleted, and of those whose earlier job's stream was.
_START = """
local name, ts, stamp, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local score, exec_score, executions, owner, stream_of = ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local resumed_from, model_field, identity = ARGV[10], ARGV[11], ARGV[12]
local started, members, repaired, stale, other = {}, {}, {}, {}, {}
for a = 13, #ARGV, 11 do
  local job, id, exec_id, exec_key = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local registry, wip, intermediate = ARGV[a + 4], ARGV[a + 5], ARGV[a + 6]
  for k = a + 7, a + 8 do
    local kind = redis.call('TYPE', ARGV[k])['ok']
    if kind ~= 'none' and kind ~= 'stream' then
      redis.call('DEL', ARGV[k])
      repaired[#repaired + 1] = id
    end
  end
  redis.call('HSET', exec_key, 'id', exec_id, 'job_id', id, 'created_at', ts, 'last_heartbeat', ts,
    'worker_name', name)
  redis.call('EXPIRE', exec_key, ttl)
  redis.call('ZADD', registry, exec_score, exec_id)
  redis.call('EXPIRE', registry, ttl + 60)
  -- A cancel that landed since the pull stays: the worker reads it and stops the job within a step. So does a
  -- delete (RQ's job.delete()): a hash written here would be a stub RQ cannot read, and the job would run on.
  local status = redis.call('HGET', job, 'status')
  if status then
    local created, created_ms, mark = ARGV[a + 9], ARGV[a + 10], redis.call('HGET', job, stream_of)
    local raw = redis.call('HGET', job, 'created_at')
    if not raw or raw == '' then  -- (RQ reads the time it read it at: nothing to go by)
      if not mark then redis.call('HSET', job, stream_of, '-') end
    elseif mark ~= created and mark ~= '-' then
      local first = redis.call('XRANGE', ARGV[a + 7], '-', '+', 'COUNT', 1)[1]
      if first and (mark or tonumber(string.match(first[1], '^(%d+)')) < tonumber(created_ms)) then
        redis.call('DEL', ARGV[a + 7])
        stale[#stale + 1] = id
      end
      redis.call('HSET', job, stream_of, created)
    end
    local last = redis.call('XREVRANGE', ARGV[a + 7], '+', '-', 'COUNT', 1)[1]
    if last then redis.call('HSET', job, resumed_from, last[1]) else redis.call('HDEL', job, resumed_from) end
    local ran_on = redis.call('HGET', job, model_field)
    if ran_on and ran_on ~= identity then other[#other + 1] = id end
    if status ~= 'canceled' and status ~= 'stopped' then status = 'started' end
    redis.call('HSET', job, 'last_heartbeat', stamp, 'status', status, 'started_at', stamp, 'worker_name', name,
      owner, exec_id, model_field, identity)
    redis.call('PERSIST', job)
  end
  redis.call('LREM', intermediate, 1, id)
  redis.call('DEL', intermediate .. ':first_seen:' .. id)
  local composite = id .. ':' .. exec_id
  if not started[wip] then started[wip] = {} end
  local list = started[wip]
  list[#list + 1] = score
  list[#list + 1] = composite
  members[#members + 1] = composite
end
for wip, list in pairs(started) do
  for i = 1, #list, 4000 do redis.call('ZADD', wip, unpack(list, i, math.min(i + 3999, #list))) end
end
for i = 1, #members, 4000 do redis.call('SADD', executions, unpack(members, i, math.min(i + 3999, #members))) end
if #members > 0 then redis.call('EXPIRE', executions, ttl + 60) end
return {repaired, stale, other}
"""


def register(connection: Redis) -> Any:
    """The script, loaded (called by its SHA from then on)."""
    return load_script(connection, _START)


def start_jobs(
    pulled: list[tuple[Job, Queue]],
    worker_name: str,
    ttl: int,
    owner_field: str,
    stream_of_field: str,
    identity: str,
) -> tuple[list[Execution], list[Any]]:
    """The start of every pulled job under a new execution of ``worker_name`` (its id also written as the job's
    owner), as RQ's own start would: the executions, and the arguments of the script (``queue_start``); the jobs
    updated as ``prepare_for_execution`` leaves them. The same arguments start the same jobs again harmlessly (a
    reply lost: the writes may have landed)."""
    right_now = now()
    stamp = utcformat(right_now)
    score = current_timestamp() + ttl  # RQ's registry scores: whole seconds
    executions: list[Execution] = []
    started_keys: dict[str, str] = {}
    args: list[Any] = [
        worker_name, repr(right_now.timestamp()), stamp, ttl, score, score + 60,
        WORKER_EXECUTIONS_KEY_TEMPLATE.format(worker_name), owner_field, stream_of_field, RESUMED_FROM_FIELD,
        MODEL_FIELD, identity,
    ]  # fmt: skip
    for (job, queue), execution_id in zip(pulled, execution_ids(len(pulled))):
        execution = Execution(execution_id, job.id, job.connection, worker_name=worker_name)
        execution.created_at = execution.last_heartbeat = right_now
        execution._job = job
        executions.append(execution)
        wip = started_keys.get(queue.name)
        if wip is None:
            wip = started_keys[queue.name] = queue.started_job_registry.key
        created, created_ms = created_form(job.created_at)
        args += [
            job.key, job.id, execution.id, execution.key, ExecutionRegistry.key_template.format(job.id), wip,
            queue.intermediate_queue_key, stream_key(job.id), result_key(job.id), created, created_ms,
        ]  # fmt: skip
        job.worker_name = worker_name
        job.last_heartbeat = job.started_at = right_now
        job._status = JobStatus.STARTED
    return executions, args


def forget_earlier_jobs_stream(conn: Redis, job: Job) -> bool:
    """The start script's check of one job (the stock RQ path's start): an earlier job's stream under its id
    deleted, the job marked. Whether a stream was deleted."""
    with conn.pipeline(transaction=False) as pipe:
        queue_stream_check(pipe, job)
        earlier, mark = stream_check(job.created_at, *pipe.execute(raise_on_error=False))
    with conn.pipeline(transaction=False) as pipe:
        if earlier:
            pipe.delete(stream_key(job.id))
        if mark is not None:
            pipe.hset(job.key, STREAM_OF_FIELD, mark)
        pipe.execute()
    return earlier


def ran_on_another_model(conn: Redis, job: Job, identity: str) -> bool:
    """The stock RQ path's look at ``MODEL_FIELD`` (the start script's): whether the job's last attempt ran on
    another model than ``identity`` (its output is not this one's to go on with), the field then this one's."""
    with conn.pipeline(transaction=False) as pipe:
        pipe.hget(job.key, MODEL_FIELD)
        pipe.hset(job.key, MODEL_FIELD, identity)
        ran_on = pipe.execute()[0]
    return ran_on is not None and ran_on.decode(errors="replace") != identity


def queue_start(script: Any, pipe: Any, args: list[Any]) -> None:
    """Queue on ``pipe`` the call of ``script`` (``register``'s) with ``start_jobs``'s arguments. By SHA: a
    pipeline holding a registered script would ask SCRIPT EXISTS first, a round trip more."""
    pipe.evalsha(script.sha, 0, *args)


def execution_ids(n: int) -> list[str]:
    """``n`` ids as RQ makes an execution's (``uuid4().hex``), from one ``urandom`` call: a call per id let go of
    the interpreter lock each time, and the tokenizing thread beside a burst's start took it over 256 times (the
    start's read of 256 jobs ~4 ms longer)."""
    raw = os.urandom(16 * n)
    return [UUID(bytes=raw[i : i + 16], version=4).hex for i in range(0, 16 * n, 16)]
