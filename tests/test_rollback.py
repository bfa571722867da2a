"""Rollback after a verify forward leaves every cache exactly as a fresh forward would.

For each family and each accepted length A = 0..15: prefill, verify a 16-token block, roll back to
A+1 tokens; compare with prefill plus a forward over the same A+1 tokens. Covers KV caches, Gated
DeltaNet conv and recurrent states, and Gemma 4's sliding-window ring (the prompt is longer than
the window, so the ring has wrapped).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from dflash_core.cache import SlidingWindowCache
from dflash_core.loading import load_target

FAMILIES = ["qwen3", "qwen3_5", "qwen3_5_moe", "gemma4", "gemma3"]
BLOCK = 16
TOL = dict(rtol=1e-4, atol=1e-5)


def _close(a, b):
    np.testing.assert_allclose(np.array(a), np.array(b), **TOL)


def _compare(rolled, fresh):
    kinds = set()
    for a, b in zip(rolled, fresh):
        kinds.add(type(a).__name__)
        if isinstance(a, ArraysCache):
            _close(a[0], b[0])  # conv state: the last K-1 inputs
            _close(a[1], b[1])  # recurrent state
        elif isinstance(a, SlidingWindowCache):
            assert a.offset == b.offset
            live = [p % a.capacity for p in range(max(0, a.offset - a.window), a.offset)]
            _close(a.keys[..., live, :], b.keys[..., live, :])
            _close(a.values[..., live, :], b.values[..., live, :])
        else:
            assert isinstance(a, KVCache) and a.offset == b.offset
            _close(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :])
            _close(a.values[..., : a.offset, :], b.values[..., : b.offset, :])
    return kinds


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_matches_fresh_forward(request, family):
    _check_rollback(request, family)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_rollback_from_recorded_step_states(request, family, step_states):
    """The verify keeps the state after every step and the rollback picks one (on the CPU through
    the per-step reference)."""
    _check_rollback(request, family, step_states)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_rollback_from_recorded_step_deltas(request, family, step_deltas):
    """`KernelOptions.step_deltas` (for CUDA: the verify keeps each step's delta, the rollback
    replays the kept updates), run on the uncompiled pure-MLX steps whose roundings it repeats."""
    _check_rollback(request, family, step_deltas)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_deltas_asked_where_no_kernel_replays_them_keep_step_states(request, family, monkeypatch):
    """`step_deltas` on, verifies recording, but no kernel whose replay repeats the forward's
    roundings (here: the CPU's compiled steps; on CUDA, head sizes our kernel does not take): the
    verify keeps step states (the check in `_check_rollback`), and rollbacks are exact."""
    from dataclasses import replace

    from dflash_core.adapters import qwen3_5

    monkeypatch.setattr(qwen3_5, "records_step_states", lambda: True)
    monkeypatch.setattr(qwen3_5, "replays_deltas", lambda head_k_dim, head_v_dim: False)
    _check_rollback(request, family, lambda adapter: adapter.with_kernels(replace(adapter.kernels, step_deltas=True)))


def _check_rollback(request, family, recording=None):
    """`recording`: adapter -> the adapter recording step states or deltas (the `step_states` and
    `step_deltas` fixtures), or None for this backend's default."""
    target_dir, _ = request.getfixturevalue(f"{family}_pair")
    adapter, _, _ = load_target(target_dir)
    if recording is not None:
        adapter = recording(adapter)
    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(0, adapter.vocab_size, size=(1, 21)), dtype=mx.int32)
    block = mx.array(rng.integers(0, adapter.vocab_size, size=(1, BLOCK)), dtype=mx.int32)
    probe = mx.array([[5]], dtype=mx.int32)
    kinds = set()
    for accepted in range(BLOCK):
        keep = accepted + 1
        rolled = adapter.make_cache(max_rollback=BLOCK)
        adapter.forward(prompt, rolled)
        verify = adapter.forward(block, rolled, record=True)
        if family.startswith("qwen3_5"):  # the record holds what this backend's rollback uses
            from dflash_core.adapters.qwen3_5 import records_step_states, replays_deltas

            mixer = next(layer.linear_attn for layer in adapter.layers if layer.is_linear)
            deltas = (records_step_states() and adapter.kernels.step_deltas
                      and replays_deltas(mixer.head_k_dim, mixer.head_v_dim))
            assert all((r.step_states is not None) == (records_step_states() and not deltas)
                       and (r.deltas is not None) == deltas for r in verify.rollback.states)
        adapter.rollback(rolled, verify.rollback, keep=keep)

        fresh = adapter.make_cache(max_rollback=BLOCK)
        adapter.forward(prompt, fresh)
        adapter.forward(block[:, :keep], fresh)
        kinds |= _compare(rolled, fresh)
        # And the caches behave the same from here on.
        _close(adapter.forward(probe, rolled).logits, adapter.forward(probe, fresh).logits)
    expected = {"qwen3": {"RowsKVCache"}, "qwen3_5": {"RowsKVCache", "RowsArraysCache"},
                "qwen3_5_moe": {"RowsKVCache", "RowsArraysCache"}, "gemma4": {"RowsKVCache", "SlidingWindowCache"},
                "gemma3": {"RowsKVCache", "SlidingWindowCache"}}[family]
    assert kinds == expected
