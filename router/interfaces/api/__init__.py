"""stockade over HTTP (FastAPI). For now the endpoints services use to check credentials: RFC 7662
introspection and the JWKS; the agent-facing API grows here."""

from router.interfaces.api.app import create_app

__all__ = ["create_app"]
