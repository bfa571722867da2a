"""Several generations drafting in one forward (`propose_rows`, `add_context_rows`) get, row for
row, exactly what each gets alone (`propose`, `add_context`): on the CPU's reference BLAS a row of a
product does not depend on the other rows, and everything else runs per row."""

from __future__ import annotations

import mlx.core as mx
import pytest

from dflash_core.drafter import DraftRow
from dflash_core.kernels import attention as block_attention
from dflash_core.kernels import matmul as small_m
from dflash_core.loading import load_checked_drafter, load_target

CONTEXTS = (4, 11, 25)  # each row's first context
WIDTHS = (16, 16, 5)
MORE = (3, 1, 6)  # the context a verify adds to each row before the next round
NEXT_WIDTHS = (5, 16, 9)


def _load(pair):
    target, _, _ = load_target(pair[0])
    return target, load_checked_drafter(pair[1], target)


def _taps(target, drafter, n: int) -> mx.array:
    """Target taps [1, n, n_taps*H] of n arbitrary tokens."""
    tokens = (mx.arange(n, dtype=mx.int32) * 7 + 3) % target.vocab_size
    return target.forward(tokens[None], target.make_cache(16), drafter.config.target_layer_ids).tapped_hidden


def _split_taps(taps, lengths):
    out, at = [], 0
    for n in lengths:
        out.append(taps[:, at : at + n])
        at += n
    return out


def _assert_same_cache(a, b):
    for layer_a, layer_b in zip(a, b):
        assert layer_a.offset == layer_b.offset
        n = layer_a.offset
        assert mx.array_equal(layer_a.keys[..., :n, :], layer_b.keys[..., :n, :])
        assert mx.array_equal(layer_a.values[..., :n, :], layer_b.values[..., :n, :])


def _check_rows_match_alone(target, drafter):
    taps = _split_taps(_taps(target, drafter, sum(CONTEXTS) + sum(MORE)), CONTEXTS + MORE)
    first, more = taps[:3], taps[3:]
    batched, alone = [drafter.make_cache() for _ in CONTEXTS], [drafter.make_cache() for _ in CONTEXTS]
    drafter.add_context_rows(list(zip(first, batched)))
    for t, cache in zip(first, alone):
        drafter.add_context(t, cache)
    for a, b in zip(batched, alone):
        _assert_same_cache(a, b)

    for round_widths in (WIDTHS, NEXT_WIDTHS):
        # Bonus tokens still lazy on the device, as the engine passes them.
        bonuses = [(mx.argmax(t[0, -1]) % target.vocab_size).reshape(1).astype(mx.int32) for t in first]
        rows = [DraftRow(b, cache, w) for b, cache, w in zip(bonuses, batched, round_widths)]
        got = drafter.propose_rows(rows, target)
        want = [drafter.propose(b, target, cache, w) for b, cache, w in zip(bonuses, alone, round_widths)]
        for g, w, width in zip(got, want, round_widths):
            assert g.shape == (width - 1,) and g.dtype == mx.int32
            assert mx.array_equal(g, w)
        # Stronger than the argmax: every hidden state of every row, to the bit.
        block = mx.concatenate([mx.concatenate([b, mx.full((w - 1,), drafter.config.mask_token_id, mx.int32)])
                                for b, w in zip(bonuses, round_widths)])
        h = drafter.hidden_rows(target.embed(block[None]), batched, round_widths)
        at = 0
        for b, cache, w in zip(bonuses, alone, round_widths):
            single = mx.concatenate([b, mx.full((w - 1,), drafter.config.mask_token_id, mx.int32)])
            assert mx.array_equal(h[:, at : at + w], drafter.hidden(target.embed(single[None]), cache))
            at += w
        # A verify accepted a few drafts in each row: the context grows, by different amounts.
        drafter.add_context_rows(list(zip(more, batched)))
        for t, cache in zip(more, alone):
            drafter.add_context(t, cache)
        for a, b in zip(batched, alone):
            _assert_same_cache(a, b)
        first = more


@pytest.mark.parametrize("family", ["qwen3", "gemma4", "qwen3_5"])
def test_rows_match_each_row_alone(request, family):
    _check_rows_match_alone(*_load(request.getfixturevalue(f"{family}_pair")))


def test_rows_match_with_sliding_layers(tiny_pair_factory):
    pair = tiny_pair_factory("qwen3", layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                             num_layers=2)
    target, drafter = _load(pair)
    assert drafter.config.is_sliding(0) and drafter.config.is_causal(0) and not drafter.config.is_sliding(1)
    _check_rows_match_alone(target, drafter)


