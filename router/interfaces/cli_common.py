"""Helpers every `stockade` command module shares: the consoles, the common options, settings
from the context, failing with an exit code, JSON output and time options."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import re
import sys
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.segment import Segment

if TYPE_CHECKING:
    # The writer (pydantic models, signatures) only for the commands that open a log; the
    # settings (pydantic, every component's settings model) only for the commands that read them.
    from router.audit import JsonlAuditLog
    from router.audit.checkpoint import VerifyKey
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
        if isinstance(exc.__cause__, json.JSONDecodeError):
            raise fail(
                f"invalid settings: {_unparsed_variable(exc)} is not valid JSON: {exc.__cause__}"[:1500]
            ) from None
        cause = f" ({exc.__cause__})" if exc.__cause__ else ""
        raise fail(f"invalid settings: {exc}{cause}"[:1500]) from None


def _unparsed_variable(exc: Exception) -> str:
    """The STOCKADE_* variable whose JSON value pydantic-settings could not parse: its error names
    only the top-level field (``"audit"``), so the variables under it are read as the settings
    read them, and the one holding the text the parser choked on is named."""
    from pydantic_settings import EnvSettingsSource  # noqa: PLC0415

    from router.settings import Settings  # noqa: PLC0415

    found = re.search(r'field "([^"]+)"', str(exc))
    field = found[1] if found else ""
    text = exc.__cause__.doc if isinstance(exc.__cause__, json.JSONDecodeError) else None
    prefix = f"stockade_{field.lower()}"
    names = [name.upper() for name, value in EnvSettingsSource(Settings).env_vars.items()
             if value is not None and (name == prefix or name.startswith(prefix + "__")) and value == text]  # fmt: skip
    if names:
        return names[0]
    return f"a STOCKADE_{field.upper()}__* variable" if field else "a STOCKADE_* variable"


def _variable(loc: tuple[int | str, ...]) -> str:
    """The STOCKADE_* variable a validation error's location is in (``("audit", "backend")``:
    STOCKADE_AUDIT__BACKEND), and where inside its JSON value if deeper."""
    names = [str(part) for part in itertools.takewhile(lambda part: isinstance(part, str), loc)]
    inside = ".".join(map(str, loc[len(names) :]))
    variable = "STOCKADE_" + "__".join(names).upper()
    return f"{variable} (at {inside})" if inside else variable


def verify_keys(settings: Settings, public_key: Path | None) -> list[VerifyKey]:
    """The log's public key: ``--public-key``, else the signing key's ``.pub`` beside it; none if
    that default is not there (exit 2 naming a given key that cannot be read)."""
    from router.audit.checkpoint import VerifyKey  # noqa: PLC0415

    source = public_key or settings.audit.signing_key.with_name(settings.audit.signing_key.name + ".pub")
    if public_key is None and not source.exists():
        return []
    try:
        return [VerifyKey.load(source)]
    except (OSError, ValueError) as exc:
        raise fail(f"--public-key {source}: {exc}") from exc


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``message`` as an error; the `typer.Exit` to raise (2: bad usage or input). The message
    is text, never markup: a path, an install command (``'.[audit]'``) or a log's words keep their brackets."""
    err.print(f"[red]error:[/red] {escape(message)}", markup=True)
    return typer.Exit(code)


AUDIT_EXTRA = "uv tool install -c requirements.lock '.[audit,otel]'"
"""How to install stockade with the `audit` extra (DuckDB) from a checkout, as README.md says."""


def audit_engine_missing(command: str) -> str:
    """Why ``command`` cannot run on this install (it has no DuckDB), and how to give it one."""
    return (f"{command} needs DuckDB, the `audit` extra, which this stockade was installed without: in a "
            f"checkout, reinstall with it: {AUDIT_EXTRA} (or pip install '.[audit]')")  # fmt: skip


def require_audit_engine(command: str) -> None:
    """Exit 2 naming the install command if DuckDB, which ``command`` reads the log with, is not
    installed: an optional dependency missing is a fault of the install, not a bug (exit 70)."""
    if importlib.util.find_spec("duckdb") is None:
        raise fail(audit_engine_missing(command))


