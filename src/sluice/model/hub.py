"""Turn a local path or a Hugging Face repo id into a local model directory, never touching the network."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelNotFoundError
from .hf_fields import shown


def hf_cache_dir() -> Path:
    """The hub cache huggingface_hub would use, computed from the environment *now*.

    huggingface_hub.constants freezes these at import time, which would ignore a later HF_HOME change
    (tests, notebooks, a CLI flag that sets the variable), so we repeat its precedence rules here.
    """
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
        home = os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")
        cache = os.path.join(home, "hub")
    return Path(os.path.expandvars(cache)).expanduser()


def _looks_like_path(text: str) -> bool:
    return text.startswith((".", "/", "~", "\\")) or os.path.isabs(text)


def resolve_model_dir(path_or_repo_id: str | os.PathLike) -> Path:
    """Return the directory holding config.json, tokenizer.json, weights for `path_or_repo_id`.

    A local directory wins; anything else is a repo id looked up in the local HF cache (offline).
    """
    try:
        text = os.fsdecode(path_or_repo_id)
    except TypeError:
        raise ModelNotFoundError(f"a model is a directory path or a repo id (a string), got "
                                 f"{shown(path_or_repo_id)}") from None
    if not text or "\0" in text:
        raise ModelNotFoundError(f"model path {shown(text)} is empty or contains a NUL byte")
    try:
        local = Path(text).expanduser()
        is_dir, exists = local.is_dir(), local.exists()
    except (OSError, RuntimeError) as e:  # ENAMETOOLONG, EACCES on a parent; RuntimeError: ~nosuchuser
        raise ModelNotFoundError(f"model path {shown(text)} cannot be used: {getattr(e, 'strerror', None) or e}"
                                 ) from None
    if is_dir:
        if not os.access(local, os.R_OK | os.X_OK):
            raise ModelNotFoundError(f"model directory {shown(text)} is not readable (permission denied)")
        return local.resolve()
    if _looks_like_path(text) or exists:
        what = "is a file, not a directory" if exists else "does not exist"
        raise ModelNotFoundError(f"model path {shown(text)} {what}; pass a directory holding config.json")

    # Imported here so that loading a local directory never pays for importing huggingface_hub.
    from huggingface_hub import snapshot_download

    cache = hf_cache_dir()
    try:
        # local_files_only makes huggingface_hub read refs/ and snapshots/ only, with no HTTP at all.
        snapshot = snapshot_download(text, cache_dir=str(cache), local_files_only=True)
    except (OSError, ValueError) as err:  # LocalEntryNotFoundError is an OSError, HFValidationError a ValueError
        invalid = f" It is not a valid repo id either: {str(err)[:300]}" if isinstance(err, ValueError) else ""
        name = shown(text)
        raise ModelNotFoundError(
            f"{name} is not a local directory, and the repo id {name} is not in the Hugging Face cache "
            f"at {cache} (set by HF_HUB_CACHE, else HF_HOME/hub).{invalid} sluice never downloads: run "
            f"`huggingface-cli download {text[:200]}` (or `hf download {text[:200]}`) on a machine with "
            f"network access and copy the cache over, or pass the path of a local model directory."
        ) from err
    return Path(snapshot).resolve()


def file_roots(model_dir: Path) -> list[Path]:
    """Where a model directory's files may really live: the directory itself and, for a Hugging Face cache
    snapshot (models--org--name/snapshots/<commit>/), its repo's blobs/ folder, which the snapshot's
    symlinks point into. Anything else a name or a link leads to is outside the model."""
    root = model_dir.resolve()
    return [root, root.parents[1] / "blobs"] if root.parent.name == "snapshots" else [root]


def is_inside(model_dir: Path, real: Path) -> bool:
    """Whether the resolved path `real` lies in one of file_roots(model_dir)."""
    return any(real.is_relative_to(root) for root in file_roots(model_dir))
