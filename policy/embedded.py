"""The embedded policy engine: regorus in process, decisions on the compiled RVM path.

Decisions run on ``regorus.Program`` + ``regorus.Rvm`` (about four times faster than the
interpreter). Every module is also parsed by the interpreter ``regorus.Engine`` at load, so a
syntax error anywhere, tests included, refuses the whole directory and the old policy stays.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import regorus
import structlog

from policy.base import POLICY_ERROR, Decision, PolicyInput, deny, to_decision
from policy.bundle import PolicyBundle, load_bundle
from policy.config import PolicySettings
from policy.errors import PolicyBundleError

log = structlog.get_logger(__name__)

_UNDEFINED = "<undefined>"  # what the RVM returns (JSON-encoded) when the entrypoint is undefined


def _is_panic(exc: BaseException) -> bool:
    # pyo3_runtime.PanicException derives from BaseException and is not importable by name.
    return type(exc).__name__ == "PanicException"


@dataclass(frozen=True, slots=True)
class _Loaded:
    """One compiled generation of the policy; swapped as a whole on reload. ``program`` and
    ``interpreter`` are None once the engine is closed."""

    bundle: PolicyBundle
    program: Any
    interpreter: Any
    generation: int


def _compile(bundle: PolicyBundle, entrypoint: str, generation: int) -> _Loaded:
    try:
        interpreter = regorus.Engine()
        for path, text in bundle.modules:
            interpreter.add_policy(path, text)
        interpreter.add_data_json(bundle.data_json)
        program = regorus.Program.compile_from_modules(bundle.data_json, bundle.decision_modules, [entrypoint])
    except BaseException as exc:
        if not (isinstance(exc, Exception) or _is_panic(exc)):
            raise
        raise PolicyBundleError(f"policy in {bundle.root} does not compile: {str(exc).strip()}") from exc
    return _Loaded(bundle=bundle, program=program, interpreter=interpreter, generation=generation)


class EmbeddedEngine:
    """`PolicyEngine` backed by regorus in this process.

    One RVM per thread (an RVM is not shareable across threads); each is loaded lazily from
    the current compiled program.
    """

    def __init__(self, settings: PolicySettings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._local = threading.local()
        self._loaded = _compile(load_bundle(settings.dir, max_bytes=settings.max_policy_bytes), settings.entrypoint, 1)
        log.info("policy_loaded", revision=self.revision, modules=len(self._loaded.bundle.modules))

    @property
    def revision(self) -> str:
        return self._loaded.bundle.revision

    @property
    def bundle(self) -> PolicyBundle:
        """The policy files and data currently in force."""
        return self._loaded.bundle

    async def reload(self) -> str:
        with self._lock:
            old = self._loaded
            try:
                bundle = load_bundle(self._settings.dir, max_bytes=self._settings.max_policy_bytes)
                new = _compile(bundle, self._settings.entrypoint, old.generation + 1)
            except PolicyBundleError as exc:
                log.error("policy_reload_refused", error=str(exc), kept_revision=old.bundle.revision)
                raise
            self._loaded = new
        log.info("policy_reloaded", revision=new.bundle.revision, previous=old.bundle.revision)
        return new.bundle.revision

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
        """Synchronous decide on the RVM; fails closed on every error."""
        revision = self._loaded.bundle.revision
        try:
            raw = self.evaluate_raw(policy_input)
        except _EvaluationFailed as exc:
            return deny(POLICY_ERROR, str(exc), revision=revision)
        return _to_decision(raw, revision)

    def evaluate_raw(self, policy_input: PolicyInput) -> str | None:
        """The entrypoint's value as the RVM returns it (JSON text), before validation.

        Raises:
            _EvaluationFailed: the input is over the cap, or the engine raised or panicked.
        """
        loaded = self._loaded
        if loaded.program is None:
            raise _EvaluationFailed("the policy engine is closed")
        input_json = policy_input.model_dump_json()
        if len(input_json) > self._settings.max_input_bytes:
            raise _EvaluationFailed(f"policy input is {len(input_json)} bytes, over the cap")
        try:
            vm = self._vm(loaded)
            vm.set_input_json(input_json)
            raw: str | None = vm.execute()
        except BaseException as exc:
            if not (isinstance(exc, Exception) or _is_panic(exc)):
                raise
            self._local.vm = None  # a VM that failed mid-run is not trusted again
            log.error("policy_evaluation_failed", error=str(exc).strip()[:500], revision=loaded.bundle.revision)
            raise _EvaluationFailed(f"policy evaluation failed: {str(exc).strip()[:200]}") from exc
        return raw

    def evaluate_interpreted(self, policy_input: PolicyInput) -> Any:
        """The decision as the interpreter computes it (raw JSON value); for parity checks and benchmarks."""
        engine = self._loaded.interpreter.clone()
        engine.set_input_json(policy_input.model_dump_json())
        return json.loads(engine.eval_rule_as_json(self._settings.entrypoint))

    async def decide(self, policy_input: PolicyInput) -> Decision:
        # Evaluation takes tens of microseconds: cheaper inline than a thread hop.
        return self.evaluate(policy_input)

    async def aclose(self) -> None:
        # regorus objects are unsendable: they must be dropped on the thread that made them. Drop
        # them here, now, rather than whenever (and wherever) the garbage collector gets to them.
        with self._lock:
            self._loaded = _Loaded(self._loaded.bundle, None, None, -1)
            self._local = threading.local()


class _EvaluationFailed(Exception):
    """Evaluation did not produce a value; the caller denies."""


def _to_decision(raw: str | None, revision: str) -> Decision:
    try:
        value = json.loads(raw) if raw is not None else None
    except json.JSONDecodeError:
        value = None
    return to_decision(None if value == _UNDEFINED else value, revision)
