"""The upstream-secret issuer: API keys the operator already has, leased per call.

Values are read once, at start-up, from the environment variable or file the operator names.
A lease carries the value to the egress proxy (which injects it into requests to the
credential's hosts) and is recorded in the `Store`; the value itself is never stored.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import Iterable

from pydantic import SecretStr

from router.credentials.base import Binding, CredentialConfig, CredentialUnavailable, Grant, Lease
from router.store.base import Store

# What RFC 9110 forbids in a field value (and h11 refuses to send): controls other than tab.
_NOT_IN_A_HEADER = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def load_secret(config: CredentialConfig) -> SecretStr:
    """The operator's value for a ``secret`` credential.

    Raises:
        CredentialUnavailable: the variable is unset or empty, or the file is unreadable or empty;
            or the value has a character no HTTP header may carry.
    """
    if config.value_env is not None:
        # Stripped as a file's value is: a trailing newline (an env file, a secret mounted from a
        # file) is no part of a key, and would make every request carrying it invalid.
        value = os.environ.get(config.value_env, "").strip()
        where = f"environment variable {config.value_env}"
    else:
        assert config.value_file is not None  # the config validator demands one source  # noqa: S101
        try:
            value = config.value_file.read_text().strip()
        except OSError as exc:
            raise CredentialUnavailable(f"credential {config.name}: cannot read {config.value_file}: "
                                        f"{exc.strerror}") from exc  # fmt: skip
        where = f"file {config.value_file}"
    if not value:
        raise CredentialUnavailable(f"credential {config.name}: {where} is empty; set it before starting stockade")
    if _NOT_IN_A_HEADER.search(value):
        # Never the value, nor where in it: the message goes to logs and the operator's terminal.
        raise CredentialUnavailable(f"credential {config.name}: the value in {where} has a control character (a "
                                    "line break, say), which no HTTP header may carry; store the key only")  # fmt: skip
    return SecretStr(value)


class SecretIssuer:
    """`Issuer` of leases on operator-held secrets."""

    def __init__(self, store: Store, configs: Iterable[CredentialConfig]) -> None:
        self._store = store
        self._values = {c.name: load_secret(c) for c in configs if c.kind == "secret"}

    @property
    def values(self) -> dict[str, SecretStr]:
        return dict(self._values)

    async def mint(self, grant: Grant, binding: Binding) -> Lease:
        value = self._values.get(grant.config.name)
        if value is None:
            raise CredentialUnavailable(f"credential {grant.config.name} has no value loaded")
        now = time.time()
        lease = Lease("l-" + secrets.token_hex(12), grant, binding, value,
                      "stockade-placeholder-" + secrets.token_hex(16), now, now + grant.ttl_s)  # fmt: skip
        await self._store.put_lease(lease.id, json.dumps(lease.record()), grant.ttl_s)
        return lease

    async def revoke(self, lease: Lease) -> None:
        await self._store.revoke_lease(lease.id)

    async def aclose(self) -> None:
        self._values.clear()
