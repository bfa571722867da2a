"""Running one request on the worker and shaping its output as OpenAI responses."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from dflash_core.engine import GenerationChunk, RequestError
from dflash_core.grammar import CompiledGrammar, GrammarError
from dflash_core.prompts import hf_tokenizer
from dflash_core.sampling import SamplingError, SamplingParams
from dflash_core.stats import GenerationStats

from .chat import Prompt
from .errors import APIError
from .logprobs import TokenText, chat_logprobs, completion_logprobs
from .metrics import Metrics
from .models import ServedModel
from .output_text import ChatOutputParser, Delta, StopMatcher, collect_deltas, delta_to_openai
from .scheduler import Job, JobTimedOut, QueueFullError, Scheduler, SchedulerStopped


class ClientGone(Exception):
    pass


_END = object()  # the queue's end-of-generation (None) when held behind merged chunks


@dataclass
class Run:
    """One generation queued on the worker, read back as engine chunks."""

    scheduler: Scheduler
    served: ServedModel
    prompt: Prompt
    max_tokens: Optional[int]
    sampling: SamplingParams
    stop_token_ids: Optional[set[int]] = None
    timeout: Optional[float] = None
    started: float = field(default_factory=time.perf_counter)  # the request's arrival
    logprobs: Optional[int] = None  # top-k logprobs per token (None: none)
    grammar: Optional[CompiledGrammar] = None  # what the output must match
    speculation: Optional[str] = None  # auto, on or off; None: the model's configured mode
    first_token_at: Optional[float] = None
    stats: Optional[GenerationStats] = None
    job: Optional[Job] = None
    generated: list[int] = field(default_factory=list)  # every token the engine handed out
    token_logprobs: list = field(default_factory=list)  # their TokenLogprobs, when asked for
    logprobs_released: int = 0  # of those, how many have passed the stop strings
    logprobs_sent: int = 0
    held: Any = None  # the end or an error read from the queue behind chunks merged before it

    def submit(self) -> None:
        engine = self.served.engine
        self.job = Job(
            start=lambda: engine.generate(
                self.prompt.tokens,
                max_tokens=self.max_tokens,
                sampling=self.sampling,
                stop_token_ids=self.stop_token_ids,
                logprobs=self.logprobs,
                grammar=self.grammar,
                reasoning_budget=self.prompt.reasoning_budget,
                speculation=self.speculation,
                batched=self.scheduler.batching,
            ),
            loop=asyncio.get_running_loop(),
            engine=engine,
            together=self.scheduler.batching,  # steps with the model's other generations, else alone
            # (the caches never hold more than the context, whatever max_tokens asks)
            tokens=_cache_tokens(len(self.prompt.tokens), self.max_tokens, engine.max_context),
            # Enforced by the worker too: a stream whose client stops reading is not awaited here.
            deadline=None if self.timeout is None else self.started + self.timeout,
        )
        try:
            self.scheduler.submit(self.job)
        except QueueFullError as e:
            raise APIError(429, f"the server is busy ({e}); retry later", type="rate_limit_error",
                           code="queue_full",
                           headers={"Retry-After": str(math.ceil(self.scheduler.estimated_wait()))}) from e
        except SchedulerStopped as e:
            raise APIError(503, str(e), type="server_error", headers={"Retry-After": "5"}) from e

    def cancel(self) -> None:
        if self.job is not None:
            self.job.cancel()

    async def chunks(self) -> AsyncIterator[GenerationChunk]:
        deadline = None if self.timeout is None else self.started + self.timeout
        try:
            while True:
                remaining = None if deadline is None else max(0.0, deadline - time.perf_counter())
                if self.held is not None:
                    item, self.held = (None if self.held is _END else self.held), None
                else:
                    try:
                        item = await asyncio.wait_for(self.job.outputs.get(), remaining)
                    except asyncio.TimeoutError:
                        raise self.timed_out() from None
                    if isinstance(item, GenerationChunk):
                        item = self.merge_waiting(item)
                if item is None:
                    return
                if isinstance(item, BaseException):
                    if isinstance(item, JobTimedOut):
                        raise self.timed_out() from item
                    if isinstance(item, (RequestError, SamplingError, GrammarError)):  # the engine's own input checks
                        raise APIError(400, str(item)) from item
                    if isinstance(item, SchedulerStopped):  # shutting down (or the worker died)
                        raise APIError(503, str(item), type="server_error", code="shutting_down",
                                       headers={"Retry-After": "5"}) from item
                    raise APIError(500, f"generation failed: {type(item).__name__}: {item}", type="server_error") from item
                self.stats = item.stats
                self.generated += item.token_ids
                self.token_logprobs += item.logprobs or ()
                if item.token_ids and self.first_token_at is None:
                    self.first_token_at = time.perf_counter()
                yield item
                if item.finish_reason:
                    return
        finally:
            self.cancel()  # a no-op after a normal end; frees the worker on any early exit

    def timed_out(self) -> APIError:
        return APIError(504, f"the request took longer than {self.timeout:g} s", type="server_error", code="timeout")

    def merge_waiting(self, chunk: GenerationChunk) -> GenerationChunk:
        """`chunk` and the chunks already queued behind it as one: when the worker makes tokens
        faster than this request's client takes them (many streams stepping together), each
        event carries all that is ready instead of one event per step, so the event loop's work
        per token falls as the load rises. Nothing waits for more: a lone chunk goes out as it
        is. The end of the generation or an error behind them is kept for the next read."""
        merged = [chunk]
        while not merged[-1].finish_reason and not self.job.outputs.empty():
            item = self.job.outputs.get_nowait()
            if not isinstance(item, GenerationChunk):
                self.held = item if item is not None else _END
                break
            merged.append(item)
        if len(merged) == 1:
            return chunk
        last = merged[-1]
        logprobs = [lp for c in merged for lp in (c.logprobs or ())] if any(c.logprobs is not None for c in merged) else None
        return GenerationChunk(token_ids=[t for c in merged for t in c.token_ids], text="".join(c.text for c in merged),
                               finish_reason=last.finish_reason, stats=last.stats, stop_token_id=last.stop_token_id,
                               logprobs=logprobs)

    def release_logprobs(self, stop_end: Optional[int]) -> None:
        """Called once a chunk's text went through the stop strings: its tokens' logprobs may go
        out, after a stop string (`stop_end`) only those of the tokens through it, as `usage`
        counts them."""
        if self.logprobs is not None:
            self.logprobs_released = len(self.generated) if stop_end is None else self.tokens_through(stop_end)

    def take_logprobs(self) -> Optional[list]:
        """The released logprobs not handed out yet (None when not asked for)."""
        if self.logprobs is None:
            return None
        out = self.token_logprobs[self.logprobs_sent:self.logprobs_released]
        self.logprobs_sent = max(self.logprobs_sent, self.logprobs_released)
        return out

    def tokens_through(self, chars: int) -> int:
        """The fewest generated tokens whose text reaches `chars` characters (decoded as the
        engine's detokenizer does, an unfinished character held back)."""
        tokenizer = hf_tokenizer(self.served.engine.tokenizer)

        def length(k: int) -> int:
            return len(tokenizer.decode(self.generated[:k], skip_special_tokens=False).rstrip("\ufffd"))

        low, high = 0, len(self.generated)
        while low < high:
            middle = (low + high) // 2
            if length(middle) >= chars:
                high = middle
            else:
                low = middle + 1
        return low

    def usage(self, stop_end: Optional[int] = None) -> dict:
        """`stop_end`: where a stop string ended the output (characters of model text). The last
        cycle may have committed tokens past it; they are not part of the completion, so usage
        is the same with and without speculation. (The `dflash` object keeps the engine's count.)"""
        stats = self.stats or GenerationStats(prompt_tokens=len(self.prompt.tokens))
        completion = stats.generated_tokens if stop_end is None else self.tokens_through(stop_end)
        return {
            "prompt_tokens": stats.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": stats.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": stats.prompt_tokens - stats.prefill_tokens},
        }

    def report(self) -> dict:
        """The `dflash` object: what speculation did for this request."""
        return (self.stats or GenerationStats()).as_dict()

    def record(self, metrics: Metrics) -> None:
        if self.first_token_at is not None:
            metrics.ttft.observe(self.first_token_at - self.started)
        if self.stats is not None:
            metrics.record_generation(self.stats)


