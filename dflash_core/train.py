"""`dflash train`: distil a DFlash drafter for any target the engine supports, in MLX.

The recipe of the DFlash paper (arXiv 2602.06036; docs/train.md): the target regenerates responses to the training
prompts greedily, so the drafter learns the target's own choices. Each training sequence gives
blocks anchored at sampled response positions: the block input is the anchor token followed by
B-1 mask tokens, the context is the target's tapped hidden states of every position before the
anchor, and the loss is cross-entropy on block rows 1..B-1 against the tokens the target produced
there, weighted by exp(-(j-1)/gamma) so that early rows (which gate acceptance) count most. Only
the drafter trains: the target's embedding and LM head are used frozen. AdamW with linear warm-up
and cosine decay. The result is saved in the z-lab checkpoint format the normal loader serves.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from .draft_vocab import DRAFT_VOCAB_FILE, most_frequent, write_draft_vocab
from .drafter import DFlashDrafter, load_drafter, read_drafter_config
from .drafter_config import DrafterConfig, default_target_layer_ids
from .engine import Engine
from .hub import DRAFTER_FILES, TARGET_FILES, resolve
from .kernels import KernelOptions
from .loading import load_target
from .prompts import hf_tokenizer
from .train_data import data_report, read_prompt_records, regenerate, split_sequences
from .train_taps import TapCache, padded_tokens, target_taps

log = logging.getLogger(__name__)


@dataclass
class TrainOptions:
    target: str
    data: Path
    out: Path
    # The drafter's shape (ARCHITECTURE below): None where not given, a new drafter's defaults
    # then (`with_new_drafter_defaults`), the drafter's own with `init_from`.
    layers: Optional[int] = None  # 1
    block_size: Optional[int] = None  # 16
    taps: Optional[list[int]] = None
    steps: int = 1000
    minutes: Optional[float] = None  # training time budget: the run ends at `steps` or here, whichever first
    batch: int = 4  # sequences per optimizer step
    anchors: int = 8  # blocks per sequence
    lr: float = 6e-4
    warmup: int = 50
    weight_decay: float = 0.01
    gamma: float = 7.0  # loss weight decay over block positions
    max_new_tokens: int = 128
    generation_batch: int = 16  # target responses generated together (continuous batching)
    # Whose batching generates them: "engine" (batching.py) or "mlx-lm" (its BatchGenerator, one
    # batched cache a step: far less host work a row at the hundreds of rows a GPU takes).
    generator: str = "engine"
    max_prompt_tokens: int = 384  # longer prompts keep their first quarter and their end
    chat: bool = True
    held_out: float = 0.1  # share of prompts held out when the data does not say which (corpus.py does)
    samples_per_prompt: int = 1  # the greedy response, then sampled ones
    sample_temperature: float = 0.8
    shard_prompts: int = 256  # prompts per resumable shard of the data generation
    # Time budget of this run's data generation: no shard starts after it (one always runs where
    # there is no data yet; 0: none runs), the run trains on the prompts done, and a later run into
    # the same `out` continues where it stopped.
    generation_minutes: Optional[float] = None
    # Make (or continue) the data and stop, no drafter trained: a machine's session can go to the
    # data alone, which a later run into the same `out` (with the same prompts) trains on.
    generate_only: bool = False
    eval_every: int = 100
    save_every: int = 200
    seed: int = 0
    intermediate_size: Optional[int] = None
    heads: Optional[int] = None
    kv_heads: Optional[int] = None
    head_dim: Optional[int] = None  # 128
    mask_token_id: Optional[int] = None
    resume: bool = False
    # "full": softmax over the whole vocabulary (the recipe). "data": over the tokens the target
    # produced in the training responses only, a cheaper approximation for machines where the LM
    # head's full softmax is the cost (a CPU and a 262k vocabulary); acceptance is always
    # estimated with the full vocabulary.
    loss_vocab: str = "full"
    # The dtype of the loss's LM-head product: "target" (the head's own) or "bfloat16". With a
    # float32 target on a GPU the full-vocabulary head is most of a step's work (a 262k x 640 head,
    # 4096 block rows: ~2.7 TFLOP forward and backward in float32 without tensor cores); in
    # bfloat16 it runs on them. The logits are upcast before the softmax; acceptance is estimated
    # with the target's own head either way.
    head_dtype: str = "target"
    tap_cache_gb: float = 4.0  # target taps kept across steps
    # The dtype the target is loaded in for training, after the data is made by the target as
    # stored: "target" (as stored) or "bfloat16"/"float16". A float32 target's forwards for the taps
    # of sequences not in the tap cache were half a step on a GPU (no tensor cores); the drafter
    # then learns from the hidden states of the target cast as it would be served in that dtype.
    target_dtype: str = "target"
    # A DFlash drafter (directory or hub id) to start from instead of a new one: its architecture,
    # taps, block size and mask token are kept, its weights are trained further (a new optimizer and
    # schedule). The shipped demo drafter continued on new data; a released drafter adapted to a
    # fine-tuned target or a domain.
    init_from: Optional[str] = None
    save_dtype: Optional[str] = None  # the drafter's weights on disk (default: the target's dtype)
    # Write a draft vocabulary (draft_vocab.py) of the N tokens most frequent in the training
    # responses: drafts over those columns of the head alone, cheaper where a draft's head is its
    # cost (a CPU, a large vocabulary). Acceptance is then estimated as served, over them. 0: none.
    draft_vocab: int = 0

    def with_new_drafter_defaults(self) -> "TrainOptions":
        return replace(self, layers=self.layers or 1, block_size=self.block_size or 16, head_dim=self.head_dim or 128)


# ----------------------------------------------------------------------- the model


def training_kernels(target) -> KernelOptions:
    """The target's kernel options for a drafter being trained: its blocks' attention never in the
    exact CUDA kernel (`drafter_exact_attention`), which has no gradient, but in MLX's ops."""
    return replace(target.kernels, drafter_exact_attention=False)


