"""Which pinned packages a GPU host lacks: the contents of the offline bundle for that host.

    python -m finetune_tools.gpu_check.bundle --have host-freeze.txt     # `pip list --format=freeze` there
    python -m finetune_tools.gpu_check.bundle --host-python /path/to/python
    python -m finetune_tools.gpu_check.bundle --have host-freeze.txt --extra eval --also liger-kernel==0.8.5

Prints one ``name==version`` line per package to carry (the versions pinned in
docker/requirements.txt) and, on stderr, why each is carried. Run it with a Python that has the
pinned stack installed (the nox stack, the Makefile's .venv): the requirements of each carried
package are read from its installed metadata, so the walk needs no index.

A package is carried when the recipes need it (the kit's own dependencies in pyproject.toml,
then what each carried package requires, for Linux x86-64 and the host's Python) and the host
either lacks it or has a version that is older than the pin (the kit's direct dependencies) or
outside what the requiring package accepts (everything else). torch and its CUDA libraries are
never carried: the host's own CUDA build is the point; a host without torch is an error.
``--extra eval`` adds an optional-dependency group of pyproject.toml (lm-eval for ``make eval``) to the
roots; ``--also NAME==VERSION`` carries a package docker/requirements.txt does not pin (liger-kernel, a CUDA-only
kernel library) at that version, without walking its requirements (they must be on the host).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import Version

from finetune_kit import command_line
from finetune_kit.metering.run_record import normalise, read_pins

HOST_OWN = ("torch", "triton")  # with every nvidia-* library: the host's CUDA build, never replaced
# the libraries whose features the recipes call: older than the pin is too old; the kit's other
# dependencies (tokenizers, safetensors, tqdm) only have to be there, at a version their users accept
EXACT = ("deepspeed", "transformers", "accelerate", "peft", "bitsandbytes", "datasets", "pydantic")


def host_owns(name: str) -> bool:
    return name in HOST_OWN or name.startswith("nvidia-")


def read_roots(pyproject: Path, extras: tuple[str, ...] = ()) -> dict[str, str]:
    """The kit's dependencies, then those of each optional-dependency group in ``extras``: name -> why."""
    import tomllib

    project = tomllib.loads(pyproject.read_text())["project"]
    groups = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in groups]
    if unknown:
        raise SystemExit(f"error: --extra {', '.join(unknown)}: pyproject.toml's optional groups are {sorted(groups)}")
    roots = {normalise(Requirement(d).name): "the kit needs it" for d in project["dependencies"]}
    for extra in extras:
        for d in groups[extra]:
            roots.setdefault(normalise(Requirement(d).name), f"the kit's [{extra}] extra")
    return roots


def parse_freeze(text: str) -> dict[str, str]:
    """``name==version`` lines (pip list --format=freeze, pip freeze); a bare ``name`` is a package
    whose version is not known (taken to do); comments and options are ignored."""
    out = {}
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if not line or line.startswith("-"):
            continue
        name, _, version = line.partition("==")
        if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name.strip()):
            out[normalise(name.strip())] = version.strip()
    return out


def ask_python(python: str) -> dict[str, str]:
    code = ("import importlib.metadata as m, json, sys; "
            "print(json.dumps({'python': '%d.%d.%d' % sys.version_info[:3], "
            "'packages': {d.metadata['Name']: d.version for d in m.distributions()}}))")
    answer = json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)
    return {"python": answer["python"], **{normalise(k): v for k, v in answer["packages"].items() if k}}


def target_environment(python_version: str) -> dict[str, str]:
    env = default_environment()
    major_minor = ".".join(python_version.split(".")[:2])
    env.update(python_version=major_minor, python_full_version=python_version if python_version.count(".") == 2
               else f"{major_minor}.0", sys_platform="linux", platform_system="Linux", platform_machine="x86_64",
               os_name="posix", implementation_name="cpython", platform_python_implementation="CPython")
    return env


