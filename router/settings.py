"""The one settings object, read from ``STOCKADE_*`` environment variables (``__`` nests).

``STOCKADE_POLICY__DIR=/etc/stockade/policies`` sets ``settings.policy.dir``. Built once in the
entrypoint and passed down; nothing else reads the environment.

State (the audit log, its spool, the demo's logs) is never kept relative to the current directory:
by default it lives in ``state_dir()``.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from policy.config import PolicySettings
from router.audit.masking import pointer_problem
from router.credentials.base import CredentialConfig
from runner import RunnerSettings

# A system service's state directory (FHS); also the runner's as root (runner.config).
SYSTEM_STATE_DIR = Path("/var/lib/stockade")


def state_dir() -> Path:
    """Where a router keeps its state unless told otherwise (``STOCKADE_AUDIT__PATH``).

    ``$XDG_STATE_HOME/stockade`` (``~/.local/state/stockade`` when XDG_STATE_HOME is unset), as for
    any user's program, root included in a login shell. A system service has no home: run as root
    with neither HOME (or HOME=/) nor XDG_STATE_HOME, as systemd starts a system unit without
    ``User=``, it is ``/var/lib/stockade``.
    """
    xdg = os.environ.get("XDG_STATE_HOME", "")
    if os.path.isabs(xdg):  # the XDG spec: a relative value is invalid and ignored
        return Path(xdg) / "stockade"
    if os.geteuid() == 0 and os.environ.get("HOME", "") in ("", "/"):
        return SYSTEM_STATE_DIR
    return Path.home() / ".local" / "state" / "stockade"


def _default_audit_path() -> Path:
    directory = state_dir()
    # Made private on first use (XDG: 0700). The system one is also where sandboxes, each its own
    # uid, reach their staging directories: traverse only, never list (the audit files are 0640).
    # One that cannot be made is reported by the audit log when it opens the file, naming the path.
    with contextlib.suppress(OSError):
        directory.mkdir(mode=0o711 if directory == SYSTEM_STATE_DIR else 0o700, parents=True, exist_ok=True)
    return directory / "audit.jsonl"


def config_dir() -> Path:
    """Where stockade's own keys live, apart from its state: ``$XDG_CONFIG_HOME/stockade``, or
    ``/etc/stockade`` for a root service without a home."""
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    # Ignored when relative, as the XDG spec says and `state_dir` does: the signing key and the
    # anchor would otherwise follow the working directory, and a router started elsewhere would sign
    # with a new key and find no anchor to hold its log to.
    if os.path.isabs(xdg):
        return Path(xdg) / "stockade"
    if os.geteuid() == 0 and os.environ.get("HOME", "") in ("", "/"):
        return Path("/etc/stockade")
    return Path.home() / ".config" / "stockade"


class MaskRule(BaseModel):
    """One masking rule: a JSON Pointer (RFC 6901: ``~1`` for a ``/`` in a key, ``~0`` for a ``~``)
    into the event's ``input`` or ``result`` (``/input/args/card``; a ``*`` step matches any key or
    list item); its value is erased or, with ``hash``, replaced by an HMAC-SHA256 under the log's
    masking key (`AuditSettings.mask_key`). A path that can never match is refused here."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(pattern=r"^/(input|result)(/[^/]+)+$")
    hash: bool = False

    @model_validator(mode="after")
    def _can_match(self) -> Self:
        problem = pointer_problem(self.path)
        if problem is not None:
            raise ValueError(f"mask path {self.path!r} can never match: {problem}")
        return self