def new_drafter(target, tokenizer, opts: TrainOptions) -> DFlashDrafter:
    opts = opts.with_new_drafter_defaults()
    H, n = target.hidden_size, target.num_layers
    # z-lab's spread; on a target of a few layers it repeats ids, which would only duplicate inputs.
    taps = opts.taps or sorted(set(default_target_layer_ids(n, min(n - 1, max(3, opts.layers)))))
    if any(not 0 <= t < n for t in taps) or len(set(taps)) != len(taps):
        raise ValueError(f"--taps {taps}: distinct target layer ids in [0, {n}) expected")
    mask = opts.mask_token_id
    if mask is not None and not 0 <= mask < target.vocab_size:
        raise ValueError(f"--mask-token-id {mask}: outside the target's vocabulary of {target.vocab_size}")
    if mask is None:
        vocab = hf_tokenizer(tokenizer).get_vocab()
        mask = next((vocab[t] for t in ("<mask>", "<|mask|>") if t in vocab), None)
        if mask is None:
            raise ValueError("the tokenizer has no <mask> token: pass --mask-token-id")
    heads = opts.heads or max(1, H // opts.head_dim)
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": H,
        "num_hidden_layers": opts.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": opts.kv_heads or max(1, heads // 4),
        "head_dim": opts.head_dim,
        "intermediate_size": opts.intermediate_size or 2 * H,
        "vocab_size": target.vocab_size,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "num_target_layers": n,
        "layer_types": ["full_attention"] * opts.layers,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "dflash_config": {"block_size": opts.block_size, "target_layer_ids": taps, "mask_token_id": int(mask)},
    }
    drafter = DFlashDrafter(DrafterConfig.from_dict(raw), training_kernels(target))
    drafter.config.raw = raw  # written out as config.json
    mx.eval(drafter.parameters())
    return drafter


