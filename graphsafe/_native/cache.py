"""The native library's cache directory: whom it trusts, how it is made, its build lock.

Every serving process loads the library, and clusters often point `$GRAPHSAFE_CACHE` at a
shared disk; so it is trusted as ssh trusts a key. `$GRAPHSAFE_CACHE`, its `native/` and
the library must be owned by the effective user and not writable by group or others:
anyone else who could write one of them could put code into every process that loads it.
Root-owned paths are refused too, unless root is the one running: ssh accepts them, as
root could change the process anyway, but a cache of one's own never needs them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

__all__ = ["LOCK_NAME", "Refusal", "build_lock", "make_private_dirs", "untrusted"]

LOCK_NAME = "build.lock"


class Refusal(NamedTuple):
    """A cache path that is not trusted, what is wrong with it, and the fix."""

    path: Path
    problem: str
    got: str
    fix: str

    @staticmethod
    def expected() -> str:
        """What every cache path must be."""
        return f"owned by you (uid {os.geteuid()}), not writable by group or others"

    def line(self) -> str:
        """The refusal in one line (for `describe()`)."""
        return (f"refused {self.path}: {self.problem} (expected: {self.expected()}; "
                f"got: {self.got}); fix: {self.fix}")

    def lines(self) -> str:
        """The refusal for an error: expected and got on their own lines, then the fix."""
        return (f"{self.path} is {self.problem}\nexpected: {self.expected()}\n"
                f"got: {self.got}\nfix: {self.fix}")


def untrusted(lib: Path) -> Refusal | None:
    """Why `$GRAPHSAFE_CACHE`, its `native/` or the library `lib` is not trusted, or None.

    Args:
        lib: The library's path, `$GRAPHSAFE_CACHE/native/<name>`.

    Returns:
        The first refused path, outermost first; None when all are trusted. A missing path
        is not refused: there is nothing in it to load.
    """
    for target in (lib.parent.parent, lib.parent, lib):
        try:
            st = os.stat(target)
        except FileNotFoundError:
            continue
        problems = []
        if st.st_uid != os.geteuid():
            problems.append(f"owned by uid {st.st_uid}")
        if st.st_mode & 0o022:
            problems.append("writable by group or others")
        if not problems:
            continue
        if target == lib:
            fix = (f"remove it (`rm {lib}`) and run `graphsafe native build`: a library "
                   "others could write may not be the one graphsafe built")
        elif st.st_uid != os.geteuid():
            fix = "point GRAPHSAFE_CACHE at a directory of your own"
        else:
            fix = f"`chmod go-w {target}`, or point GRAPHSAFE_CACHE at a directory of your own"
        got = f"owned by uid {st.st_uid}, mode {st.st_mode & 0o7777:#o}"
        return Refusal(target, " and ".join(problems), got, fix)
    return None


def make_private_dirs(directory: Path) -> None:
    """Create `directory` and its missing parents with mode 0o700 (existing ones untouched)."""
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            d.mkdir(mode=0o700)


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold `directory/build.lock` exclusively (`flock`; the kernel drops it if we die).

    Args:
        directory: The cache directory the build writes into.

    Yields:
        None, once no other process or thread holds the lock.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(directory / LOCK_NAME, flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
