"""py-cpuinfo's answer about this machine's CPU, asked once per boot rather than at every op DeepSpeed loads.

DeepSpeed's CPU op builders ask py-cpuinfo for the architecture and the vector width at each op they load (the
shared-memory collectives, fused Adam, CPU Adam), and py-cpuinfo answers each question from a new Python process:
1.2 s a question on a 2-core EPYC, two an op, in every rank of every CPU launch. The answer cannot change before
the machine restarts. :func:`keep` makes ``cpuinfo.get_cpu_info`` answer with this process's first answer, which
it also keeps in ``$FINETUNE_CACHE_DIR/cpuinfo/`` (default ``~/.cache/finetune_kit``) under the machine's name and
boot id: later launches on the machine start no process for it. A folder it cannot write costs only the saving.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path

from finetune_kit import caches

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def kept_file(version: str) -> Path | None:
    """Where this boot's answer is kept; None where the boot cannot be told (not Linux)."""
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:
        return None
    return caches.root() / "cpuinfo" / f"{os.uname().nodename}-{boot}-py-cpuinfo-{version}.json"


def keep() -> None:
    """From now on in this process, ``cpuinfo.get_cpu_info()`` returns the kept answer (nothing without
    py-cpuinfo; once is enough). DeepSpeed's builders import the function from the module at each call."""
    try:
        import cpuinfo
    except ImportError:
        return
    if getattr(cpuinfo.get_cpu_info, "kept", False):
        return
    ask, path = cpuinfo.get_cpu_info, kept_file(getattr(cpuinfo, "CPUINFO_VERSION_STRING", "unknown"))

    @functools.cache
    def answer() -> dict:
        if path is not None:
            try:
                return json.loads(path.read_text())
            except (OSError, ValueError):  # not kept yet, unreadable, or half a file from another era
                pass
        info = ask()
        if path is not None and info:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
                    json.dump(info, f)
                os.replace(f.name, path)  # whole or not at all, whichever rank writes last
            except OSError:
                pass
        return info

    answer.kept = True
    cpuinfo.get_cpu_info = answer
