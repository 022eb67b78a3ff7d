"""The default sandbox image, built locally: there is no registry on the machines stockade runs on.

``mmdebstrap --variant=essential`` writes a Debian root filesystem as a tar, which ``docker import``
turns into an image. The recipe (suite, variant, packages) is hashed: an image labelled with the
same recipe hash is reused, so the build runs once per machine. The image is also tagged with the
sha256 of the tar it was made from. Operators with their own image set ``STOCKADE_RUNNER__IMAGE``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import docker
import docker.errors

from runner.errors import SandboxUnavailable

REPOSITORY = "stockade-sandbox"
RECIPE = {
    "suite": "bookworm",
    "variant": "essential",
    # python3 for python tools and the resident worker, socat for the egress bridge,
    # ca-certificates so tools can verify TLS through the proxy.
    "packages": ["ca-certificates", "python3", "socat"],
    "user": "65534:65534",
}


def recipe_hash() -> str:
    return hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:16]


def default_image() -> str:
    """The tag of the image this version of stockade builds."""
    return f"{REPOSITORY}:recipe-{recipe_hash()}"


def image_present(client: docker.DockerClient, name: str) -> bool:
    try:
        client.images.get(name)
    except docker.errors.ImageNotFound:
        return False
    return True


def build_image(
    client: docker.DockerClient, *, force: bool = False, progress: Callable[[str], None] = lambda _: None
) -> str:
    """Build (or find) the default image; returns its recipe tag.

    Raises:
        SandboxUnavailable: mmdebstrap is missing or failed, or Docker refused the import.
    """
    tag = default_image()
    if not force and image_present(client, tag):
        progress(f"{tag} is already built")
        return tag
    mmdebstrap = shutil.which("mmdebstrap")
    if mmdebstrap is None:
        raise SandboxUnavailable("mmdebstrap not found: apt-get install mmdebstrap")
    with tempfile.TemporaryDirectory(prefix="stockade-image-", dir="/var/tmp") as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        progress(f"mmdebstrap {RECIPE['suite']} ({RECIPE['variant']}, {', '.join(RECIPE['packages'])})")
        done = subprocess.run(
            [mmdebstrap, "--quiet", f"--variant={RECIPE['variant']}", "--include=" + ",".join(RECIPE["packages"]),
             "--aptopt=Acquire::Retries \"3\"", str(RECIPE["suite"]), str(rootfs)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise SandboxUnavailable(f"mmdebstrap failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        digest = hashlib.sha256()
        with rootfs.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        content_tag = digest.hexdigest()[:16]
        progress(f"docker import as {REPOSITORY}:{content_tag}")
        changes = [f"USER {RECIPE['user']}", "WORKDIR /tmp", f"LABEL stockade.recipe={recipe_hash()}"]
        try:
            client.api.import_image_from_file(str(rootfs), repository=REPOSITORY, tag=content_tag, changes=changes)
            client.images.get(f"{REPOSITORY}:{content_tag}").tag(REPOSITORY, tag.split(":", 1)[1])
        except docker.errors.DockerException as exc:
            raise SandboxUnavailable(f"docker import failed: {exc}") from exc
    progress(f"built {tag} ({REPOSITORY}:{content_tag})")
    return tag


def build_default_image(
    docker_host: str | None, *, force: bool = False, progress: Callable[[str], None] = lambda _: None
) -> str:
    """`build_image` against the Docker engine at ``docker_host`` (None: the local socket).

    Raises:
        SandboxUnavailable: Docker is unreachable, or the build failed.
    """
    try:
        client = docker.DockerClient(base_url=docker_host)
        client.ping()
    except docker.errors.DockerException as exc:
        raise SandboxUnavailable(f"Docker engine unreachable ({exc}); start dockerd (scripts/services)") from exc
    try:
        return build_image(client, force=force, progress=progress)
    finally:
        client.close()
