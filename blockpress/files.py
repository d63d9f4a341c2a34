"""Files written whole or not at all: every save (checkpoints, trainer state, tokenizer files, adapters) goes through
here. No torch: the tokenizer, which imports without it, writes its files with it too."""

from __future__ import annotations

import codecs
import glob
import json
import math
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePath, PureWindowsPath
from typing import Any

from safetensors import SafetensorError

from .checks import utf8_problem
from .stopping import STOP_SIGNALS, interrupts_deferred


def expand_user(path: str | Path, name: str) -> Path:
    """`path` with a leading ~ or ~user expanded, as a shell would. A ~user with no such user (or no home known) is
    a ValueError naming `name` (the argument it came from): pathlib raises a bare RuntimeError, 'Could not determine
    home directory.', naming neither the path nor the argument. So is a path holding a NUL byte, which no file
    system takes: every os call on it raises a bare ValueError 'embedded null byte'."""
    if "\x00" in str(path):
        raise ValueError(f"{name}: {str(path)!r} holds a NUL byte (\\x00), which no file name may; give the path "
                         "without it")
    try:
        return Path(path).expanduser()
    except RuntimeError:
        user = str(path).replace(os.sep, "/").split("/")[0]
        raise ValueError(f"{name}: {str(path)!r} starts with {user}, and no home folder is known for "
                         f"{'this user' if user == '~' else f'a user {user[1:]!r}'}; give the path without it") from None


def output_folder(path: Any, name: str) -> Path:
    """A folder path to write into, given as argument `name`: a str or Path, not empty ("" would be the current
    folder), expanded as expand_user expands it (its refusals too), neither a file nor under one (making it said only
    "[Errno 20] Not a directory"), nor a link to nothing (mkdir said a bare "File exists")."""
    if not isinstance(path, (str, Path)) or not str(path).strip():
        raise ValueError(f"{name}: expected a folder path, got {path!r}")
    folder = expand_user(path, name)
    above = next((p for p in folder.parents if p.exists()), None)  # the nearest part of it that is there
    if above is not None and not above.is_dir():
        raise ValueError(f"{name}: {str(folder)!r} is under {str(above)!r}, which is a file, not a folder")
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{name}: {str(folder)!r} is a file; give a folder")
    if folder.is_symlink() and not folder.exists():
        raise ValueError(f"{name}: {str(folder)!r} is a link to {os.readlink(folder)!r}, which does not exist; "
                         "create that folder, or give another path")
    return folder


def same_place(a: str | Path, b: str | Path) -> bool:
    """Whether paths `a` and `b` name one file or folder: by device and inode where both exist (os.path.samefile), else
    by the folder they would be in and their names. Comparing the resolved strings missed a second name for a folder:
    another letter case on a case-insensitive volume (macOS's default; realpath keeps the case it is given there), a
    bind mount or another mount point."""
    a, b = Path(a), Path(b)
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    if a.exists() or b.exists() or a.name != b.name:
        return False
    return a.resolve() == b.resolve() or (a.parent.exists() and b.parent.exists()
                                          and os.path.samefile(a.parent, b.parent))


# A save's tag, in the names of the files it stages: the saving process's id and a random token. One fixed name a file
# (`.{name}.tmp`) was shared by every save into a folder, so two at once (two runs on one --out, Pool workers saving to
# one folder) deleted and moved each other's files: saves failed with FileNotFoundError, or mixed their files.
_TAG = re.compile(r"(?P<pid>[0-9]+)-[0-9a-f]{8}")
_LIVE_TAGS: set[str] = set()  # this process's tags whose files are still in use (a save in another thread)


def new_tag() -> str:
    """A tag for one save's staged files, this process's in use until release_tag."""
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    _LIVE_TAGS.add(tag)
    return tag


def release_tag(tag: str) -> None:
    _LIVE_TAGS.discard(tag)


