"""A real uvicorn server on a free loopback port, in a background thread."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

from server.app import create_app


class LiveServer:
    def __init__(self, settings, prepare=None):
        self.app = create_app(settings)
        self.state = self.app.state.dflash
        if prepare is not None:
            prepare(self.state)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # readiness: models load on the worker at start
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("server did not become healthy")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
