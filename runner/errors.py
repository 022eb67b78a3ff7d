"""Errors raised by the runner package.

    SandboxError
     └── SandboxUnavailable   the requested tier cannot run on this host

A tool that fails, times out or hits a limit is not an error: it is a `RunResult` verdict.
These are for when the sandbox itself cannot do its job; the router denies the call.
"""


class SandboxError(Exception):
    """The sandbox could not run the job (spawn failed, setup failed)."""


class SandboxUnavailable(SandboxError):
    """The requested tier is not usable here; the message says what is missing and how to install it."""