def temporary_path(path: str | Path, tag: str | None = None) -> Path:
    """Where `path` is staged: beside it, hidden, so no checkpoint file pattern matches it, and named by its save's
    `tag` (new_tag). None: the fixed name `.{name}.tmp` of saves made before tags, which a killed one may have left."""
    path = Path(path)
    return path.with_name(f".{path.name}.{tag}.tmp" if tag else f".{path.name}.tmp")


def tag_of(name: str, suffix: str) -> str | None:
    """The tag in `name`, a staged file's name ending in `suffix` (".tmp"); None where it holds none."""
    if not name.endswith(suffix):
        return None
    tag = name[:len(name) - len(suffix)].rpartition(".")[2]
    return tag if _TAG.fullmatch(tag) else None


def save_over(tag: str) -> bool:
    """Whether the save whose staged files are named by `tag` is over, so what it left is dead bytes: its process is
    gone, or it is this process and no save here holds the tag (one that failed, or an earlier process of this id)."""
    pid = int(tag.partition("-")[0])
    if pid == os.getpid():
        return tag not in _LIVE_TAGS
    if os.name != "posix":  # no harmless check of another process there (Windows' os.kill ends it): kept
        return False
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, the process is only looked up
    except (ProcessLookupError, OverflowError):  # (OverflowError: past any process id)
        return True
    except OSError:  # PermissionError: another user's process, running
        return False
    return False


def remove_stale(folder: str | Path, pattern: str, suffix: str, keep: set[Path] | frozenset[Path] = frozenset()
                 ) -> None:
    """Delete the files in `folder` named `{pattern}.{tag}{suffix}` (`pattern` a glob, ".model*.safetensors*") that
    saves now over (save_over) left there, except those in `keep`; a running save's are kept. A folder so named is a
    commit's backup of one it removed (".bak"), deleted whole."""
    for leftover in Path(folder).glob(f"{pattern}.*{glob.escape(suffix)}"):
        tag = tag_of(leftover.name, suffix)
        if tag is None or leftover in keep or not save_over(tag):
            continue
        if leftover.is_file():
            leftover.unlink(missing_ok=True)
        elif suffix == ".bak" and leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)


def remove_killed_writes(folder: str | Path, stem: str, suffix: str) -> None:
    """Delete what killed writes of `folder/stem` left, staged as `.{stem}.{tag}{suffix}`: those whose run is gone
    (remove_stale), and the one fixed name `.{stem}{suffix}` of versions before tags."""
    (Path(folder) / f".{stem}{suffix}").unlink(missing_ok=True)
    remove_stale(folder, f".{glob.escape(stem)}", suffix)


LOCK_FILE = ".lock"  # in a folder lock_folder holds: the holder's process id


def lock_folder(folder: Path, name: str) -> Callable[[], None]:
    """Hold `folder` (given as `name`, e.g. "--out X") for this process alone until the function returned is called:
    a ValueError naming `name` and the holder's process id where another holds it. Two training runs on one folder
    deleted each other's staged files and appended to one metrics.jsonl. The lock is fcntl.flock's on LOCK_FILE in
    it, which the system lets go when the process ends, however it ends; the folder is made where it is not there
    (and removed again, left empty, on release). Where flock is not (Windows) or the file system refuses it (some
    network mounts), nothing is held."""
    try:
        import fcntl
    except ImportError:
        return lambda: None
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE

    def remove_made() -> None:
        for made_folder in made:  # innermost first; one that holds anything now is kept
            try:
                made_folder.rmdir()
            except OSError:
                pass

    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            remove_made()
            return lambda: None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode("ascii", "replace").strip() or "not known yet: it is starting"
            os.close(fd)
            raise ValueError(f"{name}: in use by another run (pid {holder}), which holds {path}; wait for it to "
                             "end, or give another folder") from None
        except OSError:  # no flock on this file system
            os.close(fd)
            remove_made()
            return lambda: None
        try:  # a run that ended between the open and the lock removed the file: lock the one there now
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode("ascii"))

    def release() -> None:
        try:
            path.unlink(missing_ok=True)  # while still held: a run that opened it before retries (the check above)
        finally:
            os.close(fd)
            remove_made()

    return release


