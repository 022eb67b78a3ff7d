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
