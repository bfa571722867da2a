"""A drafter's draft vocabulary: the token ids its drafts are chosen among (`draft_vocab.json` in its
directory), so that a draft multiplies its hidden states by those rows of the target's LM head
alone. A large vocabulary's head is most of a draft where products cost by the row, as on a CPU
(the demo target's is 262,144 x 640; docs/performance.md, "A draft vocabulary"), and
`KernelOptions.draft_vocab` uses it there by default. Drafts outside it are never proposed, so a
target token outside it ends a cycle's accepted run; the output is the target's either way.

The file: {"token_ids": [...], "source": "...", "coverage": 0.99} — distinct ids below the
target's vocabulary size, most frequent first; `source` and `coverage` (the share of the counted
tokens the ids cover) say where it came from. A drafter without one drafts over the whole head.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional

import mlx.core as mx

from .drafter_config import CheckpointError
from .kernels import DEFAULT_KERNELS, KernelOptions, backend

DRAFT_VOCAB_FILE = "draft_vocab.json"


def uses_draft_vocab(kernels: KernelOptions = DEFAULT_KERNELS) -> bool:
    """Whether drafts go over a drafter's draft vocabulary here (`KernelOptions.draft_vocab`; by
    default on the CPU only)."""
    return kernels.draft_vocab if kernels.draft_vocab is not None else backend() == "cpu"


def active_path(kernels: KernelOptions = DEFAULT_KERNELS) -> str:
    """Which head drafts are chosen by here (for `dflash doctor`)."""
    if uses_draft_vocab(kernels):
        return f"a drafter's {DRAFT_VOCAB_FILE} where it has one: drafts over those tokens' columns of the LM head"
    return f"the whole LM head (a drafter's {DRAFT_VOCAB_FILE} is used on the CPU only)"


def read_draft_vocab(path: Path, vocab_size: int) -> Optional[mx.array]:
    """The draft vocabulary in a drafter directory as int32 ids, or None where it has none. A file
    that is there but wrong is an error naming the file and key."""
    file = Path(path) / DRAFT_VOCAB_FILE
    if not file.is_file():
        return None
    try:
        ids = json.loads(file.read_text()).get("token_ids")
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{file}: not a readable JSON object ({e})") from None
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids)):
        raise CheckpointError(f"{file}: token_ids: expected a non-empty list of token ids in [0, {vocab_size})")
    if len(set(ids)) != len(ids):
        raise CheckpointError(f"{file}: token_ids: an id appears more than once")
    return mx.array(ids, dtype=mx.int32)


def most_frequent(sequences: Iterable[Iterable[int]], size: int) -> tuple[list[int], float]:
    """The `size` most frequent tokens of `sequences` (most frequent first; ties by id) and the share
    of all their tokens those cover."""
    counts = Counter(t for seq in sequences for t in seq)
    total = sum(counts.values())
    kept = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]
    return [t for t, _ in kept], (sum(c for _, c in kept) / total if total else 0.0)


def write_draft_vocab(path: Path, token_ids: list[int], source: str, coverage: float) -> Path:
    file = Path(path) / DRAFT_VOCAB_FILE
    file.write_text(json.dumps({"token_ids": [int(t) for t in token_ids], "source": source,
                                "coverage": round(coverage, 6)}, separators=(",", ":")))
    return file
