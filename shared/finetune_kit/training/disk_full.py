"""A save that runs out of room on disk: every rank stops with one line, and nothing complete is touched.

Checkpoints (``checkpoints/step_N.partial``) and final outputs (``model.partial``, ``adapter.partial``) are
written under a temporary name and put in place only once complete, so a disk that fills mid-save (another job
takes the room, a quota is reached, a first checkpoint larger than its estimate) damages nothing whole.
:func:`room_for` wraps such a save on every rank and turns its failure into :class:`DiskFull`, which
:func:`~finetune_kit.launch.failures.run_main` ends in one line for the job: the folder, the bytes the save takes
against those free, and what is kept. Every rank that stops so removes the partial folder once its own writes
have ended, which gives the room back: the last rank out removes what the others wrote before it, so nothing of
the folder is left whichever rank fails first. A rank still waiting in a collective for a rank that failed sees its
peer leave: on a disk still short of room, it stops with the same error, not with a lost-rank report; a rank whose
file vanished mid-write (the folder removed under it by a rank that stopped first) stops with it too.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from finetune_kit.errors import UserInputError
from finetune_kit.launch.failures import peer_failure

MARGIN = 1.1  # free disk a save needs = its predicted size x this
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
# What a failed write says where it gives no errno: torch.save's zip writer ("unexpected pos", the stream's
# "iostream error"), safetensors' Rust writer ("os error 28").
WRITE_FAILED = re.compile(r"unexpected pos|file write failed|iostream error|os error (28|122)|no space left|"
                          r"quota exceeded", re.IGNORECASE)
NOT_FOUND = re.compile(r"No such file or directory|does not exist|os error 2\b")


class DiskFull(UserInputError):
    """A save did not fit on the disk of the run's output (it filled before or while the save was written)."""


def free_bytes(path: Path) -> int:
    """Free bytes on the disk that holds ``path`` (before it exists: the folder it will be made in)."""
    path = Path(path)
    return shutil.disk_usage(next(p for p in (path, *path.parents) if p.exists())).free


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def _size(folder: Path) -> int:
    """Bytes of the files under ``folder``, where another rank may be removing them (what is gone counts 0)."""
    total = 0
    for root, _, files in os.walk(folder):  # os.walk passes over a folder that vanished
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def reason(err: BaseException) -> str | None:
    """Why ``err`` is a write that ran out of room ("No space left on device", ...), or None if it says nothing
    of the kind."""
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno in NO_ROOM:
            return os.strerror(e.errno)
    return "a write failed" if any(WRITE_FAILED.search(str(e)) for e in _chain(err)) else None


def vanished(err: BaseException, partial: Path) -> bool:
    """Whether ``err`` is a file or folder of ``partial`` not found (the folder removed mid-write): Python's
    FileNotFoundError, torch.save's "Parent directory ... does not exist", safetensors' "os error 2"."""
    return any(str(partial) in str(e) and NOT_FOUND.search(str(e)) for e in _chain(err))


def short_of_room(folder: Path, needed: int) -> str | None:
    """A sentence with both numbers if the disk of ``folder`` has less than ``needed`` bytes (x ``MARGIN``) free,
    else None."""
    free = free_bytes(folder)
    if free >= needed * MARGIN:
        return None
    return f"it takes about {gib(needed)} and {gib(free)} are free there"


@contextmanager
def room_for(folder: Path, partial: Path, needed: int, *, what: str, kept: str, writer: bool) -> Iterator[None]:
    """Run a save of ``what`` (about ``needed`` bytes, the same on every rank) into ``partial`` under ``folder``;
    every rank enters. A failure that is a write out of room on this rank, a peer gone (its process stopped)
    while the disk is short of room, or a file of ``partial`` gone mid-write (removed by a rank that stopped first)
    becomes :class:`DiskFull` naming ``folder``, the bytes and ``kept`` (what is kept and how to go on); every rank
    first removes ``partial``, its own writes over. Any other failure is raised as it is. The ``writer``'s line
    counts the room the folder gave back."""
    try:
        yield
    except Exception as err:
        why = reason(err)
        if why is None and not (vanished(err, partial) or peer_failure(err) and short_of_room(folder, needed)):
            raise
        free = free_bytes(folder)
        if writer:  # its room back, counted now: a file the failed write left open is freed once this process ends
            free += _size(partial)
        shutil.rmtree(partial, ignore_errors=True)  # every rank: the last one out finds every other rank's writes over
        why = why or "another rank's write failed"
        raise DiskFull(f"{what} did not fit on disk: '{folder}' filled up while it was written ({why}); it takes "
                       f"about {gib(needed)} and {gib(free)} are free now (its partial folder removed). "
                       f"{kept}") from err
