"""structlog, configured once by the entrypoint: JSON in production, console in development."""

from __future__ import annotations

import logging
import sys
from typing import Literal, TextIO

import structlog

from router.redact import redact_log_event


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
            redact_log_event,  # after exceptions are formatted: a secret in a traceback is scrubbed too
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=file or sys.stderr),
        cache_logger_on_first_use=cache,
    )
