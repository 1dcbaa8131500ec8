"""Long requests of a model whose every layer slides, in a KV pool too small to hold them whole: the blocks out of
the window freed as requests go on (the engine's way) against kept to the end, in interleaved pairs. A random
Mistral-shaped model (4 layers, hidden 256, window 128, float32), 8 requests of 64 prompt + 448 new tokens (EOS
ignored) in a pool of 96 blocks of 16 (1,536 tokens, of the 4,096 the requests reach); it prints each run's peak
blocks, preemptions and tokens/s, and the medians.

    python3 benchmarks/sliding_window.py [--pairs 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCK, BLOCKS, LAYERS, KV_HEADS, HEAD_DIM = 16, 96, 4, 2, 32


def build(path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, MistralConfig

    cfg = MistralConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS, num_attention_heads=8,
        num_key_value_heads=KV_HEADS, max_position_embeddings=4096, sliding_window=128, eos_token_id=None,
        bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)


def run(path: str, free: bool) -> tuple[int, int, float]:
    """(peak blocks in use, preemptions, tokens/s) of one run."""
    from roseinfer import LLM, SamplingParams

    block_bytes = 2 * LAYERS * BLOCK * KV_HEADS * HEAD_DIM * 4
    llm = LLM(path, dtype="float32", block_size=BLOCK, kv_cache_memory=str(BLOCKS * block_bytes), max_model_len=1536)
    engine = llm.engine
    if not free:
        engine.kv.sliding_window = 0  # every block kept to the request's end
    params = SamplingParams(max_tokens=448, temperature=0.0, ignore_eos=True)
    for i in range(8):
        engine.add_request(str(i), {"prompt_token_ids": list(range(10 + i, 74 + i))}, params)
    peak, tokens, start = 0, 0, time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
        peak = max(peak, engine.kv.num_used_blocks)
    return peak, engine.scheduler.num_preemptions, tokens / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=2, help="interleaved runs of each")
    args = p.parse_args()
    rates: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        build(tmp)
        for i in range(args.pairs):
            for free in (True, False):
                peak, preempted, rate = run(tmp, free)
                rates[free].append(rate)
                name = "freed out of the window" if free else "kept whole"
                print(f"pair {i + 1}: {name}: peak {peak} of {BLOCKS} blocks, {preempted} preempted, {rate:.0f} tok/s")
    print(f"median tok/s: freed {statistics.median(rates[True]):.0f}, kept whole {statistics.median(rates[False]):.0f}")


if __name__ == "__main__":
    main()
