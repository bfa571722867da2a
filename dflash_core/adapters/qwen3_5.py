"""Qwen3.5 / Qwen3.6 hybrids (dense and MoE): GatedDeltaNet layers plus full attention.

A GatedDeltaNet layer carries a conv state (the last K-1 inputs) and a recurrent state that cannot
be trimmed. The adapter runs the mixer itself over mlx-lm's projections so that, during a verify
forward, it can keep the step inputs (q, k, v, g, beta) and the pre-verify states. MLX arrays are
immutable, so keeping references is the snapshot. Rolling back to `keep` tokens then replays only
the recurrence over those steps, from the snapshot, with the same kernel: no weight is read again.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.gated_delta import compute_g, normalize_qk

from ..kernels.gated_delta import gated_delta
from .base import TargetAdapter


class Qwen35Adapter(TargetAdapter):
    family = "qwen3_5"

    def make_cache(self, max_rollback: int) -> list:
        return [ArraysCache(size=2) if layer.is_linear else KVCache() for layer in self.layers]

    def run_layers(self, tokens, cache, tap_ids, tape):
        h = self.embed(tokens)
        attention_cache = next(c for c, layer in zip(cache, self.layers) if not layer.is_linear)
        mask = create_attention_mask(h, attention_cache)
        tapped = {}
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
            if layer.is_linear:
                mixed = gated_delta_mixer(layer.linear_attn, layer.input_layernorm(h), layer_cache, tape)
                h = h + mixed
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            else:
                h = layer(h, mask, layer_cache)
            if i in tap_ids:
                tapped[i] = h
        return h, tapped

    def rollback(self, cache, tape, keep):
        length, steps = tape
        if keep >= length:
            return
        steps = iter(steps)
        for layer, layer_cache in zip(self.layers, cache):
            if not layer.is_linear:
                layer_cache.trim(length - keep)
                continue
            conv_input, q, k, v, g, beta, state = next(steps)
            # Conv state after `keep` tokens: the K-1 inputs ending at the last kept token.
            kernel = layer.linear_attn.conv_kernel_size
            layer_cache[0] = mx.contiguous(conv_input[:, keep : keep + kernel - 1])
            _, layer_cache[1] = gated_delta(
                q[:, :keep], k[:, :keep], v[:, :keep], g[:, :keep], beta[:, :keep], state
            )


def gated_delta_mixer(m, x: mx.array, cache: ArraysCache, tape: list | None) -> mx.array:
    """mlx-lm's GatedDeltaNet.__call__ for one unpadded sequence, keeping rollback inputs."""
    B, S, _ = x.shape
    qkv = m.in_proj_qkv(x)
    z = m.in_proj_z(x).reshape(B, S, m.num_v_heads, m.head_v_dim)
    b = m.in_proj_b(x)
    a = m.in_proj_a(x)

    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((B, m.conv_kernel_size - 1, m.conv_dim), dtype=x.dtype)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    cache[0] = mx.contiguous(conv_input[:, -(m.conv_kernel_size - 1) :])
    conv_out = nn.silu(m.conv1d(conv_input))

    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [m.key_dim, 2 * m.key_dim], -1),
            [m.num_k_heads, m.num_k_heads, m.num_v_heads],
            [m.head_k_dim, m.head_k_dim, m.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=m.head_k_dim**-0.5, eps=1e-6)
    g = compute_g(m.A_log, a, m.dt_bias)
    beta = mx.sigmoid(b)
    state = cache[1]
    if state is None:
        state = mx.zeros((B, m.num_v_heads, m.head_v_dim, m.head_k_dim), dtype=mx.float32)
    y, cache[1] = gated_delta(q, k, v, g, beta, state)
    if tape is not None:
        tape.append((conv_input, q, k, v, g, beta, state))
    return m.out_proj(m.norm(y, z).reshape(B, S, -1))
