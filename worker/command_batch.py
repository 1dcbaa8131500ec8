"""Many jobs' RQ bookkeeping in one script call.

Each job's commands are written onto a redis-py pipeline that is never executed (by RQ's own methods, as
``Execution.create`` for the jobs a pull starts, or by the worker's writes of what RQ's success path leaves); one
EVALSHA then runs them all, in order, each job's only while the attempt that wrote them still owns the job. What
goes is redis-py's cost per queued command (packing each one, parsing each reply: ~9 us a command, 14 commands a
finished job), and the WATCH/MULTI round trips of the fencing check.

Commands on keys the caller declares shared (``merge``: a registry, the worker's hash) become one command for the
whole batch, run after every job's own: each job that runs adds its members (ZADD, SADD, ZREM, SREM) or its
amount (HINCRBY, HINCRBYFLOAT), an EXPIRE many jobs repeat runs once, and their DELs of one key each can be one.
Redis counts every command a script runs, so 64 jobs adding themselves to one registry cost one command, not 64.
"""

from __future__ import annotations

from typing import Any

from redis import Redis
from redis.client import Pipeline

# KEYS: each job's hash. ARGV: the owner field, the number of merged commands, then per merged command its mode
# ('+': the jobs' amounts summed into its last argument; '': their arguments appended), the number of its fixed
# arguments and those; then per job: the attempt that must own it ('': no check), a key that must not exist for
# its commands to run ('': none), the number of its commands and of its parts in merged commands, then per command
# the number of its arguments and the arguments, then per part the merged command's number, the number of
# arguments and the arguments. A job hash that is gone does not fence (Redis may have lost its data); one requeued
# or owned by another attempt does. Returns two lists of (0-based) jobs whose commands were skipped: those owned
# elsewhere, and those whose key that must not exist did.
_RUN = """
local field, a, lost, held = ARGV[1], 3, {}, {}
local merged = {}
for m = 1, tonumber(ARGV[2]) do
  local len = tonumber(ARGV[a + 1])
  merged[m] = {mode = ARGV[a], fixed = {unpack(ARGV, a + 2, a + 1 + len)}, sum = 0, args = {}, used = false}
  a = a + 2 + len
end
local function flush(m)
  local cmd = {unpack(m.fixed)}
  if m.mode == '+' then cmd[#cmd + 1] = string.format('%.17g', m.sum) end
  for _, v in ipairs(m.args) do cmd[#cmd + 1] = v end
  redis.call(unpack(cmd))
  m.args, m.sum = {}, 0
end
for j = 1, #KEYS do
  local owner, absent, n, parts = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  a = a + 4
  local mine, free = true, true
  if owner ~= '' then
    local job = redis.call('HMGET', KEYS[j], field, 'status')
    mine = not job[1] or (job[1] == owner and job[2] ~= 'queued')
  end
  if mine and absent ~= '' then free = redis.call('EXISTS', absent) == 0 end
  local run = mine and free
  for _ = 1, n do
    local len = tonumber(ARGV[a])
    if run then redis.call(unpack(ARGV, a + 1, a + len)) end
    a = a + 1 + len
  end
  for _ = 1, parts do
    local m, len = merged[tonumber(ARGV[a])], tonumber(ARGV[a + 1])
    if run then
      m.used = true
      if m.mode == '+' then m.sum = m.sum + tonumber(ARGV[a + 2]) end
      if m.mode ~= '+' then for k = a + 2, a + 1 + len do m.args[#m.args + 1] = ARGV[k] end end
      if #m.args > 4000 then flush(m) end  -- unpack's limit on a command's arguments
    end
    a = a + 2 + len
  end
  if not mine then lost[#lost + 1] = j - 1 elseif not free then held[#held + 1] = j - 1 end
end
for _, m in ipairs(merged) do
  if m.used then flush(m) end
end
return {lost, held}
"""