class AuditSettings(BaseModel):
    """Where the audit log lives and how durable each append is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # "jsonl": a file (shared by routers on one host through flock). "redis": a stream in the
    # store's Redis (STOCKADE_STORE__URL), one chain for routers on any number of hosts.
    backend: Literal["jsonl", "redis"] = "jsonl"
    path: Path = Field(default_factory=_default_audit_path)  # see state_dir()
    # "fsync": an event is on disk before the call it records proceeds (the default).
    # "relaxed": written to the OS only; an operator's explicit choice, named as such.
    durability: Literal["fsync", "relaxed"] = "fsync"
    # With the Redis backend: where events the stream cannot take are kept (fsynced) until it
    # answers again, with the last head this router appended. Each router on a host claims its own
    # file here. Put it on a disk that survives the router, not a tmpfs. None: ``audit-spool``
    # beside ``path``.
    spool_dir: Path | None = None
    # The Ed25519 key that signs checkpoints (PKCS8 PEM, mode 0600; made on first use, with its
    # public key beside it as ``<key>.pub``). Keep it off the log's volume: whoever can rewrite
    # the log must not be able to sign for it. Default: stockade's config directory.
    signing_key: Path = Field(default_factory=lambda: config_dir() / "audit-signing.key")
    # The name checkpoints carry: which log they vouch for.
    log_name: str = Field(default="stockade", min_length=1, max_length=200)
    # A checkpoint is signed this long after an append (at most one per interval), every
    # ``checkpoint_every`` events, when a segment is sealed, and on shutdown.
    checkpoint_interval_s: float = Field(default=1.0, gt=0)
    # Refusals of one kind (the same caller and code) written one by one in each window; past
    # that they are counted, and the count written as one event when the window closes
    # (`router.refusals`): a flood of bad requests must not become an fsynced append each.
    refusal_burst: int = Field(default=100, gt=0)
    refusal_window_s: float = Field(default=10.0, gt=0)
    checkpoint_every: int = Field(default=10_000, gt=0)
    # Also publish each checkpoint as a new file here: somewhere the router cannot rewrite (an
    # object-lock bucket mount, a SIEM inbox). The Redis backend also keeps them in Redis.
    publish_dir: Path | None = None
    # A segment is sealed at this size, and at UTC midnight if ``rotate_daily``.
    segment_max_bytes: int = Field(default=64 << 20, ge=4096)
    rotate_daily: bool = True
    # Sealed segments older than this many days are deleted (each leaves a signed tombstone).
    # None: kept forever.
    retention_days: int | None = Field(default=None, ge=1)
    # OPA-style masking: paths into ``input`` / ``result`` (``/input/args/password``) whose values
    # are erased, or replaced by a keyed hash (``{"path": ..., "hash": true}``), before the event
    # is hashed and written: masked data never enters the log.
    mask: list[MaskRule] = Field(default_factory=list)
    # The key hashed masks are an HMAC-SHA256 under (32 random bytes, hex; mode 0600; made on first
    # use). Kept beside the signing key, off the log's volume: with it, anyone holding the log could
    # test guesses against a hashed value (a PIN, a card number) as fast as they can hash. Losing it
    # only means values hashed later no longer equal those hashed before.
    mask_key: Path = Field(default_factory=lambda: config_dir() / "audit-mask.key")


class StoreSettings(BaseModel):
    """Where sessions, provenance, approvals and rate windows live."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # None: in this process (the embedded default). ``redis://host:6379/0``: shared by every
    # router pointed at it (STOCKADE_STORE__URL).
    url: str | None = None
    # A store slower than this fails the call closed rather than hanging it.
    timeout_s: float = Field(default=2.0, gt=0)


