"""make test's ``c++`` for DeepSpeed's ops (tests/op_compiler.py): torch's header precompiled once per set of flags and
forced into the sources that include it, every other command passed through unchanged (a stand-in compiler records
what it is asked; the real one runs in make test's ops session); and objects kept by what the compiler sees (the
system's C++ compiler on small sources, through a recorder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.harness import REPO
from tests.op_compiler import HEADER, includes, op_compiler, split_compile, with_precompiled_header

RECORDER = """#!/bin/sh
printf '%s\\n' "$*" >> "{log}"
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
[ -n "$out" ] && : > "$out"
exit 0
"""


def op(tmp_path: Path) -> dict:
    """An op's folders: torch's headers (system), the op's own header including torch's, three sources."""
    torch_include, own = tmp_path / "torch/include", tmp_path / "op/include"
    (torch_include / "torch").mkdir(parents=True)
    (torch_include / HEADER).write_text("#pragma once\n")
    own.mkdir(parents=True)
    (own / "op.h").write_text("#include <vector>\n#include <torch/extension.h>\n")
    sources = {"direct": "#include <torch/extension.h>\n", "through": '#include "op.h"\nint f();\n',
               "plain": "#include <cmath>\n#include <vector>\n"}
    for name, text in sources.items():
        (tmp_path / f"op/{name}.cpp").write_text(text)
    real, log = tmp_path / "real-c++", tmp_path / "calls.log"
    real.write_text(RECORDER.format(log=log))
    real.chmod(0o755)
    flags = ["-DTORCH_EXTENSION_NAME=op", f"-I{own}", "-isystem", str(torch_include), "-O0", "-g"]
    return {"flags": flags, "real": str(real), "log": log, "dir": tmp_path / "op", "torch": torch_include}


def compile_command(o: dict, source: str) -> list[str]:
    return ["-MMD", "-MF", f"{source}.o.d", *o["flags"], "-c", str(o["dir"] / f"{source}.cpp"), "-o", f"{source}.o"]


def test_the_header_is_made_once_per_set_of_flags_and_forced_into_the_sources_that_include_it(tmp_path):
    o = op(tmp_path)
    store = tmp_path / "pch"
    direct = with_precompiled_header(o["real"], compile_command(o, "direct"), store)
    through = with_precompiled_header(o["real"], compile_command(o, "through"), store)
    for args, source in ((direct, "direct"), (through, "through")):
        assert args[:len(compile_command(o, source))] == compile_command(o, source)  # ninja's command, then ours
        assert args[-5:-3] == ["-I", args[-4]] and args[-3:] == ["-include", HEADER, "-Winvalid-pch"]
    assert direct[-4] == through[-4]  # the same flags: one header for both
    made = Path(direct[-4])
    assert (made / HEADER).resolve() == (o["torch"] / HEADER).resolve()  # the sources' own #include finds it once
    calls = o["log"].read_text().splitlines()
    assert len(calls) == 1 and "-x c++-header" in calls[0] and calls[0].endswith(f"-o {made / HEADER}.gch.partial")
    assert (made / f"{HEADER}.gch").is_file()
    other = with_precompiled_header(o["real"], [*compile_command(o, "direct"), "-O3"], store)
    assert Path(other[-4]) != made and len(o["log"].read_text().splitlines()) == 2  # other flags: another header


def test_other_commands_pass_through_unchanged(tmp_path):
    o = op(tmp_path)
    store = tmp_path / "pch"
    for args in (compile_command(o, "plain"),  # includes no torch header
                 ["-dumpfullversion", "-dumpversion"], ["-v"],  # torch's questions about the compiler
                 ["direct.o", "through.o", "-shared", "-o", "op.so"]):  # the link
        assert with_precompiled_header(o["real"], args, store) == args
    assert not o["log"].exists() and not store.exists()


def test_a_header_that_cannot_be_made_leaves_the_compile_as_it_was(tmp_path):
    o = op(tmp_path)
    failing = tmp_path / "failing-c++"
    failing.write_text("#!/bin/sh\nexit 1\n")
    failing.chmod(0o755)
    command = compile_command(o, "direct")
    assert with_precompiled_header(str(failing), command, tmp_path / "pch") == command


def test_includes_follows_the_ops_own_headers_only_as_deep_as_asked(tmp_path):
    o = op(tmp_path)
    own = [Path(o["flags"][1][2:])]
    assert includes(o["dir"] / "through.cpp", HEADER, own)
    assert not includes(o["dir"] / "through.cpp", HEADER, [])  # op.h is not beside the source
    assert not includes(o["dir"] / "through.cpp", HEADER, own, depth=0)
    assert split_compile(compile_command(o, "plain")) == (o["flags"], o["dir"] / "plain.cpp")


def test_within_the_context_c_plus_plus_on_path_is_the_wrapper_and_runs_the_real_compiler(tmp_path):
    o = op(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "c++").symlink_to(o["real"])
    before = dict(os.environ)
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    try:
        with op_compiler(precompile_header=True, objects=None):
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            subprocess.run(["c++", *compile_command(o, "through")], cwd=tmp_path, env=env, check=True)
            seen = json.loads(subprocess.run([sys.executable, "-c", "import os, json; print(json.dumps("
                                              "[os.environ['OP_COMPILER_REAL'], os.environ['PATH']]))"],
                                             env=env, capture_output=True, text=True, check=True).stdout)
        assert os.environ["PATH"] == f"{bin_dir}{os.pathsep}{before['PATH']}" and "OP_COMPILER_REAL" not in os.environ
    finally:
        os.environ.clear()
        os.environ.update(before)
    assert seen[0] == str(bin_dir / "c++") and seen[1].split(os.pathsep)[1] == str(bin_dir)
    calls = o["log"].read_text().splitlines()  # the header made, then the source compiled with it
    assert len(calls) == 2 and "-x c++-header" in calls[0] and calls[1].endswith(f"-include {HEADER} -Winvalid-pch")


SOURCE = """#include "lib.h"
int answer() { return check(%s); }
"""
LIB = """#pragma once
inline const char* where() { return __FILE__; }  // as torch's checks spell the folder a header came from
inline int check(int x) { return x > 0 ? x : (where()[0] == 'x'); }
"""


def installed(root: Path, value: str = "42") -> tuple[Path, Path]:
    """The same library and source (as two copies of one package would hold them) under ``root``."""
    (root / "include").mkdir(parents=True)
    (root / "include/lib.h").write_text(LIB)
    (root / "src").mkdir()
    (root / "src/answer.cpp").write_text(SOURCE % value)
    return root / "include", root / "src/answer.cpp"


def compile_with_objects(tmp_path: Path, include: Path, source: Path, build: Path, *flags: str) -> list[str]:
    """The wrapper as ninja runs it for one source, from ``build``, keeping objects in ``tmp_path/objects``; the
    recorded calls of the real compiler but for ``--version``."""
    log = tmp_path / "calls.log"
    recorder = tmp_path / "recording-c++"
    if not recorder.exists():
        recorder.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> "{log}"\nexec c++ "$@"\n')
        recorder.chmod(0o755)
    build.mkdir(parents=True, exist_ok=True)
    before = len(log.read_text().splitlines()) if log.exists() else 0
    env = {**os.environ, "PYTHONPATH": str(REPO), "OP_COMPILER_REAL": str(recorder),
           "OP_COMPILER_OBJECTS": str(tmp_path / "objects")}
    env.pop("OP_COMPILER_PCH", None)
    subprocess.run([sys.executable, "-m", "tests.op_compiler", "-MMD", "-MF", "answer.o.d", f"-I{include}",
                    "-DTORCH_EXTENSION_NAME=op", "-fPIC", *flags, "-c", str(source), "-o", "answer.o"],
                   cwd=build, env=env, check=True)
    return [call.split() for call in log.read_text().splitlines()[before:] if call != "--version"]


def test_the_same_source_in_another_folder_takes_the_object_compiled_before(tmp_path):
    first = installed(tmp_path / "stack")
    calls = compile_with_objects(tmp_path, *first, tmp_path / "build1", "-O2")
    assert [("-E" in c, "-c" in c) for c in calls] == [(True, False), (False, True)]
    assert len(list((tmp_path / "objects").glob("*.o"))) == 1
    second = installed(tmp_path / "host")  # the same files, another folder: __FILE__ spells another path
    calls = compile_with_objects(tmp_path, *second, tmp_path / "build2", "-O2")
    assert [("-E" in c, "-c" in c) for c in calls] == [(True, False)]  # preprocessed only: not compiled
    assert (tmp_path / "build2/answer.o").read_bytes() == (tmp_path / "build1/answer.o").read_bytes()
    depfile = (tmp_path / "build2/answer.o.d").read_text()  # as the compile writes it, for ninja
    assert depfile.startswith("answer.o:") and str(second[0] / "lib.h") in depfile


def test_other_code_or_other_flags_compile_again(tmp_path):
    """The negative controls: each changes what the object would hold, and each compiles."""
    include, source = installed(tmp_path / "stack")
    compile_with_objects(tmp_path, include, source, tmp_path / "build1", "-O2")
    changed = installed(tmp_path / "changed", value="43")
    for (inc, src), flags in (((include, source), ("-O0",)), (changed, ("-O2",)),
                              ((include, source), ("-O2", "-ffast-math"))):
        calls = compile_with_objects(tmp_path, inc, src, tmp_path / "build2", *flags)
        assert [("-E" in c, "-c" in c) for c in calls] == [(True, False), (False, True)], (flags, calls)
    assert len(list((tmp_path / "objects").glob("*.o"))) == 4


def sections(obj: Path) -> dict[str, bytes]:
    """An object's code and data sections, byte for byte, and the names of its debug sections."""
    out = {}
    for name in (".text", ".rodata", ".data"):
        dump = obj.with_name(f"{obj.name}{name}")
        subprocess.run(["objcopy", "-O", "binary", f"--only-section={name}", str(obj), str(dump)], check=True)
        out[name] = dump.read_bytes()
    headers = subprocess.run(["objdump", "-h", str(obj)], capture_output=True, text=True, check=True).stdout
    out["debug"] = sorted(set(line.split()[1] for line in headers.splitlines()
                              if len(line.split()) > 1 and line.split()[1].startswith(".debug")))
    return out


def test_debug_information_is_left_out_and_the_code_is_the_same(tmp_path):
    include, source = installed(tmp_path / "stack")
    calls = compile_with_objects(tmp_path, include, source, tmp_path / "build", "-O2", "-g")
    assert calls and all("-g" not in call for call in calls)
    subprocess.run(["c++", f"-I{include}", "-DTORCH_EXTENSION_NAME=op", "-fPIC", "-O2", "-g", "-c", str(source),
                    "-o", "debug.o"], cwd=tmp_path / "build", check=True)  # as DeepSpeed's flags ask
    wrapped, debug = sections(tmp_path / "build/answer.o"), sections(tmp_path / "build/debug.o")
    assert debug["debug"] and not wrapped["debug"]
    assert debug[".text"] and all(wrapped[name] == debug[name] for name in (".text", ".rodata", ".data"))
