"""Compiled decode and verify blocks never run another model's trace.

MLX keys the traces of a compiled function by the Python function's id. Engines of different
families with the same tiny shapes, loaded, run (the batched steps on a worker thread, as the
server's scheduler runs them) and freed one after another in one process: without care, a new
engine's block allocated where a freed one was ran the freed block's trace, with the other model's
weights in it, and generated other tokens (dflash_core/compiled.py, `entry_point`). Each engine here must
generate exactly what it generates with compilation off.
"""

from __future__ import annotations

import gc
import threading

import mlx.core as mx
from families import ENGINE_FAMILIES

from dflash_core.batching import generate_together
from dflash_core.loading import load_engine


def _tokens(request, family: str, worker: bool = False) -> list[int]:
    """What an engine of `family` generates: two requests alone, then three batched, those on a
    worker thread (`worker`, as the server's scheduler runs them) or here."""
    target, drafter = request.getfixturevalue(f"{family}_pair")
    engine = load_engine(str(target), str(drafter), prefill_chunk=16)
    prompt = engine.tokenizer.encode("the cat sat on the mat and then it ran off")
    out = [t for c in engine.generate(prompt, max_tokens=24, stop_token_ids=set()) for t in c.token_ids]
    out += [t for c in engine.generate(prompt, max_tokens=8, stop_token_ids=set(), speculation="off")
            for t in c.token_ids]
    requests = [{"prompt_tokens": prompt[: 6 + 2 * i], "max_tokens": 20, "stop_token_ids": set()} for i in range(3)]

    def batched():
        for chunks in generate_together(engine, requests, max_rows=3):
            out.extend(t for c in chunks for t in c.token_ids)

    if worker:
        thread = threading.Thread(target=batched)
        thread.start()
        thread.join()
    else:
        batched()
    return out


def test_engines_loaded_one_after_another_run_their_own_blocks(request):
    mx.disable_compile()
    try:
        eager = {family: _tokens(request, family) for family in ENGINE_FAMILIES}
    finally:
        mx.enable_compile()
    for round in range(4):  # (the first round failed before entry points)
        for family in ENGINE_FAMILIES:
            worker = round % 2 == 0 and family in ("qwen3", "qwen3_5")
            assert _tokens(request, family, worker) == eager[family], (family, round)
            gc.collect()
