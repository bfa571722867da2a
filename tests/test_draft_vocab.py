"""A drafter's draft vocabulary (draft_vocab.json): its drafts are the argmax of the target's head
over those tokens alone, the file is read and checked at load, and the output stays exactly the
target's."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from families import ENGINE_FAMILIES
from families import sample_prompt as _prompt

from dflash_core.draft_vocab import DRAFT_VOCAB_FILE, most_frequent, read_draft_vocab, write_draft_vocab
from dflash_core.drafter_config import CheckpointError
from dflash_core.engine import Engine
from dflash_core.loading import load_checked_drafter, load_target
from dflash_core.sampling import SamplingParams

N_TOKENS = 48


def test_a_head_over_some_tokens_is_those_columns_of_the_head(qwen3_pair, cpu_kernels):
    """`head_over(ids)`: the head's columns for `ids`, from a tied float32 head (MLX's product, and
    our CPU head kernel where the rows are many enough for it) and from a quantized untied head."""
    target, _, _ = load_target(qwen3_pair[0])
    ids = mx.array([5, 17, 300, 2], dtype=mx.int32)
    hidden = mx.random.normal((1, 3, target.hidden_size))
    full = np.array(target.lm_head(hidden))[..., [5, 17, 300, 2]]
    np.testing.assert_allclose(np.array(target.head_over(ids)(hidden)), full, rtol=1e-5, atol=1e-5)
    target.cpu_head_min_parameters = 0  # the kernel for a head of any size (its weights in float16)
    kernel = target.head_over(ids)
    assert type(kernel).__name__ in ("HalfHead", "Int8Head")
    np.testing.assert_allclose(np.array(kernel(hidden)), full, rtol=0.01, atol=0.01 * np.abs(full).max())
    head = nn.Linear(target.hidden_size, target.vocab_size, bias=False)
    head.weight = mx.random.normal(head.weight.shape) * 0.05
    target.text_model.lm_head = nn.QuantizedLinear.from_linear(head, group_size=32, bits=4)
    target.text_model.args.tie_word_embeddings = False
    np.testing.assert_allclose(np.array(target.head_over(ids)(hidden)),
                               np.array(target.text_model.lm_head(hidden))[..., [5, 17, 300, 2]], rtol=1e-5, atol=1e-5)


def _subset(vocab: int, keep: list[int], extra: int, seed: int) -> mx.array:
    rng = np.random.default_rng(seed)
    others = [int(t) for t in rng.permutation(vocab) if int(t) not in set(keep)][:extra]
    return mx.array(sorted(set(keep) | set(others)), dtype=mx.int32)


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_drafts_are_the_heads_argmax_over_the_draft_vocab(engines, family):
    """A block's drafts with a draft vocabulary (used on the CPU by default) are the ids whose columns
    of the full head score highest among those ids: each draft in the vocabulary, and the same as the
    full head's drafts wherever the full head's choice is in it."""
    engine = engines[family]
    target, drafter = engine.target, engine.drafter
    prompt = mx.array(_prompt(engine), dtype=mx.int32)
    cache = target.make_cache(max_rollback=16)
    out = target.forward(prompt[None], cache, drafter.config.target_layer_ids, last_logits_only=True)
    context = drafter.make_cache()
    drafter.add_context(out.tapped_hidden, context)
    bonus = mx.argmax(out.logits[0, -1]).reshape(1).astype(mx.int32)
    whole = drafter.propose(bonus, target, context).tolist()
    left_out = whole[0]  # (a tiny drafter may draft one token throughout)
    vocab = _subset(target.vocab_size, [t for t in whole if t != left_out], target.vocab_size // 4, seed=1).tolist()
    vocab = mx.array([t for t in vocab if t != left_out], dtype=mx.int32)
    block = mx.concatenate([bonus, mx.full((drafter.block_size - 1,), drafter.config.mask_token_id, mx.int32)])
    logits = drafter.logits(drafter.hidden(target.embed(block[None]), context)[:, 1:], target.lm_head)[0]
    want = np.array(vocab)[np.argmax(np.array(logits)[:, np.array(vocab)], axis=-1)].tolist()
    try:
        drafter.draft_vocab = vocab
        cut = drafter.propose(bonus, target, context).tolist()
        # (on the CPU by default; with the option off, or on a GPU by default, over the whole head)
        assert drafter.with_kernels(replace(drafter.kernels, draft_vocab=False)).propose(bonus, target, context).tolist() \
            == whole
    finally:
        drafter.draft_vocab = None
    assert set(cut) <= set(vocab.tolist())
    assert cut == want
    assert [c for c, w in zip(cut, whole) if w in set(vocab.tolist())] == [w for w in whole if w in set(vocab.tolist())]
    assert cut[0] != whole[0]


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=7)], ids=["greedy", "seeded"])
def test_a_draft_vocabulary_keeps_the_output_the_targets(engines, family, sampling):
    """Speculative output with a draft vocabulary is the target-alone output, with one that holds
    every token the target produces (cycles accept drafts) and one that lacks half of them (their
    positions' drafts are rejected)."""
    base = engines[family]
    prompt = _prompt(base)

    def tokens(engine, **kwargs):
        chunks = list(engine.generate(prompt, max_tokens=N_TOKENS, sampling=sampling, stop_token_ids=set(), **kwargs))
        return [t for c in chunks for t in c.token_ids], chunks[-1].stats

    reference, _ = tokens(base, speculative=False)
    produced = sorted(set(reference))
    for keep in (produced, produced[::2]):
        drafter = base.drafter.with_kernels(base.drafter.kernels)  # (its own draft vocabulary)
        drafter.draft_vocab = _subset(base.target.vocab_size, keep, base.target.vocab_size // 8, seed=len(keep))
        out, stats = tokens(Engine(base.target, base.tokenizer, drafter, prefill_chunk=16), speculation="on")
        assert out == reference and stats.cycles > 0


def test_a_drafters_draft_vocab_file_is_read_and_checked(qwen3_pair, tmp_path):
    target, _, _ = load_target(qwen3_pair[0])
    directory = tmp_path / "drafter"
    shutil.copytree(qwen3_pair[1], directory)
    assert load_checked_drafter(directory, target).draft_vocab is None  # none: the whole head
    ids, coverage = most_frequent([[7, 7, 3, 9], [3, 7, 11]], 3)
    assert ids == [7, 3, 9] and coverage == pytest.approx(6 / 7)
    write_draft_vocab(directory, ids, "test", coverage)
    assert load_checked_drafter(directory, target).draft_vocab.tolist() == [7, 3, 9]
    file = directory / DRAFT_VOCAB_FILE
    for bad, says in (({"token_ids": []}, "token_ids"), ({"token_ids": [1, 1]}, "more than once"),
                      ({"token_ids": [target.vocab_size]}, "token_ids"), ({"ids": [1]}, "token_ids"),
                      ({"token_ids": [1.5]}, "token_ids")):
        file.write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=says) as raised:
            read_draft_vocab(directory, target.vocab_size)
        assert str(file) in str(raised.value)
    file.write_text("{not json")
    with pytest.raises(CheckpointError, match="JSON"):
        load_checked_drafter(directory, target)
