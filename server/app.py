"""The OpenAI-compatible HTTP API: thin routes over the scheduler and the engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import Optional

from fastapi import Depends, FastAPI, Request
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
    app.add_middleware(CountRequests, counter=state.metrics.requests)
    install_error_handlers(app)
    if settings.server.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.server.cors_origins, allow_methods=["*"],
                           allow_headers=["*"])

    def authorized(request: Request) -> None:
        key = settings.server.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), key):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                           type="authentication_error", code="invalid_api_key")

    @app.get("/health")
    async def health():
        if state.pool.loading_error:
            return JSONResponse({"status": "error", "error": state.pool.loading_error}, status_code=503)
        if not state.pool.ready:
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})
        return {"status": "ok", "models": [m.name for m in state.pool.served()]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def list_models():
        loaded = {m.name: m for m in state.pool.served()}
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "owned_by": "dflash",
                 "created": loaded[name].created if name in loaded else 0}
                for name in state.pool.names()
            ],
        }

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        chat.refuse_unsupported(body)
        served = await state.pool.get(body.model)
        prompt = chat.chat_prompt(body, served.engine.tokenizer, served.markers, served.template_defaults(settings))
        parser = ChatOutputParser(served.markers, [t.model_dump() for t in body.tools or []], body.tool_choice,
                                  body.stop, prompt.starts_in_reasoning)
        run = _start(state, served, body, prompt, _stop_tokens(served, body))
        responder = ChatResponder(run, body.model, parser)
        return await _respond(state, "chat", request, run, responder, body)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request):
        chat.refuse_unsupported(body)
        served = await state.pool.get(body.model)
        prompt = chat.completion_prompt(body, served.engine.tokenizer)
        run = _start(state, served, body, prompt, None)
        return await _respond(state, "completions", request, run, CompletionResponder(run, body.model, body.stop), body)

    return app


def _stop_tokens(served: ServedModel, body: ChatCompletionRequest) -> Optional[set[int]]:
    """Gemma 4 follows a tool call with <|tool_response>, which is the caller's turn, not ours."""
    if not body.tools or served.markers.tool_format != "gemma4":
        return None
    hf = getattr(served.engine.tokenizer, "_tokenizer", served.engine.tokenizer)
    extra = hf.get_vocab().get("<|tool_response>")
    return served.engine.eos_token_ids | ({extra} if extra is not None else set())


def _start(state: ServerState, served: ServedModel, body, prompt: chat.Prompt, stop_tokens) -> Run:
    defaults = served.sampling_defaults(state.settings)
    max_tokens = chat.max_new_tokens(body, defaults)
    chat.check_context(len(prompt.tokens), max_tokens, served.engine.max_context)
    sampling = chat.sampling_params(body, defaults, served.engine.target.vocab_size)
    run = Run(state.scheduler, served, prompt, max_tokens, sampling, stop_tokens, state.settings.server.request_timeout)
    state.pool.acquire(served)  # not unloaded while in use; released in _respond
    try:
        run.submit()
    except Exception:
        state.pool.release(served)
        raise
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


class CountRequests:
    """ASGI middleware counting API responses by path and status (streams count when they start)."""

    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.counter.labels(endpoint=path, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
