"""The fast BLAS: `dflash` loads it before MLX, and MLX's float32 matmuls then go to it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dflash_core.blas import candidates

PROBE = """
import json, sys
from dflash_core.blas import preload, provider
loaded = preload()
import mlx.core as mx
a = mx.ones((64, 64))
print(json.dumps({"loaded": loaded, "provider": provider(), "sum": (a @ a).sum().item()}))
"""


def _probe(**env) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
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


def test_too_late_is_a_no_op():
    """Once MLX is loaded its calls are bound: preloading then does nothing."""
    import mlx.core  # noqa: F401

    from dflash_core.blas import preload

    assert preload() is None
