"""The first run: a default model that cannot be had is stood in for by the demo, loudly; the
model name `default`; chats to a base model end; what doctor and `dflash models` say."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from live_server import LiveServer

from dflash_core.cli import main
from dflash_core.doctor import default_model_status, doctor_report
from dflash_core.settings import ModelSettings, SamplingDefaults, Settings

MISSING = ModelSettings(name="big-model", target="nobody/not-on-this-machine", drafter=None)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No model in the Hugging Face cache and a hub that cannot be reached."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def _stand_in(pair, name="stand-in"):
    return ModelSettings(name=name, target=str(pair[0]), drafter=str(pair[1]),
                         sampling=SamplingDefaults(max_tokens=5))


def _serve(settings, pair, **kwargs):
    return LiveServer(settings, prepare=lambda state: setattr(state.pool, "stand_in", lambda: _stand_in(pair)), **kwargs)


def test_an_unavailable_default_is_stood_in_for_loudly(offline, qwen3_pair, caplog):
    caplog.set_level(logging.WARNING, logger="dflash_server.models")
    with _serve(Settings(models=[MISSING]), qwen3_pair) as server:
        health = httpx.get(server.url + "/health").json()
        assert health["status"] == "ok" and health["default_model"] == "stand-in"
        assert health["fallback"]["requested"] == "big-model"
        assert "nobody/not-on-this-machine is not in the local Hugging Face cache" in health["fallback"]["reason"]
        # /v1/models lists what can be served: the failed default is not offered.
        assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == ["stand-in"]
        chat = {"messages": [{"role": "user", "content": "Hi"}]}
        answer = httpx.post(server.url + "/v1/chat/completions", json={"model": "default", **chat}, timeout=60)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["model"] == "stand-in"  # the real name, not the alias
        assert body["usage"]["completion_tokens"] <= 5  # the stand-in's own max_tokens default
        failed = httpx.post(server.url + "/v1/chat/completions", json={"model": "big-model", **chat}, timeout=60)
        assert failed.status_code == 503
        error = failed.json()["error"]
        assert error["code"] == "model_unavailable" and "not in the local Hugging Face cache" in error["message"]
        assert "'stand-in' instead" in error["message"]
        assert httpx.get(server.url + "/v1/models/big-model").status_code == 503
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "SERVING THE OFFLINE DEMO 'stand-in' INSTEAD" in logged


def test_a_model_asked_for_by_name_is_not_stood_in_for(offline, qwen3_pair):
    settings = Settings(models=[MISSING], demo_fallback=False)
    with _serve(settings, qwen3_pair, ready=lambda health: health.json().get("status") == "error") as server:
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503
        assert "not in the local Hugging Face cache" in health.json()["errors"]["big-model"]
        assert httpx.get(server.url + "/v1/models").json()["data"] == []
        answer = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                            json={"model": "default", "messages": [{"role": "user", "content": "Hi"}]})
        assert answer.status_code == 503 and "not in the local Hugging Face cache" in answer.json()["error"]["message"]


def test_a_chat_ends_where_the_model_starts_another_turn(qwen3_pair):
    """A base model chatting does not write end-of-turn, but does start the next turn."""
    from scripted_server import script, scripted_server

    with scripted_server({"tiny": qwen3_pair}) as server:
        script(server, "tiny", "Hello there.<|im_start|>user\nmore")
        body = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
            "chat_template_kwargs": {"enable_thinking": False}}).json()
        assert body["choices"][0]["message"]["content"] == "Hello there."
        assert body["choices"][0]["finish_reason"] == "stop"
        # A plain completion is text, not a chat turn: it goes on.
        text = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "Hi", "max_tokens": 20}).json()["choices"][0]["text"]
        assert text.startswith("Hello there.<|im_start|>user")


def test_doctor_says_where_the_default_model_comes_from(offline, tmp_path):
    settings = Settings(models=[MISSING])
    assert "OFFLINE DEMO gemma-3-270m instead" in default_model_status(settings, "offline mode (HF_HUB_OFFLINE is set)")
    assert "downloads nobody/not-on-this-machine" in default_model_status(settings, "reachable (https://hub)")
    local = ModelSettings(name="local", target=str(tmp_path), drafter=None)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "is on disk" in default_model_status(Settings(models=[local]), "offline")
    report = doctor_report(check_hub=True, settings=settings)
    assert report["device_memory_gb"] is not None  # the CPU's memory is the system's
    assert report["demo_cache"].endswith("dflash")
    assert "OFFLINE DEMO" in report["default_model"]


def test_models_table_aligns_long_paths(tmp_path, capsys, monkeypatch):
    long = tmp_path / ("a-rather-long-directory-name-" * 3)
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({"models": [{"name": "local-one", "target": str(long), "drafter": str(long)}]}))
    assert main(["models", "--config", str(config)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    header = lines[0]
    # Every row's size columns end where the header's do.
    assert all(len(line) == len(header) for line in lines), lines[:3]
