"""All-or-nothing output directories for the one-shot commands (``prune``).

A run claims ``OUT`` with an exclusive lock on a sibling file ``.OUT.lock`` (``fcntl.flock``:
released by the kernel when the process ends, however it ends, so a killed run never leaves a
stale claim), writes into a temporary sibling ``.OUT.partial-PID-XXXX`` and renames that into
place only when the caller says the contents are complete and checked. A failure or an
interrupt removes the temporary directory: ``OUT`` is never created half-written (an empty
``OUT`` that existed before the run stays empty). A second run that asks for the same ``OUT``
while the first holds it is refused, naming the holder (its process id, host, start time and
command line); one that comes after the first finished finds ``OUT`` full and is refused too.

The rename is the commit point. ``rename(2)`` is atomic within one filesystem and replaces only
an *empty* directory, so even two runs that both got past the lock (a lock file removed by
hand) cannot both land: the second rename fails and that run says so.

``OUT`` may be a symbolic link to an empty directory, or a dangling one: the run writes into the
link's target (the rename could not replace the link itself).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path

try:  # POSIX; elsewhere the lock file's existence is the claim (removed at the end of the run)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = ["OutputBusy", "OutputClaim"]

_PARTIAL = ".partial-"
_MARK = ".lalr_partial"  # inside every temporary directory: only such directories are ever removed


class OutputBusy(ValueError):
    """Another run holds the output directory."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class OutputClaim:
    """``with OutputClaim(out, command) as tmp: ... write into tmp ...; claim.commit()``.

    ``__enter__`` takes the lock (or raises :class:`OutputBusy`), refuses an ``out`` that exists
    and is not an empty directory, removes temporary directories that killed runs left for the
    same ``out`` and returns a new empty temporary directory next to ``out``. :meth:`commit`
    renames it to ``out``. Leaving the block without a commit (an exception, Ctrl-C) removes it.
    ``log`` receives a line about anything removed.
    """

    def __init__(self, out: str | os.PathLike, command: str = "", log=None):
        self.out = Path(out).absolute()
        if self.out.is_symlink():  # a link (to an empty directory, or dangling): the output goes where it points,
            # the temporary sibling and the lock next to the target, so that the rename lands there
            self.out = Path(os.path.realpath(self.out))
        self.command = command or " ".join(sys.argv)
        self.log = log or (lambda s: None)
        self.lock_path = self.out.parent / f".{self.out.name}.lock"
        self.tmp: Path | None = None
        self.committed = False
        self._fd: int | None = None

    # ------------------------------------------------------------------ lock

    def _holder(self) -> str:
        try:
            info = json.loads(self.lock_path.read_text() or "{}")
        except (OSError, ValueError):
            info = {}
        if not info:
            return "a run that is starting"
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
        return f"pid {info.get('pid')} on {info.get('host')}, since {started}: {info.get('command', '?')}"

    def _busy(self) -> OutputBusy:
        return OutputBusy(f"--out {self.out} is being written by another run ({self._holder()}); wait for it to "
                          f"finish or choose another --out")

    def _lock(self) -> None:
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(f"cannot create {self.out.parent} to hold --out: {e.strerror or e}") from None
        while True:
            if fcntl is None:  # pragma: no cover - Windows
                try:
                    fd = os.open(self.lock_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
                except FileExistsError:
                    raise OutputBusy(f"--out {self.out} is claimed by {self.lock_path} ({self._holder()}); if no run "
                                     "is writing it any more, delete that file") from None
            else:
                fd = os.open(self.lock_path, os.O_CREAT | os.O_RDWR, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    raise self._busy() from None
                # the holder before us may have removed the file between our open and our lock:
                # then we hold a lock nobody else can see; take the file that is there now
                try:
                    same = os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if not same:
                    os.close(fd)
                    continue
            # ours from here: an interrupt while the holder's note is written still gives it back
            self._fd = fd
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                                     "command": self.command}).encode())
            os.fsync(fd)
            return

    def _unlock(self) -> None:
        if self._fd is None:
            return
        try:
            self.lock_path.unlink()
        except FileNotFoundError:
            pass
        os.close(self._fd)  # closing releases the flock
        self._fd = None

    # ------------------------------------------------------------------ temporary directory

    def _check_free(self) -> None:
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            raise ValueError(f"--out {self.out} exists and is not an empty directory; choose a new one")

    def _sweep(self) -> None:
        """Remove the temporary directories of runs that were killed (we hold the lock, so none
        of them is being written)."""
        for d in self.out.parent.glob(f".{self.out.name}{_PARTIAL}*"):
            if d.is_dir() and (d / _MARK).is_file():
                shutil.rmtree(d, ignore_errors=True)
                self.log(f"removed {d}, left by an earlier run that was killed")

    def __enter__(self) -> Path:
        try:
            self._lock()
            self._check_free()
            self._sweep()
            self.tmp = self.out.parent / f".{self.out.name}{_PARTIAL}{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.tmp.mkdir()
            (self.tmp / _MARK).write_text(f"{os.getpid()}\n")
        except BaseException:  # an interrupt too: the with block's exit will not run
            self.__exit__(None, None, None)
            raise
        return self.tmp

    def commit(self) -> None:
        """Rename the temporary directory to ``out`` (the contents must be complete)."""
        assert self.tmp is not None, "commit() outside the with block"
        (self.tmp / _MARK).unlink()
        self._check_free()
        try:
            os.rename(self.tmp, self.out)  # replaces an empty directory, never a full one
        except OSError as e:
            (self.tmp / _MARK).write_text(f"{os.getpid()}\n")
            raise OSError(f"cannot move the finished output into --out {self.out} ({e.strerror or e}); another run "
                          "wrote it meanwhile, or it is on another filesystem") from None
        self.committed = True

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if not self.committed and self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
        finally:
            self._unlock()

    def outcome(self) -> str:
        """What a failed run left: for the one-line error."""
        if self.out.is_dir():
            return f"--out {self.out} was left empty"
        return f"nothing was written to --out {self.out}"
