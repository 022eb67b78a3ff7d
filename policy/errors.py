"""Errors raised by the policy package.

    PolicyError
     └── PolicyBundleError   the policy directory cannot be loaded or compiled

Evaluation never raises: an engine error is a deny with reason code ``policy.error``.
The router translates these into its own tree at the seam.
"""


class PolicyError(Exception):
    """Base class for errors of the policy package."""


class PolicyBundleError(PolicyError):
    """The policy directory cannot be read, parsed or compiled; the message names the file."""


def as_bundle_error(exc: Exception, where: object) -> PolicyBundleError:
    """``exc`` as the `PolicyBundleError` a reload refuses with: itself if it is one, else one
    naming what was being loaded and what went wrong (never an unexpected exception type that
    a caller would not record as a refused reload)."""
    if isinstance(exc, PolicyBundleError):
        return exc
    return PolicyBundleError(f"policy {where} could not be loaded: {type(exc).__name__}: {str(exc)[:300]}")
