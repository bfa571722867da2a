"""The one backend gate for custom kernels.

Every kernel has a pure-MLX fallback that is always correct and tested; a backend-specific
implementation is used only where `backend()` says it can run. Metal keeps mlx-lm's own kernels.
"""

from __future__ import annotations

import functools

import mlx.core as mx


@functools.cache
def backend() -> str:
    """'metal', 'cuda' or 'cpu': where the default device's kernels run."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "cpu"
