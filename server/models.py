"""The models this server can serve, loaded on the worker thread at start or on first use.

With `memory_budget_gb` set, loading a model first unloads the least recently used models that
no request is using until the new one fits (its size estimated from its weight files).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import mlx.core as mx

from dflash_core.hub import DRAFTER_FILES, TARGET_FILES, resolve
from dflash_core.loading import LoadedModel, choose_drafter, load_configured
from dflash_core.settings import ModelSettings, Settings

from .errors import APIError
from .scheduler import Scheduler
from .tool_calls import Markers, markers_for_tokenizer

log = logging.getLogger(__name__)


@dataclass
class ServedModel:
    settings: ModelSettings
    loaded: LoadedModel
    markers: Markers
    created: int = field(default_factory=lambda: int(time.time()))
    last_used: float = field(default_factory=time.monotonic)
    in_use: int = 0

    @property
    def engine(self):
        return self.loaded.engine

    @property
    def name(self) -> str:
        return self.settings.name

    def sampling_defaults(self, settings: Settings) -> dict:
        """Config defaults override the model's own generation_config.json."""
        out = dict(self.loaded.generation_defaults)
        if settings.defaults.temperature is not None:
            out["temperature"] = settings.defaults.temperature
        out.update(self.settings.sampling)
        if settings.defaults.max_tokens is not None:
            out["max_tokens"] = settings.defaults.max_tokens
        return out

    def template_defaults(self, settings: Settings) -> dict:
        out = {}
        if settings.defaults.enable_thinking is not None:
            out["enable_thinking"] = settings.defaults.enable_thinking
        out.update(self.settings.chat_template_kwargs)
        return out


def load_served(spec: ModelSettings, prefill_chunk: int, prefix_cache_gb: float = 0.0) -> ServedModel:
    loaded = load_configured(spec, prefill_chunk, int(prefix_cache_gb * 1e9))
    hf = getattr(loaded.engine.tokenizer, "_tokenizer", loaded.engine.tokenizer)
    return ServedModel(spec, loaded, markers_for_tokenizer(getattr(hf, "chat_template", None), hf.get_vocab()))


def estimated_bytes(spec: ModelSettings) -> int:
    """Weight files on disk (downloading them if needed): what loading will roughly take."""
    paths = [resolve(spec.target, spec.target_revision, files=TARGET_FILES)]
    drafter, revision, _ = choose_drafter(spec.target, spec.drafter, spec.drafter_revision)
    if drafter:
        paths.append(resolve(drafter, revision, files=DRAFTER_FILES))
    return sum(f.stat().st_size for p in paths for f in Path(p).glob("*.safetensors"))


class ModelPool:
    def __init__(self, settings: Settings, scheduler: Scheduler):
        self.settings = settings
        self.scheduler = scheduler
        self._served: dict[str, ServedModel] = {}
        self._load_lock = asyncio.Lock()
        self.loading_error: Optional[str] = None
        self.ready = False

    def names(self) -> list[str]:
        return [m.name for m in self.settings.models]

    def served(self) -> list[ServedModel]:
        return list(self._served.values())

    def add(self, served: ServedModel) -> None:
        """Serve an already built model (tests, embedding dflash in another program)."""
        if served.name not in self.names():
            self.settings.models.append(served.settings)
        self._served[served.name] = served

    async def load_startup(self) -> None:
        try:
            for spec in self.settings.models:
                if spec.load_at_start:
                    await self.get(spec.name)
            self.ready = True
        except APIError as e:  # the server stays up and reports the problem on /health
            self.loading_error = e.message

    async def get(self, name: str) -> ServedModel:
        served = self._served.get(name)
        if served is None:
            spec = next((m for m in self.settings.models if m.name == name), None)
            if spec is None:
                raise APIError(
                    404, f"The model {name!r} does not exist. Available: {', '.join(self.names())}",
                    param="model", code="model_not_found",
                )
            async with self._load_lock:  # one load at a time: the budget check must see the others
                served = self._served.get(name)
                if served is None:
                    try:
                        served = await self.scheduler.call(lambda: self._load(spec))
                    except (FileNotFoundError, ValueError) as e:  # missing files, bad checkpoints
                        log.error("model %s could not be loaded: %s", name, e)
                        raise APIError(503, f"model {name!r} could not be loaded: {e}", type="server_error",
                                       code="model_unavailable", headers={"Retry-After": "30"}) from e
                    except Exception as e:
                        log.exception("model %s could not be loaded", name)
                        raise APIError(503, f"model {name!r} could not be loaded: {type(e).__name__}: {e}",
                                       type="server_error", code="model_unavailable") from e
        served.last_used = time.monotonic()
        return served

    def _load(self, spec: ModelSettings) -> ServedModel:
        """On the worker thread: make room under the budget, then load."""
        budget = self.settings.memory_budget_gb
        if budget is not None:
            self._make_room(int(budget * 1e9) - estimated_bytes(spec))
        log.info("loading model %s (target %s, drafter %s)", spec.name, spec.target, spec.drafter)
        served = load_served(spec, self.settings.prefill_chunk, self.settings.prefix_cache_gb)
        self._served[spec.name] = served
        return served

    def _make_room(self, allowed: int) -> None:
        while sum(m.loaded.nbytes for m in self._served.values()) > allowed:
            idle = [m for m in self._served.values() if m.in_use == 0]
            if not idle:
                log.warning("memory budget exceeded, but every loaded model is in use")
                return
            victim = min(idle, key=lambda m: m.last_used)
            log.info("unloading %s (least recently used) to stay within the memory budget", victim.name)
            del self._served[victim.name]
            mx.clear_cache()

    def acquire(self, served: ServedModel) -> None:
        served.in_use += 1
        served.last_used = time.monotonic()

    def release(self, served: ServedModel) -> None:
        served.in_use -= 1
