"""A real uvicorn server on a free loopback port, in a background thread."""

from __future__ import annotations

import socket
import threading
import time

import httpx

from dflash_server.app import create_app
from dflash_server.process import DrainingServer, uvicorn_config


class RecordRequests:
    """ASGI middleware keeping (method, path, body) of every request, for tests that check what a
    client sent (an agent CLI handing a tool's output back, say), and (method, path, status) of
    every response (a client that retries or falls back after a 400 still finishes)."""

    def __init__(self, app, requests: list, statuses: list):
        self.app, self.requests, self.statuses = app, requests, statuses

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks = []

        async def recording_receive():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.requests.append((scope["method"], scope["path"], b"".join(chunks)))
            return message

        async def recording_send(message):
            if message["type"] == "http.response.start":
                self.statuses.append((scope["method"], scope["path"], message["status"]))
            await send(message)

        await self.app(scope, recording_receive, recording_send)


class LiveServer:
    def __init__(self, settings, prepare=None, ready=lambda health: health.status_code == 200):
        """`ready(response of /health)`: when the server counts as started (by default healthy)."""
        self.ready = ready
        self.app = create_app(settings)
        self.state = self.app.state.dflash
        self.requests: list[tuple[str, str, bytes]] = []  # what clients sent, in order
        self.statuses: list[tuple[str, str, int]] = []  # what they got, in order of answering
        self.app.add_middleware(RecordRequests, requests=self.requests, statuses=self.statuses)
        if prepare is not None:
            prepare(self.state)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(self.app, settings.server, log_level="warning", lifespan="on")
        self.server = DrainingServer(config, self.state, settings.server.shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # readiness: models load on the worker at start
            try:
                health = httpx.get(self.url + "/health", timeout=5)
                if self.ready(health):
                    # The probes were ours, not a client's: a 503 while the models load is no refusal.
                    self.requests.clear()
                    self.statuses.clear()
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("server did not become healthy")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
