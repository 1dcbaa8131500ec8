"""``quantization="int8"``, alone and with ``int8_output_layer``, against the float model it comes from, on the
standard workload (the 64 chat prompts of ``roseinfer/data/prompts64.json``, 64 new tokens each, greedy, EOS
ignored): tokens/s in interleaved runs, and what the int8 layers cost in accuracy beside what bfloat16 costs.
Accuracy is read against the float32 model:

- greedy outputs token-identical to float32's, and the median token where they first differ;
- the float32 model's mean log-probability of each system's outputs (teacher-forced, ``prompt_logprobs``): how
  likely the reference finds the text each made (greedy text is not the likeliest text: its own can be beaten).

    python3 benchmarks/int8_cpu.py [--dtype bfloat16] [--pairs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = Path(__file__).resolve().parents[1] / "roseinfer" / "data" / "prompts64.json"


def timed(llm, messages, params) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.chat(messages, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, [o.outputs[0].token_ids for o in outs]


def agreement(ref: list[list[int]], other: list[list[int]]) -> tuple[int, float]:
    """(outputs identical to ``ref``, median index of the first token that differs; the length where none does)."""
    firsts = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r)) for r, o in zip(ref, other)]
    return sum(f == len(r) for f, r in zip(firsts, ref)), statistics.median(firsts)


def mean_logprob(reference, prompt_ids: list[list[int]], outputs: list[list[int]]) -> float:
    """The reference model's mean log-probability of the output tokens, each read after the prompt and the
    outputs' tokens before it."""
    from roseinfer import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": p + o} for p, o in zip(prompt_ids, outputs)]
    total, count = 0.0, 0
    for out, p, o in zip(reference.generate(prompts, params, use_tqdm=False), prompt_ids, outputs):
        ids = p + o
        for pos in range(len(p), len(ids)):
            total += out.prompt_logprobs[pos][ids[pos]]
            count += 1
    return total / count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="the float model's")
    p.add_argument("--pairs", type=int, default=3, help="interleaved runs of each")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()

    import torch

    from roseinfer import LLM, SamplingParams
    from roseinfer.cpu_features import describe

    print(f"cpu: {describe()}; torch threads: {torch.get_num_threads()}")
    messages = [[{"role": "user", "content": text}] for text in json.loads(PROMPTS.read_text())]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    systems = {
        args.dtype: LLM(dtype=args.dtype),
        f"{args.dtype} + int8": LLM(dtype=args.dtype, quantization="int8"),
        "+ int8 output layer": LLM(dtype=args.dtype, quantization="int8", int8_output_layer=True),
    }
    reference = systems.get("float32") or LLM(dtype="float32")
    for llm in systems.values():
        llm.chat(messages[:4], params, use_tqdm=False)  # warm
    rates: dict[str, list[float]] = {name: [] for name in systems}
    outputs: dict[str, list[list[int]]] = {}
    for pair in range(args.pairs):
        for name, llm in systems.items():
            llm.engine.kv.reset_prefix_cache()  # each run starts cold
            rate, outputs[name] = timed(llm, messages, params)
            rates[name].append(rate)
            print(f"pair {pair + 1}/{args.pairs}: {name}: {rate:,.1f} tok/s", flush=True)
    if "float32" not in outputs:
        outputs["float32"] = timed(reference, messages, params)[1]
    prompt_ids = [reference.engine.tokenize({"messages": m})[1] for m in messages]
    print(f"\n{'system':<22} {'tok/s (median)':>15} {'identical to fp32':>18} {'first diff (median)':>20} "
          f"{'fp32 mean logprob':>18}")  # fmt: skip
    for name in dict.fromkeys([*systems, "float32"]):
        rate = f"{statistics.median(rates[name]):,.1f}" if name in rates else "-"
        same, first = agreement(outputs["float32"], outputs[name])
        score = mean_logprob(reference, prompt_ids, outputs[name])
        print(f"{name:<22} {rate:>15} {f'{same}/{len(messages)}':>18} {first:>20} {score:>18.3f}")
    base, alone, whole = (statistics.median(rates[name]) for name in systems)
    print(f"\nint8: {alone / base:.2f}x the {args.dtype} model's tokens/s; with its output layer: {whole / base:.2f}x")


if __name__ == "__main__":
    main()
