"""Qwen3.5's `forward_rows` gives every row exactly what `forward` gives it alone.

Several generations (prompts of different lengths, so different cache lengths) run decode steps and
verify blocks of different lengths in one call. Each row's logits, tapped hidden states, rollback
record and caches afterwards must equal, bit for bit, those of the same row run alone on caches of
its own (prefilled separately: the two worlds share no cache object); after each world rolls every
row back to a different prefix, a second batched round must still agree, which checks that the
GatedDeltaNet states and conv windows stayed per row. Exactness holds on the CPU's reference BLAS,
which rounds a row of a product the same whatever the other rows (tests/conftest.py); on a GPU, where
a product's rounding depends on its row count, the rows agree to float32 rounding
(`forced.assert_rounds_alike`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from forced import assert_rounds_alike
from mlx_lm.models.cache import ArraysCache

from dflash_core.adapters import ForwardRow
from dflash_core.adapters.qwen3_5 import GatedDeltaRecord
from dflash_core.loading import load_engine

FAMILIES = ["qwen3_5", "qwen3_5_moe"]
PROMPTS = [5, 13, 30, 21]  # 30 and 21 prefill through mlx-lm's layers, 5 and 13 as rows


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request):
    target_dir, drafter_dir = request.getfixturevalue(f"{request.param}_pair")
    engine = load_engine(str(target_dir), str(drafter_dir))
    adapter = engine.target
    rng = np.random.default_rng(0)
    prompts = [mx.array(rng.integers(0, adapter.vocab_size, size=(1, n)), dtype=mx.int32) for n in PROMPTS]
    return adapter, tuple(engine.drafter.config.target_layer_ids), prompts


def _world(adapter, prompts) -> list[list]:
    """Fresh caches, one per prompt, prefilled."""
    caches = []
    for prompt in prompts:
        cache = adapter.make_cache(max_rollback=16)
        mx.eval(adapter.forward(prompt, cache).logits)
        caches.append(cache)
    return caches


def _tokens(adapter, lengths, seed):
    rng = np.random.default_rng(seed)
    return [mx.array(rng.integers(0, adapter.vocab_size, size=(1, n)), dtype=mx.int32) for n in lengths]


def _equal(a, b, what):
    assert (a is None) == (b is None), what
    if a is not None:
        assert a.shape == b.shape and a.dtype == b.dtype, what
        if mx.issubdtype(a.dtype, mx.floating):
            try:
                assert_rounds_alike(a, b)
            except AssertionError as e:
                raise AssertionError(f"{what}: {e}") from None
        else:
            assert mx.array_equal(a, b).item(), what


def _same_caches(batched, solo):
    for i, (a, b) in enumerate(zip(batched, solo)):
        if isinstance(a, ArraysCache):
            _equal(a[0], b[0], f"layer {i} conv state")
            _equal(a[1], b[1], f"layer {i} recurrent state")
        else:
            assert a.offset == b.offset, f"layer {i} offset"
            _equal(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :], f"layer {i} keys")
            _equal(a.values[..., : a.offset, :], b.values[..., : b.offset, :], f"layer {i} values")


def _same_output(a, b):
    _equal(a.logits, b.logits, "logits")
    _equal(a.tapped_hidden, b.tapped_hidden, "tapped hidden")
    assert (a.rollback is None) == (b.rollback is None)
    if a.rollback is not None:
        assert a.rollback.tokens == b.rollback.tokens and len(a.rollback.states) == len(b.rollback.states)
        for ra, rb in zip(a.rollback.states, b.rollback.states):
            assert isinstance(ra, GatedDeltaRecord)
            _equal(ra.conv_input, rb.conv_input, "record conv input")
            _equal(ra.state, rb.state, "record state")
            _equal(ra.step_states, rb.step_states, "record step states")
            assert (ra.deltas is None) == (rb.deltas is None)
            for x, y in zip(ra.deltas or (), rb.deltas or ()):
                _equal(x, y, "record deltas")
            assert (ra.steps is None) == (rb.steps is None)
            for x, y in zip(ra.steps or (), rb.steps or ()):
                _equal(x, y, "record steps")


def _round(adapter, taps, batched, solo, tokens, last_only, record=True):
    """One forward_rows call in the batched world, the same rows one by one in the solo world."""
    rows = [ForwardRow(t, c, last, record) for t, c, last in zip(tokens, batched, last_only)]
    outs = adapter.forward_rows(rows, taps)
    alone = [adapter.forward(t, c, taps, last_logits_only=last, record=record)
             for t, c, last in zip(tokens, solo, last_only)]
    mx.eval([o.logits for o in outs + alone])
    for out, ref, t, last in zip(outs, alone, tokens, last_only):
        assert out.logits.shape[1] == (1 if last else t.shape[1])
        _same_output(out, ref)
    for b, s in zip(batched, solo):
        _same_caches(b, s)
    return outs, alone


def _recording(setup, request, record):
    """`setup` with its adapter recording as the fixture named `record` makes it (None: as is)."""
    adapter, taps, prompts = setup
    return (adapter if record is None else request.getfixturevalue(record)(adapter)), taps, prompts


def _check_rows(adapter, taps, prompts):
    batched, solo = _world(adapter, prompts), _world(adapter, prompts)
    for b, s in zip(batched, solo):
        _same_caches(b, s)
    # Decode steps and verify blocks side by side, over caches of four lengths.
    lengths = [1, 7, 16, 16]
    outs, alone = _round(adapter, taps, batched, solo, _tokens(adapter, lengths, 1), [False, False, False, True])
    # Each row keeps a different prefix, in both worlds.
    for length, keep, b, s, out, ref in zip(lengths, [0, 3, 16, 0], batched, solo, outs, alone):
        adapter.rollback(b, out.rollback, min(keep, length))
        adapter.rollback(s, ref.rollback, min(keep, length))
        _same_caches(b, s)
    _round(adapter, taps, batched, solo, _tokens(adapter, [16, 1, 7, 3], 2), [False, True, False, False])
    # And plain steps, unrecorded, from there on.
    _round(adapter, taps, batched, solo, _tokens(adapter, [1, 1, 1, 1], 3), [True] * 4, record=False)


def test_rows_match_forward_alone(setup):
    _check_rows(*setup)


def test_rows_match_with_recorded_step_states(setup, step_states):
    """Verifies recording the state after every step (here through the per-step reference)."""
    adapter, taps, prompts = setup
    _check_rows(step_states(adapter), taps, prompts)


def test_a_row_does_not_depend_on_its_companions(setup):
    adapter, taps, prompts = setup
    tokens = _tokens(adapter, [7, 1, 16, 3], 4)
    results = []
    for members in ([0], [0, 1], [2, 0, 3], [3, 2, 1, 0]):
        caches = _world(adapter, prompts)
        rows = [ForwardRow(tokens[m], caches[m], record=True) for m in members]
        results.append(adapter.forward_rows(rows, taps)[members.index(0)])
    for out in results[1:]:
        _same_output(out, results[0])


def test_small_rows_share_one_forward_and_prefill_rows_run_alone(setup, monkeypatch):
    adapter, taps, prompts = setup
    caches = [adapter.make_cache(max_rollback=16) for _ in range(3)]
    lengths = [1, 16, adapter.compile_max_tokens + 4]
    tokens = _tokens(adapter, lengths, 5)
    embedded = []
    embed = adapter.embed
    monkeypatch.setattr(adapter, "embed", lambda t: embedded.append(t.shape[1]) or embed(t))
    outs = adapter.forward_rows([ForwardRow(t, c) for t, c in zip(tokens, caches)], taps)
    assert sorted(embedded) == sorted([1 + 16, lengths[2]])
    assert [o.logits.shape[1] for o in outs] == lengths


@pytest.mark.parametrize("record", [None, "step_states", "step_deltas"])
def test_rows_of_one_length_share_the_recurrence(setup, request, record):
    """Rows of one length run a GatedDeltaNet layer's conv and recurrence together along the batch
    axis: three 16-token verifies, two decode steps and a 7-token verify, interleaved (the groups'
    rows stacked from slices) and then side by side (a group's rows one block), each row rolled
    back to a different prefix in between, must still each get what they get alone. `record`: the
    backend's default, or verifies recording step states or deltas (the fixtures of that name)."""
    adapter, taps, _ = _recording(setup, request, record)
    rng = np.random.default_rng(6)
    prompts = [mx.array(rng.integers(0, adapter.vocab_size, size=(1, n)), dtype=mx.int32)
               for n in [5, 13, 30, 21, 9, 3]]
    batched, solo = _world(adapter, prompts), _world(adapter, prompts)
    lengths = [16, 1, 16, 7, 1, 16]
    outs, alone = _round(adapter, taps, batched, solo, _tokens(adapter, lengths, 7),
                         [False, True, False, False, False, True])
    for keep, b, s, out, ref, length in zip([16, 0, 5, 3, 1, 0], batched, solo, outs, alone, lengths):
        adapter.rollback(b, out.rollback, min(keep, length))
        adapter.rollback(s, ref.rollback, min(keep, length))
        _same_caches(b, s)
    lengths = [1, 1, 16, 16, 16, 7]
    outs, alone = _round(adapter, taps, batched, solo, _tokens(adapter, lengths, 8), [False] * 6)
    for keep, b, s, out, ref in zip([1, 0, 9, 16, 2, 7], batched, solo, outs, alone):
        adapter.rollback(b, out.rollback, keep)
        adapter.rollback(s, ref.rollback, keep)
        _same_caches(b, s)
    _round(adapter, taps, batched, solo, _tokens(adapter, [1] * 6, 9), [True] * 6, record=False)


@pytest.mark.parametrize("record", [None, "step_states", "step_deltas"])
def test_rows_carry_their_states_to_the_next_forward(setup, request, record):
    """The same rows' next forward starts from the batch their last one left, in every layer (the
    GatedDeltaNet windows and states, the attention buffers) instead of stacking each row's again;
    after a batched rollback of verifies that recorded every step (step states or deltas, as on
    CUDA) the GatedDeltaNet layers start from its gathers or replays. Every round agrees with the
    rows alone (`_equal`)."""
    from dflash_core.adapters import qwen3_5

    adapter, taps, prompts = _recording(setup, request, record)
    step_states = qwen3_5.records_step_states()  # verifies record every step: states or deltas
    stacked = adapter.stacked_rows
    batched, solo = _world(adapter, prompts), _world(adapter, prompts)
    _round(adapter, taps, batched, solo, _tokens(adapter, [1] * 4, 10), [True] * 4, record=False)
    before = stacked.reused
    _round(adapter, taps, batched, solo, _tokens(adapter, [1] * 4, 11), [True] * 4, record=False)
    assert stacked.reused - before == len(adapter.layers)
    outs, alone = _round(adapter, taps, batched, solo, _tokens(adapter, [16] * 4, 12), [False] * 4)
    keeps = [3, 7, 1, 15]
    gated = [i for i, layer in enumerate(adapter.layers) if layer.is_linear]
    adapter.rollback_rows([(b, out.rollback, keep) for b, out, keep in zip(batched, outs, keeps)])
    # The rollback's gathers leave every GatedDeltaNet row in them, unsliced.
    assert all(b[i].unsliced() for b in batched for i in gated) == step_states
    for s, ref, keep in zip(solo, alone, keeps):
        adapter.rollback(s, ref.rollback, keep)
    for b, s in zip(batched, solo):
        _same_caches(b, s)
    before = stacked.reused
    _round(adapter, taps, batched, solo, _tokens(adapter, [16] * 4, 13), [False] * 4)
    attention_layers = sum(not layer.is_linear for layer in adapter.layers)
    # Rolled back row by row (no per-step records), the GatedDeltaNet rows hold arrays of their own.
    assert stacked.reused - before == (len(adapter.layers) if step_states else attention_layers)


def test_rows_match_with_recorded_step_deltas(setup, step_deltas):
    adapter, taps, prompts = setup
    _check_rows(step_deltas(adapter), taps, prompts)


@pytest.mark.parametrize("record", ["states", "deltas"])
def test_rows_of_two_widths_roll_back_together_from_step_states(setup, request, record):
    """Verifies of two widths in one forward (auto plans narrower cycles) are two batches of step
    states (or deltas), whose rows are numbered from 0 in each: a batched rollback where both
    batches have the same rows and keeps takes each row's state from its own batch, as alone."""
    adapter, taps, prompts = _recording(setup, request, f"step_{record}")
    batched, solo = _world(adapter, prompts), _world(adapter, prompts)
    outs, alone = _round(adapter, taps, batched, solo, _tokens(adapter, [16, 16, 4, 4], 14), [False] * 4)
    keeps = [3, 2, 3, 2]
    adapter.rollback_rows([(b, out.rollback, keep) for b, out, keep in zip(batched, outs, keeps)])
    for s, ref, keep in zip(solo, alone, keeps):
        adapter.rollback(s, ref.rollback, keep)
    for b, s in zip(batched, solo):
        _same_caches(b, s)
    _round(adapter, taps, batched, solo, _tokens(adapter, [4, 16, 16, 4], 15), [False] * 4)


def test_a_batched_forward_leaves_the_gated_delta_rows_in_their_batch(setup):
    """After a batched forward each row's GatedDeltaNet caches hold their row of the stacked conv
    windows and states with no slice made (four ops a row and layer every round); reading one makes
    its slices, which are that row of the stacks, and the same rows' next forward still starts from
    the stacks. A slot written since (a rollback of that row alone) makes the next forward stack
    that layer's rows anew."""
    adapter, taps, prompts = setup
    caches = _world(adapter, prompts)
    gated = [i for i, layer in enumerate(adapter.layers) if layer.is_linear]
    step = lambda seed: mx.eval([o.logits for o in adapter.forward_rows(  # noqa: E731
        [ForwardRow(t, c) for t, c in zip(_tokens(adapter, [1] * len(caches), seed), caches)])])
    step(10)
    assert all(c[i].unsliced() for c in caches for i in gated)
    for row, cache in enumerate(caches):
        (conv, state), index = cache[gated[0]].batch_row()
        assert index == row
        assert mx.array_equal(cache[gated[0]][0], conv[row : row + 1]).item()
        assert mx.array_equal(cache[gated[0]][1], state[row : row + 1]).item()
        assert not cache[gated[0]].unsliced() and cache[gated[0]].batch_row() is not None
    before = adapter.stacked_rows.reused
    step(20)
    assert adapter.stacked_rows.reused - before == len(adapter.layers)
    caches[1][gated[0]][1] = caches[1][gated[0]][1] + 0  # an array of its own now
    assert caches[1][gated[0]].batch_row() is None
    before = adapter.stacked_rows.reused
    step(30)
    assert adapter.stacked_rows.reused - before == len(adapter.layers) - 1
