"""Settings owned by the policy package (composed into the router's settings)."""

from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator


def _shipped_policies() -> Path:
    """The project's own policy directory; operators point ``STOCKADE_POLICY__DIR`` elsewhere.

    An installed stockade carries it as package data (``policy/shipped/``, which the wheel maps
    from the repository's top-level ``policies/``); a source checkout or an editable install reads
    that ``policies/`` directly. Both are the same files.
    """
    installed = resources.files("policy") / "shipped"
    if isinstance(installed, Path) and installed.is_dir():
        return installed
    return Path(__file__).resolve().parent.parent / "policies"


class PolicySettings(BaseModel):
    """Where the Rego lives and how big it and its inputs may be."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # "embedded": regorus in this process. "opa": an OPA server at opa_url, which the engine
    # loads with this directory's policy and data (STOCKADE_POLICY__ENGINE=opa).
    engine: Literal["embedded", "opa"] = "embedded"
    # What the engines load and the control plane watches: a policy directory, or a bundle file
    # (a .tar.gz that `stockade policy build` makes). STOCKADE_POLICY__BUNDLE sets it to the bundle.
    dir: Path = Field(default_factory=_shipped_policies)
    # A signed bundle to load instead of the directory. Set, it replaces `dir` (so the watcher,
    # the engines and every `--dir` override see one source); a replaced file is hot-reloaded.
    bundle: Path | None = None
    # The public key (PEM: Ed25519, RSA or EC, as OPA's `keys` take) bundles must be signed with.
    # Set: only a bundle signed with it loads (an unsigned, badly signed or altered bundle is
    # refused, and so is a directory, which carries no signature). Unset: a signed bundle is
    # refused too, as OPA does: its signature could not be checked.
    bundle_public_key: Path | None = None
    entrypoint: str = "data.stockade.decision"
    # A running control plane checks the policy files this often and reloads on change (0: never).
    watch_interval_s: float = Field(default=2.0, ge=0)
    # regorus has no evaluation timeout: bound what it is given instead.
    max_policy_bytes: int = 1 << 20
    max_input_bytes: int = 2 << 20
    opa_url: str = "http://127.0.0.1:8181"
    opa_token: SecretStr | None = None
    # An OPA slower than this is a deny (policy.error), not a hung call.
    opa_timeout_s: float = Field(default=1.0, gt=0)
    # False: the OPA server loads this directory itself (mounted, `opa run --server --watch <dir>`,
    # as compose.yaml does) and the engine only asks it; the revision is that of this copy.
    opa_upload: bool = True

    @model_validator(mode="before")
    @classmethod
    def _bundle_is_the_source(cls, data: Any) -> Any:
        """With ``bundle`` set, ``dir`` names the bundle (the one thing every consumer loads)."""
        if isinstance(data, dict) and data.get("bundle"):
            return {**data, "dir": data["bundle"]}
        return data
