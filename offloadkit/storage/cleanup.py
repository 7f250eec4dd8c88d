"""Private spill directories that never outlive their process.

Each disk tier gets a directory created with mode 0700 and a name carrying the owning
PID (``offloadkit-<pid>-<random>``). Directories are removed by their tier's ``close()``,
at interpreter exit, and on SIGTERM (the previous handler still runs afterwards). A
process killed with SIGKILL cannot clean up: the next tier created under the same parent
removes directories whose owning process no longer exists.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import tempfile
import threading

__all__ = ["create_private_dir", "remove_dir", "remove_stale_dirs", "live_dirs"]

_PREFIX = "offloadkit-"
_NAME = re.compile(r"^offloadkit-(\d+)-")
_live: set[str] = set()
_lock = threading.Lock()
_sigterm_installed = False


def live_dirs() -> set[str]:
    with _lock:
        return set(_live)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def remove_stale_dirs(parent: str) -> list[str]:
    """Remove this user's spill directories under ``parent`` whose process is gone."""
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        match = _NAME.match(name)
        path = os.path.join(parent, name)
        if not match or int(match.group(1)) == os.getpid():
            continue
        try:
            if os.lstat(path).st_uid != uid or not os.path.isdir(path):
                continue
        except OSError:
            continue
        if not _pid_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def create_private_dir(parent: str | None = None) -> str:
    """A new directory only this user can read (0700), removed when the process ends.

    Raises:
        OSError: naming the parent directory, when it cannot be created or written.
    """
    parent = parent or tempfile.gettempdir()
    try:
        os.makedirs(parent, exist_ok=True)
        remove_stale_dirs(parent)
        path = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=parent)  # mode 0700
    except OSError as exc:
        raise OSError(exc.errno, f"offloadkit: cannot create a spill directory in {parent!r}: {exc.strerror}; "
                                 "pass a writable disk directory") from exc
    with _lock:
        _live.add(path)
    _install_sigterm_handler()
    return path


def remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    with _lock:
        _live.discard(path)


def _remove_all() -> None:
    for path in live_dirs():
        remove_dir(path)


atexit.register(_remove_all)


def _install_sigterm_handler() -> None:
    global _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        _remove_all()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        else:  # default action: terminate, as if this handler were not there
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
        _sigterm_installed = True
    except ValueError:  # not the main thread of the main interpreter
        pass
