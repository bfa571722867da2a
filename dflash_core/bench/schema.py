"""The JSON that `dflash bench` writes, as pydantic models: every field is described here, and
docs/bench.md summarises them. Also the one function that pools acceptance counts, which the
engine runs, the per-prompt summaries, the plots and server mode all report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Optional, Protocol, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

SCHEMA_VERSION = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Environment(_Strict):
    dflash: str
    mlx: str
    mlx_lm: str
    python: str
    platform: str
    device: str = Field(description="MLX default device and the device's name")
    backend: str = Field(description="'metal', 'cuda' or 'cpu'")
    cuda_graphs: Optional[str] = Field(description="MLX_USE_CUDA_GRAPHS as set for this process (CUDA only)")


class ModelInfo(_Strict):
    name: str
    target: str = Field(description="target repo, path, or random-weights shape")
    drafter: Optional[str] = Field(description="drafter repo or path, 'random', or null (target alone)")
    weights: Literal["checkpoint", "random"]
    quant: Optional[str] = Field(None, description="random weights: 'bf16' or '4bit'")
    block_size: Optional[int] = None
    weights_bytes: int = Field(description="bytes of target + drafter weights in memory")
    speculative_off_reason: Optional[str] = None


class EngineSettings(_Strict):
    contexts: list[int] = Field(description="requested prompt lengths in tokens (filler + prompt)")
    sets: list[str]
    prompts_per_set: Optional[int] = None
    prompts_file: Optional[str] = Field(None, description="prompts from this file (dflash corpus), one set per category")
    prompts_split: Optional[str] = Field("held_out", description="the file's prompts of this split (null: all)")
    chat: bool = Field(True, description="false: a file's text prompts encoded as they are, without the chat template")
    repeats: int = Field(ge=1)
    cooldown_seconds: float = Field(ge=0)
    max_tokens: int = Field(ge=1)
    ignore_eos: bool = Field(description="true: every run generates exactly max_tokens")
    temperature: float = Field(ge=0)
    seed: Optional[int] = None
    forced_accepted: Optional[int] = Field(
        None, description="random weights: drafts accepted per cycle by construction (speed at an assumed acceptance)")


class Divergence(_Strict):
    repeat: int = Field(description="the DFlash repeat (0-based) that diverged first")
    index: int = Field(description="position among the generated tokens (0: the first generated token)")
    target_token: Optional[int] = Field(description="target-alone token there; null: its output had ended")
    dflash_token: Optional[int] = Field(description="DFlash token there; null: its output had ended")
    logit_gap: Optional[float] = Field(
        description="the target's logit of target_token minus that of dflash_token after the prompt and the agreed "
                    "tokens (a fresh target forward); near zero: a near-tie. Null when a token is null")


class ModeResult(_Strict):
    """One mode (target alone or DFlash) of one prompt at one context: medians over the repeats."""

    speculative: bool
    speculative_off_reason: Optional[str] = None
    runs: int
    prompt_tokens: int
    generated_tokens: int = Field(description="median over runs")
    finish_reason: Optional[str] = Field(description="of the first run: 'stop' (end of sequence) or 'length'")
    prefill_seconds: float = Field(description="median: start until the first token is known")
    decode_seconds: float = Field(description="median: first token to last")
    prefill_tokens_per_second: float = Field(description="median of prompt tokens / prefill_seconds")
    decode_tokens_per_second: float = Field(description="median of (generated - 1) / decode_seconds")
    peak_memory_bytes: int = Field(description="largest mx.get_peak_memory() of the runs (weights included)")
    cycles: int = Field(0, description="draft-verify cycles, summed over runs")
    draft_tokens_accepted: int = Field(0, description="summed over runs")
    accepted_by_position: list[int] = Field(
        default_factory=list, description="cycles in which the draft at block position 1..B-1 was accepted, summed")
    tokens_per_cycle: Optional[float] = Field(None, description="(draft_tokens_accepted + cycles) / cycles")
    acceptance_by_position: Optional[list[float]] = Field(None, description="accepted_by_position / cycles")
    cycle_widths: dict[int, int] = Field(
        default_factory=dict, description="cycles run at each width (the bonus token and its drafts), summed over runs")
    plain_steps: int = Field(0, description="speculation auto: plain target steps, summed over runs")
    tokens_from_steps: int = Field(0, description="tokens those plain steps made, summed over runs")
    speculation_note: Optional[str] = Field(
        None, description="speculation auto, the first run: why it last chose plain steps, in numbers")


class PromptResult(_Strict):
    set: str
    prompt: str
    context: int = Field(description="requested length")
    prompt_tokens: int = Field(description="actual length: more than context when the prompt alone is longer")
    filler_tokens: int
    target: ModeResult
    dflash: Optional[ModeResult] = Field(description="null when the model has no drafter")
    auto: Optional[ModeResult] = Field(None, description="speculation auto; null when the model has no drafter")
    speedup: Optional[float] = Field(description="dflash / target decode_tokens_per_second")
    auto_speedup: Optional[float] = Field(None, description="auto / target decode_tokens_per_second")
    match: Optional[bool] = Field(
        description="every DFlash run equalled the first target-alone run token for token; null: not checked")
    compared_tokens: int = Field(description="tokens compared (the shortest output)")
    divergence: Optional[Divergence] = None
    target_repeats_agree: bool = Field(description="the target-alone runs equalled each other (determinism)")


class Summary(_Strict):
    """One context and prompt set ('all': every set): medians over prompts, pooled acceptance."""

    context: int
    set: str
    prompts: int
    prompt_tokens: int = Field(description="median actual prompt length")
    target_prefill_tokens_per_second: float
    dflash_prefill_tokens_per_second: Optional[float]
    target_decode_tokens_per_second: float
    dflash_decode_tokens_per_second: Optional[float]
    speedup: Optional[float] = Field(description="dflash_decode / target_decode of this row")
    auto_decode_tokens_per_second: Optional[float] = None
    auto_speedup: Optional[float] = Field(None, description="auto_decode / target_decode of this row")
    pooled_speedup: Optional[float] = Field(
        None, description="the row's prompts as one workload: their tokens over their summed decode time, DFlash "
                          "against the target alone (each prompt's time: its tokens over its median tok/s)")
    auto_pooled_speedup: Optional[float] = Field(None, description="the same for speculation auto")
    tokens_per_cycle: Optional[float]
    acceptance_by_position: Optional[list[float]]
    target_peak_memory_bytes: int
    dflash_peak_memory_bytes: Optional[int]
    matched: int = Field(description="prompts whose DFlash output matched")
    mismatched: int


class Skipped(_Strict):
    context: int
    reason: str


class EngineReport(_Strict):
    schema_version: Literal[1] = SCHEMA_VERSION
    kind: Literal["engine"] = "engine"
    created: str = Field(description="local time, ISO 8601")
    environment: Environment
    model: ModelInfo
    settings: EngineSettings
    acceptance_measured: bool = Field(description="false for random weights: acceptance numbers mean nothing")
    note: Optional[str] = None
    results: list[PromptResult]
    summary: list[Summary]
    skipped: list[Skipped] = Field(default_factory=list)
    all_matched: Optional[bool] = Field(description="every checked prompt matched; null: nothing was checked")


class Percentiles(_Strict):
    count: int
    mean: Optional[float]
    p50: Optional[float]
    p90: Optional[float]
    p99: Optional[float]


class RequestResult(_Strict):
    prompt: str
    ok: bool
    error: Optional[str] = None
    status: Optional[int] = None
    seconds: float = Field(description="request sent until the stream ended")
    ttft_seconds: Optional[float] = Field(description="request sent until the first chunk with output")
    chunks: int = Field(description="chunks carrying output (content, reasoning or tool calls)")
    prompt_tokens: Optional[int] = None
    cached_tokens: Optional[int] = Field(None, description="prompt tokens the server's prefix cache supplied")
    completion_tokens: Optional[int] = None
    finish_reason: Optional[str] = None
    dflash: Optional[dict[str, Any]] = Field(None, description="the server's `dflash` object of the final chunk")


class ServerReport(_Strict):
    schema_version: Literal[1] = SCHEMA_VERSION
    kind: Literal["server"] = "server"
    created: str
    url: str
    model: str
    concurrency: int
    requests: int
    max_tokens: int
    temperature: float
    sets: list[str]
    completed: int
    errors: int
    error_messages: list[str] = Field(description="distinct error messages (at most 10)")
    wall_seconds: float
    prompt_tokens: int
    cached_prompt_tokens: int = Field(description="of prompt_tokens, supplied by the server's prefix cache")
    completion_tokens: int
    throughput_tokens_per_second: float = Field(description="completion tokens of all requests / wall time")
    ttft_seconds: Percentiles
    inter_token_seconds: Percentiles = Field(
        description="per request: (last output chunk - first) / (completion_tokens - 1)")
    inter_chunk_seconds: Percentiles = Field(description="gaps between consecutive output chunks, all requests")
    request_decode_tokens_per_second: Percentiles = Field(description="per request: 1 / inter_token_seconds")
    speculative_requests: int
    tokens_per_cycle: Optional[float] = Field(description="pooled over the requests' dflash objects")
    acceptance_by_position: Optional[list[float]]
    requests_detail: list[RequestResult]


BenchReport = TypeAdapter(Annotated[Union[EngineReport, ServerReport], Field(discriminator="kind")])


def load_report(path: Path) -> Union[EngineReport, ServerReport]:
    """Read and validate a JSON file written by `dflash bench`."""
    return BenchReport.validate_json(Path(path).read_text())



def now() -> str:
    """The `created` time of a report: local time, ISO 8601."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


