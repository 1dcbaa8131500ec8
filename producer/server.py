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
import functools
import gc
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from redis.exceptions import AuthenticationError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producer.aio import AsyncClient
from producer.chat_render import ChatRenderer, ChatRenderers, chat_digests
from producer.connection import REDIS_UNAVAILABLE, connect, redacted_url
from producer.generation_job import DEFAULT_RESULT_TTL
from producer.job_errors import ProtocolError, StreamGap
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
)
from producer.protocol import installed_version, mixed_models
from producer.reasoning import REASONING_PARSERS
from producer.responses_api import ResponseWriter, parse_responses
from producer.schema import lone_surrogate
from producer.server_jobs import CANCELING, answer_within, cancel_unseen_jobs, job_headers, results_unless_gone
from producer.server_sse import (
    PROMPT_FIELDS,
    chunk_stream,
    context_error_named,
    response_stream,
    start_stream,
    stop_open_streams,
)
from producer.token_names import BY_ID, TokenizerCache, TokenNames, digest_of
from producer.tool_calls import TOOL_CALL_PARSERS

log = logging.getLogger("roseinfer.server")


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


SAFE_METHODS = frozenset(("GET", "HEAD", "OPTIONS"))  # (the others may run a job: a page's are refused)
# What the API key guards: the OpenAI API, and (unlike vLLM's) the tokenizer's endpoints, where one request of the
# largest body took 2.5 GB to encode: with a key set, no caller without it spends the server's memory.
KEYED_PATHS = ("/v1/", "/tokenize", "/detokenize")


