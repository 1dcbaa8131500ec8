"""The online engine: requests come in at any time, ``step()`` advances every running one by a token."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import gc
import logging
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from roseinfer.attention import select_attention_backend
from roseinfer.block_manager import KVCacheManager
from roseinfer.checkpoint import CheckpointError
from roseinfer.config import ConfigError, EngineConfig, check_engine_env
from roseinfer.cpu_allocator import keep_freed_memory, release_freed_memory, reserve_heap
from roseinfer.detokenizer import IncrementalDetokenizer
from roseinfer.model_loader import DTYPES, load_model
from roseinfer.model_runner import ModelRunner
from roseinfer.models import build_model, kv_window, model_class
from roseinfer.models.linear import float32_for_bfloat16, int8_gemm_speedup
from roseinfer.outputs import AbortCause, CompletionOutput, RequestMetrics, RequestOutput
from roseinfer.prompts import ContextLengthExceeded, PromptInput, PromptInputs
from roseinfer.quantization import calibration_prompts, dense_layers, input_maxima, quantize
from roseinfer.sampler import Sampler, advance_generator, seeded_generator
from roseinfer.sampling_params import SamplingParams, StructuredOutputsParams
from roseinfer.scheduler import Scheduler, SchedulerOutput
from roseinfer.sequence import Sequence
from roseinfer.structured_output import StructuredOutputManager

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_steps: int = 0
    num_generated_tokens: int = 0
    # Each request's prompt once (not a sample's of n each), prefix-cache hits included, as vLLM's prompt_tokens;
    # of those, the ones its admission found in the prefix cache.
    num_prompt_tokens_computed: int = 0
    num_prompt_tokens_cached: int = 0
    num_prefill_tokens: int = 0  # prompt tokens computed (not found in the prefix cache), recomputes included


GC_YOUNG_THRESHOLD = 10_000  # allocations between two collections of the youngest generation


def check_device(device: torch.device) -> None:
    """ConfigError for a CUDA device this machine lacks (torch's own error was a traceback)."""
    if device.type == "cuda":
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= found:
            raise ConfigError(f"device {device}: this machine has {found} CUDA device(s) torch can use")


def free_memory(device: torch.device) -> int | None:
    """Bytes the device has free for a new allocation: a GPU's free memory, a CPU's MemAvailable (None where it
    cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return kib * 1024


class LLMEngine(PromptInputs):
    def __init__(self, config: EngineConfig) -> None:
        check_engine_env()
        self.config = config
        self.device = torch.device(config.device)
        self._cuda_index = self.device.index if self.device.type == "cuda" else None
        check_device(self.device)  # (before the load: torch's own error was a traceback, or came after it)
        if self._cuda_index is not None:
            # Triton launches, graph capture and CUDA events use the current device, not the tensors'.
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu":  # before the weights are allocated
            keep_freed_memory()  # a step's large tensors reuse the heap instead of faulting pages in again
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        dtype = DTYPES[config.dtype]
        loaded = load_model(config.model, config.dtype, config.device, config.tokenizer, config.chat_template)
        self.tokenizer = loaded.tokenizer
        self.model_path = loaded.path
        self.eos_token_ids = loaded.eos_token_ids
        # The tokenizer's own EOS (vLLM's model EOS): the one whose stop names no stop_reason.
        self.primary_eos = getattr(loaded.tokenizer, "eos_token_id", None)
        if self.primary_eos is None and self.eos_token_ids:  # (no tokenizer: the config's first)
            self.primary_eos = self.eos_token_ids[0]
        self.sampling_defaults = loaded.sampling_defaults  # the model's recommendation (``model_loader``)
        # Chosen once: the backend lays out the KV caches, builds each step's metadata and runs the attention.
        self.attn_backend = select_attention_backend(config.block_size, dtype, self.device)
        limit = model_class(loaded.config).context_length(loaded.config)
        if config.max_model_len is not None and config.max_model_len > limit:  # (before the weights: minutes on a GPU)
            raise ConfigError(
                f"max_model_len {config.max_model_len} is past this model's context, {limit} tokens (its "
                "max_position_embeddings, or YaRN's length where it has one): leave it unset for the model's, or give "
                "at most that"
            )
        in_float32 = float32_for_bfloat16()
        try:
            self.model = build_model(loaded.config, loaded.weights, self.attn_backend, config.max_model_len)
        except CheckpointError as exc:
            raise ConfigError(f"cannot load model {config.model!r}: {exc}") from None
        del loaded  # the checkpoint's files, and any tensor only it held
        # What a seeded output's last bits depend on beside the model and dtype: its bfloat16 layers' GEMM.
        self.numerics = "f32gemm" if float32_for_bfloat16() > in_float32 else ""

        block_bytes = self.attn_backend.kv_cache_bytes_per_block(
            self.model.num_layers, self.model.num_kv_heads, self.model.head_dim
        )
        self.max_model_len = config.max_model_len or self.model.max_position_embeddings
        budget = self._kv_budget()
        num_blocks = budget // block_bytes
        if num_blocks * config.block_size < 2:  # (ConfigError: the commands print it as a bad option)
            # (one token holds a prompt of none: an engine that refused every request, as max_model_len 1 is refused)
            raise ConfigError(
                f"kv_cache_memory: {budget} bytes hold {num_blocks * config.block_size} token(s) of KV cache, and a "
                f"request needs 2 at least; one block ({config.block_size} tokens of this model) takes {block_bytes} "
                "bytes"
            )
        if config.kv_cache_memory == "auto":
            # No more than every running request at full length needs: a small model or context is not handed
            # (and made to zero) the whole default GiB, nor half a GPU (a tiny model's 75 GB were 37M blocks, each
            # a Python object: 15 s to build).
            num_blocks = min(num_blocks, config.max_num_seqs * -(-self.max_model_len // config.block_size))
        if num_blocks * config.block_size < self.max_model_len:
            log.warning(
                "KV cache holds %d tokens, fewer than the context length %d; requests are limited to it",
                num_blocks * config.block_size,
                self.max_model_len,
            )
            self.max_model_len = num_blocks * config.block_size
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, kv_window(self.model))
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.model.long_rope_from
        )
        sampler = Sampler(self.eos_token_ids, config.seed, self.device)
        self.runner = ModelRunner(
            self.model,
            self.attn_backend,
            num_blocks,
            self.device,
            sampler,
            cuda_graph_max_seqs=0 if config.enforce_eager else config.max_num_seqs,
            max_blocks_per_seq=-(-self.max_model_len // config.block_size),
        )
        self.structured = StructuredOutputManager(
            self.tokenizer, self.model.vocab_size, self.eos_token_ids, overlap=self.device.type == "cuda"
        )
        self.stats = EngineStats()
        self._groups: dict[str, list[Sequence]] = {}  # request id -> its samples, for requests with n > 1
        # Tokens sampled whose outputs are not made yet: (request, token, whether the token itself stopped it,
        # whether the request ended at it).
        self._pending: list[tuple[Sequence, int, bool, bool]] = []
        self.undelivered: list[RequestOutput] = []  # see ``take_undelivered``
        self._overlap = self.device.type == "cuda"  # outputs made while the device runs the next step
        self._flush = True  # whether this step's outputs include every "delta" request's (``step``)
        self._holding: dict[str, Sequence] = {}  # "delta" requests whose output a step without flush held back
        if config.quantization == "int8":
            self._quantize_int8()
        if self.device.type == "cpu":
            self._release_float_copies()
        if self.device.type == "cuda":
            self._warm_up()
        settle_garbage_collector()
        if self.device.type == "cpu":
            reserve_heap()  # at the heap's top, above the weights: room the first large steps need, faulted in now
        log.info(
            "engine ready: %s, %s on %s, %d KV blocks, %s attention",
            config.model,
            config.dtype,
            config.device,
            num_blocks,
            self.attn_backend.name,
        )

    def _warm_up(self) -> None:
        """Compile the GPU kernels of every step shape (long and short prefill chunks, prefill beside decodes)
        now, so the first requests do not wait for them; then forget the warm-up's requests entirely."""
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        n = max(1, min(40, self.max_model_len - 4))
        self.add_request("__warm-up-0", [0] * n, params)
        self.step()
        self.add_request("__warm-up-1", [1] * min(5, n), params)
        while self.has_unfinished_requests():
            self.step()
        self._forget_startup_requests()
        torch.cuda.synchronize(self.device)

    def _quantize_int8(self) -> None:
        """The dense layers to int8, their SmoothQuant factors from the inputs they see on the calibration texts
        (prefill and a few decode steps each)."""
        started = time.perf_counter()
        try:
            speedup = int8_gemm_speedup(DTYPES[self.config.dtype])
        except (RuntimeError, NotImplementedError) as exc:  # a build or CPU without an int8 GEMM
            raise ConfigError(f"quantization int8: this PyTorch cannot multiply int8 matrices here ({exc})") from None
        if speedup < 1.1:  # asked for, so done; but said: the engine is not faster here
            log.warning(
                "quantization int8: this CPU's int8 GEMM runs %.2fx the %s GEMM it replaces (no VNNI? AMX tiles "
                "for bfloat16?); int8 loses accuracy here and gains little or no speed",
                speedup,
                self.config.dtype,
            )
        layers = dense_layers(self.model, self.config.int8_output_layer)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        limit = max(1, self.max_model_len - params.max_tokens - 1)
        with input_maxima(layers) as maxima:
            for i, ids in enumerate(calibration_prompts(self)):
                self.add_request(f"__calibration-{i}", {"prompt_token_ids": ids[:limit]}, params)
            while self.has_unfinished_requests():
                self.step()
        quantize(layers, maxima)
        self._forget_startup_requests()  # their cached blocks were computed by the float layers
        log.info("%d dense layers multiply in int8 (calibrated in %.1f s)", len(layers), time.perf_counter() - started)

    def _release_float_copies(self) -> None:
        """The layers' weights where their packed copies run (or their int8 ones), and the memory they and the load
        freed, back to the system: glibc kept it in the heap (float32 default model: 1,971 MiB resident, now 1,693)."""
        for layer in dense_layers(self.model, with_output_layer=True):
            layer.drop_unpacked_weight()
        gc.collect()
        release_freed_memory()

    def _forget_startup_requests(self) -> None:
        """Forget the requests the engine ran for itself (warm-up, calibration): their blocks, counts and outputs."""
        self.kv.reset_prefix_cache()
        self.kv.prefix_query_tokens = self.kv.prefix_hit_tokens = 0
        self.scheduler.num_preemptions = 0
        self.stats = EngineStats()
        self.undelivered.clear()

    def _kv_budget(self) -> int:
        if self.config.kv_cache_memory != "auto":
            budget, free = int(self.config.kv_cache_memory), free_memory(self.device)
            if free is not None and budget > free:  # (the cache is zeroed whole: past the memory, the OOM killer)
                raise ConfigError(
                    f"kv_cache_memory: {budget / 2**30:.2f} GiB is more than the {free / 2**30:.2f} GiB free on "
                    f"{self.device.type} with the model loaded: give less, or auto"
                )
            return budget
        if self.device.type == "cuda":
            return free_memory(self.device) // 2
        return 1 << 30

    # ----- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        output_prefix: list[int] | None = None,
        priority: int = 0,
        prefix_logprobs: list[dict[int, float]] | None = None,
    ) -> None:
        """Queue a request. ``priority``: lower runs first (admitted first, and preempting a running request
        that comes later when there is no slot or KV block for it); equal priorities run in arrival order.
        ``output_prefix``: tokens an earlier attempt of it already generated (and streamed); they become the start
        of its output, computed in its prefill and never sampled again. Its output text and ids then include
        them, its deltas hold only what follows, and a seeded request goes on drawing as an uninterrupted run
        would. ``prefix_logprobs``: the prefix tokens' logprobs, one per token, which a request asking for
        logprobs needs to resume (its output's logprobs start with them)."""
        if not isinstance(request_id, str):  # (an int went in, and abort_request(7) took it for a list of ids)
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        # Checked and derived again as it is now: a field set after it was made (``sp.stop = [...]``, a vLLM habit)
        # went unchecked, and its stop strings unseen (``generate`` made a copy; this path did not).
        params = dataclasses.replace(params)
        text, token_ids = self.tokenize(prompt)
        if text is None and params.prompt_logprobs is not None and self.tokenizer is not None:
            text = self.tokenizer.decode(token_ids)  # the text those logprobs score (as vLLM gives it)
        if not token_ids:
            raise ValueError("the prompt is empty")
        self.check_prompt_tokens(len(token_ids))
        if max(token_ids) >= self.model.vocab_size:  # a tokenizer larger than the model's table: the step would fail
            raise ValueError(
                f"the prompt holds token id {max(token_ids)}, past the model's vocabulary [0, {self.model.vocab_size})"
                " (its tokenizer has more tokens than the model)"
            )
        if (
            params.context_overflow == "error"
            and params.max_tokens is not None
            and len(token_ids) + params.max_tokens > self.max_model_len
        ):  # (vLLM's server's words)
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your request has "
                f"{len(token_ids)} input tokens plus {params.max_tokens} 'max_tokens'. Please reduce one or the other."
            )
        prefix = self._checked_prefix(output_prefix or [], len(token_ids), params, prefix_logprobs)
        if prefix and params.n > 1:
            raise ValueError("a request with n > 1 cannot resume from an output prefix: its samples start over")
        past = [t for t in params.logit_bias or () if t >= self.model.vocab_size]
        if past:
            raise ValueError(
                f"logit_bias names token ids past the model's vocabulary [0, {self.model.vocab_size}): {past[:5]}"
            )
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        if (
            request_id in self.scheduler
            or request_id in self._groups
            or any(entry[0].parent_id == request_id for entry in self._pending)  # its last output not out yet
        ):
            held = self.scheduler.get(request_id)
            if held is not None and held.parent_id != request_id:
                raise ValueError(f"request id {request_id!r} names a sample of the request {held.parent_id!r}")
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError("priority must be an integer")
        so = params.structured_outputs
        if so is not None and so.thinking is not None and self.tokenizer is not None:
            so = _thinking_after(so, self.tokenizer.decode(token_ids[-16:]))
        seqs = []
        for index in range(params.n):
            # Compiled before anything else is built: a constraint the library rejects fails here, with its reason.
            grammar = self.structured.matcher_for(so, prefix) if so else None
            fresh = grammar is not None and self.structured.compiled_last
            detok = IncrementalDetokenizer(self.tokenizer, token_ids, params) if self.tokenizer is not None else None
            if detok is not None and prefix:
                detok.prime(prefix)
                if detok.stop_hit is not None:
                    raise ValueError("the output prefix already contains a stop string: the request had ended")
            generator = self._generator_for(params, index, len(prefix))
            seq_id = request_id if params.n == 1 else f"{request_id}[{index}]"
            seq = Sequence(
                seq_id, token_ids, params, detok, generator, prompt=text, output_prefix=prefix, priority=priority
            )
            seq.grammar, seq.grammar_fresh, seq.parent_id, seq.index = grammar, fresh, request_id, index
            if index:
                seq.prompt_logprobs = None  # the first sample computes the prompt: the others share its blocks
            if prefix and seq.logprobs is not None and prefix_logprobs is not None:
                seq.logprobs = [dict(step) for step in prefix_logprobs]
            seq.leader = seqs[0] if seqs else None
            seqs.append(seq)
        if params.n > 1:
            if any(seq.request_id in self.scheduler for seq in seqs):
                raise ValueError(f"request id {request_id!r} clashes with the samples of another request")
            self._groups[request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)

    def _checked_prefix(
        self,
        prefix: list[int],
        num_prompt_tokens: int,
        params: SamplingParams,
        logprobs: list[dict[int, float]] | None = None,
    ) -> list[int]:
        if not prefix:
            return []
        ids = self.checked_ids(prefix)  # the same checks as prompt token ids
        if params.logprobs is not None and (
            logprobs is None
            or len(logprobs) != len(ids)
            or not all(isinstance(step, dict) and t in step for t, step in zip(ids, logprobs))
        ):  # else the output's logprobs would be out of step with its ids
            raise ValueError(
                "a request asking for logprobs resumes only with its output prefix's logprobs, one per token "
                "holding that token: start it over"
            )
        if num_prompt_tokens + len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt ({num_prompt_tokens} tokens) and the output to resume ({len(ids)} tokens) leave no room "
                f"in this model's {self.max_model_len} tokens"
            )
        if params.max_tokens is not None and len(ids) >= params.max_tokens:
            raise ValueError(f"the output to resume has {len(ids)} tokens, max_tokens is {params.max_tokens}")
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        if any(t in stops for t in ids[max(params.min_tokens - 1, 0) :]):
            raise ValueError("the output to resume holds a stop token: the request had ended")
        return ids

    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """Stop a request now (every sample of it) and free its KV blocks. Returns its last outputs, the final one
        last; [] if unknown. Output kind "delta" with n > 1: each sample that had text or tokens not yet given out
        gets an output of its own first (one output holds one sample's delta). A list of ids (vLLM's form): each."""
        if not isinstance(request_id, str):
            listed = isinstance(request_id, Iterable) and not isinstance(request_id, (bytes, bytearray))
            ids = list(request_id) if listed else [request_id]
            for one in ids:  # (checked before any ends: the outputs of those aborted before a bad one were lost)
                if not isinstance(one, str):
                    raise TypeError(f"a request id is a string, got {one!r}")
            return [out for one in ids for out in self.abort_request(one)]
        seqs = self._groups.get(request_id) or [self.scheduler.get(request_id)]
        if seqs[0] is not None and seqs[0].parent_id != request_id:
            return []  # a sample's own id ("x[1]" of a request "x" with n > 1): not a request, nothing of it ends
        if seqs[0] is None:  # unknown, or it ended at the last step and its final output waits (on a GPU)
            seqs = [entry[0] for entry in self._pending if entry[0].parent_id == request_id][:1]
            if not seqs:
                return []
        drained = self._drain_pending(request_id)
        now = time.perf_counter()
        tails: list[tuple[Sequence, str, list[int]]] = []
        for seq in seqs:
            if seq.is_finished and id(seq) not in drained:
                continue  # its last output was given
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                seq.finish_time = now
            delta = seq.detokenizer.finish() if seq.detokenizer is not None else ""
            held, seq.held_ids = seq.held_ids, []  # sampled since its last output (output kind "delta")
            if seq.params.output_kind == "final_only":  # its one output: every token this run made, as its text
                held = seq.output_token_ids[seq.num_resumed_tokens :]
            tails.append((seq, delta, held))
        if not tails:
            return [self._output(seqs[-1], "", [])]
        outputs = []
        if seqs[0].params.output_kind == "delta":
            outputs = [self._output(seq, delta, held, group_may_end=False) for seq, delta, held in tails[:-1]]
            outputs = [out for out in outputs if out.delta_text or out.delta_token_ids]
        seq, delta, held = tails[-1]
        return [*outputs, self._output(seq, delta, held)]

    def _drain_pending(self, request_id: str) -> set[int]:
        """The tokens of ``request_id`` the last step sampled whose outputs wait for the next step (on a GPU): taken
        in now, text and ids, so its last outputs hold them and no output of it comes after. The ids of the
        sequences that had one."""
        if not self._pending or all(entry[0].parent_id != request_id for entry in self._pending):
            return set()
        drained = set()
        kept = []
        for seq, token, by_token, ended_at_token in self._pending:
            if seq.parent_id != request_id:
                kept.append((seq, token, by_token, ended_at_token))
                continue
            detok = seq.detokenizer
            if detok is not None:
                detok.push(_shown(seq, token, by_token))
                if detok.stop_hit is not None and not by_token:  # it ended there, before the abort (as in a step)
                    if not seq.is_finished:
                        self.scheduler.finish(seq, "stop")
                        seq.finish_time = time.perf_counter()
                    seq.finish_reason, seq.stop_reason = "stop", detok.stop_hit
            seq.held_ids.append(token)
            drained.add(id(seq))
        self._pending = kept
        return drained

    def take_undelivered(self) -> list[RequestOutput]:
        """Outputs of the step before one that raised (on a GPU they are made while the next step runs): requests
        that ended there are not running, and would get no final output otherwise."""
        outputs, self.undelivered = self.undelivered, []
        return outputs

    def running_request_ids(self) -> list[str]:
        """The requests in the running batch (those a step computes), by the ids they were added with."""
        return list(dict.fromkeys(seq.parent_id for seq in self.scheduler.running()))

    def running_since(self, request_id: str) -> float | None:
        """When the request's running time began (``time.monotonic()``): its first step, moved on by every wait it
        had for a place again after a preemption (running behind interactive work, a bulk job was timed out for
        the time it spent preempted). None while it waits for its first step, or once it ended. A job's timeout counts
        from it (RQ's: from a job's start), not from its wait behind max_num_seqs."""
        seqs = [s for s in self._groups.get(request_id) or [self.scheduler.get(request_id)] if s is not None]
        seqs = [s for s in seqs if not s.is_finished] or seqs  # (a sample that ended no longer runs)
        now = time.monotonic()
        starts = [
            s.first_scheduled_time + s.preempted_s + (now - s.preempted_at if s.preempted_at is not None else 0.0)
            for s in seqs
            if s.first_scheduled_time is not None
        ]
        return min(starts, default=None)

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's accessor; ``tokenizer`` here)."""
        return self.tokenizer

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def get_num_unfinished_requests(self) -> int:
        """Requests, not samples (one of n = 4 is one, as vLLM counts it), not finished or whose last output is still
        to come (``has_unfinished_requests`` says True exactly when this is not 0)."""
        held = (seq.parent_id for seq in (*self.scheduler.running(), *self.scheduler.waiting()))
        return len({*held, *self._groups, *(entry[0].parent_id for entry in self._pending)})

    # ----- the step ------------------------------------------------------------------------------
    def step(self, flush: bool = True) -> list[RequestOutput]:
        """Advance every scheduled request by a step. On a GPU the outputs of a step come back with the next
        call: their text and output objects are made while the device runs that next step (the host's work
        hidden behind the device's); what ends a request (length, EOS, stop ids, a complete structured output)
        is still decided before the next step is scheduled, and a stop string found late drops the extra token.
        ``flush=False``: running requests of output kind "delta" that have had their first output get none now;
        what they add waits for a step with ``flush`` (or their end), so a caller that sends text out every few
        steps builds an output per request only then."""
        self._flush = flush
        if self._cuda_index is not None and torch.cuda.current_device() != self._cuda_index:
            torch.cuda.set_device(self._cuda_index)  # the current device is per thread: a worker steps from its own
        outputs: list[RequestOutput] = []
        sched = pending = None
        try:
            sched = self.scheduler.schedule()
            if not sched.is_empty:
                masks = self.structured.start_masks([item.seq for item in sched.scheduled if item.samples])
                pending = self.runner.launch(sched, masks)
                self._emit_pending(outputs)  # the previous step's, while the device runs this one
                if self._overlap:  # (before this step's tokens join their requests: a delta's logprobs end at its ids)
                    self._release_held(outputs)
                sampled = pending.result()
        except BaseException:
            if pending is not None:  # (the next step refills the pinned inputs a queued copy of this one reads)
                with contextlib.suppress(Exception):
                    pending.wait()
            # The blocks this step registered in the prefix cache were never filled (out of memory, an interrupt
            # in the schedule or the masks): a later request with the same prefix would read them.
            self.scheduler.forget_step()
            self.undelivered = outputs  # the last step's, made before this one failed: ``take_undelivered``
            if sched is not None:
                self._take_back_draws(sched)
            raise
        if sched.is_empty:
            return self._release_held(self._emit_pending([]))
        for item in sched.scheduled:  # the prompt tokens computed (not cached), counted once the step ran
            known = item.seq.num_prompt_tokens + item.seq.num_resumed_tokens
            if item.start < known:
                self.stats.num_prefill_tokens += min(item.start + item.num_tokens, known) - item.start
        now = time.perf_counter()
        new_tokens = self.scheduler.update_from_output(sched, sampled, now)
        self.stats.num_steps += 1
        for seq, token in new_tokens:
            # Its first token: the prompt is in (counted once: the other samples of n share the first's).
            if seq.num_output_tokens == seq.num_resumed_tokens + 1 and seq.index == 0:
                self.stats.num_prompt_tokens_computed += seq.num_prompt_tokens
                self.stats.num_prompt_tokens_cached += min(seq.num_cached_tokens, seq.num_prompt_tokens)
            self.stats.num_generated_tokens += 1
            by_token = self._end_check(seq, token, now)
            self._pending.append((seq, token, by_token, seq.is_finished))
        if not self._overlap:
            self._release_held(self._emit_pending(outputs))
        return outputs

    def _take_back_draws(self, sched: SchedulerOutput) -> None:
        """A failed step's draws taken back: a seeded request that runs on (sent back to waiting, or kept by a
        caller that goes on) draws what a run without the failure would. Never raises over the step's own error (a
        device in a sticky error state refuses the rebuild too: those requests are failed by the caller anyway)."""
        try:
            for item in sched.scheduled:
                seq = item.seq
                if item.samples and seq.generator is not None:
                    seq.generator = self._generator_for(seq.params, seq.index, seq.num_output_tokens)
        except Exception:
            log.exception("the seeded generators of a failed step could not be taken back")

    def _generator_for(self, params: SamplingParams, index: int, drawn: int) -> torch.Generator | None:
        """Sample ``index``'s own generator where its request has a seed, past the draws of its first ``drawn``
        tokens (a resumed prefix's, or those a failed step left): it draws what an uninterrupted run draws next."""
        seed = params.sample_seed(index)
        if seed is None:
            return None
        generator = seeded_generator(seed, self.device)
        if not params.greedy:
            advance_generator(generator, drawn)
        return generator

    def _end_check(self, seq: Sequence, token: int, now: float) -> bool:
        """What ends ``seq`` at ``token`` without its text: EOS, a stop id, its structured output refusing or
        completing, its length. Ends it (its blocks freed before the next schedule). Returns whether the token
        itself stopped it (EOS, a stop id, a refusal): such a token's text stays out of the output."""
        p = seq.params
        reason: str | None = None
        stop_reason: str | int | None = None
        if seq.grammar is not None and (dead_end := self.structured.dead_end(seq)) is not None:
            # Met while filling its mask, which then allowed EOS alone: not a complete output, as "stop" said.
            log.error("request %s: its structured output can go no further: %s", seq.request_id, dead_end)
            limited = self.structured.past_limits(dead_end)
            cause = self.structured.limit_cause(seq, dead_end) if limited else AbortCause(True, dead_end)
            reason, seq.abort_cause = "abort", cause
        elif seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                # An EOS the generation config adds to the tokenizer's is named, as vLLM's stop ids name theirs.
                reason, stop_reason = "stop", (None if token == self.primary_eos else token)
            elif token in p.stop_token_ids:
                reason, stop_reason = "stop", token
        by_token = reason is not None
        if seq.grammar is not None and reason is None:
            if not self.structured.accept(seq, token):  # the mask allowed it: a dead end, a limit or a library fault
                seq.abort_cause = self.structured.refused(seq, token)
                log.error("request %s: its structured output refused token %d: %s", seq.request_id, token,
                          seq.abort_cause.why)  # fmt: skip
                reason = by_token = "abort"
            elif self.structured.is_done(seq):  # complete, nothing may follow: it ends after this token
                reason = "stop"
        if reason is None and (
            (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            seq.stop_reason = stop_reason
            seq.finish_time = now
        return bool(by_token)

    def _emit_pending(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Text and outputs of the tokens the last step sampled, added to ``outputs`` as each is made; a stop string
        in the text ends its request. An error midway (an interrupt) leaves those made for ``take_undelivered`` and
        the tokens after it for the next step (all were lost: a finished request's last output never came, the
        others' text short of their tokens). The token in hand is not taken again (an error of its own would come
        back at every step), but a request it finished still gets its last output where one can be made."""
        pending, self._pending = self._pending, []
        # A request with n > 1 ends once, at its last sample's output of the batch (they may all end in one step).
        last = {entry[0].parent_id: i for i, entry in enumerate(pending)} if self._groups else None
        for i, entry in enumerate(pending):
            may_end = last is None or last[entry[0].parent_id] == i
            try:
                self._emit(entry, outputs, may_end)
            except BaseException:
                self._pending = pending[i + 1 :] + self._pending
                if entry[0].is_finished:  # (its output is the last thing ``_emit`` adds: not there)
                    self._salvage_last_output(entry[0], outputs, may_end)
                # (for ``take_undelivered``: a step's own call was the only one whose outputs were kept; the CPU's,
                # after its step, and an empty step's, on a GPU, lost a request's last output made here)
                self.undelivered = outputs
                raise
        return outputs

    def _release_held(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """``outputs`` and, on a step with flush, the outputs held back by steps without it of "delta" requests that
        sampled nothing since (preempted, waiting to run again): their text stayed in the engine until they ran
        again, a bulk job's behind every interactive one that took its place."""
        if not (self._flush and self._holding):
            return outputs
        holding, self._holding = self._holding, {}
        for seq in holding.values():
            if seq.is_finished or not seq.held_ids:  # (its last output, or one since, took them)
                continue
            delta = seq.detokenizer.update(None) if seq.detokenizer is not None else ""
            outputs.append(self._output(seq, delta, seq.held_ids))
            seq.held_ids = []
        return outputs

    def _salvage_last_output(self, seq: Sequence, outputs: list[RequestOutput], group_may_end: bool) -> None:
        """The last output of ``seq``, which ended at the token whose output failed: its text's rest where the
        detokenizer still gives it, and the ids held for it (a delta's), else its output whole without them."""
        text = ""
        with contextlib.suppress(Exception):
            text = seq.detokenizer.finish() if seq.detokenizer is not None else ""
        with contextlib.suppress(Exception):
            if (out := self._output(seq, text, seq.held_ids, group_may_end=group_may_end)).finished:
                outputs.append(out)
                seq.held_ids = []

    def _emit(self, entry: tuple, outputs: list[RequestOutput], group_may_end: bool) -> None:
        """One sampled token's text and output (``_emit_pending``)."""
        seq, token, by_token, ended_at_token = entry
        if seq.is_finished and not ended_at_token:
            return  # aborted since: its last output was given then
        detok = seq.detokenizer
        kind = seq.params.output_kind
        if kind == "delta":  # held until its output is made: an error before then leaves its id to the next output,
            seq.held_ids.append(token)  # whose text holds its text (the detokenizer took it: not pushed again)
        if detok is not None:
            # A stopping token's own text stays out of the output (``_shown``).
            detok.push(_shown(seq, token, by_token))
            hit = detok.stop_hit
            if hit is not None:  # a stop string wins over the length, a complete output or a stop token whose
                # shown text holds it (the text is cut there: as vLLM's, the string is the reason)
                if not seq.is_finished:
                    self.scheduler.finish(seq, "stop")  # a token computed for it since is dropped
                    seq.finish_time = time.perf_counter()
                seq.finish_reason, seq.stop_reason = "stop", hit
        if not seq.is_finished and (
            kind == "final_only"
            or (kind == "delta" and not self._flush and seq.streamed and seq.parent_id == seq.request_id)
        ):
            if kind == "delta":
                self._holding[seq.request_id] = seq
            return  # (a delta's id held above: its text waits in the detokenizer, as a final_only request's does)
        delta = "" if detok is None else detok.finish() if seq.is_finished else detok.update(None)
        ids = [token]
        if kind == "final_only":  # its one output: every token this run made, as its text
            ids = seq.output_token_ids[seq.num_resumed_tokens :]
        elif kind == "delta":  # (held since its last output, this one's too)
            ids = seq.held_ids
        elif seq.held_ids:
            ids, seq.held_ids = seq.held_ids + ids, []
        seq.streamed = True
        out = self._output(seq, delta, ids, group_may_end=group_may_end)
        if kind == "delta":
            seq.held_ids = []  # (taken once its output is made)
        if out.finished or kind != "final_only":  # a sample of n ending before the others: not yet
            outputs.append(out)

    def _output(
        self, seq: Sequence, delta_text: str, delta_ids: list[int], group_may_end: bool = True
    ) -> RequestOutput:
        """The request's output after ``seq`` advanced, with the delta of ``seq``: its outputs are ``seq``'s alone
        while the request runs, every sample once it finished (copying n samples' tokens at every token of each
        would cost n^2 per step)."""
        group = self._groups.get(seq.parent_id)
        finished = seq.is_finished and (group is None or (group_may_end and all(s.is_finished for s in group)))
        if seq.params.output_kind == "delta" and not finished:
            # The request runs on: what is new, and nothing else (no copy of the whole output at every step).
            logprobs, running = None, None
            if seq.logprobs is not None:
                logprobs = seq.logprobs[len(seq.logprobs) - len(delta_ids) :]
                start = seq.num_prompt_tokens + seq.logprobs_summed
                new = zip(seq.token_ids[start:], seq.logprobs[seq.logprobs_summed :])
                seq.logprob_sum += sum(step.get(token, float("nan")) for token, step in new)
                seq.logprobs_summed, running = len(seq.logprobs), seq.logprob_sum
            # A sample of n that ended before the others ends here with its own reason (as vLLM's), the request not.
            piece = CompletionOutput(
                seq.index, delta_text, delta_ids, seq.finish_reason, seq.stop_reason, logprobs, seq.abort_cause, running
            )
            return RequestOutput(
                seq.parent_id,
                seq.prompt,
                seq.prompt_token_ids,
                [piece],
                False,
                delta_text,
                delta_ids,
                seq.index,
                prompt_logprobs=(seq.leader or seq).prompt_logprobs,
            )
        if seq.parent_id == seq.request_id:  # one sample: the common case, built without the group's bookkeeping
            return RequestOutput(
                request_id=seq.request_id,
                prompt=seq.prompt,
                prompt_token_ids=seq.prompt_token_ids,
                outputs=[
                    CompletionOutput(
                        seq.index,
                        seq.output_text,
                        seq.output_token_ids,
                        seq.finish_reason,
                        seq.stop_reason,
                        _copy(seq.logprobs),  # (the sequence's own list grows on: an output kept must not)
                        seq.abort_cause,
                    )
                ],
                finished=seq.is_finished,
                delta_text=delta_text,
                delta_token_ids=delta_ids,
                delta_index=seq.index,
                metrics=RequestMetrics(
                    seq.arrival_time, seq.first_token_time, seq.finish_time, seq.num_cached_tokens, seq.num_preemptions
                ),
                prompt_logprobs=seq.prompt_logprobs,  # (complete before the first token: shared, not copied)
            )
        samples = group if group is not None and finished else [seq]
        if finished and group is not None:
            del self._groups[seq.parent_id]
        lead = group[0] if group is not None else seq
        first_times = [s.first_token_time for s in samples if s.first_token_time is not None]
        return RequestOutput(
            request_id=seq.parent_id,
            prompt=lead.prompt,
            prompt_token_ids=lead.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=s.index,
                    text=s.output_text,
                    token_ids=s.output_token_ids,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    logprobs=_copy(s.logprobs),
                    abort_cause=s.abort_cause,
                )
                for s in samples
            ],
            finished=finished,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            delta_index=seq.index,
            metrics=RequestMetrics(
                lead.arrival_time,
                min(first_times) if first_times else None,
                max(s.finish_time for s in samples) if finished else None,
                lead.num_cached_tokens,  # (the prompt's, as vLLM's: the other samples' hits are on its own blocks)
                sum(s.num_preemptions for s in samples),
            ),
            prompt_logprobs=lead.prompt_logprobs,
        )


def _copy(logprobs: list | None) -> list | None:
    return None if logprobs is None else list(logprobs)


def _shown(seq: Sequence, token: int, by_token: bool) -> int | None:
    """The token its detokenizer takes: the text of a token that stopped the request (EOS, a stop id) stays out,
    as in vLLM, unless the request keeps what stopped it (``include_stop_str_in_output``); one its structured output
    refused (the request ended "abort") never shows."""
    if not by_token or (seq.params.include_stop_str_in_output and seq.finish_reason == "stop"):
        return token
    return None


def settle_garbage_collector() -> None:
    """For a step loop: what is loaded so far lives as long as the process, so the collector never walks it again
    (the millions of objects transformers leaves behind: a full collection in a burst took 15-28 ms), and the
    youngest generation is collected less often."""
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()
    # A step allocates thousands of short-lived objects: at Python's default (700) the tiny model's 256 x 128
    # burst ran 132 young collections (8.8 ms); at 10,000 none, and the burst 2% faster. Never lowered.
    threshold = gc.get_threshold()
    if threshold[0] < GC_YOUNG_THRESHOLD:
        gc.set_threshold(GC_YOUNG_THRESHOLD, *threshold[1:])


@functools.cache
def _unfreeze_at_exit() -> None:
    """Where triton is loaded (torch imports it), the frozen objects go back to the collector at exit: left frozen,
    triton's nanobind objects outlive the interpreter and it prints dozens of "leaked" lines. It costs the exit the
    collection of everything loaded (~1 s for a model's worth of objects)."""

    def unfreeze() -> None:
        if any(name.startswith("triton") for name in sys.modules):
            gc.unfreeze()

    atexit.register(unfreeze)


def _thinking_after(so: StructuredOutputsParams, prompt_tail: str) -> StructuredOutputsParams:
    """A constraint with ``thinking``, as the prompt leaves it: a prompt that ends in ``</think>`` thought already
    (a template that closed the thinking, as Qwen3's with enable_thinking false): the constraint from the first
    token; one that ends in ``<think>`` opened it (DeepSeek-R1's, QwQ's): thinking first."""
    tail = prompt_tail.rstrip()
    if tail.endswith("</think>"):
        return dataclasses.replace(so, thinking=None)
    return dataclasses.replace(so, thinking="first") if tail.endswith("<think>") else so