async def wait_for_disconnect(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request, coroutine):
    """Await `coroutine`, cancelling it if the client goes away first."""
    work = asyncio.ensure_future(coroutine)
    gone = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        work.cancel()
        raise ClientGone()
    finally:
        gone.cancel()


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(data: Any) -> dict:
    return {"data": data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}


def named_sse(event: dict) -> dict:
    """An SSE event named by its `type`, as the Responses and Messages APIs stream them."""
    return {"event": event["type"], "data": json.dumps(event, ensure_ascii=False)}


# ------------------------------------------------------------------------- chat output


HEARTBEAT = Delta()  # no output: a prefill chunk ended (streams may send a keep-alive)


class ChatOutput:
    """One chat generation read as parsed deltas; shared by chat completions, Responses and
    Messages, which only shape what it yields."""

    def __init__(self, run: Run, parser: ChatOutputParser):
        self.run, self.parser = run, parser
        self.engine_finish = "stop"

    async def deltas(self) -> AsyncIterator[Delta]:
        for delta in self.parser.feed_forced(self.run.prompt.forced_output):
            yield delta
        async for chunk in self.run.chunks():
            if not chunk.token_ids and not chunk.finish_reason:
                yield HEARTBEAT
                continue
            deltas = self.parser.feed(chunk.text)
            self.run.release_logprobs(self.parser.end)
            for delta in deltas:
                yield delta
            if self.parser.end is not None:  # a stop string, or the one call allowed
                self.run.cancel()  # the worker drops it at its next turn, within one cycle
                break
            if chunk.finish_reason:
                self.engine_finish = chunk.finish_reason
        for delta in self.parser.finish():
            yield delta

    @property
    def finish_reason(self) -> str:
        """OpenAI's: "tool_calls", "stop" (end of turn or a stop string) or "length"."""
        return self.parser.finish_reason(self.engine_finish)

    def usage(self) -> dict:
        return self.run.usage(self.parser.end)



