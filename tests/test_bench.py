"""`dflash bench` on the tiny CPU fixtures: schema, plots, divergence detection, server mode."""

from __future__ import annotations

import dataclasses
import json
import sys

import mlx.core as mx
import pydantic
import pytest
from live_server import LiveServer

from dflash_core import bench, cli
from dflash_core.bench_prompts import PROMPTS, filler_tokens, select_prompts
from dflash_core.cli import bench as bench_command
from dflash_core.settings import ModelSettings, ServerSettings, Settings
from dflash_core.shapes import TINY_VOCAB

PNG = b"\x89PNG\r\n\x1a\n"


def _bench(*args, out) -> int:
    return cli.main(["bench", *args, "--cooldown", "0", "--no-progress", "--out", str(out)])


def _assert_png(path):
    assert path.exists() and path.stat().st_size > 10_000, path
    assert path.read_bytes()[:8] == PNG


# ---------------------------------------------------------------------------------- helpers


def test_first_divergence():
    assert bench.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert bench.first_divergence([1, 2, 3], [1, 5, 3]) == (1, 2, 5)
    assert bench.first_divergence([1, 2, 3], [1, 2]) == (2, 3, None)  # DFlash stopped early
    assert bench.first_divergence([1, 2], [1, 2, 9]) == (2, None, 9)


def test_padding_is_exact_and_keeps_bos_first():
    filler = list(range(100, 200))
    tokens, added = bench.pad_to_context([7, 8, 9], filler, 10, bos=None, separator=[0])
    assert tokens == [100, 101, 102, 103, 104, 105, 0, 7, 8, 9] and added == 7
    tokens, added = bench.pad_to_context([2, 8, 9], filler, 6, bos=2, separator=[0])
    assert tokens == [2, 100, 101, 0, 8, 9] and added == 3
    assert bench.pad_to_context([1, 2, 3], filler, 2, bos=None) == ([1, 2, 3], 0)  # longer: as it is


def test_prompts_and_filler_are_deterministic():
    assert {p.set for p in PROMPTS} == {"math", "code", "chat", "agent"}
    assert all(sum(p.set == s for p in PROMPTS) >= 3 for s in ("math", "code", "chat", "agent"))
    assert [p.name for p in select_prompts(["code", "math"], 1)] == ["lru-cache", "train-meeting"]
    with pytest.raises(ValueError, match="unknown prompt set"):
        select_prompts(["poetry"])
    encode = lambda text: list(text.encode())  # noqa: E731
    assert filler_tokens(encode, 5000) == filler_tokens(encode, 5000) and len(filler_tokens(encode, 5000)) == 5000
    assert filler_tokens(encode, 5000)[:300] == filler_tokens(encode, 300)


# ------------------------------------------------------------------------- engine mode (CLI)


