"""`forward_rows` (several generations in one target forward) gives every row exactly what `forward`
gives it alone: logits, tapped hidden states, rollback records and the caches afterwards, bit for
bit on the CPU (float32, MLX's reference BLAS; on a GPU a batch's products and a row's alone round
differently, as the README says, so there they agree to float32 rounding). Rows mix decode steps, verify blocks and a block of
another length over prompts shorter and longer than the Gemma fixtures' sliding window of 8; the
solo world runs the same rows on caches of its own, prefilled separately.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from forced import assert_rounds_alike
from mlx_lm.models.cache import KVCache

from dflash_core.adapters import ForwardRow
from dflash_core.loading import load_target

FAMILIES = ["qwen3", "gemma3", "gemma4"]
TAPS = [0, 2]
PROMPTS = [5, 13, 30, 30]  # prefill lengths, one per row
FIRST = [1, 16, 7, 16]  # each row's tokens in the first batched round
SECOND = [16, 1, 16, 1]  # and in the second, after each row's rollback
KEEP = [0, 3, None, 1]  # what each row keeps of its first round (None: all of it)


@pytest.fixture(scope="module")
def adapters(request):
    return {family: load_target(request.getfixturevalue(f"{family}_pair")[0])[0] for family in FAMILIES}


def _tokens(adapter, n: int, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, adapter.vocab_size, size=(1, n)), dtype=mx.int32)


def _prefilled(adapter, lengths) -> list[list]:
    """A fresh cache per row, prefilled with that row's prompt (through `forward`, as the engine)."""
    caches = []
    for row, n in enumerate(lengths):
        cache = adapter.make_cache(max_rollback=16)
        adapter.forward(_tokens(adapter, n, seed=row), cache)
        caches.append(cache)
    return caches


def _same_output(solo, batched):
    assert_rounds_alike(solo.logits, batched.logits)
    assert (solo.tapped_hidden is None) == (batched.tapped_hidden is None)
    if solo.tapped_hidden is not None:
        assert_rounds_alike(solo.tapped_hidden, batched.tapped_hidden)
    assert (solo.rollback is None) == (batched.rollback is None)
    if solo.rollback is not None:
        assert solo.rollback.tokens == batched.rollback.tokens and solo.rollback.states == batched.rollback.states


def _same_cache(solo: list, batched: list, written: int = 1):
    """The caches hold the same numbers wherever a query can still read: `written` tokens came in
    the last forward (a rollback may undo all but one of them)."""
    for a, b in zip(solo, batched):
        assert type(a) is type(b) and a.offset == b.offset
        if isinstance(a, KVCache):
            # Every position held: batched rows share one buffer, whose length and unused tail are
            # the batch's (nothing reads past a row's offset).
            assert_rounds_alike(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :])
            assert_rounds_alike(a.values[..., : a.offset, :], b.values[..., : b.offset, :])
        else:
            # Rings: every slot whose position a query can see, now or after rolling back all but
            # one of the tokens just written, in the same place. (A batched row's padding lands in
            # older slots, which stay masked until overwritten.)
            assert a.keys.shape == b.keys.shape
            end, capacity = a.offset, a.capacity
            positions = end - 1 - ((end - 1 - np.arange(capacity)) % capacity)
            seen = mx.array(np.flatnonzero((positions >= 0) & (positions >= end - written + 1 - a.window)))
            assert_rounds_alike(a.keys[..., seen, :], b.keys[..., seen, :])
            assert_rounds_alike(a.values[..., seen, :], b.values[..., seen, :])


def _round(adapter, solo_caches, batched_caches, lengths, seed, tap_ids=TAPS, **row_kwargs):
    """The same rows once alone and once in one `forward_rows`; returns both worlds' outputs."""
    tokens = [_tokens(adapter, n, seed + row) for row, n in enumerate(lengths)]
    solo = [adapter.forward(t, c, tap_ids, record=True, **row_kwargs) for t, c in zip(tokens, solo_caches)]
    batched = adapter.forward_rows([ForwardRow(t, c, record=True, **row_kwargs) for t, c in zip(tokens, batched_caches)],
                                   tap_ids)
    mx.eval([o.logits for o in solo + batched])
    for s, b, n in zip(solo, batched, lengths):
        assert b.logits.shape[1] == (1 if row_kwargs.get("last_logits_only") else n)
        _same_output(s, b)
        if b.choices is not None:  # the batch's one argmax, each row's part: its own logits' argmax
            assert mx.array_equal(b.choices, mx.argmax(b.logits[0], axis=-1).astype(mx.int32))
    assert any(b.choices is not None for b in batched)  # rows that ran together carry them
    for s, b, n in zip(solo_caches, batched_caches, lengths):
        _same_cache(s, b, written=n)
    return solo, batched


