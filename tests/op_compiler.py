"""The ``c++`` that make test puts first on PATH while DeepSpeed JIT-builds its ops: three savings, two optional.

**No debug information** (``-g`` dropped from every command). GCC's debug information changes no instruction or data
of an object: measured with the CPU Adam op's flags (``-O3 -g -march=native -fopenmp``) on a 2-core AMD EPYC,
``cpu_adam.cpp`` compiled in 96 s of one core with ``-g`` and in 57 s without, its ``.text``, ``.rodata`` and
``.data`` byte for byte the same. The ops these sessions build are loaded, never stepped through in a debugger.

**Torch's extension header precompiled** (for an op of many sources: make test's ops session, tests/ops.py). Each
source includes that header, and it is most of the work: measured on a 2-core AMD EPYC with the async I/O op's flags
(``-O0``, ``-g`` dropped), a source holding only ``#include <torch/extension.h>`` took 46 s of one core, one of the
op's sources 45 s; with the precompiled header (80 s to make, once), each took 17 s, for an object of the same code. A
header GCC cannot use (other flags) is reported (``-Winvalid-pch``) and the source compiles from the header as before.

**Objects kept by what the compiler sees** (ops that make test builds more than once: the shared environment's, and
the same DeepSpeed's again from the GPU bundle's copy, in tests/offline/test_gpu_bundle.py). An object is looked up
by the compiler's version, the flags that shape code, and the source as preprocessed without line markers (``-E -P``:
the text the compiler compiles, 4 s for a source that includes torch's header against about 60 s to compile it with
``-O3``), its include folders named by their place in the command (torch's checks spell the folder a header was found
in, through ``__FILE__``). Any other text, flag or compiler is another object. The fused Adam op's
``cpu_adam_impl.cpp`` is CPU Adam's too, and the bundle's sources are the same files in another folder: each compiles
once. Measured on a 2-core AMD EPYC: fused Adam after CPU Adam in 64 s instead of about 2 minutes; the bundle's fused
Adam and shared-memory all-reduce in 13 s instead of about 4 minutes. (An object names the folders it was first
compiled from, in its checks' messages.)

Nothing else changes: ninja still records ``c++ ...`` (this script is named ``c++``), so a later load of the op in
another process, with the real compiler, finds it built; ``-MMD`` lists the same headers.

    with op_compiler(precompile_header=True): builder.load()
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
from collections.abc import Iterator
from pathlib import Path

HEADER = "torch/extension.h"
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
SOURCE_SUFFIXES = (".cpp", ".cc", ".cxx")
DEBUG_FLAGS = ("-g",)


REPO = Path(__file__).resolve().parent.parent
OBJECTS = REPO / ".nox/stack/op-objects"  # kept with the shared environment, gone when it is built again
VARIABLES = ("PATH", "OP_COMPILER_REAL", "OP_COMPILER_PCH", "OP_COMPILER_OBJECTS")


@contextlib.contextmanager
def op_compiler(precompile_header: bool = False, objects: Path | None = OBJECTS) -> Iterator[dict[str, str]]:
    """Within it, ``c++`` started from this process (ninja's compiles) is this script; yields the variables it set in
    ``os.environ`` (for a process started with an environment of its own)."""
    real = shutil.which("c++")
    if real is None:
        yield {}
        return
    with tempfile.TemporaryDirectory(prefix="op-compiler-") as tmp:
        wrapper = Path(tmp) / "bin/c++"
        wrapper.parent.mkdir()
        wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{REPO}" exec "{sys.executable}" -m tests.op_compiler "$@"\n')
        wrapper.chmod(0o755)
        saved = {name: os.environ.get(name) for name in VARIABLES}
        update = {"PATH": f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}", "OP_COMPILER_REAL": real}
        if precompile_header:
            update["OP_COMPILER_PCH"] = str(Path(tmp) / "pch")
        if objects is not None:
            update["OP_COMPILER_OBJECTS"] = str(objects)
        for name in set(VARIABLES) - set(update):
            os.environ.pop(name, None)
        os.environ.update(update)
        try:
            yield update
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


def option(args: list[str], name: str) -> str | None:
    """The value after ``name`` in ``args`` (``-o``, ``-MF``), or None."""
    return next((args[i + 1] for i, arg in enumerate(args[:-1]) if arg == name), None)


def code_flags(flags: list[str]) -> list[str]:
    """``flags`` less those whose whole effect is on the preprocessed text (folders, macros)."""
    kept, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in ("-I", "-isystem", "-iquote", "-include", "-D", "-U"):
            skip = True
        elif not flag.startswith(("-I", "-D", "-U", "-isystem", "-iquote")):
            kept.append(flag)
    return kept


def object_key(real: str, args: list[str]) -> str | None:
    """The key of the object a ``-c`` command makes (see the module's note), writing its dependency file on the way
    (``-MMD -MF``, as the compile would); None for any other command, or a source that does not preprocess."""
    if "-c" not in args:
        return None
    flags, source = split_compile(args)
    out, depfile = option(args, "-o"), option(args, "-MF")
    if source is None or out is None:
        return None
    deps = ["-MMD", "-MF", depfile, "-MT", out] if depfile and "-MMD" in args else []
    text = subprocess.run([real, *flags, *deps, "-E", "-P", str(source)], capture_output=True)
    if text.returncode != 0:
        return None
    version = subprocess.run([real, "--version"], capture_output=True).stdout
    digest = hashlib.sha256(version + "\0".join(code_flags(flags)).encode() + b"\0" + unplaced(text.stdout, flags,
                                                                                                source))
    return digest.hexdigest()[:32]


def unplaced(text: bytes, flags: list[str], source: Path) -> bytes:
    """Preprocessed ``text`` with its include folders and the source's folder named by their place in the command:
    ``__FILE__`` in torch's inline functions spells the folder a header was found in."""
    folders = [flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag in ("-I", "-isystem", "-iquote")]
    folders += [flag[2:] for flag in flags if flag.startswith("-I") and len(flag) > 2] + [str(source.parent)]
    for n, folder in sorted(enumerate(folders), key=lambda pair: -len(pair[1])):
        text = text.replace(folder.encode(), f"<folder {n}>".encode())
    return text


def without_debug_information(args: list[str]) -> list[str]:
    """``args`` less ``-g``: the same instructions and data, without the debug sections (see the module's note)."""
    return [arg for arg in args if arg not in DEBUG_FLAGS]


def main(args: list[str]) -> None:
    real = os.environ["OP_COMPILER_REAL"]
    args = without_debug_information(args)
    pch, objects = os.environ.get("OP_COMPILER_PCH"), os.environ.get("OP_COMPILER_OBJECTS")
    key = object_key(real, args) if objects else None
    kept, out = (Path(objects) / f"{key}.o", option(args, "-o")) if key else (None, None)
    if kept is not None and kept.is_file():  # compiled before: the same object
        shutil.copyfile(kept, out)
        return
    command = with_precompiled_header(real, args, Path(pch)) if pch else args
    if kept is None:
        os.execv(real, [real, *command])
    compiled = subprocess.run([real, *command])
    if compiled.returncode == 0 and Path(out).is_file():
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_name(f"{key}.{os.getpid()}.partial")
        shutil.copyfile(out, partial)
        os.replace(partial, kept)
    sys.exit(compiled.returncode)


if __name__ == "__main__":
    main(sys.argv[1:])
