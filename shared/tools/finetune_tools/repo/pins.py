"""Where the pinned versions are written, and whether they agree.

``docker/requirements.txt`` holds the pins, ``docker/requirements-cuda.txt`` those of the GPU images only.
``docker/requirements.lock`` (GPU: both) and ``requirements-cpu.lock`` (CPU: the first) are generated from them
by ``make lock`` with a sha256 for every file;
the Dockerfiles carry the versions in labels and pin their base by digest; noxfile.py installs the pins.
``problems(root)`` lists every disagreement, each naming the file, the value and the fix.
"""

from __future__ import annotations

import re
from pathlib import Path

from finetune_kit.metering.run_record import PIN, normalise, read_pins  # noqa: F401  (also this module's API)

LOCKS = ("docker/requirements.lock", "docker/requirements-cpu.lock")
CUDA_PINS = "docker/requirements-cuda.txt"  # locked into the GPU lock only
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
VERSION_LABEL = re.compile(r"finetune-kit\.([a-z0-9_-]+)=\"([^\"]+)\"")
SPELLED_VERSION = re.compile(r"[\"' ]([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][^\s\"',]*)")
FIX_LOCK = "run `make lock` and commit docker/*.lock"


def public(version: str) -> str:
    """``2.13.0+cpu`` -> ``2.13.0``: a local build of the pinned release satisfies the pin."""
    return version.split("+")[0]


def read_lock(path: Path) -> dict[str, dict]:
    """Each locked package: its version, its sha256 hashes and the packages it was pulled in by."""
    entries: dict[str, dict] = {}
    current = None
    for line in path.read_text().splitlines():
        if m := PIN.match(line):
            current = entries.setdefault(normalise(m[1]), {"version": m[2], "hashes": [], "via": []})
        elif current is not None and (h := re.search(r"--hash=sha256:([0-9a-f]{64})", line)):
            current["hashes"].append(h[1])
        elif current is not None and (v := re.match(r"\s+#\s+(?:via\s+)?(\S.*)$", line)):
            current["via"] += [normalise(v[1]) if not v[1].startswith("-r") else "-r"]
    return entries


def lock_problems(pins: dict[str, str], lock: dict[str, dict], name: str) -> list[str]:
    found = []
    for pkg, version in sorted(pins.items()):
        if pkg not in lock:
            found.append(f"{name}: {pkg}=={version} is pinned but not locked; {FIX_LOCK}")
        elif public(lock[pkg]["version"]) != version:
            found.append(f"{name}: {pkg} is locked at {lock[pkg]['version']} but pinned at {version}; {FIX_LOCK}")
    for pkg, entry in sorted(lock.items()):
        if not entry["hashes"]:
            found.append(f"{name}: {pkg}=={entry['version']} has no --hash, so --require-hashes refuses the "
                         f"lock; {FIX_LOCK}")
        if pkg not in pins and not [v for v in entry["via"] if v in lock]:
            found.append(f"{name}: {pkg}=={entry['version']} is neither pinned nor needed by a locked package; "
                         f"{FIX_LOCK}")
    return found


def dockerfile_problems(path: Path, pins: dict[str, str], name: str) -> list[str]:
    """Every FROM pinned by digest (directly, or through an ARG whose default is), except the
    project's own base image (``BASE_IMAGE``, built from docker/Dockerfile); version labels = pins."""
    text = path.read_text().replace("\\\n", " ")
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    found = []
    for image in re.findall(r"^FROM\s+(\S+)", text, re.M):
        if image == "${BASE_IMAGE}":
            continue
        resolved = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], m[0]), image)
        if not DIGEST.search(resolved):
            found.append(f"{name}: FROM {image} (= {resolved}) is not pinned by digest; write it as "
                         "name:tag@sha256:<digest> (or an ARG defaulting to that)")
    for lib, version in VERSION_LABEL.findall(text):
        if lib in pins and pins[lib] != version:
            found.append(f"{name}: label finetune-kit.{lib}=\"{version}\" but docker/requirements.txt pins "
                         f"{lib}=={pins[lib]}; change the label")
    return found


def spelled_version_problems(path: Path, pins: dict[str, str], name: str) -> list[str]:
    """``pkg==version`` written in code (noxfile.py) must be the pinned version."""
    return [f"{name}: {pkg}=={version} but docker/requirements*.txt pin {pins[normalise(pkg)]}; use the pin"
            for pkg, version in SPELLED_VERSION.findall(path.read_text())
            if normalise(pkg) in pins and pins[normalise(pkg)] != version]


def problems(root: Path) -> list[str]:
    pins = read_pins(root / "docker/requirements.txt")
    dev = read_pins(root / "docker/requirements-dev.txt")
    cuda = read_pins(root / CUDA_PINS)
    found = []
    for lock in LOCKS:
        if not (root / lock).is_file():
            found.append(f"{lock} is missing; {FIX_LOCK}")
            continue
        entries = read_lock(root / lock)
        found += lock_problems({**pins, **cuda} if lock == LOCKS[0] else pins, entries, lock)
        if lock != LOCKS[0]:
            found += [f"{lock}: {pkg} is pinned for the GPU images only ({CUDA_PINS}) but locked here; {FIX_LOCK}"
                      for pkg in sorted(set(cuda) & set(entries))]
    for dockerfile in sorted([root / "docker/Dockerfile", *root.glob("recipes/*/Dockerfile")]):
        found += dockerfile_problems(dockerfile, pins, str(dockerfile.relative_to(root)))
    found += spelled_version_problems(root / "noxfile.py", {**dev, **pins}, "noxfile.py")
    return found
