"""Many jobs' RQ bookkeeping in one script call.

Each job's commands are written onto a redis-py pipeline that is never executed (by RQ's own methods, as
``Execution.create`` for the jobs a pull starts, or by the worker's writes of what RQ's success path leaves); one
EVALSHA then runs them all, in order, each job's only while the attempt that wrote them still owns the job. What
goes is redis-py's cost per queued command (packing each one, parsing each reply: ~9 us a command, 14 commands a
finished job), and the WATCH/MULTI round trips of the fencing check.
"""

from __future__ import annotations

from typing import Any

from redis import Redis
from redis.client import Pipeline

# KEYS: each job's hash. ARGV: the owner field, then per job: the attempt that must own it ('': no check), the
# number of its commands, then per command the number of its arguments and the arguments. A job hash that is gone
# does not fence (Redis may have lost its data); one requeued or owned by another attempt does. Returns the
# (0-based) jobs whose commands were skipped.
_RUN = """
local field, a, lost = ARGV[1], 2, {}
for j = 1, #KEYS do
  local owner, n = ARGV[a], tonumber(ARGV[a + 1])
  a = a + 2
  local mine = true
  if owner ~= '' then
    local held = redis.call('HMGET', KEYS[j], field, 'status')
    mine = not held[1] or (held[1] == owner and held[2] ~= 'queued')
  end
  for _ = 1, n do
    local len = tonumber(ARGV[a])
    if mine then redis.call(unpack(ARGV, a + 1, a + len)) end
    a = a + 1 + len
  end
  if not mine then lost[#lost + 1] = j - 1 end
end
return lost
"""


class CommandBatch:
    """Collects jobs' commands (``job`` gives the pipeline to write one job's on) and runs them in one call."""

    def __init__(self, connection: Redis, owner_field: str, script: Any | None) -> None:
        self._pipe = connection.pipeline(transaction=True)
        self._owner_field = owner_field
        self._script = script  # the registered _RUN script; None where Redis runs no Lua (the embedded fakeredis)
        self._keys: list[str] = []
        self._args: list[Any] = []
        self._started: list[tuple[int, int]] = []  # per job: where its commands start in the stack, its owner slot

    @staticmethod
    def register(connection: Redis):
        """The script, loaded (called by its SHA from then on)."""
        script = connection.register_script(_RUN)
        connection.script_load(_RUN)
        return script

    def job(self, key: str, owner: str = "") -> Pipeline:
        """The pipeline to write the next job's commands on; they run only while ``owner`` owns it ('': always)."""
        self._close_job()
        self._keys.append(key)
        self._started.append((len(self._pipe.command_stack), len(self._args)))
        self._args += [owner, 0]
        return self._pipe

    def _close_job(self) -> None:
        if not self._started:
            return
        start, slot = self._started[-1]
        commands = self._pipe.command_stack[start:]
        self._args[slot + 1] = len(commands)
        for args, _options in commands:
            if isinstance(args[0], str) and " " in args[0]:  # a two-word command name
                args = (*args[0].split(), *args[1:])
            self._args.append(len(args))
            self._args += args

    def run(self) -> list[int]:
        """Run every job's commands; the jobs (by position) skipped because another attempt owns them. Without
        Lua the commands run as one MULTI transaction, unchecked (the caller fences them)."""
        self._close_job()
        if not self._keys:
            return []
        if self._script is None:
            self._pipe.execute()
            return []
        self._pipe.reset()
        keys, args = self._keys, [self._owner_field, *self._args]
        lost = self._script(keys=keys, args=args)
        return [int(i) for i in lost]