ARCHITECTURE = ("layers", "block_size", "taps", "heads", "kv_heads", "head_dim", "intermediate_size", "mask_token_id")


def drafter_to_continue(target, opts: TrainOptions) -> tuple[Path, TrainOptions]:
    """`opts.init_from` resolved and checked against the target before any data is generated (a
    wrong drafter is one clear error, not one after the generation's minutes), and `opts` with the
    drafter's shape, which the run keeps (`train` refuses an option that sets a shape beside it)."""
    path = resolve(opts.init_from, files=DRAFTER_FILES)
    _, cfg = read_drafter_config(path)
    cfg.check_target(str(path / "config.json"), hidden_size=target.hidden_size, num_layers=target.num_layers,
                     vocab_size=target.vocab_size)
    return path, replace(opts, layers=cfg.num_hidden_layers, block_size=cfg.block_size,
                         taps=list(cfg.target_layer_ids), heads=cfg.num_attention_heads,
                         kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                         intermediate_size=cfg.intermediate_size, mask_token_id=cfg.mask_token_id)


def initial_drafter(target, path: Path) -> DFlashDrafter:
    """The drafter in `path` (z-lab format, checked by `drafter_to_continue`) to train further, in
    float32 (the shipped ones are bf16; AdamW's small updates would round away)."""
    drafter = load_drafter(path, dtype=mx.float32, kernels=training_kernels(target))
    raw, _ = read_drafter_config(path)
    for key in ("torch_dtype", "dtype"):  # the weights are written in --save-dtype or the target's
        raw.pop(key, None)
    drafter.config.raw = raw  # written out again as config.json
    drafter.train()
    return drafter


def block_logits(drafter: DFlashDrafter, target, taps: mx.array, tokens: mx.array, anchors: mx.array,
                 lm_head=None, sequence: Optional[mx.array] = None) -> mx.array:
    """Logits [K, B-1, V] of K blocks anchored at `anchors`, each seeing the context before it.

    The same layers as inference, batched over blocks: the context K/V of every position is
    projected once, and a mask gives block k the positions before its anchor. Several sequences
    train together as a batch, `taps` [N, S, D] and `tokens` [N, S] padded at their ends, block k
    in sequence `sequence[k]`: it attends to its own sequence's context only (its padding lies
    past every anchor, so the mask hides it)."""
    cfg = drafter.config
    B, S, K = cfg.block_size, taps.shape[1], anchors.shape[0]
    context = drafter.hidden_norm(drafter.fc(taps))
    first = tokens[anchors] if sequence is None else tokens[sequence, anchors]
    block = mx.concatenate([first[:, None], mx.full((K, B - 1), cfg.mask_token_id, mx.int32)], axis=1)
    h = target.embed(block)
    if cfg.input_embedding_scale != 1.0:
        h = h * cfg.input_embedding_scale
    q_pos = anchors[:, None] + mx.arange(B)[None]  # [K, B]
    key_pos = mx.concatenate([mx.broadcast_to(mx.arange(S)[None], (K, S)), q_pos], axis=1)  # [K, S+B]
    before_anchor = mx.concatenate([mx.arange(S)[None] < anchors[:, None], mx.ones((K, B), mx.bool_)], axis=1)
    for i, layer in enumerate(drafter.layers):
        k, v = layer.self_attn.keys_values(context, 0, drafter.kernels)
        if sequence is None:
            k, v = (mx.broadcast_to(x, (K,) + x.shape[1:]) for x in (k, v))
        else:
            k, v = k[sequence], v[sequence]
        mask = before_anchor[:, None, :]
        if cfg.is_causal(i):
            mask = mask & (key_pos[:, None, :] <= q_pos[:, :, None])
        if cfg.is_sliding(i):
            mask = mask & (mx.abs(q_pos[:, :, None] - key_pos[:, None, :]) < cfg.sliding_window)
        h = layer(h, (k, v), anchors, mask[:, None], drafter.kernels)
    return drafter.logits(drafter.norm(h)[:, 1:], lm_head or target.lm_head)


