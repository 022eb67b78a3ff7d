"""Adapters that hand registered tools to model APIs and agent frameworks; every call goes
through stockade."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from router.tools import ToolSpec

if TYPE_CHECKING:
    from router.client import StockadeClient


def openai_tools(specs: list[ToolSpec]) -> list[dict[str, Any]]:
    """The tools as OpenAI function-calling definitions (Chat Completions ``tools``)."""
    return [{"type": "function", "function": {"name": s.name, "description": s.description,
                                              "parameters": s.input_schema}} for s in specs]  # fmt: skip


def anthropic_tools(specs: list[ToolSpec]) -> list[dict[str, Any]]:
    """The tools as Anthropic Messages API tool definitions."""
    return [{"name": s.name, "description": s.description, "input_schema": s.input_schema} for s in specs]


def langchain_tools(client: StockadeClient, session_id: str, specs: list[ToolSpec]) -> list[Any]:
    """The tools as LangChain ``StructuredTool``s whose every call goes through stockade in
    ``session_id`` (needs the ``langchain`` extra). A call that does not complete returns the
    status, reason codes and decision_id as its text, for the model to read."""
    from langchain_core.tools import StructuredTool  # noqa: PLC0415  (an optional extra)

    def bind(spec: ToolSpec) -> Any:
        async def run(**args: Any) -> str:
            result = await client.call(session_id, spec.name, args)
            if result.ok:
                return result.output if isinstance(result.output, str) else json.dumps(result.output)
            return json.dumps({"status": result.status, "reasons": result.reasons, "decision_id": result.decision_id,
                               "approval_id": result.approval_id})  # fmt: skip

        return StructuredTool.from_function(coroutine=run, name=spec.name, description=spec.description,
                                            args_schema=spec.input_schema, infer_schema=False)  # fmt: skip

    return [bind(spec) for spec in specs]
