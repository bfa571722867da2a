"""Plain pre-norm decoders whose layers are called as `layer(h, mask, cache)`: Qwen3 (dense and
MoE). Every cache is a trimmable KV cache, so rollback is a trim."""

from __future__ import annotations

from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from .base import TargetAdapter


class DenseAdapter(TargetAdapter):
    family = "qwen3"

    def make_cache(self, max_rollback: int) -> list:
        return [KVCache() for _ in self.layers]

    def run_layers(self, tokens, cache, tap_ids, tape):
        h = self.embed(tokens)
        mask = create_attention_mask(h, cache[0])
        tapped = {}
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
            h = layer(h, mask, layer_cache)
            if i in tap_ids:
                tapped[i] = h
        return h, tapped
