"""The trained agent target answers agent-style prompts with its own forward pass.

Four examples in the spirit of the CLI end-to-end tests: two tasks that ask for a tool call (the
tool named as Codex and Claude Code name theirs) and two prompts after the tool's result. Each is
then asked again behind a long system prompt the model never saw, through the product's loader
and engine, speculative and not: greedy decoding must give exactly the trained response.
"""

import json
import random
import time

import pytest
from agent_model import agent_pair, agent_tokenizer, shared_tail
from synthetic import _WORDS, _corpus

from dflash_core.loading import load_engine

SYSTEM = "You are a coding agent. Use the tools you are given."
NOTE = "hello from the note"
FINAL = f"The note says: {NOTE}."


def _call(tool: str) -> str:
    args = {"cmd": "cat note.txt"} if tool == "exec_command" else {"command": "cat note.txt"}
    return "<tool_call>\n" + json.dumps({"name": tool, "arguments": args}) + "\n</tool_call>"


def _conversations():
    """(messages after the system prompt, response text) per example."""
    out = []
    for tool in ("exec_command", "Bash"):
        task = {"role": "user", "content": f"Use the tool {tool} to read note.txt"}
        out.append(([task], _call(tool)))
        result = {"role": "user", "content": f"<tool_response>\n{NOTE}\n</tool_response>"}
        out.append(([task, {"role": "assistant", "content": _call(tool)}, result], FINAL))
    return out


def _encode(tok, system: str, messages) -> list[int]:
    # The template writes <bos> itself; encode() would prepend a second one.
    text = tok.apply_chat_template([{"role": "system", "content": system}, *messages],
                                   tokenize=False, add_generation_prompt=True)
    return list(tok.encode(text, add_special_tokens=False))


def _long_system(tok, tokens: int, seed: int) -> str:
    """A system prompt of at least `tokens` tokens of text the model was not trained on."""
    rng = random.Random(seed)
    lines = _corpus(seed=seed, lines=400)
    parts = []
    while len(tok.encode("\n".join(parts), add_special_tokens=False)) < tokens:
        parts += [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30))).capitalize() + "."
                  for _ in range(20)]
        parts += rng.sample(lines, 20)
    return "\n".join(parts)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent")
    tok = agent_tokenizer(root / "tok")
    end = "<end_of_turn>"
    examples = []
    for messages, response in _conversations():
        prompt = _encode(tok, SYSTEM, messages)
        # What follows the system prompt decides the response: kept verbatim in training.
        tail = shared_tail(prompt, _encode(tok, "Other words here.", messages))
        examples.append((prompt, tok.encode(response + end, add_special_tokens=False), tail))
    started = time.perf_counter()
    target, drafter = agent_pair(root, examples)
    print(f"trained in {time.perf_counter() - started:.1f} s")
    return tok, examples, target, drafter


@pytest.mark.slow  # trains a model first (about 15 s on 2 cores, with MKL)
@pytest.mark.parametrize("speculative", [True, False])
def test_long_unseen_prefix_gives_the_trained_response(trained, speculative):
    tok, examples, target, drafter = trained
    engine = load_engine(str(target), str(drafter), max_context=131072, prefill_chunk=256)
    system = _long_system(tok, 5000, seed=77)
    for (messages, _), (_, response, _) in zip(_conversations(), examples):
        prompt = _encode(tok, system, messages)
        assert len(prompt) > 5000
        out, stop = [], None
        for chunk in engine.generate(prompt, max_tokens=len(response) + 8, speculative=speculative):
            out += chunk.token_ids
            stop = chunk.stop_token_id if chunk.finish_reason else stop
            if chunk.finish_reason:
                assert chunk.stats.speculative is speculative
        # The end-of-turn token stops generation and is reported apart from the tokens.
        assert out + [stop] == response, tok.decode(out)
