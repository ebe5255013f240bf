"""Debian packages a session needs (podman, Slurm, Prometheus, libaio's headers), installed when missing.

Standard library only: the image build imports it before the shared environment exists (make test starts that
build first, beside the lint and environment sessions).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def ensure_debian_packages(*packages: str, present: Path | str) -> None:
    """apt-get install ``packages`` unless ``present`` (a file or a command they provide) is there;
    as root on Debian, as on this project's CI. Otherwise fail, naming the command to run."""
    if shutil.which(str(present)) or Path(present).exists():
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise RuntimeError(f"this test needs apt-get install {' '.join(packages)} (as root)")
    # another session may be installing beside this one: wait for dpkg's lock instead of failing on it
    wait = ["-o", "DPkg::Lock::Timeout=600"]
    install = ["apt-get", *wait, "install", "-y", "--no-install-recommends", *packages]
    if subprocess.run(install, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", *wait, "update"], check=True, capture_output=True)
        subprocess.run(install, check=True, capture_output=True)
