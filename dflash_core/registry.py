"""Known target -> DFlash drafter pairs, found from the names the MLX community uses.

`mlx-community/Qwen3.5-9B-4bit`, `Qwen/Qwen3.5-9B` and a local folder `Qwen3.5-9B-bf16` all find
`z-lab/Qwen3.5-9B-DFlash`: quantized and converted checkpoints use the drafter of their base model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class KnownPair:
    target: str  # the base model's Hugging Face repo
    drafter: str
    family: str
    drafter_revision: Optional[str] = None  # pin when a revision is verified (mask ids changed between revisions)
    note: str = ""


KNOWN_PAIRS: tuple[KnownPair, ...] = (
    KnownPair("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", "qwen3", note="non-thinking mode"),
    KnownPair("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", "qwen3", note="non-thinking mode"),
    KnownPair("Qwen/Qwen3.5-4B", "z-lab/Qwen3.5-4B-DFlash", "qwen3_5"),
    KnownPair("Qwen/Qwen3.5-9B", "z-lab/Qwen3.5-9B-DFlash", "qwen3_5"),
    KnownPair("Qwen/Qwen3.5-27B", "z-lab/Qwen3.5-27B-DFlash", "qwen3_5"),
    KnownPair("Qwen/Qwen3.5-35B-A3B", "z-lab/Qwen3.5-35B-A3B-DFlash", "qwen3_5_moe"),
    KnownPair("Qwen/Qwen3.5-122B-A10B", "z-lab/Qwen3.5-122B-A10B-DFlash", "qwen3_5_moe"),
    KnownPair("Qwen/Qwen3.6-27B", "z-lab/Qwen3.6-27B-DFlash", "qwen3_5", note="preview drafter"),
    KnownPair("Qwen/Qwen3.6-35B-A3B", "z-lab/Qwen3.6-35B-A3B-DFlash", "qwen3_5_moe"),
    KnownPair("google/gemma-4-31B-it", "z-lab/gemma-4-31B-it-DFlash", "gemma4"),
    KnownPair("google/gemma-4-26B-A4B-it", "z-lab/gemma-4-26B-A4B-it-DFlash", "gemma4"),
)

# Suffixes conversions add to a base model's name (mlx-community and friends).
_CONVERSION_SUFFIX = re.compile(
    r"(-(mlx|mxfp4|mxfp8|nvfp4|fp8|fp16|bf16|float16|bfloat16|dwq|awq|gptq|qat|q[2-8](_k(_m|_s)?)?|[2-8]bit|[2-8]-bit))+$"
)


def base_model_key(name: str) -> str:
    """`mlx-community/Qwen3.5-9B-MLX-4bit` -> `qwen3.5-9b`: the comparable part of a model name."""
    last = Path(name.rstrip("/")).name.lower()
    previous = None
    while previous != last:
        previous, last = last, _CONVERSION_SUFFIX.sub("", last)
    return last


def find_pair(target: str) -> Optional[KnownPair]:
    key = base_model_key(target)
    for pair in KNOWN_PAIRS:
        if base_model_key(pair.target) == key:
            return pair
    return None
