"""Where trl-tree keeps the models it builds (the tiny test model, SmolLM2's prepared folder, warm starts), and how
they are written so that an interrupted or concurrent build never leaves a folder that loads as a broken model."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path


def cache_root(cache_dir: str | None = None) -> Path:
    """`cache_dir`, else `$TRL_TREE_CACHE`, else `~/.cache/trl_tree`; read at call time so tests can redirect it."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("TRL_TREE_CACHE") or Path.home() / ".cache" / "trl_tree")


def save_model_atomically(path: Path, tokenizer, model, extra_files: dict[str, str] | None = None) -> None:
    """Save into a fresh folder next to `path`, then rename it to `path`; whatever fails, remove the partial folder,
    so an interrupted save never leaves a folder that later loads as a broken model. If another process finished
    the same folder first, its copy is kept. `extra_files` (name -> text) are written into the folder before the
    rename, so a reader that finds the folder finds them too."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        tokenizer.save_pretrained(staging)
        model.save_pretrained(staging)
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text)
        os.rename(staging, path)
    except OSError as error:
        if error.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not path.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # a no-op after a successful rename
