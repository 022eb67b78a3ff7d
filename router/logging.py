"""structlog, configured once by the entrypoint: JSON in production, console in development.

An application that embeds stockade (`ControlPlane` in process) and configures nothing still gets
sane logs: `configure_default_logging` runs when `router.control` is imported and, unless
structlog is configured already, sends redacted events at ``STOCKADE_LOG_LEVEL`` (default
``warning``) to stderr, never to stdout (structlog's own default prints everything to stdout,
unredacted). An application that configures structlog itself, before or after, keeps its own
configuration; it adds `router.redact.redact_log_event` to its processors to keep secrets out of
its logs.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any, Literal, TextIO

import structlog

_LEVELS = ("debug", "info", "warning", "error")


def _redacted(logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """`router.redact.redact_log_event`, without importing it (it loads the runner) before it matters."""
    redact = sys.modules.get("router.redact")
    if redact is None:  # never imported, so no secret was ever registered with it
        return event_dict
    scrubbed: MutableMapping[str, Any] = redact.redact_log_event(logger, method, event_dict)
    return scrubbed


def configure_logging(
    fmt: Literal["console", "json"], level: str, file: TextIO | None = None, *, cache: bool = True
) -> None:
    """Configure structlog for this process. Logs go to stderr (or ``file``); stdout is for command
    output. ``cache=False`` lets a later configuration take over loggers already used (tests)."""
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _redacted,  # after exceptions are formatted: a secret in a traceback is scrubbed too
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        # sys.stderr looked up at each event (`_CurrentStderr`), cached loggers included.
        logger_factory=structlog.PrintLoggerFactory(file) if file is not None else _stderr_logger,
        cache_logger_on_first_use=cache,
    )


def configure_default_logging() -> None:
    """Unless structlog is configured already: redacted console logs on stderr at ``STOCKADE_LOG_LEVEL``
    (``STOCKADE_LOG_FORMAT`` ``json`` for JSON). Not cached, so the application's own configuration,
    made later, takes over every logger."""
    if not structlog.is_configured():
        configure_from_environment(cache=False)


def configure_from_environment(*, cache: bool = True) -> None:
    """`configure_logging` with ``STOCKADE_LOG_FORMAT`` and ``STOCKADE_LOG_LEVEL`` as the
    environment has them (console and warning if unset or not one of theirs)."""
    # Read here, not through Settings: this runs at import or at a command's start, where
    # building Settings (and the policy and runner settings it holds) would cost time and could
    # fail. Settings validates the same variables when the application builds it.
    level = os.environ.get("STOCKADE_LOG_LEVEL", "warning").lower()
    fmt = os.environ.get("STOCKADE_LOG_FORMAT", "console").lower()
    configure_logging("json" if fmt == "json" else "console", level if level in _LEVELS else "warning", cache=cache)


class _CurrentStderr:
    """``sys.stderr`` as it is when an event is written, not when its logger was made: a logger
    structlog cached keeps working after whoever swapped stderr (a test runner capturing it, a
    CLI runner) swaps it back and closes its own."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


_CURRENT_STDERR = _CurrentStderr()


def _stderr_logger(*_args: Any) -> structlog.PrintLogger:
    # PrintLogger asks for a TextIO; it only calls write and flush, which the proxy has.
    return structlog.PrintLogger(_CURRENT_STDERR)  # type: ignore[arg-type]
