"""Load a target (any mlx-lm checkpoint of a supported family) and its DFlash drafter."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from mlx_lm import utils as mlx_lm_utils

from .adapters import TargetAdapter, adapter_for
from .drafter import DFlashDrafter, load_drafter
from .engine import Engine
from .hub import resolve

log = logging.getLogger(__name__)


def load_target(path: Path) -> tuple[TargetAdapter, object, dict]:
    model, config = mlx_lm_utils.load_model(Path(path))
    text_config = config.get("text_config") or {}
    eos = config.get("eos_token_id", text_config.get("eos_token_id"))
    if isinstance(eos, int):
        eos = [eos]
    tokenizer = mlx_lm_utils.load_tokenizer(Path(path), eos_token_ids=eos)
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


@dataclass
class LoadedModel:
    engine: Engine
    target_path: Path
    drafter_path: Optional[Path]
    config: dict
    # Sampling defaults the model's authors ship in generation_config.json.
    generation_defaults: dict = field(default_factory=dict)


GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(path: Path) -> dict:
    file = Path(path) / "generation_config.json"
    if not file.exists():
        return {}
    raw = json.loads(file.read_text())
    if raw.get("do_sample") is False:
        return {"temperature": 0.0}
    return {k: raw[k] for k in GENERATION_DEFAULT_KEYS if raw.get(k) is not None}


def load_model(
    target: str,
    drafter: Optional[str] = None,
    *,
    target_revision: Optional[str] = None,
    drafter_revision: Optional[str] = None,
    prefill_chunk: int = 2048,
    max_context: Optional[int] = None,
) -> LoadedModel:
    target_path = resolve(target, target_revision)
    adapter, tokenizer, config = load_target(target_path)
    draft_model, drafter_path = None, None
    if drafter:
        drafter_path = resolve(drafter, drafter_revision)
        draft_model = load_checked_drafter(drafter_path, adapter)
    engine = Engine(
        adapter,
        tokenizer,
        draft_model,
        prefill_chunk=prefill_chunk,
        max_context=max_context or max_position_embeddings(config),
    )
    return LoadedModel(engine, target_path, drafter_path, config, generation_defaults(target_path))


def load_engine(target: str, drafter: Optional[str] = None, **kwargs) -> Engine:
    return load_model(target, drafter, **kwargs).engine