# ------------------------------------------------------------------------- chat completions


class ChatResponder:
    def __init__(self, run: Run, model: str, output: ChatOutput):
        self.run, self.model, self.output = run, model, output
        self.id, self.created = _id("chatcmpl"), int(time.time())
        self.token_text = TokenText(run.served.engine)

    def _chunk(self, delta: dict, finish_reason=None, **extra) -> dict:
        logprobs = chat_logprobs(self.token_text, self.run.take_logprobs())
        return {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}], **extra,
        }

    async def stream(self, include_usage: bool) -> AsyncIterator[dict]:
        yield sse(self._chunk({"role": "assistant", "content": ""}))
        try:
            async for delta in self.output.deltas():
                if delta is not HEARTBEAT:
                    yield sse(self._chunk(_openai_delta(delta)))
        except APIError as e:
            yield sse(e.body())
            yield sse("[DONE]")
            return
        # The last chunk carries the logprobs of tokens whose text was held back until the end.
        yield sse(self._chunk({}, self.output.finish_reason, dflash=self.run.report()))
        if include_usage:
            yield sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                       "choices": [], "usage": self.output.usage(), "dflash": self.run.report()})
        yield sse("[DONE]")

    async def complete(self) -> dict:
        content, reasoning, _ = collect_deltas([delta async for delta in self.output.deltas()])
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if reasoning:
            message["reasoning_content"] = message["reasoning"] = reasoning
        calls = [call.to_openai() for call in self.output.parser.tool_calls]
        if calls:
            message["tool_calls"] = calls
        elif message["content"] is None:
            message["content"] = ""
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": self.output.finish_reason,
                         "logprobs": chat_logprobs(self.token_text, self.run.take_logprobs())}],
            "usage": self.output.usage(), "dflash": self.run.report(),
        }


def _openai_delta(delta: Delta) -> dict:
    out = delta_to_openai(delta)
    if "reasoning_content" in out:
        out["reasoning"] = out["reasoning_content"]  # clients read either name
    return out


# ------------------------------------------------------------------------------ completions


class CompletionResponder:
    def __init__(self, run: Run, model: str, stop):
        self.run, self.model, self.matcher = run, model, StopMatcher(stop)
        self.id, self.created = _id("cmpl"), int(time.time())
        self.engine_finish = "stop"
        self.token_text = TokenText(run.served.engine)
        self.offset = 0  # characters of logprob tokens handed out

    def _body(self, text: str, finish_reason=None, **extra) -> dict:
        logprobs = completion_logprobs(self.token_text, self.run.take_logprobs(), self.offset)
        if logprobs is not None:
            self.offset += sum(map(len, logprobs["tokens"]))
        return {
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}], **extra,
        }

    async def _texts(self) -> AsyncIterator[str]:
        async for chunk in self.run.chunks():
            text = self.matcher.feed(chunk.text)
            self.run.release_logprobs(self.matcher.matched_end)
            if text:
                yield text
            if self.matcher.matched is not None:
                self.run.cancel()
                return
            if chunk.finish_reason:
                self.engine_finish = chunk.finish_reason
        text = self.matcher.finish()
        if text:
            yield text

    def _finish_reason(self) -> str:
        return "stop" if self.matcher.matched is not None else self.engine_finish

    async def stream(self, include_usage: bool) -> AsyncIterator[dict]:
        try:
            async for text in self._texts():
                yield sse(self._body(text))
        except APIError as e:
            yield sse(e.body())
            yield sse("[DONE]")
            return
        yield sse(self._body("", self._finish_reason(), dflash=self.run.report()))
        if include_usage:
            yield sse({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                       "choices": [], "usage": self.run.usage(self.matcher.matched_end), "dflash": self.run.report()})
        yield sse("[DONE]")

    async def complete(self) -> dict:
        text = "".join([t async for t in self._texts()])
        return self._body(text, self._finish_reason(), usage=self.run.usage(self.matcher.matched_end),
                          dflash=self.run.report())


def _cache_tokens(prompt: int, max_tokens: Optional[int], max_context: Optional[int]) -> int:
    """The most tokens a generation's caches will hold: the prompt and what it may generate, within
    the model's context (a max_tokens far past it would otherwise never fit beside another job,
    and hold back the queue behind it)."""
    most = prompt + (max_tokens if max_tokens is not None else max_context or 0)
    return min(most, max_context) if max_context else most
