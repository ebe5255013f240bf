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

What one row needs of the GPU itself is no problem of the host: a row with ``--fp8`` on a GPU below
compute capability 8.9 (no fp8 tensor cores; the recipe would refuse it) is recorded as not applicable
(:func:`not_applicable`) and the other rows run.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

from finetune_kit.errors import ConfigError
from finetune_kit.models.fp8 import MIN_CAPABILITY
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


def library_problems(cases: list[Case], *, fp8: bool = False, also: Sequence[str] = ()) -> list[str]:
    """``fp8``: some run computes in fp8, which needs torchao; ``also``: more modules some run imports
    (the smoke's lm_eval, liger_kernel)."""
    names = (list(LIBRARIES) + (["bitsandbytes"] if any(c.method == "qlora" for c in cases) else [])
             + (["torchao"] if fp8 else []) + list(also))
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
             fp8: bool = False, also: Sequence[str] = (), environ=os.environ) -> list[str]:
    """Every reason the check would fail on this host, each with its fix; empty when ready.

    ``model_bytes``: what the models not yet built will take on disk; ``gpu_used_GiB``: GPU memory
    in use before the check starts (NVML), None when unknown; ``fp8``: a row that will run has ``--fp8``.
    """
    launchers: dict[str, str] = {}
    for case in cases:
        if case.launcher:
            launchers.setdefault(case.launcher[0], case.name)  # the first case that needs it
    found = [f"the launcher {name!r} is not on PATH (case {first} and any after it)"
             for name, first in launchers.items() if shutil.which(name) is None]
    found += library_problems(cases, fp8=fp8, also=also)
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


def fp8_choice(flags: Sequence[str]) -> str:
    """The ``--fp8`` value among recipe ``flags`` (the last one given, as argparse reads it); "none" without one."""
    choice = "none"
    for i, flag in enumerate(flags):
        if flag == "--fp8" and i + 1 < len(flags):
            choice = flags[i + 1]
        elif flag.startswith("--fp8="):
            choice = flag.split("=", 1)[1]
    return choice


def gpu_capability(index: int = 0) -> tuple[int, int] | None:
    """GPU ``index``'s compute capability (major, minor), without a CUDA context in this process: NVML's
    answer, else torch's in a short subprocess (no nvidia-ml-py); None when neither finds a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(index))
        return int(major), int(minor)
    except Exception:  # ImportError, NVMLError
        pass
    code = (f"import torch; print(*torch.cuda.get_device_capability({index})) "
            "if torch.cuda.is_available() else None")
    try:
        answer = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    parts = answer.split()
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 and all(p.isdigit() for p in parts) else None


def not_applicable(flags: Sequence[str], capability: tuple[int, int] | None) -> str | None:
    """Why a run with recipe ``flags`` cannot run on a GPU of compute ``capability``, or None to run it
    (also without a GPU, None: on CPU torch's reference fp8 kernel runs the same code path)."""
    choice = fp8_choice(flags)
    if choice == "none" or capability is None or tuple(capability) >= MIN_CAPABILITY:
        return None
    need = "{}.{}".format(*MIN_CAPABILITY)
    return (f"fp8 needs compute capability {need}+ (--fp8 {choice}); this GPU's is {capability[0]}.{capability[1]}, "
            "without fp8 tensor cores")
