"""Shared fixtures: settings pointing at temporary files, and a real control plane
(in-process regorus, real bubblewrap, a real JSONL audit file)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from policy import PolicySettings
from router import ControlPlane, Settings
from router.settings import AuditSettings

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def clean_environ() -> Iterator[None]:
    """Keeps STOCKADE_* variables of the developer's shell out of the tests."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("STOCKADE_")}
    for key in saved:
        del os.environ[key]
    yield
    os.environ.update(saved)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl"),
        policy=PolicySettings(dir=REPO / "policies"),
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


ECHO = "def main(**kwargs):\n    return kwargs\n"
