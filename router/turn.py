"""Round robin's turn, shared by the ingress processes of one node.

Each ingress (a colocated pool replica, or a gateway replica) routes on its own, and the kernel
spreads connections over their listeners (`SO_REUSEPORT`). With a turn of its own in each, two
ingresses in front of two engines send about a quarter of consecutive requests to the engine
that had the one before (measured: 25-46 of 115 on the h2h window), and two prefills on one
engine delay its decodes twice. One turn per node and pool removes that.

The turn is a ticket from the kernel: one byte appended to a file in a memory file system
(`O_APPEND` is atomic, and the descriptor's offset after the write is this writer's own end of
the file), so the ingresses need neither a lock nor a round trip: a 1-byte write to tmpfs, a few
microseconds. Across nodes each node keeps its own turn.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

Turn = Callable[[], int]  # the next ticket: a different number each call, in order
WRAP_BYTES = 1 << 20  # the file is emptied past this size; a ticket may then repeat once


def turn_dir() -> Path:
    """Where this node's turns live: TOKENFAB_TURN_DIR, else a directory of this user's in
    /dev/shm (a memory file system), else in the temporary directory."""
    base = os.environ.get("TOKENFAB_TURN_DIR")
    if base:
        return Path(base)
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return root / f"tokenfab-{os.getuid()}-turns"


def local_turn() -> Turn:
    """A turn of this process's own."""
    return itertools.count().__next__


class SharedTurn:
    """Tickets shared by every process that opens the same `path`, in the order they were drawn.
    If the file cannot be written (read-only, removed, no space), it logs once and goes on with
    a turn of this process's own: round robin then holds per ingress, as it would unshared.

    Example: processes A and B on one path draw A, B, A -> tickets 1, 2, 3.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._fallback: Turn | None = None

    def __call__(self) -> int:
        if self._fallback is None:
            try:
                return self._draw()
            except OSError as exc:
                logger.warning("round robin turn %s unavailable (%s); this process keeps a "
                               "turn of its own", self.path, exc)
                self._fallback = local_turn()
                self.close()
        return self._fallback()

    def _draw(self) -> int:
        if self._fd is None:
            self._fd = _open_private(self.path)
        os.write(self._fd, b"\0")
        ticket = os.lseek(self._fd, 0, os.SEEK_CUR)
        if ticket >= WRAP_BYTES:
            os.ftruncate(self._fd, 0)
        return ticket

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _open_private(path: Path) -> int:
    """`path` opened for appending, in a directory only this user can write, never through a
    link: /dev/shm is shared, and a directory or link planted there by another user must not
    make this process append to a file of their choosing. OSError otherwise."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    owner = path.parent.lstat()
    if not stat.S_ISDIR(owner.st_mode) or owner.st_uid != os.getuid() or owner.st_mode & 0o022:
        raise PermissionError(f"{path.parent} is not a directory of this user's alone")
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)


def shared_turn(application: str, pool: str) -> SharedTurn:
    """The turn of `pool` in `application` on this node."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{application}--{pool}")
    return SharedTurn(turn_dir() / f"{safe}.turn")
