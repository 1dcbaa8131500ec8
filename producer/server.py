"""``roseinfer serve``: an OpenAI-compatible HTTP server over the queue. No engine in this process: each request
becomes a job submitted through ``AsyncClient``, and its events come back as server-sent events (or its result as
one response). A client that goes away cancels its job.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (the models live workers
serve), ``GET /health`` (200 when Redis answers and a worker is alive, 503 with the reason otherwise), and vLLM's
``POST /tokenize`` and ``/detokenize`` (with the tokenizer a worker wrote to Redis).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producer.aio import AsyncClient, AsyncGenerationJob
from producer.chat_render import ChatRenderer, ChatRenderers, chat_digests
from producer.client import JobCanceled, JobFailed, ProtocolError, StreamGap, StreamRestarted
from producer.connection import REDIS_UNAVAILABLE, connect, redacted_url
from producer.openai_api import (
    APIError,
    ChatCompletionRequest,
    ChunkWriter,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_response,
    completion_response,
    fit_to_context,
    parse,
    parse_completions,
    parse_request,
    total_usage,
    without_output,
)
from producer.protocol import installed_version
from producer.reasoning import REASONING_PARSERS
from producer.responses_api import ResponseWriter, parse_responses
from producer.schema import lone_surrogate
from producer.token_names import BY_ID, TokenizerCache, TokenNames, digest_of
from producer.tool_calls import TOOL_CALL_PARSERS

log = logging.getLogger("roseinfer.server")

# A stream of several prompts holds its headers for every job's first event (a refused job is the request's status),
# but once one came, no longer than this: a job queued behind a full worker streams when it starts.
FIRST_EVENTS_GRACE_S = 1.0
# A stream whose jobs sent nothing yet (queued behind others) gets its headers after this, then a comment line
# every PING_EVERY_S while nothing comes: a proxy's read timeout (nginx's 60 s) cut it, and with it the job.
HEADERS_HOLD_S = 5.0
PING_EVERY_S = 15.0
# The request field a context_length_exceeded error names, by endpoint (behind a proxy's path prefix too).
_PROMPT_FIELDS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/responses": "input"}
MAX_IDS_IN_HEADER = 32  # more: the first id and the count (256 ids, ~9.5 KB, passed a proxy's header buffer)


class Workers:
    """The live workers of the queue and their models, read at most once a second."""

    def __init__(self, client: AsyncClient, ttl: float = 1.0) -> None:
        self.client, self.ttl = client, ttl
        self._at, self._rows = 0.0, []
        self._reading: asyncio.Future | None = None
        self._warned_at = -60.0

    async def live(self) -> list[dict[str, Any]]:
        if time.monotonic() - self._at > self.ttl:
            # One read for every request that comes meanwhile: a burst of 64 made 64 reads, each several round
            # trips on the threads that submit jobs. Shielded: a request whose client left does not cancel it.
            if self._reading is None or self._reading.done():
                self._reading = asyncio.ensure_future(self._read())
            await asyncio.shield(self._reading)
        return self._rows

    async def _read(self) -> None:
        self._rows = await self.client.workers()
        self._at = time.monotonic()

    async def models(self) -> list[str]:
        return sorted({row["model"] for row in await self.live() if row.get("model")})

    async def max_model_len(self, model: str) -> int | None:
        """The context length of ``model``: the shortest its live workers give (a request must fit any of them)."""
        lens = [
            row["max_model_len"] for row in await self.live() if row.get("model") == model and row.get("max_model_len")
        ]
        return min(lens) if lens else None

    async def tokenizer_of(self, model: str) -> str | None:
        """The digest of the tokenizer a live worker serving ``model`` wrote to Redis, if any did."""
        return digest_of(await self.live(), model)

    def warn(self, message: str) -> None:
        """``message`` logged as a warning, once a minute at most."""
        if time.monotonic() - self._warned_at >= 60:
            self._warned_at = time.monotonic()
            log.warning("%s", message)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "roseinfer_server_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.latency = Histogram(
            "roseinfer_server_request_seconds", "time to the response's headers", ["endpoint"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r,
        )  # fmt: skip
        self.streams = Gauge("roseinfer_server_open_streams", "streamed responses being sent", registry=r)


def _route_path(scope: Scope) -> str:
    """The path the routes match: behind a prefix (uvicorn's ``--root-path``, a ``Mount``) ``scope["path"]`` holds
    the prefix too, and ``/api/v1/models`` skipped the key that ``/v1/models`` asks for. Cut at a ``/`` only, as
    Starlette routes (a root path ``/v`` made ``/v1/models`` read ``1/models``)."""
    path, root = scope["path"], scope.get("root_path", "").rstrip("/")
    return path[len(root) :] if root and path.startswith(root + "/") else path


class AuthAndCount:
    """The API key's check and the requests' counts, as plain ASGI: ``@app.middleware("http")`` hands the endpoint
    a stream of its own, on which a client's disconnect never shows, so a client that left a non-streamed request
    never canceled its job."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: ServerMetrics, routes: list[BaseRoute]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    def endpoint(self, scope: Scope) -> str:
        """The route's template (``/v1/models/{model:path}``), or "other": any path a client makes up would be a
        series of its own."""
        for route in self.routes:
            if isinstance(route, Route) and route.matches(scope)[0] != Match.NONE:
                return route.path
        return "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, started = _route_path(scope), time.perf_counter()
        label = self.endpoint(scope)
        if self.expected is not None and (path.startswith("/v1/") or scope["path"].startswith("/v1/")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = APIError(401, "invalid API key", param=None, code="invalid_api_key")
                self.metrics.requests.labels(label, "401").inc()
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return

        answered = False

        def count(status: int) -> None:
            if path != "/metrics":
                self.metrics.requests.labels(label, str(status)).inc()
                self.metrics.latency.labels(label).observe(time.perf_counter() - started)

        async def counted(message: Message) -> None:
            nonlocal answered
            if message["type"] == "http.response.start":
                answered = True
                count(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            if not answered:  # the server's fault: its 500 is sent by Starlette's outermost layer, outside this one
                count(500)
            raise


def create_app(
    client: AsyncClient,
    api_key: str | None = None,
    timeout: float = 600.0,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    allowed_origins: list[str] | None = None,
) -> FastAPI:
    """``tool_call_parser``: the served model's own tool-call format, for ``tool_choice: "auto"`` (vLLM's
    ``--tool-call-parser``; ``producer/tool_formats.py``); ``reasoning_parser``: how its thinking is told from its
    answer (vLLM's ``--reasoning-parser``; ``producer/reasoning.py``); ``allowed_origins``: the web origins whose
    pages may call the API from a browser (CORS; ``*``: any), none by default."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {tool_call_parser!r}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {reasoning_parser!r}")
    app = FastAPI(title="roseinfer", docs_url=None, redoc_url=None, lifespan=_lifespan)
    workers = Workers(client)
    tokenizers = TokenizerCache(client)
    renderers = ChatRenderers(client)
    metrics = ServerMetrics()
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.code == "context_length_exceeded" and exc.param is None:  # the field to shorten, as OpenAI names it
            exc.param = next((f for path, f in _PROMPT_FIELDS.items() if request.url.path.endswith(path)), None)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """FastAPI's own answers (no such path, a method not allowed) in OpenAI's shape too."""
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        err = APIError(exc.status_code, str(exc.detail), kind)
        err.headers.update(exc.headers or {})  # a 405's Allow
        return await _api_error(request, err)

    @app.exception_handler(RedisError)
    async def _redis_down(request: Request, exc: RedisError) -> JSONResponse:
        return await _api_error(request, APIError(503, f"Redis is unavailable: {exc}", "service_unavailable"))

    async def _unreadable_job(request: Request, exc: Exception) -> JSONResponse:
        """A job's events that cannot be read whole (trimmed, not the protocol): OpenAI's shape, not plain text."""
        return await _api_error(request, APIError(500, str(exc), "server_error"))

    for unreadable in (StreamGap, ProtocolError):
        app.add_exception_handler(unreadable, _unreadable_job)

    @app.exception_handler(Exception)
    async def _server_fault(request: Request, exc: Exception) -> JSONResponse:
        """A fault of the server's own: OpenAI's shape, not plain text (Starlette still logs its traceback)."""
        return await _api_error(request, APIError(500, f"internal error: {type(exc).__name__}", "server_error"))

    app.add_middleware(AuthAndCount, api_key=api_key, metrics=metrics, routes=app.routes)
    if allowed_origins:  # (added last, so outermost: a preflight carries no key, and is answered before the check)
        app.add_middleware(
            CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"],
            expose_headers=["x-request-id", "x-roseinfer-job-id", "x-roseinfer-job-count"],
        )  # fmt: skip

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            await client.connection.ping()
            live = await workers.live()
        except Exception as exc:
            return JSONResponse({"status": "unavailable", "reason": f"Redis: {exc}"}, status_code=503)
        served = await workers.models()
        if not live:
            reason = f"no live worker on queue {client.queue_name!r}"
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        body = {"status": "ok", "workers": len(live), "models": served}
        return JSONResponse({**body, "warning": _mixed_models(client.queue_name, served)} if len(served) > 1 else body)

    @app.get("/version")
    async def version() -> dict[str, str]:
        """vLLM's: the server's version (what clients and probes log)."""
        return {"version": installed_version()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [await _model_card(m) for m in await workers.models()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        """OpenAI's retrieve (``client.models.retrieve``): 404 for a model no live worker serves, 503 with none."""
        await _served(model)
        return await _model_card(model)

    async def _model_card(model: str) -> dict[str, Any]:
        card = {"id": model, "object": "model", "created": 0, "owned_by": "roseinfer"}
        if (length := await workers.max_model_len(model)) is not None:  # (vLLM's field: clients size prompts by it)
            card["max_model_len"] = length
        return card

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = parse_request(TokenizeRequest, await _body(request))
        tokenizer = await _tokenizer(req.model)
        if req.messages is not None:  # vLLM's chat form: rendered by the worker's chat template, as its job's
            job = req.chat_job()
            renderer = await _renderer(req.model)
            try:
                ids = await asyncio.to_thread(renderer.tokenize, job, bool(req.add_special_tokens))
            except Exception as exc:  # the template's own refusal (roles out of order ...), as the job would fail
                raise APIError(400, f"the chat template refused the messages: {exc}", param="messages") from None
        else:  # (off the event loop: a long prompt's encoding would hold every other request)
            special = req.add_special_tokens is not False
            ids = (await asyncio.to_thread(tokenizer.encode, req.prompt, add_special_tokens=special)).ids
        strs = [tokenizer.id_to_token(i) for i in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": await workers.max_model_len(req.model), "tokens": ids,
                "token_strs": strs}  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = parse_request(DetokenizeRequest, await _body(request))
        tokenizer = await _tokenizer(req.model)
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        if bad := [t for t in req.tokens if not 0 <= t < vocab]:
            raise APIError(400, f"token ids past the model's vocabulary of {vocab}: {bad[:8]}", param="tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, req.tokens, skip_special_tokens=False)}

    async def _renderer(model: str) -> ChatRenderer:
        """The chat renderer of ``model``'s workers: 503 where none wrote its chat template to Redis (or a model
        without one), 501 where the server cannot render it (no transformers)."""
        digests = chat_digests(await workers.live(), model)
        if digests is None:
            raise APIError(503, f"no live worker of {model!r} has its chat template in Redis", "service_unavailable")
        try:
            return await renderers.get(*digests)
        except ImportError as exc:
            message = f"tokenizing messages needs transformers beside the server: {exc}"
            raise APIError(501, message, "not_implemented") from None
        except LookupError as exc:
            raise APIError(503, str(exc), "service_unavailable") from None

    async def _tokenizer(model: str) -> Any:
        """The tokenizer of ``model`` a live worker wrote to Redis; 404 for a model not served, 503 without one."""
        await _served(model)
        names = await tokenizers.names(await workers.tokenizer_of(model))
        if names.tokenizer is None:
            raise APIError(503, f"no live worker of {model!r} has its tokenizer in Redis", "service_unavailable")
        return names.tokenizer

    async def _served(model: str) -> None:
        """``model`` among the models the queue's live workers serve: else 503 (none alive) or 404."""
        served = await workers.models()
        if not served:
            raise APIError(503, f"no live worker on queue {client.queue_name!r}", "service_unavailable")
        if model not in served:
            raise APIError(404, f"model {model!r} is not served here (served: {served})", param="model",
                           code="model_not_found")  # fmt: skip
        if len(served) > 1:  # served still (a rollout, one model at several paths), and said
            workers.warn(_mixed_models(client.queue_name, served))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _complete(request, ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(request, CompletionRequest)

    async def _complete(request: Request, kind: type) -> Any:
        wait = _answer_within(request, timeout)
        body = await _body(request)
        if kind is CompletionRequest:  # a prompt or a list of them: a job each
            req, jobs_fields = parse_completions(body)
        else:
            req, fields = parse(kind, body, tool_call_parser, reasoning_parser)
            jobs_fields = [fields]
        await _served(req.model)
        if len(jobs_fields) > 1:  # a request's jobs: <base>-0 .. <base>-<k-1>, so a header can name them all
            base = str(uuid.uuid4())
            jobs_fields = [{**fields, "job_id": f"{base}-{i}"} for i, fields in enumerate(jobs_fields)]
        # (Before the submit: a Redis error here left the jobs of a request answered 503 running for nobody.)
        names = await _token_names(req.model, req.num_logprobs is not None or req.prompt_logprobs is not None)
        jobs = list(await asyncio.gather(*(client.submit(**fit_to_context(f)) for f in jobs_fields)))  # one batch
        job, ids = jobs[0], _job_headers(jobs)
        chat = kind is ChatCompletionRequest
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            echo = req.prompts() if not chat and req.echo else None  # (text prompts: job_fields refuses the others)
            if chat and req.echoed:  # (vLLM's chat echo: the first chunk's text)
                echo = [req.echoed]
            chunks = ChunkWriter(
                job.id,
                req.model,
                chat,
                req.n,
                req.num_logprobs,
                echo,
                include_usage,
                req.continuous_usage,
                names,
                tools=req.tool_plan() if chat else None,
                reasoning=req.reasoning_plan() if chat else None,
                include_reasoning=not chat or req.include_reasoning is not False,
                echo_only=not chat and req.echo_only,
            )
            try:
                early, events = await _start_stream(request, jobs, wait)
            except ConnectionAbortedError:  # (its jobs canceled already)
                return Response(status_code=499, headers=ids)
            stream = _sse(jobs, chunks, timeout, metrics.streams, early, events)
            return StreamingResponse(stream, media_type="text/event-stream", headers=ids)
        try:
            results = await _results_unless_gone(request, jobs, wait)
        except ConnectionAbortedError:  # its jobs are canceled; the status (nginx's "client closed request") is logged
            return Response(status_code=499, headers=ids)
        if chat:
            body = chat_response(job.id, req.model, req, results[0], names)
        else:
            body = completion_response(job.id, req.model, req, results, names)
        return JSONResponse(body, headers=ids)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        """OpenAI's Responses API: the chat job its request means, answered as a response or its events."""
        wait = _answer_within(request, timeout)
        req, chat, fields = parse_responses(await _body(request), tool_call_parser, reasoning_parser)
        await _served(req.model)
        names = await _token_names(req.model, chat.num_logprobs is not None)  # (before the submit, as the chat's)
        job = await client.submit(**fit_to_context(fields))
        ids = _job_headers([job])
        plans = chat.tool_plan(), chat.num_logprobs, names, chat.reasoning_plan()
        writer = ResponseWriter(job.id, req.model, req, *plans)
        try:
            if req.stream:
                early, events = await _start_stream(request, [job], wait)
                stream = _response_sse(job, writer, timeout, metrics.streams, early, events)
                return StreamingResponse(stream, media_type="text/event-stream", headers=ids)
            [result] = await _results_unless_gone(request, [job], wait)
        except ConnectionAbortedError:  # (its job canceled already)
            return Response(status_code=499, headers=ids)
        return JSONResponse(writer.whole(result), headers=ids)

    async def _token_names(model: str, wanted: bool) -> TokenNames:
        """The tokens of ``model`` by their text where a response shows tokens (no lookup otherwise: by id)."""
        return await tokenizers.names(await workers.tokenizer_of(model)) if wanted else BY_ID

    async def _start_stream(
        request: Request, jobs: list[AsyncGenerationJob], wait: float
    ) -> tuple[list[tuple[int, dict[str, Any]]], MergedEvents]:
        """The jobs' events, those before the headers read: a job refused among them is the request's status.
        ``--timeout`` counts from each job's last event: a stream that goes on is not cut (OpenAI's and vLLM's are
        not; a client's read timeout counts between chunks too). The first events wait ``wait`` at most, but where
        the stream's pings come sooner than the client stops reading: they keep it, and ``--timeout`` bounds them."""
        events = MergedEvents([each.events(timeout, skip_void=True, idle=True) for each in jobs])
        # (where the headers go before any event: the 504 comes in-stream)
        events.expect_first_within(timeout if wait > PING_EVERY_S else wait)
        try:
            first = asyncio.wait_for(_first_events(jobs, events, HEADERS_HOLD_S), wait)  # (the client waits)
            return await _unless_gone(request, jobs, first, wait), events
        except BaseException:  # (its jobs canceled already where they should be)
            events.close()
            raise

    return app


def _answer_within(request: Request, timeout: float) -> float:
    """Seconds the server waits for an answer's first byte: ``--timeout``, or less where the client says it stops
    reading sooner (the official clients send ``x-stainless-read-timeout``, 600 s by default, ``--timeout``'s own).
    The 504 must reach it first: a client that gave up on its own retried, submitting the job again each time."""
    try:
        read = float(request.headers.get("x-stainless-read-timeout", "inf"))
    except ValueError:
        return timeout
    if not 0 < read < float("inf"):
        return timeout
    return min(timeout, read - max(0.05 * read, min(1.0, 0.2 * read)))  # (the answer's own way back, and skew)


async def _results_unless_gone(
    request: Request, jobs: list[AsyncGenerationJob], timeout: float
) -> list[dict[str, Any]]:
    """The jobs' results; their cancel if the client goes away first; a job's failure as an API error."""
    waits = [asyncio.ensure_future(job.result(timeout)) for job in jobs]
    try:
        return await _unless_gone(request, jobs, asyncio.gather(*waits), timeout)
    finally:  # one failed: the others' polls stop too (a failed gather leaves its children running)
        for wait in waits:
            wait.cancel()


async def _first_events(
    jobs: list[AsyncGenerationJob], events: MergedEvents, hold: float
) -> list[tuple[int, dict[str, Any]]]:
    """The events that come before any byte of the response: every job's first, or once one came, those within
    ``FIRST_EVENTS_GRACE_S``; none if none came within ``hold`` (jobs queued behind others). A job the worker
    refuses among them (a prompt too long) is the request's status, 400, as without streaming (OpenAI and vLLM
    check before they stream), not 200 and an error chunk."""
    early: list[tuple[int, dict[str, Any]]] = []
    seen: set[int] = set()
    deadline = time.monotonic() + hold
    while len(seen) < len(jobs):
        wait = deadline - time.monotonic()
        if wait <= 0:
            break
        try:
            got = await events.get(wait)
        except NothingYet:  # (a stream's own TimeoutError, its job past --timeout, is the request's 504)
            break
        if got is None:
            break
        i, event = got
        reason = event.get("finish_reason")
        if reason == "error":
            raise JobFailed.of_event(jobs[i].id, event)
        if reason == "abort" and not event["text"]:
            raise JobCanceled(jobs[i].id, "the job was canceled")
        if not early:
            deadline = time.monotonic() + FIRST_EVENTS_GRACE_S
        early.append(got)
        seen.add(i)
    return early


async def _unless_gone(request: Request, jobs: list[AsyncGenerationJob], wait: Any, timeout: float) -> Any:
    """What ``wait`` (an awaitable about ``jobs``) gives; their cancel if the client goes away first (or one
    fails: no one will read the others); a job's failure as an API error."""
    waiting = asyncio.ensure_future(wait)
    try:
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=0.25)
            if done:
                return waiting.result()
            if await request.is_disconnected():
                raise ConnectionAbortedError
    except (TimeoutError, asyncio.TimeoutError):  # (wait_for's is not the builtin before Python 3.11)
        _cancel_all_soon(jobs)
        raise _with_jobs(_timed_out(timeout), jobs) from None
    except (JobFailed, JobCanceled) as exc:
        if len(jobs) > 1:
            _cancel_all_soon(jobs)
        raise _with_jobs(_job_error(exc), jobs) from None
    except (ConnectionAbortedError, asyncio.CancelledError):
        _cancel_all_soon(jobs)
        raise
    except Exception:  # Redis away, events that cannot be read: no one will read the jobs
        _cancel_all_soon(jobs)
        raise
    finally:
        waiting.cancel()
        # Retrieved, whatever it ended with: a gather cancelled after a child failed (or that a child's failure ends
        # as the cancel lands) logged "exception was never retrieved" with its traceback, a disconnect each.
        waiting.add_done_callback(lambda f: f.cancelled() or f.exception())


def _mixed_models(queue: str, served: list[str]) -> str:
    """The workers on the queue name several models (a rollout, a mistake, one model at several paths): a job names
    no model and runs on whichever worker takes it first, so the answer may come from any of them."""
    return (
        f"the workers on queue {queue!r} serve several models ({', '.join(served)}), and a job runs on whichever "
        "takes it: give each model a queue of its own, and one model at several paths one --served-model-name"
    )


def _with_jobs(err: APIError, jobs: list[AsyncGenerationJob]) -> APIError:
    err.headers.update(_job_headers(jobs))
    return err


def _job_headers(jobs: list[AsyncGenerationJob]) -> dict[str, str]:
    """``x-roseinfer-job-id``: the jobs' ids; past ``MAX_IDS_IN_HEADER`` the first (``<base>-0``) and their count.
    ``x-request-id`` (OpenAI's, which its clients keep as ``_request_id``): the first job's id."""
    first = {"x-request-id": jobs[0].id}
    if len(jobs) <= MAX_IDS_IN_HEADER:
        return {**first, "x-roseinfer-job-id": ",".join(job.id for job in jobs)}
    return {**first, "x-roseinfer-job-id": jobs[0].id, "x-roseinfer-job-count": str(len(jobs))}


def _cancel_all_soon(jobs: list[AsyncGenerationJob]) -> None:
    for job in jobs:
        _cancel_soon(job)


def _job_error(exc: JobFailed | JobCanceled) -> APIError:
    if isinstance(exc, JobCanceled):
        return _not_to_retry(APIError(500, "the job was canceled", "server_error"))
    # Only a job the worker found at fault is the client's (400): a timeout, a failed step, an abandoned job are not.
    if exc.error_type == "invalid_request":
        return APIError(400, exc.reason, code=exc.error_code)
    if exc.error_type == "timeout":
        return _not_to_retry(APIError(504, exc.reason, "timeout"))
    return APIError(500, exc.reason, "server_error")


def _timed_out(timeout: float) -> APIError:
    """The request outlived ``--timeout`` (its jobs are canceled)."""
    return _not_to_retry(APIError(504, f"no result within {timeout:g} s", "timeout"))


MAX_BODY_BYTES = 16 * 2**20  # far past any model's context in text: a 30 MB prompt to /tokenize took 2.6 GB


async def _body(request: Request) -> Any:
    """The request's JSON, or a 400 saying why not (a 413 past ``MAX_BODY_BYTES``)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:  # (refused before it is read)
        raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
    raw = bytearray()
    async for chunk in request.stream():  # (a body sent without its length, in chunks: counted as it comes)
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
    try:
        body = json.loads(raw)
    except RecursionError:  # arrays nested past the parser's depth: JSON, but no request
        raise APIError(400, "the request body is nested too deeply") from None
    except ValueError as exc:  # (not JSON, not UTF-8, or an integer past Python's 4300 digits)
        raise APIError(400, f"the request body is not valid JSON ({exc})") from None
    if (surrogate := lone_surrogate(body)) is not None:  # (a response echoing it could not be written as UTF-8)
        raise APIError(
            400, f"the request body is not valid Unicode: a lone surrogate {surrogate!r} (half a UTF-16 pair)"
        )
    return body


def _not_to_retry(err: APIError) -> APIError:
    """The official clients retry a status >= 500 twice unless told not to: a request that timed out (or whose job
    an operator canceled) would be submitted twice more, adding load to a queue already behind."""
    err.headers["x-should-retry"] = "false"
    return err


async def _sse(
    jobs: list[AsyncGenerationJob],
    chunks: ChunkWriter,
    timeout: float,
    open_streams: Gauge,
    early: list[tuple[int, dict[str, Any]]],
    events: MergedEvents,
) -> AsyncIterator[str]:
    """The chunks of the jobs' events, ``(job i, event)``: those that came before the headers, then the others as
    they come. Job i's samples are choices i * n .. i * n + n - 1 (one job but for a completion of several prompts);
    the usage of them all at the end. A job's error ends the stream and cancels the others."""
    finished, finals = False, []  # the jobs' final events, for the usage of them all
    sent: set[int] = set()  # the jobs some of whose text went out
    ended: set[int] = set()  # the choices whose finish went out (a sample of n > 1 ends before its job)
    open_streams.inc()
    try:
        for i, event in early:
            chunks.note_prompt(i, event)
        for index in range(len(jobs) * chunks.n):
            yield _data(chunks.piece(chunks.echo[index // chunks.n] if chunks.echo else "", first=True, index=index))
        async for got in events.after(early):
            if got is None:  # nothing for a while (jobs queued): a comment line, which clients skip, keeps it open
                yield PING
                continue
            i, event = got
            job, base = jobs[i], i * chunks.n
            if chunks.echo_only:
                event = without_output(event)
            if event.get("reset") and i in sent:
                raise StreamRestarted(job.id)  # text already sent cannot be taken back
            reason = event.get("finish_reason")
            if reason == "error":
                raise JobFailed.of_event(job.id, event)
            if event["text"] or event.get("logprobs"):
                sent.add(i)
            chunks.count(i, event)
            index = base + event.get("index", 0)
            if reason == "abort":  # canceled (or stopped): an error, as without streaming, not a whole answer
                if event["text"] and (chunk := chunks.piece(event["text"], index=index, event=event)):
                    yield _data(chunk)
                raise JobCanceled(job.id, "the job was canceled")
            shows_logprobs = chunks.logprobs is not None and event.get("logprobs")  # tokens whose text waits
            if event["text"] or shows_logprobs or (reason is not None and chunks.n == 1):
                end = None if chunks.n > 1 else reason
                if (chunk := chunks.piece(event["text"], end, index=index, event=event)) is not None:
                    yield _data(chunk)
            if event.get("sample_finish_reason") and reason is None and index not in ended:  # as OpenAI, at once
                ended.add(index)
                yield _data(chunks.piece("", event["sample_finish_reason"], index=index))
            if reason is not None and chunks.n > 1:  # each sample ends with its own reason: the result has them
                result = await job.result(timeout)
                result = without_output(result) if chunks.echo_only else result
                for choice in result.get("choices") or []:
                    if base + choice["index"] not in ended:
                        yield _data(chunks.piece("", choice["finish_reason"], index=base + choice["index"]))
            if reason is not None:
                finals.append(event)
                if len(finals) == len(jobs):
                    break
        if chunks.include_usage:
            yield _data(chunks.usage(total_usage(finals)))
        yield "data: [DONE]\n\n"
        finished = True
    except STREAM_ERRORS as exc:
        path = "/v1/chat/completions" if chunks.chat else "/v1/completions"
        yield _data(_stream_error(exc, timeout, _PROMPT_FIELDS[path]).body())
        yield "data: [DONE]\n\n"
    finally:
        open_streams.dec()
        events.close()
        if not finished:
            _cancel_all_soon(jobs)


STREAM_ERRORS = (JobFailed, JobCanceled, StreamRestarted, StreamGap, ProtocolError, TimeoutError, RedisError)


def _stream_error(exc: Exception, timeout: float, prompt_field: str | None = None) -> APIError:
    """What ends a stream once its headers went out, as the error it sends (a prompt too long names
    ``prompt_field``, as the status it would have been names it)."""
    if isinstance(exc, (JobFailed, JobCanceled)):
        err = _job_error(exc)
        if err.code == "context_length_exceeded" and err.param is None:
            err.param = prompt_field
        return err
    if isinstance(exc, NoFirstEvent):  # (the headers went ahead of the first event, which never came)
        return _not_to_retry(APIError(504, str(exc), "timeout"))
    if isinstance(exc, TimeoutError):  # a job sent nothing for --timeout
        return _not_to_retry(APIError(504, f"no new token within {timeout:g} s", "timeout"))
    if isinstance(exc, RedisError):  # Redis went away past the client's retries: said, not a cut stream
        return APIError(503, f"Redis is unavailable: {exc}", "service_unavailable")
    return APIError(500, str(exc), "server_error")


async def _response_sse(
    job: AsyncGenerationJob,
    writer: ResponseWriter,
    timeout: float,
    open_streams: Gauge,
    early: list[tuple[int, dict[str, Any]]],
    events: MergedEvents,
) -> AsyncIterator[str]:
    """A response's typed events from its job's: created, the text (or calls) as it comes, completed; an error
    event where the job fails, and its cancel where the client goes away."""
    finished = False
    open_streams.inc()
    try:
        for event in writer.opening():
            yield _typed(event)
        async for got in events.after(early):
            if got is None:
                yield PING
                continue
            event = got[1]
            if event.get("reset") and writer.fed:  # (the reasoning parser's held "<think>" and logprobs too)
                raise StreamRestarted(job.id)  # text already sent (thinking too) cannot be taken back
            reason = event.get("finish_reason")
            if reason == "error":
                raise JobFailed.of_event(job.id, event)
            for out in writer.piece(event["text"], event):
                yield _typed(out)
            if reason == "abort":  # canceled: an error, as without streaming
                raise JobCanceled(job.id, "the job was canceled")
            if reason is not None:
                for out in writer.closing(reason, event.get("usage") or {}):
                    yield _typed(out)
                break
        finished = True
    except STREAM_ERRORS as exc:
        for out in writer.failed(_stream_error(exc, timeout, _PROMPT_FIELDS["/v1/responses"])):
            yield _typed(out)
    finally:
        open_streams.dec()
        events.close()
        if not finished:
            _cancel_soon(job)


def _typed(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


class NoFirstEvent(TimeoutError):
    """A stream whose headers went before any event of its jobs (queued behind others) got none in time."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no result within {seconds:g} s")


class NothingYet(Exception):
    """``MergedEvents.get``'s own wait ran out: not a stream's TimeoutError, which is its job past ``--timeout``."""


class MergedEvents:
    """``(i, event)`` of each stream i as its events come, each read by a task of its own (a wait for the next one
    can time out without losing any); a stream's error once it comes."""

    def __init__(self, streams: list[AsyncIterator[dict[str, Any]]]) -> None:
        self._first_within: tuple[float, float] | None = None  # (seconds, by when: monotonic) for ``after``
        self._arrived: asyncio.Queue = asyncio.Queue()
        self._left = len(streams)
        self._readers = [asyncio.create_task(self._read(i, stream)) for i, stream in enumerate(streams)]

    async def _read(self, i: int, stream: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for event in stream:
                self._arrived.put_nowait((i, event, None))
        except Exception as exc:
            self._arrived.put_nowait((i, None, exc))
            return
        self._arrived.put_nowait((i, None, None))

    async def get(self, timeout: float | None = None) -> tuple[int, dict[str, Any]] | None:
        """The next ``(i, event)``; None once every stream ended; ``NothingYet`` past ``timeout`` seconds."""
        while self._left:
            arrived = self._arrived.get()
            try:
                i, event, exc = await (arrived if timeout is None else asyncio.wait_for(arrived, timeout))
            except asyncio.TimeoutError:  # (not the builtin TimeoutError before Python 3.11)
                raise NothingYet from None
            if exc is not None:
                raise exc
            if event is not None:
                return i, event
            self._left -= 1
        return None

    def expect_first_within(self, seconds: float) -> None:
        """``after`` raises ``NoFirstEvent`` where no event came within ``seconds`` from now."""
        self._first_within = seconds, time.monotonic() + seconds

    async def after(self, early: list[tuple[int, dict[str, Any]]]) -> AsyncIterator[tuple[int, dict[str, Any]] | None]:
        """``early`` (events already taken), then the rest as they come; None each ``PING_EVERY_S`` seconds nothing
        came (the stream's keep-alive). ``NoFirstEvent`` where none came at all in time (``expect_first_within``)."""
        for got in early:
            yield got
        first = self._first_within if not early else None
        while True:
            wait = PING_EVERY_S
            if first is not None:
                left = first[1] - time.monotonic()
                if left <= 0:
                    raise NoFirstEvent(first[0])
                wait = min(wait, left)
            try:
                got = await self.get(wait)
            except NothingYet:
                yield None
                continue
            if got is None:
                return
            first = None
            yield got

    def close(self) -> None:
        for reader in self._readers:
            reader.cancel()


PING = ": ping\n\n"  # an SSE comment: every client skips it


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


_CANCELING: set[asyncio.Future] = set()  # the cancels on their threads, which a stop waits for (``_lifespan``)


def _cancel_soon(job: AsyncGenerationJob) -> None:
    """Cancel the job on a thread, not awaited: this runs while the request's task is being cancelled."""
    loop = asyncio.get_running_loop()
    done = loop.run_in_executor(None, job._sync.cancel)
    _CANCELING.add(done)
    done.add_done_callback(_CANCELING.discard)
    log.info("job %s canceled: its client went away", job.id)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """At a stop: the requests the server cancelled (its grace over) cancel their jobs before the process ends (uvicorn
    raises the stop's signal again once it has served; a cancel still on its thread was lost, its job ran on)."""
    yield
    for _ in range(10):  # (the cancelled requests' clean-up runs on the loop: a few turns of it, 0.1 s at most)
        await asyncio.sleep(0.01)
        if _CANCELING:
            break
    if _CANCELING:
        await asyncio.wait(set(_CANCELING), timeout=5)


# ----- the command -------------------------------------------------------------------------------------
SHUTDOWN_GRACE_S = 5  # (docker-compose.yml gives the server longer than this to stop)


def run_server(
    redis_url: str,
    queue: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    timeout: float = 600.0,
    client: AsyncClient | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    allowed_origins: list[str] | None = None,
) -> int:
    import uvicorn

    app = create_app(
        client or AsyncClient(redis_url, queue), api_key, timeout, tool_call_parser, reasoning_parser, allowed_origins
    )
    # What is loaded lives as long as the server: a full collection walking it paused every request ~25 ms.
    gc.collect()
    gc.freeze()
    log.warning("serving the OpenAI API for queue %r on http://%s:%d/v1", queue, host, port)
    if client is None:  # (served anyway, as a worker waits for Redis: /health and requests say 503 until it answers)
        try:
            with connect(redis_url, socket_connect_timeout=2, socket_timeout=2) as probe:
                probe.ping()
        except REDIS_UNAVAILABLE as exc:
            url = redacted_url(redis_url)
            log.warning("Redis does not answer at %s (%s): requests get 503 until it does", url, exc)
    with contextlib.suppress(KeyboardInterrupt):
        # A stop waits this long for open requests, then cancels them (their jobs too): without a bound it waited
        # for every stream to end, and the orchestrator's kill then left their jobs running for no one.
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    return 0
