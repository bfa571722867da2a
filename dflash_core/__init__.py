"""dflash_core: lossless DFlash speculative decoding on MLX (no HTTP here)."""

__version__ = "0.1.0"