def test_short_sweep_end_to_end(qwen3_pair, tmp_path, capsys):
    target, drafter = qwen3_pair
    out = tmp_path / "results.json"
    code = _bench("--target", str(target), "--drafter", str(drafter), "--contexts", "160,320",
                  "--sets", "math,agent", "--prompts-per-set", "1", "--max-tokens", "16", "--repeats", "2", out=out)
    assert code == 0
    printed = capsys.readouterr().out
    assert "decode tok/s" in printed and "speedup" in printed and "auto" in printed and "MISMATCH" not in printed

    report = bench.load_report(out)  # the documented schema, validated
    assert isinstance(report, bench.EngineReport)
    assert report.acceptance_measured and report.all_matched is True and report.model.block_size == 16
    assert [(r.context, r.set) for r in report.summary] == [
        (160, "math"), (160, "agent"), (160, "all"), (320, "math"), (320, "agent"), (320, "all")]
    for r in report.results:
        assert r.match is True and r.divergence is None and r.target_repeats_agree
        assert r.target.runs == r.dflash.runs == 2
        assert r.target.prompt_tokens == r.dflash.prompt_tokens == r.prompt_tokens
        assert r.target.prefill_tokens_per_second > 0 and r.dflash.decode_tokens_per_second > 0
        assert r.speedup == pytest.approx(r.dflash.decode_tokens_per_second / r.target.decode_tokens_per_second)
        assert r.dflash.tokens_per_cycle >= 1 and len(r.dflash.acceptance_by_position) == 15
        assert r.dflash.peak_memory_bytes > 0 and not r.target.speculative
        # speculation auto beside them: the same output (checked in `match`), its own speed.
        assert r.auto.runs == 2 and r.auto.speculative
        assert r.dflash.cycle_widths == {16: r.dflash.cycles}  # always-on: the whole block every cycle
        assert sum(r.auto.cycle_widths.values()) == r.auto.cycles and not r.target.cycle_widths
        assert r.auto_speedup == pytest.approx(r.auto.decode_tokens_per_second / r.target.decode_tokens_per_second)
        if r.set == "math":  # padded with the filler document to exactly the context
            assert r.prompt_tokens == r.context and r.filler_tokens > 0
        else:  # the agent prompt with its tools is longer than both contexts: left as it is
            assert r.prompt_tokens > r.context and r.filler_tokens == 0
    # Each row also as one workload: the prompts' decode tokens over their summed decode time.
    for row in report.summary:
        group = [r for r in report.results if r.context == row.context and row.set in ("all", r.set)]
        for mode, pooled in (("dflash", row.pooled_speedup), ("auto", row.auto_pooled_speedup)):
            seconds = [sum((getattr(r, m).generated_tokens - 1) / getattr(r, m).decode_tokens_per_second
                           for r in group) for m in ("target", mode)]
            tokens = sum(r.target.generated_tokens - 1 for r in group)
            assert tokens == sum(getattr(r, mode).generated_tokens - 1 for r in group)  # the same outputs
            assert pooled == pytest.approx(seconds[0] / seconds[1])
    assert "prompts as one workload" in printed
    # The untrained drafter loses: auto says why, in numbers, as a response's stats do.
    notes = [r.auto.speculation_note for r in report.results if r.auto.speculation_note]
    assert notes and all("against a step of" in n for n in notes)
    _assert_png(tmp_path / "results-speed.png")
    _assert_png(tmp_path / "results-acceptance.png")

    # The schema is strict: an unknown key or a missing one is refused.
    raw = json.loads(out.read_text())
    with pytest.raises(pydantic.ValidationError):
        bench.BenchReport.validate_python({**raw, "surprise": 1})
    with pytest.raises(pydantic.ValidationError):
        bench.BenchReport.validate_python({k: v for k, v in raw.items() if k != "summary"})


def _mode(generated: int, tokens_per_second: float) -> bench.ModeResult:
    return bench.ModeResult(speculative=True, runs=1, prompt_tokens=8, generated_tokens=generated,
                            finish_reason="length", prefill_seconds=0.1, decode_seconds=(generated - 1) / tokens_per_second,
                            prefill_tokens_per_second=80.0, decode_tokens_per_second=tokens_per_second,
                            peak_memory_bytes=1)


def test_a_workload_weighs_each_prompt_by_its_time():
    # Two prompts of 101 tokens, 1 s each alone; DFlash takes 0.25 s on one and 1 s on the other:
    # 200 tokens in 1.25 s against 2 s, 1.6x, where the ratio of medians says 2.5x.
    from dflash_core.bench.engine_runs import pooled_speedup

    targets = [_mode(101, 100.0), _mode(101, 100.0)]
    dflash = [_mode(101, 400.0), _mode(101, 100.0)]
    assert pooled_speedup(targets, dflash) == pytest.approx(1.6)
    # A long generation weighs by its time: 1001 tokens at 2x and 11 at 10x is close to 2x.
    assert pooled_speedup([_mode(1001, 100.0), _mode(11, 100.0)], [_mode(1001, 200.0), _mode(11, 1000.0)]) == \
        pytest.approx(1010 / (5.0 + 0.01) / 100.0)
    assert pooled_speedup(targets, dflash[:1]) is None  # a prompt without DFlash: no workload figure
    assert pooled_speedup(targets, []) is None


