"""RQ's success path for many jobs in one script call: what ``handle_job_success`` and the cleanups write.

Collected as redis-py commands and merged by a generic script, a finished job cost the sender ~130 us of Python (14
commands packed, then split apart again): 23 ms for the 179 jobs one step of a burst ended, while the engine's
step beside it waited on the interpreter lock. Here Python makes each job's result entry and a few keys; one
script checks each job is still this attempt's (and has no dependents, which RQ's own path must enqueue) and
writes its hash, its result in RQ's result stream and the TTLs, then the registries, the execution records and the
worker's counters once for the batch. The writes are RQ's own, field for field (``tests/test_queue_units.py`` holds
them to what RQ's methods leave).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from redis import Redis
from rq.executions import Execution, ExecutionRegistry
from rq.job import Job, JobStatus
from rq.registry import (
    CanceledJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    ScheduledJobRegistry,
    StartedJobRegistry,
)
from rq.results import Result
from rq.utils import current_timestamp, utcformat

from producer.protocol import done_key, result_key
from worker.intake import load_script

# ARGV: the field naming a job's owner, RQ's time stamp of the end, the worker's name, the end as a float (the
# result's execution_ended_at), the worker's hash, the worker's executions set, the result entry's type, the TTL of
# completion lists; then per job (``_PER_JOB`` each): its hash, id, execution id (its owner), dependents key,
# result stream, return value, execution start, result TTL (-1: for good), dependencies key ('': none), execution
# hash, execution registry, finished registry and score, started registry, execution's composite key, seconds
# worked, completion list ('': none), failed registry, canceled registry, scheduled registry. A job canceled as it
# finished finishes, and leaves the canceled registry; so does one RQ put off for a retry with an interval, the
# scheduled registry (whose retry then ran it again). Returns the (0-based) jobs skipped: those another attempt
# owns now (a job hash that is gone does not fence: Redis may have lost its data) or that failed meanwhile (RQ's
# clean-up took it for abandoned: this worker stalled past its heartbeat, and that end stands: its client was
# told, its failure callbacks ran; a success over it gave the job two results), and those that got dependents. A
# job this attempt finished already (the same call tried again after its reply was lost) is left as it is. A job
# "queued" whose started-registry entry is still this execution's was not requeued (RQ's requeues take the entry
# out with it): a stale copy saved over its status (``job.save()`` of the object ``enqueue`` returned) finishes.
_FINISH = """
local field, stamp, name, ended = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local worker, executions, kind, done_ttl = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local lost, held, finished, started, gone, members, bare, deleted = {}, {}, {}, {}, {}, {}, {}, {}
local count, working, j = 0, 0, 0
local function add(lists, key, ...)
  if not lists[key] then lists[key] = {} end
  local list = lists[key]
  for _, v in ipairs({...}) do list[#list + 1] = v end
end
-- Whether the job's latest result is this execution's: written by an earlier try of this call (its reply lost).
local function written(result, exec_id)
  local last = redis.pcall('XREVRANGE', result, '+', '-', 'COUNT', 1)
  if last.err or #last == 0 then return false end
  local fields = last[1][2]
  for k = 1, #fields, 2 do if fields[k] == 'execution_id' then return fields[k + 1] == exec_id end end
  return false
end
local function run_chunked(cmd, key, list)
  for i = 1, #list, 4000 do redis.call(cmd, key, unpack(list, i, math.min(i + 3999, #list))) end
end
for a = 9, #ARGV, 20 do
  local job, id, exec_id, dependents, result = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4]
  local ttl = tonumber(ARGV[a + 7])
  local now = redis.call('HMGET', job, field, 'status')
  local requeued = now[2] == 'queued' and not redis.call('ZSCORE', ARGV[a + 13], ARGV[a + 14])
  if now[1] and (now[1] ~= exec_id or requeued or now[2] == 'failed') then
    lost[#lost + 1] = j
  elseif not now[2] and redis.call('HEXISTS', worker, 'birth') == 1 and redis.call('EXISTS', job) == 0 then
    -- gone while Redis still holds this worker's registration (it lost no data: a heartbeat after a restart makes
    -- the hash again, without its birth): RQ's job.delete() as it finished, which stays
    deleted[#deleted + 1] = j
  elseif now[2] == 'finished' and written(result, exec_id) then
    -- ended by this call already: a try again after its reply was lost writes nothing twice (a status written
    -- "finished" by hand while the job ran is no such end: its result was never stored)
  elseif redis.call('EXISTS', dependents) == 1 then
    held[#held + 1] = j
  else
    if not now[2] and redis.call('EXISTS', job) == 0 then bare[#bare + 1] = j end
    redis.call('HSET', job, 'last_heartbeat', stamp, 'status', 'finished', 'ended_at', stamp)
    if now[2] == 'failed' then redis.call('ZREM', ARGV[a + 17], id) end
    if now[2] == 'canceled' then redis.call('ZREM', ARGV[a + 18], id) end
    if now[2] == 'scheduled' then redis.call('ZREM', ARGV[a + 19], id) end
    local entry = {'XADD', result, 'MAXLEN', '~', '10', '*', 'type', kind, 'worker_name', name,
      'return_value', ARGV[a + 5], 'execution_id', exec_id, 'execution_started_at', ARGV[a + 6],
      'execution_ended_at', ended}
    -- A result key of another type (set by hand since the start, which replaces such keys) is replaced too: its
    -- error stopped the script, the batch's ends half written.
    local added = redis.pcall(unpack(entry))
    if type(added) == 'table' and added.err then
      if not string.find(added.err, 'WRONGTYPE', 1, true) then return redis.error_reply(added.err) end
      redis.call('DEL', result)
      redis.call(unpack(entry))
    end
    if ttl == -1 then redis.call('PERSIST', result) else redis.call('EXPIRE', result, ttl) end
    local notify = ARGV[a + 16]
    -- pcall: a completion list the job names that holds another type fails its push alone, not the batch's ends
    if notify ~= '' and type(redis.pcall('RPUSH', notify, id)) == 'number' then
      redis.call('EXPIRE', notify, done_ttl)
    end
    add(finished, ARGV[a + 11], ARGV[a + 12], id)
    if ttl > 0 then
      redis.call('EXPIRE', job, ttl)
      if ARGV[a + 8] ~= '' then redis.call('EXPIRE', ARGV[a + 8], ttl) end
    end
    gone[#gone + 1] = ARGV[a + 9]
    add(started, ARGV[a + 13], ARGV[a + 14])
    redis.call('ZREM', ARGV[a + 10], exec_id)
    members[#members + 1] = ARGV[a + 14]
    count, working = count + 1, working + tonumber(ARGV[a + 15])
  end
  j = j + 1
end
for key, list in pairs(finished) do run_chunked('ZADD', key, list) end
for i = 1, #gone, 4000 do redis.call('DEL', unpack(gone, i, math.min(i + 3999, #gone))) end
for key, list in pairs(started) do run_chunked('ZREM', key, list) end
run_chunked('SREM', executions, members)
if count > 0 then
  redis.call('HINCRBY', worker, 'successful_job_count', count)
  redis.call('HINCRBYFLOAT', worker, 'total_working_time', string.format('%.17g', working))
end
return {lost, held, bare, deleted}
"""
_PER_JOB = 20


def register(connection: Redis) -> Any:
    """The script, loaded (called by its SHA from then on)."""
    return load_script(connection, _FINISH)


def finish_jobs(
    script: Any,
    connection: Redis,
    jobs: list[tuple[Job, Execution, str, int, str | None]],
    worker_name: str,
    worker_key: str,
    ended: datetime,
    done_ttl: int,
    owner_field: str,
) -> tuple[list[int], list[int], list[int]]:
    """End every job of ``jobs`` (job, its execution here, its return value as RQ stores it, its result TTL (not
    0), its completion list or None) as RQ's success path would, each only while ``execution`` still owns it and it
    has no dependents. Returns the jobs (by position) skipped because another attempt owns them, those skipped
    because they have dependents, and those deleted as they ended; the others' objects say finished."""
    if not jobs:
        return [], [], []
    score_now = current_timestamp()
    args: list[Any] = [
        owner_field, utcformat(ended), worker_name, repr(ended.timestamp()), worker_key,
        jobs[0][1].worker_executions_key, Result.Type.SUCCESSFUL.value, done_ttl,
    ]  # fmt: skip
    for job, execution, value, ttl, notify in jobs:
        args += [
            job.key, job.id, execution.id, job.dependents_key, result_key(job.id), value,
            repr(execution.created_at.timestamp()), ttl, job.dependencies_key if job._dependency_ids else "",
            execution.key, ExecutionRegistry.key_template.format(job.id),
            FinishedJobRegistry.key_template.format(job.origin), "+inf" if ttl == -1 else score_now + ttl,
            StartedJobRegistry.key_template.format(job.origin), execution.composite_key,
            repr((ended - job.started_at).total_seconds()), done_key(notify) if notify else "",
            FailedJobRegistry.key_template.format(job.origin), CanceledJobRegistry.key_template.format(job.origin),
            ScheduledJobRegistry.key_template.format(job.origin),
        ]  # fmt: skip
    lost, held, bare, deleted = connection.evalsha(script.sha, 0, *args)
    lost, held, deleted = [int(i) for i in lost], [int(i) for i in held], [int(i) for i in deleted]
    skipped = set(lost) | set(held) | set(deleted)
    for i, (job, *_rest) in enumerate(jobs):
        if i not in skipped:
            job._status = JobStatus.FINISHED
    if bare:  # hashes Redis lost (a restart without persistence): the script's fields alone were a stub
        _save_whole(connection, [jobs[int(i)] for i in bare], ended, owner_field)
    return lost, held, deleted


def _save_whole(
    connection: Redis, ended_jobs: list[tuple[Job, Execution, str, int, str | None]], ended: datetime, owner_field: str
) -> None:
    """The whole hash of each of these finished jobs, from memory, where Redis had lost it: the script's three
    fields alone made a hash RQ cannot read (``Job.fetch``: "Unexpected job format"; rq-dashboard failed on it)."""
    with connection.pipeline() as pipe:
        for job, execution, _value, ttl, _notify in ended_jobs:
            job.ended_at, job.last_heartbeat = ended, ended
            job.save(pipeline=pipe)
            pipe.hset(job.key, owner_field, execution.id)
            if ttl > 0:
                pipe.expire(job.key, ttl)
        pipe.execute()
