"""Target adapters, one small module per model family."""

from __future__ import annotations

import mlx.nn as nn

from ..kernels import DEFAULT_KERNELS, KernelOptions
from .base import ForwardRow, RollbackRecord, TargetAdapter, TargetOutput
from .dense import DenseAdapter
from .gemma3 import Gemma3Adapter
from .gemma4 import Gemma4Adapter
from .qwen3_5 import Qwen35Adapter

# mlx-lm model module -> adapter. Each family listed here has a lossless test in tests/.
ADAPTERS: dict[str, type[TargetAdapter]] = {
    "qwen3": DenseAdapter,
    "qwen3_5": Qwen35Adapter,
    "qwen3_5_moe": Qwen35Adapter,
    "gemma4": Gemma4Adapter,
    "gemma4_text": Gemma4Adapter,
    "gemma3_text": Gemma3Adapter,
}


class UnsupportedModelError(ValueError):
    pass


def adapter_for(model: nn.Module, kernels: KernelOptions = DEFAULT_KERNELS) -> TargetAdapter:
    module = type(model).__module__.rsplit(".", 1)[-1]
    if module not in ADAPTERS:
        raise UnsupportedModelError(
            f"no dflash adapter for mlx-lm model type {module!r}; supported: {', '.join(sorted(ADAPTERS))}"
        )
    return ADAPTERS[module](model, kernels)


__all__ = ["ADAPTERS", "ForwardRow", "RollbackRecord", "TargetAdapter", "TargetOutput", "UnsupportedModelError", "adapter_for"]
