"""Is this host ready for the GPU check? Every missing piece, listed at once, in seconds, before any model is built.

A GPU hour is lost when the check finds a missing compiler after the models are written, or a
launcher after the first case. :func:`problems` looks at everything the cases will need:

- the launchers the cases run (``accelerate``, ``deepspeed``) on PATH;
- the libraries the recipes import, each installed library's own requirements met by what is
  installed (an image's older pyarrow under a newer datasets, say), and the transformers features
  the recipes call (``activation_checkpointing_enable``, the Trainer's ``activation_checkpointing``);
- on a GPU, what DeepSpeed's JIT build of fused and CPU Adam needs: nvcc of torch's CUDA major
  release, the CUDA headers, ninja, a C++ compiler and Python's headers; bitsandbytes' CUDA library
  for the QLoRA case; and no other process holding GPU memory;
- free disk for the models not built yet.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import shutil
import sysconfig
from collections.abc import Iterable
from pathlib import Path

from finetune_kit.errors import ConfigError
from finetune_tools.gpu_check.cases import Case

LIBRARIES = ("torch", "transformers", "accelerate", "deepspeed", "peft", "datasets", "pydantic", "safetensors")
BUSY_GPU_GiB = 2.0  # more than this in use before the first case: another process holds the GPU


def requirement_problems(names: Iterable[str]) -> list[str]:
    """Installed libraries whose own declared requirements the installed versions do not meet."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    found = []
    for name in names:
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # reported as missing by library_problems
        for text in requires:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                found.append(f"{name} needs {req}, which is not installed")
                continue
            if req.specifier and not req.specifier.contains(Version(have), prereleases=True):
                found.append(f"{name} {metadata.version(name)} needs {req}; installed: {req.name} {have}")
    return found


def library_problems(cases: list[Case]) -> list[str]:
    names = list(LIBRARIES) + (["bitsandbytes"] if any(c.method == "qlora" for c in cases) else [])
    found = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:  # an import can fail with any error, not only ImportError
            found.append(f"{name} does not import: {type(err).__name__}: {err}")
    if found:
        return found
    import transformers
    from transformers import PreTrainedModel, TrainingArguments

    if not hasattr(PreTrainedModel, "activation_checkpointing_enable"):
        found.append(f"transformers {transformers.__version__} has no activation_checkpointing_enable "
                     "(the 8B and 70B recipes call it): install the pinned transformers")
    if any(c.trainer for c in cases) and "activation_checkpointing" not in TrainingArguments.__dataclass_fields__:
        found.append(f"transformers {transformers.__version__}'s TrainingArguments has no activation_checkpointing "
                     "(the 13B recipe sets it): install the pinned transformers")
    return found + requirement_problems(names)


def toolchain_problems(environ=os.environ) -> list[str]:
    """What DeepSpeed's JIT build of its CUDA ops needs."""
    import torch
    from deepspeed.ops.op_builder.builder import installed_cuda_version
    from torch.utils import cpp_extension

    from finetune_kit.launch.cuda_ops import check_nvcc

    found = []
    try:
        nvcc = "{}.{}".format(*installed_cuda_version())  # what DeepSpeed's build will read
    except Exception as err:  # DeepSpeed raises its own MissingCUDAException
        found.append(f"nvcc not found ({err}): set CUDA_HOME or put the CUDA toolkit's bin/ on PATH")
    else:
        try:
            check_nvcc(nvcc, torch.version.cuda, "fused_adam")
        except ConfigError as err:
            found.append(str(err))
        headers = Path(cpp_extension.CUDA_HOME, "include", "cuda_runtime.h")
        if not headers.is_file():
            found.append(f"the CUDA headers are missing: no {headers}")
    if not cpp_extension.is_ninja_available():
        found.append("ninja not found: pip install ninja (DeepSpeed's JIT build needs it)")
    compiler = environ.get("CXX") or "c++"
    if shutil.which(compiler) is None and shutil.which("g++") is None:
        found.append(f"no C++ compiler ({compiler} or g++) on PATH")
    python_h = Path(sysconfig.get_paths()["include"], "Python.h")
    if not python_h.is_file():
        found.append(f"Python's headers are missing: no {python_h} (install python3-dev)")
    return found


def problems(cases: list[Case], out: Path, *, gpu: bool, model_bytes: int, gpu_used_GiB: float | None = None,
             environ=os.environ) -> list[str]:
    """Every reason the check would fail on this host, each with its fix; empty when ready.

    ``model_bytes``: what the models not yet built will take on disk; ``gpu_used_GiB``: GPU memory
    in use before the check starts (NVML), None when unknown.
    """
    launchers: dict[str, str] = {}
    for case in cases:
        if case.launcher:
            launchers.setdefault(case.launcher[0], case.name)  # the first case that needs it
    found = [f"the launcher {name!r} is not on PATH (case {first} and any after it)"
             for name, first in launchers.items() if shutil.which(name) is None]
    found += library_problems(cases)
    if gpu:
        found += toolchain_problems(environ)
        if any(c.method == "qlora" for c in cases):
            try:
                from finetune_kit.launch.cuda_ops import _bitsandbytes

                _bitsandbytes()
            except (ConfigError, ImportError) as err:
                found.append(str(err))
        if gpu_used_GiB is not None and gpu_used_GiB > BUSY_GPU_GiB:
            found.append(f"{gpu_used_GiB:.1f} GiB of GPU 0 is in use before the check starts: stop the process "
                         "holding it (nvidia-smi lists it); the cases are sized for the whole GPU")
    folder = Path(out)
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if free < model_bytes * 1.1:
        found.append(f"{free / 2**30:.1f} GiB free under {folder}, the models need {model_bytes / 2**30:.1f} GiB: "
                     "free disk or pass --out on a larger disk")
    return found
