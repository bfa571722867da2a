"""`dflash bench`: reproducible speed measurements of DFlash against the target alone.

Engine mode (the default) loads one model and, in the same process, runs every bundled prompt
(`bench_prompts.py`) at every context length of a sweep, once with the target alone and once with
DFlash, `repeats` times each, and reports medians: prefill and decode throughput apart, the
speedup, tokens per cycle, acceptance by draft position, peak memory, and whether DFlash's output
equalled the target's token for token (the first divergence when not).

Server mode (`--server URL`) measures a running server the way clients see it: concurrent
streaming chat completions, time to first token, inter-token and inter-chunk latency.

The JSON written by both modes is defined (and validated) by the pydantic models below;
docs/bench.md describes how to read it. No HTTP server code here: server mode is a client (httpx).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Sequence, Union

import mlx.core as mx
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from .bench_prompts import PROMPT_SETS, BenchPrompt, filler_tokens, select_prompts
from .doctor import package_version
from .prompts import encode_rendered, hf_tokenizer, render_chat
from .kernels import backend
from .sampling import SamplingParams

SCHEMA_VERSION = 1

# =====================================================================================
# The JSON schema. Every field is described here; docs/bench.md summarises it.
# =====================================================================================


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
    plain_steps: int = Field(0, description="speculation auto: plain target steps, summed over runs")
    tokens_from_steps: int = Field(0, description="tokens those plain steps made, summed over runs")


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


def environment() -> Environment:
    return Environment(
        dflash=package_version("dflash"), mlx=mx.__version__, mlx_lm=package_version("mlx-lm"),
        python=platform.python_version(), platform=f"{platform.system()} {platform.machine()}",
        device=f"{mx.default_device()} ({mx.device_info().get('device_name', 'unknown')})",
        backend=backend(), cuda_graphs=os.environ.get("MLX_USE_CUDA_GRAPHS"),
    )


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


# =====================================================================================
# Prompts: chat template, then the filler document in front up to the context length
# =====================================================================================


def _plain_text(prompt: BenchPrompt) -> str:
    """Without a chat template (the stand-in tokenizer of random weights): plain text turns."""
    lines = [f"tools: {json.dumps(prompt.tools)}"] if prompt.tools else []
    for m in prompt.messages:
        calls = f" {json.dumps(m['tool_calls'])}" if m.get("tool_calls") else ""
        lines.append(f"{m['role']}: {m.get('content') or ''}{calls}")
    return "\n".join(lines) + "\nassistant:"


def render_prompt(tokenizer, prompt: BenchPrompt, template_kwargs: Optional[dict] = None) -> list[int]:
    # Rendered to text and then encoded without special tokens, as the server does, so the engine
    # sees the very tokens a client's request would produce.
    if getattr(hf_tokenizer(tokenizer), "chat_template", None):
        text = render_chat(tokenizer, prompt.messages, prompt.tools, **(template_kwargs or {}))
    else:
        text = _plain_text(prompt)
    return encode_rendered(tokenizer, text)


def pad_to_context(tokens: list[int], filler: list[int], context: int, bos: Optional[int],
                   separator: Sequence[int] = ()) -> tuple[list[int], int]:
    """Put filler tokens (then `separator`, a paragraph break) before the prompt, after a leading
    BOS, so that every prompt is exactly `context` tokens long; a longer prompt is left as it is.
    Returns the tokens and how many were added.

    Spliced as token ids rather than text, so the length is exact whatever the tokenizer."""
    n = max(0, context - len(tokens))
    if n > len(filler):
        raise ValueError(f"filler has {len(filler)} tokens, {n} needed")
    pad = filler[: n - len(separator)] + list(separator) if n > len(separator) else filler[:n]
    if bos is not None and tokens and tokens[0] == bos:
        return [bos] + pad + tokens[1:], n
    return pad + tokens, n


# =====================================================================================
# Engine mode
# =====================================================================================


@dataclass
class Run:
    """One generation: its tokens and the engine's statistics."""

    tokens: list[int]
    finish_reason: Optional[str]
    speculative: bool
    speculative_off_reason: Optional[str]
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    generated_tokens: int
    cycles: int
    draft_tokens_accepted: int
    accepted_by_position: list[int]
    peak_memory_bytes: int
    plain_steps: int = 0
    tokens_from_steps: int = 0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        # As GenerationStats: the first token belongs to prefill.
        return (self.generated_tokens - 1) / self.decode_seconds if self.decode_seconds > 0 else 0.0


