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
from pathlib import Path

from tests.debian import ensure_debian_packages

REPO = Path(__file__).resolve().parents[2]

HOME = REPO / ".nox/podman"
PACKAGES = ("debootstrap", "podman", "buildah", "uidmap", "catatonit", "runc")
TEST_BASE = "localhost/finetune-kit-test-base:bookworm"
# buildah can hang on some mounts: a build never waits forever. make test builds the images ahead at the lowest
# CPU and disk priority beside two lanes of tests: on a 2-core AMD EPYC the base image's build alone went past 25
# minutes there, and fetching its wheelhouse past 15. Every step of it (debootstrap, the wheelhouse, each build)
# has this long.
BUILD_TIMEOUT_S = 3600

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
                            "http://deb.debian.org/debian"], check=True, capture_output=True,
                           timeout=BUILD_TIMEOUT_S)
            subprocess.run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(tarball), "."], check=True)
            shutil.rmtree(rootfs)
        podman(env, "import", "--change", 'CMD ["/bin/bash"]', str(tarball), TEST_BASE, timeout=BUILD_TIMEOUT_S)
        found = podman(env, "images", "--format", "{{.Digest}}", TEST_BASE).stdout.split()
    return TEST_BASE, found[0]


def build(env: dict, dockerfile: str, tag: str, **build_args: str) -> str:
    """``podman build`` from the repository root, never pulling and on the host network; the docker
    format keeps the Dockerfile's SHELL (OCI images drop it). Returns the log of the build that made
    the image: podman's layer cache makes a repeated build of unchanged files instant (make test
    builds the images in the background first), so the log of the build whose steps ran is kept under
    .nox/podman/build-logs, by image ID, and returned for a build served from the cache."""
    args = [arg for key, value in build_args.items() for arg in ("--build-arg", f"{key}={value}")]
    command = ["build", "--format", "docker", "--pull=never", "--network", "host", "-f", dockerfile, *args, "-t", tag,
               # the lowest CPU share: each RUN step runs in a cgroup of its own, which the nice value make test gives
               # its background build does not reach (measured: a RUN step took as much of the CPU as a test
               # session's process, at nice 19); with it, the steps run on the CPU the sessions leave idle
               "--cpu-shares", "2"]
    proc = podman(env, *command, str(REPO), timeout=BUILD_TIMEOUT_S)
    logs = HOME / "build-logs"
    logs.mkdir(exist_ok=True)
    kept = logs / f"{podman(env, 'images', '--no-trunc', '--format', '{{.ID}}', tag).stdout.split()[0]}.log"
    output = proc.stdout + proc.stderr
    if ran_a_step(output):
        kept.write_text(output)
    elif not kept.is_file():  # made by a build whose log is gone: build it again, every step
        proc = podman(env, *command, "--no-cache", str(REPO), timeout=BUILD_TIMEOUT_S)
        output = proc.stdout + proc.stderr
        kept = logs / f"{podman(env, 'images', '--no-trunc', '--format', '{{.ID}}', tag).stdout.split()[0]}.log"
        kept.write_text(output)
    return kept.read_text()


def ran_a_step(build_log: str) -> bool:
    """Whether a ``podman build`` ran any RUN, COPY or ADD step, rather than taking each from its cache."""
    steps = ("\n" + build_log).split("\nSTEP ")[1:]
    return any(step.split(":", 1)[1].split(maxsplit=1)[0] in ("RUN", "COPY", "ADD") and "--> Using cache" not in step
               for step in steps)
