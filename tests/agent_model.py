"""A tiny Gemma 3 target trained to answer given prompts with given responses.

End-to-end tests of real agent CLIs (Codex, Claude Code, opencode) need a model whose own forward
pass emits a tool call for the CLI's prompt: no mock sits between the server and the weights. The
CLIs send 25k-55k tokens (with the 512-token tokenizer), so the model must prefill fast on a CPU
and must not care what those tokens are. Hence: gemma3_text, 2 layers, EVERY layer sliding-window
attention (window 64). mlx-lm's gemma3_text makes layer i global when
`(i + 1) % sliding_window_pattern == 0`, so a pattern larger than the layer count (6 for 2 layers)
leaves none global; the product's Gemma3Adapter decides the same way.

What the model sees: a layer's output at position p depends on its input at p-63..p, so after 2
layers the next-token logits depend on the LAST 2*63+1 = 127 TOKENS ONLY (`RECEPTIVE`; not 64: the
windows of the two layers add up), whatever comes before. Training therefore runs on exactly the
last 127 tokens of each prompt plus its response, and teaches robustness to the unseen long text
the CLIs put before the decisive part by replacing everything before each prompt's last `tail`
tokens with random filler windows, fresh every step.

Usage:
    tok = agent_tokenizer(tmp / "tok")            # the tokenizer the target will have
    prompt = tok.encode(rendered, add_special_tokens=False)   # encode() alone prepends <bos>
    target, drafter = agent_pair(tmp, [(prompt, response_ids, tail), ...])
    engine = load_engine(str(target), str(drafter), max_context=131072, prefill_chunk=256)

Both directories are in the Hugging Face layouts the product loads. The drafter has random
weights: speculation stays lossless, it only accepts little.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx_lm.utils import load_model, load_tokenizer, save_model
from synthetic import _WORDS, _corpus, build_drafter, build_target, train_tokenizer

from dflash_core.blas import candidates

WINDOW = 64
LAYERS = 2
RECEPTIVE = LAYERS * (WINDOW - 1) + 1  # prompt tokens that can influence the next token
CONTEXT = RECEPTIVE  # prompt tokens per training sequence: exactly what the model can see
SHAPE = dict(
    num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=256, num_attention_heads=8,
    num_key_value_heads=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
    sliding_window_pattern=6,  # > LAYERS: no global layer (see the module docstring)
    max_position_embeddings=262144,
)

# (prompt tokens, response tokens ending with the end of turn[, tail]): see train_agent_target.
Example = Union[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int], int]]


def agent_tokenizer(out_dir):
    """The tokenizer (mlx-lm's wrapper) that build_target gives the target: training it is
    deterministic, so callers can encode their examples before the target exists."""
    return load_tokenizer(train_tokenizer(out_dir, "gemma3_text"))


def shared_tail(*prompts: Sequence[int]) -> int:
    """Length of the token suffix the prompts share: rendered with two different system
    prompts (or histories), it is the decisive tail that training keeps verbatim."""
    n = 0
    while n < min(map(len, prompts)) and len({tuple(p[len(p) - n - 1:]) for p in prompts}) == 1:
        n += 1
    return n


def agent_pair(root, examples: Sequence[Example], **kw) -> tuple[Path, Path]:
    """train_agent_target under root/"target" (in a process with the fast BLAS, where this machine
    has one) and a random drafter for it under root/"drafter"."""
    root = Path(root)
    target = train_with_fast_blas(root / "target", examples, **kw)
    return target, build_drafter(root / "drafter", target)


def train_with_fast_blas(out_dir, examples: Sequence[Example], **kw) -> Path:
    """train_agent_target in a child process that loads the fast BLAS (MKL) before MLX, as `dflash`
    does (dflash_core/blas.py); in this process where there is none. The suite's own processes keep
    MLX's reference BLAS, on which training spends about a second a step; with MKL a few
    hundredths. What it trains is checked the same way either way (the margin, then each caller's
    own check through the engine), so where the two BLAS round differently nothing depends on it.
    `kw` must be JSON (no `log`: the child prints, and a failure's output is in the error)."""
    if not candidates():
        return train_agent_target(out_dir, examples, **kw)
    out_dir = Path(out_dir)
    _in_fast_blas_child("_train_job", out_dir.parent / f"{out_dir.name}.job.json", {
        "out_dir": str(out_dir), "examples": [list(map(list, e[:2])) + list(e[2:]) for e in examples], "kw": kw})
    return out_dir


def _train_job(job: dict) -> None:
    examples = [tuple(e) for e in job["examples"]]
    train_agent_target(job["out_dir"], examples, **job["kw"])


def greedy_misses(pair, asked: Sequence[tuple[Sequence[int], Sequence[int]]], **engine_kw) -> list[int]:
    """Which of `asked` (prompt, response) the product's engine on `pair` does not answer with exactly
    the response (greedy, speculating, as many tokens as the response, its end of turn included),
    as indices; run in a child with the fast BLAS, as `dflash serve` runs, where there is one. The
    prompts of an agent CLI run to tens of thousands of tokens: there they prefill about 4x faster."""
    job = {"pair": list(map(str, pair)), "asked": [[list(p), list(r)] for p, r in asked], "engine_kw": engine_kw}
    if not candidates():
        return _misses_job(job)
    out = Path(pair[0]).parent / "misses.json"
    _in_fast_blas_child("_misses_job", out.with_suffix(".job.json"), {**job, "out": str(out)})
    return json.loads(out.read_text())


def _misses_job(job: dict) -> list[int]:
    from dflash_core.loading import load_engine

    engine = load_engine(*job["pair"], **job["engine_kw"])
    misses = []
    for i, (prompt, response) in enumerate(job["asked"]):
        out, stop = [], None
        for chunk in engine.generate(prompt, max_tokens=len(response)):
            out += chunk.token_ids
            stop = chunk.stop_token_id if chunk.finish_reason else stop
        if out + ([stop] if stop is not None else []) != response:
            misses.append(i)
    if "out" in job:
        Path(job["out"]).write_text(json.dumps(misses))
    return misses


def _in_fast_blas_child(function: str, job_file: Path, job: dict) -> None:
    """agent_model.<function>(job) in a child process that loads the fast BLAS before MLX."""
    job_file.write_text(json.dumps(job))
    here = Path(__file__).resolve().parent
    child = ("import json, sys; from dflash_core.blas import preload; preload(); import agent_model; "
             f"agent_model.{function}(json.loads(open(sys.argv[1]).read()))")
    path = [str(here), str(here.parent), os.environ.get("PYTHONPATH")]  # (an empty entry would add the cwd)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    done = subprocess.run([sys.executable, "-c", child, str(job_file)], env=env, capture_output=True, text=True)
    print(done.stdout, end="")
    if done.returncode != 0:
        raise RuntimeError(f"{function} with the fast BLAS failed:\n{(done.stdout + done.stderr)[-4000:]}")


def train_agent_target(out_dir, examples: Sequence[Example], *, tail: Optional[int] = None,
                       filler: Optional[Sequence[int]] = None, steps: int = 400, batch: int = 8,
                       lr: float = 5e-3, margin: float = 2.0, passes: int = 3, min_steps: int = 0, hard: int = 50, seed: int = 0,
                       shape: Optional[dict] = None, log=print) -> Path:
    """Build the target and train it until greedy decoding after every example's prompt gives
    exactly its response (the response should end with the end-of-turn token).

    Each example is (prompt, response) or (prompt, response, tail). `tail`: how many final prompt
    tokens decide the response (the example's own, else the keyword; None: the whole prompt);
    in most training copies they are kept verbatim after random filler, in the others the prompt's
    own preceding tokens stay. Only the last RECEPTIVE prompt tokens matter to the model anyway. `filler`: token ids to cut the
    filler windows from (default: synthetic corpus text rendered as chat turns). Training stops
    when every example, with its own context and with fresh filler, near position 0 and far into
    the context, has the right argmax at every response position by at least `margin` logits;
    RuntimeError after `steps` steps otherwise.
    """
    started = time.perf_counter()
    out = build_target(out_dir, "gemma3_text", shape={**SHAPE, **(shape or {})}, seed=seed)
    model, _ = load_model(out)
    rng = random.Random(seed)
    pool = list(filler) if filler is not None else default_filler(load_tokenizer(out), seed)
    if len(pool) < CONTEXT:
        raise ValueError(f"filler has {len(pool)} tokens, needs at least {CONTEXT}")
    examples = [(list(e[0]), list(e[1]), e[2] if len(e) > 2 else tail) for e in examples]
    pool += _echoes(examples, rng, len(pool) * hard // 100)
    width = CONTEXT + max(len(e[1]) for e in examples)  # one padded length for every batch

    optimizer = optim.AdamW(learning_rate=lr, weight_decay=0.0)
    loss_and_grad = nn.value_and_grad(model, _loss)
    # Consecutive batches (fresh filler, scored before their update: a free held-out test)
    # whose every response token has the margin, about `passes` per example, before stopping.
    patience, streak = max(4, -(-passes * len(examples) // batch)), 0
    queue: list[int] = []
    for step in range(1, steps + 1):
        if len(queue) < batch:  # every example equally often
            queue += rng.sample(range(len(examples)), len(examples)) * -(-batch // len(examples))
        picked, queue = queue[:batch], queue[batch:]
        rows = [_sequence(examples[i], rng.random() < 0.7, pool, rng) for i in picked]
        # Random absolute positions: the CLIs' prompts put the response tens of thousands of
        # tokens in, where RoPE's float32 angles round differently than near position 0.
        (loss, worst), grads = loss_and_grad(model, *_tensors(rows, width), rng.randrange(60000))
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state, loss, worst)
        streak = streak + 1 if worst.item() >= margin else 0
        if streak >= patience and step >= min_steps:
            if _reproduces(model, examples, pool, rng, width, margin):
                break
            streak = 0
    else:
        raise RuntimeError(f"{len(examples)} examples not reproduced after {steps} steps "
                           f"(loss {loss.item():.4f}): raise steps or the model's size")
    log(f"agent target: {len(examples)} examples reproduced after {step} steps, "
        f"{time.perf_counter() - started:.1f} s (loss {loss.item():.4f})")
    save_model(out, model)  # same file names build_target wrote: load_engine reads them as before
    return out


def default_filler(tokenizer, seed: int = 0, turns: int = 120) -> list[int]:
    """Random text of the kinds agent prompts are made of (prose, markdown, JSON tool schemas,
    the synthetic corpus' code, numbers and multi-byte text) as alternating chat turns, so the
    filler also holds the turn markup that the CLIs' long histories are full of."""
    rng = random.Random(seed + 1)
    corpus = _corpus(seed=rng.randrange(1 << 30), lines=4 * turns)

    def words(k):
        return " ".join(rng.choice(_WORDS) for _ in range(k))

    kinds = [
        lambda: "\n".join(words(rng.randint(5, 25)).capitalize() + "." for _ in range(4)),
        lambda: "\n".join(f"## {words(2).title()}\n- {words(8)}\n- `{words(1)}`" for _ in range(3)),
        lambda: json.dumps({"type": "function", "function": {
            "name": "_".join(rng.sample(_WORDS, 2)), "description": words(12),
            "parameters": {"type": "object", "properties": {w: {"type": "string"} for w in rng.sample(_WORDS, 2)}}}},
            indent=rng.choice([None, 2])),
        lambda: "\n".join(rng.sample(corpus, 4)),
    ]
    messages = [{"role": ("user", "assistant")[i % 2], "content": rng.choice(kinds)()}
                for i in range(turns)]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))[1:]  # without the leading <bos>


def _echoes(examples, rng: random.Random, n: int) -> list[int]:
    """About n tokens of the examples' own prompt ends and responses in random order: as filler
    they teach the model that only the LAST occurrence counts (a CLI's history repeats them)."""
    out: list[int] = []
    while len(out) < n:
        prompt, response, _ = rng.choice(examples)
        out += prompt[-rng.randrange(1, CONTEXT):] + response[:rng.randrange(1, len(response) + 1)]
    return out


def _sequence(example, fill: bool, pool: list[int], rng: random.Random) -> list[int]:
    """CONTEXT prompt tokens then the response: the prompt's end (fill: only its tail) after a
    random window of filler."""
    prompt, response, tail = example
    keep = min(tail if fill and tail is not None else len(prompt), CONTEXT)
    need = CONTEXT - keep
    start = rng.randrange(len(pool) - need + 1)
    return pool[start:start + need] + prompt[len(prompt) - keep:] + response


def _tensors(rows: list[list[int]], width: int):
    """inputs/targets [N, width-1] and weights marking the response positions."""
    inputs, targets, weights = [], [], []
    for seq in rows:
        pad = width - len(seq)  # after the response: causal, so it changes nothing before it
        inputs.append(seq[:-1] + [0] * pad)
        targets.append(seq[1:] + [0] * pad)
        # Position CONTEXT-1 (the last prompt token) predicts the first response token.
        weights.append([0.0] * (CONTEXT - 1) + [1.0] * (len(seq) - CONTEXT) + [0.0] * pad)
    return mx.array(inputs), mx.array(targets), mx.array(weights)


class _At:
    """Stands in for a KV cache so mlx-lm's attention applies RoPE from position `offset`."""

    def __init__(self, offset: int):
        self.offset = offset

    def update_and_fetch(self, keys, values):
        return keys, values


def _logits(model, inputs: mx.array, offset: int) -> mx.array:
    """The gemma3_text forward as mlx-lm and Gemma3Adapter run it (embedding scaled by sqrt(H)
    rounded to bfloat16, sliding-window mask on every layer), logits from the last prompt
    position on. mlx-lm's own Model.__call__ cannot be used: it reads cache[pattern - 1]."""
    inner = model.model
    h = inner.embed_tokens(inputs)
    h = h * mx.array(inner.args.hidden_size ** 0.5, mx.bfloat16).astype(h.dtype)
    window, n = inner.window_size, len(inner.layers)
    start = 0
    for i, layer in enumerate(inner.layers):
        # The CPU's matmul is slow: skip the positions no response logit depends on. Layer i's
        # outputs are needed from CONTEXT-1 - (n-1-i)*(window-1) on, its inputs one window before.
        first = max(0, CONTEXT - 1 - (n - i) * (window - 1))
        h, start = h[:, first - start:], first
        pos = mx.arange(h.shape[1])
        mask = (pos[None] <= pos[:, None]) & (pos[:, None] - pos[None] < window)
        h = layer(h, mask, _At(offset + start))
    return model.lm_head(inner.norm(h[:, CONTEXT - 1 - start:]))


def _margins(logits: mx.array, targets: mx.array) -> mx.array:
    """The right token's logit minus the best other one (> 0: greedy picks the right token)."""
    right = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    others = mx.where(mx.arange(logits.shape[-1]) == targets[..., None], -mx.inf, logits)
    return right - others.max(-1)


def _loss(model, inputs, targets, weights, offset):
    """(cross-entropy over the response tokens, the worst margin among them)."""
    logits = _logits(model, inputs, offset)
    t, w = targets[:, CONTEXT - 1:], weights[:, CONTEXT - 1:]
    loss = (nn.losses.cross_entropy(logits, t) * w).sum() / w.sum()
    worst = mx.where(w > 0, mx.stop_gradient(_margins(logits, t)), mx.inf).min()
    return loss, worst


def _reproduces(model, examples, pool, rng, width, margin) -> bool:
    """Teacher-forced argmax right at every response position (what greedy decoding then
    follows) by `margin` logits: every example with its own context and with fresh filler,
    near position 0 and tens of thousands of tokens in."""
    rows = [_sequence(e, fill, pool, rng) for e in examples for fill in (False, True)]
    inputs, targets, weights = _tensors(rows, width)
    for offset in (0, 50000):
        logits = _logits(model, inputs, offset)
        ok = mx.where(weights[:, CONTEXT - 1:] > 0,
                      _margins(logits, targets[:, CONTEXT - 1:]) >= margin, True)
        if not mx.all(ok).item():
            return False
    return True
