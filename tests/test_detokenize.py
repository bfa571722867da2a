"""Incremental detokenization never splits a character, whatever the chunking."""

from __future__ import annotations

import random

import pytest

from dflash_core.detokenize import MAX_HELD, IncrementalDetokenizer
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


def _bytes_path(tokenizer):
    from dflash_core.detokenize import TokenBytes

    token_bytes = TokenBytes.for_tokenizer(tokenizer)
    assert token_bytes is not None  # the fixtures' tokenizers are byte-level BPE
    return token_bytes


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_the_byte_path_equals_the_tokenizers_decode(request, family):
    target_dir, _ = request.getfixturevalue(f"{family}_pair")
    _, tokenizer, _ = load_target(target_dir)
    token_bytes = _bytes_path(tokenizer)
    rng = random.Random(1)
    ids = list(tokenizer.encode(TEXT, add_special_tokens=False)) + [rng.randrange(len(tokenizer._tokenizer)) for _ in range(300)]
    detok = IncrementalDetokenizer(tokenizer, token_bytes)
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 16)
        out.append(detok.add(ids[i : i + n]))
        i += n
    text = "".join(out) + detok.flush()
    assert text == tokenizer._tokenizer.decode(ids, skip_special_tokens=False).rstrip("\ufffd")


@pytest.mark.timed
@pytest.mark.parametrize("bytes_path", [True, False], ids=["byte-level", "window"])
def test_bytes_that_never_form_a_character_do_not_stall(qwen3_pair, bytes_path):
    """600 tokens of lone continuation bytes: text keeps coming (as U+FFFD), in linear time."""
    import time

    _, tokenizer, _ = load_target(qwen3_pair[0])
    hf = tokenizer._tokenizer
    bad = next(t for t in range(len(hf)) if hf.decode([t]) == "\ufffd" and hf.decode([t, t]) == "\ufffd\ufffd")
    detok = IncrementalDetokenizer(tokenizer, _bytes_path(tokenizer) if bytes_path else None)
    started, emitted = time.perf_counter(), []
    for k in range(600):
        emitted.append(detok.add([bad]))
    took = time.perf_counter() - started
    text = "".join(emitted)
    held = 0 if bytes_path else MAX_HELD + 3  # the window path holds a few back at most
    assert len(text) >= 600 - held and set(text) == {"\ufffd"}
    assert len("".join(emitted[:40])) >= 40 - held  # not held until the end
    assert took < 2.0
