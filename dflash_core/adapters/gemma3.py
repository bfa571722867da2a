"""Gemma 3 text models (the offline demo's Gemma 3 270M among them).

Every `sliding_window_pattern`-th layer is global, the others attend within a sliding window; the
embedding is scaled by sqrt(H) rounded to bfloat16 (as the model was trained), the drafter gets it
unscaled. Sliding layers use `SlidingWindowCache`: mlx-lm's RotatingKVCache cannot be trimmed once
it has wrapped. Prefill calls mlx-lm's layers as `layer(h, mask, cache)`; decode and verify run
each layer as two compiled functions around the cache update, as the other adapters do (on a CPU,
eager small ops cost a 270M model's decode step a fifth of its time).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

from ..cache import SlidingWindowCache
from ..kernels.attention import attention, buffer_mask
from ..kernels.matmul import gated_mlp, linear, linears
from .base import TargetAdapter, gated_mlp_group


def gelu_approx_gate(gate: mx.array, up: mx.array) -> mx.array:
    """Gemma 3's MLP activation, `gelu_approx(gate) * up` as mlx-lm's MLP computes it."""
    return nn.gelu_approx(gate) * up


def attention_inputs(layer, groups: dict, kernels):
    """input norm -> q, k, v with per-head norms and RoPE at an array offset (mlx-lm's Attention)."""
    attn = layer.self_attn

    def pre(h, offset):
        B, L, _ = h.shape
        q, k, v = linears(groups["qkv"], layer.input_layernorm(h), kernels)
        q = attn.q_norm(q.reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3))
        k = attn.k_norm(k.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3))
        v = v.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return attn.rope(q, offset=offset), attn.rope(k, offset=offset), v

    return pre


def attention_output_and_mlp(layer, groups: dict, kernels):
    """What mlx-lm's TransformerBlock does after attention (its float16 residual clip included)."""
    from mlx_lm.models.gemma3_text import clip_residual

    def post(h, attended):
        B, L, _ = h.shape
        r = linear(layer.self_attn.o_proj, attended.transpose(0, 2, 1, 3).reshape(B, L, -1), kernels)
        h = clip_residual(h, layer.post_attention_layernorm(r))
        r = gated_mlp(layer.mlp, layer.pre_feedforward_layernorm(h), gelu_approx_gate, kernels, groups.get("gate_up"))
        return clip_residual(h, layer.post_feedforward_layernorm(r))

    return post


class Gemma3Adapter(TargetAdapter):
    family = "gemma3_text"

    @property
    def args(self):
        return self.text_model.args

    def _is_global(self, i: int) -> bool:
        pattern = self.args.sliding_window_pattern
        return i % pattern == pattern - 1

    def layer_groups(self, layer):
        attn = layer.self_attn
        return {"qkv": [attn.q_proj, attn.k_proj, attn.v_proj], **gated_mlp_group(layer.mlp)}

    def make_cache(self, max_rollback: int) -> list:
        return [
            KVCache() if self._is_global(i) else SlidingWindowCache(self.args.sliding_window, slack=max_rollback)
            for i in range(len(self.layers))
        ]

    def run_layers(self, tokens, cache, tap_ids, states):
        h = self.embed(tokens)
        h = h * mx.array(self.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
        n = tokens.shape[1]
        sliding = next((c for c in cache if isinstance(c, SlidingWindowCache)), None)
        sliding_mask = sliding.mask(n) if sliding is not None else None
        if n <= self.compile_max_tokens:
            return self._compiled_layers(h, cache, sliding_mask, tap_ids)
        tapped = {}
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
            h = layer(h, "causal" if self._is_global(i) else sliding_mask, layer_cache)
            if i in tap_ids:
                tapped[i] = h
        return h, tapped

    def _compiled_layers(self, h, cache, sliding_mask, tap_ids):
        """Decode and verify. A verify's global layers attend over their cache's whole buffer with
        its tail masked (as in the dense adapter), sliding layers over their ring with its mask."""
        start, n = cache[0].offset, h.shape[1]
        offset = mx.array(start)
        buffer_masks = {}  # by buffer length
        tapped = {}
        for i, (layer, layer_cache, groups) in enumerate(zip(self.layers, cache, self.shared_inputs)):
            attn = layer.self_attn
            q, k, v = self.compiled(("pre", i), lambda: attention_inputs(layer, groups, self.kernels))(h, offset)
            k, v = layer_cache.update_and_fetch(k, v)
            if self._is_global(i):
                if n == 1:
                    attended = scaled_dot_product_attention(q, k, v, cache=layer_cache, scale=attn.scale, mask=None)
                else:
                    k, v = layer_cache.keys, layer_cache.values
                    length = k.shape[2]
                    if length not in buffer_masks:
                        buffer_masks[length] = buffer_mask(length, start, n)
                    attended = attention(q, [k], [v], attn.scale, buffer_masks[length], self.kernels)
            elif n == 1:
                attended = scaled_dot_product_attention(q, k, v, cache=layer_cache, scale=attn.scale, mask=sliding_mask)
            else:
                attended = attention(q, [k], [v], attn.scale, sliding_mask, self.kernels)
            h = self.compiled(("post", i), lambda: attention_output_and_mlp(layer, groups, self.kernels))(h, attended)
            if i in tap_ids:
                tapped[i] = h
        return h, tapped
