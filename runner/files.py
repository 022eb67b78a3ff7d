"""Inputs in, outputs out: staging directories, and the quarantine that outputs land in.

Outputs are untrusted: only regular files are copied, never followed through a link, under a
path the host rebuilds from checked components, with caps on count and total size. Nothing is
ever extracted from an archive.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import stat
import time
from collections.abc import Iterable
from pathlib import Path

from runner.base import FileRecord, InputFile, OutputCaps
from runner.egress.intercept import CA_INPUT
from runner.errors import SandboxError

_SAFE_PART = re.compile(r"[A-Za-z0-9._+@=-][A-Za-z0-9._+@= -]{0,254}")  # fullmatch: "$" would admit a final newline
_MAX_DEPTH = 16
# An output's path, in bytes: with the quarantine directory in front it stays far below PATH_MAX
# (a tool's 16 levels of 255-character names would not).
MAX_OUTPUT_PATH = 1024
# A refused output is shown by at most this many characters of its path (and of why).
_SHOWN_CHARS = 200
# Refused outputs listed for one call; past it they are only counted. The same as the entries a
# sandbox's /out can hold (its inode count), so an honest tool never reaches it.
MAX_REFUSED = 1024


def check_input_name(name: str) -> str:
    """An input file name a caller may give: one path component, no traversal, printable, and not
    a name stockade stages itself (the egress CA bundle, `CA_INPUT`).

    Raises:
        ValueError: the name would escape ``/in``, is not a plain file name, or is reserved.
    """
    if name == CA_INPUT:
        raise ValueError(f"input file name {name!r} is reserved for stockade's egress CA bundle: rename the input")
    return _plain_name(name)


def _plain_name(name: str) -> str:
    if not _SAFE_PART.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"input file name {name[:80]!r} must be one plain path component (letters, digits, ._-+@=)")
    return name


def stage_inputs(directory: Path, inputs: Iterable[InputFile]) -> tuple[FileRecord, ...]:
    """Write ``inputs`` into ``directory`` (world-readable, owned by the router) and record them.

    Raises:
        SandboxError: an input could not be staged (a name given twice or not plain, a full disk);
            the message names the input, never the host's staging path.
    """
    records = []
    for item in inputs:
        try:
            name = _plain_name(item.name)
        except ValueError as exc:
            raise SandboxError(str(exc)) from exc
        try:
            fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444)
            with os.fdopen(fd, "wb") as handle:
                handle.write(item.data)
        except FileExistsError as exc:
            raise SandboxError(f"more than one input is named {name!r}: give each its own name") from exc
        except OSError as exc:
            raise SandboxError(f"could not stage input {name!r}: {exc.strerror or type(exc).__name__}") from exc
        records.append(FileRecord(name, len(item.data), hashlib.sha256(item.data).hexdigest()))
    return tuple(records)


def safe_relative(path: str) -> Path | None:
    """``path`` as a relative path of checked components, or None if it is not one."""
    parts = path.split("/")
    if not parts or len(parts) > _MAX_DEPTH or any(not _SAFE_PART.fullmatch(p) or p in (".", "..") for p in parts):
        return None
    return Path(*parts)


class Quarantine:
    """One call's quarantine directory: outputs are written here by the router, never by the tool."""

    def __init__(self, root: Path, call_id: str, caps: OutputCaps) -> None:
        safe_id = call_id if _SAFE_PART.fullmatch(call_id or "") else "call"
        self.directory = root / safe_id
        self._caps = caps
        self._bytes = 0
        self._unlisted = 0
        self.records: list[FileRecord] = []
        self.refused: list[tuple[str, str]] = []

    def refuse(self, path: str, why: str) -> None:
        """Record an output not taken: its name shown and shortened, and past `MAX_REFUSED` entries
        only counted, so a tool cannot make a record (or the audit log) as large as it likes."""
        if len(self.refused) < MAX_REFUSED:
            self.refused.append((shown(path)[:_SHOWN_CHARS], why[:_SHOWN_CHARS]))
            return
        self._unlisted += 1
        more = ("...", f"{self._unlisted} more refused entries not listed")
        if self._unlisted == 1:
            self.refused.append(more)
        else:
            self.refused[-1] = more

    def add(self, path: str, data: bytes) -> None:
        """Copy one output into the quarantine, or refuse it with the reason: never raises for
        what the tool named or for a copy the host could not make."""
        if shown(path) != path:
            # Not UTF-8 (an undecodable name): no record, log or agent could name it faithfully.
            self.refuse(path, "name is not valid UTF-8")
            return
        rel = safe_relative(path)
        if rel is None:
            self.refuse(path, "unsafe path")
            return
        if len(path.encode()) > MAX_OUTPUT_PATH:
            self.refuse(path, f"path longer than {MAX_OUTPUT_PATH} bytes")
            return
        if len(self.records) >= self._caps.max_files:
            self.refuse(path, "over the file count cap")
            return
        if self._bytes + len(data) > self._caps.max_bytes:
            self.refuse(path, "over the total size cap")
            return
        target = self.directory / rel
        try:
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            # The reason, never the host path (the quarantine's location is not the agent's to know).
            self.refuse(path, f"could not be stored: {exc.strerror or type(exc).__name__}")
            return
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
        except OSError as exc:
            with contextlib.suppress(OSError):
                target.unlink()  # no record will point at a partial copy
            self.refuse(path, f"could not be stored: {exc.strerror or type(exc).__name__}")
            return
        self._bytes += len(data)
        self.records.append(FileRecord(rel.as_posix(), len(data), hashlib.sha256(data).hexdigest()))

    def collect_tree(self, out_dir: Path) -> None:
        """Copy the regular files under ``out_dir`` (a sandbox's ``/out`` seen from the host).

        The walk keeps its own stack (no recursion a deep tree could exhaust) and opens each
        directory component by component from ``out_dir`` without following links (no path grows
        past ``PATH_MAX``). A directory `_MAX_DEPTH` levels down is not entered: it is refused once
        for everything under it. What cannot be read is refused, never raised.
        """
        pending: list[tuple[str, ...]] = [()]
        while pending:
            parts = pending.pop()
            try:
                entries = self._collect_directory(out_dir, parts)
            except OSError:
                self.refuse("/".join(parts) or ".", "unreadable")
                continue
            # Reversed onto the stack: subdirectories are visited in name order, depth first.
            pending.extend(reversed(entries))

    def _collect_directory(self, out_dir: Path, parts: tuple[str, ...]) -> list[tuple[str, ...]]:
        """Take the files of one directory of ``out_dir``; return its subdirectories to visit."""
        fd = _open_directory(out_dir, parts)
        try:
            with os.scandir(fd) as listing:
                entries = sorted(listing, key=lambda e: e.name)
            subdirectories: list[tuple[str, ...]] = []
            for entry in entries:
                rel = "/".join((*parts, entry.name))
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    self.refuse(rel, "unreadable")
                    continue
                if stat.S_ISDIR(info.st_mode):
                    if len(parts) + 1 < _MAX_DEPTH:
                        subdirectories.append((*parts, entry.name))
                    else:
                        self.refuse(rel, f"directory deeper than {_MAX_DEPTH} levels: nothing under it taken")
                elif not stat.S_ISREG(info.st_mode):
                    self.refuse(rel, "symlink" if stat.S_ISLNK(info.st_mode) else "not a regular file")
                elif self._bytes + info.st_size > self._caps.max_bytes:
                    self.refuse(rel, "over the total size cap")
                else:
                    self._collect_file(fd, entry.name, rel)
            return subdirectories
        finally:
            os.close(fd)

    def _collect_file(self, directory_fd: int, name: str, rel: str) -> None:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory_fd)
        except OSError:
            self.refuse(rel, "unreadable")
            return
        with os.fdopen(fd, "rb") as handle:
            data = handle.read(self._caps.max_bytes - self._bytes + 1)
        self.add(rel, data)


