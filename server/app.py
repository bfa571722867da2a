"""The OpenAI-compatible HTTP API: thin routes over the scheduler and the engine."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import secrets
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dflash_core.distributed import stop_followers
from dflash_core.settings import Settings, is_loopback

from . import chat, content_encoding, messages, responses
from .errors import APIError, install_error_handlers
from .generation import ChatResponder, CompletionResponder
from .schemas import ChatCompletionRequest, CompletionRequest
from .serving import ServerState, respond, start_chat, start_run

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"  # the page: plain files shipped in the package, no build step


def create_app(settings: Settings, channel=None) -> FastAPI:
    """`channel`: this is rank 0 of a distributed group (dflash_core/distributed.py); the other
    ranks run `distributed.follow`."""
    state = ServerState(settings, channel)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.scheduler.start()
        loading = asyncio.create_task(state.pool.load_startup())
        yield
        loading.cancel()
        if channel is not None:  # after the drain: the other ranks finish too
            with contextlib.suppress(Exception):
                await state.scheduler.call(lambda: stop_followers(channel))
        # A broken group may hold the worker in a forward that never returns: do not wait for it.
        state.scheduler.stop(timeout=0 if channel is not None and channel.failure else 30)

    app = FastAPI(title="dflash", lifespan=lifespan)
    app.state.dflash = state
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.add_middleware(InternalErrors)  # first added, so inside the counter and CORS
    # Inside the key and Host checks: a body is read only for a request they let through (one
    # without the key cannot hold 16 MB of the server's memory per connection).
    app.add_middleware(LimitBody, limit=settings.server.max_request_bytes, seconds=settings.server.body_timeout)
    if settings.server.api_key:  # before the body is read: a bad key is a 401 whatever the body
        app.add_middleware(RequireKey, key=settings.server.api_key, open_metrics=settings.server.open_metrics)
    if settings.server.loopback:
        app.add_middleware(LoopbackHosts, extra=settings.server.allowed_hosts)
    app.add_middleware(RefuseWhileDraining, state=state)
    app.add_middleware(CountRequests, counter=state.metrics.requests)
    install_error_handlers(app)
    if settings.server.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.server.cors_origins, allow_methods=["*"],
                           allow_headers=["*"])

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if state.scheduler.failure:
            return JSONResponse({"status": "error", "error": state.scheduler.failure}, status_code=503)
        pool = state.pool
        models = [m.name for m in pool.served()]
        # A default model the demo stands in for is reported, but the server does serve.
        errors = {k: v for k, v in pool.loading_errors.items() if not pool.stood_in_for(k)}
        if errors:
            return JSONResponse({"status": "error", "errors": errors, "models": models}, status_code=503)
        if not pool.ready:
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})
        if pool.fallback:
            return {"status": "ok", "models": models, "default_model": pool.default_name, "fallback": pool.fallback}
        return {"status": "ok", "models": models, "default_model": pool.default_name}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_entry(name: str) -> dict:
        """OpenAI's fields and Anthropic's (`type`, `display_name`, `created_at`,
        `max_input_tokens`) side by side: both SDKs list models from this one route."""
        loaded = {m.name: m for m in state.pool.served()}
        created = loaded[name].created if name in loaded else 0
        spec = next((m for m in state.settings.models if m.name == name), None)
        context = loaded[name].engine.max_context if name in loaded else (spec.max_context if spec else None)
        entry = {"id": name, "object": "model", "owned_by": "dflash", "created": created, "type": "model",
                 "display_name": name,
                 "created_at": datetime.datetime.fromtimestamp(created, datetime.timezone.utc).isoformat()}
        if context:
            entry["max_input_tokens"] = context - 1  # a prompt leaves room for one token
        return entry

    @app.get("/", include_in_schema=False)
    async def page():
        """The built-in page (server/static/): a chat playground and the live view."""
        return FileResponse(STATIC / "index.html")

    @app.get("/page/config", include_in_schema=False)
    async def page_config():
        """What the page must know before its first API call: whether to ask for the key."""
        return {"api_key_required": bool(settings.server.api_key)}

    @app.get("/v1/dflash/live")
    async def live():
        """What the page's live view shows: per model, the last minutes and totals since start."""
        snapshots = state.pool.snapshots
        return {
            "time": time.time(),
            "active_requests": state.scheduler.active,
            "queued_requests": state.scheduler.waiting,
            "models": state.live.view(),
            "memory": {"active_bytes": mx.get_active_memory(), "prefix_cache_bytes": snapshots.nbytes,
                       "prefix_cache_budget_bytes": snapshots.budget_bytes},
        }

    @app.get("/v1/models")
    async def list_models():
        data = [model_entry(name) for name in state.pool.servable()]
        # (Anthropic's list is paged: one page here.)
        return {"object": "list", "data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        if model in state.pool.loading_errors:
            raise APIError(503, f"model {model!r} could not be loaded: {state.pool.loading_errors[model]}",
                           type="server_error", code="model_unavailable")
        if model not in state.pool.names():
            raise APIError(404, f"The model {model!r} does not exist", param="model", code="model_not_found")
        return model_entry(model)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        started = await start_chat(state, body, time.perf_counter())
        responder = ChatResponder(started.run, started.served.name, started.output)
        return await respond(state, "chat", request, started.run, responder, stream=bool(body.stream),
                             include_usage=bool(body.stream_options and body.stream_options.include_usage))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        arrival = time.perf_counter()
        chat.refuse_unsupported(body)
        served = await state.pool.get(body.model)
        try:
            prompt = await asyncio.to_thread(chat.completion_prompt, body, served.engine.tokenizer,
                                             served.engine.target.vocab_size, served.engine.max_context)
            run = start_run(state, served, body, prompt, None, arrival, logprobs=body.logprobs)
        except BaseException:
            state.pool.release(served)
            raise
        return await respond(state, "completions", request, run, CompletionResponder(run, served.name, body.stop),
                             stream=bool(body.stream),
                             include_usage=bool(body.stream_options and body.stream_options.include_usage))

    app.include_router(responses.router(state))
    app.include_router(messages.router(state))
    return app


API_PATHS = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
             "/v1/models", "/health", "/metrics"}