class PlantedDivergence:
    """The real engine, except that speculative runs hand out one altered token."""

    def __init__(self, engine, index: int):
        self.engine, self.index = engine, index

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompt, *, speculative=True, **kwargs):
        seen = 0
        for chunk in self.engine.generate(prompt, speculative=speculative, **kwargs):
            ids = list(chunk.token_ids)
            if speculative and seen <= self.index < seen + len(ids):
                ids[self.index - seen] = (ids[self.index - seen] + 1) % self.engine.target.vocab_size
                chunk = dataclasses.replace(chunk, token_ids=ids)
            seen += len(ids)
            yield chunk


def test_planted_divergence_is_reported(qwen3_pair, tmp_path, capsys, monkeypatch):
    real = bench.checkpoint_bench_model

    def planted(settings, channel=None):
        model = real(settings, channel)
        return dataclasses.replace(model, engine=PlantedDivergence(model.engine, index=5))

    monkeypatch.setattr(bench_command, "checkpoint_bench_model", planted)
    target, drafter = qwen3_pair
    out = tmp_path / "r.json"
    code = _bench("--target", str(target), "--drafter", str(drafter), "--contexts", "160", "--sets", "chat",
                  "--prompts-per-set", "1", "--max-tokens", "12", "--ignore-eos", "--repeats", "1", "--no-plots",
                  out=out)
    assert code == 1  # a mismatch fails the command
    report = bench.load_report(out)
    assert report.all_matched is False
    (result,) = report.results
    assert result.match is False and result.divergence is not None
    d = result.divergence
    assert (d.repeat, d.index) == (0, 5) and d.target_token is not None
    assert d.dflash_token == (d.target_token + 1) % TINY_VOCAB
    assert d.logit_gap > 0  # greedy: the target's own token is its argmax, the planted one trails it
    assert result.compared_tokens == 12  # both outputs ran to max_tokens
    assert report.summary[0].mismatched == 1
    printed = capsys.readouterr().out
    assert "MISMATCH chat/trip-plan at context 160: first divergence at generated token 5" in printed
    assert f"target {d.target_token}, dflash {d.dflash_token}, target logit gap" in printed


def test_logit_gap_matches_one_full_forward(qwen3_pair):
    from mlx_lm import utils as mlx_lm_utils

    from dflash_core.loading import load_model

    target, drafter = qwen3_pair
    engine = load_model(str(target), str(drafter), prefill_chunk=7).engine  # several prefill chunks
    prompt, agreed = [3, 17, 42, 8, 99, 23, 5, 61, 12, 7, 30], [44, 2, 90]
    model, _ = mlx_lm_utils.load_model(target)
    logits = model(mx.array([prompt + agreed]))[0, -1]
    want, got = int(mx.argmax(logits).item()), 11
    expected = (logits[want] - logits[got]).item()
    assert bench.logit_gap(engine, prompt, agreed, want, got) == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert bench.logit_gap(engine, prompt, agreed, want, None) is None  # DFlash's output had ended


def test_random_weights_are_labelled(tmp_path, capsys):
    out = tmp_path / "random.json"
    code = _bench("--random-weights", "tiny-qwen3", "--forced-accepted", "3", "--contexts", "200", "--sets", "chat",
                  "--prompts-per-set", "1", "--max-tokens", "24", "--repeats", "1", out=out)
    assert code == 0
    report = bench.load_report(out)
    assert report.model.weights == "random" and report.model.drafter == "random"
    assert report.acceptance_measured is False and "Forced acceptance" in report.note
    assert report.settings.forced_accepted == 3
    (result,) = report.results
    assert result.dflash.tokens_per_cycle == pytest.approx(4.0)  # 3 forced drafts + the target's token
    assert result.match is None and report.all_matched is None  # forced outputs are not the target's
    assert result.prompt_tokens == 200
    assert "RANDOM WEIGHTS" in capsys.readouterr().out
    _assert_png(tmp_path / "random-speed.png")
    assert not (tmp_path / "random-acceptance.png").exists()  # no acceptance plot for random weights
    with pytest.raises(ValueError, match="unknown random-weights shape"):
        bench.random_bench_model("llama-7b")


