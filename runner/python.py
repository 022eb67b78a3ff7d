"""Run a Python function inside a sandbox: the harness, and the job that carries it.

The harness reads ``{"source", "entrypoint", "args"}`` as JSON on stdin, executes the source,
calls the entrypoint with the arguments as keywords and writes ``{"result": ...}`` as JSON on
stdout. Anything the tool prints goes to stderr, so stdout carries only the result.
"""

from __future__ import annotations

import json
from typing import Any

from runner.base import ResourceLimits, SandboxSpec

HARNESS = """\
import json, sys
def _run():
    job = json.load(sys.stdin)
    real_stdout, sys.stdout = sys.stdout, sys.stderr
    namespace = {"__name__": "stockade_tool"}
    exec(compile(job["source"], "<tool>", "exec"), namespace)
    fn = namespace.get(job["entrypoint"])
    if not callable(fn):
        sys.stderr.write("stockade: entrypoint %r is not defined by the tool source\\n" % job["entrypoint"])
        raise SystemExit(2)
    result = fn(**job["args"])
    real_stdout.write(json.dumps({"result": result}))
    real_stdout.flush()
_run()
"""


def python_job(
    source: str,
    entrypoint: str,
    args: dict[str, Any],
    *,
    interpreter: str,
    limits: ResourceLimits,
) -> SandboxSpec:
    """The `SandboxSpec` that runs ``entrypoint(**args)`` from ``source`` under ``interpreter``."""
    payload = json.dumps({"source": source, "entrypoint": entrypoint, "args": args}).encode()
    # -I: ignore PYTHON* variables and the user site; -S: skip site (faster, nothing to import from it).
    return SandboxSpec(argv=(interpreter, "-I", "-S", "-c", HARNESS), stdin=payload, limits=limits, kind="python")


def parse_result(stdout: bytes) -> Any:
    """The tool's return value from the harness's stdout.

    Raises:
        ValueError: stdout is not the harness's ``{"result": ...}`` document.
    """
    document = json.loads(stdout)
    if not isinstance(document, dict) or set(document) != {"result"}:
        raise ValueError("tool stdout is not a {'result': ...} document")
    return document["result"]
