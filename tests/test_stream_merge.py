"""A request reading its generation's chunks (server/generation.py: Run.chunks) merges the chunks
already waiting in its queue into one, and keeps the end or an error behind them for the next read."""

from __future__ import annotations

import asyncio

import pytest

from dflash_core.engine import GenerationChunk
from dflash_core.sampling import SamplingParams
from server.errors import APIError
from server.generation import Run
from server.scheduler import Job


def _run(items):
    async def go():
        loop = asyncio.get_running_loop()
        run = Run(scheduler=None, served=None, prompt=None, max_tokens=None, sampling=SamplingParams())
        run.job = Job(start=lambda: iter(()), loop=loop)
        for item in items:
            run.job.outputs.put_nowait(item)
        out = []
        try:
            async for chunk in run.chunks():
                out.append(chunk)
        except APIError as e:
            out.append(e)
        return out

    return asyncio.run(go())


def chunk(ids, finish=None, logprobs=None):
    return GenerationChunk(token_ids=list(ids), text="".join(f"<{i}>" for i in ids), finish_reason=finish,
                           stop_token_id=9 if finish == "stop" else None, logprobs=logprobs)


def test_waiting_chunks_go_out_as_one():
    (merged,) = _run([chunk([1]), chunk([2, 3]), chunk([4], finish="stop")])
    assert merged.token_ids == [1, 2, 3, 4] and merged.text == "<1><2><3><4>"
    assert merged.finish_reason == "stop" and merged.stop_token_id == 9


def test_a_lone_chunk_goes_out_as_it_is_and_the_end_is_kept():
    first = chunk([1])
    out = _run([first, None])
    assert out == [first] and out[0] is first
    out = _run([chunk([1]), chunk([2]), None, chunk([5])])  # nothing after the end is read
    assert [c.token_ids for c in out] == [[1, 2]]


def test_an_error_behind_merged_chunks_comes_after_them():
    out = _run([chunk([1]), chunk([2]), RuntimeError("boom")])
    assert [c.token_ids for c in out[:-1]] == [[1, 2]]
    assert isinstance(out[-1], APIError) and out[-1].status == 500 and "boom" in str(out[-1])


def test_logprobs_stay_one_per_token():
    out = _run([chunk([1], logprobs=["a"]), chunk([2, 3], logprobs=["b", "c"]), None])
    assert out[0].logprobs == ["a", "b", "c"] and out[0].token_ids == [1, 2, 3]
    (plain,) = _run([chunk([1]), chunk([2], finish="length")])
    assert plain.logprobs is None and plain.finish_reason == "length"


@pytest.mark.parametrize("stop_at", [0, 1])
def test_a_finished_chunk_ends_the_merge(stop_at):
    items = [chunk([1], finish="stop" if stop_at == 0 else None), chunk([2], finish="stop" if stop_at == 1 else None),
             chunk([3])]
    out = _run(items)
    assert [c.token_ids for c in out] == ([[1]] if stop_at == 0 else [[1, 2]])
