"""Where a decode step's time goes: ``roseinfer bench --profile``.

For a few decode steps of a full batch, the engine's own calls are timed at their borders (the ops run synchronously
on a CPU): the dense layers (every ``Linear`` but the output layer), the output layer, attention, the elementwise
kernels (norms, RoPE, SiLU), sampling; what is left of the step's wall time is Python and scheduling. The timers
cost about a microsecond a call, a few hundred calls a step.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any

PARTS = ("dense layers", "output layer", "attention", "elementwise", "sampling", "python and scheduling")


@contextmanager
def _timed(totals: dict[str, float], owner: Any, name: str, part: Any) -> Any:
    """Replace ``owner.name`` with a wrapper adding its time to ``totals[part]`` (``part`` may be a function of
    the call's first argument, to split one function between parts); put it back after."""
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[part(args[0]) if callable(part) else part] += time.perf_counter() - start

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def profile_decode(engine: Any, prompts: list[Any], params: Any, steps: int = 16) -> dict[str, Any]:
    """Time ``steps`` decode steps of ``prompts`` all running (their prefills done first, untimed); ms per step by
    part, the dense layers' share of the step, and the step's cost as a multiple of its dense layers."""
    from roseinfer.models import linear as linear_mod

    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{i}", prompt, params)
    while engine.scheduler.num_waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running()):
        engine.step()  # prefills, untimed
    totals: dict[str, float] = defaultdict(float)
    lm_head = engine.model.lm_head
    model_module = __import__(type(engine.model).__module__, fromlist=["_"])
    elementwise = [n for n in ("add_rms_norm", "rope_", "silu_mul") if hasattr(model_module, n)]
    timers = [
        _timed(
            totals, linear_mod.Linear, "__call__", lambda layer: "output layer" if layer is lm_head else "dense layers"
        ),
        _timed(totals, engine.attn_backend, "forward", "attention"),
        _timed(totals, engine.runner.sampler, "start", "sampling"),  # on CPU it samples before returning
        *[_timed(totals, model_module, name, "elementwise") for name in elementwise],
    ]
    batch = engine.scheduler.num_running
    wall = 0.0
    done = 0
    for timer in timers:
        timer.__enter__()
    try:
        for _ in range(steps):
            if not engine.has_unfinished_requests():
                break
            start = time.perf_counter()
            engine.step()
            wall += time.perf_counter() - start
            done += 1
    finally:
        for timer in reversed(timers):
            timer.__exit__(None, None, None)
    for i in range(len(prompts)):
        engine.abort_request(f"profile-{i}")
    if not done:
        raise ValueError("no decode step to profile: give the prompts more max_tokens")
    totals["python and scheduling"] = max(0.0, wall - sum(totals.values()))
    per_step = {part: round(1e3 * totals[part] / done, 2) for part in PARTS}
    dense = totals["dense layers"] + totals["output layer"]
    return {
        "batch": batch,
        "steps": done,
        "step_ms": round(1e3 * wall / done, 2),
        "ms_per_step": per_step,
        "dense_share": round(dense / wall, 3),
        # Over the matrix products, the output layer's too (the figure README's tables call "step / dense"); and
        # over the dense layers alone, the output layer left out.
        "step_over_dense": round(wall / dense, 2) if dense else None,
        "step_over_dense_layers": round(wall / totals["dense layers"], 2) if totals["dense layers"] else None,
    }
