"""The models this server can serve, loaded on the worker thread at start or on first use.

With `memory_budget_gb` set, loading a model first unloads the least recently used models that
no request is using until the new one fits (its size estimated from its weight files).

When the default model's files cannot be had (not on disk, the hub unreachable) and `demo_fallback`
is on, the server serves the offline demo instead, and says so in the log, `/health` and every
`/v1/models` listing: a first start without network still answers.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import mlx.core as mx

from dflash_core.demo import DEMO_DESCRIPTION
from dflash_core.distributed import LeaderEngine
from dflash_core.hub import DRAFTER_FILES, TARGET_FILES, ModelNotFoundError, resolve
from dflash_core.kernels.cpu_extension import build_in_background
from dflash_core.loading import LoadedModel, choose_drafter, load_configured
from dflash_core.prefix_cache import SnapshotBudget
from dflash_core.prompts import hf_tokenizer
from dflash_core.settings import ModelSettings, Settings, demo_model_settings

from .errors import APIError
from .scheduler import Scheduler
from .tool_calls import Markers, markers_for_tokenizer

log = logging.getLogger(__name__)

# Qwen (ChatML), Gemma 3, Gemma 4.
TURN_STARTS = ("<|im_start|>", "<start_of_turn>", "<|turn>")
DEFAULT_ALIAS = "default"  # a model name that always means the server's default model


@dataclass
class ServedModel:
    settings: ModelSettings
    loaded: LoadedModel
    markers: Markers
    created: int = field(default_factory=lambda: int(time.time()))
    last_used: float = field(default_factory=time.monotonic)
    in_use: int = 0
    tool_response_token: Optional[int] = None  # Gemma 4: the caller's turn after a tool call
    # The template's start of a turn: a model that writes one has ended its own (a base model
    # chatting, like the demo, never writes the end-of-turn token but does start the next turn).
    turn_start_token: Optional[int] = None

    @property
    def engine(self):
        return self.loaded.engine

    @property
    def name(self) -> str:
        return self.settings.name


def load_served(spec: ModelSettings, prefill_chunk: int, prefix_cache: Union[int, SnapshotBudget] = 0,
                prefill_seconds: Optional[float] = None, channel=None) -> ServedModel:
    """`channel`: rank 0 of a distributed group: the target sharded over it, the engine announcing
    each generation and step to the other ranks (dflash_core/distributed.py)."""
    loaded = load_configured(spec, prefill_chunk, prefix_cache, prefill_seconds, group=channel and channel.group)
    if channel is not None:
        loaded.engine = LeaderEngine(loaded.engine, channel)
    loaded.engine.token_bytes  # built here, on the worker, not on the event loop at a first request
    hf = hf_tokenizer(loaded.engine.tokenizer)
    vocab = hf.get_vocab()
    markers = markers_for_tokenizer(getattr(hf, "chat_template", None), vocab)
    tool_response = vocab.get("<|tool_response>") if markers.tool_format == "gemma4" else None
    turn_start = next((vocab[t] for t in TURN_STARTS if t in vocab), None)
    return ServedModel(spec, loaded, markers, tool_response_token=tool_response, turn_start_token=turn_start)


def estimated_bytes(spec: ModelSettings) -> int:
    """Weight files on disk (downloading them if needed): what loading will roughly take."""
    paths = [resolve(spec.target, spec.target_revision, files=TARGET_FILES)]
    drafter, revision, _ = choose_drafter(spec.target, spec.drafter, spec.drafter_revision)
    if drafter:
        paths.append(resolve(drafter, revision, files=DRAFTER_FILES))
    return sum(f.stat().st_size for p in paths for f in Path(p).glob("*.safetensors"))


class ModelPool:
    def __init__(self, settings: Settings, scheduler: Scheduler, channel=None):
        self.settings = settings
        self.scheduler = scheduler
        self.channel = channel  # distributed: only the default model, sharded, is served
        self._served: dict[str, ServedModel] = {}
        self._load_lock = asyncio.Lock()
        self._use_lock = threading.Lock()  # in_use counts and unloading, across the two threads
        self.loading_errors: dict[str, str] = {}
        # {"requested", "serving", "reason", "note"} once the demo stands in (as /health reports it)
        self.fallback: Optional[dict] = None
        self.stand_in: Callable[[], ModelSettings] = demo_model_settings  # what stands in (tests pass their own)
        # One prefix-cache budget for every model this server holds.
        self.snapshots = SnapshotBudget(int(settings.prefix_cache_gb * 1e9))
        self.ready = False

    def names(self) -> list[str]:
        return [m.name for m in self.settings.models]

    @property
    def default_name(self) -> str:
        """What the model name `default` means: the configured default, or the demo standing in."""
        return self.fallback["serving"] if self.fallback else self.settings.model().name

    def stood_in_for(self, name: str) -> bool:
        """Whether `name` is the default model the demo stands in for."""
        return self.fallback is not None and self.fallback["requested"] == name

    def servable(self) -> list[str]:
        """The models a request can use now, the default first: loaded ones and those not tried
        yet, not those that failed to load."""
        names = [n for n in self.names() if n not in self.loading_errors]
        return sorted(names, key=lambda n: n != self.default_name)

    def served(self) -> list[ServedModel]:
        return list(self._served.values())

    def add(self, served: ServedModel) -> None:
        """Serve an already built model (tests, embedding dflash in another program)."""
        if served.name not in self.names():
            self.settings.models.append(served.settings)
        self._served[served.name] = served

    async def load_startup(self) -> None:
        """Load every load_at_start model; one that fails does not keep the others from loading."""
        default = self.settings.model().name
        for spec in self.settings.models:
            if spec.load_at_start:
                try:
                    self.release(await self.get(spec.name))
                except APIError as e:  # the server stays up and reports the problem on /health
                    self.loading_errors[spec.name] = e.message
                    if spec.name == default and isinstance(e.__cause__, ModelNotFoundError) and self.settings.demo_fallback:
                        await self._serve_demo_instead(spec.name, e.message)
        self.ready = True

    async def _serve_demo_instead(self, requested: str, reason: str) -> None:
        demo = self.stand_in()
        if demo.name == requested:
            return
        if mx.default_device() == mx.cpu:
            # The demo drafter is accepted little and a CPU verify costs several steps: `auto`
            # would come to plain steps too, but only after probe cycles that cost seconds in the
            # first answers a newcomer sees. The stand-in answers with its target alone.
            demo = demo.model_copy(update={"drafter": None})
        if demo.name not in self.names():
            self.settings.models.append(demo)
        try:
            self.release(await self.get(demo.name))
        except APIError as e:
            self.loading_errors[demo.name] = e.message
            log.error("the offline demo %s could not be loaded either: %s", demo.name, e.message)
            return
        self.fallback = {"requested": requested, "serving": demo.name, "reason": reason, "note": DEMO_DESCRIPTION}
        for line in ("=" * 78, f"{requested} cannot be loaded: {reason}",
                     f"SERVING THE OFFLINE DEMO {demo.name!r} INSTEAD: {DEMO_DESCRIPTION}",
                     f"Requests for {requested!r} fail with this reason; the model name 'default' and "
                     f"{demo.name!r} reach the demo.",
                     f"For {requested}, start once with network access (or `hf download`), or pass "
                     "--model for a model on disk.", "=" * 78):
            log.warning("%s", line)

    async def get(self, name: str) -> ServedModel:
        """The model, loading it if needed, acquired for one request: release() it when done."""
        if name == DEFAULT_ALIAS:
            name = self.default_name
        served = self._acquire_loaded(name)
        if served is not None:
            return served
        spec = next((m for m in self.settings.models if m.name == name), None)
        if spec is None:
            raise APIError(
                404, f"The model {name!r} does not exist. Available: {', '.join(self.servable())}",
                param="model", code="model_not_found",
            )
        async with self._load_lock:  # one load at a time: the budget check must see the others
            served = self._acquire_loaded(name)  # loaded by another request while this one waited
            if served is not None:
                return served
            try:
                # Downloads happen here, off the worker thread: generations keep running meanwhile.
                # Our CPU kernels compile meanwhile too (a first run: the demo's GGUF converts here).
                build_in_background()
                size = await asyncio.to_thread(estimated_bytes, spec)
                served = await self.scheduler.call(lambda: self._load(spec, size))
            except (FileNotFoundError, ValueError) as e:  # missing files, bad checkpoints
                log.error("model %s could not be loaded: %s", name, e)
                instead = (f" The server serves the offline demo {self.fallback['serving']!r} instead (model 'default')."
                           if self.stood_in_for(name) else "")
                raise APIError(503, f"model {name!r} could not be loaded: {e}{instead}", type="server_error",
                               code="model_unavailable", headers={"Retry-After": "30"}) from e
            except Exception as e:
                log.exception("model %s could not be loaded", name)
                raise APIError(503, f"model {name!r} could not be loaded: {type(e).__name__}: {e}",
                               type="server_error", code="model_unavailable") from e
            self.loading_errors.pop(name, None)
            if self.stood_in_for(name):  # the network came back
                log.info("%s is loaded: the default model is %s again, not the demo", name, name)
                self.fallback = None
            return served

    def _load(self, spec: ModelSettings, size: int) -> ServedModel:
        """On the worker thread: make room under the budget, then load (acquired for the caller)."""
        if self.channel is not None and spec.name != self.settings.model().name:
            # The other ranks hold the default model only (they load it at start, not on request).
            raise ValueError(f"this server is distributed over {self.channel.size} ranks and serves only its "
                             f"default model {self.settings.model().name!r}")
        budget = self.settings.memory_budget_gb
        if budget is not None:
            self._make_room(int(budget * 1e9) - size)
        log.info("loading model %s (target %s, drafter %s)", spec.name, spec.target, spec.drafter)
        served = load_served(spec, self.settings.prefill_chunk, self.snapshots, self.settings.prefill_chunk_seconds,
                             self.channel)
        with self._use_lock:
            self._served[spec.name] = served
            self._acquire(served)
        return served

    def _make_room(self, allowed: int) -> None:
        with self._use_lock:  # a model handed to a request in the meantime is never unloaded
            while sum(m.loaded.nbytes for m in self._served.values()) > allowed:
                idle = [m for m in self._served.values() if m.in_use == 0]
                if not idle:
                    log.warning("memory budget exceeded, but every loaded model is in use")
                    return
                victim = min(idle, key=lambda m: m.last_used)
                log.info("unloading %s (least recently used) to stay within the memory budget", victim.name)
                del self._served[victim.name]
                if victim.engine.prefix_cache is not None:  # its snapshots leave the budget with it
                    victim.engine.prefix_cache.close()
        mx.clear_cache()

    def _acquire_loaded(self, name: str) -> Optional[ServedModel]:
        with self._use_lock:
            served = self._served.get(name)
            if served is not None:
                self._acquire(served)
            return served

    def _acquire(self, served: ServedModel) -> None:
        served.in_use += 1
        served.last_used = time.monotonic()

    def release(self, served: ServedModel) -> None:
        with self._use_lock:
            served.in_use -= 1
