"""The fast BLAS: `dflash` loads it before MLX, and MLX's float32 matmuls then go to it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dflash_core.blas import candidates

PROBE = """
import json, os, sys
from dflash_core.blas import preload, provider
loaded = preload()
import mlx.core as mx
a = mx.ones((64, 64))
print(json.dumps({"loaded": loaded, "provider": provider(), "sum": (a @ a).sum().item(),
                  "blocktime": os.environ.get("KMP_BLOCKTIME")}))
"""


def _probe(**env) -> dict:
    base = {k: v for k, v in os.environ.items() if k != "KMP_BLOCKTIME"}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not candidates(), reason="no fast BLAS on this machine (pip install mkl on x86-64 Linux)")
def test_mlx_matmuls_go_to_the_fast_blas():
    fast = _probe()
    assert fast["loaded"] == candidates()[0]
    assert fast["provider"] == fast["loaded"]  # the symbol MLX calls is the fast library's
    assert fast["sum"] == 64.0 ** 3
    reference = _probe(DFLASH_BLAS="reference")
    assert reference["loaded"] is None and reference["provider"] is None
    assert reference["sum"] == fast["sum"]
    assert reference["blocktime"] is None  # only MKL's OpenMP threads are told to sleep


@pytest.mark.skipif(not any("mkl" in c for c in candidates()), reason="no MKL on this machine")
def test_mkl_threads_sleep_between_products_unless_told_otherwise():
    assert _probe()["blocktime"] == "0"
    assert _probe(KMP_BLOCKTIME="50")["blocktime"] == "50"  # the user's setting stands


def test_too_late_is_a_no_op():
    """Once MLX is loaded its calls are bound: preloading then does nothing."""
    import mlx.core  # noqa: F401

    from dflash_core.blas import preload

    assert preload() is None
