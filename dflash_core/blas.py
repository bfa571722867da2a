"""A fast BLAS for MLX's Linux CPU backend.

MLX's Linux CPU wheel links the netlib reference BLAS, tens of times slower than MKL or OpenBLAS
for float32 matmuls (docs/performance.md, "The CPU path"). MLX calls the standard CBLAS entry points (cblas_sgemm, ...),
so a library that exports them, loaded with RTLD_GLOBAL before MLX is, takes those calls: the
dynamic loader resolves a dlopen'ed library's symbols in the global scope first. `dflash` does
this at start (`launch.py`), before anything imports MLX:

1. MKL from PyPI's `mkl` package (a dependency on x86-64 Linux; its `intel-openmp` threads it),
2. else a system OpenBLAS (Debian's libopenblas0, for instance),
3. else the reference BLAS stays.

`DFLASH_BLAS=reference` keeps the reference BLAS (or `DFLASH_BLAS=/path/to/lib.so` names one).
Nothing here imports MLX. `dflash doctor` says which library answers, with a measured matmul.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys
from pathlib import Path
from typing import Optional

CHOICE_VARIABLE = "DFLASH_BLAS"


def candidates() -> list[str]:
    """Fast CBLAS libraries on this machine, best first."""
    if not sys.platform.startswith("linux"):
        return []  # macOS: MLX uses Accelerate already
    prefixes = {sys.prefix, sys.base_prefix}
    found = [p for prefix in prefixes for p in sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))]
    for pattern in ("/usr/lib/*/libopenblas.so.0", "/usr/lib/*/openblas*/libopenblas.so.0", "/usr/lib64/libopenblas.so.0",
                    "/usr/lib/libopenblas.so.0"):
        found += sorted(glob.glob(pattern))
    return found


def preload() -> Optional[str]:
    """Load the fast BLAS globally (before MLX); returns its path, or None. Call before importing
    mlx: once MLX is loaded its calls are bound."""
    choice = os.environ.get(CHOICE_VARIABLE, "auto")
    if choice == "reference" or "mlx.core" in sys.modules:
        return None
    paths = [choice] if choice != "auto" else candidates()
    for path in paths:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return path
    return None


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def provider() -> Optional[str]:
    """The file whose `cblas_sgemm` the global symbol scope resolves to (what MLX, loaded after,
    calls), or None when no library there exports it (MLX then uses its bundled reference BLAS)."""
    try:
        process = ctypes.CDLL(None)
        address = ctypes.cast(process.cblas_sgemm, ctypes.c_void_p)
    except (AttributeError, OSError):
        return None
    info = _DlInfo()
    if not process.dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return info.dli_fname.decode()


@functools.cache
def rounds_by_rows() -> bool:
    """Whether MLX's float32 products in this process go to a BLAS whose rounding of a row may
    depend on the other rows: any but the reference BLAS MLX bundles (a fast one picks its kernels
    and its order of summation by the matrices' shapes, so a 16-row verify and a 1-row decode step
    would round a token's product differently). Fixed once MLX is loaded."""
    return provider() is not None


def describe() -> str:
    """Which BLAS answers MLX's float32 matmuls, and how fast (for `dflash doctor`)."""
    import time

    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return "not used (MLX runs on a GPU)"
    loaded = provider() if sys.platform.startswith("linux") else None
    if sys.platform == "darwin":
        name = "Accelerate (MLX's own)"
    elif loaded and "mlx" not in loaded:
        name = f"{Path(loaded).name} ({loaded})"
    else:
        name = "MLX's bundled reference BLAS (slow: `pip install mkl` on x86-64, or install libopenblas0)"
    a = mx.random.normal((1024, 1024))
    mx.eval(a @ a)
    start = time.perf_counter()
    mx.eval(a @ a)
    return f"{name}: a 1024x1024 float32 matmul takes {1e3 * (time.perf_counter() - start):.1f} ms"
