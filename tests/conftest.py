"""Shared fixtures: settings pointing at temporary files, and a real control plane
(in-process regorus, real bubblewrap, a real JSONL audit file; the embedded store, or a real
Redis where a module asks for both stores)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest
import redis
import trustme

from policy import PolicySettings
from router import ControlPlane, Settings
from router.settings import AuditSettings, StoreSettings
from runner import RunnerSettings

REPO = Path(__file__).resolve().parent.parent
ALLOWED_HOST = "api.allowed.test"
# scripts/services starts this Redis; the tests own database 15 and flush it around each test.
REDIS_URL = os.environ.get("STOCKADE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
# Keys, anchors and state the code under test makes where a user's would go (~/.config/stockade,
# ~/.local/state/stockade): this run's own directory, never the developer's (each run left
# thousands of anchor files there, and a masking key). Set here, at collection, so subprocesses
# the tests start inherit it too; removed when the run ends.
_SCRATCH_HOME = Path(tempfile.mkdtemp(prefix="stockade-tests-"))
os.environ["XDG_CONFIG_HOME"] = str(_SCRATCH_HOME / "config")
os.environ["XDG_STATE_HOME"] = str(_SCRATCH_HOME / "state")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove this run's scratch home (`_SCRATCH_HOME`)."""
    shutil.rmtree(_SCRATCH_HOME, ignore_errors=True)


@pytest.fixture(autouse=True)
def clean_environ() -> Iterator[None]:
    """Keeps STOCKADE_* variables of the developer's shell out of the tests."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("STOCKADE_")}
    for key in saved:
        del os.environ[key]
    yield
    os.environ.update(saved)


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A real, empty Redis database, flushed again afterwards."""
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.flushdb()
    except redis.exceptions.ConnectionError as exc:
        client.close()
        pytest.fail(f"no Redis at {REDIS_URL} ({exc}): scripts/services starts one")
    yield REDIS_URL
    client.flushdb()
    client.close()


@pytest.fixture
def store_url() -> str | None:
    """The store the control plane fixtures use: the embedded one unless a module asks for both."""
    return None


@pytest.fixture(params=["memory", "redis"])
def both_stores(request: pytest.FixtureRequest) -> str | None:
    """Runs a test once on the embedded store and once on Redis (override ``store_url`` with it)."""
    if request.param == "memory":
        return None
    url: str = request.getfixturevalue("redis_url")
    return url


@pytest.fixture
def settings(tmp_path: Path, store_url: str | None) -> Settings:
    return Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl"),
        policy=PolicySettings(dir=REPO / "policies"),
        store=StoreSettings(url=store_url),
    )


@pytest.fixture
async def plane(settings: Settings) -> AsyncIterator[ControlPlane]:
    async with ControlPlane.from_settings(settings) as control_plane:
        yield control_plane


def python_tool(name: str, source: str, **overrides: Any) -> dict[str, Any]:
    """A `python` tool spec taking any object as arguments."""
    spec: dict[str, Any] = {
        "name": name,
        "description": f"test tool {name}",
        "input_schema": {"type": "object"},
        "risk": "low",
        "executor": {"kind": "python", "source": source},
    }
    spec.update(overrides)
    return spec


def external_tool(name: str, **overrides: Any) -> dict[str, Any]:
    """An ``external`` tool spec (the framework runs it) taking any object as arguments."""
    spec: dict[str, Any] = {
        "name": name,
        "description": f"test tool {name}",
        "input_schema": {"type": "object"},
        "risk": "low",
        "executor": {"kind": "external"},
    }
    spec.update(overrides)
    return spec


ECHO = "def main(**kwargs):\n    return kwargs\n"


def copy_policies(tmp_path: Path) -> Path:
    """A private copy of the shipped policies, to edit."""
    root = tmp_path / "policies"
    shutil.copytree(REPO / "policies", root)
    return root


def edit_catalog(root: Path, **changes: object) -> None:
    """Set top-level entries of the policies' ``catalog`` (data.json)."""
    data_file = root / "stockade" / "data.json"
    data = json.loads(data_file.read_text())
    data["catalog"].update(changes)
    data_file.write_text(json.dumps(data))


@contextlib.contextmanager
def server_process(argv: list[str], log: Path, probe: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """``argv`` plus ``--port <free port>`` as a process, run from the repository; yields its base
    URL once ``probe`` answers over HTTP, and stops it afterwards. Its stderr goes to ``log``."""
    port = free_port()
    with log.open("wb") as stderr:
        server = subprocess.Popen([*argv, "--port", str(port)], env={**os.environ, **(env or {})}, cwd=REPO,
                                  stdout=subprocess.DEVNULL, stderr=stderr)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(url + probe, timeout=1)
                break
            if server.poll() is not None:
                raise RuntimeError(f"{' '.join(argv[:3])} exited: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        yield url
    finally:
        server.terminate()
        server.wait(10)


def stockade_server(
    args: list[str], env: dict[str, str], log: Path, probe: str
) -> contextlib.AbstractContextManager[str]:
    """``stockade <args>`` as a process (see `server_process`)."""
    return server_process([str(Path(sys.executable).parent / "stockade"), *args], log, probe, env)


def free_port() -> int:
    """A loopback port nothing listens on (now)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def runner_state_root() -> Path:
    """The real state root: sandbox uids must traverse into staging directories under it, which
    pytest's own temporary root (private to root) would not let them."""
    root = RunnerSettings().state_dir
    root.mkdir(parents=True, exist_ok=True, mode=0o711)
    return root


@pytest.fixture
def runner_state() -> Iterator[Path]:
    """A fresh state directory for one test's sandboxes, removed afterwards."""
    state = Path(tempfile.mkdtemp(prefix="test-", dir=runner_state_root()))
    os.chmod(state, 0o711)  # noqa: S103  (traverse only, no listing)
    yield state
    shutil.rmtree(state, ignore_errors=True)


def sandbox_containers(owner: str) -> list[dict[str, Any]]:
    """Containers a sandbox instance created that still exist (one API call: no inspect races)."""
    client = docker.from_env()
    try:
        found: list[dict[str, Any]] = client.api.containers(all=True, filters={"label": f"stockade.owner={owner}"})
        return found
    finally:
        client.close()


@dataclass
class Upstream:
    """The allowlisted HTTPS service, on loopback, with a CA only the sandbox's input trusts."""

    port: int
    ca_pem: bytes


@pytest.fixture(scope="session")
def upstream() -> Iterator[Upstream]:
    ca = trustme.CA()
    cert = ca.issue_cert(ALLOWED_HOST)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"hello from the allowlisted upstream"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    cert.configure_cert(context)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield Upstream(server.server_address[1], ca.cert_pem.bytes())
    server.shutdown()
    server.server_close()


@contextlib.contextmanager
def https_and_http(
    handler: type[http.server.BaseHTTPRequestHandler], ca: trustme.CA, host: str
) -> Iterator[tuple[int, int]]:
    """``handler`` served on two loopback ports, HTTPS (a certificate for ``host`` from ``ca``) and
    plain HTTP; yields (https port, http port) and stops both afterwards."""
    servers = []
    for secure in (True, False):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        if secure:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ca.issue_cert(host).configure_cert(context)
            server.socket = context.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    try:
        yield servers[0].server_address[1], servers[1].server_address[1]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
