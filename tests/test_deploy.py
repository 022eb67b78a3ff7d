"""compose.yaml as docker-compose reads it (no registry here: validated, not run; the same
topology runs in tests/router/test_api.py as two `stockade serve` processes on one Redis)."""

from __future__ import annotations

import shutil
import subprocess

from tests.conftest import REPO


def compose_config(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("docker-compose")
    assert binary is not None, "scripts/services installs docker-compose"
    return subprocess.run([binary, "-f", str(REPO / "compose.yaml"), "config", *args],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip


def yaml_service(config: str, name: str) -> str:
    """The lines of service ``name`` in docker-compose's normalised config."""
    lines = config.splitlines()
    start = lines.index(f"  {name}:")
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i].startswith("  ") and not lines[i].startswith("   ")),
        len(lines),
    )
    return "\n".join(lines[start:end])


def test_compose_file_is_valid_and_has_the_topology() -> None:
    checked = compose_config("-q")
    assert checked.returncode == 0, checked.stderr
    services = set(compose_config("--services").stdout.split())
    assert services == {"router", "gateway", "redis", "opa"}
    config = compose_config().stdout
    assert "replicas: 2" in config
    assert "redis://redis:6379/0" in config
    assert "--appendonly" in config
    # Redis may lose no acknowledged write: a used approval or a session's taint would come back.
    redis = yaml_service(config, "redis")
    assert "- always" in redis
    assert "- everysec" not in redis
    assert "- noeviction" in redis
    assert "STOCKADE_POLICY__ENGINE: opa" in config
    # OPA serves the mounted, watched policies/; the routers ask it and upload nothing.
    assert 'STOCKADE_POLICY__OPA_UPLOAD: "false"' in config
    assert "--watch" in config
    assert config.count(f"{REPO / 'policies'}:/policies:ro") == 2
    for service in ("router", "redis", "opa"):
        assert config.count("healthcheck:") >= 3, service


def test_the_router_image_installs_from_the_lock_with_hashes() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "--require-hashes -r requirements.lock" in dockerfile
    assert 'CMD ["stockade", "serve"' in dockerfile
