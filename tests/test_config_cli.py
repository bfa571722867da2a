"""config.yaml, precedence, the registry, downloads and the `dflash` command line."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
import yaml

from dflash_core import cli
from dflash_core.hub import ModelNotFoundError, resolve
from dflash_core.kernels import cpu_linear
from dflash_core.loading import choose_drafter, load_model
from dflash_core.registry import base_model_key, find_pair
from dflash_core.settings import DEFAULT_MODEL, ConfigError, Settings, load_settings

REPO = Path(__file__).resolve().parents[1]


def test_repo_config_is_valid_and_serves_qwen35_4b():
    settings = load_settings(REPO / "config.yaml")
    spec = settings.model()
    assert (spec.target, spec.drafter) == ("Qwen/Qwen3.5-4B", "z-lab/Qwen3.5-4B-DFlash")
    assert settings.server.host == "127.0.0.1" and settings.server.port == 8000
    assert Settings().model() == DEFAULT_MODEL  # the same default without any file


@pytest.mark.parametrize(
    "content, key",
    [
        ({"server": {"prot": 8000}}, "server.prot"),
        ({"server": {"port": "eighty"}}, "server.port"),
        ({"models": [{"name": "a"}]}, "models.0.target"),
        ({"models": [{"name": "a", "target": "x", "dtype": "int3"}]}, "models.0.dtype"),
        ({"models": [{"name": "a", "target": "x"}, {"name": "a", "target": "y"}]}, "duplicate model names"),
        ({"default_model": "b", "models": [{"name": "a", "target": "x"}]}, "default_model"),
    ],
)
def test_invalid_config_names_file_and_key(tmp_path, content, key):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(content))
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert str(path) in str(err.value) and key in str(err.value)


def test_invalid_config_exits_2_with_one_message(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("server:\n  port: [1, 2]\n")
    assert cli.main(["generate", "--config", str(path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash: error:") and str(path) in err and "server.port" in err
    assert "Traceback" not in err


def _args(argv):
    return cli.build_parser().parse_args(argv)


def test_precedence(tmp_path, monkeypatch):
    local = tmp_path / "config.yaml"
    local.write_text(yaml.safe_dump({"server": {"port": 1111}, "models": [{"name": "local", "target": "org/local"}]}))
    env = tmp_path / "env.yaml"
    env.write_text(yaml.safe_dump({"server": {"port": 2222}, "models": [{"name": "env", "target": "org/env"}]}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DFLASH_CONFIG", raising=False)
    assert cli.settings_from_args(_args(["serve"])).server.port == 1111  # ./config.yaml
    monkeypatch.setenv("DFLASH_CONFIG", str(env))
    settings = cli.settings_from_args(_args(["serve"]))
    assert settings.server.port == 2222 and settings.model().name == "env"  # DFLASH_CONFIG beats ./config.yaml
    settings = cli.settings_from_args(_args(["serve", "--target", "org/flag", "--drafter", "org/flag-drafter"]))
    assert settings.model().target == "org/flag" and settings.model().drafter == "org/flag-drafter"  # flags win
    monkeypatch.chdir(REPO / "tests")  # no config.yaml here, no DFLASH_CONFIG: built-in defaults
    monkeypatch.delenv("DFLASH_CONFIG")
    assert cli.settings_from_args(_args(["serve"])).model() == DEFAULT_MODEL


def test_model_flag_picks_a_configured_model_or_a_target(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DFLASH_CONFIG", raising=False)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(
        {"models": [{"name": "a", "target": "org/a"}, {"name": "b", "target": "org/b", "drafter": None}]}))
    settings = cli.settings_from_args(_args(["serve", "--model", "b"]))
    assert settings.model().target == "org/b" and [m.name for m in settings.models] == ["b", "a"]
    spec = cli.settings_from_args(_args(["serve", "--model", "mlx-community/Qwen3.5-9B-4bit"])).model()
    assert spec.target == "mlx-community/Qwen3.5-9B-4bit" and spec.drafter == "auto"
    spec = cli.settings_from_args(_args(["serve", "--model", "a", "--drafter", "none"])).model()
    assert spec.target == "org/a" and spec.drafter is None  # the configured model, target alone
    spec = cli.settings_from_args(_args(["serve", "--model", "a", "--drafter", "/d", "--drafter-revision", "r"])).model()
    assert (spec.drafter, spec.drafter_revision) == ("/d", "r")
    with pytest.raises(ConfigError, match="--drafter needs --target or --model"):
        cli.settings_from_args(_args(["serve", "--drafter", "/d"]))


@pytest.mark.parametrize(
    "name, drafter",
    [
        ("Qwen/Qwen3.5-9B", "z-lab/Qwen3.5-9B-DFlash"),
        ("mlx-community/Qwen3.5-9B-4bit", "z-lab/Qwen3.5-9B-DFlash"),
        ("mlx-community/Qwen3.5-9B-MLX-8bit", "z-lab/Qwen3.5-9B-DFlash"),
        ("/models/Qwen3.5-27B-bf16", "z-lab/Qwen3.5-27B-DFlash"),
        ("mlx-community/Qwen3.6-35B-A3B-4bit", "z-lab/Qwen3.6-35B-A3B-DFlash"),
        ("mlx-community/gemma-4-31b-it-4bit", "z-lab/gemma-4-31B-it-DFlash"),
        ("mlx-community/gemma-4-31b-it-qat-4bit", "z-lab/gemma-4-31B-it-DFlash"),
        ("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16"),
        ("Qwen/Qwen3.5-9B-Base", None),
        ("meta-llama/Llama-3.2-1B", None),
    ],
)
def test_registry_finds_drafters_from_community_names(name, drafter):
    pair = find_pair(name)
    assert (pair.drafter if pair else None) == drafter


def test_base_model_key():
    assert base_model_key("mlx-community/Qwen3.5-4B-MLX-bf16") == "qwen3.5-4b"
    assert base_model_key("Qwen3.5-4B-q4_k_m") == "qwen3.5-4b"


def test_unknown_target_serves_alone_and_says_so(qwen3_pair):
    target, _ = qwen3_pair
    drafter, _, reason = choose_drafter(str(target), "auto", None)
    assert drafter is None and "no known DFlash drafter" in reason
    engine = load_model(str(target), "auto").engine
    last = list(engine.generate(engine.tokenizer.encode("hi"), max_tokens=3))[-1]
    assert not last.stats.speculative and "no known DFlash drafter" in last.stats.speculative_off_reason


def test_missing_repo_gives_a_clear_offline_message(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError) as err:
        resolve("someone/no-such-model")
    message = str(err.value)
    assert "hf download someone/no-such-model" in message and "local model directory" in message
    with pytest.raises(ModelNotFoundError, match="no such directory"):
        resolve("./does/not/exist")


def test_an_interrupted_download_is_not_taken_for_a_model(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--org--partial"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    (snapshot / "config.json").write_text("{}")  # the weights never arrived
    with pytest.raises(ModelNotFoundError, match="hf download org/partial"):
        resolve("org/partial", files=["*.json", "*.safetensors"])
    (snapshot / "model.safetensors").write_bytes(b"")
    assert resolve("org/partial", files=["*.json", "*.safetensors"]) == snapshot


def test_generate_json_on_local_fixtures(qwen3_5_pair, capsys):
    target, drafter = qwen3_5_pair
    code = cli.main(["generate", "--target", str(target), "--drafter", str(drafter), "--prompt", "Hello",
                     "--max-tokens", "24", "--json", "--chat"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 24 and isinstance(out["text"], str)
    stats = out["stats"]
    for key in ("prompt_tokens", "prefill_tokens", "prefill_seconds", "decode_seconds", "generated_tokens", "cycles",
                "draft_tokens_proposed", "draft_tokens_accepted", "tokens_per_cycle", "acceptance_by_position",
                "speculative", "speculative_off_reason", "finish_reason", "decode_tokens_per_second", "block_size"):
        assert key in stats, key
    assert stats["speculative"] and stats["finish_reason"] == "length"
    code = cli.main(["generate", "--target", str(target), "--drafter", str(drafter), "--prompt", "Hello",
                     "--max-tokens", "24", "--json", "--chat", "--no-speculative"])
    plain = json.loads(capsys.readouterr().out)
    assert plain["token_ids"] == out["token_ids"]
    assert plain["stats"]["speculative_off_reason"] == "disabled by request"


def test_dtype_quantization_and_block_size(qwen3_pair, caplog):
    target, drafter = qwen3_pair
    with caplog.at_level("WARNING", logger="dflash_core.loading"):
        loaded = load_model(str(target), str(drafter), quantize_bits=8, block_size=6)
    assert "SLOWER than the target alone" in caplog.text  # these tests run on MLX's CPU backend
    engine = loaded.engine
    assert engine.drafter.block_size == 6
    prompt = engine.tokenizer.encode("Quantized")
    alone = [t for c in engine.generate(prompt, max_tokens=40, speculative=False) for t in c.token_ids]
    chunks = list(engine.generate(prompt, max_tokens=40))
    assert [t for c in chunks for t in c.token_ids] == alone  # lossless on a quantized target too
    assert len(chunks[-1].stats.acceptance_by_position) == 5
    half = load_model(str(target), None, dtype="float16").engine
    assert half.target.dtype.__str__().endswith("float16")
    with pytest.raises(ValueError, match="block_size"):
        load_model(str(target), str(drafter), block_size=40)


def test_command_line_edges(qwen3_pair, tmp_path, monkeypatch, capsys):
    target, _ = qwen3_pair
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DFLASH_CONFIG", raising=False)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({
        "defaults": {"max_tokens": 5},
        "models": [{"name": "a", "target": str(target), "drafter": "none"}, {"name": "b", "target": "org/b"}]}))
    settings = cli.settings_from_args(_args(["serve", "--model", "a", "--target-revision", "v1"]))
    first, other = settings.models
    assert first.drafter is None  # `drafter: none` in YAML, as --drafter none
    assert first.target_revision == "v1" and other.load_at_start is False  # --model: the others wait
    # generate takes config.yaml's defaults for what its flags leave unset, and with
    # --no-speculative it never loads (or downloads) a drafter.
    code = cli.main(["generate", "--target", str(target), "--drafter", "org/not-downloaded", "--no-speculative",
                     "--prompt", "Hi", "--json"])
    assert code == 0 and len(json.loads(capsys.readouterr().out)["token_ids"]) == 5
    # Bad values are one clear message (exit code 2), not a traceback.
    assert cli.main(["serve", "--model", "a", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
    assert cli.main(["generate", "--config", str(tmp_path), "--prompt", "x"]) == 2
    assert "cannot read the config file" in capsys.readouterr().err
    assert cli.main(["generate", "--model", "a", "--prompt-file", str(tmp_path)]) == 2
    assert "cannot read the prompt file" in capsys.readouterr().err
    monkeypatch.chdir(target)
    assert cli.model_name(".") == target.name


def test_dtype_keeps_what_the_model_keeps_in_float32(qwen3_5_pair):
    from mlx.utils import tree_flatten

    engine = load_model(str(qwen3_5_pair[0]), None, dtype="bfloat16").engine
    weights = dict(tree_flatten(engine.target.model.parameters()))
    a_logs = [k for k in weights if k.endswith("A_log")]
    assert a_logs and all(weights[k].dtype == mx.float32 for k in a_logs)  # mlx-lm's cast_predicate
    assert all(v.dtype == mx.bfloat16 for k, v in weights.items() if not k.endswith("A_log"))
    chunks = list(engine.generate(engine.tokenizer.encode("Cast"), max_tokens=3))
    assert sum(len(c.token_ids) for c in chunks) == 3


def test_models_and_doctor_commands(qwen3_pair, tmp_path, capsys):
    target, _ = qwen3_pair
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"models": [{"name": "mine", "target": str(target), "drafter": None},
                                                 {"name": "nine", "target": "mlx-community/Qwen3.5-9B-4bit"}]}))
    assert cli.main(["models", "--config", str(config), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    mine = next(r for r in rows if r["name"] == "mine")
    assert mine["source"] == "config" and mine["target_bytes"] > 0
    nine = next(r for r in rows if r["name"] == "nine")
    assert nine["drafter"] == "z-lab/Qwen3.5-9B-DFlash"  # drafter "auto": the registry's choice, shown
    assert any(r["source"] == "registry" and r["drafter"] == "z-lab/Qwen3.5-9B-DFlash" for r in rows)
    assert cli.main(["models", "--config", str(config)]) == 0
    assert "z-lab/Qwen3.5-9B-DFlash" in capsys.readouterr().out
    assert cli.main(["doctor", "--json", "--no-hub"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "cpu" and report["mlx"].startswith("0.") and report["kernels"]["gated_delta"]
    ours = "MLX's unfused ops with our CPU softmax and products (float32, decode and blocks)"
    assert report["kernels"]["block_attention"] == (ours if cpu_linear.extension() else "MLX fused attention")
    assert report["kernels"]["small_m_matmul"] == "MLX matmul"
    assert report["kernels"]["cpu_projections"].startswith("int8 or float16 copies in our MLX primitive" if
                                                           cpu_linear.extension() else "MLX's float32 product")
    assert report["kernels"]["residual_norms"] == "MLX ops"
    assert report["kernels"]["draft_vocab"].startswith("a drafter's draft_vocab.json where it has one")
    assert "auto" in report["speculation"] and "lose" in report["speculation"]
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "backend" in out and "hub" in out


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for command in ("serve", "generate", "models", "doctor"):
        assert command in out


@pytest.mark.parametrize(
    "models, setting, expected",
    [
        ([{"name": "a", "target": "x", "drafter": "d"}], None, "0"),
        ([{"name": "a", "target": "x", "drafter": None}], None, "1"),
        ([{"name": "a", "target": "x", "drafter": "d"}], True, "1"),
    ],
)
def test_cuda_graphs_follow_speculation(monkeypatch, models, setting, expected):
    import os

    monkeypatch.delenv("MLX_USE_CUDA_GRAPHS", raising=False)
    monkeypatch.delenv("MLX_ENABLE_CACHE_THRASHING_CHECK", raising=False)
    Settings.model_validate({"models": models, "cuda_graphs": setting}).apply_backend_settings()
    assert os.environ["MLX_USE_CUDA_GRAPHS"] == expected
    # A value in the environment stays when the config leaves it automatic, and yields when it says.
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "from-env")
    Settings.model_validate({"models": models, "cuda_graphs": setting}).apply_backend_settings()
    assert os.environ["MLX_USE_CUDA_GRAPHS"] == ("from-env" if setting is None else expected)


def test_mlx_cache_thrashing_check_is_off_unless_the_user_set_it(monkeypatch):
    """MLX's CUDA caches throw after 2 x their size of misses in a row: a server runs slower there
    instead of failing requests. A value the user exported stays."""
    import os

    models = [{"name": "a", "target": "x", "drafter": None}]
    monkeypatch.delenv("MLX_ENABLE_CACHE_THRASHING_CHECK", raising=False)
    monkeypatch.delenv("MLX_USE_CUDA_GRAPHS", raising=False)
    Settings.model_validate({"models": models}).apply_backend_settings()
    assert os.environ["MLX_ENABLE_CACHE_THRASHING_CHECK"] == "0"
    monkeypatch.setenv("MLX_ENABLE_CACHE_THRASHING_CHECK", "1")
    Settings.model_validate({"models": models}).apply_backend_settings()
    assert os.environ["MLX_ENABLE_CACHE_THRASHING_CHECK"] == "1"


def test_model_sampling_defaults_are_typed(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"models": [{"name": "a", "target": "x", "sampling": {"top_k": 20, "temperature": 0.6}}]}))
    sampling = load_settings(path).model("a").sampling
    assert sampling.top_k == 20 and isinstance(sampling.top_k, int) and sampling.temperature == 0.6
    path.write_text(yaml.safe_dump({"models": [{"name": "a", "target": "x", "sampling": {"top_kk": 20}}]}))
    with pytest.raises(ConfigError, match="models.0.sampling.top_kk"):
        load_settings(path)


def test_serve_refuses_a_public_address_without_a_key(capsys):
    from dflash_core.cli import main

    assert main(["serve", "--host", "0.0.0.0", "--target", "nowhere"]) == 2
    assert "without an API key" in capsys.readouterr().err


def test_the_demo_is_served_in_bf16_on_cuda_only(monkeypatch):
    """The offline demo's target: bf16 on CUDA (exact there, and faster than its float32
    conversion), as converted (float32) on the CPU and Metal; a configured model keeps its own."""
    import dflash_core.kernels as kernels
    from dflash_core.demo import DEMO_NAME
    from dflash_core.settings import Settings

    monkeypatch.setattr(kernels, "backend", lambda: "cpu")
    assert Settings().model(DEMO_NAME).dtype is None
    monkeypatch.setattr(kernels, "backend", lambda: "metal")
    assert Settings().model(DEMO_NAME).dtype is None
    monkeypatch.setattr(kernels, "backend", lambda: "cuda")
    assert Settings().model(DEMO_NAME).dtype == "bfloat16"
    assert Settings().model("some/model").dtype is None


def test_a_head_dim_the_exact_attention_lacks_is_said_at_load(tmp_path, monkeypatch, caplog):
    """On CUDA, a target whose head dim the exact attention kernel does not take loads with a
    warning that says what that costs; one it takes, and any target elsewhere, without."""
    from synthetic import tiny_pair

    import dflash_core.kernels as kernels
    from dflash_core.loading import inexact_attention_note

    odd = tiny_pair(tmp_path / "odd", "qwen3", target_kwargs={"shape": {"head_dim": 24}})
    fine = tiny_pair(tmp_path / "fine", "qwen3")
    assert inexact_attention_note(load_model(*map(str, odd)).engine.target) is None  # not on CUDA
    monkeypatch.setattr(kernels, "backend", lambda: "cuda")
    caplog.clear()
    with caplog.at_level("WARNING"):
        target = load_model(*map(str, odd)).engine.target
    assert "head_dim 24 is not one the exact CUDA attention takes" in caplog.text
    assert inexact_attention_note(target) == next(r.message for r in caplog.records if "head_dim 24" in r.message)
    assert inexact_attention_note(load_model(*map(str, fine)).engine.target) is None
