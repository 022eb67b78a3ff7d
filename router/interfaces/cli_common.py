"""Helpers every `stockade` command module shares: the consoles, the common options, settings
from the context, failing with an exit code, JSON output and time options."""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.segment import Segment

if TYPE_CHECKING:
    # The writer (pydantic models, signatures) only for the commands that open a log; the
    # settings (pydantic, every component's settings model) only for the commands that read them.
    from router.audit import JsonlAuditLog
    from router.settings import Settings

# C0 controls but newline and tab, DEL and C1 controls: what a terminal would act on. Each becomes
# one visible character (its control picture, or U+FFFD), so widths and styled spans stay put.
_CONTROLS = {c: chr(0x2400 + c) for c in range(0x20) if c not in (0x09, 0x0A)}
_CONTROLS |= {0x7F: "\u2421"} | dict.fromkeys(range(0x80, 0xA0), "\ufffd")


def visible(text: str) -> str:
    """``text`` with every character a terminal would act on (ESC, CSI, BEL...) shown instead."""
    return text.translate(_CONTROLS)


class SafeConsole(Console):
    """A console that never writes a control character it was given as text: names and messages
    from an audit log or a policy (an agent's, an attacker's) cannot clear the screen, recolour
    it or plant links. Rich's own styling is added after this, so it still works."""

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        # Segment.control marks rich's own codes (cursor moves for progress): kept as they are.
        return super()._render_buffer(
            segment if segment.control else Segment(visible(segment.text), segment.style) for segment in buffer
        )


out = SafeConsole(highlight=False, soft_wrap=True)
err = SafeConsole(stderr=True, highlight=False, soft_wrap=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of a table.")]
PolicyDir = Annotated[Path | None, typer.Option("--dir", help="Policy directory (default: STOCKADE_POLICY__DIR).")]
AuditPath = Annotated[Path | None, typer.Option("--path", help="Audit log (default: STOCKADE_AUDIT__PATH).")]


def settings_of(ctx: typer.Context) -> Settings:
    """The settings from the STOCKADE_* variables, read when a command first asks (an auditor's
    ``audit query --path``, say, never does, and starts without loading them). A variable that
    does not validate is a usage error (exit 2) naming it."""
    root = ctx.find_root()
    if root.obj is None:
        root.obj = _read_settings()
    settings: Settings = root.obj
    return settings


def _read_settings() -> Settings:
    from pydantic import ValidationError  # noqa: PLC0415
    from pydantic_settings import SettingsError  # noqa: PLC0415

    from router.settings import Settings  # noqa: PLC0415

    try:
        return Settings()
    except ValidationError as exc:
        problems = "; ".join(f"{_variable(e['loc'])}: {e['msg']}" for e in exc.errors())
        raise fail(f"invalid settings: {problems[:1500]}") from None
    except SettingsError as exc:  # a variable that should hold JSON does not
        cause = f" ({exc.__cause__})" if exc.__cause__ else ""
        raise fail(f"invalid settings: {exc}{cause}"[:1500]) from None


def _variable(loc: tuple[int | str, ...]) -> str:
    """The STOCKADE_* variable a validation error's location is in (``("audit", "backend")``:
    STOCKADE_AUDIT__BACKEND), and where inside its JSON value if deeper."""
    names = [str(part) for part in itertools.takewhile(lambda part: isinstance(part, str), loc)]
    inside = ".".join(map(str, loc[len(names) :]))
    variable = "STOCKADE_" + "__".join(names).upper()
    return f"{variable} (at {inside})" if inside else variable


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``message`` as an error; the `typer.Exit` to raise (2: bad usage or input)."""
    err.print(f"[red]error:[/red] {message}", markup=True)
    return typer.Exit(code)


def emit_json(value: Any) -> None:
    """Write ``value`` to stdout as indented JSON, for scripts."""
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")


def when(value: str | None, option: str) -> datetime | None:
    """An ISO 8601 time option with its zone; exits 2 naming ``option`` if it is not one."""
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise fail(f"{option} {value!r} is not an ISO 8601 time such as 2026-11-22T10:00:00Z") from exc
    if parsed.tzinfo is None:
        raise fail(f"{option} {value!r} needs a timezone, e.g. 2026-11-22T10:00:00Z")
    return parsed


def audit_log(ctx: typer.Context, path: Path | None) -> JsonlAuditLog:
    """The JSONL audit log at ``path`` (default: the configured one); exits 2 if there is none."""
    settings = settings_of(ctx).audit
    target = path or settings.path
    if not target.exists():
        raise fail(f"no audit log at {target}; pass --path or set STOCKADE_AUDIT__PATH")
    from router.audit import JsonlAuditLog  # noqa: PLC0415

    return JsonlAuditLog(target, durability=settings.durability)


def tool_specs(path: Path) -> list[dict[str, Any]]:
    """The tool specs in a JSON file (a list), or in each ``*.json`` file of a directory (a list
    or one spec; by name), each checked as a ToolSpec: exit 2 naming the file, tool and field."""
    from pydantic import ValidationError  # noqa: PLC0415

    from router.tools import ToolSpec  # noqa: PLC0415

    if path.is_dir():
        return [spec for file in sorted(path.glob("*.json")) for spec in tool_specs(file)]
    try:
        specs = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise fail(f"cannot read the tool specs in {path}: {exc}") from exc
    if isinstance(specs, dict):
        specs = [specs]
    if not isinstance(specs, list) or not all(isinstance(s, dict) for s in specs):
        raise fail(f"{path} must hold a JSON list of tool specs (objects), or one spec")
    for i, spec in enumerate(specs):
        try:
            ToolSpec.model_validate(spec)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(spec)'}: {e['msg']}" for e in exc.errors())
            raise fail(f"{path}: tool #{i} ({str(spec.get('name', '?'))[:64]}) is not a valid tool spec: "
                        f"{problems[:1500]}") from None  # fmt: skip
    return specs
