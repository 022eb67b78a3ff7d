"""Inputs in, outputs out: staging directories, and the quarantine that outputs land in.

Outputs are untrusted: only regular files are copied, never followed through a link, under a
path the host rebuilds from checked components, with caps on count and total size. Nothing is
ever extracted from an archive.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

from runner.base import FileRecord, InputFile, OutputCaps

_SAFE_PART = re.compile(r"[A-Za-z0-9._+@=-][A-Za-z0-9._+@= -]{0,254}")  # fullmatch: "$" would admit a final newline
_MAX_DEPTH = 16


def check_input_name(name: str) -> str:
    """An input file name: one path component, no traversal, printable.

    Raises:
        ValueError: the name would escape ``/in`` or is not a plain file name.
    """
    if not _SAFE_PART.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"input file name {name[:80]!r} must be one plain path component (letters, digits, ._-+@=)")
    return name


def stage_inputs(directory: Path, inputs: Iterable[InputFile]) -> tuple[FileRecord, ...]:
    """Write ``inputs`` into ``directory`` (world-readable, owned by the router) and record them."""
    records = []
    for item in inputs:
        name = check_input_name(item.name)
        path = directory / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444)
        with os.fdopen(fd, "wb") as handle:
            handle.write(item.data)
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
        self.records: list[FileRecord] = []
        self.refused: list[tuple[str, str]] = []

    def add(self, path: str, data: bytes) -> None:
        if shown(path) != path:
            # Not UTF-8 (an undecodable name): no record, log or agent could name it faithfully.
            self.refused.append((shown(path)[:200], "name is not valid UTF-8"))
            return
        rel = safe_relative(path)
        if rel is None:
            self.refused.append((path[:200], "unsafe path"))
            return
        if len(self.records) >= self._caps.max_files:
            self.refused.append((path[:200], "over the file count cap"))
            return
        if self._bytes + len(data) > self._caps.max_bytes:
            self.refused.append((path[:200], "over the total size cap"))
            return
        target = self.directory / rel
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        self._bytes += len(data)
        self.records.append(FileRecord(rel.as_posix(), len(data), hashlib.sha256(data).hexdigest()))

    def collect_tree(self, out_dir: Path) -> None:
        """Copy the regular files under ``out_dir`` (a sandbox's ``/out`` seen from the host)."""
        for current, dirs, files in os.walk(out_dir, followlinks=False):
            for name in sorted(dirs):
                if (Path(current) / name).is_symlink():
                    self.refused.append((shown(_rel(out_dir, Path(current) / name)), "symlink"))
            for name in sorted(files):
                full = Path(current) / name
                rel = _rel(out_dir, full)
                info = full.lstat()
                if not stat.S_ISREG(info.st_mode):
                    why = "symlink" if stat.S_ISLNK(info.st_mode) else "not a regular file"
                    self.refused.append((shown(rel), why))
                    continue
                if self._bytes + info.st_size > self._caps.max_bytes:
                    self.refused.append((shown(rel), "over the total size cap"))
                    continue
                try:
                    fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                except OSError:
                    self.refused.append((shown(rel), "unreadable"))
                    continue
                with os.fdopen(fd, "rb") as handle:
                    data = handle.read(self._caps.max_bytes - self._bytes + 1)
                self.add(rel, data)


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


def _rel(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


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
