"""The contracts a policy is written against, as JSON Schema: ``input`` and ``data``.

- `input_schema`: what Rego sees as ``input``, generated from `policy.base.PolicyInput` (so it
  changes when the code does), with ``input.args`` refined per registered tool: each tool's own
  argument schema, selected by ``input.tool.name``.
- `data_schema`: what the policy directory's ``data.json`` files may hold. ``data.stockade.catalog``
  (`Catalog`) and ``data.stockade.reasons`` (`ReasonCatalog`) are typed and closed; a team's own
  top-level data (outside ``data.stockade``) is accepted as it is.

`policy.check` resolves every ``input.*`` and ``data.*`` reference of a policy against these.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, RootModel, StrictInt, ValidationError, create_model

from policy import base
from policy.bundle import PolicyBundle
from policy.errors import PolicyBundleError

# The windows the router counts, by scope and period (used only until `policy.base.RATE_WINDOWS`
# exists: the router's list is the truth).
_RATE_SCOPES = ("session", "agent", "principal", "tool", "agent_tool")
_RATE_PERIODS = ("minute", "hour", "day")
REASON_CODE = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z0-9_]+)+$")


def rate_windows() -> tuple[str, ...]:
    """The rate windows the router sends in ``input.rate`` (``agent_per_hour``, ...)."""
    windows = getattr(base, "RATE_WINDOWS", None)
    if windows:
        return tuple(windows)
    counts = getattr(base, "RateCounts", None)
    if isinstance(counts, type) and issubclass(counts, BaseModel):
        return tuple(counts.model_fields)
    return tuple(f"{scope}_per_{period}" for scope in _RATE_SCOPES for period in _RATE_PERIODS)


class _Closed(BaseModel):
    # strict: a limit written as the string "2" is an error here, not a value Rego compares as text.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _limit_values_model() -> type[BaseModel]:
    """One optional positive number per field of `policy.base.Limits` (never null: Rego's ``min``
    over a null picks the null)."""
    fields: dict[str, Any] = {}
    for name, info in base.Limits.model_fields.items():
        kinds = [kind for kind in get_args(info.annotation) if kind is not type(None)] or [info.annotation]
        # Absent is allowed (a limit without a catalog default defaults to its maximum, sandbox.rego);
        # an explicit null is not.
        fields[name] = (kinds[0], Field(default=None, gt=0))
    model: type[BaseModel] = create_model("LimitValues", __base__=_Closed, **fields)
    return model


LimitValues = _limit_values_model()


class CatalogLimits(_Closed):
    """The tool's default limits when it names none, and the ceiling policy caps every limit to."""

    default: LimitValues  # type: ignore[valid-type]  # built from Limits' fields above
    max: LimitValues  # type: ignore[valid-type]


class CatalogCredential(_Closed):
    """A credential tools may be granted: the scopes allowed and the grant's lifetime."""

    scopes: list[str] = Field(default_factory=list)
    ttl_s: StrictInt = Field(default=60, gt=0)


def _rate_limits_model() -> type[BaseModel]:
    """One optional limit (an integer ≥ 0) per window the router counts; any other key is an
    error, because a window the router does not send never fires."""
    fields: dict[str, Any] = {window: (StrictInt, Field(default=None, ge=0)) for window in rate_windows()}
    model: type[BaseModel] = create_model("RateLimits", __base__=_Closed, **fields)
    return model


RateLimits = _rate_limits_model()


class Catalog(_Closed):
    """``data.stockade.catalog``: the tool catalog's defaults and allowlists the shipped rules read."""

    capabilities: list[str]
    risks: list[str]
    auto_allow_risks: list[str]
    approval_risks: list[str]
    denied_capability_sets: list[list[str]]
    limits: CatalogLimits
    tiers: list[str]
    min_tier_by_capability: dict[str, str]
    egress_allowlist: list[str]
    consequential_capabilities: list[str]
    rate_limits: RateLimits  # type: ignore[valid-type]  # built from the rate windows above
    credentials: dict[str, CatalogCredential]


class ReasonEntry(_Closed):
    """One reason code: the outcome it leads to, what it means, and what to do about it."""

    outcome: Literal["deny", "require_approval"]
    message: str = Field(min_length=1)
    runbook: str = Field(min_length=1)


ReasonCode = Annotated[str, Field(pattern=REASON_CODE.pattern)]


class ReasonCatalog(RootModel[dict[ReasonCode, ReasonEntry]]):
    """``data.stockade.reasons``: every reason code a rule (or the router) may give."""

    model_config = ConfigDict(strict=True)


