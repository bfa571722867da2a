"""Find model files: a local directory as is, otherwise a Hugging Face repo through huggingface_hub
(cached, with its progress bars). Failures say what to download or which local path to pass."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


class ModelNotFoundError(FileNotFoundError):
    pass


def looks_like_local_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).expanduser().exists()


# What a server needs from a repo (not, say, the original PyTorch weights of a converted model).
TARGET_FILES = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
DRAFTER_FILES = ["*.json", "*.safetensors"]


def resolve(
    name: str, revision: Optional[str] = None, *, files: Optional[list[str]] = None, allow_download: bool = True
) -> Path:
    if name.startswith("demo:"):
        from .demo import DEMO_TARGET, demo_target_dir

        if name != DEMO_TARGET:
            raise ModelNotFoundError(f"{name}: unknown demo model (known: {DEMO_TARGET})")
        return demo_target_dir()
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path}: no config.json (expected a Hugging Face model directory)")
        return path
    if looks_like_local_path(name) or name.count("/") != 1:
        raise ModelNotFoundError(f"{name}: no such directory, and not a Hugging Face repo id (owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        # Cached files first, so a model already on disk needs no network at all.
        return Path(snapshot_download(name, revision=revision, allow_patterns=files, local_files_only=True))
    except LocalEntryNotFoundError:
        if not allow_download:
            raise ModelNotFoundError(_not_cached(name, revision)) from None
    try:
        # huggingface_hub draws its progress bars; files already cached are not fetched again.
        return Path(snapshot_download(name, revision=revision, allow_patterns=files))
    except Exception as e:  # offline, unknown repo, gated repo, ...
        raise ModelNotFoundError(f"{_not_cached(name, revision)}\n  download failed: {type(e).__name__}: {e}") from e


def _not_cached(name: str, revision: Optional[str]) -> str:
    rev = f" --revision {revision}" if revision else ""
    return (
        f"{name}{'@' + revision if revision else ''} is not in the local Hugging Face cache. "
        f"Download it on a machine with network access (`hf download {name}{rev}`) "
        "or pass the path of a local model directory."
    )
