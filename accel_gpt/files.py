"""Writing files so that a crash never leaves a half-written one behind.

Everything accel_gpt publishes (shards, manifests, checkpoints, weights, exports, metrics rewrites,
predictions) is written under a hidden temporary sibling name, fsynced, renamed over the final name,
and the rename made durable by an fsync of the folder. A reader sees the old file or the new one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from accel_gpt.errors import UserError
from accel_gpt.limits import file_size_limit, file_size_reason

TMP_MARK = ".tmp-"  # in the name of every temporary sibling: `.NAME.tmp-PID`


def temp_sibling(path: Path, tag: str | int | None = None) -> Path:
    """The hidden name `path` is written under before it is published (default tag: this process's id)."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid() if tag is None else tag}")


@contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write (a file or a folder); publish it over `path` on success.

    On an exception the temporary is removed and `path` is left as it was. A folder may replace only an
    empty folder (rename(2) semantics), which is what an export into an empty `--out_dir` needs.
    """
    path = Path(path)
    tmp = temp_sibling(path)
    try:
        yield tmp
        publish(tmp, path)
    finally:
        with contextlib.suppress(OSError):  # a folder gone read-only fails this too: the write's error is the news
            remove(tmp)


def atomic_write(path: str | Path, data: bytes | str) -> None:
    with replacing(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def atomic_write_json(path: str | Path, obj: Any, indent: int | None = 2) -> None:
    atomic_write(path, json.dumps(obj, indent=indent) + "\n")


def publish(tmp: Path, final: Path) -> None:
    """Make `tmp` (file or folder) durable, rename it to `final` in one step, make the rename durable."""
    fsync_tree(tmp)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def fsync_tree(path: Path) -> None:
    """fsync a file, or every file and folder under a folder, so a rename never outruns the data."""
    if path.is_file():
        _fsync_file(path)
        return
    for p in sorted(path.rglob("*")):
        if p.is_file():
            _fsync_file(p)
        elif p.is_dir():
            fsync_dir(p)
    fsync_dir(path)


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable: without it a power cut can forget a rename already relied on."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def make_shareable(path: Path) -> None:
    """Give a file (or each file of a folder) the usual umask-based mode: safetensors and mkdtemp create
    theirs private (0600/0700), which would hide weights meant to be shared."""
    umask = os.umask(0)
    os.umask(umask)
    for f in [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]:
        f.chmod(0o666 & ~umask)


def remove(path: Path) -> None:
    """Delete a file or a folder tree if it exists (a missing one is not unlinked: on a read-only file system that
    fails with EROFS, not ENOENT)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink()


def remove_temporaries(folder: Path) -> list[Path]:
    """Delete the hidden temporaries that a killed writer left in `folder`; return what was removed."""
    removed = [p for p in Path(folder).glob(f".*{TMP_MARK}*")]
    for p in removed:
        remove(p)
    return removed


LOCK = ".lock"


@contextmanager
def locked(folder: str | Path, what: str) -> Iterator[None]:
    """Hold `folder/.lock` while `what` writes into `folder`; a second writer is refused in one line.

    An flock on the file: the kernel releases it when the holder dies, so a dead holder's lock is simply
    taken over. The file names the holder (pid and host) for the refusal message.
    """
    path = Path(folder) / LOCK
    f = open(path, "a+")
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            message = f"{folder} is in use by {holder} ({what} refused); wait for it or use another folder"
            raise UserError(message) from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}")
        f.flush()
        yield
    finally:
        f.close()


def lock_holder(folder: str | Path) -> str | None:
    """Who holds `folder/.lock` ("pid N on HOST"), or None where nobody does; takes no lock for itself.

    It asks for a *shared* lock: shared locks never exclude each other, so every rank of a launch may probe at the
    same moment (an exclusive probe made two ranks refuse each other), and only a writer's exclusive lock refuses
    it. A shared lock also works on a read-only descriptor where flock is emulated by POSIX locks (NFS)."""
    path = Path(folder) / LOCK
    try:
        f = open(path)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or "another process"
    return None


# ------------------------------------------------------------------------------------------ failed writes

FULL_DISK_BYTES = 1 << 20  # less free space than this, after a failed write, means the disk is full
# How a full disk reads where a library wraps ENOSPC (or EDQUOT, a quota) into an error of its own type: safetensors
# quotes Rust's io::Error ("No space left on device (os error 28)"); torch's writer says only "file write failed" or
# "basic_ios::clear: iostream error", which is why the size of the write is asked too.
FULL_DISK_WORDS = ("no space left on device", "os error 28", "disk quota exceeded", "os error 122")


def write_failure(folder: Path, write: Callable[[], object], needed: int = 0) -> str | None:
    """Run `write`, which writes about `needed` bytes into `folder`; None when it worked, else why not, in words.

    A full disk is told by the error itself (ENOSPC anywhere in its chain, or its words in a library's own error
    type) or by the write needing more than was free before it; never by the free space after it alone, since a
    library may delete its partial file before it raises. Other failures that are not failed writes propagate."""
    free = free_bytes(folder)
    try:
        write()
    except Exception as e:
        if (isinstance(e, OSError) and e.errno == errno.EROFS) or not os.access(folder, os.W_OK):
            return f"{folder} has become read-only"
        after = free_bytes(folder)
        if says_disk_full(e) or (free is not None and needed > free) or (after is not None and after < FULL_DISK_BYTES):
            return no_space(needed, free)
        limit = file_size_limit()  # torch's writer says EFBIG as "iostream error"
        if limit is not None and (needed >= limit or (isinstance(e, OSError) and e.errno == errno.EFBIG)):
            return file_size_reason(limit)
        if isinstance(e, OSError):
            return str(e)
        raise
    return None


def write_or_refuse(what: str, target: Path, write: Callable[[], object], needed: int = 0) -> None:
    """Run `write` (about `needed` bytes, for `target`); a full or read-only disk is one line, `cannot write WHAT:
    why`, whatever library raised it. For the commands' own outputs: the export, eval's and plot's --out."""
    folder = next(p for p in Path(target).absolute().parents if p.exists())  # where the bytes go
    error = write_failure(folder, write, needed)
    if error is not None:
        raise UserError(f"cannot write {what}: {error}")


def says_disk_full(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from or during, reports a full disk or an exceeded quota."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(words in str(error).lower() for words in FULL_DISK_WORDS):
            return True
        error = error.__cause__ or error.__context__
    return False


def no_space(needed: int, free: int | None) -> str:
    """The reason a write failed on a full disk, with what it needed and what was free when both are known."""
    if not needed or free is None:
        return "no space left on the device"
    return f"no space left on the device (the write needs about {megabytes(needed)}; {megabytes(free)} were free)"


def free_bytes(folder: Path) -> int | None:
    with contextlib.suppress(OSError):
        return shutil.disk_usage(folder).free
    return None


def megabytes(size: int) -> str:
    return f"{size / 1e6:,.1f} MB" if size >= 100_000 else f"{size / 1e3:,.1f} kB"  # a jsonl of a few lines too


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of these tensors' data on this process (a sharded tensor's local part), each storage once: a tied head
    is the embedding's matrix, not a second copy."""
    storages, total = set(), 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        if not hasattr(t, "untyped_storage") or t.untyped_storage().data_ptr() in storages:
            continue
        storages.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()
    return total
