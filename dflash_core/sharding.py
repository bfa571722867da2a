"""Tensor-parallel sharding of a target over an `mx.distributed` group, before its adapter is built.

Qwen3 and Qwen3.5 / 3.6 use mlx-lm's own `Model.shard`. Gemma 3 and Gemma 4, which mlx-lm does
not shard, get the same pattern here: each attention layer's heads are split over the ranks (q, k
and v "all-to-sharded", the output projection "sharded-to-all", which all-reduces), the dense MLP's
intermediate width likewise (gate and up all-to-sharded, down sharded-to-all). Key/value heads
fewer than the ranks are repeated first, so that every rank holds the heads its queries read, as
mlx-lm does for Qwen3.5. What stays whole on every rank: embeddings (and so the tied LM head),
norms, Gemma 4's per-layer-input projections and its MoE experts and router (correct, not
smaller: the experts are computed whole on every rank).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear

# mlx-lm model modules whose models shard themselves (`Model.shard`).
MLX_LM_SHARDED = ("qwen3", "qwen3_5", "qwen3_5_moe")
OWN_SHARDING = ("gemma3_text", "gemma4", "gemma4_text")


def shard_target(model: nn.Module, group: mx.distributed.Group) -> None:
    """Split the target's weights over the group."""
    family = type(model).__module__.rsplit(".", 1)[-1]
    if family in MLX_LM_SHARDED and hasattr(model, "shard"):
        model.shard(group)
    elif family in OWN_SHARDING:
        text = getattr(model, "language_model", model)
        for layer in text.model.layers:
            _shard_attention(layer.self_attn, group)
            _shard_mlp(layer.mlp, group)
    else:
        raise ValueError(f"a {family} target cannot be sharded: distributed serving supports "
                         f"{', '.join(MLX_LM_SHARDED + OWN_SHARDING)} targets")
    mx.eval(model.parameters())


def _repeat_heads(linear: nn.Module, heads: int, n: int) -> None:
    """Repeat each of the `heads` output heads of `linear` n // heads times (n ranks, heads < n)."""
    if heads >= n:
        return
    if n % heads:
        raise ValueError(f"{heads} key/value heads cannot be spread over {n} ranks")

    def repeat(p):
        p = p.reshape(heads, p.shape[0] // heads, *p.shape[1:])
        return mx.repeat(p, n // heads, axis=0).reshape(-1, *p.shape[2:])

    linear.update({name: repeat(p) for name, p in linear.parameters().items()})


def _split(count: int, n: int, what: str) -> int:
    if count % n:
        raise ValueError(f"{count} {what} cannot be split evenly over {n} ranks")
    return count // n


def _shard_attention(attn: nn.Module, group: mx.distributed.Group) -> None:
    n = group.size()
    attn.n_heads = _split(attn.n_heads, n, "attention heads")
    attn.q_proj = shard_linear(attn.q_proj, "all-to-sharded", group=group)
    attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
    if getattr(attn, "has_kv", True):  # Gemma 4's KV-sharing layers project no keys or values
        for name in ("k_proj", "v_proj"):
            if hasattr(attn, name):  # (k == v layers have no v_proj)
                _repeat_heads(getattr(attn, name), attn.n_kv_heads, n)
                setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
    attn.n_kv_heads = max(1, attn.n_kv_heads // n)
    if hasattr(attn, "repeats"):
        attn.repeats = attn.n_heads // attn.n_kv_heads


def _shard_mlp(mlp: nn.Module, group: mx.distributed.Group) -> None:
    mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
    mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
    mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