def validate_data(bundle: PolicyBundle) -> dict[str, str] | None:
    """Check ``data.stockade.catalog`` against `Catalog` and ``data.stockade.reasons`` against
    `ReasonCatalog`, each where the bundle has it, as every engine loads a policy: a catalog the
    rules misread fails open (a rate limit of ``"120"`` compares as text, and no window ever
    fires), so such a policy is refused, and a reload keeps the old one. Returns the reason
    catalog as code → outcome, which decisions are checked against (`policy.base.to_decision`);
    None if the bundle has none.

    Raises:
        PolicyBundleError: a value the schema refuses, named by its path under ``data``.
    """
    stockade = bundle.data.get("stockade", {})
    if not isinstance(stockade, dict):
        raise PolicyBundleError(f"{bundle.root}: data.stockade is a {type(stockade).__name__}, not an object")
    for key, model in (("catalog", Catalog), ("reasons", ReasonCatalog)):
        if key not in stockade:
            continue
        try:
            model.model_validate(stockade[key])
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(("data.stockade", key, *(str(part) for part in first["loc"])))
            got = f" (it is {json.dumps(first['input'])[:80]})" if "input" in first else ""
            raise PolicyBundleError(
                f"{bundle.root}: {where}: {first['msg']}{got}; fix the data.json that sets it "
                "(`stockade policy check` names its line)"
            ) from exc
    if "reasons" not in stockade:
        return None
    return {code: entry["outcome"] for code, entry in stockade["reasons"].items()}


def input_schema(tools: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """JSON Schema of ``input``, from `PolicyInput`, every ``$ref`` inlined.

    With ``tools`` (registration specs: ``name`` and ``input_schema``, or ``args``), ``input.tool.name``
    is one of their names and ``input.args`` is the chosen tool's argument schema: ``args`` is the
    union of them, and ``allOf`` holds one ``if tool.name == X then args is X's schema`` per tool.
    """
    schema = _inline(base.PolicyInput.model_json_schema())
    properties = schema["properties"]
    rate = properties.get("rate", {})
    if "properties" not in rate:  # an open map of counts: close it over the windows the router sends
        properties["rate"] = {
            "type": "object",
            "properties": {window: {"type": "integer", "minimum": 0} for window in rate_windows()},
            "additionalProperties": False,
        }
    if tools:
        by_tool = {str(tool["name"]): _tool_args_schema(tool) for tool in tools}
        properties["tool"]["properties"]["name"] = {"type": "string", "enum": sorted(by_tool)}
        properties["args"] = {"anyOf": list(by_tool.values())}
        schema["allOf"] = [
            {
                "if": {"properties": {"tool": {"properties": {"name": {"const": name}}}}},
                "then": {"properties": {"args": args}},
            }
            for name, args in by_tool.items()
        ]
    return schema


def args_by_tool(schema: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The per-tool argument schemas of an `input_schema` (empty when it was made without tools)."""
    found: dict[str, dict[str, Any]] = {}
    for clause in schema.get("allOf", []):
        name = clause.get("if", {}).get("properties", {}).get("tool", {}).get("properties", {}).get("name", {})
        args = clause.get("then", {}).get("properties", {}).get("args")
        if "const" in name and isinstance(args, dict):
            found[str(name["const"])] = args
    return found


def data_schema(bundle: PolicyBundle | None = None) -> dict[str, Any]:
    """JSON Schema of ``data`` as the ``data.json`` files make it, every ``$ref`` inlined.

    ``data.stockade`` holds exactly ``catalog`` and ``reasons``; other top-level keys are a
    team's own and untyped (with ``bundle``, the ones it has are listed).
    """
    stockade = {
        "type": "object",
        "properties": {
            "catalog": _inline(Catalog.model_json_schema()),
            "reasons": _inline(ReasonCatalog.model_json_schema()),
        },
        "additionalProperties": False,
    }
    schema: dict[str, Any] = {"type": "object", "properties": {"stockade": stockade}, "additionalProperties": True}
    if bundle is not None:
        for key in bundle.data:
            if key != "stockade":
                schema["properties"][key] = {}
    return schema


def _tool_args_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    args = tool.get("input_schema", tool.get("args"))
    if not isinstance(args, Mapping):
        return {"type": "object"}
    return _inline(dict(args))


def _inline(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with every local ``$ref`` (``#/$defs/X``) replaced by its target; a recursive
    reference is left open (``{}``), which the checker reads as "any value"."""
    definitions = schema.get("$defs", {}) | schema.get("definitions", {})

    def resolve(node: Any, seen: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [resolve(item, seen) for item in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/"):
            name = ref.rsplit("/", 1)[-1]
            if name in seen or name not in definitions:
                return {}
            rest = {k: v for k, v in node.items() if k != "$ref"}
            return resolve({**copy.deepcopy(definitions[name]), **rest}, (*seen, name))
        return {k: resolve(v, seen) for k, v in node.items() if k not in ("$defs", "definitions")}

    resolved: dict[str, Any] = resolve(schema, ())
    return resolved
