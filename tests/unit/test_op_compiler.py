"""The ops session's ``c++`` (tests/op_compiler.py): torch's header precompiled once per set of flags and forced into
the sources that include it, and every other command passed through unchanged. A stand-in compiler records what it
is asked; the real one runs in make test's ops session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.harness import REPO
from tests.op_compiler import HEADER, includes, precompiled_torch_header, split_compile, with_precompiled_header

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
        with precompiled_torch_header():
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