HEAD_DTYPES = ("target", "bfloat16")
TARGET_DTYPES = ("target", "bfloat16", "float16")


def loss_lm_head(target, token_ids: Optional[mx.array] = None, dtype: Optional[mx.Dtype] = None):
    """The LM head of the training loss, hidden -> logits: over the whole vocabulary or over
    `token_ids` alone (--loss-vocab data), its product in `dtype` (--head-dtype; None: the target's
    own). None where that is the target's own head, unchanged: the whole vocabulary in the head's
    dtype, or a quantized head (its product stays MLX's quantized one)."""
    head = getattr(target.text_model, "lm_head", None)
    untied = head is not None and hasattr(head, "weight") and not target.tied_head()
    source = head if untied else target.inner.embed_tokens  # tied: the embedding rows are the output matrix
    quantized = hasattr(source, "scales")
    if token_ids is None:
        if quantized or dtype is None or source.weight.dtype == dtype:
            return None
        rows = source.weight
    elif quantized and untied:  # the head's own rows, dequantized (the embedding is another matrix)
        biases = head.biases[token_ids] if "biases" in head else None
        rows = mx.dequantize(head.weight[token_ids], head.scales[token_ids], biases, group_size=head.group_size,
                             bits=head.bits, mode=getattr(head, "mode", "affine"))
    else:
        rows = head.weight[token_ids] if untied else source(token_ids)
    rows = mx.stop_gradient(rows if dtype is None else rows.astype(dtype))
    if dtype is None:
        return lambda hidden: hidden @ rows.T
    return lambda hidden: hidden.astype(dtype) @ rows.T


def block_labels(tokens: mx.array, anchors: mx.array, block: int) -> mx.array:
    """The target's tokens at anchor + 1 .. anchor + B - 1, -1 past the end."""
    positions = anchors[:, None] + mx.arange(1, block)[None]
    valid = positions < tokens.shape[0]
    return mx.where(valid, tokens[mx.minimum(positions, tokens.shape[0] - 1)], -1)


def position_weights(block: int, gamma: float) -> mx.array:
    return mx.exp(-mx.arange(block - 1, dtype=mx.float32) / gamma)


def sample_anchors(rng: random.Random, sequence: dict, count: int) -> Optional[mx.array]:
    first, last = sequence["response_start"], len(sequence["tokens"]) - 2
    if last < first:
        return None
    return mx.array(sorted(rng.sample(range(first, last + 1), min(count, last - first + 1))), dtype=mx.int32)


def batch_of(pieces: list[tuple[list[int], mx.array, mx.array]], block: int) -> tuple[mx.array, ...]:
    """Sequences (token ids, taps [1, S_i, D], anchors [K_i]) as one training batch for
    `block_logits`: taps [N, S, D] and tokens [N, S] padded to the longest, every anchor, each
    block's sequence, and each block's labels (`block_labels`, per sequence)."""
    tokens = padded_tokens([t for t, _, _ in pieces])
    longest = tokens.shape[1]
    taps = mx.concatenate([mx.pad(x, [(0, 0), (0, longest - x.shape[1]), (0, 0)]) for _, x, _ in pieces])
    anchors = mx.concatenate([a for _, _, a in pieces])
    sequence = mx.concatenate([mx.full(a.shape, i, mx.int32) for i, (_, _, a) in enumerate(pieces)])
    labels = mx.concatenate([block_labels(mx.array(t, dtype=mx.int32), a, block) for t, _, a in pieces])
    return taps, tokens, anchors, sequence, labels


