"""What the benchmarks that drive a real server share: a free port and a `dflash serve` process."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(config: dict, workdir: Path, name: str, timeout: float = 600):
    """`dflash serve` with `config` (config.yaml's keys; the port is chosen here) as a process;
    (process, base URL) once /health answers 200. Its log is workdir/server-{name}.log."""
    port = free_port()
    path = workdir / f"config-{name}.yaml"
    path.write_text(yaml.safe_dump({**config, "server": {**config.get("server", {}), "port": port}}))
    log = open(workdir / f"server-{name}.log", "w")
    process = subprocess.Popen([sys.executable, "-m", "dflash_core.launch", "serve", "--config", str(path)],
                               stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("server did not become healthy")