# ------------------------------------------------------------------------------ pooled acceptance


class AcceptanceCounts(Protocol):
    """What pooling reads: the engine's GenerationStats, a ModeResult and Pooled all have it."""

    cycles: int
    draft_tokens_accepted: int
    accepted_by_position: Sequence[int]


@dataclass(frozen=True)
class Pooled:
    """Acceptance counts summed over generations, and the shares they give (None: no cycles)."""

    cycles: int
    draft_tokens_accepted: int
    accepted_by_position: list[int]

    @property
    def tokens_per_cycle(self) -> Optional[float]:
        return (self.draft_tokens_accepted + self.cycles) / self.cycles if self.cycles else None

    @property
    def acceptance_by_position(self) -> Optional[list[float]]:
        return [n / self.cycles for n in self.accepted_by_position] if self.cycles else None


def pooled(counts: Iterable[AcceptanceCounts]) -> Pooled:
    """Counts summed, not shares averaged, so a generation weighs by its cycles: the one place
    where tokens per cycle and acceptance by position are computed from counts.

    A generation without a drafter has no `accepted_by_position` (and no cycles): it is left out,
    as it would cut the positions short."""
    counted = [c for c in counts if c.accepted_by_position]
    return Pooled(cycles=sum(c.cycles for c in counted),
                  draft_tokens_accepted=sum(c.draft_tokens_accepted for c in counted),
                  accepted_by_position=[sum(col) for col in zip(*(c.accepted_by_position for c in counted))])