def acceptance_walk(drafter, target, sequences, rng: random.Random, max_sequences: int = 32,
                    batch: int = 16, draft_vocab: Optional[mx.array] = None) -> tuple[float, list[float]]:
    """Tokens per cycle the drafter reaches on these sequences (greedy, always-on) as the engine
    walks them, and its acceptance by block position 1..B-1. From the response's first token, each
    cycle accepts the leading drafts equal to the target's tokens and starts again after them, the
    target's own token counted. A position's acceptance is the engine's `acceptance_by_position`
    at full width: the share of all cycles in which its draft was accepted (a cycle near a
    sequence's end counts, as the engine counts one cut by max_tokens). Up to `max_sequences`
    sequences, drawn by `rng`. With `draft_vocab`, drafts are chosen among those tokens, as served.

    The engine's figure is tokens over cycles, so a stretch it drafts well costs few cycles and a
    hard one many: an average of the accepted length over positions drawn at random counts every
    position once and overstates it wherever acceptance varies (half the positions accepting 15
    drafts and half none: 8.5 over positions against 1.9 walked)."""
    picked = [s for s in sequences if len(s["tokens"]) - s["response_start"] >= 2]
    picked = rng.sample(picked, min(max_sequences, len(picked)))
    tokens = cycles = 0
    accepted_at = mx.zeros((drafter.config.block_size - 1,), mx.int32)
    for first in range(0, len(picked), batch):
        group = picked[first : first + batch]
        taps = target_taps(target, [s["tokens"] for s in group], drafter.config.target_layer_ids)
        at = [s["response_start"] for s in group]  # each sequence's next cycle starts at this token
        live = list(range(len(group)))
        while live:  # one cycle of every sequence still walking, batched
            pieces = [(group[i]["tokens"], taps[i], mx.array([at[i]], dtype=mx.int32)) for i in live]
            x, ids, anchors, sequence, labels = batch_of(pieces, drafter.config.block_size)
            logits = block_logits(drafter, target, x, ids, anchors, sequence=sequence)
            if draft_vocab is None:
                proposals = mx.argmax(logits, axis=-1)
            else:
                proposals = draft_vocab[mx.argmax(mx.take(logits, draft_vocab, axis=-1), axis=-1)]
            leading = mx.cumprod((proposals == labels).astype(mx.int32), axis=1)  # [blocks, B-1]
            accepted_at = accepted_at + leading.sum(axis=0)
            accepted = leading.sum(axis=1).tolist()
            for i, n in zip(live, accepted):
                committed = min(n + 1, len(group[i]["tokens"]) - 1 - at[i])  # the last may run past the end
                tokens, cycles, at[i] = tokens + committed, cycles + 1, at[i] + committed
            live = [i for i in live if at[i] < len(group[i]["tokens"]) - 1]
    if not cycles:
        return float("nan"), []
    return tokens / cycles, [a / cycles for a in accepted_at.tolist()]


# --------------------------------------------------------------------- checkpoints


def save_drafter(drafter: DFlashDrafter, out: Path, dtype: Optional[mx.Dtype] = None) -> None:
    """z-lab format: config.json and model.safetensors with un-prefixed names."""
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(drafter.parameters()))
    if dtype is not None:
        weights = {k: v.astype(dtype) for k, v in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(drafter.config.raw, indent=2, sort_keys=True))


