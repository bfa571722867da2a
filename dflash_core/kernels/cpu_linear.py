"""A decode step's weight products on the CPU with narrow weights, inside MLX's graph.

On MLX's CPU backend a decode step of a small model reads its float32 weights through the BLAS
(MKL reaches about 16 GB/s on this project's 2 cores), and MLX has no fast path for narrower
weights: its float16 and quantized CPU matmuls are 4-40x slower than float32 (`benchmarks/
cpu_matmul.py`). So on the CPU a target's large float32 projections get a narrow copy at load
(`add_narrow_copies`), which decode and verify forwards multiply in our kernels (`cpu_linear.cpp`:
AVX2, FMA and F16C, threads) as an MLX primitive: it runs inside the compiled blocks like any op,
with no trip to the host between layers. The copy (`narrow_copy`) is int8 blocks of 32 with a
float32 scale each where the float32 weights are exactly that, as a GGUF's Q8_0, Q5_0 and Q4_0
tensors converted to float32 are, or with a float32 offset each too (Q4_K's): the same weights in
about a quarter of the bytes; else float16 (the weights rounded to float16, products and sums in
float32: half the bytes). Prefill keeps the
float32 weights and MLX's product: at hundreds of rows it is compute-bound, where MKL's GEMM is
the faster one (`TargetAdapter.prefill_kernels`).

Each output is one sum in a fixed order whatever the other rows of the call, so a 16-token verify
and a 1-token step give a token the same result to the bit, and speculative output stays exactly
the target-alone output (tests/test_cpu_linear.py). The copies take memory besides the float32
weights (the demo's: 126 MB).

The primitive is a C++ MLX extension, compiled on first use (about 20 s) by CMake with nanobind
(MLX's binding library, at the ABI MLX's Python module was built with) into the cache. Where it
cannot run (not the CPU backend, not x86-64 Linux with AVX2/FMA/F16C, no C++ compiler or CMake,
`KernelOptions.cpu_narrow_linears` off) MLX multiplies the float32 weights.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from . import backend
from .cpu_head import affine_blocks, cpu_supports, default_threads, int8_blocks

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_linear.cpp")
MODULE = "dflash_cpu_linear"
# Below this a projection's bytes are not what a step costs (and the tests' tiny models keep MLX's).
MIN_PARAMETERS = 1 << 16
FLOAT16_MAX = 65504.0

CMAKE_LISTS = f"""
cmake_minimum_required(VERSION 3.24)
project({MODULE} LANGUAGES CXX)
set(CMAKE_CXX_STANDARD 20)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
set(CMAKE_BUILD_TYPE Release)
find_package(Python 3.10 COMPONENTS Interpreter Development.Module REQUIRED)
find_package(nanobind CONFIG REQUIRED)
find_package(MLX CONFIG REQUIRED)
# NB_DOMAIN mlx: the domain MLX's Python module registers its array type in.
nanobind_add_module({MODULE} NB_STATIC NOMINSIZE NB_DOMAIN mlx cpu_linear.cpp)
target_compile_definitions({MODULE} PRIVATE MODULE_NAME={MODULE})
target_compile_options({MODULE} PRIVATE -O3 -mavx2 -mfma -mf16c)
target_link_libraries({MODULE} PRIVATE mlx)
"""


def _cmake() -> Optional[str]:
    found = shutil.which("cmake")
    if found:
        return found
    try:  # PyPI's cmake package (a dependency on Linux) puts its binary beside the interpreter
        import cmake

        return str(Path(cmake.CMAKE_BIN_DIR) / "cmake")
    except ImportError:
        return None


def _mlx_dir() -> Path:
    """The installed mlx package (its headers, library and CMake files), from the loaded module."""
    return Path(mx.__file__).parent


def _digest() -> str:
    import nanobind

    key = "\n".join([SOURCE.read_text(), CMAKE_LISTS, str(_mlx_dir()), mx.__version__,
                     nanobind.__version__, sys.version, platform.platform()])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _build(out: Path, cmake: str) -> None:
    import nanobind

    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        work = Path(tmp)
        (work / "CMakeLists.txt").write_text(CMAKE_LISTS)
        shutil.copy(SOURCE, work / "cpu_linear.cpp")
        configure = [cmake, "-S", str(work), "-B", str(work / "build"), f"-DPython_EXECUTABLE={sys.executable}",
                     f"-Dnanobind_DIR={nanobind.cmake_dir()}",
                     f"-DMLX_DIR={_mlx_dir() / 'share' / 'cmake' / 'MLX'}"]
        for command in (configure, [cmake, "--build", str(work / "build"), "-j", str(os.cpu_count() or 1)]):
            subprocess.run(command, check=True, capture_output=True, timeout=600)
        built = next((work / "build").glob(f"{MODULE}*.so"))
        built.replace(out)  # atomic: another process sees the whole file or none


@functools.cache
def extension() -> Optional[ModuleType]:
    """The compiled primitive (built once per source, MLX and Python into the cache), or None where
    it cannot be. Processes starting together build it once (a file lock)."""
    if not cpu_supports():
        return None
    cmake = _cmake()
    try:
        import nanobind  # noqa: F401
    except ImportError:
        cmake = None
    if cmake is None:
        log.info("no CMake or nanobind: decode on the CPU keeps MLX's float32 product")
        return None
    from ..demo import cache_root

    root = cache_root() / "kernels"
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"cpu_linear-{_digest()}.so"
    with open(root / "cpu_linear.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            log.info("compiling the CPU decode kernel (once, about 20 s) into %s", path)
            try:
                _build(path, cmake)
            except (OSError, subprocess.SubprocessError, StopIteration) as e:
                log.info("the CPU decode kernel did not compile (%s): MLX's float32 product instead", e)
                return None
    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        # A nanobind of another ABI than MLX's module loads, but cannot take MLX's arrays.
        module.half_linear(mx.zeros((1, 16)), mx.zeros((1, 16), dtype=mx.float16), 1)
    except (ImportError, TypeError) as e:
        log.info("the CPU decode kernel did not load (%s): MLX's float32 product instead", e)
        return None
    return module


NARROW_WEIGHT = "_cpu_weight"  # a layer's copy; the leading "_" keeps it out of parameters() and saves


def narrow_linear(x: mx.array, weight: tuple) -> mx.array:
    """x [..., K] float32 @ W.T in the primitive, W a copy made by `narrow_copy`: (float16 [N, K],),
    (int8 [N, K], float32 scales [N, K / 32]) or (int8, scales, float32 biases [N, K / 32])."""
    module = extension()
    if len(weight) == 1:
        return module.half_linear(x, weight[0], default_threads())
    if len(weight) == 2:
        return module.int8_linear(x, *weight, default_threads())
    return module.affine_linear(x, *weight, default_threads())


def narrow_copy(weight: mx.array) -> Optional[tuple]:
    """The copy of a float32 weight [N, K] the primitive multiplies: its int8 blocks where the
    weights are exactly that (a GGUF's Q8_0, Q5_0 or Q4_0 converted to float32: the same weights in a
    quarter of the bytes), or int8 blocks with a bias each (Q4_K's), else float16 (the weights
    rounded: half the bytes); None for a weight beyond float16's range."""
    blocks = int8_blocks(weight)
    if blocks is None:
        blocks = affine_blocks(weight)
    if blocks is not None:
        return tuple(mx.array(a) for a in blocks)
    if mx.abs(weight).max().item() >= FLOAT16_MAX:
        return None
    return (weight.astype(mx.float16),)


