"""Settings owned by the policy package (composed into the router's settings)."""

from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr


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
    dir: Path = Field(default_factory=_shipped_policies)
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
