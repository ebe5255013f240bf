"""Checks of a DeepSpeed config that offloads to NVMe (ZeRO-Infinity), before anything loads: the
folder exists and takes files, and DeepSpeed's async_io op is prebuilt or can be built (libaio)."""

from __future__ import annotations

from pathlib import Path

from finetune_kit.errors import ConfigError

SECTIONS = ("offload_optimizer", "offload_param")


def nvme_paths(ds_config: dict) -> dict[str, str | None]:
    """{section: nvme_path} for each zero_optimization offload section whose device is nvme."""
    zero = ds_config.get("zero_optimization") or {}
    return {name: zero[name].get("nvme_path") for name in SECTIONS
            if isinstance(zero.get(name), dict) and str(zero[name].get("device", "")).lower() == "nvme"}


def check(ds_config: dict, source: str) -> None:
    """ConfigError naming the value, the rule and the fix; nothing when no section offloads to NVMe."""
    from finetune_kit.training.checkpoints import check_writable

    paths = nvme_paths(ds_config)
    for section, path in paths.items():
        key = f"zero_optimization.{section}.nvme_path"
        if not path:
            raise ConfigError(f"{source}: {section} offloads to nvme but {key} is not set. Set it to a folder "
                              "on a fast local NVMe disk.")
        if not Path(path).is_dir():
            raise ConfigError(f"{source}: {key} '{path}' is not a folder. Create it on a fast local NVMe disk "
                              f"(mkdir -p {path}) or point {key} at one.")
        check_writable(Path(path))
    if paths and not async_io_available():
        raise ConfigError(f"{source} offloads to NVMe, which needs DeepSpeed's async_io op, and it can neither "
                          "be loaded nor built here: libaio's headers are missing. Install them (Debian/Ubuntu: "
                          "apt-get install libaio-dev; RHEL: dnf install libaio-devel), or offload to cpu instead.")


def async_io_available() -> bool:
    """DeepSpeed's async_io op is prebuilt, or its builder finds libaio to build it."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get("async_io"):
        return True
    return bool(get_accelerator().create_op_builder("AsyncIOBuilder").is_compatible(verbose=False))
