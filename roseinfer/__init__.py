"""roseinfer: continuous batching on a paged KV cache, and a Redis job-queue worker around it."""

import os

# SciPy (pulled in by model loading) starts OpenBLAS threads that spin on the cores the engine needs;
# torch itself uses MKL/oneDNN, never OpenBLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from roseinfer.config import DEFAULT_MODEL, EngineConfig
from roseinfer.outputs import CompletionOutput, RequestOutput
from roseinfer.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "DEFAULT_MODEL",
    "LLM",
    "CompletionOutput",
    "ContextLengthExceeded",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]


def __getattr__(name: str):
    # The engine pulls in torch and transformers: loaded only when asked for.
    if name == "LLM":
        from roseinfer.llm import LLM

        return LLM
    if name in ("LLMEngine", "ContextLengthExceeded"):
        from roseinfer import llm_engine

        return getattr(llm_engine, name)
    raise AttributeError(name)
