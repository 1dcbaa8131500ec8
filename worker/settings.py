"""Worker settings: command-line flags, else ``ROSEINFER_*`` environment variables, else these defaults."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from producer.protocol import DEFAULT_QUEUE


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ROSEINFER_", extra="forbid")

    redis_url: str = "redis://127.0.0.1:6379/0"
    queue: str = DEFAULT_QUEUE
    name: str | None = None

    # The engine (see roseinfer.EngineConfig).
    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    device: str = "cpu"
    max_num_seqs: int = Field(default=128, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    max_model_len: int | None = Field(default=None, ge=2)
    block_size: int | None = Field(default=None, ge=1)  # None: the engine's default
    kv_cache_memory: str = "auto"
    num_threads: int | None = Field(default=None, ge=1)

    # Jobs held at once (running batch + the engine's waiting queue); None: max_num_seqs + a quarter.
    max_in_flight: int | None = Field(default=None, ge=1)
    # Replay streams and result keys expire this long after the job ends.
    stream_ttl: int = Field(default=24 * 3600, ge=1)
    result_ttl: int = Field(default=24 * 3600, ge=1)
    stream_maxlen: int = Field(default=100_000, ge=16)
    # Recovery of a dead worker's jobs takes at most heartbeat_interval + heartbeat_grace +
    # maintenance_interval (about 55 s with these), run by any surviving worker.
    heartbeat_interval: int = Field(default=10, ge=1)
    heartbeat_grace: int = Field(default=30, ge=1)
    maintenance_interval: int = Field(default=15, ge=1)
    # Seconds to block on an empty queue when nothing runs (short, so signals and maintenance stay prompt).
    idle_wait: int = Field(default=1, ge=1)
    burst: bool = False

    def engine_options(self) -> dict:
        opts = {
            "dtype": self.dtype,
            "device": self.device,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "kv_cache_memory": self.kv_cache_memory,
            "num_threads": self.num_threads,
        }
        if self.block_size is not None:
            opts["block_size"] = self.block_size
        return opts

    @property
    def in_flight_limit(self) -> int:
        return self.max_in_flight or self.max_num_seqs + max(1, self.max_num_seqs // 4)
