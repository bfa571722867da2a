"""The OpenAI-compatible HTTP API: thin routes over the scheduler and the engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask

from dflash_core.settings import Settings

from . import chat
from .errors import APIError, install_error_handlers
from .generation import ChatResponder, ClientGone, CompletionResponder, Run, until_disconnect
from .metrics import Metrics
from .models import ModelPool, ServedModel
from .output_text import ChatOutputParser
from .scheduler import Scheduler
from .schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)


class ServerState:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.scheduler = Scheduler(queue_size=settings.server.queue_size, max_active=settings.server.max_active)
        self.pool = ModelPool(settings, self.scheduler)
        self.metrics = Metrics(self.scheduler)


def create_app(settings: Settings) -> FastAPI:
    state = ServerState(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.scheduler.start()
        loading = asyncio.create_task(state.pool.load_startup())
        yield
        loading.cancel()
        state.scheduler.stop()

    app = FastAPI(title="dflash", lifespan=lifespan)
    app.state.dflash = state
    app.add_middleware(InternalErrors)  # first added, so inside the counter and CORS
    if settings.server.api_key:  # before the body is read: a bad key is a 401 whatever the body
        app.add_middleware(RequireKey, key=settings.server.api_key)
    app.add_middleware(CountRequests, counter=state.metrics.requests)
    install_error_handlers(app)
    if settings.server.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.server.cors_origins, allow_methods=["*"],
                           allow_headers=["*"])

    @app.get("/health")
    async def health():
        if state.scheduler.failure:
            return JSONResponse({"status": "error", "error": state.scheduler.failure}, status_code=503)
        if state.pool.loading_errors:
            return JSONResponse({"status": "error", "errors": state.pool.loading_errors,
                                 "models": [m.name for m in state.pool.served()]}, status_code=503)
        if not state.pool.ready:
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})
        return {"status": "ok", "models": [m.name for m in state.pool.served()]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_entry(name: str) -> dict:
        loaded = {m.name: m for m in state.pool.served()}
        return {"id": name, "object": "model", "owned_by": "dflash",
                "created": loaded[name].created if name in loaded else 0}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_entry(name) for name in state.pool.names()]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        if model not in state.pool.names():
            raise APIError(404, f"The model {model!r} does not exist", param="model", code="model_not_found")
        return model_entry(model)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        arrival = time.perf_counter()
        chat.refuse_unsupported(body)
        served = await state.pool.get(body.model)
        try:
            prompt = chat.chat_prompt(body, served.engine.tokenizer, served.markers, settings.template_defaults(served.settings))
            parser = ChatOutputParser(served.markers, [t.model_dump() for t in body.tools or []], body.tool_choice,
                                      body.stop, prompt.starts_in_reasoning)
            run = _start(state, served, body, prompt, _stop_tokens(served, body), arrival)
        except BaseException:
            state.pool.release(served)
            raise
        return await _respond(state, "chat", request, run, ChatResponder(run, body.model, parser), body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        arrival = time.perf_counter()
        chat.refuse_unsupported(body)
        served = await state.pool.get(body.model)
        try:
            prompt = chat.completion_prompt(body, served.engine.tokenizer, served.engine.target.vocab_size)
            run = _start(state, served, body, prompt, None, arrival)
        except BaseException:
            state.pool.release(served)
            raise
        return await _respond(state, "completions", request, run, CompletionResponder(run, body.model, body.stop), body)

    return app


def _stop_tokens(served: ServedModel, body: ChatCompletionRequest) -> Optional[set[int]]:
    """Gemma 4 follows a tool call with <|tool_response>, which is the caller's turn, not ours."""
    if not body.tools or served.tool_response_token is None:
        return None
    return served.engine.eos_token_ids | {served.tool_response_token}


def _start(state: ServerState, served: ServedModel, body, prompt: chat.Prompt, stop_tokens, arrival: float) -> Run:
    """Queue the generation (the model stays acquired until _respond finishes)."""
    defaults = state.settings.sampling_defaults(served.settings, served.loaded.generation_defaults)
    max_tokens = chat.max_new_tokens(body, defaults)
    chat.check_context(len(prompt.tokens), max_tokens, served.engine.max_context,
                       "messages" if isinstance(body, ChatCompletionRequest) else "prompt")
    sampling = chat.sampling_params(body, defaults, served.engine.target.vocab_size)
    run = Run(state.scheduler, served, prompt, max_tokens, sampling, stop_tokens,
              state.settings.server.request_timeout, started=arrival)
    run.submit()
    if body.user:
        log.info("request for %s from user %r", served.name, body.user)
    return run


async def _respond(state: ServerState, endpoint: str, request: Request, run: Run, responder, body):
    metrics = state.metrics
    finished = False

    def finish() -> None:  # exactly once, however the response ends
        nonlocal finished
        if not finished:
            finished = True
            run.cancel()
            run.record(metrics)
            state.pool.release(run.served)

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events():
            try:
                async for event in responder.stream(include_usage):
                    yield event
            except asyncio.CancelledError:  # the client went away: stop its generation now
                metrics.cancelled.labels(endpoint=endpoint).inc()
                raise
            finally:
                finish()

        # The background task also runs when the client left before the stream even started.
        return EventSourceResponse(events(), ping=15, background=BackgroundTask(finish))
    try:
        return await until_disconnect(request, responder.complete())
    except ClientGone:
        metrics.cancelled.labels(endpoint=endpoint).inc()
        return Response(status_code=499)
    finally:
        finish()


API_PATHS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}


class RequireKey:
    """`Authorization: Bearer <key>` on every /v1 path (health and metrics stay open)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1/"):
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        # Bytes as sent: compare_digest refuses non-ASCII str, and a wrong key is a 401, not a 500.
        if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
            response = APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                                type="authentication_error", code="invalid_api_key").response()
            return await response(scope, receive, send)
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
            response = APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").response()
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
        endpoint = path if path in API_PATHS else ("/v1/models/{model}" if path.startswith("/v1/models/") else "other")

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.counter.labels(endpoint=endpoint, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
