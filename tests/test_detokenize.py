"""Incremental detokenization never splits a character, whatever the chunking."""

from __future__ import annotations

import random

import pytest

from dflash_core.detokenize import IncrementalDetokenizer
from dflash_core.loading import load_target

TEXT = "Grüße aus Köln! 東京の天気は晴れ。 Emoji 🚀🔥 ok.\n def f(x):\n    return x ** 2  # naïve café"


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_chunked_decoding_is_exact_and_never_broken(request, family):
    target_dir, _ = request.getfixturevalue(f"{family}_pair")
    _, tokenizer, _ = load_target(target_dir)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in pieces), "the fixture should split some character across tokens"
    expected = tokenizer._tokenizer.decode(ids, skip_special_tokens=False)
    rng = random.Random(0)
    for trial in range(20):
        detok = IncrementalDetokenizer(tokenizer)
        out, i = [], 0
        while i < len(ids):
            n = 1 if trial == 0 else rng.randint(1, 16)
            delta = detok.add(ids[i : i + n])
            assert "\ufffd" not in delta
            out.append(delta)
            i += n
        out.append(detok.flush())
        assert "".join(out) == expected


def test_incomplete_character_at_the_end_is_dropped(qwen3_pair):
    _, tokenizer, _ = load_target(qwen3_pair[0])
    ids = tokenizer.encode("ok 🚀", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:k]))
    detok = IncrementalDetokenizer(tokenizer)
    text = detok.add(ids[:cut]) + detok.flush()
    assert "\ufffd" not in text and text == tokenizer.decode(ids[:cut]).rstrip("\ufffd")
