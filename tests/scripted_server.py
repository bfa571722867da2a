"""A live server whose models have real tokenizers and chat templates but scripted engines
(`scripted.py`): the output parsers, the API surfaces and the SSE path run as with real models,
on output the test chooses."""

from __future__ import annotations

from dataclasses import replace

from live_server import LiveServer
from scripted import scripted_engine

from dflash_core.settings import ModelSettings, Settings
from dflash_server.models import load_served


def scripted_server(pairs: dict, settings: Settings | None = None) -> LiveServer:
    """`pairs`: model name -> (target_dir, drafter_dir) whose tokenizer and template to use."""

    def prepare(state):
        for name, pair in pairs.items():
            real = load_served(ModelSettings(name=name, target=str(pair[0]), drafter=None), 2048)
            loaded = replace(real.loaded, engine=scripted_engine(real.engine.tokenizer), generation_defaults={})
            state.pool.add(replace(real, loaded=loaded))

    return LiveServer(settings or Settings(models=[]), prepare=prepare)


def script(server: LiveServer, name: str, text: str) -> list[int]:
    """Make model `name` answer every prompt with `text` (then end of sequence)."""
    engine = server.state.pool._served[name].engine
    engine.target.script = engine.tokenizer._tokenizer.encode(text, add_special_tokens=False)
    return engine.target.script
