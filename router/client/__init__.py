"""The Python SDK: the control plane's methods over HTTP (`StockadeClient`, and `SyncStockadeClient`
for synchronous code), Python functions as sandboxed tools (`sandboxed_tool`), and adapters that
hand registered tools to model APIs and agent frameworks (`router.client.adapters`).

Results are the same typed models the in-process `ControlPlane` returns and errors the same
exceptions, rebuilt from the API's problem details by their ``code`` (`router.client.errors`).
Importing the SDK loads pydantic, httpx and the wire types (`router.wire`), never the server:
no policy engine, sandbox, store or web framework. The adapters are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from router.client.clients import StockadeClient, SyncStockadeClient
from router.client.errors import ApiError, ApiUnreachable, IdentityMismatch
from router.client.tools import SandboxedTool, sandboxed_tool

if TYPE_CHECKING:
    from router.client.adapters import (
        anthropic_tools,
        langchain_tools,
        openai_agents_tools,
        openai_tools,
        pydantic_ai_toolset,
    )

__all__ = [
    "ApiError",
    "ApiUnreachable",
    "IdentityMismatch",
    "SandboxedTool",
    "StockadeClient",
    "SyncStockadeClient",
    "anthropic_tools",
    "langchain_tools",
    "openai_agents_tools",
    "openai_tools",
    "pydantic_ai_toolset",
    "sandboxed_tool",
]

_ADAPTERS = frozenset(
    {"anthropic_tools", "langchain_tools", "openai_agents_tools", "openai_tools", "pydantic_ai_toolset"}
)


def __getattr__(name: str) -> Any:
    if name not in _ADAPTERS:
        raise AttributeError(f"module 'router.client' has no attribute {name!r}")
    value = getattr(importlib.import_module("router.client.adapters"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
