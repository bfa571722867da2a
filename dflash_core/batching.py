"""Continuous batching: the forwards of several generations of one model run as one.

A generation's stream (`Engine.generate(..., batched=True)`) yields, besides its chunks, the
forwards it needs: a `DraftCall` (the drafter's block for a cycle) or a `TargetCall` (a plain step
or a verify), and takes each output back through `send`. Run alone, `serve_alone` answers each call
with the plain forward; `step_together` advances many streams by one step each and answers their
calls in batches: one drafter forward for every generation drafting, then one target forward for
every generation's verify block or plain step (`TargetAdapter.forward_rows`). The weights are read
once per batch instead of once per generation, which is what decode is bound by. Each row computes
what it computes alone, and where a matmul rounds a row the same whatever the other rows (MLX's CPU
reference BLAS, which the tests run) its tokens are bit for bit the same; on a GPU or with MKL a
larger product may round differently, as a 16-token verify already does against a 1-token step,
which can change the target's choice at a near-tie (README, "Lossless at any temperature").

Prefill chunks are not batched: a generation in prefill does one chunk per step, as alone, so a
long prompt delays the others by one chunk per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import mlx.core as mx

from .adapters import ForwardRow


@dataclass
class TargetCall:
    """A target forward a generation needs: its row, with the layers to tap."""

    row: ForwardRow
    tap_ids: Sequence[int] = ()


@dataclass
class DraftCall:
    """A drafter block a generation needs: its last committed token (on the device), its drafter
    context, the block's width and the taps to add to the context first (None: none). The answer
    is the width-1 proposals.

    `start` (a draft ahead, `Engine._launch`): the block's first position as (an array on the
    device, the least it can be), before the host knows it; the taps are all of a verify's,
    some of which the host will trim. Such a call may be declined (answered None): the generation
    then drafts after its read, as without it. `step_together` declines them where several rows
    draft in one round (the rows' drafts batch instead)."""

    bonus: mx.array
    context: list
    width: int
    taps: Optional[mx.array] = None
    start: Optional[tuple[mx.array, int]] = None


def serve(engine, call):
    """The output of one call, run alone."""
    if isinstance(call, TargetCall):
        r = call.row
        if r.undo is not None:
            engine.target.rollback(r.cache, *r.undo)
        return engine.target.forward(r.tokens, r.cache, call.tap_ids, last_logits_only=r.last_logits_only,
                                     record=r.record)
    if call.taps is not None:
        engine.drafter.add_context(call.taps, call.context)
    if call.start is not None:
        return engine.drafter.propose(call.bonus, engine.target, call.context, call.width, start=call.start)
    return engine.drafter.propose(call.bonus, engine.target, call.context, call.width)


def serve_alone(engine, stream) -> Iterator[Any]:
    """A stream's chunks, its calls answered one by one: `Engine.generate` without batching."""
    try:
        item = next(stream)
        while True:
            while isinstance(item, (TargetCall, DraftCall)):
                item = stream.send(serve(engine, item))
            yield item
            item = next(stream)
    except StopIteration:
        return
    finally:
        stream.close()


@dataclass
class Stepped:
    """What one stream did in a `step_together`: its next chunk, or how it ended."""

    chunk: Any = None
    done: bool = False  # the stream ended (StopIteration)
    error: Optional[BaseException] = None  # it raised: only this generation fails


def step_together(engine, streams: Sequence[Iterator[Any]]) -> list[Stepped]:
    """Advance every stream (all of one engine, started with batched=True) to its next chunk,
    answering their calls in batches: drafts first (a verify needs its drafts), then the target
    forwards, grouped by the layers they tap. A stream that raises fails alone. An engine that
    steps its generations itself (`distributed.LeaderEngine`, which first tells the other ranks)
    gets the streams handed over."""
    own = getattr(engine, "step_together", None)
    if own is not None:
        return own(streams)
    results = [Stepped() for _ in streams]
    calls: dict[int, Any] = {}
    called: set[int] = set()  # the streams that made forwards this round
    widths: list[int] = []  # each target forward's tokens this round: the round's make (rounds.py)

    def advance(i: int, value: Any = None, first: bool = False) -> None:
        try:
            item = next(streams[i]) if first else streams[i].send(value)
        except StopIteration:
            results[i].done = True
            return
        except Exception as e:  # noqa: BLE001 - one request's failure must not take the others down
            results[i].error = e
            return
        if isinstance(item, (TargetCall, DraftCall)):
            calls[i] = item
            called.add(i)
        else:
            results[i].chunk = item

    for i in range(len(streams)):
        advance(i, first=True)
    while calls:
        drafting = [i for i, c in calls.items() if isinstance(c, DraftCall)]
        if drafting:
            ahead = [i for i in drafting if calls[i].start is not None]
            if ahead and len(drafting) > 1:  # several rows draft: in one forward, after their reads
                for i in ahead:
                    calls.pop(i)
                    advance(i, None)
                continue
            outputs = _draft_rows(engine, [calls.pop(i) for i in drafting])
            for i, out in zip(drafting, outputs):
                advance(i, out)
            _evaluate_queued(engine)
            continue
        by_taps: dict[tuple, list[int]] = {}
        for i, c in calls.items():
            by_taps.setdefault(tuple(c.tap_ids), []).append(i)
        undos = [(c.row.cache, *c.row.undo) for c in calls.values() if c.row.undo is not None]
        if undos:  # the rollbacks the rows decided since their last forward, all at once
            engine.target.rollback_rows(undos)
        for taps, members in by_taps.items():
            rows = [calls.pop(i).row for i in members]
            widths += [r.tokens.shape[-1] for r in rows]
            outputs = engine.target.forward_rows(rows, taps)
            for i, out in zip(members, outputs):
                advance(i, out)
            _evaluate_queued(engine)
    queued = getattr(engine, "batch_queue", None)
    if queued is not None:
        queued.join_reads()
    spec = getattr(engine, "speculation_state", None)
    if spec is not None:
        # Clean: every row decoded (a prefill chunk, or the first token's read of the prompt's last
        # chunk, would put host-timed work into this round's wall).
        clean = len(called) == len(streams) and all(r.chunk is None or _decoded(r.chunk) for r in results)
        spec.rounds.end_round(widths, clean, engine.clock())
    return results


def _evaluate_queued(engine) -> None:
    """Start evaluating what the rows queued while they took their outputs (`Engine.batch_queue`:
    each row's next token, drafts, taps), in one `mx.async_eval` instead of one per row (the
    tokens they will read are joined for one host read at the round's end: `host_reads`)."""
    queued = getattr(engine, "batch_queue", None)
    if queued:
        queued.flush()


def _decoded(chunk) -> bool:
    """Whether a chunk came out of a decode step: not a prefill chunk, nor the first token."""
    stats = getattr(chunk, "stats", None)
    return bool(chunk.token_ids) and stats is not None and stats.generated_tokens > len(chunk.token_ids)


def _draft_rows(engine, calls: list[DraftCall]) -> list[mx.array]:
    if len(calls) == 1:
        return [serve(engine, calls[0])]
    drafter = engine.drafter
    adding = [(c.taps, c.context) for c in calls if c.taps is not None]
    if len(adding) > 1 and hasattr(drafter, "add_context_rows"):
        drafter.add_context_rows(adding)
    else:
        for taps, context in adding:
            drafter.add_context(taps, context)
    if len(calls) > 1 and hasattr(drafter, "propose_rows"):
        from .drafter import DraftRow

        return drafter.propose_rows([DraftRow(c.bonus, c.context, c.width) for c in calls], engine.target)
    return [drafter.propose(c.bonus, engine.target, c.context, c.width) for c in calls]


def generate_together(engine, requests: Sequence[dict], max_rows: int = 16, progress=None) -> list[list[Any]]:
    """Run many generations of one engine, up to `max_rows` stepping together, a new one joining
    as soon as one ends: each request is `Engine.generate`'s keyword arguments (`prompt_tokens`
    included); returns each one's chunks, in request order. `progress(n)` is told of each end."""
    chunks: list[list[Any]] = [[] for _ in requests]
    waiting = list(range(len(requests)))[::-1]
    live: dict[int, Iterator[Any]] = {}
    while waiting or live:
        while waiting and len(live) < max_rows:
            i = waiting.pop()
            live[i] = engine.generate(**requests[i], batched=True)
        order = list(live)
        for i, stepped in zip(order, step_together(engine, [live[i] for i in order])):
            if stepped.error is not None:
                for stream in live.values():
                    stream.close()
                raise stepped.error
            if stepped.chunk is not None:
                chunks[i].append(stepped.chunk)
            if stepped.done or (stepped.chunk is not None and stepped.chunk.finish_reason):
                live.pop(i).close()
                if progress is not None:
                    progress(1)
    return chunks