class TelemetrySettings(BaseModel):
    """Where the spans of tool calls go (OpenTelemetry, OTLP/HTTP): nowhere unless set (router.telemetry)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # A collector's OTLP/HTTP URL (STOCKADE_TELEMETRY__OTLP_ENDPOINT): its base, ``http://collector:4318``
    # (``/v1/traces`` is added), or the traces URL itself. A malformed one is logged, and nothing exported.
    otlp_endpoint: str | None = None
    # Without otlp_endpoint: export where the OTel SDK's standard variables say
    # (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT; http://localhost:4318 by default).
    enabled: bool = False
    service_name: str = Field(default="stockade", min_length=1)


_PRINCIPAL_NAME = r"^[A-Za-z0-9][A-Za-z0-9@._+-]{0,127}$"
_GROUP = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@/+-]{0,127}")
_LABEL_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
_LABEL_VALUE = re.compile(r"[A-Za-z0-9_.,:@/+= -]{0,256}")
_MAX_GROUPS = 64
_MAX_LABELS = 64


def _shown(value: str) -> str:
    return repr(value[:40] + "..." if len(value) > 40 else value)


def _check_group(value: str) -> str:
    if not _GROUP.fullmatch(value):
        raise ValueError(
            f"group {_shown(value)} ({len(value)} characters) is not a group name: 1-128 letters, digits and "
            "_ . : @ / + -, starting with a letter or digit"
        )
    return value


def _check_labels(labels: dict[str, str]) -> dict[str, str]:
    for key, value in labels.items():
        if not _LABEL_KEY.fullmatch(key):
            raise ValueError(
                f"label name {_shown(key)} ({len(key)} characters) is not allowed: 1-64 letters, digits and "
                "_ . -, starting with a letter"
            )
        if not _LABEL_VALUE.fullmatch(value):
            raise ValueError(
                f"label {key}'s value {_shown(value)} ({len(value)} characters) is not allowed: at most 256 "
                "letters, digits, spaces and _ . , : @ / + = -"
            )
    return labels


def _check_principal_names(principals: dict[str, PrincipalConfig]) -> dict[str, PrincipalConfig]:
    for name in principals:
        if not re.fullmatch(_PRINCIPAL_NAME, name):
            raise ValueError(
                f"principal name {_shown(name)} ({len(name)} characters) is not allowed: 1-128 letters, digits and "
                "@ . _ + -, starting with a letter or digit (as in STOCKADE_API_PRINCIPALS)"
            )
    return principals


GroupName = Annotated[str, AfterValidator(_check_group)]


class PrincipalConfig(BaseModel):
    """What policy knows of a principal (``input.subject.groups`` / ``labels``): its teams and
    roles, and facts such as ``{"department": "finance"}``. Configured here only, never taken
    from the agent."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    groups: list[GroupName] = Field(default_factory=list, max_length=_MAX_GROUPS)
    labels: Annotated[dict[str, str], AfterValidator(_check_labels)] = Field(
        default_factory=dict, max_length=_MAX_LABELS
    )

    @property
    def configured(self) -> bool:
        """Whether it says anything (groups or labels)."""
        return bool(self.groups or self.labels)


class ApiPrincipal(PrincipalConfig):
    """Who may use the HTTP API, as what. Only the sha256 of the bearer token is configured
    (``stockade api-token`` makes a token and prints its hash). ``groups`` and ``labels``: what
    policy sees of this principal when a session acts for it (`PrincipalConfig`)."""

    name: str = Field(pattern=_PRINCIPAL_NAME)
    role: Literal["agent", "approver", "auditor", "admin"]
    token_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    # Agents register tools only if allowed to; admins always may.
    may_register: bool = False
    # For an agent: the principals it may open sessions for (None: any principal that has no
    # groups or labels configured). A principal with groups or labels is acted for only by agents
    # that list it, so an agent cannot claim someone's groups by naming them in a session.
    acts_for: list[Annotated[str, Field(pattern=_PRINCIPAL_NAME)]] | None = Field(default=None, max_length=1024)

    def refuses_to_act_for(self, name: str, config: PrincipalConfig) -> str | None:
        """Why this agent may not open a session for the principal ``name`` (configured as
        ``config``); None if it may."""
        if self.acts_for is not None and name not in self.acts_for:
            return f"agent {self.name} may open sessions only for the principals its acts_for lists, not {name}"
        if config.configured and self.acts_for is None:
            return (f"principal {name} has groups or labels configured: only an agent whose acts_for lists it "
                    "may open a session for it")  # fmt: skip
        return None


_MONTH = 30 * 86400.0  # seconds: the longest a session, an approval or a signing key lives


