"""Submit prompts to roseinfer workers through Redis: ``from producer import Client``.

Light on purpose: redis, rq, pydantic, pydantic-settings and tqdm only (no torch, no transformers), so it runs
inside any service.
"""

from producer.aio import AsyncClient, AsyncGenerationJob, ClientClosed
from producer.client import Client
from producer.connection import InvalidRedisURL
from producer.generation_job import GenerationJob
from producer.job_errors import (
    InvalidRequest,
    JobCanceled,
    JobError,
    JobFailed,
    JobIdTaken,
    NoSuchJob,
    ProtocolError,
    ResultNotKept,
    StreamExpired,
    StreamGap,
    StreamRestarted,
)
from producer.protocol import InvalidQueueName
from producer.schema import ChatMessage, JobRequest

__all__ = [
    "AsyncClient",
    "AsyncGenerationJob",
    "ChatMessage",
    "Client",
    "ClientClosed",
    "GenerationJob",
    "InvalidQueueName",
    "InvalidRedisURL",
    "InvalidRequest",
    "JobCanceled",
    "JobError",
    "JobFailed",
    "JobIdTaken",
    "JobRequest",
    "NoSuchJob",
    "ProtocolError",
    "ResultNotKept",
    "StreamExpired",
    "StreamGap",
    "StreamRestarted",
]
