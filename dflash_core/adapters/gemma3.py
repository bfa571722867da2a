"""Gemma 3 text models (the offline demo's Gemma 3 270M among them).

Every `sliding_window_pattern`-th layer is global, the others attend within a sliding window; the
embedding is scaled by sqrt(H) rounded to bfloat16 (as the model was trained), the drafter gets it
unscaled. Sliding layers use `SlidingWindowCache`: mlx-lm's RotatingKVCache cannot be trimmed once
it has wrapped. The layers are mlx-lm's own, called as `layer(h, mask, cache)`.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..cache import SlidingWindowCache
from .base import TargetAdapter


class Gemma3Adapter(TargetAdapter):
    family = "gemma3_text"

    @property
    def args(self):
        return self.text_model.args

    def _is_global(self, i: int) -> bool:
        pattern = self.args.sliding_window_pattern
        return i % pattern == pattern - 1

    def make_cache(self, max_rollback: int) -> list:
        return [
            KVCache() if self._is_global(i) else SlidingWindowCache(self.args.sliding_window, slack=max_rollback)
            for i in range(len(self.layers))
        ]

    def run_layers(self, tokens, cache, tap_ids, tape):
        h = self.embed(tokens)
        h = h * mx.array(self.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
        n = tokens.shape[1]
        global_mask = None if n == 1 else "causal"
        sliding = next((c for c in cache if isinstance(c, SlidingWindowCache)), None)
        sliding_mask = sliding.mask(n) if sliding is not None else None
        tapped = {}
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
            h = layer(h, global_mask if self._is_global(i) else sliding_mask, layer_cache)
            if i in tap_ids:
                tapped[i] = h
        return h, tapped
