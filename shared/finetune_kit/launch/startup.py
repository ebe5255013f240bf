"""Start-up speed-ups for CPU launches: work that DeepSpeed and torch repeat at each launch and rank, done once.

They change no result, only how soon a launch trains; they matter most for the test suite's many short CPU launches,
where they were measured (a 2-core AMD EPYC, the 8B recipe's tiny model). :func:`speed_up` applies those that fit
the process; each is done once per process, and calling again costs nothing.

- py-cpuinfo's answer about the CPU, asked once per boot (:func:`keep_cpu_info`). DeepSpeed's CPU op builders ask
  py-cpuinfo for the architecture and the vector width at each op they load (the shared-memory collectives, fused
  Adam, CPU Adam), and py-cpuinfo answers each question from a new Python process: 1.2 s a question, two an op, in
  every rank of every CPU launch. The answer cannot change before the machine restarts: ``cpuinfo.get_cpu_info``
  answers with this process's first answer, also kept in ``$FINETUNE_CACHE_DIR/cpuinfo/`` (default
  ``~/.cache/finetune_kit``) under the machine's name and boot id, so later launches on the machine start no
  process for it. A folder it cannot write costs only the saving.
- The NUMA layout, read once per process (:func:`keep_numa_layout`). On a machine without GPUs, DeepSpeed's
  ``CPU_Accelerator.device_count()`` (deepspeed/accelerator/cpu_accelerator.py) counts NUMA nodes with
  ``deepspeed.utils.numa.get_numa_cores``, which runs ``numactl --hardware`` in a new process at each call (a fork
  of the whole rank, even where numactl is missing), unless the launcher set ``LOCAL_SIZE`` (only DeepSpeed's own
  does). ZeRO-3 asks at every reduce-scatter of gradients (``stage3.py``, ``__avg_scatter_grads``): 8% of a rank's
  time in the steps under ``accelerate launch``. The layout cannot change while the process lives: the function
  answers with its first answer.
- DeepSpeed's Muon module imported without ``torch.compile``'s set-up, for a run whose optimizer is not Muon
  (:func:`import_muon_uncompiled`; on GPUs too, where it costs nothing). Building a ZeRO engine, DeepSpeed checks
  the optimizer against the ones ZeRO supports and imports its Muon optimizer's module to list it
  (``deepspeed.runtime.zero.utils.is_zero_supported_optimizer``). That module wraps a function in ``torch.compile``
  as it is imported, and ``torch.compile`` then imports Inductor's compiler: a 4-step launch of the 8B recipe on 2
  CPU ranks took 41 CPU seconds, 35 to 36 with the import made here first (3 to 4 seconds less in all). Imported
  with TorchDynamo off (``TORCHDYNAMO_DISABLE=1``, for the import alone), Muon's function stays plain Python in this
  process: nothing else changes, and a run that trains with Muon keeps it compiled (nothing is imported there).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
from pathlib import Path

from finetune_kit import caches

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def speed_up(ds_config: dict | None = None) -> None:
    """The speed-ups that fit this process: with ``ds_config`` (a DeepSpeed launch, before its engine is built),
    DeepSpeed's Muon module imported uncompiled; on a machine without a CUDA GPU, py-cpuinfo's and the NUMA
    layout's first answers kept."""
    import torch

    if ds_config is not None:
        import_muon_uncompiled(ds_config)
    if not torch.cuda.is_available():
        keep_cpu_info()
        keep_numa_layout()


def kept_file(version: str) -> Path | None:
    """Where this boot's py-cpuinfo answer is kept; None where the boot cannot be told (not Linux)."""
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:
        return None
    return caches.root() / "cpuinfo" / f"{os.uname().nodename}-{boot}-py-cpuinfo-{version}.json"


def keep_cpu_info() -> None:
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


def keep_numa_layout() -> None:
    """From now on in this process, ``deepspeed.utils.numa.get_numa_cores()`` returns its first answer (nothing
    without DeepSpeed; once is enough). The accelerator imports the function from the module at each call."""
    try:
        from deepspeed.utils import numa
    except ImportError:
        return
    if not getattr(numa.get_numa_cores, "kept", False):
        ask = numa.get_numa_cores
        answer = functools.cache(lambda: ask())
        answer.kept = True
        numa.get_numa_cores = answer


def uses_muon(ds_config: dict) -> bool:
    """Whether the DeepSpeed config's optimizer is DeepSpeed's Muon (its type ``muon``, any case)."""
    return str((ds_config.get("optimizer") or {}).get("type", "")).lower() == "muon"


def import_muon_uncompiled(ds_config: dict) -> bool:
    """Import DeepSpeed's Muon module with TorchDynamo off, unless ``ds_config`` trains with Muon or it is already
    imported; returns whether this call imported it. The environment is as it was afterwards."""
    if uses_muon(ds_config) or MODULE in sys.modules:
        return False
    saved = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        __import__(MODULE)
    except ImportError:  # a DeepSpeed without Muon: nothing to import
        return False
    finally:
        if saved is None:
            os.environ.pop("TORCHDYNAMO_DISABLE", None)
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = saved
    return True
