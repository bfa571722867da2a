"""What `dflash bench` prints and draws from a report: the engine table, the server table, and the
PNG plots (matplotlib, the optional `bench` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .schema import EngineReport, Percentiles, ServerReport, pooled

PLOTS_NEED = "matplotlib is not installed: pip install 'dflash[bench]' for the plots (or pass --no-plots)"


class PlotsUnavailable(ImportError):
    """matplotlib is not installed. Its own class, so that a caller can skip the plots for this
    reason alone."""


# ------------------------------------------------------------------------------ tables


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
    w = max([6] + [len(r.set) for r in report.summary])  # a file's categories can be longer than the bundled sets
    header = (f"{'context':>7} {'set':<{w}} {'n':>2} {'prompt':>6} | {'prefill tok/s':>17} | "
              f"{'decode tok/s':>26} | {'speedup':>15} {'tok/cycle':>9} | {'peak GB':>11} | match")
    lines += [header, f"{'':>{18 + w}} | {'target':>8} {'dflash':>8} | {'target':>8} {'dflash':>8} {'auto':>8} |"
              f" {'dflash':>7} {'auto':>7}{'':>10} | {'tgt':>5} {'dfl':>5} |", "-" * len(header)]
    for r in report.summary:
        match = "-" if r.matched + r.mismatched == 0 else (
            "yes" if not r.mismatched else f"NO ({r.mismatched}/{r.matched + r.mismatched})")
        lines.append(
            f"{r.context:>7} {r.set:<{w}} {r.prompts:>2} {r.prompt_tokens:>6} | "
            f"{_fmt(r.target_prefill_tokens_per_second, '.0f'):>8} {_fmt(r.dflash_prefill_tokens_per_second, '.0f'):>8} | "
            f"{_fmt(r.target_decode_tokens_per_second):>8} {_fmt(r.dflash_decode_tokens_per_second):>8} "
            f"{_fmt(r.auto_decode_tokens_per_second):>8} | "
            f"{_fmt(r.speedup, '.2f') + 'x':>7} {_fmt(r.auto_speedup, '.2f') + 'x':>7} {_fmt(r.tokens_per_cycle, '.2f'):>9} | "
            f"{_gb(r.target_peak_memory_bytes):>5} {_gb(r.dflash_peak_memory_bytes):>5} | {match}")
    for r in report.summary:
        if r.set == "all" and r.pooled_speedup is not None:
            auto = f", auto {r.auto_pooled_speedup:.2f}x" if r.auto_pooled_speedup is not None else ""
            lines.append(f"context {r.context}, all {r.prompts} prompts as one workload (their tokens over their "
                         f"summed decode time): dflash {r.pooled_speedup:.2f}x{auto} the target alone")
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


# ------------------------------------------------------------------------------ plots


def write_plots(report: EngineReport, folder: Path, stem: str = "dflash-bench") -> list[Path]:
    """`<stem>-speed.png` (tok/s and speedup against context) and, when acceptance was measured,
    `<stem>-acceptance.png` (acceptance by draft position). Raises PlotsUnavailable without
    matplotlib."""
    try:
        from matplotlib.figure import Figure  # a bare Figure renders with Agg: no display, no pyplot state
    except ImportError as e:  # an optional extra: the table and the JSON need nothing of it
        if (e.name or "").partition(".")[0] != "matplotlib":
            raise  # installed but broken (a dependency of it missing): its own message says more
        raise PlotsUnavailable(PLOTS_NEED) from e

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
                shares = pooled(r.dflash for r in group if r.dflash is not None).acceptance_by_position
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