def _roll_back(adapter, solo_caches, batched_caches, solo, batched):
    """Each row back to its KEEP of the FIRST round's tokens, in both worlds."""
    for row, keep in enumerate(KEEP):
        keep = FIRST[row] if keep is None else keep
        adapter.rollback(solo_caches[row], solo[row].rollback, keep)
        adapter.rollback(batched_caches[row], batched[row].rollback, keep)


def _check_rows_match_solo(adapter):
    solo_caches, batched_caches = _prefilled(adapter, PROMPTS), _prefilled(adapter, PROMPTS)
    solo, batched = _round(adapter, solo_caches, batched_caches, FIRST, seed=100)
    # Each row rolls back to its own accepted prefix, in both worlds; the caches stay exact and so
    # does the next round.
    _roll_back(adapter, solo_caches, batched_caches, solo, batched)
    for s, b in zip(solo_caches, batched_caches):
        _same_cache(s, b)
    _round(adapter, solo_caches, batched_caches, SECOND, seed=200)
    # Plain steps without taps or records, and only the last position's logits.
    _round(adapter, solo_caches, batched_caches, [1, 3, 1, 16], seed=300, tap_ids=(), last_logits_only=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_match_solo_forwards(adapters, family):
    _check_rows_match_solo(adapters[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_match_solo_on_the_cuda_attention_path(adapters, family, exact_attention_calls):
    """Verify rows attend through the gate of the exact kernel CUDA uses (kernels/attention_cuda.py;
    on the CPU its stand-in), all rows in one call, each with its own mask."""
    _check_rows_match_solo(adapters[family])
    assert exact_attention_calls


@pytest.mark.parametrize("family", FAMILIES)
def test_a_row_does_not_depend_on_its_companions(adapters, family):
    adapter = adapters[family]
    row_tokens = _tokens(adapter, 16, seed=7)
    outputs = []
    for companions in ([1, 16], [7]):
        caches = _prefilled(adapter, [30, 5, 13][: 1 + len(companions)])
        rows = [ForwardRow(row_tokens, caches[0], record=True)]
        rows += [ForwardRow(_tokens(adapter, n, seed=50 + j), c) for j, (n, c) in enumerate(zip(companions, caches[1:]))]
        outputs.append((adapter.forward_rows(rows, TAPS)[0], caches[0]))
    (first, first_cache), (second, second_cache) = outputs
    _same_output(first, second)
    _same_cache(first_cache, second_cache)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_rows_run_alone_among_small_ones(adapters, family):
    """A row longer than the compiled forwards (a prefill chunk) runs through the plain forward,
    in place among the others."""
    adapter = adapters[family]
    lengths = [1, adapter.compile_max_tokens + 4, 16]
    solo_caches, batched_caches = _prefilled(adapter, PROMPTS[:3]), _prefilled(adapter, PROMPTS[:3])
    _round(adapter, solo_caches, batched_caches, lengths, seed=400)


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_started_in_parts_gives_the_same_rows(adapters, family, monkeypatch):
    """A verify forward hands its first layers to the device while the rest is built
    (`queue_layers`); the rows' outputs and caches are exactly those of the forward built whole,
    and plain decode steps are not split."""
    adapter = adapters[family]
    whole = adapter.with_kernels(replace(adapter.kernels, queue_layers=False))
    queued = []
    async_eval = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: queued.append(len(arrays)) or async_eval(*arrays))
    for lengths, split in ((FIRST, True), ([1, 1, 1, 1], False)):
        worlds = []
        for each in (adapter, whole):
            caches = _prefilled(adapter, PROMPTS)
            queued.clear()
            rows = [ForwardRow(_tokens(adapter, n, 100 + r), c, record=True) for r, (n, c) in enumerate(zip(lengths, caches))]
            outputs = each.forward_rows(rows, TAPS)
            worlds.append((outputs, caches, len(queued)))
        (parts, part_caches, starts), (built_whole, whole_caches, whole_starts) = worlds
        assert whole_starts == 0 and (starts > 0) == split
        for a, b in zip(parts, built_whole):
            _same_output(a, b)
        for a, b in zip(part_caches, whole_caches):
            _same_cache(a, b)


# Gemma 4 attends row by row (its KV-shared layers read each row's own): nothing is stacked there.
@pytest.mark.parametrize("family", FAMILIES)
def test_rows_carry_their_stacked_buffers_to_the_next_forward(adapters, family):
    """A batched forward starts from the buffers the same rows' last one stacked (no copy of every
    row's cache per layer), also where they must grow past a 256-position buffer; a row whose cache
    moved on in between (it ran alone) makes its rows stack anew. Each round is exact against solo."""
    from dflash_core.cache import RowOfBatch

    adapter = adapters[family]
    stacked = adapter.stacked_rows
    prompts = [240, 30, 241]
    solo_caches, batched_caches = _prefilled(adapter, prompts), _prefilled(adapter, prompts)
    _round(adapter, solo_caches, batched_caches, [16, 1, 15], seed=400)
    before = stacked.reused
    _round(adapter, solo_caches, batched_caches, [16, 16, 1], seed=500)  # rows 0 and 2 past 256
    carried = stacked.reused - before
    assert carried > 0, "the second forward of the same rows stacked every buffer again"
    assert max(c.offset for c in batched_caches[0] if isinstance(c, KVCache)) > 256
    # Row 1 steps alone in both worlds: its caches hold buffers of their own now.
    token = _tokens(adapter, 1, seed=600)
    mx.eval(adapter.forward(token, solo_caches[1]).logits, adapter.forward(token, batched_caches[1]).logits)
    # Its writes (in place, into the slices of the stack it held) end its hold on the batch.
    written = [c for c in batched_caches[1] if isinstance(c, RowOfBatch)]
    assert written and all(c.batch_row() is None for c in written)
    before = stacked.reused
    _round(adapter, solo_caches, batched_caches, [1, 16, 16], seed=700)
    assert stacked.reused == before, "buffers were reused although a row's cache had changed"
    before = stacked.reused
    _round(adapter, solo_caches, batched_caches, [16, 1, 1], seed=800)
    assert stacked.reused - before == carried


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_sliding_layers_attend_as_one_batch(adapters, family):
    """The Gemmas' sliding-window layers write the rows' rings as one stack and attend once for all
    rows (row by row, 15 of Gemma 3 270M's 18 layers made a batched step cost about as much host
    work as each row's step alone), and Gemma 4's KV-shared layers attend over the batch their
    source layer wrote: the next forward of the same rows, after their rollbacks, starts from the
    stack of every layer that has a cache, the sliding ones included. Exact against solo throughout."""
    adapter = adapters[family]
    cached = len(adapter.make_cache(max_rollback=16))
    sliding = [c for c in adapter.make_cache(max_rollback=16) if not isinstance(c, KVCache)]
    assert sliding and cached == len(adapter.layers) - getattr(adapter.args, "num_kv_shared_layers", 0)
    if family == "gemma4":
        assert adapter.args.num_kv_shared_layers > 0  # the fixture has layers that reuse others' K/V
    solo_caches, batched_caches = _prefilled(adapter, PROMPTS), _prefilled(adapter, PROMPTS)
    solo, batched = _round(adapter, solo_caches, batched_caches, FIRST, seed=800)
    _roll_back(adapter, solo_caches, batched_caches, solo, batched)
    before = adapter.stacked_rows.reused
    _round(adapter, solo_caches, batched_caches, SECOND, seed=900)
    assert adapter.stacked_rows.reused - before == cached


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batched_forward_slices_no_row_out_until_it_is_read(adapters, family):
    """After a batched forward each row's caches hold their row of the stacked buffers without a
    slice made (two ops a row and layer every step: most of a step's host work at hundreds of
    rows); reading one makes its slice, which is that row of the stack, and the same rows' next
    forward still starts from the stack (reading is not writing)."""
    from dflash_core.cache import RowOfBatch

    adapter = adapters[family]
    caches = _prefilled(adapter, [20, 7, 13])
    step = lambda seed: mx.eval([o.logits for o in adapter.forward_rows(  # noqa: E731
        [ForwardRow(_tokens(adapter, 1, seed + r), c) for r, c in enumerate(caches)])])
    step(10)
    held = [(row, c) for row, cache in enumerate(caches) for c in cache if isinstance(c, RowOfBatch)]
    assert held and all(c._batch is not None for _, c in held)
    for row, c in held:
        stacked_keys, _, index = c.batch_row()
        assert index == row and mx.array_equal(c.keys, stacked_keys[row : row + 1])
        assert c._batch is None and c.batch_row() is not None  # sliced once, still the batch's row
    before = adapter.stacked_rows.reused
    step(20)
    assert adapter.stacked_rows.reused - before == len({id(c) for _, c in held}) // 3


def test_rows_of_different_lengths_change_layout_in_one_gather_each_way():
    """`rows.to_batch` lays rows of different lengths out as [rows, longest, ...] by one gather
    (each row's tokens, then its last one again as padding) and `from_batch` takes exactly the real
    tokens back, in order; rows of one length are a reshape both ways."""
    from dflash_core.rows import batch_index, from_batch, to_batch, unbatch_index

    bounds = [(0, 3), (3, 4), (4, 8)]
    x = mx.arange(8 * 2).reshape(1, 8, 2)
    batched = to_batch(x, bounds, 4)
    assert batched.shape == (3, 4, 2)
    assert batched[:, :, 0].tolist() == [[0, 2, 4, 4], [6, 6, 6, 6], [8, 10, 12, 14]]
    assert mx.array_equal(to_batch(x, bounds, 4, batch_index(bounds, 4)), batched)
    assert mx.array_equal(from_batch(batched, bounds), x)
    assert mx.array_equal(from_batch(batched, bounds, unbatch_index(bounds)), x)
    even = [(0, 4), (4, 8)]
    assert mx.array_equal(from_batch(to_batch(x, even, 4), even), x)