def finite(value: Any) -> Any:
    """``value`` with every NaN and infinity (a DuckDB double, a metric) as None: JSON has no
    such numbers, and ``NaN`` in output breaks every strict parser a script uses."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def emit_json(value: Any) -> None:
    """Write ``value`` to stdout as indented JSON, for scripts (NaN and infinities as null)."""
    sys.stdout.write(json.dumps(finite(value), indent=2, default=str, allow_nan=False) + "\n")


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


INPUT_MAX_BYTES = 16 << 20
"""The largest JSON input file a command reads (a PolicyInput, tool specs): far over any real one,
and a stream such as /dev/zero fails with this named instead of exhausting memory."""


def read_capped(path: Path, what: str, limit: int = INPUT_MAX_BYTES) -> bytes:
    """The bytes of ``path`` (``-``: stdin), at most ``limit``; exits 2 naming ``what`` (the
    option, say) if it cannot be read or is larger."""
    try:
        if str(path) == "-":
            raw = sys.stdin.buffer.read(limit + 1)
        else:
            with path.open("rb") as handle:
                raw = handle.read(limit + 1)
    except OSError as exc:
        raise fail(f"{what} {path}: cannot be read ({exc.strerror or exc})") from exc
    if len(raw) > limit:
        raise fail(f"{what} {path}: larger than {limit >> 20} MiB, more than any input it takes; pass the right file")
    return raw


def parse_json(raw: bytes, what: str) -> Any:
    """``raw`` parsed as JSON; exits 2 naming ``what`` if it is not JSON or nests too deeply to read."""
    try:
        return json.loads(raw)
    except RecursionError as exc:  # the parser's recursion: a file built to nest thousands deep
        raise fail(f"{what}: JSON nested too deeply to read") from exc
    except ValueError as exc:
        raise fail(f"{what}: not JSON ({exc})") from exc


def audit_log(ctx: typer.Context, path: Path | None, *, without_active: bool = False) -> JsonlAuditLog:
    """The JSONL audit log at ``path`` (default: the configured one); exits 2 if there is none.
    With ``without_active`` (verify), a log whose active segment is gone while its sealed segments
    or checkpoints are there is still one: what is missing is a verdict, not a wrong path."""
    settings = settings_of(ctx).audit
    target = path or settings.path
    if not target.exists() and not (without_active and _log_parts_exist(target)):
        raise fail(f"no audit log at {target}; pass --path or set STOCKADE_AUDIT__PATH")
    if target.is_dir():
        raise fail(f"{target} is a directory, not an audit log; pass --path with the log file (audit.jsonl)")
    from router.audit import JsonlAuditLog  # noqa: PLC0415

    return JsonlAuditLog(target, durability=settings.durability)


def _log_parts_exist(target: Path) -> bool:
    from router.audit.layout import LogLayout  # noqa: PLC0415

    layout = LogLayout(target)
    return layout.segments_dir.is_dir() or layout.checkpoints.is_file()


def tool_specs(path: Path) -> list[dict[str, Any]]:
    """The tool specs in a JSON file (a list), or in each ``*.json`` file of a directory (a list
    or one spec; by name), each checked as a ToolSpec: exit 2 naming the file, tool and field, or
    the directory if it holds no ``*.json`` file (a check of no tools would pass saying nothing)."""
    from pydantic import ValidationError  # noqa: PLC0415

    from router.tools import ToolSpec  # noqa: PLC0415

    if path.is_dir():
        files = sorted(file for file in path.glob("*.json") if not file.is_dir())
        if not files:
            raise fail(f"--tools {path}: the directory holds no *.json tool specs; pass the file or directory "
                       "that has them")  # fmt: skip
        return [spec for file in files for spec in tool_specs(file)]
    specs = parse_json(read_capped(path, "--tools"), f"cannot read the tool specs in {path}")
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
