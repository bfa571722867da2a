"""The server process: uvicorn with a graceful drain on SIGTERM / Ctrl-C.

At the first signal the server stops taking work (new requests get 503 in their API's shape,
/health says "draining") but keeps its connections, so running requests finish. When they have,
or `server.shutdown_timeout` has passed, what still runs is ended with a 503 error: a stream with
its API's error event (and `[DONE]` for chat completions), a non-streamed request with a 503 body.
Then uvicorn shuts down. A second signal exits at once.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import uvicorn

from dflash_core.settings import ServerSettings

from .serving import ServerState

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, deadline: float):
        super().__init__(config)
        self.state, self.deadline = state, deadline
        self.drained = threading.Event()  # set when the drain handed over to uvicorn's shutdown

    def handle_exit(self, sig, frame) -> None:
        if self.state.draining:  # the second signal: do not wait
            return super().handle_exit(sig, frame)
        self.state.draining = True
        log.warning("shutting down: finishing running requests (up to %g s), new ones get 503", self.deadline)
        threading.Thread(target=self._drain, name="dflash-drain", daemon=True).start()

    def _drain(self) -> None:
        scheduler = self.state.scheduler
        end = time.monotonic() + self.deadline
        while not scheduler.idle and not scheduler.failure and time.monotonic() < end:
            time.sleep(0.05)  # polling a thread-owned queue: a shutdown path, not a hot one
        if not scheduler.idle:
            log.warning("shutdown deadline passed: ending the requests still running")
            scheduler.abort("the server is shutting down")
        # The aborted responses need a moment to be written before connections close.
        self.config.timeout_graceful_shutdown = 5
        self.should_exit = True
        self.drained.set()


def uvicorn_config(app, server: ServerSettings, **options) -> uvicorn.Config:
    """uvicorn's settings for `server` (the tests' live servers use them too)."""
    options = {"log_level": "info", **options}
    return uvicorn.Config(app, host=server.host, port=server.port, timeout_keep_alive=server.keep_alive,
                          timeout_graceful_shutdown=5, **options)


def serve(app, settings: ServerSettings) -> None:
    server = DrainingServer(uvicorn_config(app, settings), app.state.dflash, settings.shutdown_timeout)
    channel = app.state.dflash.channel
    if channel is not None:  # a broken distributed group: fail what runs, then stop as at a signal
        channel.on_failure = lambda reason: stop_on_failure(server, reason)
        channel.watch(app.state.dflash.settings.server.distributed_step_timeout)
    server.run()


def stop_on_failure(server: DrainingServer, reason: str) -> None:
    """The engine cannot go on (distributed group broken): new requests get 503 with `reason`,
    running ones (even one stuck in a forward that waits on a dead rank) end with it, and the
    server shuts down."""
    scheduler = server.state.scheduler
    scheduler.failure = reason
    scheduler.abort(reason)
    server.handle_exit(signal.SIGTERM, None)
