"""The HTTP layer: routes that read and validate a request, hand it to the worker, and stream
its events back as OpenAI's JSON or server-sent events. No MLX work happens here, so the event
loop keeps answering (`/health`, `/v1/models`) while a generation runs.

    POST /v1/chat/completions   POST /v1/completions   (also without the /v1 prefix)
    GET  /v1/models   GET /health   GET /metrics
"""

from __future__ import annotations

import asyncio
import hmac
import json
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from .schema import ApiError, Served, chunk, parse_json, prepare, response, timings, usage_chunk
from .worker import Delta, Done, Failed, Job, QueueFull, Worker

DEFAULT_MAX_BODY = 8 << 20


def create_app(served: Served, worker: Worker, api_key: str | None = None, max_body: int = DEFAULT_MAX_BODY) -> FastAPI:
    """The app; the worker thread starts and stops with the app's lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    app = FastAPI(title="mlxspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served, app.state.worker = served, worker
    if api_key:
        app.add_middleware(ApiKeyMiddleware, key=api_key)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=kind))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        return error_response(ApiError(500, f"internal error: {type(e).__name__}", type="server_error"))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    @app.get("/models", include_in_schema=False)
    async def models() -> dict:
        pair = served.pair
        return {"object": "list", "data": [{
            "id": served.model_id, "object": "model", "created": 0, "owned_by": "mlxspec",
            "target": str(getattr(pair, "target_path", "")),
            "draft": str(pair.draft_path) if pair.draft is not None and getattr(pair, "draft_path", None) else None,
            "context_length": served.context,
        }]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        gauges = {"queue_depth": worker.queued, "busy": int(worker.current is not None),
                  "prompt_cache_sessions": len(worker.cache.entries), "prompt_cache_bytes": worker.cache.nbytes()}
        return PlainTextResponse(worker.metrics.text(gauges), media_type="text/plain; version=0.0.4")

    async def generate(kind: str, request: Request):
        p = prepare(kind, await read_json(request, max_body), served)
        job = Job(p, asyncio.get_running_loop())
        try:
            worker.submit(job)
        except QueueFull as e:
            raise ApiError(429, str(e), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        headers = {"X-Mlxspec-Warning": "; ".join(p.warnings)} if p.warnings else {}
        if p.stream:
            return StreamingResponse(sse(job, served.model_id), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        return JSONResponse(await collect(job, request, served.model_id), headers=headers)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions", include_in_schema=False)
    async def chat_completions(request: Request):
        return await generate("chat", request)

    @app.post("/v1/completions")
    @app.post("/completions", include_in_schema=False)
    async def completions(request: Request):
        return await generate("completion", request)

    return app


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object, refusing one over `limit` bytes before reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {declared} bytes; the limit is {limit}", code="body_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise ApiError(413, f"the request body is over the limit of {limit} bytes", code="body_too_large")
    return parse_json(bytes(body))


async def sse(job: Job, model: str) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format. Leaving early (the client disconnected:
    Starlette closes this generator) cancels the job."""
    p = job.request
    try:
        if p.kind == "chat":
            yield _data(chunk(p, model, first=True))
        while True:
            ev = await job.events.get()
            if isinstance(ev, Delta):
                yield _data(chunk(p, model, ev.text))
            elif isinstance(ev, Failed):
                yield _data(ApiError(500, ev.message, type="server_error").body())
                return
            elif isinstance(ev, Done):
                last = chunk(p, model, finish=ev.finish_reason or "stop")
                last["timings"] = timings(ev.stats, ev.drafter)
                yield _data(last)
                if p.include_usage:
                    yield _data(usage_chunk(p, model, ev.stats))
                yield "data: [DONE]\n\n"
                return
    finally:
        job.cancel()  # a no-op once the job is done


async def collect(job: Job, request: Request, model: str) -> dict:
    """The whole reply; a client that goes away while it waits cancels the job."""
    parts: list[str] = []
    while True:
        try:
            ev = await asyncio.wait_for(job.events.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                raise ApiError(499, "the client closed the request", code="client_closed") from None
            continue
        if isinstance(ev, Delta):
            parts.append(ev.text)
        elif isinstance(ev, Failed):
            raise ApiError(500, ev.message, type="server_error")
        elif isinstance(ev, Done):
            return response(job.request, model, "".join(parts), ev.finish_reason or "stop", ev.stats, ev.drafter)


def _data(doc: dict) -> str:
    return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n"


class ApiKeyMiddleware:
    """Every path but /health needs `Authorization: Bearer <key>` (a plain ASGI middleware, so
    streamed responses and disconnects pass through untouched)."""

    def __init__(self, app, key: str):
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, given = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.key):
                e = ApiError(401, "a valid API key is required: send Authorization: Bearer <key>",
                             type="authentication_error", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})
                await error_response(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)