class AuthAndCount:
    """The API key's check and the requests' counts, as plain ASGI: ``@app.middleware("http")`` hands the endpoint
    a stream of its own, on which a client's disconnect never shows, so a client that left a non-streamed request
    never canceled its job."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        metrics: ServerMetrics,
        routes: list[BaseRoute],
        allowed_origins: list[str] | None = None,
    ) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.origins = {o.encode() for o in allowed_origins or ()}

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

        def count(status: int) -> None:  # (a refusal too: the histogram's count fell short of the requests')
            if path != "/metrics":
                self.metrics.requests.labels(label, str(status)).inc()
                self.metrics.latency.labels(label).observe(time.perf_counter() - started)

        origin = dict(scope["headers"]).get(b"origin")
        if origin is not None and scope["method"] not in SAFE_METHODS and not self.origins & {origin, b"*"}:
            # A web page's request (a browser names its page's origin): CORS keeps the page from reading the answer,
            # not from sending it (a form, text/plain, a body of no type: no preflight), and a job would run.
            err = APIError(403, f"requests from web pages of {origin.decode(errors='replace')} are refused: "
                           "--allowed-origins names the origins whose pages may call this API")  # fmt: skip
            count(403)
            await JSONResponse(err.body(), status_code=403)(scope, receive, send)
            return
        if self.expected is not None and any(p.startswith(KEYED_PATHS) for p in (path, scope["path"])):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = APIError(401, "invalid API key", param=None, code="invalid_api_key")
                count(401)
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return

        answered = False

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
    tokenizing = asyncio.Semaphore(TOKENIZE_AT_ONCE)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        field = next((f for path, f in PROMPT_FIELDS.items() if request.url.path.endswith(path)), None)
        # (a prompt too long: the field to shorten, as OpenAI names it, and max_tokens as the request named it)
        context_error_named(exc, field, getattr(request.state, "max_tokens_field", "max_tokens"))
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

    app.add_middleware(
        AuthAndCount, api_key=api_key, metrics=metrics, routes=app.routes, allowed_origins=allowed_origins
    )
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
            try:
                await client.connection.ping()
            except RedisConnectionError:  # (a pooled connection Redis dropped: a probe's 503 restarted a good server)
                await client.connection.ping()
            live = await workers.live()
        except Exception as exc:
            return JSONResponse({"status": "unavailable", "reason": f"Redis: {exc}"}, status_code=503)
        served = await workers.models()
        if not live:
            reason = f"no live worker on queue {client.queue_name!r}"
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        body = {"status": "ok", "workers": len(live), "models": served}
        return JSONResponse({**body, "warning": mixed_models(client.queue_name, served)} if len(served) > 1 else body)

    @app.get("/version")
    async def version() -> dict[str, str]:
        """vLLM's: the server's version (what clients and probes log)."""
        return {"version": installed_version()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The models the queue's live workers serve; 503 with none, as every other route answers then (an empty
        list made a client's ``models.list().data[0]`` an IndexError, where it could tell a 503)."""
        return {"object": "list", "data": [await _model_card(m) for m in await _live_models()]}

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
        req = await _parsed(request, functools.partial(parse_request, TokenizeRequest))
        tokenizer = await _tokenizer(req.model)
        if req.messages is not None:  # vLLM's chat form: rendered by the worker's chat template, as its job's
            job = req.chat_job()
            renderer = await _renderer(req.model)
            try:
                async with tokenizing:  # (as the prompt form: a few at once)
                    ids = await asyncio.to_thread(renderer.tokenize, job, bool(req.add_special_tokens))
            except Exception as exc:  # the template's own refusal (roles out of order ...), as the job would fail
                raise APIError(400, f"the chat template refused the messages: {exc}", param="messages") from None
        else:  # off the event loop, and without the GIL (encode held it: a 15 MB text stopped the server 10 s)
            special = req.add_special_tokens is not False
            async with tokenizing:  # (a few at once: one such text took 2 GB)
                [encoded] = await asyncio.to_thread(tokenizer.encode_batch, [req.prompt], add_special_tokens=special)
            ids = encoded.ids
        strs = [tokenizer.id_to_token(i) for i in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": await workers.max_model_len(req.model), "tokens": ids,
                "token_strs": strs}  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await _parsed(request, functools.partial(parse_request, DetokenizeRequest))
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

    async def _live_models() -> list[str]:
        served = await workers.models()
        if not served:
            raise APIError(503, f"no live worker on queue {client.queue_name!r}", "service_unavailable")
        return served

    async def _served(model: str) -> None:
        """``model`` among the models the queue's live workers serve: else 503 (none alive) or 404."""
        served = await _live_models()
        if model not in served:
            raise APIError(404, f"model {model!r} is not served here (served: {served})", param="model",
                           code="model_not_found")  # fmt: skip
        if len(served) > 1:  # served still (a rollout, one model at several paths), and said
            workers.warn(mixed_models(client.queue_name, served))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _complete(request, ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(request, CompletionRequest)

    async def _complete(request: Request, kind: type) -> Any:
        wait, created = answer_within(request, timeout), int(time.time())  # (OpenAI's created: the request's time)
        if kind is CompletionRequest:  # a prompt or a list of them: a job each
            req, jobs_fields = await _parsed(request, parse_completions)
        else:
            req, fields = await _parsed(request, lambda body: parse(kind, body, tool_call_parser, reasoning_parser))
            jobs_fields = [fields]
            if req.max_completion_tokens is not None:  # (the name a context error gives it)
                request.state.max_tokens_field = "max_completion_tokens"
        await _served(req.model)
        if len(jobs_fields) > 1:  # a request's jobs: <base>-0 .. <base>-<k-1>, so a header can name them all
            base = str(uuid.uuid4())
            jobs_fields = [{**fields, "job_id": f"{base}-{i}"} for i, fields in enumerate(jobs_fields)]
        # (Before the submit: a Redis error here left the jobs of a request answered 503 running for nobody.)
        names = await _token_names(req.model, req.num_logprobs is not None or req.prompt_logprobs is not None)
        try:
            jobs = list(await asyncio.gather(*(client.submit(**fit_to_context(f)) for f in jobs_fields)))  # one batch
        except RedisError as exc:  # (answered 503: a job that went in all the same is canceled once Redis answers)
            cancel_unseen_jobs(client, exc)
            raise
        job, ids = jobs[0], job_headers(jobs)
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
                early, events = await start_stream(request, jobs, wait, timeout)
            except ConnectionAbortedError:  # (its jobs canceled already)
                return Response(status_code=499, headers=ids)
            stream = chunk_stream(jobs, chunks, timeout, metrics.streams, early, events)
            return StreamingResponse(stream, media_type="text/event-stream", headers=ids)
        try:
            results = await results_unless_gone(request, jobs, wait)
        except ConnectionAbortedError:  # its jobs are canceled; the status (nginx's "client closed request") is logged
            return Response(status_code=499, headers=ids)
        # (off the event loop: a result of n = 64 samples with their logprobs took it seconds to shape and encode)
        if chat:
            body = await asyncio.to_thread(chat_response, job.id, req.model, req, results[0], names, created)
        else:
            body = await asyncio.to_thread(completion_response, job.id, req.model, req, results, names, created)
        return await asyncio.to_thread(JSONResponse, body, headers=ids)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        """OpenAI's Responses API: the chat job its request means, answered as a response or its events."""
        wait = answer_within(request, timeout)
        parser = functools.partial(parse_responses, tool_parser=tool_call_parser, reasoning_parser=reasoning_parser)
        req, chat, fields = await _parsed(request, parser)
        await _served(req.model)
        # (before the submit, as the chat's; a thinking model's too: its reasoning tokens are counted by them)
        names = await _token_names(req.model, chat.num_logprobs is not None or chat.reasoning_plan() is not None)
        try:
            job = await client.submit(**fit_to_context(fields))
        except RedisError as exc:
            cancel_unseen_jobs(client, exc)
            raise
        ids = job_headers([job])
        plans = chat.tool_plan(), chat.num_logprobs, names, chat.reasoning_plan()
        writer = ResponseWriter(job.id, req.model, req, *plans)
        try:
            if req.stream:
                early, events = await start_stream(request, [job], wait, timeout)
                stream = response_stream(job, writer, timeout, metrics.streams, early, events)
                return StreamingResponse(stream, media_type="text/event-stream", headers=ids)
            [result] = await results_unless_gone(request, [job], wait)
        except ConnectionAbortedError:  # (its job canceled already)
            return Response(status_code=499, headers=ids)
        return await asyncio.to_thread(lambda: JSONResponse(writer.whole(result), headers=ids))

    async def _token_names(model: str, wanted: bool) -> TokenNames:
        """The tokens of ``model`` by their text where a response shows tokens (no lookup otherwise: by id)."""
        return await tokenizers.names(await workers.tokenizer_of(model)) if wanted else BY_ID

    return app


TOKENIZE_AT_ONCE = 2  # /tokenize requests encoding at once (a text of the largest body took ~2 GB to encode)
MAX_BODY_BYTES = 16 * 2**20  # far past any model's context in text: a 30 MB prompt to /tokenize took 2.6 GB
T = TypeVar("T")
PARSE_ON_LOOP_BYTES = 2**20  # a smaller body is parsed on the event loop (~50 ms at most), not in a pooled thread


async def _parsed(request: Request, parse: Callable[[Any], T]) -> T:
    """``parse`` of the request's JSON body (its 400s raised as they are); a large body's off the event loop: the
    16 MB of token ids a request may send took 2 s to decode, check and parse, every other client waiting."""
    raw = await _body(request)
    if len(raw) < PARSE_ON_LOOP_BYTES:
        return parse(_decoded(raw))
    return await asyncio.to_thread(lambda: parse(_decoded(raw)))


async def _body(request: Request) -> bytearray:
    """The request's body, or a 413 past ``MAX_BODY_BYTES`` (a 400 for an upload cut short)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:  # (refused before it is read)
        raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
    raw = bytearray()
    try:
        async for chunk in request.stream():  # (a body sent without its length, in chunks: counted as it comes)
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
    except ClientDisconnect:  # (an upload cut short: an error's traceback in the log each, for no one)
        raise APIError(400, "the client went away before its request body ended") from None
    return raw


def _decoded(raw: bytearray) -> Any:
    """The body's JSON, or a 400 saying why not."""
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


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """At a stop: the requests the server cancelled (its grace over) cancel their jobs before the process ends (uvicorn
    raises the stop's signal again once it has served; a cancel still on its thread was lost, its job ran on)."""
    yield
    for _ in range(10):  # (the cancelled requests' clean-up runs on the loop: a few turns of it, 0.1 s at most)
        await asyncio.sleep(0.01)
        if CANCELING:
            break
    if CANCELING:
        await asyncio.wait(set(CANCELING), timeout=5)


# ----- the command -------------------------------------------------------------------------------------
def server_client(redis_url: str, queue: str, **options: Any) -> AsyncClient:
    """The server's client: its failed jobs kept as long as its others (RQ's year kept each failed request's payload,
    a 400 already answered: any caller of the API could fill Redis with them)."""
    return AsyncClient(redis_url, queue, **{"failure_ttl": DEFAULT_RESULT_TTL, **options})


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
    app = create_app(
        client or server_client(redis_url, queue), api_key, timeout, tool_call_parser, reasoning_parser, allowed_origins
    )
    # What is loaded lives as long as the server: a full collection walking it paused every request ~25 ms.
    gc.collect()
    gc.freeze()
    log.warning("serving the OpenAI API for queue %r on http://%s:%d/v1", queue, host, port)
    if client is None:  # (served anyway, as a worker waits for Redis: /health and requests say 503 until it answers)
        try:
            with connect(redis_url, socket_connect_timeout=2, socket_timeout=2) as probe:
                probe.ping()
        except AuthenticationError:
            raise  # (a login refused never mends: the command's own words for it and exit 2, as every command's)
        except REDIS_UNAVAILABLE as exc:
            url = redacted_url(redis_url)
            log.warning("Redis does not answer at %s (%s): requests get 503 until it does", url, exc)
    # A stop waits this long for open requests, then cancels them (their jobs too): without a bound it waited for
    # every stream to end, and the orchestrator's kill then left their jobs running for no one. A Ctrl-C comes back
    # from uvicorn once it has stopped, as a KeyboardInterrupt: the command's 130, as its other commands' (it was 0).
    grace = SHUTDOWN_GRACE_S
    _StoppingServer(
        uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=grace)
    ).run()
    return 0


class _StoppingServer(uvicorn.Server):
    """uvicorn's server, whose stop ends the open streams with the stopping error a second before its grace ends:
    cut by the grace, each ended without a word to its client, and a traceback in the log."""

    async def startup(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        loop = getattr(self, "loop", None)
        if not self.should_exit and loop is not None:  # (a signal's handler: to the loop through its pipe)
            loop.call_soon_threadsafe(loop.call_later, max(SHUTDOWN_GRACE_S - 1.0, 0.0), stop_open_streams)
        super().handle_exit(sig, frame)