class RequireKey:
    """The API key on every /v1 path, on the API docs (/docs, /redoc, /openapi.json) and on
    /metrics unless `open_metrics` (/health stays open), sent as OpenAI clients do
    (`Authorization: Bearer <key>`) or as Anthropic's do (`x-api-key: <key>`)."""

    PROTECTED = ("/docs", "/redoc", "/openapi.json")

    def __init__(self, app, key: str, open_metrics: bool = False):
        self.app, self.key = app, key.encode()
        self.protected = self.PROTECTED + (() if open_metrics else ("/metrics",))

    def _guarded(self, path: str) -> bool:
        return path.startswith("/v1/") or any(path == p or path.startswith(p + "/") for p in self.protected)

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not self._guarded(path):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        # Bytes as sent: compare_digest refuses non-ASCII str, and a wrong key is a 401, not a 500.
        bearer = scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.key)
        if not (bearer or secrets.compare_digest(headers.get(b"x-api-key", b"").strip(), self.key)):
            error = APIError(401, "invalid or missing API key (send Authorization: Bearer <key> or x-api-key: <key>)",
                             type="authentication_error", code="invalid_api_key")
            return await error.response(path)(scope, receive, send)
        await self.app(scope, receive, send)


class LoopbackHosts:
    """Bound to loopback, answer only requests whose Host is a loopback name (or one of `extra`):
    a web page that rebinds its own DNS name to 127.0.0.1 cannot reach a keyless local server."""

    def __init__(self, app, extra=()):
        self.app, self.extra = app, {h.lower() for h in extra}

    def _allowed(self, host: bytes) -> bool:
        text = host.decode("latin-1").lower()
        name = text[1:].partition("]")[0] if text.startswith("[") else text.rpartition(":")[0] if ":" in text else text
        return is_loopback(name) or name in self.extra or text in self.extra

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = dict(scope.get("headers") or []).get(b"host", b"")
        if not self._allowed(host):
            error = APIError(421, f"Host {host.decode('latin-1')!r} is not this server's: it listens on a loopback "
                                  "address (add the name to server.allowed_hosts to accept it)", code="invalid_host")
            return await error.response(scope.get("path", ""))(scope, receive, send)
        await self.app(scope, receive, send)


