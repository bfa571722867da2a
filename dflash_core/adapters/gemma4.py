"""Gemma 4 text models (also when wrapped as vision-language checkpoints).

Quirks owned here: the embedding is scaled by sqrt(H) inside the model (the drafter gets the raw
one), per-layer input embeddings, the last `num_kv_shared_layers` layers reuse the K/V of the last
earlier layer of the same type, sliding-window layers, and logit soft-capping. Sliding layers use
`SlidingWindowCache` instead of mlx-lm's RotatingKVCache, which cannot be trimmed once wrapped.
Decode and verify run as rows (`TargetAdapter.run_rows`): per-token work once for all rows, and
attention for all rows as one batch (global layers over their KV buffers stacked, sliding ones over
their rings stacked, as in Gemma 3; a KV-shared layer over the batch its source layer attended over),
or row by row where the rows' rings do not allow it.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.gemma4_text import geglu

from ..cache import RowsKVCache, SlidingWindowCache
from ..kernels import backend
from ..kernels.attention import attention, buffer_mask, single_query
from ..kernels.matmul import gated_mlp, linear, linears
from ..kernels.norms import add_norm, add_normed, norm_of
from .base import TargetAdapter, attend_batch, batch_keys, gated_mlp_group, heads_first, join, part, rotary, rotated
from .gemma3 import window_batch_keys, window_rows_layout


def attention_inputs(layer, groups: dict, kernels):
    """Gemma 4 attention up to RoPE (which needs a row's offset): q, and k, v unless this layer
    shares another's, each [B, L, heads, D] with its norm."""
    attn = layer.self_attn

    def pre(h):
        B, L, _ = h.shape
        x = layer.input_layernorm(h)
        q, *kv = linears(groups["qkv"] if attn.has_kv else [attn.q_proj], x, kernels)
        q = attn.q_norm(q.reshape(B, L, attn.n_heads, attn.head_dim))
        if not attn.has_kv:
            return (q,)
        k = kv[0].reshape(B, L, attn.n_kv_heads, attn.head_dim)
        v = k if attn.use_k_eq_v else kv[1].reshape(B, L, attn.n_kv_heads, attn.head_dim)
        return q, attn.k_norm(k), attn.v_norm(v)

    return pre


def route(router, h: mx.array, kernels) -> tuple[mx.array, mx.array]:
    """mlx-lm's MoE `Router` with its projection through `linear` on the CPU, so that a token's
    experts and their weights have the same bits in a verify as in a decode step
    (kernels/cpu_linear.py; the experts' gathered products are per token already). Elsewhere the
    module's own call, as for Qwen3.5's MoE block (`matmul.is_sparse_moe`)."""
    if backend() != "cpu":
        return router(h)
    x = mx.fast.rms_norm(h, router.scale * router._root_size, router.eps)
    scores = linear(router.proj, x, kernels)
    k = router.config.top_k_experts
    chosen = mx.stop_gradient(mx.argpartition(scores, kth=-k, axis=-1)[..., -k:])
    weights = mx.softmax(mx.take_along_axis(scores, chosen, axis=-1), axis=-1)
    return chosen, weights * router.per_expert_scale[chosen]


def attention_output_and_feed_forward(layer, groups: dict, kernels):
    """Everything mlx-lm's DecoderLayer does after attention (MoE and per-layer input included)."""

    def mlp(x):
        return gated_mlp(layer.mlp, x, geglu, kernels, groups.get("gate_up"))

    def post(h, attended, *per_layer_input):
        per_layer_input = per_layer_input[0] if per_layer_input else None
        B, L, _ = h.shape
        out = linear(layer.self_attn.o_proj, attended.transpose(0, 2, 1, 3).reshape(B, L, -1), kernels)
        if layer.enable_moe:
            h = add_normed(h, out, *norm_of(layer.post_attention_layernorm), kernels)
            dense = layer.post_feedforward_layernorm_1(mlp(layer.pre_feedforward_layernorm(h)))
            top_k_indices, top_k_weights = route(layer.router, h, kernels)
            experts = layer.experts(layer.pre_feedforward_layernorm_2(h), top_k_indices, top_k_weights)
            r = dense + layer.post_feedforward_layernorm_2(experts)
        else:  # (the residual add and both norms around it in one launch where norms.py can)
            h, x = add_norm(h, out, *norm_of(layer.pre_feedforward_layernorm), kernels,
                            branch=norm_of(layer.post_attention_layernorm))
            r = mlp(x)
        h = add_normed(h, r, *norm_of(layer.post_feedforward_layernorm), kernels)
        if layer.per_layer_input_gate is not None and per_layer_input is not None:
            gate = nn.gelu_approx(linear(layer.per_layer_input_gate, h, kernels)) * per_layer_input
            h = h + layer.post_per_layer_input_norm(linear(layer.per_layer_projection, gate, kernels))
        return h * layer.layer_scalar if layer.layer_scalar is not None else h

    return post


def project_per_layer_inputs(inner, h, per_layer_inputs, kernels):
    """mlx-lm's `_project_per_layer_inputs` with its projection through `linear`, so that on the CPU
    a verify gives a token the bits a decode step does (kernels/cpu_linear.py)."""
    projected = linear(inner.per_layer_model_projection, h, kernels) * inner.per_layer_projection_scale
    projected = mx.unflatten(projected, -1, (inner.config.num_hidden_layers, inner.hidden_size_per_layer_input))
    projected = inner.per_layer_projection_norm(projected)
    return projected if per_layer_inputs is None else (projected + per_layer_inputs) * inner.per_layer_input_scale


class Gemma4Adapter(TargetAdapter):
    family = "gemma4"

    @property
    def args(self):
        return self.text_model.args

    def layer_groups(self, layer):
        attn = layer.self_attn
        groups = {}
        if attn.has_kv:  # (a layer reusing another's K/V projects q alone)
            groups["qkv"] = [attn.q_proj, attn.k_proj] + ([] if attn.use_k_eq_v else [attn.v_proj])
        return {**groups, **gated_mlp_group(layer.mlp)}

    def make_cache(self, max_rollback: int) -> list:
        first_shared = self.args.num_hidden_layers - self.args.num_kv_shared_layers
        return [
            RowsKVCache()
            if self.args.layer_types[i] == "full_attention"
            else SlidingWindowCache(self.args.sliding_window, slack=max_rollback)
            for i in range(first_shared)
        ]

    def logits(self, hidden):
        out = super().logits(hidden)
        cap = self.text_model.final_logit_softcapping
        return mx.tanh(out / cap) * cap if cap else out

    def _masks(self, n: int, cache: list) -> dict:
        masks = {}
        for layer, layer_cache in zip(self.layers, cache):
            kind = layer.layer_type
            if kind in masks:
                continue
            if isinstance(layer_cache, SlidingWindowCache):
                masks[kind] = layer_cache.mask(n)
            else:
                masks[kind] = None if n == 1 else "causal"
        return masks

    def per_token_modules(self):
        extra = [self.inner.per_layer_model_projection] if self.inner.hidden_size_per_layer_input else []
        return super().per_token_modules() + extra

    def _embed(self, tokens, kernels):
        """h and each layer's per-layer input (None where the model has none), per token."""
        inner = self.inner
        embeddings = inner.embed_tokens(tokens)
        h = embeddings * inner.embed_scale
        per_layer = [None] * len(self.layers)
        if inner.hidden_size_per_layer_input:
            projected = project_per_layer_inputs(inner, h, inner._get_per_layer_inputs(tokens, embeddings), kernels)
            per_layer = [projected[:, :, i, :] for i in range(len(self.layers))]
        return h, per_layer

    def run_layers(self, tokens, cache, tap_ids, states):
        """Prefill: mlx-lm's layers."""
        inner = self.inner
        h, per_layer = self._embed(tokens, self.prefill_kernels)
        masks = self._masks(tokens.shape[1], cache)
        cache = cache + [None] * (len(self.layers) - len(cache))
        shared = [(None, None)] * len(self.layers)
        tapped = {}
        for i, layer in enumerate(self.layers):
            kvs, offset = shared[inner.previous_kvs[i]]
            h, kvs, offset = layer(
                h,
                masks[layer.layer_type],
                cache[i],
                per_layer_input=per_layer[i],
                shared_kv=kvs,
                offset=offset,
            )
            shared[i] = (kvs, offset)
            if i in tap_ids:
                tapped[i] = h
        return h, tapped

    def run_rows(self, tokens, rows, tap_ids):
        """Decode and verify: each layer as compiled functions for all rows around attention, which
        runs for all rows as one batch where they allow (`_attend_batch`), else row by row
        (`_attend_row`)."""
        h, per_layer = self._embed(tokens, self.kernels)
        layout = self._batch_layout(rows)
        if layout is None:
            caches = [r.cache + [None] * (len(self.layers) - len(r.cache)) for r in rows.rows]
            # Per row: its masks by layer type (taken before any layer writes) and the K/V each
            # layer attended over, which the KV-shared layers reuse.
            masks = [self._masks(e - s, c) for (s, e), c in zip(rows.bounds, caches)]
            shared = [[None] * len(self.layers) for _ in caches]
        else:
            shared = [None] * len(self.layers)  # per layer: the batch's queries' keys, values and mask
        tapped = {}
        for i, (layer, groups) in enumerate(zip(self.layers, self.shared_inputs)):
            if len(rows.rows) == 1:  # RoPE in the projections' block
                inputs = self.compiled(("pre_rope", i), lambda: rotated(
                    attention_inputs(layer, groups, self.kernels), layer.self_attn))(h, rows.offsets[0])
                attended = self._attend_row(i, inputs, caches[0], shared[0], masks[0], rows, 0, rope_done=True)
                h = self._after_attention(i, layer, groups, h, attended, per_layer, rows, tapped, tap_ids)
                continue
            inputs = self.compiled(("pre", i), lambda: attention_inputs(layer, groups, self.kernels))(h)
            if layout is not None:
                attended = self._attend_batch(i, inputs, rows, layout, shared)
            else:
                attended = join([
                    self._attend_row(i, [part(x, s, e) for x in inputs], caches[r], shared[r], masks[r], rows, r)
                    for r, (s, e) in enumerate(rows.bounds)
                ], axis=2)
            h = self._after_attention(i, layer, groups, h, attended, per_layer, rows, tapped, tap_ids)
        return h, tapped

    def _after_attention(self, i, layer, groups, h, attended, per_layer, rows, tapped: dict, tap_ids):
        """Layer i's block after attention (queued, tapped): its output h."""
        post = self.compiled(("post", i), lambda: attention_output_and_feed_forward(layer, groups, self.kernels))
        h = post(h, attended, *(() if per_layer[i] is None else (per_layer[i],)))
        self.queue_layers(i, h, rows)
        if i in tap_ids:
            tapped[i] = h
        return h

    def _batch_layout(self, rows):
        """The sliding layers' ring layout for attending all rows as one batch (`window_rows_layout`,
        None for a single row); False where the model has no sliding layer. None: row by row."""
        if len(rows.rows) < 2:
            return None
        sliding = [i for i, c in enumerate(rows.rows[0].cache) if isinstance(c, SlidingWindowCache)]
        if not sliding:
            return False
        return window_rows_layout(rows, rows.caches(sliding[0]))

    def _attend_batch(self, i, inputs, rows, layout, shared):
        """Layer i's attention for all rows as one batch: a layer with its own K/V writes them into
        the rows' stacked buffers or rings (`batch_keys`, `window_batch_keys`) and attends; a layer
        that reuses another's attends over what that one attended over, with its mask."""
        attn = self.layers[i].self_attn
        rope = self.compiled(("rope", i), lambda: rotary(attn))
        if attn.has_kv:
            caches = rows.caches(i)
            if isinstance(caches[0], SlidingWindowCache):
                shared[i] = window_batch_keys(*inputs, rows, caches, rope, layout)
            else:
                shared[i] = batch_keys(*inputs, rows, caches, rope)
            return attend_batch(*shared[i], rows, attn.scale, self.kernels)
        (q_b,) = rope(rows.batch_offsets, rows.layout.batched(inputs[0]))
        _, keys, values, mask = shared[i] = shared[self.inner.previous_kvs[i]]
        return attend_batch(q_b, keys, values, mask, rows, attn.scale, self.kernels)

    def _attend_row(self, i, inputs, cache, shared, masks, rows, r, rope_done: bool = False):
        """Layer i's attention for row r from its slice of the layer's inputs: RoPE at its offset
        (done already where `rope_done`: `rotated`'s q and k, heads first), its cache update (or
        the K/V it shares) and attention. A verify attends through the block attention
        (kernels/attention.py) with boolean masks: sliding layers' ring already has one; global
        layers attend over their cache's whole buffer with its tail masked, as in the dense
        adapter, so shapes repeat across cycles."""
        layer = self.layers[i]
        attn = layer.self_attn
        rope = (lambda offset, *xs: xs) if rope_done else self.compiled(("rope", i), lambda: rotary(attn))
        n = inputs[0].shape[2 if rope_done else 1]
        if attn.has_kv:
            q, k = rope(rows.offsets[r], inputs[0], inputs[1])
            k, v = cache[i].update_and_fetch(k, heads_first(inputs[2]))
            if n > 1 and isinstance(cache[i], KVCache):
                k, v = cache[i].keys, cache[i].values
            shared[i] = (k, v)
        else:
            (q,) = rope(rows.offsets[r], inputs[0])
            k, v = shared[i] = shared[self.inner.previous_kvs[i]]
        mask = masks[layer.layer_type]
        if n == 1:
            return single_query(q, k, v, cache[i], attn.scale, mask, self.kernels)
        if not isinstance(mask, mx.array):  # a global layer ("causal"): the buffer's mask
            length = k.shape[2]
            if length not in rows.masks[r]:
                rows.masks[r][length] = buffer_mask(length, rows.starts[r], n)
            mask = rows.masks[r][length]
        return attention(q, [k], [v], attn.scale, mask, self.kernels)