class Settings(BaseSettings):
    """Everything configurable about a stockade router."""

    model_config = SettingsConfigDict(env_prefix="STOCKADE_", env_nested_delimiter="__", extra="ignore", frozen=True)

    policy: PolicySettings = Field(default_factory=PolicySettings)
    runner: RunnerSettings = Field(default_factory=RunnerSettings)
    audit: AuditSettings = Field(default_factory=AuditSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    log_format: Literal["console", "json"] = "console"
    log_level: Literal["debug", "info", "warning", "error"] = "warning"
    max_args_bytes: int = Field(default=1 << 20, gt=0)
    max_report_bytes: int = Field(default=1 << 20, gt=0)
    max_input_bytes: int = Field(default=16 << 20, gt=0)
    # Each lifetime below is bounded: an infinite one (``inf``, ``1e309``) never expired in the
    # embedded store and overflowed Redis's expiry, failing every held call.
    # A session unused for this long expires: its calls are refused and its sandboxes destroyed.
    session_idle_ttl_s: float = Field(default=3600.0, gt=0, le=_MONTH)
    # How long a human has to decide a held call before its approval expires.
    approval_ttl_s: float = Field(default=900.0, gt=0, le=_MONTH)
    # How long a decided, used or expired approval stays listed for review after its expiry.
    approval_keep_s: float = Field(default=86400.0, ge=0, le=365 * 86400.0)
    instance: str = Field(default_factory=socket.gethostname)
    # The credentials this router can issue (STOCKADE_CREDENTIALS, a JSON list); policy grants
    # them per call, capped by these entries.
    credentials: list[CredentialConfig] = Field(default_factory=list)
    # How often the token issuer's signing key is replaced (old public keys stay published as
    # long as tokens they signed can live).
    credential_key_rotation_s: float = Field(default=3600.0, gt=0, le=_MONTH)
    # Bearer tokens of the services allowed to introspect credentials (RFC 7662 callers).
    introspection_tokens: list[SecretStr] = Field(default_factory=list)
    # The HTTP API's principals (STOCKADE_API_PRINCIPALS, a JSON list); none: every request is refused.
    api_principals: list[ApiPrincipal] = Field(default_factory=list)
    # What policy knows of principals by name (STOCKADE_PRINCIPALS, a JSON object
    # {"alice@example.com": {"groups": ["deployers"], "labels": {"team": "payments"}}}): for
    # principals that do not use the HTTP API themselves (SDK, MCP, embedded). A name may have its
    # groups and labels here or on its API principal entry, not in both.
    principals: Annotated[dict[str, PrincipalConfig], AfterValidator(_check_principal_names)] = Field(
        default_factory=dict
    )
    # The deployment this router decides for (``input.environment.name``: prod, staging, dev, ...).
    environment: str = Field(default="dev", pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$")
    api_max_body_bytes: int = Field(default=32 << 20, gt=0)
    # A request (a call included: it waits for the tool) that takes longer is answered 504.
    api_request_timeout_s: float = Field(default=600.0, gt=0)

    @model_validator(mode="after")
    def _one_config_per_principal(self) -> Self:
        """Each principal's groups and labels are configured in one place: two different answers
        to "what groups is alice in" would make a rule depend on which entry was read."""
        found: dict[str, PrincipalConfig] = {}
        for name, config in [*self.principals.items(), *((p.name, p) for p in self.api_principals)]:
            if not config.configured:
                continue
            plain = PrincipalConfig(groups=config.groups, labels=config.labels)
            if found.setdefault(name, plain) != plain:
                raise ValueError(
                    f"principal {name!r} has groups or labels configured twice, differently (STOCKADE_PRINCIPALS "
                    "and STOCKADE_API_PRINCIPALS entries): configure them in one entry"
                )
        return self

    @model_validator(mode="after")
    def _one_principal_per_token(self) -> Self:
        """A token is one principal's: a copied entry would otherwise make the same token whichever
        entry is matched last (an agent's token an admin's), with nothing said."""
        owners: dict[str, int] = {}
        for n, entry in enumerate(self.api_principals):
            first = owners.setdefault(entry.token_sha256, n)
            if first != n:
                raise ValueError(
                    f"STOCKADE_API_PRINCIPALS entries {first} ({self.api_principals[first].name}, "
                    f"{self.api_principals[first].role}) and {n} ({entry.name}, {entry.role}) have the same "
                    "token_sha256: give each principal its own token (stockade api-token)"
                )
        return self

    @model_validator(mode="after")
    def _one_credential_per_variable(self) -> Self:
        """Each credential has its own name and its own sandbox variable: ``gh-a`` and ``gh.a``
        are both ``STOCKADE_CREDENTIAL_GH_A``, and a call granted both would see one placeholder,
        whichever was written last, with nothing said."""
        owners: dict[str, CredentialConfig] = {}
        for entry in self.credentials:
            first = owners.setdefault(entry.env_var, entry)
            if first is not entry:
                same = "the same name" if first.name == entry.name else f"the same sandbox variable {entry.env_var}"
                raise ValueError(
                    f"STOCKADE_CREDENTIALS entries {first.name!r} and {entry.name!r} have {same}: rename one "
                    "(a name's letters, digits and separators make its variable)"
                )
        return self

    def principal_config(self, name: str) -> PrincipalConfig:
        """What is configured for the principal ``name`` (nothing: no groups, no labels)."""
        found = self.principals.get(name)
        if found is not None and found.configured:
            return found
        for entry in self.api_principals:
            if entry.name == name and entry.configured:
                return entry
        return _NOBODY


_NOBODY = PrincipalConfig()
