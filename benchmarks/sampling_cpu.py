"""Sampled workloads on CPU, the C sampling kernel against PyTorch's ops, in one process: the standard 64 chat
prompts, N new tokens each (EOS ignored), greedy and five sampled settings, in interleaved pairs (the kernel off,
then on), tokens/s of each run and a Markdown table of them. ``--sampler-only``: the sampler alone, ms a step of 64
rows of random bfloat16 logits (49,152 wide), the same settings and one of 8k-token prompts with a repetition
penalty.

    python3 benchmarks/sampling_cpu.py [--dtype bfloat16] [--max-tokens 48] [--pairs 2] [--sampler-only]
"""

from __future__ import annotations

import argparse
import json
import time

WORKLOADS = {
    "greedy": {"temperature": 0},
    "temperature 0.7": {"temperature": 0.7},
    "temperature 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature 1.0, top_k 50": {"temperature": 1.0, "top_k": 50},
    "temperature 0.7, top_p 0.9, repetition_penalty 1.1": {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1},
    "temperature 0.7, logprobs 5": {"temperature": 0.7, "logprobs": 5},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--sampler-only", action="store_true", help="time the sampler alone, on random logits")
    args = p.parse_args()
    if args.sampler_only:
        sampler_alone(args.pairs)
        return

    import torch

    import roseinfer.sampler as sampler_module
    from roseinfer import LLM, SamplingParams
    from roseinfer.bench import DEFAULT_WORKLOAD
    from roseinfer.cpu_features import describe

    print(f"cpu: {describe()}; torch threads: {torch.get_num_threads()}")
    llm = LLM(dtype=args.dtype)
    convs = [[{"role": "user", "content": t}] for t in json.loads(DEFAULT_WORKLOAD.read_text())]
    llm.chat(convs[:4], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    kernel = sampler_module.can_sample_rows
    rates: dict[tuple[str, str], list[float]] = {}
    for pair in range(args.pairs):
        for system in ("PyTorch ops", "C kernel"):
            sampler_module.can_sample_rows = kernel if system == "C kernel" else (lambda logits: False)
            for name, options in WORKLOADS.items():
                llm.engine.kv.reset_prefix_cache()
                params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, **options)
                start = time.perf_counter()
                outs = llm.chat(convs, params, use_tqdm=False)
                rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
                rates.setdefault((system, name), []).append(rate)
                print(f"pair {pair + 1}, {system}, {name}: {rate:.1f} tok/s", flush=True)
    sampler_module.can_sample_rows = kernel
    print("\n| sampler | " + " | ".join(WORKLOADS) + " |")
    print("|---" * (len(WORKLOADS) + 1) + "|")
    for system in ("PyTorch ops", "C kernel"):
        cells = [", ".join(f"{r:,.0f}" for r in rates[(system, name)]) for name in WORKLOADS]
        print(f"| {system} | " + " | ".join(cells) + " |")


def sampler_alone(pairs: int) -> None:
    import torch

    import roseinfer.sampler as sampler_module
    from roseinfer.sampler import Sampler
    from roseinfer.sampling_params import SamplingParams
    from roseinfer.sequence import Sequence

    logits = torch.randn(64, 49152, generator=torch.Generator().manual_seed(0)).bfloat16() * 3
    loads = {name: ([1, 2, 3], options) for name, options in WORKLOADS.items()}
    loads["8k-token prompts, repetition_penalty 1.1"] = (
        list(range(8000)),
        {"temperature": 0.7, "repetition_penalty": 1.1},
    )
    kernel = sampler_module.can_sample_rows
    for pair in range(pairs):
        for system in ("PyTorch ops", "C kernel"):
            sampler_module.can_sample_rows = kernel if system == "C kernel" else (lambda logits: False)
            for name, (prompt, options) in loads.items():
                seqs = []
                for _ in range(64):
                    seq = Sequence("r", prompt, SamplingParams(**options), None, None)
                    seq.token_ids += list(range(100))  # 100 tokens of output
                    seqs.append(seq)
                sampler = Sampler([0], 0, torch.device("cpu"))
                sampler(logits, seqs)  # warm-up
                start = time.perf_counter()
                for _ in range(5):
                    sampler(logits, seqs)
                print(f"pair {pair + 1}, {system}, {name}: {(time.perf_counter() - start) / 5 * 1e3:.1f} ms a step")
    sampler_module.can_sample_rows = kernel


if __name__ == "__main__":
    main()