def run_once(engine, tokens: Sequence[int], *, speculative: bool, max_tokens: int, sampling: SamplingParams,
             ignore_eos: bool, speculation: Optional[str] = None) -> Run:
    """One generation; `speculation` (auto, on, off) when speculating, the engine's mode if None."""
    mx.synchronize()
    # The peak counts memory in use (weights included), not the allocator's cache; the cache is
    # kept, so runs do not pay for fresh allocations that real serving would not pay either.
    mx.reset_peak_memory()
    out, last = [], None
    extra = {"speculation": speculation} if speculative and speculation else {}
    for chunk in engine.generate(tokens, max_tokens=max_tokens, sampling=sampling, speculative=speculative,
                                 stop_token_ids=set() if ignore_eos else None, **extra):
        out += chunk.token_ids
        last = chunk
    # The engine queues the next cycle before handing out tokens; let that stray work finish
    # here, so it does not run into the next measurement.
    mx.synchronize()
    s = last.stats
    return Run(out, last.finish_reason, s.speculative, s.speculative_off_reason, s.prefill_tokens,
               s.prefill_seconds, s.decode_seconds, s.generated_tokens, s.cycles, s.draft_tokens_accepted,
               list(s.accepted_by_position), mx.get_peak_memory(), s.plain_steps, s.tokens_from_steps)


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> Optional[tuple[int, Optional[int], Optional[int]]]:
    """(index, reference token, other token) of the first difference; None when equal. An output
    that ended earlier (end of sequence) has None at that index."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i, a, b
    if len(reference) != len(other):
        i = min(len(reference), len(other))
        return i, (reference[i] if i < len(reference) else None), (other[i] if i < len(other) else None)
    return None


def _pooled(cycles: int, accepted: int, by_position: list[int]) -> tuple[Optional[float], Optional[list[float]]]:
    if not cycles:
        return None, None
    return (accepted + cycles) / cycles, [n / cycles for n in by_position]


def mode_result(runs: list[Run]) -> ModeResult:
    first = runs[0]
    cycles = sum(r.cycles for r in runs)
    accepted = sum(r.draft_tokens_accepted for r in runs)
    by_position = [sum(col) for col in zip(*(r.accepted_by_position for r in runs))] if first.speculative else []
    per_cycle, by_share = _pooled(cycles, accepted, by_position)
    return ModeResult(
        speculative=first.speculative, speculative_off_reason=first.speculative_off_reason, runs=len(runs),
        prompt_tokens=first.prompt_tokens,
        generated_tokens=int(statistics.median(r.generated_tokens for r in runs)),
        finish_reason=first.finish_reason,
        prefill_seconds=statistics.median(r.prefill_seconds for r in runs),
        decode_seconds=statistics.median(r.decode_seconds for r in runs),
        prefill_tokens_per_second=statistics.median(r.prefill_tokens_per_second for r in runs),
        decode_tokens_per_second=statistics.median(r.decode_tokens_per_second for r in runs),
        peak_memory_bytes=max(r.peak_memory_bytes for r in runs),
        cycles=cycles, draft_tokens_accepted=accepted, accepted_by_position=by_position,
        tokens_per_cycle=per_cycle, acceptance_by_position=by_share,
        plain_steps=sum(r.plain_steps for r in runs), tokens_from_steps=sum(r.tokens_from_steps for r in runs),
    )


def logit_gap(engine, tokens: Sequence[int], agreed: Sequence[int], want: Optional[int],
              got: Optional[int]) -> Optional[float]:
    """How close the target was to DFlash's token at a divergence: logit(want) - logit(got) after
    `tokens + agreed`, from a fresh chunked forward of the target. A gap of the size of the
    rounding differences between kernels (bf16 on a GPU) is a near-tie; a large one is a bug."""
    if want is None or got is None:
        return None
    adapter, sequence = engine.target, list(tokens) + list(agreed)
    cache = adapter.make_cache(max_rollback=engine.max_rollback)
    for start in range(0, len(sequence), engine.prefill_chunk):
        out = adapter.forward(mx.array([sequence[start:start + engine.prefill_chunk]]), cache, last_logits_only=True)
        mx.eval(out.logits)
    logits = out.logits[0, -1].astype(mx.float32)
    return (logits[want] - logits[got]).item()


def compare(prompt: BenchPrompt, context: int, tokens: list[int], filler: int, target: list[Run],
            dflash: list[Run], check: bool, engine=None, auto: Optional[list[Run]] = None) -> PromptResult:
    reference = target[0].tokens
    divergence, match = None, None
    if dflash and check:
        match = True
        for repeat, run in enumerate(dflash + (auto or [])):
            found = first_divergence(reference, run.tokens)
            if found is not None:
                index, want, got = found
                gap = logit_gap(engine, tokens, reference[:index], want, got) if engine is not None else None
                divergence = Divergence(repeat=repeat, index=index, target_token=want, dflash_token=got, logit_gap=gap)
                match = False
                break
    t, d = mode_result(target), (mode_result(dflash) if dflash else None)
    a = mode_result(auto) if auto else None
    speedup = d.decode_tokens_per_second / t.decode_tokens_per_second if d and t.decode_tokens_per_second else None
    auto_speedup = a.decode_tokens_per_second / t.decode_tokens_per_second if a and t.decode_tokens_per_second else None
    return PromptResult(
        set=prompt.set, prompt=prompt.name, context=context, prompt_tokens=len(tokens), filler_tokens=filler,
        target=t, dflash=d, auto=a, speedup=speedup, auto_speedup=auto_speedup, match=match,
        compared_tokens=min(len(r.tokens) for r in target[:1] + dflash),
        divergence=divergence, target_repeats_agree=all(r.tokens == reference for r in target),
    )


def pooled_acceptance(results: list[PromptResult]) -> Optional[list[float]]:
    """Acceptance by position over all DFlash cycles of `results` (counts pooled, not shares averaged)."""
    spec = [r.dflash for r in results if r.dflash is not None and r.dflash.cycles]
    cycles = sum(d.cycles for d in spec)
    return [sum(col) / cycles for col in zip(*(d.accepted_by_position for d in spec))] if cycles else None


def summarize(results: list[PromptResult], sets: list[str]) -> list[Summary]:
    rows = []
    for context in dict.fromkeys(r.context for r in results):
        for name in list(sets) + ["all"]:
            group = [r for r in results if r.context == context and name in ("all", r.set)]
            if not group:
                continue
            spec = [r.dflash for r in group if r.dflash is not None]
            cycles = sum(d.cycles for d in spec)
            by_position = [sum(col) for col in zip(*(d.accepted_by_position for d in spec))]
            per_cycle, by_share = _pooled(cycles, sum(d.draft_tokens_accepted for d in spec), by_position)
            target_decode = statistics.median(r.target.decode_tokens_per_second for r in group)
            dflash_decode = statistics.median(d.decode_tokens_per_second for d in spec) if spec else None
            autos = [r.auto for r in group if r.auto is not None]
            auto_decode = statistics.median(a.decode_tokens_per_second for a in autos) if autos else None
            rows.append(Summary(
                context=context, set=name, prompts=len(group),
                prompt_tokens=int(statistics.median(r.prompt_tokens for r in group)),
                target_prefill_tokens_per_second=statistics.median(r.target.prefill_tokens_per_second for r in group),
                dflash_prefill_tokens_per_second=(
                    statistics.median(d.prefill_tokens_per_second for d in spec) if spec else None),
                target_decode_tokens_per_second=target_decode, dflash_decode_tokens_per_second=dflash_decode,
                speedup=dflash_decode / target_decode if spec and target_decode else None,
                auto_decode_tokens_per_second=auto_decode,
                auto_speedup=auto_decode / target_decode if autos and target_decode else None,
                tokens_per_cycle=per_cycle, acceptance_by_position=by_share,
                target_peak_memory_bytes=max(r.target.peak_memory_bytes for r in group),
                dflash_peak_memory_bytes=max(d.peak_memory_bytes for d in spec) if spec else None,
                matched=sum(r.match is True for r in group), mismatched=sum(r.match is False for r in group),
            ))
    return rows


@dataclass
class BenchModel:
    """What engine mode measures: an engine (anything with `generate`, `tokenizer`, `drafter` and
    `max_context`, as `engine.Engine`) and how to describe it."""

    engine: Any
    info: ModelInfo
    template_kwargs: dict = field(default_factory=dict)
    acceptance_measured: bool = True
    note: Optional[str] = None


def run_engine_bench(model: BenchModel, settings: EngineSettings, progress: bool = True) -> EngineReport:
    from tqdm import tqdm

    engine = model.engine
    prompts = select_prompts(settings.sets, settings.prompts_per_set)
    sampling = SamplingParams(temperature=settings.temperature,
                              seed=settings.seed if settings.temperature > 0 else None)
    hf = hf_tokenizer(engine.tokenizer)
    bos = getattr(hf, "bos_token_id", None)

    def encode(text: str) -> list[int]:
        return list(hf.encode(text, add_special_tokens=False))

    separator = encode("\n\n")  # the filler document ends with a paragraph break, not mid-word
    rendered = {p.name: render_prompt(engine.tokenizer, p, model.template_kwargs) for p in prompts}
    # Target alone, always-on DFlash, and auto (cycles only while they win here).
    modes = ["off"] + (["on", "auto"] if engine.drafter is not None else [])
    # Forced acceptance changes the target's choices: its output is not the target's to compare.
    check = settings.forced_accepted is None

    skipped, contexts = [], []
    for context in settings.contexts:
        if engine.max_context is not None and context + settings.max_tokens > engine.max_context:
            skipped.append(Skipped(context=context, reason=f"context + max_tokens exceeds the model's limit "
                                                           f"of {engine.max_context} tokens"))
        else:
            contexts.append(context)

    common = dict(max_tokens=settings.max_tokens, sampling=sampling, ignore_eos=settings.ignore_eos)
    # Warm-up, not measured: the first generations compile kernels and allocate buffers.
    for mode in modes:
        run_once(engine, rendered[prompts[0].name], speculative=mode != "off", speculation=mode,
                 **{**common, "max_tokens": min(settings.max_tokens, 32)})

    total = len(contexts) * len(prompts) * settings.repeats * len(modes)
    bar = tqdm(total=total, desc="dflash bench", unit="run", disable=not progress, file=sys.stderr)
    results: list[PromptResult] = []
    first = True
    try:
        for context in contexts:
            filler = filler_tokens(encode, context)
            for prompt in prompts:
                tokens, n_filler = pad_to_context(rendered[prompt.name], filler, context, bos, separator)
                runs: dict[str, list[Run]] = {"off": [], "on": [], "auto": []}
                # Modes alternate within each repeat, so slow drift (heat, other load) hits all alike.
                for _ in range(settings.repeats):
                    for mode in modes:
                        if not first and settings.cooldown_seconds:
                            time.sleep(settings.cooldown_seconds)
                        first = False
                        bar.set_postfix_str(f"ctx {context} {prompt.set}/{prompt.name} "
                                            f"{ {'off': 'target', 'on': 'dflash', 'auto': 'auto'}[mode]}")
                        runs[mode].append(run_once(engine, tokens, speculative=mode != "off", speculation=mode, **common))
                        bar.update()
                results.append(compare(prompt, context, tokens, n_filler, runs["off"], runs["on"], check, engine,
                                       auto=runs["auto"]))
    finally:
        bar.close()

    checked = [r.match for r in results if r.match is not None]
    return EngineReport(
        created=_now(), environment=environment(), model=model.info, settings=settings,
        acceptance_measured=model.acceptance_measured, note=model.note, results=results,
        summary=summarize(results, settings.sets), skipped=skipped,
        all_matched=all(checked) if checked else None,
    )


# ------------------------------------------------------------------------------ the table


def _fmt(value: Optional[float], spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _gb(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def engine_table(report: EngineReport) -> str:
    m, s = report.model, report.settings
    lines = [
        f"dflash bench: {m.name} (target {m.target}, drafter {m.drafter or 'none'}) on {report.environment.device}",
        f"{'greedy' if s.temperature == 0 else f'temperature {s.temperature}, seed {s.seed}'}, "
        f"max {s.max_tokens} tokens{' (EOS ignored)' if s.ignore_eos else ''}, median of {s.repeats}, "
        f"cooldown {s.cooldown_seconds:g}s",
    ]
    if not report.acceptance_measured:
        lines.append(f"RANDOM WEIGHTS: speed only; tokens/cycle is NOT a measure of acceptance. {report.note or ''}")
    header = (f"{'context':>7} {'set':<6} {'n':>2} {'prompt':>6} | {'prefill tok/s':>17} | "
              f"{'decode tok/s':>26} | {'speedup':>15} {'tok/cycle':>9} | {'peak GB':>11} | match")
    lines += [header, f"{'':>24} | {'target':>8} {'dflash':>8} | {'target':>8} {'dflash':>8} {'auto':>8} |"
              f" {'dflash':>7} {'auto':>7}{'':>10} | {'tgt':>5} {'dfl':>5} |", "-" * len(header)]
    for r in report.summary:
        match = "-" if r.matched + r.mismatched == 0 else (
            "yes" if not r.mismatched else f"NO ({r.mismatched}/{r.matched + r.mismatched})")
        lines.append(
            f"{r.context:>7} {r.set:<6} {r.prompts:>2} {r.prompt_tokens:>6} | "
            f"{_fmt(r.target_prefill_tokens_per_second, '.0f'):>8} {_fmt(r.dflash_prefill_tokens_per_second, '.0f'):>8} | "
            f"{_fmt(r.target_decode_tokens_per_second):>8} {_fmt(r.dflash_decode_tokens_per_second):>8} "
            f"{_fmt(r.auto_decode_tokens_per_second):>8} | "
            f"{_fmt(r.speedup, '.2f') + 'x':>7} {_fmt(r.auto_speedup, '.2f') + 'x':>7} {_fmt(r.tokens_per_cycle, '.2f'):>9} | "
            f"{_gb(r.target_peak_memory_bytes):>5} {_gb(r.dflash_peak_memory_bytes):>5} | {match}")
    for r in report.results:
        if r.divergence is not None:
            d = r.divergence
            lines.append(f"MISMATCH {r.set}/{r.prompt} at context {r.context}: first divergence at generated token "
                         f"{d.index} (repeat {d.repeat}): target {d.target_token}, dflash {d.dflash_token}"
                         + (f", target logit gap {d.logit_gap:.4g}" if d.logit_gap is not None else ""))
        if not r.target_repeats_agree:
            lines.append(f"note: {r.set}/{r.prompt} at context {r.context}: target-alone repeats differ "
                         "(non-deterministic numerics)")
    for s_ in report.skipped:
        lines.append(f"skipped context {s_.context}: {s_.reason}")
    if report.model.speculative_off_reason:
        lines.append(f"DFlash not measured: {report.model.speculative_off_reason}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the plots


def write_plots(report: EngineReport, folder: Path, stem: str = "dflash-bench") -> list[Path]:
    """`<stem>-speed.png` (tok/s and speedup against context) and, when acceptance was measured,
    `<stem>-acceptance.png` (acceptance by draft position)."""
    from matplotlib.figure import Figure  # a bare Figure renders with Agg: no display, no pyplot state

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    rows = [r for r in report.summary if r.set == "all"]
    if not rows:
        return written
    contexts = [r.context for r in rows]
    fig = Figure(figsize=(15, 4.5), layout="constrained")
    prefill, decode, speedup = fig.subplots(1, 3)
    for ax, key, title in ((prefill, "prefill", "Prefill"), (decode, "decode", "Decode")):
        ax.plot(contexts, [getattr(r, f"target_{key}_tokens_per_second") for r in rows], "o-", label="target alone")
        if any(getattr(r, f"dflash_{key}_tokens_per_second") is not None for r in rows):
            ax.plot(contexts, [getattr(r, f"dflash_{key}_tokens_per_second") for r in rows], "s-", label="DFlash")
        ax.set(title=f"{title} tokens/s (median)", xlabel="context (tokens)", ylabel="tokens/s")
    for name in report.settings.sets + ["all"]:
        points = [(r.context, r.speedup) for r in report.summary if r.set == name and r.speedup is not None]
        if points:
            xs, ys = zip(*points)
            speedup.plot(xs, ys, "o-" if name == "all" else ".--", label=name, linewidth=2.5 if name == "all" else 1)
    speedup.axhline(1.0, color="grey", linewidth=0.8)
    speedup.set(title="DFlash decode speedup", xlabel="context (tokens)", ylabel="x target alone")
    for ax in (prefill, decode, speedup):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    label = "random weights (speed only)" if report.model.weights == "random" else report.model.name
    fig.suptitle(f"dflash bench: {label} on {report.environment.device}")
    path = folder / f"{stem}-speed.png"
    fig.savefig(path, dpi=110)
    written.append(path)

    if report.acceptance_measured and any(r.acceptance_by_position for r in report.summary):
        fig = Figure(figsize=(11, 4.5), layout="constrained")
        by_set, by_context = fig.subplots(1, 2)
        sets = [(n, [r for r in report.results if n in ("all", r.set)]) for n in report.settings.sets + ["all"]]
        at = [(f"context {c}", [r for r in report.results if r.context == c]) for c in contexts]
        for ax, groups, title in ((by_set, sets, "by prompt set (all contexts)"),
                                  (by_context, at, "by context (all sets)")):
            for name, group in groups:
                shares = pooled_acceptance(group)
                if shares:
                    ax.plot(range(1, len(shares) + 1), shares, "o-" if name == "all" else ".-", label=name,
                            linewidth=2.5 if name == "all" else 1)
            ax.set(title=f"Acceptance {title}", xlabel="draft position in the block", ylabel="share of cycles",
                   ylim=(0, 1.02))
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
        fig.suptitle(f"dflash bench: acceptance by position, {report.model.name}")
        path = folder / f"{stem}-acceptance.png"
        fig.savefig(path, dpi=110)
        written.append(path)
    return written


# =====================================================================================
# Server mode
# =====================================================================================


@dataclass
class _Stream:
    """What one streamed request saw, with times relative to sending it."""

    prompt: str
    status: Optional[int] = None
    error: Optional[str] = None
    chunk_times: list[float] = field(default_factory=list)
    seconds: float = 0.0
    usage: Optional[dict] = None
    finish_reason: Optional[str] = None
    dflash: Optional[dict] = None
    done: bool = False


def _openai_body(prompt: BenchPrompt, model: str, max_tokens: int, temperature: float) -> dict:
    body = {"model": model, "messages": prompt.messages, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if prompt.tools:
        body["tools"] = prompt.tools
    return body


def stream_request(client, base: str, body: dict, prompt: str, headers: dict, timeout: float) -> _Stream:
    out = _Stream(prompt)
    start = time.perf_counter()
    try:
        with client.stream("POST", base + "/v1/chat/completions", json=body, headers=headers, timeout=timeout) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}"
                return out
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = f"stream error: {json.dumps(event['error'])[:200]}"
                    continue
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls")):
                        out.chunk_times.append(time.perf_counter() - start)
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]
                        out.dflash = event.get("dflash", out.dflash)
                if event.get("usage"):
                    out.usage = event["usage"]
        if out.error is None and not out.done:
            out.error = "the stream ended without [DONE]"
        elif out.error is None and out.usage is None:
            out.error = "no usage chunk (stream_options.include_usage was sent)"
    except Exception as e:  # a benchmark counts failures instead of stopping at the first
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.seconds = time.perf_counter() - start
    return out


def percentiles(values: Sequence[float]) -> Percentiles:
    if not values:
        return Percentiles(count=0, mean=None, p50=None, p90=None, p99=None)
    import numpy as np

    p50, p90, p99 = (float(v) for v in np.percentile(np.asarray(values, dtype=float), [50, 90, 99]))
    return Percentiles(count=len(values), mean=float(np.mean(values)), p50=p50, p90=p90, p99=p99)


def _inter_token(s: _Stream) -> Optional[float]:
    tokens = (s.usage or {}).get("completion_tokens") or 0
    if s.error or tokens < 2 or len(s.chunk_times) < 2:
        return None
    return (s.chunk_times[-1] - s.chunk_times[0]) / (tokens - 1)


def _cached(s: _Stream) -> Optional[int]:
    return ((s.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")


def server_model(client, base: str, headers: dict) -> str:
    import httpx

    try:
        response = client.get(base + "/v1/models", headers=headers, timeout=30)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"{base}: no OpenAI-compatible server with a model answers there ({e})") from None


def run_server_bench(url: str, *, concurrency: int, requests: int, model: Optional[str] = None,
                     sets: Optional[list[str]] = None, prompts_per_set: Optional[int] = None,
                     max_tokens: int = 256, temperature: float = 0.0, api_key: Optional[str] = None,
                     timeout: float = 600.0, warmup: int = 1, progress: bool = True) -> ServerReport:
    import httpx
    from tqdm import tqdm

    if concurrency < 1 or requests < 1:
        raise ValueError("--concurrency and --requests must be at least 1")
    base = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    prompts = select_prompts(sets, prompts_per_set)
    with httpx.Client() as client:
        model = model or server_model(client, base, headers)
        for i in range(warmup):  # alone and not measured: the first requests compile kernels
            p = prompts[i % len(prompts)]
            stream_request(client, base, _openai_body(p, model, min(max_tokens, 16), temperature), p.name, headers,
                           timeout)

    # N clients, each with its own connection, take the next request number until none is left.
    streams: list[Optional[_Stream]] = [None] * requests
    lock, counter = threading.Lock(), iter(range(requests))
    bar = tqdm(total=requests, desc="dflash bench --server", unit="req", disable=not progress, file=sys.stderr)

    def client_loop():
        with httpx.Client() as client:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                p = prompts[i % len(prompts)]
                streams[i] = stream_request(client, base, _openai_body(p, model, max_tokens, temperature),
                                            f"{p.set}/{p.name}", headers, timeout)
                with lock:
                    bar.update()

    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    bar.close()

    done = [s for s in streams if s is not None]
    ok = [s for s in done if s.error is None]
    inter_token = [v for v in (_inter_token(s) for s in ok) if v is not None]
    gaps = [b - a for s in ok for a, b in zip(s.chunk_times, s.chunk_times[1:])]
    spec = [s.dflash for s in ok if s.dflash and s.dflash.get("speculative")]
    cycles = sum(d.get("cycles", 0) for d in spec)
    by_position = [sum(col) for col in zip(*(d.get("accepted_by_position") or [] for d in spec))] if spec else []
    per_cycle, by_share = _pooled(cycles, sum(d.get("draft_tokens_accepted", 0) for d in spec), by_position)
    completion = sum((s.usage or {}).get("completion_tokens", 0) for s in ok)
    return ServerReport(
        created=_now(), url=base, model=model, concurrency=concurrency, requests=requests, max_tokens=max_tokens,
        temperature=temperature, sets=list(sets or PROMPT_SETS), completed=len(ok), errors=len(done) - len(ok),
        error_messages=list(dict.fromkeys(s.error for s in done if s.error))[:10], wall_seconds=wall,
        prompt_tokens=sum((s.usage or {}).get("prompt_tokens", 0) for s in ok),
        cached_prompt_tokens=sum(_cached(s) or 0 for s in ok), completion_tokens=completion,
        throughput_tokens_per_second=completion / wall if wall > 0 else 0.0,
        ttft_seconds=percentiles([s.chunk_times[0] for s in ok if s.chunk_times]),
        inter_token_seconds=percentiles(inter_token), inter_chunk_seconds=percentiles(gaps),
        request_decode_tokens_per_second=percentiles([1 / v for v in inter_token if v > 0]),
        speculative_requests=len(spec), tokens_per_cycle=per_cycle, acceptance_by_position=by_share,
        requests_detail=[
            RequestResult(prompt=s.prompt, ok=s.error is None, error=s.error, status=s.status, seconds=s.seconds,
                          ttft_seconds=s.chunk_times[0] if s.chunk_times else None, chunks=len(s.chunk_times),
                          prompt_tokens=(s.usage or {}).get("prompt_tokens"), cached_tokens=_cached(s),
                          completion_tokens=(s.usage or {}).get("completion_tokens"),
                          finish_reason=s.finish_reason, dflash=s.dflash)
            for s in done
        ],
    )


def server_table(report: ServerReport) -> str:
    def ms(p: Percentiles) -> str:
        return " ".join(f"{_fmt(None if v is None else v * 1e3):>8}" for v in (p.p50, p.p90, p.p99))

    def plain(p: Percentiles) -> str:
        return " ".join(f"{_fmt(v):>8}" for v in (p.p50, p.p90, p.p99))

    lines = [
        f"dflash bench --server {report.url}: model {report.model}, {report.requests} requests, "
        f"concurrency {report.concurrency}, max {report.max_tokens} tokens, temperature {report.temperature:g}",
        f"completed {report.completed}, errors {report.errors}, {report.completion_tokens} tokens in "
        f"{report.wall_seconds:.1f}s: {report.throughput_tokens_per_second:.1f} tok/s overall; "
        f"{report.cached_prompt_tokens} of {report.prompt_tokens} prompt tokens from the server's prefix cache",
        f"{'':<28} {'p50':>8} {'p90':>8} {'p99':>8}",
        f"{'time to first token (ms)':<28} {ms(report.ttft_seconds)}",
        f"{'inter-token latency (ms)':<28} {ms(report.inter_token_seconds)}",
        f"{'inter-chunk latency (ms)':<28} {ms(report.inter_chunk_seconds)}",
        f"{'request decode tok/s':<28} {plain(report.request_decode_tokens_per_second)}",
    ]
    if report.speculative_requests:
        lines.append(f"DFlash on {report.speculative_requests} requests: {_fmt(report.tokens_per_cycle, '.2f')} "
                     "tokens/cycle (pooled)")
    lines += [f"error: {e}" for e in report.error_messages]
    return "\n".join(lines)


# =====================================================================================
# Loading what to measure
# =====================================================================================


def random_bench_model(shape: str, quant: str = "bf16", layers: Optional[int] = None,
                       forced_accepted: Optional[int] = None, prefill_chunk: int = 2048) -> BenchModel:
    """A random target and a random drafter of the released drafter's shape, built in memory."""
    from .engine import Engine
    from .loading import parameter_bytes
    from .random_models import ByteTokenizer, ForcedAcceptance, parse_shape, random_drafter, random_target

    name, tiny = parse_shape(shape)
    target = random_target(name, "bf16" if tiny else quant, layers, tiny)
    drafter = random_drafter(name, target, tiny)
    adapter = target
    if forced_accepted is not None:
        if not 0 <= forced_accepted < drafter.block_size:
            raise ValueError(f"--forced-accepted must be between 0 and {drafter.block_size - 1}")
        adapter = ForcedAcceptance(target, [forced_accepted], drafter.block_size)
    engine = Engine(adapter, ByteTokenizer(target.vocab_size), drafter, prefill_chunk=prefill_chunk)
    note = ("Random drafters accept (almost) nothing, so DFlash here runs at about one token per cycle: "
            "the cost of a cycle, not the speed you would get. Random logits are close to tied everywhere, "
            "so in bf16 on a GPU, where a 16-token verify rounds differently from a 1-token step, the two "
            "outputs can part at the first near-tie (docs/bench.md).")
    if forced_accepted is not None:
        note = (f"Forced acceptance: the target is made to accept exactly {forced_accepted} drafts per cycle "
                f"({forced_accepted + 1} tokens per cycle), so DFlash speed is measured at that assumed "
                "acceptance; outputs are not compared.")
    info = ModelInfo(name=f"random:{shape}", target=shape, drafter="random", weights="random",
                     quant="float32" if tiny else quant, block_size=drafter.block_size,
                     weights_bytes=parameter_bytes(target.model, drafter))
    return BenchModel(engine, info, acceptance_measured=False, note=note)


def checkpoint_bench_model(settings) -> BenchModel:
    from .loading import load_configured

    spec = settings.model()
    loaded = load_configured(spec, settings.prefill_chunk)  # no prefix cache: every prefill is real
    engine = loaded.engine
    info = ModelInfo(name=spec.name, target=str(loaded.target_path),
                     drafter=str(loaded.drafter_path) if loaded.drafter_path else None, weights="checkpoint",
                     block_size=engine.drafter.block_size if engine.drafter is not None else None,
                     weights_bytes=loaded.nbytes,
                     speculative_off_reason=None if engine.drafter is not None else engine.drafter_off_reason)
    return BenchModel(engine, info, template_kwargs=dict(spec.chat_template_kwargs))