def _open_directory(root: Path, parts: tuple[str, ...]) -> int:
    """A descriptor of ``root/parts``, each component opened from the last without following a link."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(root, flags)
    try:
        for part in parts:
            child = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def shown(name: str) -> str:
    """``name`` with what UTF-8 cannot hold escaped: an undecodable byte (``surrogateescape``) as
    ``\\xNN``, any other lone surrogate as ``\\udXXX``; valid text unchanged. How file names and
    any other text a record must hold are shown (the router uses it too)."""
    try:
        name.encode()
        return name
    except UnicodeEncodeError:
        pass
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return name.encode("utf-8", "backslashreplace").decode()


def sweep_quarantine(root: Path, keep_s: float, now: float | None = None) -> int:
    """Remove the calls' quarantine directories under ``root`` last changed more than ``keep_s``
    seconds before ``now``; how many went. Quarantined outputs are kept for a while (a framework
    reads them after the call) but not for ever: every call with outputs leaves a directory, and
    a disk they fill stops the audit log, and so every call.

    Nothing under ``root`` is followed: a link (the router never makes one) is unlinked, not its
    target emptied, and `shutil.rmtree` does not follow links inside a tree. An entry that cannot be
    removed now is left for the next sweep.
    """
    cutoff = (time.time() if now is None else now) - keep_s
    try:
        entries = list(os.scandir(root))
    except OSError:  # no quarantine yet (no call had outputs), or not readable: nothing to do
        return 0
    removed = 0
    for entry in entries:
        try:
            info = entry.stat(follow_symlinks=False)
            if info.st_mtime >= cutoff:
                continue
            if stat.S_ISDIR(info.st_mode):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
        except OSError:
            continue
        removed += not os.path.lexists(entry.path)
    return removed


def remove_tree(path: Path) -> None:
    """Remove a staging directory; files the sandbox made read-only do not stop it."""
    shutil.rmtree(path, ignore_errors=True)


_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def mount_tmpfs(path: Path, *, size_mb: int, inodes: int, uid: int) -> bool:
    """Mount a size-capped tmpfs owned by ``uid`` at ``path`` (root only), so a sandbox writing to
    it cannot fill the host's disk. Returns False (leaving a plain directory) when not root."""
    if os.geteuid() != 0:
        return False
    options = f"size={size_mb}m,nr_inodes={inodes},mode=0700,uid={uid},gid={uid}".encode()
    if _libc().mount(b"tmpfs", str(path).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount tmpfs at {path}: {os.strerror(errno)}")
    return True


def unmount(path: Path) -> None:
    _libc().umount2(str(path).encode(), _MNT_DETACH)
