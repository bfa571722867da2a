"""Which MLX backend wheel owns the MLX library installed in this Python environment.

On Linux the `mlx` wheel holds the Python bindings only; a backend wheel ships the library
(mlx/lib/libmlx.so): mlx-cpu for `pip install .`, mlx-cuda-13 for `pip install ".[cuda]"`. The
`[cuda]` install brings both, and both write the same file, so the one installed last owns it (see
docker/README.md). This script compares the file on disk with each backend's RECORD hash; it
imports nothing from MLX, so it also runs where the CUDA library cannot load (a build without a
GPU).

    python mlx_backend.py                 # print the backends and the owner
    python mlx_backend.py --expect cuda13 # exit 1 unless mlx-cuda-13 owns the library

Standard library only: the Dockerfiles run it at build time.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import sys
from importlib import metadata

# Backend distributions of MLX and the name used by --expect.
BACKENDS = {"mlx-metal": "metal", "mlx-cpu": "cpu", "mlx-cuda-13": "cuda13", "mlx-cuda-12": "cuda12", "mlx-cuda": "cuda12"}


def _digest(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def _is_library(record_path: str) -> bool:
    return record_path.startswith("mlx/lib/libmlx.") and record_path.rsplit(".", 1)[-1] in ("so", "dylib", "dll")


def report() -> dict:
    """{"installed": {dist: version}, "library": path or None, "owner": dist or None}."""
    installed, candidates = {}, []
    for dist_name in BACKENDS:
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            continue
        installed[dist_name] = dist.version
        for f in dist.files or []:
            if _is_library(str(f)) and f.hash is not None:
                candidates.append((dist_name, str(f.locate()), f.hash.value))
    library = owner = None
    for dist_name, path, expected in candidates:
        try:
            actual = _digest(path)
        except OSError:  # removed, e.g. by uninstalling another backend that listed the same file
            continue
        library = path
        if actual == expected:
            owner = dist_name
    return {"installed": installed, "library": library, "owner": owner}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--expect", choices=sorted(set(BACKENDS.values())), help="exit 1 unless this backend owns the library")
    args = parser.parse_args(argv)
    r = report()
    installed = ", ".join(f"{k} {v}" for k, v in r["installed"].items()) or "none"
    print(f"backend wheels: {installed}")
    print(f"library: {r['library'] or 'missing'}")
    owner = r["owner"]
    print(f"owner: {owner} ({BACKENDS[owner]})" if owner else "owner: none of the installed backend wheels")
    if args.expect and (owner is None or BACKENDS[owner] != args.expect):
        wanted = [d for d, b in BACKENDS.items() if b == args.expect][0]
        version = r["installed"].get(wanted)
        fix = (f'pip install --force-reinstall --no-deps "{wanted}=={version}"' if version
               else f'{wanted} is not installed: pip install ".[cuda]"' if args.expect == "cuda13" else f"install {wanted}")
        print(f"error: expected the {args.expect} backend ({wanted}) to own the MLX library; repair: {fix}", file=sys.stderr)
        return 1
    return 0 if owner else 1


if __name__ == "__main__":
    sys.exit(main())
