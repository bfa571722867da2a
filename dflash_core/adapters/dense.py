"""Plain pre-norm decoders whose layers are called as `layer(h, mask, cache)`: Qwen3 (dense and
MoE). Every cache is a trimmable KV cache, so rollback is a trim. Prefill calls mlx-lm's layers
(their attention on the CPU through our softmax, `prefill_attention`); decode and verify run as
rows (`TargetAdapter.run_rows`), each layer as compiled blocks for all rows around one batched
RoPE, cache update and attention (`attend_rows`)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import create_attention_mask

from ..cache import RowsKVCache
from ..kernels.attention import buffer_mask, path_for, unfused_cpu
from ..kernels.matmul import gated_mlp, linear, linears
from ..kernels.norms import add_norm, norm_of, residual
from .base import TargetAdapter, attend_row, attend_rows, gated_mlp_group, heads_first, rotary, rotated, with_next_input


def call_norm(norm, x: mx.array) -> mx.array:
    """A norm module's own call (an adapter may compute some norms another way: gemma3.py)."""
    return norm(x)


def attention_inputs(layer, groups: dict, kernels, norm=call_norm):
    """The input norm's output -> q, k, v [B, L, heads, D] with per-head norms (Qwen3 attention up
    to RoPE, which needs a row's offset). `groups`: the layer's SharedInputs by name; `norm(module,
    x)` applies a norm module."""
    attn = layer.self_attn

    def pre(x):
        B, L, _ = x.shape
        q, k, v = linears(groups["qkv"], x, kernels)
        q = norm(attn.q_norm, q.reshape(B, L, attn.n_heads, -1))
        k = norm(attn.k_norm, k.reshape(B, L, attn.n_kv_heads, -1))
        return q, k, v.reshape(B, L, attn.n_kv_heads, -1)

    return pre


def prefill_attention(layer, groups: dict, h: mx.array, mask, cache, kernels) -> mx.array:
    """A prefill chunk's attention block (mlx-lm's `layer.self_attn(layer.input_layernorm(h), ...)`
    for Qwen3 and Gemma 3), on the CPU through our softmax as decode and verify have it
    (kernels/attention.py; a "causal" mask made the boolean mask MLX makes of it): a long prompt's
    attention was most of its prefill there. Elsewhere mlx-lm's own call."""
    attn = layer.self_attn
    if path_for(h[:, None], None, kernels) != "cpu":
        return attn(layer.input_layernorm(h), mask, cache)
    B, L, _ = h.shape
    q, k, v = attention_inputs(layer, groups, kernels)(layer.input_layernorm(h))
    q, k = rotary(attn)(cache.offset, q, k)
    k, v = cache.update_and_fetch(k, heads_first(v))
    if isinstance(mask, str):  # "causal": the chunk's queries are the last L of the keys
        mask = buffer_mask(k.shape[2], k.shape[2] - L, L)
    out = unfused_cpu(q, k, v, attn.scale, mask)
    return linear(attn.o_proj, out.transpose(0, 2, 1, 3).reshape(B, L, -1), kernels)


def attention_output_and_mlp(layer, groups: dict, kernels, next_norm=None):
    """After attention: h, or (h, next_norm(h)) where the next layer's input norm is given (one launch
    with the residual add where norms.py has it)."""

    def post(h, attended):
        B, L, _ = h.shape
        r = linear(layer.self_attn.o_proj, attended.transpose(0, 2, 1, 3).reshape(B, L, -1), kernels)
        h, x = add_norm(h, r, *norm_of(layer.post_attention_layernorm), kernels)
        r = gated_mlp(layer.mlp, x, swiglu, kernels, groups.get("gate_up"))
        return residual(h, r, next_norm, kernels)

    return post


class DenseAdapter(TargetAdapter):
    family = "qwen3"

    def make_cache(self, max_rollback: int) -> list:
        return [RowsKVCache() for _ in self.layers]

    def layer_groups(self, layer):
        attn = layer.self_attn
        return {"qkv": [attn.q_proj, attn.k_proj, attn.v_proj], **gated_mlp_group(layer.mlp)}

    def run_layers(self, tokens, cache, tap_ids, states):
        """Prefill: mlx-lm's layers (large ops, graph building is cheap)."""
        h = self.embed(tokens)
        mask = create_attention_mask(h, cache[0])
        tapped = {}
        for i, (layer, groups, layer_cache) in enumerate(zip(self.layers, self.shared_inputs, cache)):
            # mlx-lm's TransformerBlock, its attention on the CPU through our softmax
            h = h + prefill_attention(layer, groups, h, mask, layer_cache, self.prefill_kernels)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if i in tap_ids:
                tapped[i] = h
        return h, tapped

    def run_rows(self, tokens, rows, tap_ids):
        h = self.embed(tokens)
        x = self.layers[0].input_layernorm(h)  # each layer's post makes the next one's
        tapped = {}
        for i, (layer, groups) in enumerate(zip(self.layers, self.shared_inputs)):
            attn = layer.self_attn
            if len(rows.rows) == 1:  # RoPE in the projections' block
                q, k, v = self.compiled(("pre_rope", i), lambda: rotated(attention_inputs(layer, groups, self.kernels),
                                                                         attn))(x, rows.offsets[0])
                attended = attend_row(q, k, v, rows, rows.caches(i), attn.scale, self.kernels)
            else:
                q, k, v = self.compiled(("pre", i), lambda: attention_inputs(layer, groups, self.kernels))(x)
                rope = self.compiled(("rope", i), lambda: rotary(attn))
                attended = attend_rows(q, k, v, rows, rows.caches(i), attn.scale, rope, self.kernels)
            following = self.next_input_norm(i)
            post = self.compiled(("post", i), lambda: attention_output_and_mlp(layer, groups, self.kernels, following))
            h, x = with_next_input(post(h, attended), following)
            self.queue_layers(i, h, rows)
            if i in tap_ids:
                tapped[i] = h
        return h, tapped