def save_checkpoint(drafter, optimizer, step: int, history: list, rng: random.Random, out: Path,
                    seconds: float = 0.0, target_dtype: str = "target") -> None:
    path = out / "checkpoint"
    save_drafter(drafter, path)
    mx.save_safetensors(str(path / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    version, internal, gauss = rng.getstate()
    (path / "state.json").write_text(json.dumps(
        {"step": step, "history": history, "rng": [version, list(internal), gauss], "seconds": seconds,
         "target_dtype": target_dtype}))


def load_checkpoint(drafter, optimizer, rng: random.Random, out: Path) -> tuple[int, list, float]:
    """The step, history and seconds trained of the checkpoint in out/checkpoint, its weights and
    optimizer state loaded into `drafter` and `optimizer` and its random state into `rng`."""
    path = out / "checkpoint"
    drafter.load_weights(str(path / "model.safetensors"))
    optimizer.state = tree_unflatten(list(mx.load(str(path / "optimizer.safetensors")).items()))
    state = json.loads((path / "state.json").read_text())
    version, internal, gauss = state["rng"]
    rng.setstate((version, tuple(internal), gauss))  # the same anchors and batches as an unbroken run
    return state["step"], state["history"], state.get("seconds", 0.0)


# --------------------------------------------------------------------------- train


def run_share(opts: TrainOptions, step: int, seconds: float) -> float:
    """How much of the run after its warm-up is behind, 0..1: by steps, or by time where a time
    budget (`minutes`) runs out first, so that a run ended by its budget ends at the lowest rate."""
    by_steps = (step - opts.warmup) / max(1, opts.steps - opts.warmup)
    by_time = seconds / (opts.minutes * 60) if opts.minutes else 0.0
    return min(1.0, max(0.0, by_steps, by_time))


def learning_rate(opts: TrainOptions, step: int, share: float) -> float:
    """A linear warm-up from 1 % of `lr` over `warmup` steps, then a cosine down to 5 % of it over
    the rest of the run (`share` of it behind, `run_share`)."""
    if step < opts.warmup:
        return opts.lr * (0.01 + 0.99 * step / opts.warmup)
    low = opts.lr * 0.05
    return low + (opts.lr - low) * 0.5 * (1 + math.cos(math.pi * share))


@dataclass
class TrainReport:
    steps: int
    seconds: float
    sequences: int
    held_out_sequences: int
    first_loss: float
    last_loss: float
    tokens_per_cycle_estimate: float
    history: list = field(default_factory=list)
    data: dict = field(default_factory=dict)  # train_data.data_report: sizes by category, generation speed
    trained_block_tokens: int = 0  # drafter block rows trained on this run (after a resume: since it)
    trained_tokens_per_second: float = 0.0
    ended_by: str = "steps"  # or "time": the --minutes budget ran out first; "data": generate_only
    taps: dict = field(default_factory=dict)  # TapCache.report(): the target's share of the run
    acceptance_by_position: list = field(default_factory=list)  # held out, at the end (acceptance_walk)


def train(opts: TrainOptions) -> TrainReport:
    from tqdm import tqdm

    given = [name for name in ARCHITECTURE if getattr(opts, name) is not None]
    if opts.init_from is not None and given:  # (before anything loads)
        raise ValueError(f"{', '.join('--' + n.replace('_', '-') for n in given)}: the drafter's shape comes from "
                         f"--init-from {opts.init_from} (its config.json); drop them")
    if opts.generate_only and opts.resume:
        raise ValueError("--resume: a --generate-only run trains nothing to resume (it continues the data by itself)")
    if opts.generate_only and opts.generation_minutes == 0:
        raise ValueError("--generate-only with --generation-minutes 0 makes nothing: give the generation a budget, "
                         "or drop --generate-only to train on the data made so far")
    if opts.loss_vocab not in ("full", "data"):
        raise ValueError(f"loss_vocab: {opts.loss_vocab!r} is not 'full' or 'data'")
    if opts.head_dtype not in HEAD_DTYPES:
        raise ValueError(f"head_dtype: {opts.head_dtype!r} is not one of {', '.join(HEAD_DTYPES)}")
    if opts.target_dtype not in TARGET_DTYPES:
        raise ValueError(f"target_dtype: {opts.target_dtype!r} is not one of {', '.join(TARGET_DTYPES)}")
    state_file = opts.out / "checkpoint" / "state.json"
    if opts.resume and state_file.exists():
        trained_with = json.loads(state_file.read_text()).get("target_dtype", "target")
        if trained_with != opts.target_dtype:  # the taps would change dtype mid-run
            raise ValueError(f"--resume: {state_file} was trained with --target-dtype {trained_with}, "
                             f"not {opts.target_dtype}; give the same")
    rng = random.Random(opts.seed)
    mx.random.seed(opts.seed)
    opts.out.mkdir(parents=True, exist_ok=True)
    target, tokenizer, _ = load_target(resolve(opts.target, files=TARGET_FILES))
    start_from = None
    if opts.init_from is not None:
        start_from, opts = drafter_to_continue(target, opts)
    else:
        opts = opts.with_new_drafter_defaults()
    engine = Engine(target, tokenizer)
    records = read_prompt_records(opts.data)
    cache_file = opts.out / "data" / "sequences.jsonl"
    with tqdm(total=len(records) * max(1, opts.samples_per_prompt), desc="target responses", unit="response") as bar:
        sequences = regenerate(engine, records, opts, cache_file, bar.update)
    # Batched generation leaves its caches (tens of GB at 1024 rows on a GPU) in MLX's buffer cache,
    # held there until reused or freed: on an 80 GB card they and the tap cache below ran it out of
    # memory.
    mx.clear_cache()
    data = data_report(sequences, cache_file.with_name("sequences.progress.json"))
    if opts.generate_only:  # (however few: the training run checks what it has)
        (cache_file.parent / "data_report.json").write_text(json.dumps(data, indent=2))
        nan, held = float("nan"), data["held_out_sequences"]
        return TrainReport(0, 0.0, len(sequences) - held, held, nan, nan, nan, data=data, ended_by="data")
    if len(sequences) < 2:
        raise ValueError(f"{opts.data}: fewer than 2 usable training prompts")
    stored_dtype = target.dtype  # the saved drafter's default dtype: the target's as served
    if opts.target_dtype != "target" and getattr(mx, opts.target_dtype) != target.dtype:
        del engine, target
        mx.clear_cache()
        target, _, _ = load_target(resolve(opts.target, files=TARGET_FILES), dtype=opts.target_dtype)
    held_out, training = split_sequences(sequences, rng, opts.held_out)
    if not training:
        raise ValueError(f"{opts.data}: no training prompts left after holding out {len(held_out)}")

    drafter = initial_drafter(target, start_from) if start_from is not None else new_drafter(target, tokenizer, opts)
    vocab_ids, coverage = (most_frequent((seq["tokens"][seq["response_start"]:] for seq in training), opts.draft_vocab)
                           if opts.draft_vocab else ([], 0.0))
    draft_vocab = mx.array(vocab_ids, dtype=mx.int32) if vocab_ids else None
    weights = position_weights(opts.block_size, opts.gamma)
    optimizer = optim.AdamW(learning_rate=opts.lr, weight_decay=opts.weight_decay)
    step, history, before = 0, [], 0.0  # before: seconds trained by the runs this one resumes
    if opts.resume and (opts.out / "checkpoint" / "state.json").exists():
        step, history, before = load_checkpoint(drafter, optimizer, rng, opts.out)
        log.info("resuming from step %d", step)

    def loss_fn(model, taps, tokens, anchors, sequence, labels):
        logits = block_logits(model, target, taps, tokens, anchors, lm_head, sequence)
        valid = labels >= 0
        targets = mx.maximum(labels, 0) if remap is None else remap[mx.maximum(labels, 0)]
        ce = nn.losses.cross_entropy(logits.astype(mx.float32), targets, reduction="none")
        w = weights[None] * valid
        return (ce * w).sum() / mx.maximum(w.sum(), 1e-6)

    head_dtype = None if opts.head_dtype == "target" else getattr(mx, opts.head_dtype)
    ids, remap = None, None
    if opts.loss_vocab == "data":
        ids = sorted({t for seq in training for t in seq["tokens"][seq["response_start"]:]})
        remap = mx.zeros((target.vocab_size,), mx.int32).at[mx.array(ids)].add(mx.arange(len(ids), dtype=mx.int32))
        log.info("loss over the %d tokens the target produced (--loss-vocab data)", len(ids))
    lm_head = loss_lm_head(target, None if ids is None else mx.array(ids, dtype=mx.int32), head_dtype)

    grad_fn = nn.value_and_grad(drafter, loss_fn)

    taps_of = TapCache(target, [seq["tokens"] for seq in training], drafter.config.target_layer_ids,
                       int(opts.tap_cache_gb * 1e9))
    start = time.perf_counter()
    block_tokens = 0  # drafter rows trained on (each block's rows after its anchor)
    estimate, by_position = float("nan"), None  # by_position: from the last walk of this run
    progress = tqdm(total=opts.steps, initial=step, desc="training", unit="step")
    budget = opts.minutes * 60 if opts.minutes else None

    def trained() -> float:  # seconds of training, the runs this one resumes included
        return before + time.perf_counter() - start

    while step < opts.steps and (budget is None or trained() < budget):
        # The step's sequences as one batch: one forward and backward (one per sequence was a few
        # small launches each, what a step cost on a GPU).
        drawn = []
        for index in rng.sample(range(len(training)), min(opts.batch, len(training))):
            anchors = sample_anchors(rng, training[index], opts.anchors)
            if anchors is not None:
                drawn.append((index, anchors))
                block_tokens += anchors.size * (opts.block_size - 1)
        pieces = [(training[i]["tokens"], taps, anchors)
                  for (i, anchors), taps in zip(drawn, taps_of([i for i, _ in drawn]) if drawn else [])]
        if not pieces:
            raise ValueError("no training sequence has a response long enough for a block")
        loss, grads = grad_fn(drafter, *batch_of(pieces, opts.block_size))
        rate = learning_rate(opts, step, run_share(opts, step, trained()))
        optimizer.learning_rate = rate
        optimizer.update(drafter, grads)
        mx.eval(drafter.parameters(), optimizer.state, loss)
        total = loss.item()
        step += 1
        history.append({"step": step, "loss": total, "lr": rate})
        if step % opts.eval_every == 0 or step == opts.steps:
            estimate, by_position = acceptance_walk(drafter, target, held_out, random.Random(opts.seed + 1),
                                                    draft_vocab=draft_vocab)
            history[-1]["tokens_per_cycle"] = estimate
        if step % opts.save_every == 0 or step == opts.steps:
            save_checkpoint(drafter, optimizer, step, history, rng, opts.out, trained(), opts.target_dtype)
        progress.set_postfix(loss=f"{total:.3f}", tok_per_cycle=f"{estimate:.2f}")
        progress.update(1)
    progress.close()
    if by_position is None or "tokens_per_cycle" not in history[-1]:  # this run did not walk its last step
        walked, by_position = acceptance_walk(drafter, target, held_out, random.Random(opts.seed + 1),
                                              draft_vocab=draft_vocab)
        if history and "tokens_per_cycle" not in history[-1]:  # the time budget ended the run between evaluations
            history[-1]["tokens_per_cycle"] = walked
            save_checkpoint(drafter, optimizer, step, history, rng, opts.out, trained(), opts.target_dtype)
    if history:
        estimate = history[-1]["tokens_per_cycle"]
    save_drafter(drafter, opts.out, dtype=getattr(mx, opts.save_dtype) if opts.save_dtype else stored_dtype)
    if vocab_ids:
        write_draft_vocab(opts.out, vocab_ids, f"dflash train: the {len(training)} training responses", coverage)
    else:  # (one an earlier run left there would be read with these weights)
        (opts.out / DRAFT_VOCAB_FILE).unlink(missing_ok=True)
    load_drafter(opts.out)  # the normal loader accepts what was written
    seconds = time.perf_counter() - start
    report = TrainReport(step, seconds, len(training), len(held_out),
                         history[0]["loss"] if history else float("nan"),
                         history[-1]["loss"] if history else float("nan"), estimate, history, data,
                         block_tokens, block_tokens / seconds if seconds else 0.0,
                         "steps" if step >= opts.steps else "time", taps_of.report(),
                         [round(share, 4) for share in by_position])
    (opts.out / "train_report.json").write_text(json.dumps({**asdict(report), "options": _jsonable(opts)}, indent=2))
    return report


def _jsonable(opts: TrainOptions) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()}