def test_without_matplotlib_the_plots_are_skipped_with_a_hint(tmp_path, capsys, monkeypatch):
    # None in sys.modules makes `import matplotlib` (and its submodules, imported or not) fail.
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    out = tmp_path / "r.json"
    code = _bench("--random-weights", "tiny-qwen3", "--contexts", "64", "--sets", "chat", "--prompts-per-set", "1",
                  "--max-tokens", "8", "--repeats", "1", out=out)
    assert code == 0  # the measurements stand: the exit code says nothing about plots
    captured = capsys.readouterr()
    assert "decode tok/s" in captured.out and "plot:" not in captured.out
    assert "plots skipped: matplotlib is not installed: pip install 'dflash[bench]'" in captured.err
    assert isinstance(bench.load_report(out), bench.EngineReport)
    assert not list(tmp_path.glob("*.png"))
    with pytest.raises(bench.PlotsUnavailable, match=r"dflash\[bench\]"):
        bench.write_plots(bench.load_report(out), tmp_path)


# ------------------------------------------------------------------------------- server mode


def test_server_mode_reports_latencies(qwen3_pair, tmp_path, capsys):
    target, drafter = qwen3_pair
    # Speculation on: every request runs cycles, whose pooled tokens per cycle the report gives
    # (auto may keep a CPU on plain steps for all 12 tokens, as it did once in a loaded full run).
    settings = Settings(server=ServerSettings(max_active=2),
                        models=[ModelSettings(name="tiny", target=str(target), drafter=str(drafter), speculation="on")])
    out = tmp_path / "server.json"
    with LiveServer(settings) as server:
        code = _bench("--server", server.url, "--concurrency", "2", "--requests", "4", "--max-tokens", "12",
                      "--sets", "chat,agent", "--prompts-per-set", "1", out=out)
    assert code == 0
    report = bench.load_report(out)
    assert isinstance(report, bench.ServerReport)
    assert report.model == "tiny" and report.concurrency == 2
    assert report.errors == 0 and report.completed == 4 and report.error_messages == []
    assert report.ttft_seconds.count == 4 and report.ttft_seconds.p50 > 0
    assert report.ttft_seconds.p50 <= report.ttft_seconds.p90 <= report.ttft_seconds.p99
    assert report.inter_token_seconds.count >= 1 and report.inter_chunk_seconds.count >= 1
    assert 0 < report.completion_tokens <= 48 and report.throughput_tokens_per_second > 0
    assert report.speculative_requests == 4 and report.tokens_per_cycle >= 1
    for r in report.requests_detail:
        assert r.ok and r.dflash["speculative"] is True and r.completion_tokens == r.dflash["generated_tokens"]
        assert r.prompt_tokens > 0 and r.chunks >= 1
    assert {r.prompt for r in report.requests_detail} == {"chat/trip-plan", "agent/weather-call"}
    printed = capsys.readouterr().out
    assert "time to first token" in printed and "errors 0" in printed


def test_bad_bench_input_is_one_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _bench("--random-weights", "tiny-qwen3", "--prompts-per-set", "0", out=tmp_path / "r.json")
    assert "--prompts-per-set: expected positive integers" in capsys.readouterr().err
    # Nothing listens on port 9: a message naming the URL, exit code 2, no traceback.
    assert _bench("--server", "http://127.0.0.1:9", "--requests", "1", out=tmp_path / "s.json") == 2
    assert "http://127.0.0.1:9: no OpenAI-compatible server" in capsys.readouterr().err