@pytest.mark.parametrize("drafter_exact", [True, False], ids=["exact-kernel", "stacked-gemms"])
def test_rows_match_on_the_cuda_paths(qwen3_pair, monkeypatch, exact_attention_calls, drafter_exact):
    """The stacked k/v and gate/up matrices CUDA uses for drafter blocks, and their attention as
    CUDA runs it (by default the exact kernel's gate over [context ; block] joined, its CPU
    stand-in here; with `drafter_exact_attention` off, the stacked block attention over the two),
    run here on the CPU: rows still get what they get alone. (On a GPU the exact kernel itself runs,
    whose sums follow the keys' slots, which batching moves: a row's drafts may differ there in
    their last bits, never the target's tokens; that variant is for the CPU's stand-in.)"""
    from dataclasses import replace

    from dflash_core.kernels import backend

    if drafter_exact and backend() == "cuda":
        pytest.skip("the real kernel rounds a row by its keys' slots, which batching moves")

    monkeypatch.setattr(small_m, "backend", lambda: "cuda")
    monkeypatch.setattr(block_attention, "backend", lambda: "cuda")
    taken = []
    stacked = block_attention.stacked
    monkeypatch.setattr(block_attention, "stacked", lambda q, *rest: taken.append(q.shape[2]) or stacked(q, *rest))
    target, drafter = _load(qwen3_pair)
    drafter = drafter.with_kernels(replace(drafter.kernels, drafter_exact_attention=drafter_exact))
    drafter.stack_shared_inputs()
    assert drafter.layers[0].self_attn.kv_input.stacked
    _check_rows_match_alone(target, drafter)
    blocks = exact_attention_calls if drafter_exact else taken
    assert 5 in blocks and 16 in blocks  # each row's block attended on its own
    assert not taken or not drafter_exact  # by default none through the stacked GEMMs


def test_a_row_does_not_depend_on_its_companions(qwen3_pair):
    target, drafter = _load(qwen3_pair)
    taps = _split_taps(_taps(target, drafter, sum(CONTEXTS)), CONTEXTS)
    caches = [drafter.make_cache() for _ in CONTEXTS]
    drafter.add_context_rows(list(zip(taps, caches)))
    mask_id = drafter.config.mask_token_id

    def run(rows, k):  # row k's proposals and hidden states; a row is (bonus, cache index, width)
        block = mx.concatenate([mx.array([bonus] + [mask_id] * (w - 1), mx.int32) for bonus, _, w in rows])
        h = drafter.hidden_rows(target.embed(block[None]), [caches[i] for _, i, _ in rows], [w for *_, w in rows])
        at = sum(w for *_, w in rows[:k])
        drafts = drafter.propose_rows([DraftRow(mx.array([b], mx.int32), caches[i], w) for b, i, w in rows], target)
        return drafts[k], h[:, at : at + rows[k][2]]

    row = (9, 1, 16)
    alone = run([row], 0)
    for companions, k in [([(5, 0, 5), row, (7, 2, 16)], 1), ([row, (7, 2, 16), (5, 0, 9)], 0), ([(5, 0, 2), row], 1)]:
        drafts, hidden = run(companions, k)
        assert mx.array_equal(drafts, alone[0]) and mx.array_equal(hidden, alone[1])
    assert [c[0].offset for c in caches] == list(CONTEXTS)  # proposing writes nothing to the caches


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_a_narrower_cycles_drafts_are_the_whole_blocks_first(request, family):
    """A cycle that verifies fewer than the block's positions gets the whole block's first drafts,
    alone and among rows of other widths: a block's positions attend to one another, and a block
    of fewer masks than the drafter was trained on drafts worse (docs/performance.md)."""
    target, drafter = _load(request.getfixturevalue(f"{family}_pair"))
    taps = _split_taps(_taps(target, drafter, sum(CONTEXTS)), CONTEXTS)
    caches = [drafter.make_cache() for _ in CONTEXTS]
    drafter.add_context_rows(list(zip(taps, caches)))
    bonuses = [mx.array([b], mx.int32) for b in (9, 5, 7)]
    whole = [drafter.propose(b, target, cache) for b, cache in zip(bonuses, caches)]
    assert all(w.shape == (15,) for w in whole)
    for width in (2, 4, 8, 16):
        for b, cache, w in zip(bonuses, caches, whole):
            assert mx.array_equal(drafter.propose(b, target, cache, width), w[: width - 1])
    widths = (2, 16, 8)
    rows = drafter.propose_rows([DraftRow(b, cache, w) for b, cache, w in zip(bonuses, caches, widths)], target)
    for got, w, width in zip(rows, whole, widths):
        assert mx.array_equal(got, w[: width - 1])
    for width in (1, 17):  # no draft at all, or more than the block: refused, naming the bounds
        with pytest.raises(ValueError, match="2 to the block size 16"):
            drafter.propose(bonuses[0], target, caches[0], width)