def backup_path(path: str | Path, tag: str) -> Path:
    """Where a commit keeps the file at `path` that it replaces or removes until the commit is whole (StagedFiles):
    beside it, hidden, named by its save's `tag` as its staged files are (one a killed save left is removed as theirs
    are: remove_stale)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{tag}.bak")


class StagedFiles:
    """Files written beside their destinations under temporary names, then moved into place together by `commit`.
    os.replace is atomic, so a save killed part-way (SIGKILL, a full disk, a crash) leaves each destination whole, as it
    was or as written: written in place, a killed save would leave a truncated file, and a training run that saves over
    its own checkpoint would lose it. Files are flushed to disk before the first is moved, and moved in the order they
    were staged (a checkpoint's commit marker last); files staged for removal go at their turn in that order, so a stale
    file outlives the save's new ones. As a context manager: committed on leaving, discarded on an error.
    A commit that fails part-way (a rename refused, an I/O error) is undone: each file it replaced or removed is put
    back and each it added is removed, so the folder is as it was (a mix of the new weights and the old settings would
    load as one checkpoint). A recorded commit (a training save: `record`) is left to `finish` instead.

    One save of several parts (a training run's weights, tokenizer and state) stages them all in one StagedFiles
    (`staging`), so nothing of it is in place before everything of it is written. Its files are named by a tag of its
    own (new_tag), so saves into one folder at once, from other processes or threads, leave each other's alone."""

    def __init__(self) -> None:
        self.tag = new_tag()
        self.moves: list[tuple[Path | None, Path]] = []  # (temporary, destination); (None, path): remove path
        self.started = False  # whether commit has begun moving files into place
        self.recorded = False  # whether a record of the commit was taken, for `finish` to complete it (a training save)
        self.made: list[Path] = []  # folders this save created, parents first: discarding removes them again

    def make_folder(self, path: str | Path) -> None:
        """Create the folder at `path` and any missing parents, for the files staged in it. A save that fails then
        removes those it created (left empty once its temporaries are gone): else a full disk would leave a new folder
        behind, empty, where none was before."""
        missing = [folder for folder in (Path(path), *Path(path).parents) if not folder.exists()]
        for folder in reversed(missing):
            folder.mkdir(exist_ok=True)
            self.made.append(folder)

    def write(self, path: str | Path, write: Callable[[Path], object]) -> None:
        """Stage `path`, its content written by `write(temporary)` (staged again: the later content wins). An OSError
        while writing names `path` (a full disk's "[Errno 28] No space left on device" named no file)."""
        path = Path(path)
        temporary = temporary_path(path, self.tag)
        self.moves = [move for move in self.moves if move[1] != path]
        _LIVE_TAGS.add(self.tag)  # (again, after a commit: its files are in use until the next one)
        try:
            temporary.unlink(missing_ok=True)  # staged here before
            remove_killed_writes(path.parent, path.name, ".tmp")  # ones of it that killed saves left
            remove_stale(path.parent, f".{glob.escape(path.name)}", ".bak")  # (a save killed in its commit)
            self.moves.append((temporary, path))  # before it is made: discarding removes a partial (or empty) one
            temporary.touch()  # the mode the umask gives: safetensors creates its files private (0600)
            mode = temporary.stat().st_mode & 0o777
            write(temporary)
            os.chmod(temporary, mode)
            with open(temporary, "rb+") as f:  # on disk before any destination is replaced by it
                os.fsync(f.fileno())
        except (OSError, RuntimeError, SafetensorError) as exc:
            reason = _write_failure(exc)
            if reason is None:  # no failed write: the writer's own error
                raise
            named = OSError(f"{path}: {reason}")
            named.errno = getattr(exc, "errno", None)  # (ENOSPC stays testable)
            raise named from None

    def write_text(self, path: str | Path, text: str) -> None:
        self.write(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))

    def remove(self, path: str | Path) -> None:
        """Remove the file at `path` (a folder: when it is left empty) at commit, once what was staged before it is
        in place; a file staged to `path` so far is not written."""
        path = Path(path)
        for temporary, destination in self.moves:
            if destination == path and temporary is not None:
                temporary.unlink(missing_ok=True)
        self.moves = [move for move in self.moves if move[1] != path] + [(None, path)]

    def read_path(self, path: str | Path) -> Path:
        """The file a read of `path` should see now: what is staged for it, else `path` itself."""
        path = Path(path)
        staged = [temporary for temporary, destination in self.moves if destination == path]
        return staged[-1] if staged and staged[-1] is not None else path

    def remove_leftovers(self, folder: str | Path, pattern: str) -> None:
        """Delete the temporaries that killed saves left in `folder` of files named like `pattern` (a glob), except
        those staged here. Writing a name again replaces its own; these are of names this save does not write (a
        sharded save's shards, beside a single file): dead bytes, gigabytes for a real model."""
        staged = {temporary for temporary, _ in self.moves if temporary is not None}
        for leftover in Path(folder).glob(temporary_path(pattern).name):  # the fixed names of saves before tags
            if tag_of(leftover.name, ".tmp") is None and leftover not in staged and leftover.is_file():
                leftover.unlink()
        remove_stale(folder, f".{pattern}", ".tmp", keep=staged)  # a running save's are its own
        remove_stale(folder, f".{pattern}", ".bak")  # backups a save killed in its commit kept (of files it removed)

    def record(self, folder: str | Path) -> list[tuple[str, bool]]:
        """What a commit will do, as JSON-able data to keep with the save's commit marker: each destination by its
        path in `folder`, and whether it is written (False: removed). `finish` completes such a commit, killed
        part-way, from it."""
        self.recorded = True
        return [(Path(path).relative_to(folder).as_posix(), temporary is not None) for temporary, path in self.moves]

    @classmethod
    def finish(cls, folder: str | Path, record: list[tuple[str, bool]], tag: str | None = None) -> int:
        """Complete a commit that was killed part-way, from its `record`: every file still staged beside its
        destination (under the save's `tag`) moved into place, in order, and every removal made again. Staged files
        are all written (and flushed) before the first move, so those left are whole. Returns the number of files
        moved."""
        finishing = cls()
        finishing.recorded = True  # (undone, the staged files it had moved would be lost: a failure leaves the rest)
        root = Path(folder).resolve()
        for entry in record:  # all checked before anything moves: the record is read from the folder, as found
            name = entry[0] if isinstance(entry, (list, tuple)) and len(entry) == 2 else None
            # (a run folder from someone else could name files outside it, which would be replaced or deleted)
            if not isinstance(name, str) or not isinstance(entry[1], bool) or PurePath(name).is_absolute() \
                    or PureWindowsPath(name).anchor or ".." in PurePath(name).parts \
                    or not (Path(folder) / name).parent.resolve().is_relative_to(root):
                raise ValueError(f"{folder}: the record of its interrupted save names {entry!r}: expected a file's "
                                 "path inside the folder; nothing was moved or removed")
        for name, written in record:
            path = Path(folder) / name
            if not written:
                finishing.moves.append((None, path))
            elif temporary_path(path, tag).is_file():  # (else moved before the kill)
                finishing.moves.append((temporary_path(path, tag), path))
        moved = sum(temporary is not None for temporary, _ in finishing.moves)
        finishing.commit()
        return moved

    def commit(self) -> None:
        folders = []
        # What each move changed, to undo the commit should a later one fail: (destination, its backup, or None where
        # no file was there; whether it was an empty folder, removed). None for a recorded commit: its record finishes
        # it (StagedFiles.finish) from the staged files, which undoing would lose.
        undo: list[tuple[Path, Path | None, bool]] | None = None if self.recorded else []
        path = None
        try:
            for temporary, path in self.moves:
                if temporary is not None:
                    if undo is not None:  # the old file stays in place meanwhile: never a moment without one
                        there = os.path.lexists(path) and not path.is_dir()
                        undo.append((path, _copied(path, self.tag) if there else None, False))
                    os.replace(temporary, path)
                elif path.is_dir():
                    inside = list(path.iterdir())
                    if not inside:
                        path.rmdir()
                        if undo is not None:
                            undo.append((path, None, True))
                    elif undo is not None and set(inside) <= {backup for _, backup, _ in undo}:
                        # empty but for the backups of its files this commit removed: moved aside with them
                        undo.append((path, _keep(path, self.tag), True))
                elif undo is None:
                    path.unlink(missing_ok=True)
                elif os.path.lexists(path):
                    undo.append((path, _keep(path, self.tag), False))  # moved aside: removed, until the commit is whole
                self.started = True
                if path.parent not in folders:
                    folders.append(path.parent)
        except BaseException as exc:  # an error, or a stop that did not wait for the commit (sys.exit in a handler
            # of a signal interrupts_deferred does not hold: SLURM's SIGUSR1): undone either way
            if undo is None or path is None:
                raise
            _undo(undo, path, exc)  # raises, naming the file
        _drop_backups(undo or [])
        self.moves, self.made = [], []
        release_tag(self.tag)
        if os.name == "posix":  # the renames themselves on disk (a folder cannot be opened for fsync on Windows)
            for folder in (folder for folder in folders if folder.is_dir()):  # (not one removed, left empty)
                fd = os.open(folder, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def discard(self) -> None:
        for temporary, _ in self.moves:
            if temporary is not None:
                temporary.unlink(missing_ok=True)
        for folder in reversed(self.made):  # innermost first; one that holds anything else is kept
            try:
                folder.rmdir()
            except OSError:
                pass
        self.moves, self.made = [], []
        release_tag(self.tag)

    def __enter__(self) -> StagedFiles:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is not None:
            self.discard()
            return
        try:
            # A stop signal waits for the renames: a Ctrl-C between two would leave new weights beside the old settings,
            # which would load as one checkpoint
            with interrupts_deferred(STOP_SIGNALS):
                self.commit()
        except BaseException:
            # No staged copy stays (a hidden temporary as large as the weights), unless files have moved and a
            # record of the commit was kept to finish it from (a training run's resume: StagedFiles.finish)
            if not (self.started and self.recorded):
                self.discard()
            raise
        finally:
            release_tag(self.tag)  # (files kept for `finish` are a save that is over)


def _keep(path: Path, tag: str) -> Path:
    """A backup of the file or folder at `path` that the commit removes (its undo): moved aside."""
    backup = backup_path(path, tag)
    os.replace(path, backup)
    return backup


def _copied(path: Path, tag: str) -> Path:
    """A backup of the file at `path` that the commit replaces, the file staying in place: a hard link to it, or a
    copy where the file system makes no links (vfat, some network mounts): moved aside instead, a kill between that
    and the replace would leave no file there at all."""
    backup = backup_path(path, tag)
    try:
        os.link(path, backup, follow_symlinks=False)
    except OSError:
        shutil.copy2(path, backup, follow_symlinks=False)
    return backup


def _drop_backups(undo: list[tuple[Path, Path | None, bool]]) -> None:
    """Delete the backups of a commit that is whole (or stopped): dead bytes, as large as the files they kept."""
    # last first: a folder moved aside holds only backups, those of its own folders too (a/b removed, then a), so
    # the outermost goes whole and the ones inside it are gone already
    for _, backup, was_folder in reversed(undo):
        if backup is not None and was_folder:
            if backup.exists():
                shutil.rmtree(backup)
        elif backup is not None:
            backup.unlink(missing_ok=True)  # (gone where its folder was moved aside)


def _undo(undo: list[tuple[Path, Path | None, bool]], failed: Path, exc: BaseException) -> None:
    """Put back what a commit had changed when its move of `failed` failed with `exc`: each file replaced or removed
    from its backup, each folder removed made again, each file added removed. Raises an OSError naming `failed`
    (`exc` itself where it is no OSError) that says whether the folder is as it was; a backup that could not be put
    back is kept, and named."""
    unrestored: list[tuple[Path, Path | None]] = []  # (this save's file, the backup of the one it replaced)
    for path, backup, was_folder in reversed(undo):
        try:
            if backup is not None:
                os.replace(backup, path)
                if not was_folder:  # (a rename onto a link of the same file, not yet replaced, does nothing)
                    backup.unlink(missing_ok=True)
            elif was_folder:
                path.mkdir(exist_ok=True)
            elif not path.is_dir():
                path.unlink(missing_ok=True)
        except OSError:
            unrestored.append((path, backup))
    if not isinstance(exc, OSError):
        raise exc
    reason = exc.strerror or str(exc)
    if unrestored:
        kept = [f"{path.name} (the one before it kept as {backup.name})" if backup is not None else str(path.name)
                for path, backup in reversed(unrestored)]
        message = (f"{failed}: could not be moved into place ({reason}), and the save could not be undone: "
                   f"{failed.parent} is incomplete, holding this save's new {', '.join(kept)} beside the files it held "
                   "before; save again")
    else:
        message = (f"{failed}: could not be moved into place ({reason}); the save was undone: {failed.parent} was "
                   "left as it was")
    named = OSError(message)
    named.errno = exc.errno  # (EIO, ENOSPC stay testable)
    raise named from None


@contextmanager
def staging(files: StagedFiles | None) -> Iterator[StagedFiles]:
    """`files`, when a caller saving more passes its own (it commits them with the rest of its save), else a
    StagedFiles of this save's own, committed on leaving."""
    if files is not None:
        yield files
        return
    with StagedFiles() as own:
        yield own


# The first line of a Git LFS pointer file: what a hub repository cloned without git-lfs holds in place of each large
# file (the weights, tokenizer.json), a few lines of text naming the object's hash and size.
LFS_POINTER_START = b"version https://git-lfs.github.com/spec/"


def lfs_pointer_problem(path: str | Path) -> str | None:
    """What is wrong with the file at `path` when it is a Git LFS pointer rather than the content, else None: parsed as
    safetensors or JSON, a pointer's error ("header claims 2336927755350992246 bytes") never says what it is."""
    try:
        with open(path, "rb") as f:
            start = f.read(len(LFS_POINTER_START))
    except OSError:
        return None
    if start != LFS_POINTER_START:
        return None
    return (f"{path}: a Git LFS pointer, not the file itself (the repository was cloned without git-lfs, so its large "
            "files were never fetched); run `git lfs install && git lfs pull` in the clone, or fetch the model with "
            "`hf download`")


class JSONTooDeep(json.JSONDecodeError):
    """JSON nested deeper than Python's parser recurses, or holding a number longer than it converts: a JSONDecodeError,
    so each reader's own handling of bad JSON names the file (json.loads raises a bare RecursionError or ValueError,
    which would be a traceback out of `blockpress info` or `train`)."""

    def __str__(self) -> str:
        return self.msg


class KeyTwice(ValueError):
    """A JSON object that gives a key twice (args[0]: the key), which json.loads would read as its last value."""

    def said_at(self, where: str) -> ValueError:
        """The error for a line (`where`: FILE:LINE) that gives the key twice: the first value would be lost."""
        return ValueError(f"{where}: {json.dumps(self.args[0])} is given twice in one object (JSON would keep only the "
                          "last); give it once")


def one_value_a_key(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook for JSON whose repeated keys are damage, not an edit (an --input line, a
    safetensors header): the object, unless it gives a key twice (KeyTwice)."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise KeyTwice(key)
        obj[key] = value
    return obj


def _write_failure(exc: BaseException) -> str | None:
    """What a writer's exception says of a write that failed (a full disk, a quota), or None for one that is no
    failed write. safetensors and torch.save raise a full disk in their own words, neither an OSError: a training
    run's save would end in torch's "[enforce fail at inline_container.cc] unexpected pos", a long traceback."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    text = str(exc)
    if isinstance(exc, SafetensorError):
        return text.removeprefix("Error while serializing: ")
    if "inline_container" in text or "PytorchStreamWriter" in text:
        return f"torch.save could not write it, as when the disk is full or a quota is reached ({text.strip():.200})"
    return None


class NotJSONNumber(ValueError):
    """NaN, Infinity or -Infinity, which Python's json reads and writes but JSON has not (refuse_non_json_numbers)."""


def refuse_non_json_numbers(name: str) -> Any:
    """json's parse_constant for text that goes on as JSON: a line copied into an output file as NaN would make
    that file unreadable as JSON and, NaN being unequal to itself, never match its input line again."""
    raise NotJSONNumber(f"{name} is not JSON (JSON has no number for it)")


def finite_float(text: str) -> float:
    """json's parse_float beside refuse_non_json_numbers: 1e400 is JSON, but Python reads it as inf, and writes it
    back as Infinity, which is not."""
    value = float(text)
    if math.isinf(value):
        raise NotJSONNumber(f"{text} is past a float's range (read as {value}, it would be written back as "
                            f"{'-' if value < 0 else ''}Infinity, which is not JSON)")
    return value


def parse_json(text: str | bytes, object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
               parse_constant: Callable[[str], Any] | None = None,
               parse_float: Callable[[str], Any] | None = None) -> Any:
    """json.loads(text), with JSON nested past Python's recursion limit (~1,000 levels: `[[[...]]]` of 100,000, or a
    hostile file's few hundred kilobytes) a JSONDecodeError (JSONTooDeep) rather than a RecursionError, and likewise
    an integer longer than Python converts from text (4,300 digits: sys.get_int_max_str_digits), whose bare ValueError
    named neither the file nor the line. `object_pairs_hook`, `parse_constant`, `parse_float`: json.loads' (their own
    ValueErrors pass through)."""
    try:
        return json.loads(text, object_pairs_hook=object_pairs_hook, parse_constant=parse_constant,
                          parse_float=parse_float)
    except RecursionError:
        raise JSONTooDeep("nested deeper than Python's JSON parser reads (about 1,000 levels of arrays or objects)",
                          text if isinstance(text, str) else "", 0) from None
    except ValueError as exc:
        if isinstance(exc, json.JSONDecodeError) or "integer string conversion" not in str(exc):
            raise
        raise JSONTooDeep(f"a number of more digits than Python reads ({exc})", text if isinstance(text, str) else "",
                          0) from None


def utf16_note(head: bytes) -> str:
    """What a file's first bytes say when they are UTF-16's byte-order mark: what Windows PowerShell 5's `>` and
    Out-File write (read as UTF-8, it is refused as 'invalid start byte at byte 0', which says nothing of why); ""
    else."""
    if head[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return ("; it is UTF-16 (it starts with a UTF-16 byte-order mark, as Windows PowerShell's > and Out-File "
                "write text): save it as UTF-8 (in PowerShell: Out-File -Encoding utf8)")
    return ""


def cr_alone_error(where: str, raw: bytes) -> ValueError | None:
    """The error for a line that is several lines ended by a carriage return alone (as classic Mac OS saved text),
    None for any other: JSON reads a CR as a space, so such a file was one line refused as 'not JSON (Extra data,
    column 17)', which said nothing of why. (A CRLF file's lines end in a CR, which is no line of its own.)"""
    if b"\r" not in raw.rstrip(b"\r"):
        return None
    return ValueError(f"{where}: is several lines ended by a CR alone (as classic Mac OS saved text), not by LF or "
                      "CRLF: save the file with LF or CRLF line endings (tr '\\r' '\\n' writes them so)")


def utf16_note_of_text(text: str) -> str:
    """utf16_note of text read from standard input, whose bytes that are not UTF-8 arrive as surrogates
    (surrogateescape): UTF-16's byte-order mark is "\\udcff\\udcfe" (or "\\udcfe\\udcff") there. Without the mark
    (iconv -t UTF-16LE, .NET's Encoding.Unicode), mostly-ASCII UTF-16 is valid UTF-8, a NUL beside each letter: said
    so where its bytes hold two NULs or more (or are one unit, a letter and a NUL: a line of one letter), a quarter of
    them or more, all at even offsets or all at odd ones (the high bytes of big- or little-endian units), and read as
    UTF-16 so, hold no NUL character. (UTF-8 text with a NUL here and there is none of that.)"""
    if text[:2] in ("\udcff\udcfe", "\udcfe\udcff"):
        return utf16_note(text[:2].encode("utf-8", "surrogateescape"))
    if "\x00" not in text:  # (the common case, without a pass over the bytes in Python)
        return ""
    data = text.encode("utf-8", "surrogateescape")
    count, odd = data.count(0), data[1::2].count(0)
    one_unit = len(data) == 2 and count == 1 and 0x20 <= max(data) < 0x7F  # a line of one letter: "y\0"
    if not one_unit and (count < 2 or count * 4 < len(data) or 0 < odd < count):
        return ""
    # NULs at odd offsets: little-endian units ("h\0"); at even ones: big-endian ("\0h", or a little-endian line
    # input() split after its "\n" byte, which starts one byte into a unit)
    codec = "utf-16-le" if odd else "utf-16-be"
    try:
        if "\x00" in data[: len(data) // 2 * 2].decode(codec):
            return ""
    except UnicodeDecodeError:
        return ""
    return ("; it is UTF-16 without a byte-order mark (a NUL beside each letter, as iconv -t UTF-16LE and .NET's "
            "Encoding.Unicode write text): save it as UTF-8")


def utf16_text_error(text: str, what: str) -> ValueError | None:
    """The error for text read from standard input that is UTF-16 (utf16_note_of_text), None for any other."""
    note = utf16_note_of_text(text)
    if not note:
        return None
    problem = utf8_problem(text)
    return ValueError(f"{what}: " + (f"not valid UTF-8 ({problem})" if problem else "holds NUL characters") + note)


def undecodable_byte(exc: UnicodeDecodeError, skipped: int = 0) -> str:
    """"byte 0xe9 at byte 16": the first byte UTF-8 cannot read, by its value and its position counted from 1 (the
    16th byte), as cmp and an editor's columns count, for every "not UTF-8" error to name a byte alike (Python's
    exc.start counts from 0, and the reason alone, "invalid continuation byte", named no byte). `skipped`: bytes
    before exc.object that the position counts too (a byte-order mark taken off before decoding)."""
    return f"byte 0x{exc.object[exc.start]:02x} at byte {skipped + exc.start + 1}"


def text_of_file(data: bytes) -> str:
    """A UTF-8 text file's `data` as reading it as text gives on every system: a leading byte-order mark (Notepad's
    "UTF-8 with BOM") dropped, CRLF and a CR alone as "\n". A UnicodeDecodeError's start is the byte's offset in
    `data`, the mark's 3 bytes counted (utf-8-sig's leave them out: a byte at 6 would be named 3)."""
    mark = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        text = data[mark:].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnicodeDecodeError("utf-8", data, exc.start + mark, exc.end + mark, exc.reason) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_json_object(path: str | Path, error: type[Exception] = ValueError, where: str = "") -> dict[str, Any]:
    """The JSON object in the file at `path`; anything else (not UTF-8, not JSON, a list) raises `error` naming the
    file, `where` first (e.g. "--resume: "), rather than json's own traceback. A UTF-8 byte-order mark (a config.json
    saved by Notepad as "UTF-8 with BOM") is read past (json refused it as 'Unexpected UTF-8 BOM'), and a byte that is
    not UTF-8 is named at its offset in the file (text_of_file)."""
    path = Path(path)
    data = path.read_bytes()
    try:
        raw = parse_json(text_of_file(data))
    except UnicodeDecodeError as exc:
        raise error(f"{where}{path}: not valid JSON (not UTF-8: {undecodable_byte(exc)}){utf16_note(data[:2])}"
                    ) from None
    except json.JSONDecodeError as exc:
        raise error(f"{where}{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise error(f"{where}{path}: expected a JSON object, got {type(raw).__name__}")
    return raw
