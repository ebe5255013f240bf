"""DeepSpeed's JIT ops the test sessions load on CPU, compiled into the shared environment's cache ahead of use.

``python -m tests.ops`` (the nox session ``ops``) loads each op in the order the sessions first need them: CPU
and fused Adam (the unit tests), the shared-memory all-reduce (every DeepSpeed launch on CPU), async I/O and
pinned memory (ZeRO-Infinity's NVMe session); ``python -m tests.ops NAME ...``, those ops in that order (make
test-quick: the shared-memory all-reduce and fused Adam first, which its first launch loads). ``make test`` runs it
in the background from when the environment exists, so the compiles use the CPU the sessions leave idle: measured
on a 2-core AMD EPYC, async I/O and pinned memory alone took 6.5 minutes inside the NVMe session's first launch
(async I/O's nine sources that include torch's extension header compile it once here: :mod:`tests.op_compiler`).
A rank that loads an op while this compiles it waits on the cache's lock and then loads the built op: nothing
compiles twice. An op that fails to build here is reported and left to the session that needs it (which then builds
it, and fails there if it cannot).
"""

from __future__ import annotations

import sys
import time

from tests.debian import ensure_debian_packages
from tests.op_compiler import OBJECTS, op_compiler

# builder class names, in the order make test's sessions first load them
OPS = ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder", "AsyncIOBuilder", "PinMemoryBuilder")
# the ops of many sources that include torch's extension header: built with it precompiled (tests/op_compiler.py)
PRECOMPILED = ("AsyncIOBuilder",)
# the ops whose objects are kept by content (tests/op_compiler.py): fused Adam compiles CPU Adam's cpu_adam_impl.cpp
# again, and the GPU bundle's rehearsal builds fused Adam and the shared-memory all-reduce from its own DeepSpeed
KEPT = ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder")


def main(names: tuple[str, ...] = OPS) -> int:
    from deepspeed.accelerator import get_accelerator

    unknown = sorted(set(names) - set(OPS))
    if unknown:
        print(f"tests.ops: unknown op builder(s) {unknown}; known: {', '.join(OPS)}", file=sys.stderr)
        return 2
    failed = []
    for name in names:
        start = time.monotonic()
        try:
            if name == "AsyncIOBuilder":  # its headers, as the NVMe session installs them
                ensure_debian_packages("libaio-dev", present="/usr/include/libaio.h")
            builder = get_accelerator().create_op_builder(name)
            if builder is None or not builder.is_compatible(verbose=False):
                print(f"{name}: not built (no such op on this accelerator, or not compatible here)", flush=True)
                continue
            with op_compiler(precompile_header=name in PRECOMPILED, objects=OBJECTS if name in KEPT else None):
                builder.load(verbose=False)
            print(f"{name}: ready in {time.monotonic() - start:.0f} s", flush=True)
        except Exception as err:  # the session that needs it builds it again and reports its own error
            failed.append(name)
            print(f"{name}: FAILED after {time.monotonic() - start:.0f} s: {err!r}", flush=True)
    print(f"DeepSpeed ops: {len(names) - len(failed)} of {len(names)} ready"
          + (f", failed: {failed}" if failed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(tuple(sys.argv[1:]) or OPS))
