"""What smaller oneDNN caches cost a CPU worker's decode steps (they save memory: ``benchmarks/worker_soak.py``).

A dense layer's GEMM on CPU (``roseinfer.models.linear``) is a oneDNN primitive built for its exact shape, the batch's
token count included. Two caches keep the built ones: oneDNN's (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's
(``LRU_CACHE_CAPACITY``), 1,024 entries each by default, and what they hold is most of a long-running worker's growth
in memory. Smaller, they hold fewer shapes: a step whose shapes were dropped builds them again. Here SmolLM2-135M's
dense layers (30 blocks and the head, random weights) run decode steps at batch sizes 1 .. 64 in turn, each size
seen before, for each capacity in a process of its own (they are read at the first GEMM), the runs interleaved; the
sum of the median step times is printed. Too small a cache (5 shapes a batch size) makes every step here build its
five GEMMs again: the worst case, where a worker's batch changes size at every step. With ``--generate``, the
default model instead generates for its 64 shipped prompts, 8 to 96 tokens each (a seeded draw, EOS ignored), three
times in one process; the tokens/s of the second and third runs are printed, whose batch sizes the first run met.

    python3 benchmarks/onednn_cache.py --capacities default,256,128,64
    python3 benchmarks/onednn_cache.py --capacities default,128 --generate
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
HIDDEN, INTER, KV, VOCAB, BLOCKS = 576, 1536, 192, 49152, 30  # SmolLM2-135M


def measure(repeats: int) -> dict[str, float]:
    """In this process (its capacities already in the environment): the steps."""
    import torch

    from roseinfer.models.linear import Linear

    sizes = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    blocks = [[Linear(torch.randn(n, k) * 0.02) for n, k in sizes] for _ in range(BLOCKS)]
    head = Linear(torch.randn(VOCAB, HIDDEN) * 0.02)

    def step(batch: int) -> None:
        x = torch.randn(batch, HIDDEN)
        for qkv, o, gate_up, down in blocks:
            qkv(x)
            o(x)
            down(gate_up(x)[:, :INTER].contiguous())
        head(x)

    batches = range(1, 65)
    for b in batches:
        step(b)
    times: dict[int, list[float]] = {b: [] for b in batches}
    for _ in range(repeats):
        for b in batches:
            t = time.perf_counter()
            step(b)
            times[b].append(time.perf_counter() - t)
    steps_ms = sum(statistics.median(v) for v in times.values()) * 1e3
    return {"steps_ms": steps_ms}


def generate() -> dict[str, float]:
    """The default model's generation again and again: its batch shrinks as prompts end, a size each step."""
    import random

    from roseinfer.llm import LLM
    from roseinfer.sampling_params import SamplingParams

    prompts = json.loads((ROOT / "roseinfer" / "data" / "prompts64.json").read_text())
    draw = random.Random(0)
    params = [SamplingParams(temperature=0, max_tokens=draw.randint(8, 96), ignore_eos=True) for _ in prompts]
    llm, tokens, rates = LLM(), sum(p.max_tokens for p in params), []
    for _ in range(3):
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(tokens / (time.perf_counter() - t))
    return {"tok_s": statistics.mean(rates[1:])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--capacities", default="default,256,128,64", help="comma-separated ('default': unset)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved runs of each capacity")
    p.add_argument("--repeats", type=int, default=3, help="passes over the batch sizes in a run")
    p.add_argument("--generate", action="store_true", help="time the default model's generation instead")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(generate() if args.generate else measure(args.repeats)))
        return 0
    from roseinfer.cpu_features import describe

    print(f"cpu: {describe()}")
    capacities = args.capacities.split(",")
    runs: dict[str, list[dict]] = {c: [] for c in capacities}
    for _ in range(args.rounds):
        for cap in capacities:
            env = {
                k: v
                for k, v in os.environ.items()
                if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
            }
            if cap != "default":
                env.update(ONEDNN_PRIMITIVE_CACHE_CAPACITY=cap, LRU_CACHE_CAPACITY=cap)
            cmd = [sys.executable, __file__, "--child", "--repeats", str(args.repeats)] + ["--generate"] * args.generate
            out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=True).stdout
            runs[cap].append(json.loads(out.strip().splitlines()[-1]))
    key, what = ("tok_s", "tokens/s of runs 2 and 3") if args.generate else ("steps_ms", "64 decode steps, ms")
    print(f"{'capacity':>9} | {what}: median of the runs (each run)")
    for cap, results in runs.items():
        each = ", ".join(f"{r[key]:.0f}" for r in results)
        print(f"{cap:>9} | {statistics.median(r[key] for r in results):.0f} ({each})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
