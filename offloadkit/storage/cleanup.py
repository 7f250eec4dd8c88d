"""Private spill directories that never outlive their process.

Each disk tier gets a directory ``offloadkit-<pid>-<random>`` (mode 0700) and, beside it,
a lock file ``<directory>.lock`` that the owner holds locked for as long as the directory
lives. A POSIX record lock is released by the kernel when its holder dies however it dies,
and it is honoured across PID namespaces on one host and across hosts on network file
systems, where ``kill(pid, 0)`` says nothing. So a directory is stale exactly when its lock
can be taken: the next tier created under the same parent removes such directories.

The tier's files are unlinked as soon as they are opened (their space returns when the
process ends, even on SIGKILL); the empty directory goes with the tier's ``close()``, at
interpreter exit (registered when the first directory is made, never at import), or with
the next tier's stale sweep. No signal handler is installed: a graceful-preemption handler
(Trainer, torchrun, SLURM) that keeps the process running keeps its directory too.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import os
import re
import shutil
import stat
import tempfile
import threading
import time

__all__ = ["create_private_dir", "remove_dir", "remove_stale_dirs", "live_dirs", "check_parent"]

_PREFIX = "offloadkit-"
_NAME = re.compile(r"^offloadkit-\d+-[A-Za-z0-9_]+$")
_GRACE_S = 60.0  # a directory with no lock file younger than this may still be starting up
_live: dict[str, int] = {}  # directory -> fd of its held lock file
_lock = threading.Lock()
_atexit_registered = False


def live_dirs() -> set[str]:
    with _lock:
        return set(_live)


def _through_symlink(path: str) -> bool:
    """Whether any component of the absolute ``path`` is a symlink (dangling ones included)."""
    current = os.sep
    for part in path.split(os.sep):
        if not part:
            continue
        current = os.path.join(current, part)
        if os.path.islink(current):
            return True
    return False


def check_parent(parent: str) -> str:
    """The real path of a user-given spill parent, refusing one an attacker could redirect.

    When any component of the path is a symlink (also in the middle, also dangling), the
    directory the spill directories would be created in, the deepest one of the real path
    that exists, must be owned by this user (or by root with the sticky bit, like ``/tmp``)
    and not be writable by others without the sticky bit.

    Raises:
        ValueError: naming the parent, where it leads and the fix.
    """
    real = os.path.realpath(parent)
    if _through_symlink(os.path.abspath(parent)):
        anchor = real
        while not os.path.isdir(anchor) and anchor != os.path.dirname(anchor):
            anchor = os.path.dirname(anchor)
        st = os.stat(anchor)
        sticky = bool(st.st_mode & stat.S_ISVTX)
        others_write = bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))
        owner_ok = st.st_uid == os.getuid() or (st.st_uid == 0 and sticky)
        if not owner_ok or (others_write and not sticky):
            raise ValueError(
                f"disk directory {parent!r} goes through a symlink to {real!r}, inside {anchor!r}, which is "
                f"owned by uid {st.st_uid} or writable by others; pass a directory you own (e.g. {real!r} "
                "after checking it)"
            )
    return real


def _try_lock(path: str) -> int | None:
    """Open and lock ``path``; the fd on success, None if someone holds it."""
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _is_real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)  # never a symlink to one
    except OSError:
        return False


def remove_stale_dirs(parent: str) -> list[str]:
    """Remove this user's spill directories under ``parent`` whose owner is gone; returns
    the directories really removed."""
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    uid = os.getuid()
    mine = {os.path.realpath(p) for p in live_dirs()}
    # A POSIX lock never conflicts with its own process, and closing any descriptor of a
    # locked file drops the lock: never open one of our own lock files, however it is named.
    with _lock:
        own_locks = {(st.st_dev, st.st_ino) for st in (os.fstat(fd) for fd in _live.values())}
    for name in names:
        if not _NAME.match(name):
            continue
        path = os.path.join(parent, name)
        if os.path.realpath(path) in mine or not _is_real_dir(path) or os.lstat(path).st_uid != uid:
            continue
        lock_path = path + ".lock"
        try:
            lock_id = (os.stat(lock_path).st_dev, os.stat(lock_path).st_ino)
        except OSError:
            lock_id = None
        if lock_id in own_locks:
            continue
        if lock_id is not None:
            fd = _try_lock(lock_path)
            if fd is None:
                continue  # its owner is alive, wherever it runs
            try:
                shutil.rmtree(path, ignore_errors=True)
                if not os.path.lexists(path):
                    os.unlink(lock_path)
            finally:
                os.close(fd)
        elif time.time() - os.lstat(path).st_mtime > _GRACE_S:
            shutil.rmtree(path, ignore_errors=True)  # no lock at all: left by a crash mid-cleanup
        if not os.path.lexists(path):
            removed.append(path)
    return removed


def create_private_dir(parent: str | None = None) -> str:
    """A new directory only this user can read (0700), locked by this process.

    Raises:
        OSError: naming the parent directory, when it cannot be created or written.
    """
    # One spelling per directory: the live set and the sweep compare real paths.
    parent = check_parent(parent) if parent else os.path.realpath(tempfile.gettempdir())
    try:
        os.makedirs(parent, exist_ok=True)
        remove_stale_dirs(parent)
        # The lock file comes first, so no sweep ever sees the directory unlocked.
        fd, lock_path = tempfile.mkstemp(prefix=f"{_PREFIX}{os.getpid()}-", suffix=".lock", dir=parent)
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path = lock_path[: -len(".lock")]
        with _lock:
            _live[path] = fd  # before the directory exists: a sweep on another thread skips it
        try:
            os.mkdir(path, 0o700)
        except OSError:
            with _lock:
                _live.pop(path, None)
            os.close(fd)
            os.unlink(lock_path)
            raise
    except OSError as exc:
        raise OSError(
            exc.errno or errno.EIO,
            f"offloadkit: cannot create a spill directory in {parent!r}: "
            f"{exc.strerror}; pass a writable disk directory",
        ) from exc
    global _atexit_registered
    with _lock:
        if not _atexit_registered:
            atexit.register(_remove_all)
            _atexit_registered = True
    return path


def remove_dir(path: str) -> None:
    """Remove a directory made by :func:`create_private_dir`, then release its lock."""
    shutil.rmtree(path, ignore_errors=True)
    with _lock:
        fd = _live.pop(path, None)
    if fd is not None:
        try:
            os.unlink(path + ".lock")
        except OSError:
            pass
        os.close(fd)


def _remove_all() -> None:
    for path in live_dirs():
        remove_dir(path)
