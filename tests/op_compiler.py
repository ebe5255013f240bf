"""The ``c++`` that make test's ops session (tests/ops.py) puts first on PATH while DeepSpeed JIT-builds an op of many
sources: torch's extension header, which each of them includes, compiled once into a GCC precompiled header and
forced into each source that includes it.

That header is most of the work: measured on a 2-core AMD EPYC with the async I/O op's flags (``-O0 -g``), a source
holding only ``#include <torch/extension.h>`` took 43 s of one core, one of the op's sources 44 s; with the
precompiled header (51 s to make, once), that source took 14 s, for an object of the same code. Nothing else
changes: ninja still records ``c++ ...`` (this script is named ``c++``), so a later load of the op in another
process, with the real compiler, finds it built; ``-MMD`` lists the same headers; a header GCC cannot use (other
flags) is reported (``-Winvalid-pch``) and the source compiles from the header as before.

    with precompiled_torch_header(): builder.load()
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HEADER = "torch/extension.h"
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
SOURCE_SUFFIXES = (".cpp", ".cc", ".cxx")


@contextlib.contextmanager
def precompiled_torch_header():
    """Within it, ``c++`` started from this process (ninja's compiles) is this script."""
    real = shutil.which("c++")
    if real is None:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="op-compiler-") as tmp:
        wrapper = Path(tmp) / "bin/c++"
        wrapper.parent.mkdir()
        repo = Path(__file__).resolve().parent.parent
        wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{repo}" exec "{sys.executable}" -m tests.op_compiler "$@"\n')
        wrapper.chmod(0o755)
        saved = {name: os.environ.get(name) for name in ("PATH", "OP_COMPILER_REAL", "OP_COMPILER_PCH")}
        os.environ.update(PATH=f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}", OP_COMPILER_REAL=real,
                          OP_COMPILER_PCH=str(Path(tmp) / "pch"))
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def split_compile(args: list[str]) -> tuple[list[str], Path | None]:
    """A ``-c`` command's flags without its source, output and dependency file, and its source."""
    flags, source, skip = [], None, False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("-o", "-MF"):
            skip = True
        elif arg not in ("-c", "-MMD"):
            if not arg.startswith("-") and arg.endswith(SOURCE_SUFFIXES):
                source = Path(arg)
            else:
                flags.append(arg)
    return flags, source


def includes(source: Path, header: str, folders: list[Path], depth: int = 4) -> bool:
    """Whether ``source`` includes ``header``, itself or through the headers it includes from ``folders``."""
    seen, todo = set(), [(source, 0)]
    while todo:
        path, level = todo.pop()
        if path in seen or level > depth:
            continue
        seen.add(path)
        try:
            names = INCLUDE.findall(path.read_text(errors="replace"))
        except OSError:
            continue
        if header in names:
            return True
        for name in names:
            found = next((folder / name for folder in (path.parent, *folders) if (folder / name).is_file()), None)
            if found is not None:
                todo.append((found, level + 1))
    return False


def with_precompiled_header(real: str, args: list[str], store: Path) -> list[str]:
    """``args`` with torch's header precompiled for their flags (made once, under a lock) and forced in first;
    ``args`` unchanged for a command that is not such a compile or whose header cannot be made."""
    if "-c" not in args:
        return args
    flags, source = split_compile(args)
    system = [Path(flags[i + 1]) for i, flag in enumerate(flags[:-1]) if flag == "-isystem"]
    header = next((folder / HEADER for folder in system if (folder / HEADER).is_file()), None)
    local = [Path(flag[2:]) for flag in flags if flag.startswith("-I") and len(flag) > 2]
    if source is None or header is None or not includes(source, HEADER, local):
        return args
    pch = store / hashlib.sha256("\0".join(flags).encode()).hexdigest()[:16]
    made = pch / f"{HEADER}.gch"
    made.parent.mkdir(parents=True, exist_ok=True)
    with (pch / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ninja compiles side by side: one makes it, the other waits
        if not made.is_file():
            partial = made.with_name("extension.h.gch.partial")
            made_it = subprocess.run([real, *flags, "-x", "c++-header", str(header), "-o", str(partial)],
                                     capture_output=True, text=True)  # GCC says the header's #pragma once is odd
            if made_it.returncode != 0:
                print(f"torch's header not precompiled, compiled without: {made_it.stderr[-2000:]}", file=sys.stderr)
                return args
            (pch / HEADER).unlink(missing_ok=True)
            (pch / HEADER).symlink_to(header)  # where the source's own #include of it resolves: once only
            os.replace(partial, made)
    return [*args, "-I", str(pch), "-include", HEADER, "-Winvalid-pch"]


def main(args: list[str]) -> None:
    real = os.environ["OP_COMPILER_REAL"]
    os.execv(real, [real, *with_precompiled_header(real, args, Path(os.environ["OP_COMPILER_PCH"]))])


if __name__ == "__main__":
    main(sys.argv[1:])
