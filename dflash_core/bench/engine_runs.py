"""Engine mode: one model, in this process, over every bundled prompt at every context length of
a sweep, target alone, DFlash and speculation auto alternating, `repeats` times each; medians per
prompt, then summary rows per context and prompt set (docs/bench.md "How a run is measured").
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

import mlx.core as mx

from ..bench_prompts import BenchPrompt, filler_tokens, prompts_from_file, select_prompts
from ..doctor import package_version
from ..kernels import backend
from ..prompts import encode_rendered, hf_tokenizer, render_chat
from ..sampling import SamplingParams
from .schema import (
    Divergence,
    EngineReport,
    EngineSettings,
    Environment,
    ModelInfo,
    ModeResult,
    PromptResult,
    Skipped,
    Summary,
    now,
    pooled,
)

if TYPE_CHECKING:  # only for annotations: the engine loads with the model, not with this module
    from ..stats import GenerationStats


def environment() -> Environment:
    return Environment(
        dflash=package_version("dflash"), mlx=mx.__version__, mlx_lm=package_version("mlx-lm"),
        python=platform.python_version(), platform=f"{platform.system()} {platform.machine()}",
        device=f"{mx.default_device()} ({mx.device_info().get('device_name', 'unknown')})",
        backend=backend(), cuda_graphs=os.environ.get("MLX_USE_CUDA_GRAPHS"),
    )


# ------------------------------------------------------------------------------ prompts
# The chat template first, then the filler document in front up to the context length.


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
    if prompt.text is not None:
        return list(hf_tokenizer(tokenizer).encode(prompt.text))  # a completion prompt, with the BOS it adds
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


# ------------------------------------------------------------------------------ runs


@dataclass
class Run:
    """One generation: its tokens, the engine's own statistics object, and the peak memory (which
    the engine does not track)."""

    tokens: list[int]
    stats: GenerationStats
    finish_reason: Optional[str]
    peak_memory_bytes: int

    @property
    def prefill_tokens_per_second(self) -> float:
        s = self.stats
        return s.prefill_tokens / s.prefill_seconds if s.prefill_seconds > 0 else 0.0

    # The engine's numbers under the engine's names, for the scripts in benchmarks/ that read
    # them off a run.
    @property
    def decode_tokens_per_second(self) -> float:
        return self.stats.decode_tokens_per_second

    @property
    def cycles(self) -> int:
        return self.stats.cycles

    @property
    def draft_tokens_accepted(self) -> int:
        return self.stats.draft_tokens_accepted

    @property
    def plain_steps(self) -> int:
        return self.stats.plain_steps


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
    return Run(out, last.stats, last.finish_reason, mx.get_peak_memory())


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


def mode_result(runs: list[Run]) -> ModeResult:
    first = runs[0].stats
    counts = pooled(r.stats for r in runs)
    return ModeResult(
        speculative=first.speculative, speculative_off_reason=first.speculative_off_reason, runs=len(runs),
        prompt_tokens=first.prompt_tokens,
        generated_tokens=int(statistics.median(r.stats.generated_tokens for r in runs)),
        finish_reason=runs[0].finish_reason,
        prefill_seconds=statistics.median(r.stats.prefill_seconds for r in runs),
        decode_seconds=statistics.median(r.stats.decode_seconds for r in runs),
        prefill_tokens_per_second=statistics.median(r.prefill_tokens_per_second for r in runs),
        decode_tokens_per_second=statistics.median(r.stats.decode_tokens_per_second for r in runs),
        peak_memory_bytes=max(r.peak_memory_bytes for r in runs),
        cycles=counts.cycles, draft_tokens_accepted=counts.draft_tokens_accepted,
        accepted_by_position=counts.accepted_by_position, tokens_per_cycle=counts.tokens_per_cycle,
        acceptance_by_position=counts.acceptance_by_position,
        cycle_widths={w: sum(r.stats.cycle_widths.get(w, 0) for r in runs)
                      for w in sorted({w for r in runs for w in r.stats.cycle_widths})},
        plain_steps=sum(r.stats.plain_steps for r in runs),
        tokens_from_steps=sum(r.stats.tokens_from_steps for r in runs),
        speculation_note=first.speculation_note,
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


def pooled_speedup(targets: list[ModeResult], others: list[ModeResult]) -> Optional[float]:
    """The prompts as one workload: `others`' decode tokens a second over all of them against the
    targets' (a prompt's decode time: its tokens after the first over its median tok/s, as
    `decode_tokens_per_second` counts them). A row's medians answer "a typical prompt"; this answers
    "the whole set", each prompt weighing as much as the time it takes. None unless every prompt has
    both."""
    modes = [*targets, *others]
    if not others or len(others) != len(targets) or not all(m.decode_tokens_per_second for m in modes):
        return None

    def rate(group: list[ModeResult]) -> Optional[float]:
        tokens = [m.generated_tokens - 1 for m in group]
        seconds = sum(n / m.decode_tokens_per_second for n, m in zip(tokens, group))
        return sum(tokens) / seconds if seconds > 0 else None

    mine, theirs = rate(others), rate(targets)
    return mine / theirs if mine and theirs else None


def summarize(results: list[PromptResult], sets: list[str]) -> list[Summary]:
    rows = []
    for context in dict.fromkeys(r.context for r in results):
        for name in list(sets) + ["all"]:
            group = [r for r in results if r.context == context and name in ("all", r.set)]
            if not group:
                continue
            spec = [r.dflash for r in group if r.dflash is not None]
            counts = pooled(spec)
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
                pooled_speedup=pooled_speedup([r.target for r in group], spec),
                auto_pooled_speedup=pooled_speedup([r.target for r in group], autos),
                tokens_per_cycle=counts.tokens_per_cycle, acceptance_by_position=counts.acceptance_by_position,
                target_peak_memory_bytes=max(r.target.peak_memory_bytes for r in group),
                dflash_peak_memory_bytes=max(d.peak_memory_bytes for d in spec) if spec else None,
                matched=sum(r.match is True for r in group), mismatched=sum(r.match is False for r in group),
            ))
    return rows


# ------------------------------------------------------------------------------ the sweep


@dataclass
class BenchModel:
    """What engine mode measures: an engine (anything with `generate`, `tokenizer`, `drafter` and
    `max_context`, as `engine.Engine`) and how to describe it."""

    engine: Any
    info: ModelInfo
    template_kwargs: dict = field(default_factory=dict)
    acceptance_measured: bool = True
    note: Optional[str] = None


def bench_prompts(settings: EngineSettings) -> list[BenchPrompt]:
    """The bundled sets, or a prompt file's categories (its held-out prompts, unless it has none)."""
    if settings.prompts_file:
        return prompts_from_file(settings.prompts_file, settings.prompts_split, settings.prompts_per_set,
                                 settings.chat)
    return select_prompts(settings.sets, settings.prompts_per_set)


