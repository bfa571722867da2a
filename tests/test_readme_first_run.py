"""The README's first command on a fresh machine with no network but the package registry: it
installs, starts, stands the demo in for the default model it cannot download, and the README's
"Use" examples, run as written, get an answer.

A fresh checkout (the files git tracks or would track), a fresh HOME (no model caches, no converted
demo) and a Hugging Face endpoint that refuses connections; pip keeps its package cache and index
settings, and leaves compiling the bytecode to the first start. Skips only when the package registry itself is unreachable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_packaging import _free_port, _registry_or_skip, _wait_healthy, stop

ROOT = Path(__file__).resolve().parents[1]


def _section(markdown: str, title: str) -> str:
    start = markdown.index(f"\n## {title}\n")
    end = markdown.find("\n## ", start + 1)
    return markdown[start: end if end != -1 else None]


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def _checkout(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


@pytest.mark.slow  # installs and serves the real demo, as a newcomer would
@pytest.mark.skipif(sys.platform != "linux", reason="the CPU install path is Linux's")
def test_readme_first_command_serves_offline_and_its_examples_answer(tmp_path):
    _registry_or_skip(tmp_path)
    readme = (ROOT / "README.md").read_text()
    (first_command, _tests) = _blocks(_section(readme, "Set up"), "bash")
    install, serve = first_command.strip().rsplit(" && ", 1)
    assert serve == ".venv/bin/dflash serve"
    (curl,) = _blocks(_section(readme, "Use"), "bash")[:1]
    (snippet,) = _blocks(_section(readme, "Use"), "python")[:1]

    checkout, home = tmp_path / "dflash", tmp_path / "home"
    checkout.mkdir()
    home.mkdir()
    _checkout(checkout)
    pip_cache = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True).stdout.strip()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "XDG_", "DFLASH_", "VIRTUAL_ENV"))}
    # pip's package cache, and no bytecode compiled at install (Python compiles what the server
    # imports at its first start instead): 20 of the install's 54 s here, none of what is checked.
    env.update(HOME=str(home), HF_ENDPOINT="http://127.0.0.1:9", PIP_CACHE_DIR=pip_cache or str(home / "pip"),
               PIP_NO_COMPILE="1")
    installed = subprocess.run(["/bin/sh", "-c", install], cwd=checkout, env=env, capture_output=True, text=True,
                               timeout=1500)
    assert installed.returncode == 0, (installed.stdout + installed.stderr)[-4000:]

    port = _free_port()
    log = tmp_path / "serve.log"
    # The README's command, moved off port 8000 as a flag would; exec'd, so that `stop` signals the
    # server itself rather than leaving it running past the test.
    with open(log, "w") as out:
        proc = subprocess.Popen(["/bin/sh", "-c", f"exec {serve} --port {port}"], cwd=checkout, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log, timeout=600)  # it converts the demo's GGUF first
        health = httpx.get(url + "/health", timeout=5).json()
        assert health["fallback"]["requested"] == "qwen3.5-4b" and health["default_model"] == "gemma-3-270m"

        use = {**env, "PATH": os.environ["PATH"]}
        answer = subprocess.run(["/bin/sh", "-c", curl.replace("localhost:8000", f"localhost:{port}")], env=use,
                                capture_output=True, text=True, timeout=300)
        assert answer.returncode == 0, answer.stderr
        body = json.loads(answer.stdout)
        assert body["model"] == "gemma-3-270m" and body["choices"][0]["message"]["content"].strip(), body
        printed = subprocess.run([sys.executable, "-c", snippet.replace("localhost:8000", f"localhost:{port}")],
                                 env=use, capture_output=True, text=True, timeout=300)
        assert printed.returncode == 0, printed.stderr
        assert printed.stdout.strip(), "the Python snippet printed no answer"
    finally:
        stop(proc)
    text = log.read_text()
    assert "SERVING THE OFFLINE DEMO 'gemma-3-270m' INSTEAD" in text
    assert "converting gemma-3-270m" in text  # the first conversion shows its progress
    if "compiling the CPU kernels" in text:  # (where a compiler is) it began before the weights were ready
        assert text.index("compiling the CPU kernels") < text.index("converted gemma-3-270m")
