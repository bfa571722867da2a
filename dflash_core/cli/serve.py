"""`dflash serve`: the HTTP server (the only subcommand that imports the server package)."""

from __future__ import annotations

import logging
import os
import sys

from pydantic import ValidationError

from ..settings import ConfigError, ServerSettings
from .args import add_distributed_flag, add_model_flags, distributed_channel, settings_from_args


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="start the OpenAI-compatible server (default model: config.yaml's)")
    add_model_flags(p, what="served first; other configured models stay available")
    p.add_argument("--name", help="model name clients send with --target (default: the target's name)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--api-key", help="require the key (Authorization: Bearer KEY or x-api-key: KEY)")
    p.add_argument("--allow-no-key", action="store_const", const=True, default=None,
                   help="listen on a non-loopback --host without an API key (anyone who can reach it can use it)")
    add_distributed_flag(p)
    p.set_defaults(func=run_serve)


def run_serve(args) -> int:
    from dflash_server.app import create_app
    from dflash_server.process import serve

    settings = settings_from_args(args)
    updates = {k: v for k, v in (("host", args.host), ("port", args.port), ("api_key", args.api_key),
                                 ("allow_no_key", args.allow_no_key)) if v is not None}
    try:  # validated as config.yaml's values are (a port out of range is an error, not a traceback)
        server = ServerSettings.model_validate({**settings.server.model_dump(), **updates})
    except ValidationError as e:
        first = e.errors()[0]
        raise ConfigError(f"--{'-'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
    if not server.loopback:
        if not server.api_key and not server.allow_no_key:
            raise ConfigError(f"refusing to listen on {server.host} without an API key: any machine that reaches it "
                              "could use it. Set --api-key (server.api_key), or --allow-no-key (server.allow_no_key)")
        logging.getLogger("dflash").warning(
            "listening on %s:%d: reachable from other machines, %s", server.host, server.port,
            "API key required" if server.api_key else "WITHOUT an API key (--allow-no-key)")
    # A model named on the command line is what the user wants: no demo standing in for it (nor
    # when distributed: the demo's family does not shard).
    fallback = settings.demo_fallback and not (args.model or args.target or args.distributed)
    settings = settings.model_copy(update={"server": server, "demo_fallback": fallback})
    settings.apply_backend_settings()
    channel = distributed_channel(args)
    if channel is not None and not channel.leader:
        return run_follower(settings, channel)
    serve(create_app(settings, channel), settings.server)
    if channel is not None:
        _exit_group_member(1 if channel.failure else 0)
    return 0


def _exit_group_member(code: int) -> None:
    """Exit with `code` now, past the interpreter's teardown: MLX's ring group, once a peer has
    closed its sockets (a rank gone, or one that finished first after a clean stop), can abort the
    process in its destructor ("terminate called without an active exception", status -6), which
    would hide how this rank ended."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_follower(settings, channel) -> int:
    """A rank other than 0: its share of the default model, each generation and step as rank 0
    announces them, until rank 0 stops (0) or the group breaks (1). No HTTP here."""
    from ..distributed import GroupFailed, follow
    from ..loading import load_configured
    from ..prefix_cache import SnapshotBudget

    log = logging.getLogger("dflash")
    spec = settings.model()
    budget = SnapshotBudget(int(settings.prefix_cache_gb * 1e9))  # as rank 0's pool has it
    loaded = load_configured(spec, settings.prefill_chunk, budget, None, group=channel.group)
    log.info("rank %d of %d: serving %s with rank 0", channel.rank, channel.size, spec.name)
    try:
        follow(loaded.engine, channel)
    except GroupFailed as e:
        log.error("%s", e)
        _exit_group_member(1)
    log.info("rank %d: rank 0 stopped; done", channel.rank)
    _exit_group_member(0)
    return 0
