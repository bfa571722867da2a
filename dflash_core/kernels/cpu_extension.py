"""This project's CPU primitives as one C++ MLX extension, compiled on first use.

The sources beside this file (`cpu_module.cpp`, the module; `cpu_linear.cpp`, products with narrow
weights; `cpu_softmax.cpp`, attention's softmax; `cpu_attention.cpp`, attention's two products;
`cpu_kernels.h`, what they share) are built by CMake with nanobind (MLX's binding library, at the
ABI MLX's Python module was built with) into the
cache, once per sources, MLX and Python (about 15 s on 2 cores). `load_model` starts the build in
a thread (`build_in_background`) so that it overlaps reading the weights (a first `dflash serve`
converts the demo's GGUF meanwhile). The primitives run inside MLX's graphs
(compiled blocks included) like any op. Where the module cannot be had (not x86-64 Linux with AVX2,
FMA and F16C, no C++ compiler or CMake) `extension()` is None and callers keep MLX's own ops.
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
import threading
from pathlib import Path
from types import ModuleType
from typing import Optional

import mlx.core as mx

from . import backend
from .cpu_head import cpu_supports

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = ("cpu_module.cpp", "cpu_linear.cpp", "cpu_softmax.cpp", "cpu_attention.cpp")
HEADERS = ("cpu_kernels.h",)
MODULE = "dflash_cpu_kernels"

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
nanobind_add_module({MODULE} NB_STATIC NOMINSIZE NB_DOMAIN mlx {" ".join(SOURCES)})
target_compile_definitions({MODULE} PRIVATE MODULE_NAME={MODULE})
target_compile_options({MODULE} PRIVATE -O3 -mavx2 -mfma -mf16c)
target_link_libraries({MODULE} PRIVATE mlx)
# One translation unit per target: every source of ours includes MLX's and nanobind's headers, whose
# parsing was most of the build (measured on 2 cores: 22 s of build, 15 s this way).
set_target_properties({MODULE} nanobind-static PROPERTIES UNITY_BUILD ON)
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

    key = "\n".join([*((HERE / name).read_text() for name in SOURCES + HEADERS), CMAKE_LISTS, str(_mlx_dir()),
                     mx.__version__, nanobind.__version__, sys.version, platform.platform()])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _build(out: Path, cmake: str) -> None:
    import nanobind

    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        work = Path(tmp)
        (work / "CMakeLists.txt").write_text(CMAKE_LISTS)
        for name in SOURCES + HEADERS:
            shutil.copy(HERE / name, work / name)
        configure = [cmake, "-S", str(work), "-B", str(work / "build"), f"-DPython_EXECUTABLE={sys.executable}",
                     f"-Dnanobind_DIR={nanobind.cmake_dir()}",
                     f"-DMLX_DIR={_mlx_dir() / 'share' / 'cmake' / 'MLX'}"]
        for command in (configure, [cmake, "--build", str(work / "build"), "-j", str(os.cpu_count() or 1)]):
            subprocess.run(command, check=True, capture_output=True, timeout=600)
        library = next((work / "build").glob(f"{MODULE}*.so"))
        library.replace(out)  # atomic: another process sees the whole file or none


@functools.cache
def extension() -> Optional[ModuleType]:
    """The compiled module (built once per sources, MLX and Python into the cache), or None where
    it cannot be."""
    path = built()
    if path is None:
        return None
    spec = importlib.util.spec_from_file_location(MODULE, path)
    try:
        module = importlib.util.module_from_spec(spec)  # (an unresolved symbol fails here)
        spec.loader.exec_module(module)
        # A nanobind of another ABI than MLX's module loads, but cannot take MLX's arrays.
        module.half_linear(mx.zeros((1, 16)), mx.zeros((1, 16), dtype=mx.float16), 1)
    except (ImportError, TypeError) as e:
        log.info("the CPU kernels did not load (%s): MLX's own products and softmax instead", e)
        return None
    return module


def built() -> Optional[Path]:
    """The module's file in the cache, compiled first if it is not there; None where it cannot be.
    Processes starting together build it once (a file lock), and so do a process's threads (the
    background build and a model's load: the second waits for the first). No MLX op runs here, so
    that a thread may call it while another runs MLX."""
    with _BUILDING:
        return _built()


_BUILDING = threading.Lock()  # guards _built's cache: a process compiles the module at most once


@functools.cache
def build_in_background() -> None:
    """Start compiling the module in a daemon thread (once per process; where it runs), so that it
    builds while the caller loads weights; `extension()` then finds it built or waits for it."""
    if backend() == "cpu" and cpu_supports():
        threading.Thread(target=built, name="dflash-cpu-kernels", daemon=True).start()


@functools.cache
def _built() -> Optional[Path]:
    if not cpu_supports():
        return None
    cmake = _cmake()
    try:
        import nanobind  # noqa: F401
    except ImportError:
        cmake = None
    if cmake is None:
        log.info("no CMake or nanobind: the CPU keeps MLX's own products and softmax")
        return None
    from ..demo import cache_root

    root = cache_root() / "kernels"
    path = root / f"cpu_kernels-{_digest()}.so"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / "cpu_kernels.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():
                log.info("compiling the CPU kernels (once, about 15 s) into %s", path)
                _build(path, cmake)
    except (OSError, subprocess.SubprocessError, StopIteration) as e:
        output = getattr(e, "stderr", None) or getattr(e, "stdout", None) or b""
        log.warning("the CPU kernels did not compile (%s): MLX's own products and softmax instead%s", e,
                    "\n" + output.decode(errors="replace")[-4000:] if output else "")
        return None
    return path
