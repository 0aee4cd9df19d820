"""Finds a model directory on local disk: a path, a hub id already cached, or the bundled model.

Nothing here touches the network: kvscope never downloads weights.
"""
from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
# An installed wheel carries the demo model inside the package (pyproject.toml maps it there);
# a source checkout or an editable install reads it from its home in the repository, assets/.
BUNDLED_MODEL_LOCATIONS = (_PACKAGE / "_demo_model", _PACKAGE.parent / "assets" / "kvscope-demo")
BUNDLED_MODEL = next((p for p in BUNDLED_MODEL_LOCATIONS if (p / "config.json").exists()),
                     BUNDLED_MODEL_LOCATIONS[0])


def resolve_model_dir(model: str | os.PathLike | None) -> str:
    if model is None:
        if not (BUNDLED_MODEL / "config.json").exists():
            raise FileNotFoundError(
                f"the bundled demo model is missing (looked in {', '.join(map(str, BUNDLED_MODEL_LOCATIONS))}); "
                "reinstall kvscope (pip install kvscope, or pip install -e . in its source tree) "
                "or pass model=<local HF directory>"
            )
        return str(BUNDLED_MODEL)
    path = _local_path(model, "model")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return str(path)
    if path.exists():
        raise ValueError(f"model={str(model)!r} is a file; pass a HF-format model directory")
    return _cached_hub_snapshot(str(model), "model")


def _local_path(value: str | os.PathLike, arg: str) -> Path:
    """``value`` as a local path, refused naming ``arg`` where the system cannot even look it up
    (a name too long for the filesystem, say), which ``is_dir`` would raise as a bare OSError."""
    path = Path(value).expanduser()
    try:
        path.exists()
    except OSError as exc:
        text = str(value)
        shown = repr(text) if len(text) <= 80 else f"{text[:40] + '...'!r} ({len(text)} characters)"
        raise ValueError(f"{arg}={shown} is not a path this system can look up: {exc.strerror}") from None
    return path


def _cached_hub_snapshot(repo_id: str, arg: str) -> str:
    """``repo_id``'s snapshot in the local Hugging Face cache, never the network; ``arg`` is the
    argument that named it, for the error."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError) as exc:
        raise FileNotFoundError(
            f"{arg}={repo_id!r} is neither a local directory nor in the local Hugging Face cache "
            f"({os.environ.get('HF_HUB_CACHE') or os.environ.get('HF_HOME') or '~/.cache/huggingface'}). "
            "kvscope never downloads weights: fetch it once with `huggingface-cli download "
            f"{repo_id}` on a machine with network access, or pass a local path."
        ) from exc
    except Exception as exc:  # invalid repo id and similar
        raise FileNotFoundError(f"{arg}={repo_id!r} is not a local directory and not a cached hub id: {exc}") from exc


# Files that hold a tokenizer's vocabulary (fast, SentencePiece, BPE, WordPiece, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "*.tiktoken")


def resolve_tokenizer_dir(tokenizer: str | None, model_dir: str) -> str:
    """The directory to load the tokenizer from: ``tokenizer`` (a directory, or a hub id already
    in the local cache), else the model's.

    transformers loads a directory without vocabulary files as an empty tokenizer, and every
    text prompt then tokenizes to nothing; refuse it here instead, naming the fix.
    """
    path = _local_path(tokenizer, "tokenizer") if tokenizer else Path(model_dir)
    if tokenizer and not path.is_dir():
        if path.exists():
            raise ValueError(f"tokenizer={tokenizer!r} is a file; pass a directory with tokenizer files")
        path = Path(_cached_hub_snapshot(tokenizer, "tokenizer"))
    if not any(next(path.glob(pattern), None) for pattern in TOKENIZER_FILES):
        which = f"tokenizer={tokenizer!r}" if tokenizer else f"the model directory {model_dir}"
        raise FileNotFoundError(
            f"{which} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); pass "
            "tokenizer=<a directory with them>, or skip_tokenizer_init=True to give and get token ids only"
        )
    return str(path)
