"""An OPA server for the tests: OPA's own Go evaluator (v1.20, through the opa-golib-python-bindings
wheel that scripts/services unpacks into var/opa-engine) behind the part of OPA's REST API that
stockade's `opa` engine uses. No OPA server binary installs on our machines (not on PyPI, not in
Debian, and npm's package is a client); the evaluator is what decides, and it is OPA's.

    PUT    /v1/policies/<id>   a Rego module (400 with OPA's error if it does not compile)
    DELETE /v1/policies/<id>
    PUT    /v1/data/<path>     a JSON document at data.<path> (204)
    POST   /v1/data/<path>     {"input": ...} -> {"result": data.<path>} ({} when undefined)
    GET    /health

Every change is compiled into a new evaluator before it replaces the old one, so a refused
upload changes nothing. ``--dir`` loads a policy directory at start, as ``opa run --server <dir>``
would; ``--log`` appends "METHOD path" per request, for tests of what a client sends.

Usage: python -m tests.opa_server --port N [--dir D] [--log F]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ENGINE_DIR = REPO / "var" / "opa-engine"
sys.path.insert(0, str(ENGINE_DIR))

from opa_bindings import OpaEngine, OpaError, OpaUndefinedError  # noqa: E402

from policy.bundle import load_bundle  # noqa: E402


class Store:
    """The server's modules and data, and an evaluator compiled from them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.modules: dict[str, str] = {}
        self.data: dict[str, Any] = {}
        self.engine = self._compile(self.modules, self.data)

    @staticmethod
    def _compile(modules: dict[str, str], data: dict[str, Any]) -> OpaEngine:
        engine = OpaEngine()
        try:
            for policy_id, text in modules.items():
                engine.add_policy(policy_id, text)
            engine.add_data(data)
            engine.eval_query("true")  # compiles every module: type errors and conflicts surface here
        except Exception:
            engine.close()
            raise
        return engine

    def change(self, modules: dict[str, str], data: dict[str, Any]) -> None:
        """Replace the evaluator, or raise `OpaError` and keep the old one."""
        engine = self._compile(modules, data)
        old, self.engine, self.modules, self.data = self.engine, engine, modules, data
        old.close()


def _put(document: dict[str, Any], path: list[str], value: Any) -> dict[str, Any]:
    if not path:
        return dict(value)
    copy = dict(document)
    inner = copy.get(path[0])
    copy[path[0]] = _put(inner if isinstance(inner, dict) else {}, path[1:], value) if path[1:] else value
    return copy


def handler(store: Store, log: Path | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: Any) -> None:
            pass

        def _reply(self, status: int, body: Any = None) -> None:
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def _route(self) -> tuple[str, list[str]]:
            if log is not None:
                with log.open("a") as out:
                    out.write(f"{self.command} {self.path}\n")
            parts = [p for p in self.path.split("?")[0].split("/") if p]
            return "/".join(parts[:2]), parts[2:]

        def do_GET(self) -> None:
            self._route()
            self._reply(200, {})

        def do_PUT(self) -> None:
            kind, rest = self._route()
            body = self._body()
            with store.lock:
                try:
                    if kind == "v1/policies":
                        store.change({**store.modules, "/".join(rest): body.decode()}, store.data)
                        self._reply(200, {})
                    elif kind == "v1/data":
                        store.change(store.modules, _put(store.data, rest, json.loads(body)))
                        self._reply(204)
                    else:
                        self._reply(404, {"code": "resource_not_found", "message": self.path})
                except OpaError as exc:
                    self._reply(400, {"code": "invalid_parameter", "message": str(exc),
                                      "errors": [{"code": exc.code, "message": exc.message}]})  # fmt: skip

        def do_DELETE(self) -> None:
            _, rest = self._route()
            with store.lock:
                modules = {k: v for k, v in store.modules.items() if k != "/".join(rest)}
                store.change(modules, store.data)
            self._reply(200, {})

        def do_POST(self) -> None:
            kind, rest = self._route()
            body = json.loads(self._body() or b"{}")
            if kind != "v1/data":
                self._reply(404, {"code": "resource_not_found", "message": self.path})
                return
            try:
                with store.lock:  # an evaluator being replaced is closed
                    result = store.engine.eval_document(".".join(rest), body.get("input"))
            except OpaUndefinedError:
                self._reply(200, {})
                return
            except OpaError as exc:
                self._reply(500, {"code": "internal_error", "message": str(exc)})
                return
            self._reply(200, {"result": result})

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dir", type=Path, help="a policy directory to load at start")
    parser.add_argument("--log", type=Path, help="append 'METHOD path' per request here")
    opts = parser.parse_args()
    store = Store()
    if opts.dir is not None:
        bundle = load_bundle(opts.dir)
        store.change(dict(bundle.modules), bundle.data)  # as `opa run` loads a directory: tests too
    ThreadingHTTPServer(("127.0.0.1", opts.port), handler(store, opts.log)).serve_forever()


if __name__ == "__main__":
    main()