def requirements_of(name: str, env: dict[str, str]) -> list[Requirement]:
    """What the pinned ``name`` (installed where this runs) requires on the target, extras left out."""
    try:
        declared = metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        raise SystemExit(f"error: {name} is not installed in this Python ({sys.executable}); run this module "
                         "with the pinned stack (the nox stack or the Makefile's .venv)") from None
    out = []
    for line in declared:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
            out.append(req)
    return out


def plan(host: dict[str, str], pins: dict[str, str], roots: list[str] | dict[str, str],
         python_version: str) -> list[dict]:
    """The packages to carry, each ``{"name", "version", "why"}``, in the order the walk found them;
    ``roots``: names, or names with why each is needed."""
    if "torch" not in host:
        raise SystemExit("error: the host has no torch; this bundle carries only what a host with its own CUDA "
                         "build of torch lacks (install torch there, or use the full wheelhouse: make wheelhouse)")
    from packaging.specifiers import SpecifierSet

    env = target_environment(python_version)
    carry: dict[str, dict] = {}
    reasons = roots if isinstance(roots, dict) else dict.fromkeys(roots, "the kit needs it")
    queue = [(root, None if root in EXACT else SpecifierSet(), why) for root, why in reasons.items()]
    while queue:
        name, spec, needed_by = queue.pop(0)
        if name in carry or host_owns(name):
            continue
        have = host.get(name)
        pin = pins.get(name)
        if pin is None:
            raise SystemExit(f"error: {name} ({needed_by}) is not pinned in docker/requirements.txt")
        if have == "" and name not in EXACT:
            continue  # there, version not stated: taken to do
        if have is None:
            why = f"missing ({needed_by})"
        elif have == "":
            why = f"version not stated; the recipes need {pin}"
        elif spec is None and Version(have) < Version(pin):
            why = f"{have} is older than the pinned {pin}"
        elif spec is not None and not spec.contains(Version(have), prereleases=True):
            why = f"{have} is outside {needed_by}"
        else:
            continue
        carry[name] = {"name": name, "version": pin, "why": why}
        for req in requirements_of(name, env):
            queue.append((normalise(req.name), req.specifier, f"{name} {pin} needs {req.name}{req.specifier}"))
    return list(carry.values())


def main(argv=None) -> int:
    from finetune_tools.paths import find_root

    root = find_root(None)
    p = command_line.ArgumentParser(prog="python -m finetune_tools.gpu_check.bundle",
                                    description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--have", type=Path, help="the host's `pip list --format=freeze` output")
    where.add_argument("--host-python", help="the host's Python, to ask for its packages")
    p.add_argument("--python", default=None, help="the host's Python version X.Y[.Z] (default: asked, or 3.12)")
    p.add_argument("--requirements", type=Path, default=root / "docker/requirements.txt")
    p.add_argument("--pyproject", type=Path, default=root / "pyproject.toml")
    p.add_argument("--extra", action="append", default=[], help="an optional-dependency group to carry too (eval)")
    p.add_argument("--also", action="append", default=[], type=Requirement,
                   help="NAME==VERSION of a package docker/requirements.txt does not pin, carried as is "
                        "(liger-kernel==0.8.5)")
    args = p.parse_args(argv)
    loose = [str(r) for r in args.also if len(r.specifier) != 1 or next(iter(r.specifier)).operator != "=="]
    if loose:
        p.error(f"--also {', '.join(loose)}: give one exact version, NAME==VERSION")
    host = ask_python(args.host_python) if args.host_python else parse_freeze(args.have.read_text())
    python_version = args.python or host.pop("python", None) or "3.12"
    host.pop("python", None)
    chosen = plan(host, read_pins(args.requirements), read_roots(args.pyproject, tuple(args.extra)), python_version)
    for req in args.also:
        name, version = normalise(req.name), next(iter(req.specifier)).version
        if name not in {c["name"] for c in chosen} and host.get(name) != version:
            chosen.append({"name": name, "version": version,
                           "why": "asked for (--also; not in docker/requirements.txt, its requirements not walked)"})
    for item in chosen:
        print(f"{item['name']}=={item['version']}")
        print(f"carry {item['name']} {item['version']}: {item['why']}", file=sys.stderr)
    print(f"{len(chosen)} package(s) to carry for Python {python_version}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
