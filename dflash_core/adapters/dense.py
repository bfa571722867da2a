"""Plain pre-norm decoders whose layers are called as `layer(h, mask, cache)`: Qwen3 (dense and
MoE). Every cache is a trimmable KV cache, so rollback is a trim."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from ..kernels.matmul import gated_mlp, linear, linears
from .base import TargetAdapter, cached_attention, gated_mlp_group


def attention_inputs(layer, groups: dict, kernels):
    """input norm -> q, k, v with per-head norms and RoPE at an array offset (Qwen3 attention).
    `groups`: the layer's SharedInputs by name (TargetAdapter.shared_inputs)."""
    attn = layer.self_attn

    def pre(h, offset):
        B, L, _ = h.shape
        x = layer.input_layernorm(h)
        q, k, v = linears(groups["qkv"], x, kernels)
        q = attn.q_norm(q.reshape(B, L, attn.n_heads, -1)).transpose(0, 2, 1, 3)
        k = attn.k_norm(k.reshape(B, L, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return attn.rope(q, offset=offset), attn.rope(k, offset=offset), v

    return pre


def attention_output_and_mlp(layer, groups: dict, kernels):
    def post(h, attended):
        B, L, _ = h.shape
        h = h + linear(layer.self_attn.o_proj, attended.transpose(0, 2, 1, 3).reshape(B, L, -1), kernels)
        return h + gated_mlp(layer.mlp, layer.post_attention_layernorm(h), swiglu, kernels, groups.get("gate_up"))

    return post


class DenseAdapter(TargetAdapter):
    family = "qwen3"

    def make_cache(self, max_rollback: int) -> list:
        return [KVCache() for _ in self.layers]

    def layer_groups(self, layer):
        attn = layer.self_attn
        return {"qkv": [attn.q_proj, attn.k_proj, attn.v_proj], **gated_mlp_group(layer.mlp)}

    def run_layers(self, tokens, cache, tap_ids, states):
        h = self.embed(tokens)
        tapped = {}
        if tokens.shape[1] > self.compile_max_tokens:  # prefill: large ops, graph building is cheap
            mask = create_attention_mask(h, cache[0])
            for i, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
                h = layer(h, mask, layer_cache)
                if i in tap_ids:
                    tapped[i] = h
            return h, tapped
        start = cache[0].offset
        offset = mx.array(start)
        masks = {}
        for i, (layer, layer_cache, groups) in enumerate(zip(self.layers, cache, self.shared_inputs)):
            q, k, v = self.compiled(("pre", i), lambda: attention_inputs(layer, groups, self.kernels))(h, offset)
            attended = cached_attention(q, k, v, layer_cache, layer.self_attn.scale, start, masks, self.kernels)
            h = self.compiled(("post", i), lambda: attention_output_and_mlp(layer, groups, self.kernels))(h, attended)
            if i in tap_ids:
                tapped[i] = h
        return h, tapped
