"""Token ids of the built-in corpora kept on disk between processes.

Tokenizing the calibration text (several million tokens) took about as long as a small model's
whole conversion on two CPU cores, in every process that calibrates. The ids depend only on the
text and the tokenizer, so they are stored under a name made of both digests and read back by any
later process: ``$COMERA_CACHE`` if set, else ``$XDG_CACHE_HOME/comera_convert`` (by default
``~/.cache/comera_convert``). A folder that cannot be written is skipped: the ids are then tokenized
each time, as without a cache. Deleting the folder is always safe.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import load_file, save_file

CACHE_VARIABLE = "COMERA_CACHE"
FORMAT = "1"  # part of every name: a change of layout reads none of the files written before it


def cache_folder() -> Path:
    """Where token ids are kept: ``$COMERA_CACHE``, else the XDG cache folder's ``comera_convert``
    (the temporary folder's where there is no home folder)."""
    if os.environ.get(CACHE_VARIABLE):
        return Path(os.environ[CACHE_VARIABLE]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "comera_convert"
    try:
        return Path.home() / ".cache" / "comera_convert"
    except RuntimeError:  # no home folder to find (a container's user without one)
        return Path(tempfile.gettempdir()) / "comera_convert"


def text_digest(texts: Iterable[str]) -> str:
    """A digest of the documents, in order (reading them costs a fraction of tokenizing them)."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8", "surrogatepass"))
        digest.update(b"\x00")
    return digest.hexdigest()


def cache_path(source: str, text: str, tokenizer: str) -> Path:
    """The file that holds the ids of ``source`` whose text has digest ``text``, by the tokenizer of
    digest ``tokenizer``."""
    name = hashlib.sha256(f"{FORMAT}\n{text}\n{tokenizer}".encode()).hexdigest()[:32]
    return cache_folder() / "token-ids" / f"{source.replace('+', '-')}-{name}.safetensors"


def read_ids(path: Path) -> list[torch.Tensor] | None:
    """The documents' ids kept at ``path``, or None when there are none to read."""
    try:
        kept = load_file(path)
        return list(torch.split(kept["ids"], kept["lengths"].tolist()))
    except Exception:  # absent, unreadable or cut short: tokenized again and written anew
        return None


def write_ids(path: Path, ids: list[torch.Tensor]) -> None:
    """Keep ``ids`` at ``path`` (written whole or not at all; a folder that cannot be written is skipped)."""
    lengths = torch.tensor([len(doc) for doc in ids], dtype=torch.int64)
    flat = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int32)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".partial")
        os.close(handle)
        try:
            save_file({"ids": flat.contiguous(), "lengths": lengths}, temporary)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)
    except OSError:
        return
