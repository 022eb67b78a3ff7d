"""The OPA server engine: the same policy directory, decided by an OPA server over its REST API
(through opa-python-client).

The engine loads the directory or bundle file ``settings.dir`` names (a bundle checked against
``settings.bundle_public_key``, as the embedded engine does), uploads its decision modules
(``PUT /v1/policies/stockade/<path>``) and its data (``PUT /v1/data/<top-level key>``) before
its first decision and on every reload, then asks ``POST /v1/data/stockade/decision``. With
``opa_upload`` off, the server has loaded the same directory itself (mounted and watched, as in
compose.yaml) and the engine only asks. Every failure (unreachable, slow, refused upload,
undefined or malformed decision) is a deny with ``policy.error``, as in the embedded engine,
whose decisions are the reference. OPA's REST API has no atomic multi-module swap: a reload that
OPA refuses half-way is rolled back by uploading the previous bundle again.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit

import structlog
from opa_client.opa_async import AsyncOpaClient

from policy.base import POLICY_ERROR, Decision, PolicyInput, deny, to_decision
from policy.bundle import PolicyBundle, digest_of, load_configured
from policy.config import PolicySettings
from policy.errors import PolicyBundleError, as_bundle_error
from policy.status import LoadStatus

log = structlog.get_logger(__name__)

_POLICY_PREFIX = "stockade/"  # the ids this engine owns on the server; others are left alone

# OPA evaluates builtins non-strictly by default: an error makes its rule undefined, so a deny
# reason could vanish. Strict, the server answers 500 instead, and the decision fails closed.
_STRICT = {"strict-builtin-errors": True}


class OpaEngine:
    """`PolicyEngine` backed by an OPA server."""

    def __init__(self, settings: PolicySettings) -> None:
        self._settings = settings
        self._bundle = load_configured(settings)
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
        self._lock = asyncio.Lock()
        self._session_open = False
        self._served: PolicyBundle | None = None  # what the server holds, as far as we know
        self._ids: set[str] = set()

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
        """Put ``bundle`` on the server and remove this engine's modules it no longer has."""
        await self._open()
        ids = {_POLICY_PREFIX + path.removesuffix(".rego"): text for path, text in bundle.decision_modules}
        # OPA compiles each module against those it already holds, so one that uses a rule
        # another file defines is refused until that file is there: put what it accepts, then
        # try the rest again, until a round adds nothing (then the policy itself is at fault).
        pending = dict(ids)
        while pending:
            before = len(pending)
            refused: list[Exception] = []
            for policy_id, text in list(pending.items()):
                try:
                    await self._client.update_policy_from_string(text, policy_id, rego_compat=False)
                except Exception as exc:  # the client raises its own, aiohttp's and TypeErrors alike
                    refused.append(exc)
                    continue
                del pending[policy_id]
            if len(pending) == before:
                raise refused[0]
        for key, value in bundle.data.items():
            await self._client.update_or_create_data(value, key)
        for stale in self._ids - ids.keys():
            await self._client.delete_policy(stale)
        self._ids = set(ids)
        self._served = bundle

    async def _ensure_served(self) -> None:
        await self._open()
        if self._served is self._bundle or not self._settings.opa_upload:
            return
        async with self._lock:
            if self._served is not self._bundle:
                await self._upload(self._bundle)
                log.info("policy_uploaded_to_opa", revision=self._bundle.revision, url=self._settings.opa_url)

    async def decide(self, policy_input: PolicyInput) -> Decision:
        revision = self._bundle.revision
        input_json = policy_input.model_dump_json()
        if len(input_json) > self._settings.max_input_bytes:
            return deny(POLICY_ERROR, f"policy input is {len(input_json)} bytes, over the cap", revision=revision)
        try:
            await self._ensure_served()
            answer: Any = await self._client.query_rule(
                input_data=json.loads(input_json), package_path=self._path, query_params=_STRICT
            )
        except Exception as exc:  # the client raises aiohttp's, its own and TypeErrors alike: all fail closed
            log.error("opa_decision_failed", error=str(exc)[:500], url=self._settings.opa_url)
            return deny(POLICY_ERROR, f"OPA at {self._settings.opa_url} failed: {type(exc).__name__}: {exc}"[:300],
                        revision=revision)  # fmt: skip
        value = answer.get("result") if isinstance(answer, dict) else None
        return to_decision(value, revision)

    async def reload(self) -> str:
        try:
            bundle = load_configured(self._settings)
        except Exception as exc:  # any failure to load is a refusal: recorded, audited, old policy kept
            refused = as_bundle_error(exc, self._settings.dir)
            self._status = self._status.failed(str(refused), digest_of(self._settings.dir))
            log.error("policy_reload_refused", error=str(refused), kept_revision=self._bundle.revision)
            if refused is exc:
                raise
            raise refused from exc
        if not self._settings.opa_upload:  # the server watches the same files and reloads them itself
            old, self._bundle = self._bundle, bundle
            self._status = self._status.loaded(bundle.revision)
            log.info("policy_reloaded", revision=bundle.revision, previous=old.revision, served_by="opa")
            return bundle.revision
        async with self._lock:
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
            self._bundle = bundle
            self._status = self._status.loaded(bundle.revision)
        log.info("policy_reloaded", revision=bundle.revision, previous=old.revision)
        return bundle.revision

    async def aclose(self) -> None:
        if self._session_open:
            await self._client.close_connection()
            self._session_open = False
