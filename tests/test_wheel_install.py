"""stockade as a user installs it: a wheel built from this checkout, in a fresh venv with the locked
dependencies, run from ``/`` with a HOME of its own. It carries its policy, imports nothing from the
checkout, keeps its state under the user's state directory and serves MCP exactly as
docs/interfaces.md tells Claude Code and Cursor to start it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from policy.bundle import load_bundle
from router.settings import SYSTEM_STATE_DIR, AuditSettings, config_dir, state_dir
from tests.conftest import ECHO, REPO, python_tool

SHIPPED = "policy/shipped/"


def uv() -> list[str]:
    """uv as scripts/bootstrap finds it: on PATH, or the module of the system python3."""
    if found := shutil.which("uv"):
        return [found]
    if subprocess.run(["python3", "-m", "uv", "--version"], capture_output=True, check=False).returncode == 0:
        return ["python3", "-m", "uv"]
    pytest.fail("uv not found: scripts/bootstrap installs it")


def checked(argv: list[str | Path]) -> None:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, f"{argv}: {result.stdout}\n{result.stderr}"


@dataclass
class Installed:
    """The built wheel and the fresh venv it is installed in."""

    wheel: Path
    venv: Path

    @property
    def bin(self) -> Path:
        return self.venv / "bin"

    def env(self, home: Path) -> dict[str, str]:
        """What a client's process starts with: a HOME, a PATH with this install; nothing of ours."""
        return {"HOME": str(home), "PATH": f"{self.bin}:/usr/bin:/bin", "LANG": "C.UTF-8"}

    def run(self, *args: str, home: Path, cwd: Path = Path("/")) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.bin / "stockade"), *args], capture_output=True, text=True, cwd=cwd,
                              env=self.env(home), timeout=180, check=False)  # fmt: skip


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """Build the wheel (no sdist, no editable) and install it with the locked dependencies."""
    root = tmp_path_factory.mktemp("wheel")
    checked([*uv(), "build", "--wheel", "--quiet", "--out-dir", root / "dist", REPO])
    (wheel,) = (root / "dist").glob("stockade-*.whl")
    venv = root / "venv"
    checked([*uv(), "venv", "--quiet", "--python", sys.executable, "--python-preference", "only-system", venv])
    checked([*uv(), "pip", "install", "--quiet", "--python", venv / "bin" / "python",
             "-r", REPO / "requirements.lock", wheel])  # fmt: skip
    return Installed(wheel, venv)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A HOME of the test's own, with no state directory yet."""
    path = tmp_path / "home"
    path.mkdir()
    return path


@pytest.fixture
def root_unchanged() -> Iterator[None]:
    """Nothing new appears in ``/`` or ``/var`` (a relative ``var/audit.jsonl`` from ``/`` would)."""
    before = set(os.listdir("/")) | {f"var/{name}" for name in os.listdir("/var")}
    yield
    after = set(os.listdir("/")) | {f"var/{name}" for name in os.listdir("/var")}
    assert after - before == set()


def policy_files() -> dict[str, bytes]:
    """The checkout's policy directory, the source of truth, as the bundle loader reads it."""
    root = REPO / "policies"
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and (p.suffix == ".rego" or p.name == "data.json")
    }


def user_state(home: Path) -> Path:
    return home / ".local" / "state" / "stockade"


def test_state_goes_to_the_xdg_state_directory_or_the_system_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    assert state_dir() == user_state(tmp_path / "home")  # root in a login shell is a user like any other
    monkeypatch.setenv("XDG_STATE_HOME", "relative/state")  # invalid by the spec: ignored
    assert state_dir() == user_state(tmp_path / "home")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert state_dir() == tmp_path / "xdg" / "stockade"
    assert AuditSettings().path == tmp_path / "xdg" / "stockade" / "audit.jsonl"
    assert stat.S_IMODE((tmp_path / "xdg" / "stockade").stat().st_mode) == 0o700  # made private on first use
    # A system service: root (as the tests run) with no home, as systemd starts a system unit.
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.delenv("HOME")
    assert state_dir() == SYSTEM_STATE_DIR
    monkeypatch.setenv("HOME", "/")
    assert state_dir() == SYSTEM_STATE_DIR


