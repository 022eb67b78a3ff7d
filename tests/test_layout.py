"""The package layers, read from every module's imports: policy and runner never import the router;
the router's domain never imports its interfaces or its client; the client imports only the wire
types of the rest (tests/router/test_sdk.py checks what importing it loads at run time)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

# What the client may import of the router: the wire types and the error tree, nothing that runs.
CLIENT_MAY_IMPORT = {"router", "router.client", "router.errors", "router.results", "router.wire"}


def modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at any level of the file (lazy imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("package", ["policy", "runner"])
def test_policy_and_runner_never_import_the_router(package: str) -> None:
    offending = {
        str(p.relative_to(REPO)): sorted(n for n in imported(p) if under(n, "router")) for p in modules(package)
    }
    assert {path: names for path, names in offending.items() if names} == {}


def test_the_domain_never_imports_its_interfaces_or_the_client() -> None:
    domain = [p for p in modules("router") if not p.is_relative_to(REPO / "router" / "interfaces")
              and not p.is_relative_to(REPO / "router" / "client")]  # fmt: skip
    assert len(domain) > 20  # the walk found the domain
    offending = {
        str(p.relative_to(REPO)): sorted(
            n for n in imported(p) if under(n, "router.interfaces") or under(n, "router.client")
        )
        for p in domain
    }
    assert {path: names for path, names in offending.items() if names} == {}


def test_the_client_imports_nothing_of_the_server() -> None:
    offending = {}
    for path in modules("router/client"):
        names = {n for n in imported(path) if under(n, "router") or under(n, "policy") or under(n, "runner")}
        # `from router.x import Name` also records router.x.Name: judge the module part.
        bad = sorted(n for n in names if not any(n == m or n.startswith(m + ".") for m in CLIENT_MAY_IMPORT)
                     or under(n, "router.interfaces"))  # fmt: skip
        if bad:
            offending[str(path.relative_to(REPO))] = bad
    assert offending == {}
