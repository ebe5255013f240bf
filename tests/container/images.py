"""The two images the container tests use, built from the repository as it is: the base
(docker/Dockerfile on a Debian base standing in for the CUDA one, from a wheelhouse of the CPU lock)
and the 8B recipe's image on top.

``python -m tests.container.images`` builds them ahead: ``make test`` runs it in the background from its start, at
the lowest CPU and disk priority, with nox's own Python (this module and podman's need only the standard library);
the image session's builds then come from podman's layer cache, with the log of the build that ran
(:func:`tests.container.podman.build`).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import time

from tests.container import podman as pm
from tests.container.podman import REPO

LOCK = "docker/requirements-cpu.lock"
WHEELHOUSE = ".nox/image-wheelhouse"  # inside the build context (.dockerignore lets it through)
BASE, RECIPE = "localhost/finetune-kit-base:ci", "localhost/llama3-8b-zero3:ci"


def wheelhouse() -> str:
    """The CPU lock's files for this platform, each checked against its hash; fetched again only
    when the lock changes."""
    house, stamp = REPO / WHEELHOUSE, REPO / WHEELHOUSE / ".lock.sha256"
    digest = hashlib.sha256((REPO / LOCK).read_bytes()).hexdigest()
    if not stamp.is_file() or stamp.read_text() != digest:
        shutil.rmtree(house, ignore_errors=True)
        subprocess.run(["bash", "docker/build-wheelhouse.sh", "--lock", LOCK, str(house)], cwd=REPO, check=True,
                       timeout=pm.BUILD_TIMEOUT_S)
        stamp.write_text(digest)
    return WHEELHOUSE


def base(env: dict) -> dict:
    """The base image: its stand-in base's name and digest, and the log of the build that made it."""
    name, digest = pm.debian_base(env)
    log = pm.build(env, "docker/Dockerfile", BASE, BASE_NAME=name, BASE_DIGEST=digest, LOCK=LOCK,
                   WHEELHOUSE=wheelhouse(), DS_ACCELERATOR="cpu", VERSION="ci")
    return {"name": name, "digest": digest, "log": log}


def recipe_image(env: dict) -> str:
    pm.build(env, "recipes/llama3-8b-zero3/Dockerfile", RECIPE, BASE_IMAGE=BASE)
    return RECIPE


if __name__ == "__main__":
    start = time.monotonic()
    environment = pm.environment()
    base(environment)
    recipe_image(environment)
    print(f"images {BASE} and {RECIPE} built in {time.monotonic() - start:.0f} s")
