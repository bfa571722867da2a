"""Typed configuration: config.yaml, then CLI flags on top.

Precedence: CLI flags > the file named by DFLASH_CONFIG > ./config.yaml > built-in defaults.
An invalid file gives one message naming the file and the key (`ConfigError`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .demo import DEMO_DRAFTER, DEMO_MAX_TOKENS, DEMO_NAME, DEMO_TARGET


class ConfigError(ValueError):
    pass


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost (the names a loopback-bound server answers to)."""
    host = host.strip("[]").lower()
    return host in ("localhost", "::1") or host.endswith(".localhost") or host.startswith("127.")


class ServerSettings(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    api_key: Optional[str] = None
    cors_origins: list[str] = Field(default_factory=list)
    queue_size: int = Field(64, ge=1, description="requests that may wait for a turn; more get 429")
    max_active: int = Field(8, ge=1, description="generations stepping together at most (one batched forward)")
    batching: bool = Field(
        True, description="the active generations of a model step together (one batched forward each step); "
        "off: they take turns, one step each (docs/performance.md, \"Continuous batching\")")
    batch_memory_fraction: float = Field(
        0.9, gt=0, le=1, description="a waiting generation starts only while the memory in use plus what its "
        "caches will take stays under this share of the device's memory; the others wait in the queue")
    request_timeout: Optional[float] = Field(600.0, gt=0, description="seconds a request may take")
    body_timeout: Optional[float] = Field(
        60.0, gt=0, description="seconds a request's body may take to arrive; then 408")
    send_timeout: Optional[float] = Field(
        60.0, gt=0, description="seconds one event of a stream may wait for a client that stopped reading; "
        "then the stream ends (its generation already ends at request_timeout)")
    # Longer than clients keep an idle connection (httpx, under the OpenAI and Anthropic Python SDKs:
    # 5 s; Node's fetch: 4 s): the client closes an idle connection first, so it never sends a
    # request on one the server is timing out at that moment (uvicorn's own 5 s is httpx's 5 s).
    keep_alive: float = Field(120.0, gt=0, description="seconds an idle HTTP connection is kept open")
    stored_responses: int = Field(1000, ge=0, description="Responses API: stored responses kept in memory (LRU)")
    stored_responses_mb: float = Field(
        1024.0, gt=0, description="Responses API: the most MB (their JSON) the stored responses may take; "
        "the least recently used go first")
    max_request_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="larger request bodies get 413")
    # Bound to a loopback address, only loopback host names are answered (a web page's DNS
    # rebinding cannot reach the server); these are accepted too.
    allowed_hosts: list[str] = Field(default_factory=list)
    allow_no_key: bool = Field(False, description="listen on a non-loopback address without an api_key")
    open_metrics: bool = Field(False, description="with an api_key, /metrics answers without it")
    shutdown_timeout: float = Field(30.0, ge=0, description="seconds running requests may take to finish at SIGTERM")
    distributed_step_timeout: float = Field(
        60.0, gt=0, description="--distributed: seconds a step may wait on the other ranks before rank 0 "
                                "counts the group as broken, fails its requests and stops")

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)


class DefaultSettings(Strict):
    max_tokens: Optional[int] = Field(None, ge=1, description="None: until end of sequence or context limit")
    temperature: Optional[float] = Field(None, ge=0)
    enable_thinking: Optional[bool] = None


class SamplingDefaults(Strict):
    """A model's default sampling (requests override each field)."""

    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    max_tokens: Optional[int] = Field(None, ge=1)


class ModelSettings(Strict):
    name: str = Field(description="what clients send as `model`")
    target: str = Field(description="Hugging Face repo id or local path")
    target_revision: Optional[str] = None
    drafter: Optional[str] = Field("auto", description="repo id or path; 'auto': from the registry; null: target only")
    drafter_revision: Optional[str] = None
    block_size: Optional[int] = Field(None, ge=2, le=64, description="draft fewer tokens than the drafter was trained for")
    speculation: Literal["auto", "on", "off"] = Field(
        "auto", description="auto: draft-verify cycles only while they beat plain target steps on this machine")
    dtype: Optional[Literal["float16", "bfloat16", "float32"]] = Field(None, description="cast the target's weights")
    quantize_bits: Optional[Literal[4, 8]] = Field(None, description="quantize an unquantized target when loading")
    max_context: Optional[int] = Field(None, ge=16)
    warm_up: Optional[bool] = Field(
        None, description="run the model's forwards once at load, so that kernels compile then and not in the "
        "first requests; null: on a GPU (docs/performance.md)")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults, description="default sampling parameters")
    load_at_start: bool = True

    @field_validator("drafter")
    @classmethod
    def _none_means_target_alone(cls, value):
        return None if isinstance(value, str) and value.lower() == "none" else value  # as `--drafter none`


# What `dflash serve` serves when nothing else is configured.
DEFAULT_MODEL = ModelSettings(name="qwen3.5-4b", target="Qwen/Qwen3.5-4B", drafter="z-lab/Qwen3.5-4B-DFlash")


