"""Qwen3.5 / Qwen3.6 hybrids (dense and MoE): GatedDeltaNet layers plus full attention.

A GatedDeltaNet layer carries a conv state (the last K-1 inputs) and a recurrent state that cannot
be trimmed. The adapter runs the mixer itself over mlx-lm's projections so that, during a verify
forward, it can keep the pre-verify states and either the step inputs (q, k, v, g, beta) or, where
the kernel writes them in the same launch (CUDA), the state after every step. MLX arrays are
immutable, so keeping references is the snapshot. Rolling back to `keep` tokens then picks the
state after `keep` steps, or replays only the recurrence over those steps from the snapshot with
the same kernel; either way no weight is read again and the state is the one a forward of the
kept tokens alone would give.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.gated_delta import compute_g, normalize_qk

from ..kernels.gated_delta import gated_delta, gated_delta_step_states, records_step_states
from ..kernels.matmul import gated_mlp, linear, linears
from .base import TargetAdapter, cached_attention, gated_mlp_group


class GatedDeltaRecord(NamedTuple):
    """What a rollback of one GatedDeltaNet layer needs from the recorded forward."""

    conv_input: mx.array  # the conv state before the forward, then its inputs
    state: mx.array  # the recurrent state before the forward
    steps: Optional[tuple]  # (q, k, v, g, beta), replayed up to `keep`; or
    step_states: Optional[mx.array]  # the state after every step [B, T, Hv, Dv, Dk]


def gated_delta_layer(layer, groups: dict, kernels, step_states: bool = False):
    """A whole GatedDeltaNet decoder layer as a pure function of (h, conv state, recurrent state):
    mlx-lm's GatedDeltaNet.__call__ for one unpadded sequence, plus the MLP, returning what a
    rollback needs: the conv input and either the recurrence's step inputs or its per-step states."""
    m = layer.linear_attn

    def block(h, conv_state, state):
        B, S, _ = h.shape
        x = layer.input_layernorm(h)
        qkv, z, b, a = linears(groups["in_proj"], x, kernels)
        z = z.reshape(B, S, m.num_v_heads, m.head_v_dim)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        conv_out = nn.silu(m.conv1d(conv_input))
        q, k, v = [
            t.reshape(B, S, heads, dim)
            for t, heads, dim in zip(
                mx.split(conv_out, [m.key_dim, 2 * m.key_dim], -1),
                [m.num_k_heads, m.num_k_heads, m.num_v_heads],
                [m.head_k_dim, m.head_k_dim, m.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=m.head_k_dim**-0.5, eps=1e-6)
        g = compute_g(m.A_log, a, m.dt_bias)
        beta = mx.sigmoid(b)
        # What a rollback needs besides the conv input: every step's state, or the steps to replay.
        if step_states:
            y, new_state, kept = gated_delta_step_states(q, k, v, g, beta, state)
        else:
            y, new_state = gated_delta(q, k, v, g, beta, state)
            kept = (q, k, v, g, beta)
        h = h + linear(m.out_proj, m.norm(y, z).reshape(B, S, -1), kernels)
        h = h + gated_mlp(layer.mlp, layer.post_attention_layernorm(h), swiglu, kernels, groups.get("gate_up"))
        new_conv_state = conv_input[:, -(m.conv_kernel_size - 1) :]
        return h, new_conv_state, new_state, (conv_input, kept)

    return block


def gated_attention_inputs(layer, groups: dict, kernels):
    """Qwen3-Next attention up to the cache: q (with its output gate), k, v, RoPE at an array offset."""
    attn = layer.self_attn

    def pre(h, offset):
        B, L, _ = h.shape
        x = layer.input_layernorm(h)
        q, k, v = linears(groups["qkv"], x, kernels)
        queries, gate = mx.split(q.reshape(B, L, attn.num_attention_heads, -1), 2, axis=-1)
        q = attn.q_norm(queries).transpose(0, 2, 1, 3)
        k = attn.k_norm(k.reshape(B, L, attn.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
        return attn.rope(q, offset=offset), attn.rope(k, offset=offset), v, gate.reshape(B, L, -1)

    return pre


def gated_attention_output_and_mlp(layer, groups: dict, kernels):
    def post(h, attended, gate):
        B, L, _ = h.shape
        out = attended.transpose(0, 2, 1, 3).reshape(B, L, -1)
        h = h + linear(layer.self_attn.o_proj, out * mx.sigmoid(gate), kernels)
        return h + gated_mlp(layer.mlp, layer.post_attention_layernorm(h), swiglu, kernels, groups.get("gate_up"))

    return post


class Qwen35Adapter(TargetAdapter):
    family = "qwen3_5"

    def make_cache(self, max_rollback: int) -> list:
        return [ArraysCache(size=2) if layer.is_linear else KVCache() for layer in self.layers]

    def layer_groups(self, layer):
        if layer.is_linear:
            m = layer.linear_attn
            groups = {"in_proj": [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a]}
        else:
            groups = {"qkv": [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]}
        return {**groups, **gated_mlp_group(layer.mlp)}

    def run_layers(self, tokens, cache, tap_ids, states):
        h = self.embed(tokens)
        B, S = tokens.shape
        small = S <= self.compile_max_tokens  # decode and verify: compiled blocks
        attention_cache = next(c for c, layer in zip(cache, self.layers) if not layer.is_linear)
        start = attention_cache.offset
        offset = mx.array(start)
        mask = None if small else create_attention_mask(h, attention_cache)  # prefill: mlx-lm's layers
        masks = {}  # a verify's boolean masks over the whole KV buffer, shared by its layers
        tapped = {}
        # A verify (recorded, more than one token) keeps per-step states where that is cheap.
        step_states = states is not None and S > 1 and self.kernels.step_states and records_step_states()
        for i, (layer, layer_cache, groups) in enumerate(zip(self.layers, cache, self.shared_inputs)):
            if layer.is_linear:
                m = layer.linear_attn
                conv_state, state = layer_cache[0], layer_cache[1]
                if conv_state is None:
                    conv_state = mx.zeros((B, m.conv_kernel_size - 1, m.conv_dim), dtype=h.dtype)
                    state = mx.zeros((B, m.num_v_heads, m.head_v_dim, m.head_k_dim), dtype=mx.float32)
                def make(layer=layer, groups=groups):
                    return gated_delta_layer(layer, groups, self.kernels, step_states)

                block = self.compiled(("gdn", i, step_states), make) if small else make()
                h, layer_cache[0], layer_cache[1], (conv_input, kept) = block(h, conv_state, state)
                if states is not None:
                    steps, after_each = (None, kept) if step_states else (tuple(kept), None)
                    states.append(GatedDeltaRecord(conv_input, state, steps, after_each))
            elif small:
                pre = self.compiled(("pre", i), lambda: gated_attention_inputs(layer, groups, self.kernels))
                q, k, v, gate = pre(h, offset)
                attended = cached_attention(q, k, v, layer_cache, layer.self_attn.scale, start, masks, self.kernels)
                post = self.compiled(("post", i), lambda: gated_attention_output_and_mlp(layer, groups, self.kernels))
                h = post(h, attended, gate)
            else:
                h = layer(h, mask, layer_cache)
            if i in tap_ids:
                tapped[i] = h
        return h, tapped

    def rollback(self, cache, record, keep):
        if keep >= record.tokens:
            return
        states = iter(record.states)
        for layer, layer_cache in zip(self.layers, cache):
            if not layer.is_linear:
                layer_cache.trim(record.tokens - keep)
                continue
            layer_record = next(states)
            # Conv state after `keep` tokens: the K-1 inputs ending at the last kept token.
            kernel = layer.linear_attn.conv_kernel_size
            layer_cache[0] = mx.contiguous(layer_record.conv_input[:, keep : keep + kernel - 1])
            if keep == 0:
                layer_cache[1] = layer_record.state
            elif layer_record.step_states is not None:
                # A copy (MLX copies a view much smaller than its buffer), so that the cache and
                # prefix-cache snapshots of it do not pin all T states.
                layer_cache[1] = mx.contiguous(layer_record.step_states[:, keep - 1])
            else:
                q, k, v, g, beta = (x[:, :keep] for x in layer_record.steps)
                _, layer_cache[1] = gated_delta(q, k, v, g, beta, layer_record.state)
