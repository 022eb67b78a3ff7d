"""Audit events as OCSF 1.3 records, for SIEMs that speak the Open Cybersecurity Schema Framework.

=============  ==============================  ===============================================
kind           OCSF class (class_uid)          activity
=============  ==============================  ===============================================
decision       API Activity (6003)             Other (99): the tool call was decided
approval       API Activity (6003)             Create (1) requested, Update (3) approved/denied, Other (99)
credential     Authentication (3002)           Service Ticket Request (4) minted/refused, Other (99) revoked
execution      Process Activity (1007)         Launch (1): the tool ran in the sandbox
egress         HTTP Activity (4002)            the request's method (Get 3, Post 6, ...; Connect 1)
error, policy, API Activity (6003)             Other (99)
endorsement
=============  ==============================  ===============================================

Every record carries ``metadata`` (``product`` stockade, ``uid`` the decision_id that joins a call's
events, ``sequence`` the seq, ``version`` the OCSF version), ``time`` (epoch milliseconds),
``severity_id``, ``status_id`` and, in ``unmapped``, the whole event as written plus its ``hash``:
nothing is lost. An export also puts the line as written in ``raw_data``: its hash is the leaf the
export's proof proves, and every other field is checked against it (`router.audit.export`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

__all__ = ["OCSF_VERSION", "to_ocsf"]

OCSF_VERSION = "1.3.0"

_CATEGORY = {1: "System Activity", 3: "Identity & Access Management", 4: "Network Activity", 6: "Application Activity"}
_CLASS = {1007: "Process Activity", 3002: "Authentication", 4002: "HTTP Activity", 6003: "API Activity"}
_SEVERITY = {1: "Informational", 2: "Low", 3: "Medium", 4: "High"}
_STATUS = {0: "Unknown", 1: "Success", 2: "Failure", 99: "Other"}
_HTTP = {"CONNECT": 1, "DELETE": 2, "GET": 3, "HEAD": 4, "OPTIONS": 5, "POST": 6, "PUT": 7, "TRACE": 8, "PATCH": 9}
_RAN = frozenset({"ok", "reported"})  # execution outcomes that are a success
_REFUSED = {"deny", "denied", "refused", "tool_refused", "reload_refused", "revoke_failed", "retry_refused"}


def _epoch_ms(timestamp: Any) -> int | None:
    try:
        at = datetime.fromisoformat(str(timestamp).replace("Z", "+00:00"))
    except ValueError:
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return int(at.timestamp() * 1000)


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _codes(result: dict[str, Any]) -> list[str]:
    reasons = result.get("reasons")
    codes = (
        [str(r["code"]) for r in reasons if isinstance(r, dict) and "code" in r] if isinstance(reasons, list) else []
    )
    if isinstance(result.get("code"), str):
        codes.append(result["code"])
    return codes


_Shape = tuple[int, int, str, int, int]  # class_uid, activity_id, activity, status_id, severity_id


def to_ocsf(document: dict[str, Any], digest: str) -> dict[str, Any]:
    """The OCSF record of one audit event (``document``, as written) whose hash is ``digest``."""
    kind = str(document.get("kind"))
    outcome = str(document.get("outcome"))
    result = _dict(document.get("result"))
    labels = _dict(document.get("labels"))
    principal = _dict(_dict(document.get("input")).get("subject")).get("principal") or result.get("principal")
    record: dict[str, Any] = {
        "metadata": {
            "version": OCSF_VERSION,
            "product": {"name": "stockade", "vendor_name": "stockade", "version": labels.get("version", "unknown")},
            "uid": document.get("decision_id"),
            "correlation_uid": document.get("session_id"),
            "sequence": document.get("seq"),
            "event_code": f"{kind}.{outcome}",
            "log_name": "stockade audit",
            "original_time": document.get("timestamp"),
            "labels": [f"{k}={v}" for k, v in sorted(labels.items())],
        },
        "time": _epoch_ms(document.get("timestamp")),
        "timezone_offset": 0,
        "message": f"{kind} {outcome}" + (f": {document['tool']}" if document.get("tool") else ""),
        "actor": {"user": _user(principal), "app_name": document.get("agent"),
                  "session": {"uid": document.get("session_id")}},
        "unmapped": {**{k: v for k, v in document.items() if k not in ("decision_id", "timestamp")}, "hash": digest},
    }  # fmt: skip
    shape = _SHAPES.get(kind, _other)(record, document, result, outcome)
    class_uid, activity_id, activity, status_id, severity_id = shape
    category = class_uid // 1000
    record.update({
        "class_uid": class_uid, "class_name": _CLASS[class_uid], "category_uid": category,
        "category_name": _CATEGORY[category], "activity_id": activity_id, "activity_name": activity,
        "type_uid": class_uid * 100 + activity_id, "type_name": f"{_CLASS[class_uid]}: {activity}",
        "severity_id": severity_id, "severity": _SEVERITY[severity_id], "status_id": status_id,
        "status": _STATUS[status_id], "status_code": outcome, "status_detail": ", ".join(_codes(result)) or None,
    })  # fmt: skip
    return record


def _user(name: Any) -> dict[str, Any] | None:
    return {"name": name, "type_id": 1, "type": "User"} if name else None


def _plain(outcome: str) -> tuple[int, int]:
    """status_id and severity_id of an outcome: a refusal is a failure of medium severity."""
    return (2, 3) if outcome in _REFUSED else (1, 1)


def _decision(record: dict[str, Any], document: dict[str, Any], result: dict[str, Any], outcome: str) -> _Shape:
    status_id, severity_id = (99, 2) if outcome == "require_approval" else _plain(outcome)
    record["action_id"], record["action"] = {"allow": (1, "Allowed"), "deny": (2, "Denied")}.get(outcome, (99, "Other"))
    _api(record, document)
    return 6003, 99, "Decide", status_id, severity_id


def _approval(record: dict[str, Any], document: dict[str, Any], result: dict[str, Any], outcome: str) -> _Shape:
    activity_id, activity = {"requested": (1, "Create"), "approved": (3, "Update"), "denied": (3, "Update")}.get(
        outcome, (99, outcome)
    )
    status_id, severity_id = _plain(outcome)
    if outcome not in ("approved", "denied", "redeemed") and status_id == 1:
        status_id = 99  # asked, asked again: nothing succeeded or failed yet
    if result.get("approver"):
        record["actor"]["user"] = _user(result["approver"])
    _api(record, document)
    return 6003, activity_id, activity, status_id, severity_id


def _credential(record: dict[str, Any], document: dict[str, Any], result: dict[str, Any], outcome: str) -> _Shape:
    activity_id, activity = (4, "Service Ticket Request") if outcome in ("minted", "refused") else (99, outcome)
    status_id, severity_id = _plain(outcome)
    if outcome == "revoke_failed":
        severity_id = 4  # a credential that may still work until its TTL ends
    record["user"] = {"name": document.get("agent"), "type_id": 3, "type": "System"}
    record["service"] = {"name": result.get("name"), "uid": result.get("lease_id")}
    return 3002, activity_id, activity, status_id, severity_id


def _execution(record: dict[str, Any], document: dict[str, Any], result: dict[str, Any], outcome: str) -> _Shape:
    labels = _dict(document.get("labels"))
    record["process"] = {"name": document.get("tool"), "uid": document.get("call_id")}
    record["device"] = {"type_id": 0, "type": "Unknown", "hostname": labels.get("instance"),
                        "name": f"sandbox ({result.get('tier', 'unknown')})"}  # fmt: skip
    if isinstance(result.get("exit_code"), int):
        record["exit_code"] = result["exit_code"]
    # "reported": a tool the framework runs itself (executor ``external``) reported its result,
    # which is the success of that kind of execution, as "ok" is of a sandboxed run.
    status_id, severity_id = (1, 1) if outcome in _RAN else (2, 3)
    return 1007, 1, "Launch", status_id, severity_id


def _egress(record: dict[str, Any], document: dict[str, Any], result: dict[str, Any], outcome: str) -> _Shape:
    method = str(result.get("method", "")).upper()
    activity_id, activity = (_HTTP[method], method.title()) if method in _HTTP else (99, method or "Other")
    allowed = outcome == "allow"
    record["action_id"], record["action"] = (1, "Allowed") if allowed else (2, "Denied")
    record["disposition_id"], record["disposition"] = (1, "Allowed") if allowed else (2, "Blocked")
    host, port = result.get("host"), result.get("port")
    record["http_request"] = {"http_method": method or None, "url": {"hostname": host, "port": port}}
    record["http_response"] = {"code": result.get("status")}
    record["dst_endpoint"] = {"hostname": host, "port": port}
    record["src_endpoint"] = {"name": f"sandbox of call {document.get('call_id')}"}
    record["traffic"] = {"bytes_in": result.get("bytes_down"), "bytes_out": result.get("bytes_up")}
    if isinstance(result.get("duration_ms"), (int, float)):
        record["duration"] = int(result["duration_ms"])
    return (4002, activity_id, activity, *((1, 1) if allowed else (2, 4)))


def _other(record: dict[str, Any], document: dict[str, Any], result: dict[str, Any], outcome: str) -> _Shape:
    """error, policy, endorsement, and any kind to come: an API Activity of stockade's own."""
    kind = str(document.get("kind"))
    status_id, severity_id = (2, 4) if kind == "error" else _plain(outcome)
    _api(record, document)
    return 6003, 99, kind, status_id, severity_id


_SHAPES: dict[str, Callable[[dict[str, Any], dict[str, Any], dict[str, Any], str], _Shape]] = {
    "decision": _decision, "approval": _approval, "credential": _credential, "execution": _execution,
    "egress": _egress,
}  # fmt: skip


def _api(record: dict[str, Any], document: dict[str, Any]) -> None:
    """The ``api`` and ``src_endpoint`` API Activity requires: the tool call as an API operation."""
    record["api"] = {"operation": document.get("tool") or document.get("kind"),
                     "service": {"name": "stockade"}, "request": {"uid": document.get("call_id")}}  # fmt: skip
    record["src_endpoint"] = {"name": document.get("agent") or "stockade"}
