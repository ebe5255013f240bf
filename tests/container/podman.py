"""Podman for the image tests: installed if missing (Debian, root), configured for this kind of host,
and a Debian base image standing in for the CUDA base, pinned by its digest like the real one.

Settings (cgroupfs, runc, the host network, open-file limits root may set here) live in files under
``.nox/podman``, passed through ``CONTAINERS_CONF``/``CONTAINERS_STORAGE_CONF``; nothing of the host's
own container configuration is touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from tests.harness import REPO, ensure_debian_packages

HOME = REPO / ".nox/podman"
PACKAGES = ("debootstrap", "podman", "buildah", "uidmap", "catatonit", "runc")
TEST_BASE = "localhost/finetune-kit-test-base:bookworm"
BUILD_TIMEOUT_S = 1500  # buildah can hang on some mounts: a build never waits forever

CONTAINERS_CONF = """\
[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
runtime = "runc"
[containers]
netns = "host"
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
"""


def environment() -> dict[str, str]:
    """Install podman when it is missing, write its settings, and return the environment that uses them."""
    ensure_debian_packages(*PACKAGES, present="podman")
    for folder in ("storage", "run", "tmp"):
        (HOME / folder).mkdir(parents=True, exist_ok=True)
    (HOME / "containers.conf").write_text(CONTAINERS_CONF)
    (HOME / "storage.conf").write_text(
        f'[storage]\ndriver = "overlay"\ngraphroot = "{HOME / "storage"}"\nrunroot = "{HOME / "run"}"\n')
    return {**os.environ, "CONTAINERS_CONF": str(HOME / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(HOME / "storage.conf"), "TMPDIR": str(HOME / "tmp")}


def podman(env: dict, *args: str, timeout: int = 600, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["podman", *args], env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-6000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def debian_base(env: dict) -> tuple[str, str]:
    """(name, digest) of a minimal Debian bookworm image (its python3 is 3.11, the Python the lock is
    resolved on), made with debootstrap once and kept in .nox/podman."""
    found = podman(env, "images", "--format", "{{.Digest}}", TEST_BASE).stdout.split()
    if not found:
        rootfs, tarball = HOME / "rootfs", HOME / "debian-bookworm.tar"
        if not tarball.is_file():
            shutil.rmtree(rootfs, ignore_errors=True)
            subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs),
                            "http://deb.debian.org/debian"], check=True, capture_output=True, timeout=900)
            subprocess.run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(tarball), "."], check=True)
            shutil.rmtree(rootfs)
        podman(env, "import", "--change", 'CMD ["/bin/bash"]', str(tarball), TEST_BASE)
        found = podman(env, "images", "--format", "{{.Digest}}", TEST_BASE).stdout.split()
    return TEST_BASE, found[0]


def build(env: dict, dockerfile: str, tag: str, **build_args: str) -> subprocess.CompletedProcess:
    """``podman build`` from the repository root, never pulling and on the host network; the docker
    format keeps the Dockerfile's SHELL (OCI images drop it)."""
    args = [arg for key, value in build_args.items() for arg in ("--build-arg", f"{key}={value}")]
    return podman(env, "build", "--format", "docker", "--pull=never", "--network", "host", "-f", dockerfile,
                  *args, "-t", tag, str(REPO), timeout=BUILD_TIMEOUT_S)
