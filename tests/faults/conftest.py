"""Fault injection: each test starts the component it breaks (its own redis-server on a free
loopback port, a small tmpfs for the audit log, a router process), breaks it for real (SIGKILL,
a full disk), and counts what got through."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.conftest import free_port


class RedisServer:
    """A redis-server of this test's own, that it can kill -9 and start again on the same port."""

    def __init__(self, directory: Path, *, persistent: bool) -> None:
        self.directory, self.persistent = directory, persistent
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else ["--appendonly", "no"]
        self._process = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--dir",
             str(self.directory), "--enable-debug-command", "local", *persistence],  # DEBUG SLEEP: a stall
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        try:
            for _ in range(100):
                with contextlib.suppress(redis.exceptions.ConnectionError):
                    if client.ping():
                        return
                time.sleep(0.05)
            raise RuntimeError("redis-server did not start")
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final save."""
        if self._process is not None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait(10)
            self._process = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path, persistent=False)
    server.start()
    yield server
    server.kill()


@pytest.fixture
def persistent_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path, persistent=True)
    server.start()
    yield server
    server.kill()


@contextlib.contextmanager
def small_tmpfs(path: Path, size_kb: int) -> Iterator[Path]:
    """A tmpfs of ``size_kb`` mounted at ``path`` (the tests run as root), unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k,mode=0755", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> Path:
    """Fill the filesystem of ``directory`` to the last byte; the filler file, to delete."""
    filler = directory / "filler"
    with filler.open("wb", buffering=0) as handle:
        with contextlib.suppress(OSError):
            while True:
                handle.write(b"\0" * 4096)
        with contextlib.suppress(OSError):
            while True:
                handle.write(b"\0")
    assert os.statvfs(directory).f_bavail == 0
    return filler
