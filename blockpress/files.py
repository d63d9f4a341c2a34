"""Files written whole or not at all: every save (checkpoints, trainer state, tokenizer files) goes through here.
No torch: the tokenizer, which imports without it, writes its files with it too."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


class StagedFiles:
    """Files written beside their destinations under temporary names, then moved into place together by `commit`.
    os.replace is atomic, so a save killed part-way (SIGKILL, a full disk, a crash) leaves each destination whole, as
    it was or as written: written in place, a killed save left a truncated file, and a training run that saves over
    its own checkpoint lost it. Files are flushed to disk before the first is moved, and moved in the order they were
    staged (a checkpoint's commit marker last). As a context manager: committed on leaving, discarded on an error."""

    def __init__(self) -> None:
        self.moves: list[tuple[Path, Path]] = []  # (temporary, destination)

    def write(self, path: str | Path, write: Callable[[Path], None]) -> None:
        """Stage `path`, its content written by `write(temporary)`."""
        path = Path(path)
        temporary = path.with_name(f".{path.name}.tmp")  # hidden: no checkpoint file pattern matches it
        temporary.unlink(missing_ok=True)  # one left by a killed save
        temporary.touch()  # the mode the umask gives: safetensors creates its files private (0600)
        mode = temporary.stat().st_mode & 0o777
        self.moves.append((temporary, path))  # before writing: discarding removes a partial one
        write(temporary)
        os.chmod(temporary, mode)
        with open(temporary, "rb+") as f:  # on disk before any destination is replaced by it
            os.fsync(f.fileno())

    def write_text(self, path: str | Path, text: str) -> None:
        self.write(path, lambda temporary: temporary.write_text(text))

    def commit(self) -> None:
        folders = []
        for temporary, path in self.moves:
            os.replace(temporary, path)
            if path.parent not in folders:
                folders.append(path.parent)
        self.moves = []
        if os.name == "posix":  # the renames themselves on disk (a folder cannot be opened for fsync on Windows)
            for folder in folders:
                fd = os.open(folder, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def discard(self) -> None:
        for temporary, _ in self.moves:
            temporary.unlink(missing_ok=True)
        self.moves = []

    def __enter__(self) -> StagedFiles:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Write the file at `path` whole or not at all: `write(temporary)` writes it beside `path`, which it then
    replaces (StagedFiles)."""
    with StagedFiles() as files:
        files.write(path, write)
