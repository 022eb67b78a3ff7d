"""structlog, configured once by the entrypoint: JSON in production, console in development."""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

from router.credentials.redact import redact_log_event


def configure_logging(fmt: Literal["console", "json"], level: str) -> None:
    """Configure structlog for this process. Logs go to stderr; stdout is for command output."""
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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
