"""The scripts in benchmarks/ run end to end on tiny shapes, so the numbers in docs/ can be re-measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_gpu_cycle_runs_on_tiny_shapes(tmp_path):
    out = tmp_path / "cycle.json"
    done = _run("benchmarks/gpu_cycle.py", "--tiny", "--models", "qwen3.5-9b,gemma-4-31b", "--quant", "bf16",
                "--contexts", "64", "--decode-tokens", "4", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [e["model"] for e in report["results"]] == ["qwen3.5-9b", "gemma-4-31b"]
    for entry in report["results"]:
        (row,) = entry["contexts"]
        assert row["context"] == 64 and row["decode_ms"] > 0 and row["verify16_full_accept_ms"] > 0
        assert all(row[f"{kind}_graph_build_ms"] > 0 for kind in ("verify16", "draft", "decode"))
        assert row["forced_3"]["tokens_per_cycle"] == 3.0  # the forced schedule really ran


def test_host_build_times_each_graph_on_a_tiny_shape(tmp_path):
    out = tmp_path / "host_build.json"
    done = _run("benchmarks/host_build.py", "--shape", "tiny-qwen3_5", "--repeats", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert set(report["build_ms"]) == {"decode", "verify16", "draft", "draft-op-by-op"}
    assert all(0 < kind["min"] <= kind["median"] for kind in report["build_ms"].values())


def test_cycle_trace_times_a_real_pairs_cycles_one_by_one(qwen3_pair, tmp_path):
    """A tiny pair's generations always-on, each cycle as the engine timed it: the first (after the
    prompt) untimed, the rest timed, their sum and the untimed part adding up to the decode time;
    replayed forced to the same acceptance, and profiled."""
    target, drafter = qwen3_pair
    out = tmp_path / "trace.json"
    done = _run("benchmarks/cycle_trace.py", "--target", str(target), "--drafter", str(drafter),
                "--prompts-per-set", "1", "--max-tokens", "24", "--replay", "--profile", "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["generations"]
    assert {r["set"] for r in rows} == {"text", "code"}
    for row in rows:
        assert row["cycles"] >= 2 and row["timed_cycles"] == row["cycles"] - 1  # (the first: untimed)
        assert row["timed_ms"] + row["untimed_ms"] == pytest.approx(row["decode_ms"])
        assert 0 < row["median_cycle_ms"] <= row["slowest_cycle_ms"] and row["alone_ms_per_token"] > 0
        assert sum(1 for _ in row["median_cycle_ms_by_accepted"]) >= 1
        again = row["again"]  # the same generation run again: the same cycles
        assert again["cycles"] == row["cycles"] and again["timed_ms"] + again["untimed_ms"] == pytest.approx(again["decode_ms"])
        # The replay: the real run's acceptance, cycle by cycle, forced (the script checks it took
        # exactly those), and both split by part of the host's time.
        replay = row["replay"]
        assert replay["cycles"] == row["cycles"]
        assert replay["median_cycle_ms_by_accepted"].keys() == row["median_cycle_ms_by_accepted"].keys()
        for part in (again, replay):
            assert part["host_ms"]["verify_build"] > 0 and part["host_ms"]["draft_build"] > 0


def test_cycle_profile_splits_each_paths_cycles_on_a_tiny_shape(tmp_path):
    """Forced cycles under cProfile, two paths in turn: each cycle's host time split into the
    verify's and the draft's builds and launches (all found: none 0), the read's wait and the
    rest; and the target alone's plain steps likewise."""
    out = tmp_path / "cycle_profile.json"
    done = _run("benchmarks/cycle_profile.py", "--shape", "tiny-gemma3_text", "--paths", "dflash,eager-drafter",
                "--context", "64", "--tokens", "40", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [r["path"] for r in report["results"]] == ["dflash", "eager-drafter"]
    for row in report["results"]:
        assert row["tokens_per_cycle"] == 3.0  # the forced schedule really ran
        parts = row["host_ms"]
        assert set(parts) == {"verify_build", "verify_launch", "draft_build", "draft_launch", "read_wait", "rest"}
        assert all(parts[k] > 0 for k in ("verify_build", "verify_launch", "draft_build", "draft_launch"))
        alone = row["target_alone"]
        assert set(alone["host_ms"]) == {"step_build", "step_launch", "read_wait", "rest"}
        assert alone["step_ms"] > 0 and alone["host_ms"]["step_build"] > 0 and alone["host_ms"]["step_launch"] > 0


def test_gpu_graphs_runs_mlx_products_on_the_cpu(tmp_path):
    """gpu_graphs.py's MLX kinds (its kernel kinds need CUDA) on small weights."""
    out = tmp_path / "graphs.json"
    done = _run("benchmarks/gpu_graphs.py", "--kinds", "gemm16,gemv1", "--layers", "2", "--n", "64", "--k", "64",
                "--reps", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert set(report["kinds"]) == {"gemm16", "gemv1"}
    assert all(v["wall_ms"] > 0 and v["ops_per_chain"] == 6 for v in report["kinds"].values())


@pytest.mark.parametrize("flag, model, quant, labels", [("--launches", "qwen3-8b", "4bit", ("fused", "apart")),
                                                    ("--attention", "qwen3.5-9b", "bf16", ("block", "mlx"))])
def test_gpu_profile_alternations_run_on_tiny_shapes(tmp_path, flag, model, quant, labels):
    out = tmp_path / "ab.json"
    done = _run("benchmarks/gpu_profile.py", "--tiny", "--model", model, "--quant", quant, "--contexts", "32",
                flag, "--out", str(out))
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(out.read_text())
    assert row["context"] == 32 and row["rounds"] == 6
    assert all(row[f"{label}_{what}"] > 0 for label in labels for what in ("decode_ms", "verify16_ms"))


def test_batch_verify_profile_times_and_summarizes(tmp_path):
    """The loop runs on the tiny shape; --summarize reads py-spy's raw format (frames joined by ';',
    then a count) and gives each frame's share of the samples inside the loop's iterations."""
    done = _run("benchmarks/batch_verify_profile.py", "--tiny", "--rows", "3", "--context", "48", "--iterations", "3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("rows 3: build ") and " ms, total " in done.stdout
    raw = tmp_path / "raw.txt"
    raw.write_text("<module> (x.py:1);iteration (x.py:9);forward_rows (b.py:4) 3\n"
                   "<module> (x.py:1);iteration (x.py:9);eval (libmlx.so) 1\n"
                   "<module> (x.py:1);setup (x.py:2) 6\n")
    done = _run("benchmarks/batch_verify_profile.py", "--summarize", str(raw))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "4 samples in the loop's iterations"
    assert " 75.0%  forward_rows (b.py:4)" in lines and " 25.0%  eval (libmlx.so)" in lines
    assert not any("setup" in line for line in lines)


def _report_on_pair(script: str, pair, out) -> dict:
    """`script`'s report on a tiny pair, one prompt of each set, 12 tokens, one repeat."""
    target, drafter = pair
    done = _run(script, "--target", str(target), "--drafter", str(drafter),
                "--prompts-per-set", "1", "--max-tokens", "12", "--repeats", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())


def test_demo_pair_script_reports_identical_outputs(qwen3_pair, tmp_path):
    report = _report_on_pair("benchmarks/demo_pair.py", qwen3_pair, tmp_path / "demo.json")
    assert set(report["sets"]) == {"text", "code"}
    for result in report["sets"].values():
        assert result["outputs_identical"] and result["tokens_per_cycle"] >= 1.0
        assert len(result["acceptance_by_position"]) == 15


def test_pair_paths_script_runs_each_path_against_the_target_alone(qwen3_pair, tmp_path):
    """Two paths over a tiny pair's prompts (demo_pair.py's, one of each set): each path's target
    alone and DFlash, their speeds and ratio, and DFlash's output equal to the target's."""
    target, drafter = qwen3_pair
    out = tmp_path / "paths.json"
    done = _run("benchmarks/pair_paths.py", "--target", str(target), "--drafter", str(drafter),
                "--paths", "dflash,eager-drafter", "--prompts-per-set", "1", "--max-tokens", "12", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["outputs_identical"] and set(report["sets"]) == {"text", "code"}
    for by_path in report["sets"].values():
        assert set(by_path) == {"dflash", "eager-drafter"}
        for row in by_path.values():
            assert row["prompts"] == 1 and row["tokens_per_cycle"] >= 1.0
            assert row["speedup_of_medians"] == pytest.approx(
                row["dflash_decode_tokens_per_second"] / row["target_alone_decode_tokens_per_second"])


def test_draft_ahead_script_compares_both_modes_on_a_pair(qwen3_pair, tmp_path):
    report = _report_on_pair("benchmarks/draft_ahead.py", qwen3_pair, tmp_path / "ahead.json")
    assert report["outputs_identical"] and report["runs_per_mode"] == 2  # one prompt of each set
    assert set(report["median_tokens_per_second"]) == {"ahead", "after_read"}


def test_cpu_attention_runs_on_a_tiny_pair(gemma3_pair, tmp_path, cpu_kernels):
    """Both attention paths through the engine on a tiny Gemma 3 pair (its sliding window is 8, so
    a 40-token context crosses it), then the verify-against-steps exactness check."""
    target, drafter = gemma3_pair
    out = tmp_path / "attention.json"
    done = _run("benchmarks/cpu_attention.py", "--target", str(target), "--drafter", str(drafter),
                "--contexts", "40", "--repeats", "1", "--max-tokens", "8", "--out", str(out))
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["context"] == 40 and set(row["ours_over_mlx"]) == {"prefill_tok_s", "decode_step_ms", "verify16_ms",
                                                                   "dflash_tok_s"}
    assert all(row[path]["verify16_ms"] > 0 and row[path]["dflash_tok_s"] > 0 for path in ("ours", "mlx"))
    done = _run("benchmarks/cpu_attention.py", "--target", str(target), "--drafter", str(drafter), "--exactness", "48",
                "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["exactness"]
    assert [r["path"] for r in rows] == ["ours", "mlx"]
    assert rows[0]["bit_identical"] and rows[0]["argmax_agrees"]  # ours is what lossless speculation rests on


def test_cpu_matmul_runs():
    done = _run("benchmarks/cpu_matmul.py", "--rows", "256", "--cols", "64", "--batch-rows", "1,4", "--repeats", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert json.loads(lines[0])["shape"] == [256, 64]
    assert lines[1].startswith("M=  1:") and "1.0x M=1" in lines[1] and lines[2].startswith("M=  4:")


def test_gpu_batch_runs_on_tiny_shapes(tmp_path):
    out = tmp_path / "batch.json"
    done = _run("benchmarks/gpu_batch.py", "--shape", "tiny-qwen3_5", "--streams", "1,3", "--context", "40",
                "--max-tokens", "12", "--restacked", "--auto", "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["streams"] for r in rows] == [1, 3]
    for row in rows:
        assert row["dflash"]["tokens"] == row["target"]["tokens"] == 12 * row["streams"]
        assert row["dflash_restacked"]["tokens"] == row["target_restacked"]["tokens"] == 12 * row["streams"]
        for auto in (row["auto"], row["auto_unaccepted"]):
            assert auto["tokens"] == 12 * row["streams"] and auto["cycles"] + auto["plain_steps"] > 0
        assert row["dflash"]["aggregate_tok_s"] > 0 and row["target"]["per_stream_tok_s"] > 0
        assert "aggregate_tok_s" in row["mlx_lm"] or "error" in row["mlx_lm"]
    # The plot of aggregate tok/s against streams reads such reports.
    plot = tmp_path / "batching.png"
    done = _run("benchmarks/plot_batching.py", str(out), str(out), "--out", str(plot))
    assert done.returncode == 0, done.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpu_batch_rounds_report_medians_of_same_round_ratios(tmp_path):
    out = tmp_path / "rounds.json"
    done = _run("benchmarks/gpu_batch.py", "--shape", "tiny-qwen3_5", "--streams", "1,2", "--context", "24",
                "--max-tokens", "6", "--rounds", "3", "--no-mlx-lm", "--step-states", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [(r["round"], r["streams"]) for r in report["rows"]] == [(0, 1), (0, 2), (1, 1), (1, 2), (2, 1), (2, 2)]
    by = {(r["round"], r["streams"]): r for r in report["rows"]}
    two = next(m for m in report["medians"] if m["streams"] == 2)
    ratios = [by[(i, 2)]["dflash"]["aggregate_tok_s"] / by[(i, 1)]["dflash"]["aggregate_tok_s"] for i in range(3)]
    assert two["dflash_x_one_stream_each_round"] == [round(x, 2) for x in ratios]
    assert two["dflash_x_one_stream"] == sorted(ratios)[1]
    assert two["target"] == sorted(by[(i, 2)]["target"]["aggregate_tok_s"] for i in range(3))[1]
    # --step-states: DFlash with KernelOptions.step_deltas off in every round, with its own medians.
    assert all(r["dflash_step_states"]["tokens"] == 6 * r["streams"] for r in report["rows"])
    assert two["dflash_step_states"] == sorted(by[(i, 2)]["dflash_step_states"]["aggregate_tok_s"] for i in range(3))[1]
    plot = tmp_path / "rounds.png"
    done = _run("benchmarks/plot_batching.py", str(out), "--out", str(plot))
    assert done.returncode == 0, done.stderr


def test_batch_step_parts_runs_on_tiny_shapes(tmp_path):
    out = tmp_path / "parts.json"
    done = _run("benchmarks/batch_step_parts.py", "--shape", "tiny-qwen3_5", "--rows", "1,3", "--context", "40",
                "--repeat", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"1", "3"}
    for parts in rows.values():
        assert {"draft", "verify", "verify_after_rollback", "sample", "rollback", "context_rows", "host_read"} <= set(parts)
        assert all(0 <= p["build_ms"] <= p["total_ms"] for p in parts.values())


def test_cpu_distributed_runs_on_a_small_shape(tmp_path):
    out = tmp_path / "distributed.json"
    done = _run("benchmarks/cpu_distributed.py", "--hidden", "128", "--layers", "2", "--intermediate", "256",
                "--vocab", "512", "--tokens", "8", "--prompt-tokens", "16", "--repeats", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["rows"]] == ["alone", "dflash"]
    assert all(r["same_tokens"] and r["one_process_tok_s"] > 0 and r["two_ranks_tok_s"] > 0 for r in report["rows"])
    sizes = report["target_bytes"]
    assert sizes["each of two ranks"] < sizes["one process"]


def test_cpu_batch_runs_through_a_real_server(tmp_path):
    out = tmp_path / "cpu_batch.json"
    done = _run("benchmarks/cpu_batch.py", "--streams", "2", "--modes", "off,on", "--max-tokens", "6", "--repeats", "2",
                "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["speculation"], r["streams"], r["repeats"]) for r in rows] == [("off", 2, 2), ("on", 2, 2)]
    for row in rows:
        assert row["pooled_connections"]
        assert row["same_output"] and len(row["together_s_all"]) == 2
        assert row["together_s"] > 0 and row["speedup"] == row["one_by_one_s"] / row["together_s"]
        assert row["server_cpu_s_one_by_one"] > 0 and row["server_cpu_s_together"] > 0  # the server did the work


def test_cpu_batch_runs_the_engine_alone(tmp_path):
    out = tmp_path / "cpu_batch_engine.json"
    done = _run("benchmarks/cpu_batch.py", "--engine", "--streams", "3", "--modes", "off,on", "--max-tokens", "6",
                "--repeats", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["speculation"], r["streams"], r["engine_alone"]) for r in rows] == [("off", 3, True), ("on", 3, True)]
    for row in rows:
        assert row["same_output"] and len(row["together_s_all"]) == 2
        assert row["aggregate_tok_s"] == 3 * 6 / row["together_s"]


def test_agent_prefix_cache_runs_a_short_conversation(tmp_path):
    out = tmp_path / "agent_prefix_cache.json"
    done = _run("benchmarks/agent_prefix_cache.py", "--synthetic", "--hidden-size", "64", "--layers", "2", "--turns", "3",
                "--max-tokens", "8", "--out", str(out))
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())["results"]
    cold, cached = results["without cache"], results["with cache"]
    assert [r["prompt_tokens"] for r in cold] == [r["prompt_tokens"] for r in cached]  # the same conversation
    assert all(r["cached_tokens"] == 0 for r in cold)
    assert cached[0]["cached_tokens"] == 0 and all(r["cached_tokens"] > 0 for r in cached[1:])


def test_rollback_gather_times_both_forms_of_the_state_gather(tmp_path):
    """The script checks the two forms give the same states before timing them."""
    out = tmp_path / "gather.json"
    done = _run("benchmarks/rollback_gather.py", "--tiny", "--rows", "3", "--layers", "2", "--repeats", "2",
                "--out", str(out))
    assert done.returncode == 0, done.stderr
    forms = json.loads(out.read_text())["forms"]
    assert len(forms) == 3 and all(f["total_ms"] > 0 for f in forms.values())


def test_gated_delta_deltas_needs_cuda():
    """Its comparison runs the CUDA kernels (the pure-MLX path's replay is tests/test_kernels.py's)."""
    done = _run("benchmarks/gated_delta_deltas.py")
    assert done.returncode != 0 and "needs MLX's CUDA backend" in done.stderr


def test_gpu_auto_keeps_autos_steps_in_order(tmp_path):
    """gpu_auto.py's rows carry each measured auto run's steps in order (width, ms or None, wall ms
    since the step before), the record the plain-step timing fix came from (docs/performance.md,
    "On the GPU, and what a plain step's time was"), and every repeat's tok/s per mode."""
    out = tmp_path / "auto.json"
    done = _run("benchmarks/gpu_auto.py", "--shape", "tiny-qwen3", "--contexts", "64", "--repeats", "2",
                "--max-tokens", "40", "--forced", "6.4", "--out", str(out))
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(out.read_text())["rows"]
    sequences = row["auto_sequences"]
    assert len(sequences) == 2  # one per measured auto run
    last, chose = sequences[-1], row["auto_chose"]
    assert len(last) == chose["cycles"] + chose["plain_steps"]
    assert last[0][1] is None  # a generation's first step is not timed
    assert all(w in (0, 2, 4, 8, 16) and (ms is None or ms > 0) for w, ms, _ in last)
    assert sum(1 for w, _, _ in last if w) == chose["cycles"]
    # The wall between observations covers every step after the first, timed by the engine or not,
    # and is at least the time the engine gave (taken from the same reads, a little earlier).
    assert last[0][2] is None and all(wall > 0 for _, _, wall in last[1:])
    assert all(wall >= 0.9 * ms for _, ms, wall in last[1:] if ms is not None)
    assert {mode: len(tok_s) for mode, tok_s in row["runs"].items()} == {"off": 2, "on": 2, "auto": 2}
    # With no acceptance, auto's plain steps are broken by probes: the steps at the edges of those
    # runs get no time from the engine, and the summary counts them by their wall, apart.
    done = _run("benchmarks/gpu_auto.py", "--shape", "tiny-qwen3", "--contexts", "64", "--repeats", "2",
                "--max-tokens", "200", "--forced", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(out.read_text())["rows"]
    untimed = sum(1 for seq in row["auto_sequences"] for _, ms, wall in seq if ms is None and wall is not None)
    assert untimed > 0 and sum(v["n"] for k, v in row["auto_samples"].items() if k.startswith("untimed")) == untimed
    assert set(row["same_repeat_ratios"]) == {"auto_vs_target", "auto_vs_dflash", "auto_vs_best"}
    assert 0 < row["same_repeat_ratios"]["auto_vs_best"] <= max(row["same_repeat_ratios"]["auto_vs_target"],
                                                               row["same_repeat_ratios"]["auto_vs_dflash"])


def test_gpu_warm_up_times_the_warm_up_and_the_first_requests():
    done = _run("benchmarks/gpu_warm_up.py", "--shape", "tiny-qwen3", "--mode", "warm")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["mode"] == "warm" and report["warm_up_s"] > 0
    assert [report[f"request{i}"]["prompt"] for i in (1, 2, 3)] == [500, 700, 2000]
    assert all(report[f"request{i}"]["wall_s"] > 0 for i in (1, 2, 3))
    cold = _run("benchmarks/gpu_warm_up.py", "--shape", "tiny-qwen3", "--mode", "cold")
    assert cold.returncode == 0, cold.stderr
    assert "warm_up_s" not in json.loads(cold.stdout.strip().splitlines()[-1])


def test_auto_simulated_keeps_auto_near_the_better_mode(tmp_path):
    """auto on the simulated machines (steps planned and timed in the engine's order): never far
    below the better of plain steps and always-on, on any machine or acceptance pattern."""
    out = tmp_path / "sim.json"
    done = _run("benchmarks/auto_simulated.py", "--seeds", "3", "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 64
    # The machine whose first plain step after a cycle costs two steps more pays that at every switch,
    # which at the break-even acceptance (p = 0.5) comes often: 0.85 there (docs/performance.md).
    for machine in {r["machine"] for r in rows}:
        ratios = sorted(r["auto_over_best"] for r in rows if r["machine"] == machine)
        assert ratios[0] > (0.8 if "first steps" in machine else 0.85), (machine, ratios[:3])


def test_auto_simulated_takes_noise_a_width_tie_and_a_machine_filter(tmp_path):
    """`--machines` keeps the machines named so, `--noise` and `--width-tie` reach the runs (a
    noisy run differs from a quiet one) and are recorded."""
    outputs = {}
    for noise in ("0", "0.2"):
        out = tmp_path / f"sim_{noise}.json"
        done = _run("benchmarks/auto_simulated.py", "--seeds", "1", "--machines", "CPU", "--noise", noise,
                    "--width-tie", "1.0", "--out", str(out))
        assert done.returncode == 0, done.stderr
        outputs[noise] = json.loads(out.read_text())
    quiet, noisy = outputs["0"], outputs["0.2"]
    assert {r["machine"] for r in noisy["rows"]} == {"CPU-like"} and len(noisy["rows"]) == 16
    assert noisy["noise"] == 0.2 and noisy["width_tie"] == 1.0
    assert [r["plain"] for r in quiet["rows"]] != [r["plain"] for r in noisy["rows"]]


def test_gpu_plain_steps_times_each_kind_of_step(tmp_path):
    """gpu_plain_steps.py's step variants and generations, on the tiny shape: every variant timed in
    every repeat, and the generations made of what they say (plain steps only, or a cycle first)."""
    out = tmp_path / "plain.json"
    done = _run("benchmarks/gpu_plain_steps.py", "--shape", "tiny-qwen3_5", "--context", "80", "--steps", "24",
                "--repeats", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert len(report["steps"]) == 4 and all(len(v) == 2 and min(v) > 0 for v in report["steps"].values())
    runs = report["generations"]
    assert all(r["cycles"] == 0 for r in runs["off"] + runs["plain"]) and all(r["cycles"] == 1 for r in runs["cycle1"])
    assert all(r["plain_steps"] == 23 for r in runs["plain"]) and set(report["fastest"]) == set(report["median"])


def test_cpu_auto_runs_every_mode_on_the_same_prompts(tmp_path):
    """The CPU `auto` benchmark on a tiny pair: each mode on each prompt (their outputs the target
    alone's), and each run's ratio to the target alone's run of the same prompt (1 for the target)."""
    out = tmp_path / "cpu_auto.json"
    done = _run("benchmarks/cpu_auto.py", "--pairs", "tiny-untrained", "--max-tokens", "12", "--prompts", "4",
                "--out", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())["pairs"]["tiny-untrained"]
    assert result["off"]["vs_target_paired"] == 1.0
    for mode in ("on", "auto"):
        assert result[mode]["same_output"] and result[mode]["vs_target_paired"] > 0
    assert result["on"]["cycles"] > 0 and result["on"]["plain_steps"] == 0
    assert "auto-no-report" not in result  # (asked for only with --without-report)


def test_drafter_fc_times_both_products_by_row_count(tmp_path):
    """drafter_fc.py times the shipped drafter's fc through `linear` and through MLX's own product
    at each row count asked, and says which BLAS answered."""
    out = tmp_path / "fc.json"
    done = _run("benchmarks/drafter_fc.py", "--rows", "1,40", "--repeats", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [r["rows"] for r in report["rows"]] == [1, 40] and "blas" in report
    assert all(r["linear_ms"] > 0 and r["mlx_ms"] > 0 for r in report["rows"])


def test_auto_widths_compares_narrow_cycles_and_auto_with_always_on(qwen3_pair, tmp_path):
    target, drafter = qwen3_pair
    out = tmp_path / "auto_widths.json"
    done = _run("benchmarks/auto_widths.py", "--target", str(target), "--drafter", str(drafter), "--set", "code",
                "--prompts-per-set", "1", "--max-tokens", "24", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    (row,) = report["prompts"]
    assert row["same_output"]
    fixed, auto = row["fixed"], row["auto"]
    assert 1 <= fixed["narrow_tokens_per_cycle"] <= 8 and 1 <= fixed["whole_tokens_per_cycle"] <= 16
    # A narrow cycle's drafts are the whole block's first: it makes what the whole block predicts,
    # give or take where the two runs' cycles start.
    assert 1 <= fixed["narrow_from_whole_block"] <= 8
    assert auto["on_seconds"] > 0 and auto["auto_seconds"] > 0 and report["auto_against_on"] > 0
    assert all(int(w) in (2, 4, 8, 16) for w in auto["auto_cycle_widths"])