class Settings(Strict):
    server: ServerSettings = Field(default_factory=ServerSettings)
    defaults: DefaultSettings = Field(default_factory=DefaultSettings)
    models: list[ModelSettings] = Field(default_factory=lambda: [DEFAULT_MODEL.model_copy()])
    default_model: Optional[str] = None
    memory_budget_gb: Optional[float] = Field(None, gt=0, description="unload least recently used models above this")
    prefill_chunk: int = Field(2048, ge=16, description="the most prompt tokens one prefill step computes")
    prefill_chunk_seconds: Optional[float] = Field(
        0.25, gt=0, description="size the server's prefill steps to take about this long (a cancel waits for one); "
        "null: fixed chunks of prefill_chunk tokens")
    demo_fallback: bool = Field(
        True, description="serve the offline demo when the default model's files cannot be had (not on disk, no network)")
    prefix_cache_gb: float = Field(
        2.0, ge=0, description="for reusing prompt prefixes, one budget shared by all models; 0 disables")
    cuda_graphs: Optional[bool] = Field(
        None, description="MLX's CUDA graphs; null: off when a drafter is configured (see docs/performance.md)")

    def apply_backend_settings(self) -> None:
        """Settings MLX reads once, when its device starts: call before the first array op.

        A batched step's op sequence changes every step (rows joining and leaving, accepted
        lengths, cache sizes), so MLX rebuilds its CUDA graphs instead of replaying them: 12-36 %
        slower with two or more agents on the H200, against ~5 % faster for one speculating
        stream; a target-only server keeps them on for single-stream decoding (docs/performance.md,
        "Batching with graphs on")."""
        if self.cuda_graphs is not None:  # said in the config: that wins over the environment
            os.environ["MLX_USE_CUDA_GRAPHS"] = "1" if self.cuda_graphs else "0"
        else:  # automatic: an MLX_USE_CUDA_GRAPHS already set by the user is left alone
            os.environ.setdefault("MLX_USE_CUDA_GRAPHS", "0" if any(m.drafter for m in self.models) else "1")
        # MLX's CUDA caches (its graphs among them) throw once they miss 2 x their size in a row (a
        # "thrashing check", MLX 0.32's lru_cache.h). A server whose op sequences keep changing
        # (batches whose rows come and go, speculation's widths) would then fail requests where it
        # should only run slower. Off, unless the user set it.
        os.environ.setdefault("MLX_ENABLE_CACHE_THRASHING_CHECK", "0")

    def sampling_defaults(self, spec: ModelSettings, generation_defaults: Optional[dict] = None) -> dict:
        """What a request leaves unset: the checkpoint's generation_config.json defaults, then
        `defaults`, then the model's own `sampling`."""
        out = dict(generation_defaults or {})
        out.update(self.defaults.model_dump(include={"temperature", "max_tokens"}, exclude_none=True))
        out.update(spec.sampling.model_dump(exclude_none=True))
        return out

    def template_defaults(self, spec: ModelSettings) -> dict:
        """Chat-template arguments: `defaults.enable_thinking`, then the model's own."""
        return {**self.defaults.model_dump(include={"enable_thinking"}, exclude_none=True),
                **spec.chat_template_kwargs}

    @model_validator(mode="after")
    def _unique_names(self):
        names = [m.name for m in self.models]
        duplicates = {n for n in names if names.count(n) > 1}
        if duplicates:
            raise ValueError(f"duplicate model names: {sorted(duplicates)}")
        if self.default_model is not None and self.default_model not in names:
            raise ValueError(f"default_model {self.default_model!r} is not one of the models {names}")
        return self

    def model(self, name: Optional[str] = None) -> ModelSettings:
        """A configured model by name; another name is taken as a target (repo or path) whose
        drafter comes from the registry."""
        name = name or self.default_model or (self.models[0].name if self.models else None)
        if name is None:
            raise ConfigError("no model is configured")
        for m in self.models:
            if m.name == name:
                return m
        if name == DEMO_NAME:
            return demo_model_settings()
        return ModelSettings(name=name, target=name)


def demo_model_settings() -> ModelSettings:
    """The bundled offline demo as a configured model (dflash_core/demo.py has its files). On CUDA
    its target is served in bf16: faster there than its float32 conversion, the dtype its drafter
    was trained against, and exact (a verify rounds a token as a decode step does, CUDA's kernels;
    docs/train.md). Elsewhere float32, as converted: the CPU's kernels and Metal's exactness need it."""
    from .kernels import backend

    return ModelSettings(name=DEMO_NAME, target=DEMO_TARGET, drafter=str(DEMO_DRAFTER),
                         dtype="bfloat16" if backend() == "cuda" else None,
                         sampling=SamplingDefaults(max_tokens=DEMO_MAX_TOKENS))


def config_path(explicit: Optional[str] = None) -> Optional[Path]:
    if explicit:
        return Path(explicit)
    if os.environ.get("DFLASH_CONFIG"):
        return Path(os.environ["DFLASH_CONFIG"])
    local = Path("config.yaml")
    return local if local.exists() else None


def load_settings(path: Optional[Path]) -> Settings:
    if path is None:
        return Settings()
    if not path.exists():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    except (OSError, UnicodeDecodeError) as e:  # a folder, no permission, not UTF-8 text
        raise ConfigError(f"{path}: cannot read the config file: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    try:
        return Settings.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise ConfigError(f"{path}: {key}: {first['msg']}") from None

