"""The egress proxy: a sandbox's only way out, allowing exactly one call's destinations."""

from runner.egress.proxy import EgressProxy

__all__ = ["EgressProxy"]