def test_keys_go_to_the_xdg_config_directory_never_one_relative_to_the_working_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A relative XDG_CONFIG_HOME once put the signing key and the anchors under the working
    directory: a router started from elsewhere signed with a new key and held its log to no anchor."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", "relcfg")  # invalid by the spec: ignored
    assert config_dir() == tmp_path / "home" / ".config" / "stockade"
    assert AuditSettings().signing_key.is_absolute()
    assert AuditSettings().signing_key.parent == tmp_path / "home" / ".config" / "stockade"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    assert config_dir() == tmp_path / "cfg" / "stockade"


def test_the_wheel_carries_the_policy_files_beside_the_packages(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = wheel.namelist()
        shipped = {name.removeprefix(SHIPPED): wheel.read(name) for name in names if name.startswith(SHIPPED)}
    assert shipped == policy_files()
    assert "stockade/decision.rego" in shipped
    dist_info = "-".join(installed.wheel.name.split("-")[:2]) + ".dist-info"
    assert {name.split("/")[0] for name in names} == {"router", "policy", "runner", dist_info}


def test_the_installed_package_imports_from_the_venv_and_reads_its_own_policy(installed: Installed, home: Path) -> None:
    probe = (
        "import json, sys, router, policy, runner\n"
        "from router import ControlPlane, Settings\n"
        "from policy.bundle import load_bundle\n"
        "s = Settings()\n"
        "print(json.dumps({'files': [m.__file__ for m in (router, policy, runner)], 'path': sys.path,\n"
        "    'dir': str(s.policy.dir), 'revision': load_bundle(s.policy.dir).revision, 'audit': str(s.audit.path)}))"
    )
    result = subprocess.run([str(installed.bin / "python"), "-c", probe], capture_output=True, text=True, cwd="/",
                            env=installed.env(home), timeout=60, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    site = str(installed.venv / "lib")
    assert all(f.startswith(site) for f in seen["files"]), seen["files"]
    assert not any(entry.startswith(str(REPO)) for entry in seen["path"]), seen["path"]
    assert seen["dir"].startswith(site)
    assert seen["dir"].endswith("/policy/shipped")
    # The same files as the checkout's policies/: the bundle's revision hashes every path and byte.
    assert seen["revision"] == load_bundle(REPO / "policies").revision
    assert seen["audit"] == str(user_state(home) / "audit.jsonl")


# A stand-in server (any HTTP answer will do) and the SDK's client against it, in the installed venv;
# after warm-up, every module search the requests make is counted. A module imported on every
# request but not installed (httpcore's `import sniffio`) is searched for on sys.path each time.
_REQUEST_IMPORTS = """
import asyncio, json, sys
from router.client import StockadeClient

async def answer(reader, writer):
    while await reader.readuntil(b"\\r\\n\\r\\n"):
        writer.write(b"HTTP/1.1 200 OK\\r\\ncontent-type: application/json\\r\\ncontent-length: 2\\r\\n\\r\\n[]")
        await writer.drain()

class Searched:
    names = []
    def find_spec(self, name, path=None, target=None):
        self.names.append(name)

async def main():
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with StockadeClient(f"http://127.0.0.1:{port}", "t") as client:
        for _ in range(3):
            await client.list_tools()
        sys.meta_path.insert(0, Searched())
        for _ in range(20):
            assert await client.list_tools() == []
    print(json.dumps(Searched.names))

asyncio.run(main())
"""


def test_sdk_requests_search_for_no_module_in_the_installed_venv(installed: Installed, home: Path) -> None:
    # Found by bench/transports.py: without sniffio (a dependency of nothing since anyio 4.x), every
    # async httpx request searched the venv for it four times, +0.7 ms per request of the SDK and CLI.
    result = subprocess.run([str(installed.bin / "python"), "-c", _REQUEST_IMPORTS], capture_output=True,
                            text=True, cwd="/", env=installed.env(home), timeout=60, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


@pytest.mark.usefixtures("root_unchanged")
def test_the_demo_runs_from_root_and_keeps_its_audit_log_in_the_state_directory(
    installed: Installed, home: Path, tmp_path: Path
) -> None:
    demo = installed.run("demo", home=home)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "every step behaved as described" in demo.stdout
    assert load_bundle(REPO / "policies").revision[:16] in demo.stdout  # decided with the shipped policy

    state = user_state(home)
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    (log,) = (state / "demo").glob("audit-*.jsonl")
    verify = installed.run("audit", "verify", "--path", str(log), "--json", home=home)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert json.loads(verify.stdout)["ok"] is True

    # From any other directory too, leaving it as it was.
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    assert installed.run("policy", "test", home=home, cwd=elsewhere).returncode == 0
    assert list(elsewhere.iterdir()) == []


# -- the audit extra, as README.md installs it ---------------------------------------------


def readme_install() -> str:
    """The install command of README.md's "Install:" line."""
    found = re.search(r"^Install: `([^`]+)`", (REPO / "README.md").read_text(), re.MULTILINE)
    assert found is not None, "README.md has no `Install: `...`` line"
    return found.group(1)


@pytest.fixture(scope="module")
def audit_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real audit log: a router's registrations, a session and decisions (written by the checkout)."""
    from router import ControlPlane, Settings  # noqa: PLC0415  (the checkout's, only to write the log)
    from router.settings import AuditSettings  # noqa: PLC0415

    root = tmp_path_factory.mktemp("log")
    path = root / "audit.jsonl"

    async def record() -> None:
        settings = Settings(audit=AuditSettings(path=path, signing_key=root / "audit-signing.key"))
        async with ControlPlane.from_settings(settings) as plane:
            await plane.register(python_tool("echo", ECHO))
            session = await plane.open_session("agent-1", "alice@example.com")
            await plane.decide(session, "echo", {"word": "hi"})

    asyncio.run(record())
    return path


def test_the_readme_install_gives_a_stockade_whose_audit_queries_work(
    audit_log: Path, home: Path, tmp_path: Path
) -> None:
    command = readme_install()
    assert command.startswith("uv tool install ")
    assert "[audit" in command  # the extras requirements.lock was compiled with (-c only constrains)
    tools, bin_dir = tmp_path / "tools", tmp_path / "bin"
    # As a user runs it in a checkout, into scratch tool directories; uv's own cache is shared.
    env = {**os.environ, "UV_TOOL_DIR": str(tools), "UV_TOOL_BIN_DIR": str(bin_dir), "UV_PYTHON": sys.executable}
    argv = [*uv(), *shlex.split(command)[1:]]
    install = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=240, check=False)
    assert install.returncode == 0, install.stdout + install.stderr

    query = subprocess.run([str(bin_dir / "stockade"), "audit", "query", "--path", str(audit_log), "--json"],
                           capture_output=True, text=True, cwd="/", timeout=120, check=False,
                           env={"HOME": str(home), "PATH": f"{bin_dir}:/usr/bin:/bin", "LANG": "C.UTF-8"})  # fmt: skip
    assert query.returncode == 0, query.stdout + query.stderr
    events = [json.loads(line) for line in query.stdout.splitlines()]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert [(e["tool"], e["outcome"]) for e in events if e["kind"] == "decision"] == [("echo", "allow")]


def test_an_install_without_the_audit_extra_says_how_to_get_it(
    installed: Installed, audit_log: Path, home: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    checked([*uv(), "venv", "--quiet", "--python", sys.executable, "--python-preference", "only-system", venv])
    checked([*uv(), "pip", "install", "--quiet", "--python", venv / "bin" / "python",
             "-c", REPO / "requirements.lock", installed.wheel])  # fmt: skip
    assert subprocess.run([str(venv / "bin" / "python"), "-c", "import duckdb"], capture_output=True,
                          check=False).returncode != 0  # fmt: skip
    query = Installed(installed.wheel, venv).run("audit", "query", "--path", str(audit_log), home=home)
    assert query.returncode == 2, query.stdout + query.stderr
    message = " ".join(query.stderr.split())
    assert "stockade audit query needs DuckDB, the `audit` extra" in message
    assert readme_install() in message
    # The writer, sealing a segment, starts no indexer that could only fail (at every seal).
    spawn = "from pathlib import Path; from router.audit.index import spawn_indexer; print(spawn_indexer(Path(%r)))"
    started = subprocess.run([str(venv / "bin" / "python"), "-c", spawn % str(audit_log)], capture_output=True,
                             text=True, cwd="/", env=installed.env(home), timeout=60, check=False)  # fmt: skip
    assert started.returncode == 0, started.stderr
    assert started.stdout.split()[-1] == "None"
    assert "audit_indexer_not_started" in started.stdout + started.stderr


# -- MCP, as docs/interfaces.md configures the clients -------------------------------------


def documented(client: str) -> str:
    """The code block that follows ``client`` in the MCP section of docs/interfaces.md."""
    text = (REPO / "docs" / "interfaces.md").read_text()
    section = text.split("\n## MCP\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(rf"^{re.escape(client)}.*?\n```\w+\n(.*?)```", section, re.DOTALL | re.MULTILINE)
    assert found is not None, f"no {client} snippet in docs/interfaces.md ## MCP"
    return found.group(1)


def claude_code_argv(installed: Installed, home: Path, tools: Path) -> list[str]:
    """The server command ``claude mcp add`` records, as a shell with this install on PATH expands it."""
    snippet = documented("Claude Code").replace("/path/to/tools.json", str(tools))
    stub = 'claude() { [ "$1 $2 $4" = "mcp add --" ] || exit 3; shift 4; printf "%s\\0" "$@"; }\n'
    result = subprocess.run(["/bin/bash", "-euc", stub + snippet], capture_output=True, text=True, cwd="/",
                            env=installed.env(home), timeout=30, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.split("\0")[:-1]


def cursor_argv(installed: Installed, tools: Path) -> list[str]:
    """``.cursor/mcp.json``'s server, its ``command`` being where this install put stockade."""
    server = json.loads(documented("Cursor"))["mcpServers"]["stockade"]
    assert server["command"].endswith("/stockade")
    args = [str(tools) if a == "/path/to/tools.json" else a for a in server["args"]]
    return [str(installed.bin / "stockade"), *args]


@pytest.mark.usefixtures("root_unchanged")
@pytest.mark.parametrize("client", ["claude-code", "cursor"])
async def test_an_mcp_client_starts_the_installed_stockade_as_documented(
    installed: Installed, home: Path, tmp_path: Path, client: str
) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([python_tool("echo", ECHO)]))
    argv = claude_code_argv(installed, home, tools) if client == "claude-code" else cursor_argv(installed, tools)
    assert argv[0] == str(installed.bin / "stockade")
    assert argv[1:4] == ["mcp", "--agent", client]

    params = StdioServerParameters(command=argv[0], args=argv[1:], env=installed.env(home), cwd="/")
    with (tmp_path / "stderr").open("w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            listed = await session.list_tools()
            result = await session.call_tool("echo", {"word": "hi"})
    assert [t.name for t in listed.tools] == ["echo"], (tmp_path / "stderr").read_text()
    assert result.is_error is False
    assert json.loads(result.content[0].text) == {"word": "hi"}  # type: ignore[union-attr]

    audit = [json.loads(line) for line in (user_state(home) / "audit.jsonl").read_text().splitlines()]
    decisions = [e for e in audit if e["kind"] == "decision"]
    assert [(e["agent"], e["tool"]) for e in decisions] == [(client, "echo")]
