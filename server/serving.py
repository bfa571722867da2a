"""What every API surface shares: the server's state, starting a generation, answering with it.

Chat completions, Responses and Messages all become a `ChatCompletionRequest` (the last two by
translation in their own modules) and go through `start_chat`, so the prompt rendering, tool-call
and reasoning parsing, sampling and limits are one code path; each surface only shapes the output.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Optional

from fastapi import Request
from fastapi.responses import Response
from sse_starlette.sse import EventSourceResponse, SendTimeoutError
from starlette.background import BackgroundTask

from dflash_core.grammar import CompiledGrammar, GrammarError, GrammarSpec, compile_grammar
from dflash_core.settings import Settings

from . import chat
from .errors import bad_request
from .generation import ChatOutput, ClientGone, Run, until_disconnect
from .live import LiveStats
from .metrics import Metrics
from .models import ModelPool, ServedModel
from .output_text import ChatOutputParser
from .response_store import ResponseStore
from .scheduler import Scheduler
from .schemas import ChatCompletionRequest

log = logging.getLogger(__name__)


class ServerState:
    def __init__(self, settings: Settings, channel=None):
        self.settings = settings
        # Distributed (rank 0 of a group, dflash_core/distributed.py): generations always step
        # together, since the other ranks repeat each step.
        self.channel = channel
        self.scheduler = Scheduler(queue_size=settings.server.queue_size, max_active=settings.server.max_active,
                                   memory_fraction=settings.server.batch_memory_fraction,
                                   batching=settings.server.batching or channel is not None)
        self.pool = ModelPool(settings, self.scheduler, channel)
        self.metrics = Metrics(self.scheduler)
        self.live = LiveStats()  # the page's live view, by model
        self.responses = ResponseStore(settings.server.stored_responses,
                                       int(settings.server.stored_responses_mb * 2**20))
        self.draining = False  # set at SIGTERM: new requests get 503, running ones finish (server/process.py)


class StallingStream(EventSourceResponse):
    """An SSE response whose send that waits past `send_timeout` on a client that stopped reading
    ends it as a client gone (`on_stall`), not as a server error."""

    def __init__(self, *args, on_stall, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_stall = on_stall

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            self.on_stall()


@dataclass
class Started:
    """A queued chat generation and how to read it."""

    served: ServedModel
    run: Run
    output: ChatOutput


def _stop_tokens(served: ServedModel, body: ChatCompletionRequest) -> Optional[set[int]]:
    """A chat's answer ends at an end-of-sequence token or where the model starts another turn;
    Gemma 4 follows a tool call with <|tool_response>, which is the caller's turn, not ours."""
    extra = {served.turn_start_token} - {None}
    if body.tools and served.tool_response_token is not None:
        extra.add(served.tool_response_token)
    return served.engine.eos_token_ids | extra if extra else None


async def start_chat(state: ServerState, body: ChatCompletionRequest, arrival: float) -> Started:
    """Check, render and queue a chat request (the model stays acquired until `respond` ends)."""
    chat.refuse_unsupported(body)
    served = await state.pool.get(body.model)
    try:
        defaults = state.settings.template_defaults(served.settings)
        # Off the event loop: a long conversation takes a while to render and tokenize, and every
        # other stream and /health would wait for it.
        prompt = await asyncio.to_thread(chat.chat_prompt, body, served.engine.tokenizer, served.markers, defaults,
                                          served.engine.max_context)
        callable_tools = [t.model_dump() for t in body.tools or []] + body._unlisted_tools
        parser = ChatOutputParser(prompt.markers, callable_tools, body.tool_choice,
                                  body.stop, prompt.starts_in_reasoning, single_call=body.parallel_tool_calls is False)
        grammar = await _compiled(served, prompt.grammar, "response_format" if body.response_format else "tools")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        run = start_run(state, served, body, prompt, _stop_tokens(served, body), arrival, logprobs, grammar)
    except BaseException:
        state.pool.release(served)
        raise
    return Started(served, run, ChatOutput(run, parser))


async def _compiled(served: ServedModel, spec: Optional[GrammarSpec], param: str) -> Optional[CompiledGrammar]:
    """The grammar checked against the model's vocabulary, off the event loop (llguidance reads a
    large vocabulary once per model, and a schema can take a moment to compile)."""
    if spec is None:
        return None
    try:
        return await asyncio.to_thread(lambda: compile_grammar(spec, served.engine.grammar_tokenizer))
    except GrammarError as e:
        raise bad_request(str(e), param=param) from e


def start_run(state: ServerState, served: ServedModel, body, prompt: chat.Prompt, stop_tokens, arrival: float,
              logprobs: Optional[int] = None, grammar: Optional[CompiledGrammar] = None) -> Run:
    """Queue the generation (the model stays acquired until `respond` finishes)."""
    if not prompt.tokens:  # before it takes a queue slot
        raise bad_request("the prompt is empty once rendered", param="messages" if isinstance(body, ChatCompletionRequest)
                          else "prompt")
    defaults = state.settings.sampling_defaults(served.settings, served.loaded.generation_defaults)
    max_tokens = chat.max_new_tokens(body, defaults)
    chat.check_context(len(prompt.tokens), served.engine.max_context,
                       "messages" if isinstance(body, ChatCompletionRequest) else "prompt")
    sampling = chat.sampling_params(body, defaults, served.engine.target.vocab_size)
    run = Run(state.scheduler, served, prompt, max_tokens, sampling, stop_tokens,
              state.settings.server.request_timeout, started=arrival, logprobs=logprobs, grammar=grammar,
              speculation=body.dflash.speculation if body.dflash else None)
    run.submit()
    if body.user:
        log.info("request for %s from user %r", served.name, body.user)
    return run


async def respond(state: ServerState, endpoint: str, request: Request, run: Run, responder, *, stream: bool,
                  include_usage: bool = False):
    """Answer with `responder.stream(include_usage)` (SSE) or `responder.complete()` (JSON);
    whatever ends the response cancels the generation and releases the model exactly once."""
    metrics: Metrics = state.metrics
    finished = False

    def finish() -> None:  # exactly once, however the response ends
        nonlocal finished
        if not finished:
            finished = True
            run.cancel()
            run.record(metrics)
            if run.stats is not None:
                state.live.record(run.served.name, run.stats)
            state.pool.release(run.served)

    if stream:
        async def events():
            try:
                async for event in responder.stream(include_usage):
                    yield event
            except asyncio.CancelledError:  # the client went away: stop its generation now
                metrics.cancelled.labels(endpoint=endpoint).inc()
                raise
            finally:
                finish()

        def stalled() -> None:
            log.warning("a %s stream's client stopped reading for %g s: the stream ends", endpoint,
                        state.settings.server.send_timeout)
            metrics.cancelled.labels(endpoint=endpoint).inc()

        # The background task also runs when the client left before the stream even started. A
        # client that stops reading blocks the sends once the socket's buffers fill: the worker
        # still ends its generation at the deadline (`Job.deadline`), and a send blocked for
        # `send_timeout` ends the response, which releases the model (closing `events`).
        return StallingStream(events(), ping=15, background=BackgroundTask(finish),
                              send_timeout=state.settings.server.send_timeout, on_stall=stalled)
    try:
        return await until_disconnect(request, responder.complete())
    except ClientGone:
        metrics.cancelled.labels(endpoint=endpoint).inc()
        return Response(status_code=499)
    finally:
        finish()
