"""Gemma 3 text models (the offline demo's Gemma 3 270M among them).

Every `sliding_window_pattern`-th layer is global, the others attend within a sliding window; the
embedding is scaled by sqrt(H) rounded to bfloat16 (as the model was trained), the drafter gets it
unscaled. Sliding layers use `SlidingWindowCache`: mlx-lm's RotatingKVCache cannot be trimmed once
it has wrapped. Prefill calls mlx-lm's layers as `layer(h, mask, cache)`; decode and verify run
as rows (`TargetAdapter.run_rows`), each layer as compiled functions for all rows around RoPE, the
cache update and attention per row, as the other adapters do (on a CPU, eager small ops cost a
270M model's decode step a fifth of its time).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention

from ..cache import RowsKVCache, SlidingWindowCache
from ..kernels.attention import attention
from ..kernels.matmul import gated_mlp, linear
from .base import TargetAdapter, attend_rows, gated_mlp_group, heads_first, join, part, rotary
from .dense import attention_inputs  # Gemma 3's attention up to RoPE is Qwen3's (per-head norms)


def gelu_approx_gate(gate: mx.array, up: mx.array) -> mx.array:
    """Gemma 3's MLP activation, `gelu_approx(gate) * up` as mlx-lm's MLP computes it."""
    return nn.gelu_approx(gate) * up


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


def window_attention(q, k, v, cache: SlidingWindowCache, scale: float, mask: mx.array, kernels) -> mx.array:
    """Write k, v into a sliding layer's ring and attend over it with the row's mask: one query
    through mlx-lm's attention, a block through the block attention."""
    k, v = cache.update_and_fetch(k, v)
    if q.shape[2] == 1:
        return scaled_dot_product_attention(q, k, v, cache=cache, scale=scale, mask=mask)
    return attention(q, [k], [v], scale, mask, kernels)


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
            RowsKVCache() if self._is_global(i) else SlidingWindowCache(self.args.sliding_window, slack=max_rollback)
            for i in range(len(self.layers))
        ]

    def _embed(self, tokens):
        h = self.embed(tokens)
        return h * mx.array(self.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)

    def run_layers(self, tokens, cache, tap_ids, states):
        """Prefill: mlx-lm's layers."""
        h = self._embed(tokens)
        sliding = next((c for c in cache if isinstance(c, SlidingWindowCache)), None)
        sliding_mask = sliding.mask(tokens.shape[1]) if sliding is not None else None
        tapped = {}
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
            h = layer(h, "causal" if self._is_global(i) else sliding_mask, layer_cache)
            if i in tap_ids:
                tapped[i] = h
        return h, tapped

    def run_rows(self, tokens, rows, tap_ids):
        """Decode and verify. The global layers attend for all rows as one batch (`attend_rows`, as
        in the dense adapter), sliding layers per row over their ring with its mask, taken per row
        before any layer writes."""
        h = self._embed(tokens)
        sliding_masks = []
        for r, (s, e) in zip(rows.rows, rows.bounds):
            sliding = next((c for c in r.cache if isinstance(c, SlidingWindowCache)), None)
            sliding_masks.append(sliding.mask(e - s) if sliding is not None else None)
        tapped = {}
        for i, (layer, groups) in enumerate(zip(self.layers, self.shared_inputs)):
            attn = layer.self_attn
            q, k, v = self.compiled(("pre", i), lambda: attention_inputs(layer, groups, self.kernels))(h)
            rope = self.compiled(("rope", i), lambda: rotary(attn))
            if self._is_global(i):
                attended = attend_rows(q, k, v, rows, rows.caches(i), attn.scale, rope, self.kernels)
            else:
                parts = []
                for (s, e), layer_cache, offset, sliding_mask in zip(rows.bounds, rows.caches(i), rows.offsets,
                                                                     sliding_masks):
                    q_row, k_row = rope(offset, part(q, s, e), part(k, s, e))
                    parts.append(window_attention(q_row, k_row, heads_first(part(v, s, e)), layer_cache, attn.scale,
                                                  sliding_mask, self.kernels))
                attended = join(parts, axis=2)
            post = self.compiled(("post", i), lambda: attention_output_and_mlp(layer, groups, self.kernels))
            h = post(h, attended)
            self.queue_layers(i, h, rows)
            if i in tap_ids:
                tapped[i] = h
        return h, tapped
