"""The ``stockade`` command line.

Exit codes: 0 success; 1 the thing checked failed (a Rego test, a broken audit chain) or the
request was refused (an approval that is not pending, one's own, or with no approver named); 2 bad
usage or input that could not be read (a policy that does not load, an unreadable log, an
unreachable store, a router whose audit log cannot be written), or an optional dependency the
command needs that is not installed (DuckDB, the `audit` extra); 3 `policy replay` refused a log
whose hash chain is broken; 70 an internal error (a bug: an exception no command expected), shown
as one line on stderr, with its traceback under --debug.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import getpass
import hashlib
import json
import os
import secrets
import socket
import sys
import traceback
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from rich.markup import escape
from rich.text import Text
from typer.core import TyperGroup

from router.audit.chain import head_of
from router.audit.layout import LogLayout, line_blocks, read_checkpoint_source
from router.errors import AuditError, StockadeError
from router.interfaces.cli_common import AuditPath, JsonFlag, audit_engine_missing, err, out, tool_specs, verify_keys
from router.interfaces.cli_common import audit_log as _audit_log
from router.interfaces.cli_common import emit_json as _emit_json
from router.interfaces.cli_common import fail as _fail
from router.interfaces.cli_common import settings_of as _settings
from router.interfaces.policy_cli import policy_app
from router.logging import configure_from_environment
from router.states import ApprovalStatus

# What only some commands need is imported in them: every command (`stockade --help`, an
# auditor's `stockade audit query`) would otherwise load the control plane, the store, Redis,
# the Docker SDK and the approvals machinery first.
if TYPE_CHECKING:
    from router.approvals import Approval, ApprovalBook
    from router.audit import JsonlAuditLog, VerifyReport
    from router.audit.checkpoint import Checkpoint, VerifyKey
    from router.interfaces.local import LocalRouters
    from router.settings import Settings

INTERNAL_ERROR = 70  # sysexits' EX_SOFTWARE: not 1, which scripts read as "the check failed"


class _Commands(TyperGroup):
    """The root command group: an exception no command turned into an exit code (a bug, or input
    no check foresaw) ends the process with one line on stderr and `INTERNAL_ERROR`, never a
    traceback a script would take for output and an exit 1 it would take for a failed check."""

    def invoke(self, ctx: typer.Context) -> Any:  # type: ignore[override]  # typer's vendored click context
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, typer.TyperException, EOFError):
            raise  # exit codes, usage errors and ^D: typer reports them as it does
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # stdout closed by `| head`: typer quiets it
                raise
            _internal_error(ctx, exc)
        except ModuleNotFoundError as exc:
            if exc.name != "duckdb":
                _internal_error(ctx, exc)
            # The `audit` extra missing where no command checked for it first: the install's fault, not a bug.
            raise _fail(audit_engine_missing("this command")) from exc
        except Exception as exc:  # the last line of defence: every other exception is reported
            _internal_error(ctx, exc)


def _internal_error(ctx: typer.Context, exc: Exception) -> NoReturn:
    if ctx.params.get("debug"):
        err.print(Text("".join(traceback.format_exception(exc)).rstrip()))
    said = " ".join(str(exc).split())[:300]
    err.print(Text(f"error: internal error: {type(exc).__name__}{f': {said}' if said else ''} "
                   "(run with --debug for the traceback; please report it)"))  # fmt: skip
    raise typer.Exit(INTERNAL_ERROR) from exc


app = typer.Typer(
    name="stockade",
    help="Agent control plane: validate, decide (Rego), sandbox and audit every tool call.",
    no_args_is_help=True,
    add_completion=False,
    cls=_Commands,
    epilog="Exit codes: 0 success; 1 the thing checked failed (or a request was refused); 2 bad usage, "
    "unreadable input, an unreachable store or a missing extra (`audit`); 3 `policy replay` refused a log whose "
    "hash chain is broken; 70 an internal error.",
)
audit_app = typer.Typer(help="Verify and query the audit log.", no_args_is_help=True)
app.add_typer(policy_app, name="policy")  # the security team's commands: router/interfaces/policy_cli.py
app.add_typer(audit_app, name="audit")

sandbox_app = typer.Typer(help="Build the sandbox image and check which tiers work here.", no_args_is_help=True)
app.add_typer(sandbox_app, name="sandbox")
approvals_app = typer.Typer(
    help="List, show and decide calls held for a human: in the shared store (STOCKADE_STORE__URL) or, with the "
    "embedded store, through the running routers' local sockets.",
    no_args_is_help=True,
)
app.add_typer(approvals_app, name="approvals")


@app.callback()
def main(
    debug: Annotated[
        bool,
        typer.Option(
            "--debug",
            envvar="STOCKADE_DEBUG",
            help="On an internal error (exit 70), print its traceback too (or set STOCKADE_DEBUG=1).",
        ),
    ] = False,
) -> None:
    """Configure logging (STOCKADE_LOG_LEVEL, STOCKADE_LOG_FORMAT) before any command runs; the
    rest of the settings are read by the commands that use them (`settings_of`).

    Exit codes: 0 success; 1 the thing checked failed or the request was refused; 2 bad usage,
    unreadable input, an unreachable store or a missing extra; 3 `policy replay` refused a log whose
    hash chain is broken; 70 an internal error (one line on stderr; the traceback with --debug)."""
    del debug  # read from the context by `_Commands` when a command fails
    configure_from_environment()


# -- demo ---------------------------------------------------------------------------------


@app.command()
def demo(
    ctx: typer.Context,
    audit_path: Annotated[
        Path | None,
        typer.Option("--audit-path", help="Where the demo writes its audit log (default: a new file)."),
    ] = None,
) -> None:
    """Run one agent session end to end with real sandboxed runs and show the audit trail."""
    from router.interfaces.demo import run_demo  # noqa: PLC0415

    try:
        code = asyncio.run(run_demo(_settings(ctx), out, audit_path))
    except StockadeError as exc:
        raise _fail(str(exc)) from exc
    raise typer.Exit(code)


@app.command()
def serve(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8080,
    tools: Annotated[
        Path | None, typer.Option(help="Tool specs to register at start: a JSON file (a list) or a directory of them.")
    ] = None,
) -> None:
    """Serve the HTTP API (OpenAPI at /openapi.json) with settings from STOCKADE_* variables.

    With --tools, the tools are registered before the first request (each router of a
    deployment may pass the same files: the shared store keeps one registry)."""
    import uvicorn  # noqa: PLC0415  (only the server pays for it)

    from router.control import ControlPlane  # noqa: PLC0415
    from router.interfaces.api import create_app  # noqa: PLC0415
    from router.interfaces.local import approval_socket  # noqa: PLC0415

    settings = _settings(ctx)
    specs = tool_specs(tools) if tools else []
    if not settings.api_principals:
        err.print("warning: STOCKADE_API_PRINCIPALS is empty: every /v1 request will be refused (401)")
    listening = _listen(host, port)
    try:
        plane = ControlPlane.from_settings(settings)
    except StockadeError as exc:
        raise _fail(str(exc)) from exc
    application = create_app(plane, close_plane=True)
    # What start-up made (modules, schemas, the policy, the app) lives as long as the process:
    # frozen, the collector stops rescanning it, and the young generation is collected less often.
    # Measured with two routers under load: p99 48 -> 19 ms, +5% decisions/s (docs/design-notes.md).
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    config = uvicorn.Config(application, host=host, port=port, log_level=settings.log_level, access_log=False)

    refused: list[str] = []

    async def run() -> None:
        for i, spec in enumerate(specs):
            try:
                await plane.register(spec)
            except StockadeError as exc:
                refused.append(f"{tools}: tool #{i} ({str(spec.get('name', '?'))[:64]}) was refused: {exc}")
                await plane.aclose()
                return
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(approval_socket(plane))  # `stockade approvals` reaches it here
            await _server(config, stack).serve(sockets=[listening])

    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:  # uvloop, as uvicorn.run picks
        runner.run(run())
    if refused:
        raise _fail(refused[0])


def _server(config: Any, before_exit: contextlib.AsyncExitStack) -> Any:
    """A uvicorn server that closes ``before_exit`` once it has shut down, before it raises again
    the signal that stopped it: uvicorn re-raises SIGTERM after serving, which ends the process
    before any code after ``serve()`` runs (the approval socket's file stayed behind)."""
    import uvicorn  # noqa: PLC0415  (only the servers pay for it)

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            await super().shutdown(sockets)
            await before_exit.aclose()

    return _Server(config)


@app.command()
def mcp(
    ctx: typer.Context,
    agent: Annotated[str, typer.Option(help="The agent's name (stdio; over HTTP with tokens, each token's).")],
    principal: Annotated[str, typer.Option(help="The human the agent acts for.")],
    tools: Annotated[Path | None, typer.Option(help="JSON file: a list of tool specs to register.")] = None,
    trusted: Annotated[list[str] | None, typer.Option(help="Trusted context (the user's request); repeatable.")] = None,
    http: Annotated[bool, typer.Option("--http", help="Serve streamable HTTP at /mcp instead of stdio.")] = False,
    host: Annotated[
        str, typer.Option(help="Address for --http (beyond loopback only with bearer tokens).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port for --http.")] = 8765,
    elicitation: Annotated[
        bool, typer.Option(help="Ask the human in the MCP client to decide held calls, when the client can.")
    ] = True,
) -> None:
    """Serve the registered tools to MCP clients (stdio by default), every call through stockade.

    Each MCP connection is one stockade session, kept alive while the client is connected. Over
    --http, agent principals in STOCKADE_API_PRINCIPALS make bearer tokens required (each token's
    name is the agent); without any, only a loopback address is served.
    """
    import mcp.server.stdio  # noqa: PLC0415  (only MCP users pay for it)
    import uvicorn  # noqa: PLC0415

    from router.control import ControlPlane  # noqa: PLC0415
    from router.interfaces.local import approval_socket  # noqa: PLC0415
    from router.interfaces.mcp import (  # noqa: PLC0415
        audit_requests,
        build_server,
        is_loopback,
        rebinding_guard,
        require_bearer,
        stdio_refusals,
        token_names,
    )
    from router.interfaces.mcp_stdio import stdio_wire  # noqa: PLC0415
    from router.sessions import new_session  # noqa: PLC0415

    settings = _settings(ctx)
    specs = tool_specs(tools) if tools else []
    tokens = token_names(settings.api_principals) if http else {}
    # Each token names an agent, --principal the human: an agent whose acts_for leaves that
    # principal out (or who would claim a configured principal's groups without acts_for) is refused.
    config = settings.principal_config(principal)
    agents = [p for p in settings.api_principals if p.role == "agent"]
    acting_refused = {p.name: why for p in agents if (why := p.refuses_to_act_for(principal, config)) is not None}
    if http and not tokens and not is_loopback(host):
        raise _fail(f"refusing to serve MCP on {host} without authentication: configure agent principals "
                    "(STOCKADE_API_PRINCIPALS, tokens from `stockade api-token`) or listen on 127.0.0.1")  # fmt: skip
    try:  # checked now: at the first call, an MCP client would only see every request fail
        new_session(agent, principal, trusted or [])
    except StockadeError as exc:
        raise _fail(f"--agent, --principal or --trusted: {exc}") from exc
    from router.approvals import same_identity  # noqa: PLC0415

    # The human answers elicitations as --principal: an agent under the same name would approve
    # its own calls, and the log would say the human did.
    for name in [p.name for p in agents] if http and tokens else [agent]:  # with tokens, each token's agent
        if same_identity(principal, name):
            raise _fail(f"--principal {principal!r} is the agent {name!r}: name the human the agent acts for (an "
                        "agent never approves its own calls)")  # fmt: skip
    listening = _listen(host, port) if http else None
    refused: list[str] = []

    async def run() -> None:
        # The plane and the approval socket close with this stack: on leaving, or over HTTP as the
        # server shuts down, before uvicorn raises the stopping signal again (`_server`).
        async with contextlib.AsyncExitStack() as stack:
            plane = await stack.enter_async_context(ControlPlane.from_settings(settings))
            for i, spec in enumerate(specs):
                try:
                    await plane.register(spec)
                except StockadeError as exc:
                    refused.append(f"{tools}: tool #{i} ({spec.get('name', '?')!s:.64}) was refused: {exc}")
                    return
            # Over HTTP, whoever holds the connection answers elicitations: an agent's token is no proof
            # of a human. Only the stdio client (the user's own app, which started this server) asks.
            server = build_server(plane, agent=agent, principal=principal, trusted_context=trusted or [],
                                  tokens=tokens or None, elicitation=elicitation and not http)  # fmt: skip
            await stack.enter_async_context(approval_socket(plane))  # `stockade approvals` reaches it here
            if http:
                asgi = server.streamable_http_app(host=host, transport_security=rebinding_guard(host, tokens))
                # What the SDK refuses is on record either way: as each token's agent, or as --agent.
                guarded = (require_bearer(asgi, tokens, plane, acting_refused) if tokens
                           else audit_requests(asgi, plane, agent))  # fmt: skip
                config = uvicorn.Config(guarded, host=host, port=port, log_level=settings.log_level,
                                        access_log=False)  # fmt: skip
                await _server(config, stack).serve(sockets=[listening] if listening is not None else None)
                return
            wire_of = stdio_wire(stdio_refusals(plane, agent))  # answers and audits what the SDK would drop
            async with wire_of as wire, mcp.server.stdio.stdio_server(*(wire or ())) as (read, write):
                await server.run(read, write, server.create_initialization_options())

    try:
        asyncio.run(run())
    except StockadeError as exc:
        raise _fail(str(exc)) from exc
    if refused:
        raise _fail(refused[0])


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port``, handed to uvicorn: a port in use (or an address
    this host does not have) is bad usage, exit 2 naming it, not uvicorn's own exit 3, which this
    command gives another meaning."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn binds
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise _fail(f"cannot listen on {host}:{port}: {why}") from exc


@app.command("api-token")
def api_token(as_json: JsonFlag = False) -> None:
    """Make a new bearer token and print it with the sha256 to configure (STOCKADE_API_PRINCIPALS)."""
    token = secrets.token_urlsafe(32)
    digest = hashlib.sha256(token.encode()).hexdigest()
    if as_json:
        _emit_json({"token": token, "token_sha256": digest})
        return
    out.print(f"token (give to the client; shown once): {token}\ntoken_sha256 (configure this): {digest}")


# -- audit --------------------------------------------------------------------------------


PublicKey = Annotated[
    Path | None,
    typer.Option("--public-key", help="The log's Ed25519 public key (PEM). Default: the signing key's .pub "
                 "(STOCKADE_AUDIT__SIGNING_KEY); an auditor passes the copy they were given."),
]  # fmt: skip
Trusted = Annotated[
    list[Path] | None,
    typer.Option("--checkpoint", help="A checkpoint you kept (JSON, or a directory or JSON-lines file of them); the "
                 "log must still match it. Repeatable."),
]  # fmt: skip


def _trusted(paths: list[Path] | None) -> list[Checkpoint]:
    """The checkpoints an auditor kept; exit 2 naming a source that cannot be read, holds
    something else, or holds none (an empty one would let "OK" vouch for nothing of theirs)."""
    found: list[Checkpoint] = []
    for path in paths or []:
        if not path.exists():
            raise _fail(f"--checkpoint {path}: no such file or directory")
        before = len(found)
        try:
            for checkpoint in read_checkpoint_source(path):
                if checkpoint is None:
                    raise _fail(f"--checkpoint {path}: holds something that is not a readable stockade checkpoint "
                                "(JSON with log, size, root, signature)")  # fmt: skip
                found.append(checkpoint)
        except OSError as exc:
            raise _fail(f"--checkpoint {path}: cannot be read ({exc.strerror or exc})") from exc
        if len(found) == before:
            raise _fail(f"--checkpoint {path}: holds no checkpoint; pass the file or directory your kept ones are in")
    return found


@audit_app.command("verify")
def audit_verify(
    ctx: typer.Context,
    path: AuditPath = None,
    public_key: PublicKey = None,
    checkpoint: Trusted = None,
    from_seq: Annotated[
        int | None,
        typer.Option(
            "--from-seq",
            min=1,
            help="Check only the segments from the one "
            "holding this seq on (incremental: the tree resumes from the signed segment before).",
        ),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Check the log: every line's hash and link, the Merkle tree against every signed checkpoint
    (the log's, the publish directory's and yours), segments and tombstones. Exit 1 and name the
    first broken seq if anything was modified, removed, inserted, renumbered or cut off."""
    from router.audit.verify import verify_log  # noqa: PLC0415

    settings = _settings(ctx)
    keys, trusted = verify_keys(settings, public_key), _trusted(checkpoint)
    where = str(path or settings.audit.path)
    try:
        publish_dir = settings.audit.publish_dir
        if publish_dir is not None and not publish_dir.is_dir():
            why = "the checkpoints kept there cannot be checked; mount it, or unset it to go without"
            raise _fail(f"STOCKADE_AUDIT__PUBLISH_DIR={publish_dir} is not a directory (not mounted?): {why}")
        if settings.audit.backend == "redis" and path is None:
            where = f"the Redis stream at {settings.store.url}"
            report = asyncio.run(_verify_redis(settings, keys, trusted, publish_dir))
        else:
            log = _audit_log(ctx, path, without_active=True)
            where = str(log.path)
            signed = _signed_artefact(log.layout, publish_dir, trusted) if not keys else None
            if signed is not None:
                raise _fail(_unkeyed(signed))
            report = verify_log(log.layout, keys=keys, publish_dir=publish_dir, trusted=trusted,
                                from_seq=from_seq, workers=2)  # fmt: skip
    except AuditError as exc:
        raise _fail(str(exc)) from exc
    except OSError as exc:  # a part of the log that cannot be read: not a verdict on the chain
        raise _fail(f"cannot read {exc.filename or where}: {exc.strerror or exc}; pass --path with a readable log "
                    "(and its .segments, .checkpoints beside it)") from exc  # fmt: skip
    if as_json:
        _emit_json({"ok": report.ok, "events": report.events, "head_seq": report.head_seq,
                    "head_hash": report.head_hash, "broken_seq": report.broken_seq, "line": report.line,
                    "problem": report.problem, "signed": report.signed, "checkpoints": report.checkpoints,
                    "retired": report.retired, "notes": list(report.notes)})  # fmt: skip
    elif report.ok:
        out.print(f"[green]OK[/green] {escape(where)}: {report.events} events, chain and Merkle tree intact, "
                  f"{report.signed} vouched for by {report.checkpoints} signed checkpoints"
                  f"{f', {report.retired} retired under signed tombstones' if report.retired else ''}; "
                  f"head seq {report.head_seq} {report.head_hash[:16]}…")  # fmt: skip
        for note in report.notes:
            out.print(f"  note: {escape(note)}")
    else:
        out.print(f"[red]BROKEN[/red] {escape(where)}: at seq {report.broken_seq}: {escape(report.problem)}. "
                  f"{max((report.broken_seq or 1) - 1, 0)} events before it verify.")  # fmt: skip
    raise typer.Exit(0 if report.ok else 1)


def _has_bytes(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def _signed_artefact(layout: LogLayout, publish_dir: Path | None, trusted: list[Checkpoint]) -> str | None:
    """What of the log (or the auditor's) carries a signature `verify` would check with a public
    key: the checkpoints file, a sealed segment's manifest, a tombstone, the publish directory, a
    --checkpoint. None: nothing is signed (a log kept without a signing key)."""
    if trusted:
        return "--checkpoint names signed checkpoints"
    if _has_bytes(layout.checkpoints):
        return f"{layout.checkpoints} holds signed checkpoints"
    try:
        names = sorted(os.listdir(layout.segments_dir))
    except OSError:
        names = []
    for name in names:
        if name.endswith((".manifest.json", ".tombstone.json")):
            what = "a sealed segment's manifest" if name.endswith(".manifest.json") else "a tombstone"
            return f"{layout.segments_dir / name} holds {what} with a signature"
    return _published(publish_dir)


def _published(publish_dir: Path | None) -> str | None:
    """That the publish directory holds signed checkpoints, if it holds anything."""
    if publish_dir is None:
        return None
    try:
        published = any(os.scandir(publish_dir))
    except OSError:
        published = False
    return f"the publish directory {publish_dir} holds signed checkpoints" if published else None


def _unkeyed(signed: str) -> str:
    # Signatures unchecked, anyone who can write the log (its volume, or the Redis) could have
    # signed its checkpoints, manifests and tombstones: "intact" would mean nothing.
    return (f"{signed}, and no public key was found to check signatures: pass --public-key FILE (the signing key's "
            ".pub, as given to auditors)")  # fmt: skip


async def _verify_redis(
    settings: Settings, keys: list[VerifyKey], trusted: list[Checkpoint], publish_dir: Path | None
) -> VerifyReport:
    if settings.store.url is None:
        raise AuditError("STOCKADE_AUDIT__BACKEND=redis needs the store's Redis: set STOCKADE_STORE__URL")
    from router.audit.redis import RedisAuditLog  # noqa: PLC0415

    stream = RedisAuditLog(settings.store.url, timeout_s=settings.store.timeout_s)
    try:
        if not keys:
            signed = "--checkpoint names signed checkpoints" if trusted else None
            if signed is None and (await stream.checkpoints() or await stream.head_checkpoint() is not None):
                signed = "the Redis stream holds signed checkpoints"
            if signed is None:
                signed = await asyncio.to_thread(_published, publish_dir)
            if signed is not None:
                raise AuditError(_unkeyed(signed))
        return await stream.verify(keys=keys, trusted=trusted, publish_dir=publish_dir)
    finally:
        await stream.aclose()


@audit_app.command("prove")
def audit_prove(
    ctx: typer.Context,
    seq: Annotated[list[int], typer.Option("--seq", min=1, help="The event to prove (repeatable).")],
    path: AuditPath = None,
    public_key: PublicKey = None,
    as_json: JsonFlag = False,
) -> None:
    """Print an RFC 9162 inclusion proof of each event against the latest checkpoint the log's
    public key verifies (exit 1 if none does): the event's line, its leaf hash, the audit path and
    the checkpoint. Anyone with the public key can check it (`router.audit.merkle.verify_inclusion`;
    see docs/audit.md)."""
    from router.audit.verify import inclusion_proofs, proof_document  # noqa: PLC0415

    proofs: Mapping[int, list[str]]
    try:
        keys = verify_keys(_settings(ctx), public_key)
        if not keys:  # a checkpoint in the log's file may be anyone's: only a signed one is proven against
            raise _fail("no public key was found to check the checkpoint a proof is made against: pass "
                        "--public-key FILE (the signing key's .pub, as given to auditors)")  # fmt: skip
        if path is None and _settings(ctx).audit.backend == "redis":
            checkpoint, proven = asyncio.run(_prove_redis(_settings(ctx), seq, keys))
            found = {s: line for s, (line, _) in proven.items()}
            proofs = {s: proof for s, (_, proof) in proven.items()}
        else:
            log = _audit_log(ctx, path)
            checkpoint, proofs = inclusion_proofs(log.layout, seq, keys=keys)
            found = dict(_lines_at(log, set(seq)))
    except AuditError as exc:
        raise _fail(str(exc), 1) from exc
    documents = [proof_document(checkpoint, s, found[s], proofs[s]) for s in seq]
    if as_json:
        _emit_json(documents if len(documents) > 1 else documents[0])
        return
    for document in documents:
        out.print(f"seq {document['seq']} leaf {document['leaf_hash']} in tree of size {checkpoint.size} "
                  f"root {checkpoint.root} (checkpoint {checkpoint.time}, key {checkpoint.key_id})",
                  markup=False)  # fmt: skip
        for node in document["proof"]:  # type: ignore[attr-defined]
            out.print(f"  {node}", markup=False)


async def _prove_redis(
    settings: Settings, seqs: list[int], keys: list[VerifyKey]
) -> tuple[Checkpoint, dict[int, tuple[bytes, list[str]]]]:
    if settings.store.url is None:
        raise AuditError("STOCKADE_AUDIT__BACKEND=redis needs the store's Redis: set STOCKADE_STORE__URL")
    from router.audit.redis import RedisAuditLog  # noqa: PLC0415

    stream = RedisAuditLog(settings.store.url, timeout_s=settings.store.timeout_s)
    try:
        return await stream.inclusion_proofs(seqs, keys=keys)
    finally:
        await stream.aclose()


def _lines_at(log: JsonlAuditLog, seqs: set[int]) -> list[tuple[int, bytes]]:
    """The lines of ``seqs``, read from the segments that can hold them (a sealed one's name says
    its seqs) and the active one."""
    found = []
    for part in log.layout.parts():
        if part.kind == "tombstone" or (
            part.kind == "sealed" and not any(part.first_seq <= seq <= part.last_seq for seq in seqs)
        ):
            continue
        for block in line_blocks(part.path):
            for line in block:
                head = head_of(line)
                if head is not None and head[0] in seqs:
                    found.append((head[0], line))
    return found


# -- approvals ----------------------------------------------------------------------------

T = TypeVar("T")
ApprovalId = Annotated[str, typer.Argument(help="The approval id (a-...), from `stockade approvals list`.")]
Approver = Annotated[
    str,
    typer.Option("--approver", help="Who decides (recorded in the audit log; never the requesting agent).",
                 default_factory=getpass.getuser, show_default="your login name"),
]  # fmt: skip
Note = Annotated[str, typer.Option("--note", help="Why: a ticket, a reason; recorded with the decision.")]


def _with_approvals(
    ctx: typer.Context, work: Callable[[ApprovalBook | LocalRouters], Awaitable[T]], *, as_json: bool = False
) -> T:
    """Run ``work`` against the shared store and the audit log the routers write or, with the
    embedded store, against the running routers' approval sockets (router.interfaces.local); a
    router that does not answer is reported on stderr (a JSON line with ``--json``), and the
    others still answer."""
    from router.approvals import ApprovalBook, ApprovalError  # noqa: PLC0415
    from router.audit.factory import make_side_log  # noqa: PLC0415
    from router.control import VERSION  # noqa: PLC0415
    from router.interfaces.local import LocalRouters, socket_dirs, this_process  # noqa: PLC0415
    from router.store import make_store  # noqa: PLC0415

    settings = _settings(ctx)
    local = LocalRouters(socket_dirs(settings)) if settings.store.url is None else None

    async def run() -> T:
        if local is not None:
            return await work(local)
        store = make_store(settings)
        # The log the routers write (the Redis stream, or the JSONL file), with their masking rules:
        # a decision written anywhere else is missing from the record.
        audit = make_side_log(settings)
        labels = {"instance": settings.instance, "version": VERSION, "via": "cli"}
        try:
            book = ApprovalBook(store, audit, ttl_s=settings.approval_ttl_s, keep_s=settings.approval_keep_s,
                                labels=labels, peer=this_process())  # fmt: skip
            return await work(book)
        finally:
            await store.aclose()
            await audit.aclose()

    try:
        return asyncio.run(run())
    except ApprovalError as exc:
        raise _fail(str(exc), 1) from exc
    except StockadeError as exc:
        raise _fail(str(exc)) from exc
    finally:
        if local is not None and local.not_answering:
            _report_not_answering(local, as_json)


def _report_not_answering(local: LocalRouters, as_json: bool) -> None:
    """Say which routers did not answer (their approvals are missing from what was shown)."""
    if as_json:
        sys.stderr.write(json.dumps({"not_answering": [s.as_json() for s in local.not_answering]}) + "\n")
        return
    for silent in local.not_answering:
        err.print(f"[yellow]warning:[/yellow] the router at {escape(str(silent.socket))} (pid {silent.pid}) is not "
                  f"answering ({escape(silent.error)}): its approvals could not be reached", markup=True)  # fmt: skip


def _show_approval(approval: Approval, as_json: bool) -> None:
    from router.interfaces.render import approval_panel  # noqa: PLC0415

    if as_json:
        _emit_json(approval.model_dump(mode="json"))
        return
    out.print(approval_panel(approval))


@approvals_app.command("list")
def approvals_list(
    ctx: typer.Context,
    status: Annotated[ApprovalStatus | None, typer.Option(help="Only approvals in this status (e.g. pending).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """List approvals, oldest first: what was asked, by which agent, why, and until when."""
    from router.interfaces.render import approvals_table  # noqa: PLC0415

    found = _with_approvals(ctx, lambda book: book.list(status), as_json=as_json)
    if as_json:
        _emit_json([a.model_dump(mode="json") for a in found])
        return
    out.print(approvals_table(found))


@approvals_app.command("show")
def approvals_show(ctx: typer.Context, approval_id: ApprovalId, as_json: JsonFlag = False) -> None:
    """Show one approval in full, with the exact arguments the approver is asked about."""
    _show_approval(_with_approvals(ctx, lambda book: book.get(approval_id), as_json=as_json), as_json)


@approvals_app.command("approve")
def approvals_approve(
    ctx: typer.Context, approval_id: ApprovalId, approver: Approver, note: Note = "", as_json: JsonFlag = False
) -> None:
    """Grant a pending approval: the held call may then run once, exactly as asked (exit 1 if refused)."""
    _decide_approval(ctx, approval_id, approver, note, as_json, approve=True)


@approvals_app.command("deny")
def approvals_deny(
    ctx: typer.Context, approval_id: ApprovalId, approver: Approver, note: Note = "", as_json: JsonFlag = False
) -> None:
    """Refuse a pending approval: the held call cannot run with it (exit 1 if refused)."""
    _decide_approval(ctx, approval_id, approver, note, as_json, approve=False)


def _decide_approval(
    ctx: typer.Context, approval_id: str, approver: str, note: str, as_json: bool, *, approve: bool
) -> None:
    decided = _with_approvals(
        ctx, lambda book: book.decide(approval_id, approver=approver, approve=approve, note=note), as_json=as_json
    )
    _show_approval(decided, as_json)


# -- sandbox ------------------------------------------------------------------------------


@sandbox_app.command("build-image")
def sandbox_build_image(
    ctx: typer.Context,
    force: Annotated[bool, typer.Option("--force", help="Build even if the image exists.")] = False,
) -> None:
    """Build the default sandbox image locally (mmdebstrap + docker import), once per recipe."""
    import runner as runner_pkg  # noqa: PLC0415
    from runner.image import build_default_image  # noqa: PLC0415

    try:
        with err.status("building the sandbox image") as status:
            tag = build_default_image(_settings(ctx).runner.docker_host, force=force, progress=status.update)
    except runner_pkg.SandboxUnavailable as exc:
        raise _fail(str(exc), 1) from exc
    out.print(tag)


@sandbox_app.command("doctor")
def sandbox_doctor(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Show which sandbox tiers work on this host and, for those that do not, why; exit 1 if any does not."""
    import runner as runner_pkg  # noqa: PLC0415

    settings = _settings(ctx).runner
    report = {}
    for tier, sandbox in runner_pkg.make_sandboxes(settings).items():
        report[tier] = sandbox.check()
        asyncio.run(sandbox.aclose())
    if as_json:
        _emit_json({tier: {"available": problem is None, "problem": problem} for tier, problem in report.items()})
    else:
        for tier, problem in report.items():
            mark = "[green]available[/green]" if problem is None else f"[red]unavailable[/red]: {problem}"
            out.print(f"{tier:8} {mark}")
    raise typer.Exit(0 if all(p is None for p in report.values()) else 1)


# The auditor's read commands live in their own module (it imports this one's helpers).
from router.interfaces.audit_cli import register as _register_audit_commands  # noqa: E402

_register_audit_commands(audit_app)

if __name__ == "__main__":
    app()
