"""The models this server can serve, loaded on the worker thread at start or on first use."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

from dflash_core.loading import LoadedModel, load_model
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


def load_served(settings: ModelSettings, prefill_chunk: int) -> ServedModel:
    drafter = None if settings.drafter in (None, "auto") else settings.drafter
    loaded = load_model(
        settings.target,
        drafter,
        target_revision=settings.target_revision,
        drafter_revision=settings.drafter_revision,
        prefill_chunk=prefill_chunk,
        max_context=settings.max_context,
    )
    tokenizer = loaded.engine.tokenizer
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    markers = markers_for_tokenizer(getattr(hf, "chat_template", None), hf.get_vocab())
    return ServedModel(settings, loaded, markers)


class ModelPool:
    def __init__(self, settings: Settings, scheduler: Scheduler):
        self.settings = settings
        self.scheduler = scheduler
        self._served: dict[str, ServedModel] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.loading_error: Optional[str] = None
        self.ready = False

    def names(self) -> list[str]:
        return [m.name for m in self.settings.models]

    def add(self, served: ServedModel) -> None:
        """Serve an already built model (tests, embedding dflash in another program)."""
        if served.name not in self.names():
            self.settings.models.append(served.settings)
        self._served[served.name] = served

    def served(self) -> list[ServedModel]:
        return list(self._served.values())

    async def load_startup(self) -> None:
        try:
            for spec in self.settings.models:
                if spec.load_at_start:
                    await self.get(spec.name)
            self.ready = True
        except Exception as e:  # the server stays up and reports the problem on /health
            log.exception("loading models failed")
            self.loading_error = f"{type(e).__name__}: {e}"

    async def get(self, name: str) -> ServedModel:
        if name in self._served:
            return self._served[name]
        spec = next((m for m in self.settings.models if m.name == name), None)
        if spec is None:
            raise APIError(
                404, f"The model {name!r} does not exist. Available: {', '.join(self.names())}",
                type="invalid_request_error", param="model", code="model_not_found",
            )
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            if name not in self._served:
                log.info("loading model %s (target %s, drafter %s)", name, spec.target, spec.drafter)
                self._served[name] = await self.scheduler.call(
                    lambda: load_served(spec, self.settings.prefill_chunk)
                )
        return self._served[name]