# How the commands on a shared key merge: their members appended, their amounts summed, or run once.
_MERGES = {
    "ZADD": "members", "SADD": "members", "SREM": "members", "ZREM": "members",
    "HINCRBY": "sum", "HINCRBYFLOAT": "sum", "EXPIRE": "once",
}  # fmt: skip


class CommandBatch:
    """Collects jobs' commands (``job`` gives the pipeline to write one job's on) and runs them in one call."""

    def __init__(self, connection: Redis, owner_field: str, script: Any | None, merge: tuple[str, ...] = ()) -> None:
        self._pipe = connection.pipeline(transaction=True)
        self._owner_field = owner_field
        self._script = script  # the registered _RUN script; None where Redis runs no Lua (the embedded fakeredis)
        self._merge = set(merge)  # the keys whose commands become one per batch ("DEL": every one-key DEL)
        self._merged: dict[tuple, int] = {}  # (mode, fixed arguments) -> its number (from 1)
        self._keys: list[str] = []
        self._args: list[Any] = []
        self._started: list[tuple[int, int]] = []  # per job: where its commands start in the stack, its owner slot

    @staticmethod
    def register(connection: Redis):
        """The script, loaded (called by its SHA from then on)."""
        script = connection.register_script(_RUN)
        connection.script_load(_RUN)
        return script

    def job(self, key: str, owner: str = "", absent: str = "") -> Pipeline:
        """The pipeline to write the next job's commands on; they run only while ``owner`` owns it ('': always)
        and ``absent`` does not exist ('': no such key)."""
        self._close_job()
        self._keys.append(key)
        self._started.append((len(self._pipe.command_stack), len(self._args)))
        self._args += [owner, absent, 0, 0]
        return self._pipe

    def _split(self, args: tuple) -> tuple[tuple, tuple[str, tuple]] | None:
        """(fixed arguments, (mode, this job's part)) of a command on a shared key; None for any other."""
        name = str(args[0]).upper()
        if name == "DEL" and "DEL" in self._merge and len(args) == 2:  # keys the caller deletes, one DEL for all
            return ("DEL",), ("", args[1:])
        merges = _MERGES.get(name)
        if merges is None or len(args) < 2 or args[1] not in self._merge:
            return None
        if merges == "once":
            return args, ("", ())
        if merges == "sum":  # the amount is last
            return args[:-1], ("+", args[-1:])
        if name == "ZADD" and len(args) != 4:  # flags (XX, NX, GT...) or several members: left as it is
            return None
        return args[:2], ("", args[2:])  # the members after the key

    def _close_job(self) -> None:
        if not self._started:
            return
        start, slot = self._started[-1]
        commands = self._pipe.command_stack[start:]
        own, parts = [], []
        for args, _options in commands:
            if isinstance(args[0], str) and " " in args[0]:  # a two-word command name
                args = (*args[0].split(), *args[1:])
            split = self._split(args)
            if split is None:
                own.append(args)
                continue
            fixed, (mode, part) = split
            number = self._merged.setdefault((mode, fixed), len(self._merged) + 1)
            parts.append((number, part))
        self._args[slot + 2], self._args[slot + 3] = len(own), len(parts)
        for args in own:
            self._args.append(len(args))
            self._args += args
        for number, part in parts:
            self._args += [number, len(part), *part]

    def run(self) -> tuple[list[int], list[int]]:
        """Run every job's commands; the jobs (by position) skipped because another attempt owns them, and those
        skipped because their ``absent`` key exists. Without Lua the commands run as one MULTI transaction,
        unchecked and unmerged (the caller fences them)."""
        self._close_job()
        if not self._keys:
            return [], []
        if self._script is None:
            self._pipe.execute()
            return [], []
        self._pipe.reset()
        header: list[Any] = [self._owner_field, len(self._merged)]
        for mode, fixed in self._merged:
            header += [mode, len(fixed), *fixed]
        lost, held = self._script(keys=self._keys, args=header + self._args)
        return [int(i) for i in lost], [int(i) for i in held]
