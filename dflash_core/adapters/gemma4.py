"""Gemma 4 text models (also when wrapped as vision-language checkpoints).

Quirks owned here: the embedding is scaled by sqrt(H) inside the model (the drafter gets the raw
one), per-layer input embeddings, the last `num_kv_shared_layers` layers reuse the K/V of the last
earlier layer of the same type, sliding-window layers, and logit soft-capping. Sliding layers use
`SlidingWindowCache` instead of mlx-lm's RotatingKVCache, which cannot be trimmed once wrapped.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..cache import SlidingWindowCache
from .base import TargetAdapter


class Gemma4Adapter(TargetAdapter):
    family = "gemma4"

    @property
    def args(self):
        return self.text_model.args

    def make_cache(self, max_rollback: int) -> list:
        first_shared = self.args.num_hidden_layers - self.args.num_kv_shared_layers
        return [
            KVCache()
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

    def run_layers(self, tokens, cache, tap_ids, tape):
        inner = self.inner
        embeddings = inner.embed_tokens(tokens)
        h = embeddings * inner.embed_scale
        per_layer = [None] * len(self.layers)
        if inner.hidden_size_per_layer_input:
            projected = inner._project_per_layer_inputs(h, inner._get_per_layer_inputs(tokens, embeddings))
            per_layer = [projected[:, :, i, :] for i in range(len(self.layers))]
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
