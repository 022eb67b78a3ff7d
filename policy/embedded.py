"""The embedded policy engine: regorus in process, decisions on the compiled RVM path.

Decisions run on ``regorus.Program`` + ``regorus.Rvm``. Every module is also parsed by the
interpreter ``regorus.Engine`` at load, so a syntax error anywhere, tests included, refuses the
whole directory and the old policy stays.

Why every decision that is not a deny is evaluated twice: the RVM evaluates builtins
non-strictly. A builtin error (``to_number("5000x")``, a division by zero, a bad regex) makes
the rule that hit it undefined, so a deny reason can silently vanish and the call be allowed.
regorus's VM has a strict switch, but the Python binding (``gordon-to-regorus`` 0.13) does
not expose it. The interpreter always raises on builtin errors. So the RVM answers first, and a
decision is then confirmed on the interpreter (one per thread, reused: ~0.15 ms on a quiet
machine): if that raises, or decides differently, the call is denied with ``policy.error``. A
deny is confirmed too: it denies anyway, but an error may have removed a reason from it (the
call denied for another rule's reason, the error on record nowhere), so one the interpreter
raises on keeps the RVM's reasons and gains ``policy.error``. An error can therefore never pass
for "no reason", and every decision was reached by both engines, which also keeps them honest
about each other in production.

A few builtins are undefined on bad input even on the strict interpreter (``units.parse_bytes``
of ``"5B"``, ``regex.replace`` with a pattern that does not compile, ...): the interpreter is
`policy.builtins.strict_interpreter`, on which those raise too, and a literal or data argument
that makes one fail on every call refuses the load (`policy.builtins`). A load also validates the
catalog and the reason catalog (`policy.schema.validate_data`), and each decision's reason codes
are checked against the latter (`policy.base.to_decision`).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any

import regorus
import structlog

from policy.base import POLICY_ERROR, Decision, Outcome, PolicyInput, Reason, deny, serialised_input, to_decision
from policy.builtins import argument_problems, strict_interpreter
from policy.bundle import PolicyBundle, digest_of, load_configured
from policy.config import PolicySettings
from policy.errors import PolicyBundleError, as_bundle_error
from policy.schema import validate_data
from policy.status import LoadStatus

log = structlog.get_logger(__name__)

_UNDEFINED = "<undefined>"  # what the RVM returns (JSON-encoded) when the entrypoint is undefined


def _is_panic(exc: BaseException) -> bool:
    # pyo3_runtime.PanicException derives from BaseException and is not importable by name.
    return type(exc).__name__ == "PanicException"


@dataclass(frozen=True, slots=True)
class _Loaded:
    """One compiled generation of the policy; swapped as a whole on reload. ``program`` and
    ``interpreter`` are None once the engine is closed. ``reasons``: the reason catalog (code →
    outcome) decisions are checked against; None if the policy has none."""

    bundle: PolicyBundle
    program: Any
    interpreter: Any
    generation: int
    reasons: Mapping[str, str] | None = None


def _compile_steps(bundle: PolicyBundle, entrypoint: str, generation: int) -> Generator[None, None, _Loaded]:
    """Compile ``bundle`` a module at a time: each ``next`` does one step (a module parsed, the
    data added, the program compiled). regorus holds the GIL for each call, so a reload on the
    event loop yields between steps: the longest pause is one step, not the whole policy.

    Refused (`PolicyBundleError`), besides what does not compile: a catalog or reason catalog
    the schema refuses (`policy.schema.validate_data`), and a builtin call whose literal or data
    argument makes it fail on every call (`policy.builtins.argument_problems`)."""
    reasons = validate_data(bundle)
    try:
        interpreter = strict_interpreter()
        for path, text in bundle.modules:
            interpreter.add_policy(path, text)
            yield
        interpreter.add_data_json(bundle.data_json)
        yield
        decision_paths = {path for path, _ in bundle.decision_modules}
        asts = [(entry["source"]["file"], entry["ast"]) for entry in json.loads(interpreter.get_ast_as_json())]
        problems = argument_problems([(path, tree) for path, tree in asts if path in decision_paths], bundle.data)
        if problems:
            raise PolicyBundleError(f"policy in {bundle.root} has builtin calls that fail on every call: "
                                    + "; ".join(str(problem) for problem in problems[:5]))  # fmt: skip
        yield
        program = regorus.Program.compile_from_modules(bundle.data_json, bundle.decision_modules, [entrypoint])
    except PolicyBundleError:
        interpreter = program = None  # as below: the traceback must not keep the half-built engine alive
        raise
    except BaseException as exc:
        if not (isinstance(exc, Exception) or _is_panic(exc)):
            raise
        # The traceback keeps this frame, and so the half-built engine, alive: regorus objects are
        # unsendable, and one freed later by the collector on another thread raises there.
        interpreter = program = None
        raise PolicyBundleError(f"policy in {bundle.root} does not compile: {_without_backtrace(exc)}") from exc
    return _Loaded(bundle=bundle, program=program, interpreter=interpreter, generation=generation, reasons=reasons)


def _step(steps: Generator[None, None, _Loaded]) -> _Loaded | None:
    """Do the next step of a compile; the compiled policy once none is left, else None."""
    try:
        next(steps)
    except StopIteration as done:
        loaded: _Loaded = done.value
        return loaded
    return None


def _compile(bundle: PolicyBundle, entrypoint: str, generation: int) -> _Loaded:
    steps = _compile_steps(bundle, entrypoint, generation)
    while (loaded := _step(steps)) is None:
        pass
    return loaded


async def _compile_yielding(bundle: PolicyBundle, entrypoint: str, generation: int) -> _Loaded:
    """`_compile`, letting the event loop run other tasks between its steps."""
    steps = _compile_steps(bundle, entrypoint, generation)
    while True:
        loaded = _step(steps)
        if loaded is not None:
            return loaded
        await asyncio.sleep(0)  # a turn for the loop's other tasks


class EmbeddedEngine:
    """`PolicyEngine` backed by regorus in this process.

    One RVM per thread (an RVM is not shareable across threads); each is loaded lazily from
    the current compiled program. Loads from a directory or a bundle file (``settings.dir``,
    checked against ``settings.bundle_public_key``); every load attempt is recorded in
    `load_status`.
    """

    def __init__(self, settings: PolicySettings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._reloading = asyncio.Lock()
        self._local = threading.local()
        self._loaded = _compile(load_configured(settings), settings.entrypoint, 1)
        self._status = LoadStatus.first(str(settings.dir), self._loaded.bundle.revision)
        log.info("policy_loaded", revision=self.revision, modules=len(self._loaded.bundle.modules))

    @property
    def revision(self) -> str:
        return self._loaded.bundle.revision

    @property
    def bundle(self) -> PolicyBundle:
        """The policy files and data currently in force."""
        return self._loaded.bundle

    @property
    def load_status(self) -> LoadStatus:
        """The revision in force, and whether the files on disk loaded at the last attempt."""
        return self._status

    async def reload(self, approve: Callable[[str], Awaitable[None]] | None = None) -> str:
        # One reload at a time (an asyncio lock: the compile yields to the loop between modules,
        # and a thread lock held across that would block the loop for a second reload).
        async with self._reloading:
            old = self._loaded
            bundle: PolicyBundle | None = None
            try:
                bundle = load_configured(self._settings)
                new = await _compile_yielding(bundle, self._settings.entrypoint, old.generation + 1)
            except Exception as exc:  # whatever went wrong, the refusal is the same: recorded, audited, old policy kept
                refused = as_bundle_error(exc, self._settings.dir)
                failed = bundle.revision if bundle is not None else digest_of(self._settings.dir)
                self._status = self._status.failed(str(refused), failed)
                log.error("policy_reload_refused", error=str(refused), kept_revision=old.bundle.revision)
                # The raised error's traceback keeps this frame: it must not keep the old compiled
                # policy too (unsendable; freed later by a collector on another thread, it raises).
                del old
                if refused is exc:
                    raise
                raise refused from exc
            if approve is not None:
                await approve(new.bundle.revision)  # raises: not approved, the old policy stays
            with self._lock:
                self._loaded = new
                self._status = self._status.loaded(new.bundle.revision)
        log.info("policy_reloaded", revision=new.bundle.revision, previous=old.bundle.revision)
        return new.bundle.revision

    def _strict(self, loaded: _Loaded) -> Any:
        """This thread's interpreter for ``loaded`` (builtin errors raise), cloned once per generation."""
        cached = getattr(self._local, "strict", None)
        if cached is not None and cached[0] == loaded.generation:
            return cached[1]
        engine = loaded.interpreter.clone()
        self._local.strict = (loaded.generation, engine)
        return engine

    def _vm(self, loaded: _Loaded) -> Any:
        cached = getattr(self._local, "vm", None)
        if cached is not None and cached[0] == loaded.generation:
            return cached[1]
        vm = regorus.Rvm()
        vm.load_program(loaded.program)
        # Data passed at compile time is not visible to dynamic lookups (data.x[k]) on the RVM.
        vm.set_data_json(loaded.bundle.data_json)
        self._local.vm = (loaded.generation, vm)
        return vm

    def evaluate(self, policy_input: PolicyInput) -> Decision:
        """Synchronous decide on the RVM, confirmed on the strict interpreter; fails closed on
        every error and on any disagreement, and a deny keeps every reason the engines found
        (see the module docstring)."""
        loaded = self._loaded
        revision = loaded.bundle.revision
        try:
            input_json = self._input_json(policy_input, loaded)
            raw = self._execute(loaded, input_json)
        except _EvaluationFailed as exc:
            return deny(POLICY_ERROR, str(exc), revision=revision)
        value = _value(raw)  # parsed once: the decision and the comparison both use it
        decision = to_decision(value, revision, loaded.reasons)
        try:
            confirmed = self._confirm(loaded, input_json)
        except _EvaluationFailed as exc:
            return _failed(decision, str(exc))
        if confirmed != value:
            log.error("policy_engines_disagree", revision=revision, rvm=decision.outcome.value,
                      interpreter=str(confirmed)[:300])  # fmt: skip
            return _failed(decision, "the compiled and the interpreted policy disagree on this input: "
                           "run `stockade policy test`, which decides every test on both")  # fmt: skip
        return decision

    def evaluate_raw(self, policy_input: PolicyInput) -> str | None:
        """The entrypoint's value as the RVM alone returns it (JSON text), before validation and
        without the interpreter's confirmation; for parity checks and benchmarks.

        Raises:
            _EvaluationFailed: the input is over the cap, or the engine raised or panicked.
        """
        loaded = self._loaded
        return self._execute(loaded, self._input_json(policy_input, loaded))

    def _input_json(self, policy_input: PolicyInput, loaded: _Loaded) -> str:
        if loaded.program is None:
            raise _EvaluationFailed("the policy engine is closed")
        try:
            return serialised_input(policy_input, self._settings.max_input_bytes)
        except ValueError as exc:
            raise _EvaluationFailed(str(exc)) from exc

    def _execute(self, loaded: _Loaded, input_json: str) -> str | None:
        try:
            vm = self._vm(loaded)
            vm.set_input_json(input_json)
            raw: str | None = vm.execute()
        except BaseException as exc:
            if not (isinstance(exc, Exception) or _is_panic(exc)):
                raise
            self._local.vm = None  # a VM that failed mid-run is not trusted again
            log.error("policy_evaluation_failed", error=_last_line(exc), revision=loaded.bundle.revision)
            raise _EvaluationFailed(f"policy evaluation failed: {_last_line(exc)[:200]}") from exc
        return raw

    def _confirm(self, loaded: _Loaded, input_json: str) -> Any:
        """The entrypoint's value on the strict interpreter (None: undefined).

        Raises:
            _EvaluationFailed: a builtin or evaluation error, or a panic.
        """
        try:
            engine = self._strict(loaded)
            engine.set_input_json(input_json)
            return json.loads(engine.eval_rule_as_json(self._settings.entrypoint))
        except BaseException as exc:
            if not (isinstance(exc, Exception) or _is_panic(exc)):
                raise
            self._local.strict = None
            where = _error_location(exc)
            log.error("policy_evaluation_failed", error=_last_line(exc), where=where, revision=loaded.bundle.revision)
            raise _EvaluationFailed(
                f"policy evaluation failed{' at ' + where if where else ''}: {_last_line(exc)[:200]}"
            ) from exc

    def evaluate_interpreted(self, policy_input: PolicyInput) -> Any:
        """The decision as the interpreter computes it (raw JSON value); for parity checks and benchmarks."""
        engine = self._loaded.interpreter.clone()
        engine.set_input_json(policy_input.model_dump_json())
        return json.loads(engine.eval_rule_as_json(self._settings.entrypoint))

    async def decide(self, policy_input: PolicyInput) -> Decision:
        # Evaluation takes tens of microseconds: cheaper inline than a thread hop.
        return self.evaluate(policy_input)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Drop the compiled policy now, on this thread: regorus objects are unsendable, and one the
        garbage collector frees later on another thread raises there. Decisions are then denied."""
        with self._lock:
            self._loaded = _Loaded(self._loaded.bundle, None, None, -1, self._loaded.reasons)
            self._local = threading.local()


def _failed(decision: Decision, message: str) -> Decision:
    """The decision when the interpreter could not confirm ``decision`` (it raised, or decided
    otherwise): a deny with ``policy.error``, and with the RVM's own reasons if it denied too
    (every reason found stays on record; ``policy.error`` is added once)."""
    if decision.outcome is not Outcome.DENY:
        return deny(POLICY_ERROR, message, revision=decision.policy_revision)
    if any(r.code == POLICY_ERROR for r in decision.reasons):
        return decision
    return decision.model_copy(update={"reasons": [*decision.reasons, Reason(code=POLICY_ERROR, message=message)]})


class _EvaluationFailed(Exception):
    """Evaluation did not produce a value; the caller denies."""


def _value(raw: str | None) -> Any:
    """The RVM's JSON text as a value; None for undefined or unparseable."""
    try:
        value = json.loads(raw) if raw is not None else None
    except json.JSONDecodeError:
        return None
    return None if value == _UNDEFINED else value


_LOCATION = re.compile(r"-->\s*(\S+:\d+:\d+)")


def _error_location(exc: BaseException) -> str:
    """``file:line:col`` of a regorus error, if it names one."""
    found = _LOCATION.search(str(exc))
    return found.group(1) if found else ""


def _without_backtrace(exc: BaseException) -> str:
    """A regorus error's text (source snippet and message) without the Rust backtrace that
    ``RUST_BACKTRACE`` may have added."""
    return str(exc).split("Stack backtrace:", 1)[0].strip()


def _last_line(exc: BaseException) -> str:
    """The message of a regorus error without its source snippet and backtrace: its last
    meaningful line (``error: ...``), else the first line."""
    lines = [line.strip() for line in _without_backtrace(exc).splitlines() if line.strip()]
    for line in lines:
        if line.startswith("error:"):
            return line.removeprefix("error:").strip()
    return lines[0] if lines else type(exc).__name__