def cpu_weight(layer: nn.Module, x: mx.array) -> Optional[tuple]:
    """The copy `layer(x)` is multiplied by here (a plain linear layer given one by
    `add_narrow_copies`, a float32 input, on the CPU), else None."""
    if type(layer) is not nn.Linear or x.dtype != mx.float32 or backend() != "cpu":
        return None
    return layer.get(NARROW_WEIGHT)


def add_narrow_copies(modules: list[nn.Module], min_parameters: int = MIN_PARAMETERS) -> int:
    """Give the plain linear layers in `modules` whose float32 weight has `min_parameters`+
    parameters the copy the primitive multiplies (`narrow_copy`), where it runs here; returns how
    many got one."""
    if backend() != "cpu":
        return 0
    layers = [layer for module in modules for _, layer in module.named_modules()
              if type(layer) is nn.Linear and NARROW_WEIGHT not in layer and layer.weight.dtype == mx.float32
              and layer.weight.size >= min_parameters]
    if not layers or extension() is None:  # (nothing to build for models without such layers)
        return 0
    copies = []
    for layer in layers:
        copy = narrow_copy(layer.weight)
        if copy is not None:
            setattr(layer, NARROW_WEIGHT, copy)
            copies.append(copy)
    mx.eval(copies)
    return len(copies)


def active_path() -> str:
    """What a decode step's projections use here (for `dflash doctor`)."""
    if backend() != "cpu":
        return "not used (MLX runs on a GPU)"
    if not cpu_supports():
        return "MLX's float32 product (the kernel needs x86-64 Linux with AVX2, FMA and F16C)"
    module = extension()
    if module is None:
        return "MLX's float32 product (the kernel did not build: is there a C++ compiler and CMake?)"
    return (f"int8 or float16 copies in our MLX primitive ({module.__file__}) for projections of {MIN_PARAMETERS}+ "
            "parameters in decode and verify")
