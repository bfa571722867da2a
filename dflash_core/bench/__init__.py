"""`dflash bench`: reproducible speed measurements of DFlash against the target alone.

Engine mode (the default, `engine_runs`) loads one model and, in the same process, runs every
bundled prompt (`bench_prompts.py`) at every context length of a sweep, once with the target alone
and once with DFlash, `repeats` times each, and reports medians: prefill and decode throughput
apart, the speedup, tokens per cycle, acceptance by draft position, peak memory, and whether
DFlash's output equalled the target's token for token (the first divergence when not).

Server mode (`--server URL`, `server_runs`) measures a running server the way clients see it:
concurrent streaming chat completions, time to first token, inter-token and inter-chunk latency.

The JSON written by both modes is defined (and validated) by the pydantic models of `schema`;
`report` prints the tables and draws the plots; docs/bench.md describes how to read them. The
command line is `dflash_core.cli.bench`.
"""

from .engine_runs import (
                          BenchModel,
                          Run,
                          checkpoint_bench_model,
                          compare,
                          environment,
                          first_divergence,
                          logit_gap,
                          mode_result,
                          pad_to_context,
                          random_bench_model,
                          render_prompt,
                          run_engine_bench,
                          run_once,
                          summarize,
)
from .report import PLOTS_NEED, PlotsUnavailable, engine_table, server_table, write_plots
from .schema import (
                          SCHEMA_VERSION,
                          AcceptanceCounts,
                          BenchReport,
                          Divergence,
                          EngineReport,
                          EngineSettings,
                          Environment,
                          ModelInfo,
                          ModeResult,
                          Percentiles,
                          Pooled,
                          PromptResult,
                          RequestResult,
                          ServerReport,
                          Skipped,
                          Summary,
                          load_report,
                          pooled,
)
from .server_runs import percentiles, run_server_bench, server_model, stream_request

__all__ = [
    "SCHEMA_VERSION", "AcceptanceCounts", "BenchModel", "BenchReport", "Divergence", "EngineReport",
    "EngineSettings", "Environment", "ModeResult", "ModelInfo", "PLOTS_NEED", "Percentiles", "PlotsUnavailable",
    "Pooled", "PromptResult", "RequestResult", "Run", "ServerReport", "Skipped", "Summary", "checkpoint_bench_model",
    "compare", "engine_table", "environment", "first_divergence", "load_report", "logit_gap", "mode_result",
    "pad_to_context", "percentiles", "pooled", "random_bench_model", "render_prompt", "run_engine_bench",
    "run_once", "run_server_bench", "server_model", "server_table", "stream_request", "summarize", "write_plots",
]
