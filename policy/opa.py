"""The OPA server engine: the same policy directory, decided by an OPA server over its REST API
(through opa-python-client).

The engine loads the directory or bundle file ``settings.dir`` names (a bundle checked against
``settings.bundle_public_key``, as the embedded engine does), uploads its decision modules
(``PUT /v1/policies/stockade/<path>``) and its data (``PUT /v1/data/<top-level key>``) before
its first decision and on every reload, then asks ``POST /v1/data/stockade/decision``. With
``opa_upload`` off, the server has loaded the same directory itself (mounted and watched, as in
compose.yaml) and the engine only asks. Every failure (unreachable, slow, refused upload,
undefined or malformed decision) is a deny with ``policy.error``, as in the embedded engine,
whose decisions are the reference. As there, a load or reload refuses a catalog the schema refuses
(`policy.schema.validate_data`), and decisions are checked against the reason catalog.

OPA's REST API has no atomic multi-module swap, so the engine makes the switch atomic for its own
decisions: none is evaluated while an upload is in progress (a decision waits for it, up to
``opa_timeout_s``, then denies), and an upload waits for the decisions in flight. A reload that OPA
refuses half-way is rolled back by uploading the previous bundle again, which deletes whatever the
refused one had added. The engine owns the ``stockade/`` policy ids on the server: each upload
deletes those there that its bundle does not have, including ones an earlier process put there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import structlog
from opa_client.opa_async import AsyncOpaClient

from policy.base import POLICY_ERROR, Decision, PolicyInput, deny, serialised_input, to_decision
from policy.bundle import PolicyBundle, digest_of, load_configured
from policy.config import PolicySettings
from policy.errors import PolicyBundleError, PolicyError, as_bundle_error
from policy.schema import validate_data
from policy.status import LoadStatus

log = structlog.get_logger(__name__)

_POLICY_PREFIX = "stockade/"  # the ids this engine owns on the server; others are left alone

# OPA evaluates builtins non-strictly by default: an error makes its rule undefined, so a deny
# reason could vanish. Strict, the server answers 500 instead, and the decision fails closed.
_STRICT = {"strict-builtin-errors": True}


class _Gate:
    """Decisions share the OPA server; an upload has it to itself, so no decision is evaluated
    against a half-uploaded policy. An upload waiting for its turn holds back new decisions, or a
    steady stream of them would keep it waiting for ever."""

    def __init__(self) -> None:
        self._uploads = asyncio.Lock()
        self._open = asyncio.Event()  # no upload holds the server or waits for it
        self._open.set()
        self._idle = asyncio.Event()  # no decision is in flight
        self._idle.set()
        self._deciding = 0

    @contextlib.asynccontextmanager
    async def deciding(self, timeout_s: float) -> AsyncIterator[None]:
        """Hold the server for one decision, once no upload holds it (`PolicyError` after ``timeout_s``)."""
        try:
            async with asyncio.timeout(timeout_s):
                while not self._open.is_set():  # another upload may have taken it between set and wake-up
                    await self._open.wait()
        except TimeoutError:
            raise PolicyError(f"a policy upload held the server over {timeout_s}s") from None
        self._deciding += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._deciding -= 1
            if not self._deciding:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def uploading(self) -> AsyncIterator[None]:
        """Hold the server alone: after the decisions in flight, before any new one."""
        async with self._uploads:
            self._open.clear()
            try:
                await self._idle.wait()
                yield
            finally:
                self._open.set()


def _is_gone(exc: Exception) -> bool:
    """Whether a failed DELETE failed because there was nothing to delete."""
    return getattr(exc, "expression", None) == "resource_not_found"


class OpaEngine:
    """`PolicyEngine` backed by an OPA server."""

    def __init__(self, settings: PolicySettings) -> None:
        self._settings = settings
        self._bundle = load_configured(settings)
        self._reasons = validate_data(self._bundle)  # the reason catalog decisions are checked against
        self._status = LoadStatus.first(str(settings.dir), self._bundle.revision)
        parts = urlsplit(settings.opa_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PolicyBundleError(
                f"opa_url {settings.opa_url!r} is not http(s)://host:port; set STOCKADE_POLICY__OPA_URL"
            )
        self._client = AsyncOpaClient(
            host=parts.hostname,
            port=parts.port or (443 if parts.scheme == "https" else 8181),
            ssl=parts.scheme == "https",
            token=settings.opa_token.get_secret_value() if settings.opa_token else None,
            timeout=settings.opa_timeout_s,
            retries=0,  # a decision is not retried: the caller is waiting, and failing closed is safe
        )
        self._path = settings.entrypoint.removeprefix("data.").replace(".", "/")
        self._gate = _Gate()
        self._session_open = False
        self._served: PolicyBundle | None = None  # what the server holds, as far as we know
        # What this engine may have put on the server: added before each PUT (a PUT that timed out
        # may still have landed), removed once deleted, so a rollback deletes what it must.
        self._ids: set[str] = set()
        self._data_keys: set[str] = set()

    @property
    def revision(self) -> str:
        return self._bundle.revision

    @property
    def load_status(self) -> LoadStatus:
        """The revision in force, and whether the files on disk loaded at the last attempt."""
        return self._status

    async def _open(self) -> None:
        if not self._session_open:
            await self._client.__aenter__()
            self._session_open = True

    async def _upload(self, bundle: PolicyBundle) -> None:
        """Make the server hold ``bundle``: its data, its modules, and no other ``stockade/`` module.

        Call it only with the server held (`_Gate.uploading`)."""
        await self._open()
        self._served = None  # until this completes, the server holds neither this bundle nor the last
        ids = {_POLICY_PREFIX + path.removesuffix(".rego"): text for path, text in bundle.decision_modules}
        # The prefix is ours: what an earlier process (or a refused upload) left there goes too.
        self._ids |= {i for i in await self._client.get_policies_list() if i.startswith(_POLICY_PREFIX)}
        # Data first, so the new modules never run against the old data, even if the upload stops half-way.
        for key, value in bundle.data.items():
            self._data_keys.add(key)
            await self._client.update_or_create_data(value, key)
        # OPA compiles each module against those it already holds, so one that uses a rule
        # another file defines is refused until that file is there, and a file other modules
        # still use cannot be deleted before they change: do what OPA accepts, then try the
        # rest again, until a round does nothing (then the policy itself is at fault).
        pending: dict[str, Callable[[], Awaitable[None]]] = {
            **{f"put {i}": self._put_policy(i, text) for i, text in ids.items()},
            **{f"delete {i}": self._delete_policy(i) for i in self._ids - ids.keys()},
        }
        while pending:
            before = len(pending)
            refused: list[Exception] = []
            for step, run in list(pending.items()):
                try:
                    await run()
                except Exception as exc:  # the client raises its own, aiohttp's and TypeErrors alike
                    refused.append(exc)
                    continue
                del pending[step]
            if len(pending) == before:
                raise refused[0]
        for key in sorted(self._data_keys - bundle.data.keys()):
            try:
                await self._client.delete_data(key)
            except Exception as exc:
                if not _is_gone(exc):
                    raise
            self._data_keys.discard(key)
        self._served = bundle

    def _put_policy(self, policy_id: str, text: str) -> Callable[[], Awaitable[None]]:
        async def put() -> None:
            self._ids.add(policy_id)
            await self._client.update_policy_from_string(text, policy_id, rego_compat=False)

        return put

    def _delete_policy(self, policy_id: str) -> Callable[[], Awaitable[None]]:
        async def delete() -> None:
            try:
                await self._client.delete_policy(policy_id)
            except Exception as exc:
                if not _is_gone(exc):
                    raise
            self._ids.discard(policy_id)

        return delete

    async def _ensure_served(self) -> None:
        await self._open()
        if self._served is self._bundle or not self._settings.opa_upload:
            return
        async with self._gate.uploading():
            if self._served is not self._bundle:
                await self._upload(self._bundle)
                log.info("policy_uploaded_to_opa", revision=self._bundle.revision, url=self._settings.opa_url)

    async def decide(self, policy_input: PolicyInput) -> Decision:
        revision = self._bundle.revision
        try:
            text = serialised_input(policy_input, self._settings.max_input_bytes)
        except ValueError as exc:
            return deny(POLICY_ERROR, str(exc), revision=revision)
        try:
            await self._ensure_served()
            async with self._gate.deciding(self._settings.opa_timeout_s):
                revision = self._bundle.revision  # the one evaluated, if a reload finished meanwhile
                reasons = self._reasons
                if self._settings.opa_upload and self._served is not self._bundle:
                    raise PolicyError("the policy on the server is unknown after a failed upload")
                answer: Any = await self._client.query_rule(
                    input_data=json.loads(text), package_path=self._path, query_params=_STRICT
                )
        except Exception as exc:  # the client raises aiohttp's, its own and TypeErrors alike: all fail closed
            log.error("opa_decision_failed", error=str(exc)[:500], url=self._settings.opa_url)
            return deny(POLICY_ERROR, f"OPA at {self._settings.opa_url} failed: {type(exc).__name__}: {exc}"[:300],
                        revision=revision)  # fmt: skip
        value = answer.get("result") if isinstance(answer, dict) else None
        return to_decision(value, revision, reasons)

    async def reload(self, approve: Callable[[str], Awaitable[None]] | None = None) -> str:
        try:
            bundle = load_configured(self._settings)
            reasons = validate_data(bundle)
        except Exception as exc:  # any failure to load is a refusal: recorded, audited, old policy kept
            refused = as_bundle_error(exc, self._settings.dir)
            self._status = self._status.failed(str(refused), digest_of(self._settings.dir))
            log.error("policy_reload_refused", error=str(refused), kept_revision=self._bundle.revision)
            if refused is exc:
                raise
            raise refused from exc
        if approve is not None:
            await approve(bundle.revision)  # raises: not approved, the old policy stays (this router's)
        if not self._settings.opa_upload:  # the server watches the same files and reloads them itself
            old, self._bundle, self._reasons = self._bundle, bundle, reasons
            self._status = self._status.loaded(bundle.revision)
            log.info("policy_reloaded", revision=bundle.revision, previous=old.revision, served_by="opa")
            return bundle.revision
        async with self._gate.uploading():
            old = self._bundle
            try:
                await self._upload(bundle)
            except Exception as exc:
                log.error("policy_reload_refused", error=str(exc)[:500], kept_revision=old.revision)
                try:
                    await self._upload(old)
                except Exception as restore:  # the server is down: the next decide uploads again
                    log.error("opa_restore_failed", error=str(restore)[:500])
                    self._served = None
                self._status = self._status.failed(f"OPA at {self._settings.opa_url} refused the policy: {exc}",
                                                   bundle.revision)  # fmt: skip
                raise PolicyBundleError(f"OPA at {self._settings.opa_url} refused the policy: {exc}") from exc
            self._bundle, self._reasons = bundle, reasons
            self._status = self._status.loaded(bundle.revision)
        log.info("policy_reloaded", revision=bundle.revision, previous=old.revision)
        return bundle.revision

    async def aclose(self) -> None:
        if self._session_open:
            await self._client.close_connection()
            self._session_open = False
