"""Can this GPU host run the compiled kernels a recipe needs? Checked in seconds, before any weights load.

DeepSpeed's Adam is a compiled op: fused Adam on the GPU, or CPU Adam when the optimizer is
offloaded. An image may ship it prebuilt (``DS_BUILD_FUSED_ADAM=1`` at install); otherwise DeepSpeed
compiles it at the first optimizer step, which needs nvcc of the CUDA release torch was built for
(DeepSpeed's frequent "Installed CUDA version X does not match the version torch was compiled with
Y"), then fails after the model has loaded. QLoRA needs bitsandbytes' CUDA library, which fails
only when the first 4-bit layer runs. :func:`check` finds all three at the start. Without CUDA it
checks nothing: CPU runs use DeepSpeed's CPU ops, which need only a C++ compiler.
"""

from __future__ import annotations

import os
import re

from finetune_kit.errors import ConfigError

_ARCH_SUFFIX = re.compile(r"^(\d+\.\d+)[af](\+PTX)?$")  # 9.0a, 10.0f: arch-specific variants (PyTorch 2.8+)


def jit_arch_list(environ=os.environ) -> str | None:
    """Make ``TORCH_CUDA_ARCH_LIST`` readable by DeepSpeed's JIT builder, in ``environ``.

    DeepSpeed 0.19 sorts the list as numbers and fails on ``9.0a`` ("invalid literal for int()
    with base 10: '0a'"), which CUDA images for Hopper often set. Its ops use no arch-specific
    instructions, so ``9.0a`` becomes ``9.0``. Returns a note when it changed the value, else None.
    """
    value = environ.get("TORCH_CUDA_ARCH_LIST", "")
    parts = value.replace(";", " ").split()
    fixed = [m.group(1) + (m.group(2) or "") if (m := _ARCH_SUFFIX.match(p)) else p for p in parts]
    if fixed == parts:
        return None
    environ["TORCH_CUDA_ARCH_LIST"] = ";".join(dict.fromkeys(fixed))
    return (f"TORCH_CUDA_ARCH_LIST {value!r} -> {environ['TORCH_CUDA_ARCH_LIST']!r} for DeepSpeed's JIT build "
            "(it cannot read arch suffixes)")


def adam_op(ds_config: dict) -> str:
    """The DeepSpeed op builder the config's optimizer runs on."""
    offload = ((ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device", "none")
    return "CPUAdamBuilder" if offload in ("cpu", "nvme") else "FusedAdamBuilder"


def check_ops(ds_config: dict, *, quantized: bool = False) -> list[str]:
    """Raise ConfigError naming the mismatch and the fix; return what was found usable."""
    import torch

    if not torch.cuda.is_available():
        return []
    found = [note] if (note := jit_arch_list()) else []
    found.append(_deepspeed_op(adam_op(ds_config)))
    if quantized:
        found.append(_bitsandbytes())
    return found


def _deepspeed_op(builder_name: str) -> str:
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    builder = get_accelerator().create_op_builder(builder_name)
    if installed_ops.get(builder.NAME):
        return f"DeepSpeed {builder.NAME}: prebuilt"
    import torch
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder, installed_cuda_version

    if isinstance(builder, CUDAOpBuilder):
        try:
            nvcc = "{}.{}".format(*installed_cuda_version())
        except Exception as err:  # DeepSpeed raises its own MissingCUDAException
            raise ConfigError(
                f"DeepSpeed's {builder.NAME} op is not prebuilt and cannot be compiled here: {err}. Install the "
                f"CUDA toolkit {torch.version.cuda} (nvcc) and set CUDA_HOME, or use an image with DeepSpeed built "
                f"with DS_BUILD_{builder.NAME.upper()}=1.") from err
        check_nvcc(nvcc, torch.version.cuda, builder.NAME)
    if not builder.is_compatible(verbose=False):
        raise ConfigError(f"DeepSpeed's {builder.NAME} op is not prebuilt and cannot be compiled on this host "
                          "(see `ds_report`); install ninja and a C++ compiler, or use an image with it prebuilt.")
    return f"DeepSpeed {builder.NAME}: compiled at first use"


def check_nvcc(nvcc: str, torch_cuda: str | None, op: str) -> None:
    """The compiler's CUDA release must be torch's major release (minor releases of 11 and 12 mix)."""
    if nvcc.split(".")[0] != (torch_cuda or "").split(".")[0]:
        raise ConfigError(
            f"DeepSpeed would compile its {op} op with nvcc {nvcc}, but torch was built for CUDA {torch_cuda}: "
            f"the op would not load. Install the CUDA {torch_cuda} toolkit (or a torch built for CUDA {nvcc}), "
            "or use an image with the op prebuilt.")


def _bitsandbytes() -> str:
    import bitsandbytes as bnb
    from bitsandbytes import cextension

    if type(cextension.lib).__name__ == "ErrorHandlerMockBNBNativeLibrary":
        raise ConfigError(
            f"bitsandbytes {bnb.__version__} found no CUDA library for this torch (CUDA "
            f"{__import__('torch').version.cuda}): 4-bit layers would fail at the first step. Install a "
            "bitsandbytes wheel that ships libbitsandbytes_cuda<version>.so for this CUDA release.")
    return f"bitsandbytes {bnb.__version__}: CUDA library loaded"