def run_engine_bench(model: BenchModel, settings: EngineSettings, progress: bool = True) -> EngineReport:
    from tqdm import tqdm

    engine = model.engine
    prompts = bench_prompts(settings)
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
        created=now(), environment=environment(), model=model.info, settings=settings,
        acceptance_measured=model.acceptance_measured, note=model.note, results=results,
        summary=summarize(results, settings.sets), skipped=skipped,
        all_matched=all(checked) if checked else None,
    )


# ------------------------------------------------------------------------------ what to measure


def random_bench_model(shape: str, quant: str = "bf16", layers: Optional[int] = None,
                       forced_accepted: Optional[int] = None, prefill_chunk: int = 2048) -> BenchModel:
    """A random target and a random drafter of the released drafter's shape, built in memory."""
    from ..engine import Engine
    from ..loading import parameter_bytes
    from ..random_models import ByteTokenizer, ForcedAcceptance, parse_shape, random_drafter, random_target

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


def checkpoint_bench_model(settings, channel=None) -> BenchModel:
    """`channel` (distributed.Channel): the target sharded over its group, every rank running the
    same benchmark in lockstep."""
    from ..loading import load_configured

    spec = settings.model()
    # No prefix cache: every prefill is real.
    loaded = load_configured(spec, settings.prefill_chunk, group=channel.group if channel else None)
    engine = loaded.engine
    if channel is not None:
        from ..distributed import LockstepEngine

        engine = LockstepEngine(engine, channel)
    info = ModelInfo(name=spec.name, target=str(loaded.target_path),
                     drafter=str(loaded.drafter_path) if loaded.drafter_path else None, weights="checkpoint",
                     block_size=engine.drafter.block_size if engine.drafter is not None else None,
                     weights_bytes=loaded.nbytes,
                     speculative_off_reason=None if engine.drafter is not None else engine.drafter_off_reason)
    return BenchModel(engine, info, template_kwargs=dict(spec.chat_template_kwargs))
