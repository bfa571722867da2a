"""Load a target (any mlx-lm checkpoint of a supported family) and its DFlash drafter."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from mlx_lm.utils import load_model, load_tokenizer

from .adapters import TargetAdapter, adapter_for
from .drafter import DFlashDrafter, load_drafter
from .engine import Engine
from .hub import resolve

log = logging.getLogger(__name__)


def load_target(path: Path) -> tuple[TargetAdapter, object, dict]:
    model, config = load_model(Path(path))
    text_config = config.get("text_config") or {}
    eos = config.get("eos_token_id", text_config.get("eos_token_id"))
    if isinstance(eos, int):
        eos = [eos]
    tokenizer = load_tokenizer(Path(path), eos_token_ids=eos)
    return adapter_for(model), tokenizer, config


def load_checked_drafter(path: Path, target: TargetAdapter) -> DFlashDrafter:
    drafter = load_drafter(path, dtype=target.dtype)
    drafter.config.check_target(
        str(Path(path) / "config.json"),
        hidden_size=target.hidden_size,
        num_layers=target.num_layers,
        vocab_size=target.vocab_size,
    )
    return drafter


def max_position_embeddings(config: dict) -> Optional[int]:
    text_config = config.get("text_config") or {}
    return config.get("max_position_embeddings", text_config.get("max_position_embeddings"))


def load_engine(
    target: str,
    drafter: Optional[str] = None,
    *,
    target_revision: Optional[str] = None,
    drafter_revision: Optional[str] = None,
    prefill_chunk: int = 2048,
    max_context: Optional[int] = None,
) -> Engine:
    adapter, tokenizer, config = load_target(resolve(target, target_revision))
    draft_model = None
    if drafter:
        draft_model = load_checked_drafter(resolve(drafter, drafter_revision), adapter)
    return Engine(
        adapter,
        tokenizer,
        draft_model,
        prefill_chunk=prefill_chunk,
        max_context=max_context or max_position_embeddings(config),
    )