class LimitBody:
    """Bodies over `limit` bytes are a 413 in the API's error shape: by Content-Length before
    anything is read, else once the received body passes the limit (it is read here, then handed
    on whole). A body not complete within `seconds` is a 408: a client that stops sending would
    otherwise hold what it sent so far, and its connection, for as long as it likes. A compressed
    body is decoded here, under the same limit (server/content_encoding.py)."""

    def __init__(self, app, limit: int, seconds: Optional[float] = None):
        self.app, self.limit, self.seconds = app, limit, seconds

    def _too_large(self, path: str):
        return APIError(413, f"the request body is larger than {self.limit} bytes (server.max_request_bytes)",
                        code="request_too_large").response(path)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            return await self._too_large(path)(scope, receive, send)
        chunks, size = [], 0
        deadline = None if self.seconds is None else time.perf_counter() + self.seconds
        while True:
            try:
                message = await asyncio.wait_for(receive(), None if deadline is None else
                                                 max(0.0, deadline - time.perf_counter()))
            except asyncio.TimeoutError:
                error = APIError(408, f"the request body did not arrive within {self.seconds:g} s "
                                      "(server.body_timeout)", code="request_timeout")
                return await error.response(path)(scope, receive, send)
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._too_large(path)(scope, receive, send)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        headers = scope.get("headers") or []
        applied = content_encoding.codings(b",".join(v for k, v in headers if k == b"content-encoding"))
        if applied:  # decoded here, so that the API reads JSON, held to the same limit
            try:
                body = await asyncio.to_thread(content_encoding.decode, body, applied, self.limit)  # (off the event loop)
            except APIError as error:
                return await error.response(path)(scope, receive, send)
            framing = (b"content-encoding", b"content-length", b"transfer-encoding")  # (of the body as sent)
            scope = {**scope, "headers": [(k, v) for k, v in headers if k not in framing]
                     + [(b"content-length", str(len(body)).encode())]}
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnects, as the app expects them

        await self.app(scope, replay, send)


class RefuseWhileDraining:
    """During a shutdown's drain (server/process.py) new generations get 503; the rest answers."""

    def __init__(self, app, state):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.state.draining and scope.get("method") == "POST":
            error = APIError(503, "the server is shutting down", type="server_error", code="shutting_down",
                             headers={"Retry-After": "5"})
            return await error.response(scope.get("path", ""))(scope, receive, send)
        await self.app(scope, receive, send)


class InternalErrors:
    """An unexpected exception becomes the OpenAI-shaped 500 here, inside the request counter and
    CORS: Starlette's own last-resort handler sits outside every middleware."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            if started:  # a response is under way: nothing can replace it
                raise
            log.exception("unexpected error")
            error = APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
            response = error.response(scope.get("path", ""))
            await response(scope, receive, send)


class CountRequests:
    """ASGI middleware counting API responses by path and status (streams count when they start)."""

    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")

        # Known routes only: arbitrary paths would each add a time series for ever.
        endpoint = path if path in API_PATHS else next(
            (route for prefix, route in (("/v1/models/", "/v1/models/{model}"), ("/v1/responses/", "/v1/responses/{id}"))
             if path.startswith(prefix)), "other")

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.counter.labels(endpoint=endpoint, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
