"""Small filesystem helpers shared by checkpoints, calibration artifacts and scripts."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator


def check_folder(directory: str | os.PathLike, *, overwrite: bool = False) -> str:
    """`directory` as an absolute path, if `atomic_folder` may write it: FileExistsError when it exists and is
    not a folder, or is a folder that is not empty and not `overwrite` (for a script to refuse before work)."""
    directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise FileExistsError(f"{directory} exists and is not a folder")
    if os.path.isdir(directory) and os.listdir(directory) and not overwrite:
        raise FileExistsError(f"{directory} exists and is not empty; pass overwrite=True (--overwrite) to replace it")
    return directory


@contextlib.contextmanager
def atomic_folder(directory: str | os.PathLike, *, overwrite: bool = False) -> Iterator[str]:
    """Write a folder atomically: yields a fresh temporary folder beside `directory` to fill, and
    renames it into place only when the block completes, so an interruption leaves `directory` as it
    was. A `directory` that exists and is not empty raises FileExistsError unless `overwrite`, which
    swaps the new folder in (the old one is removed only after the new one is in place)."""
    directory = check_folder(directory, overwrite=overwrite)
    parent, name = os.path.split(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.partial-", dir=parent)
    try:
        yield tmp
        old = None
        if os.path.exists(directory):
            old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
            os.rename(directory, os.path.join(old, name))
        os.rename(tmp, directory)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
