"""Checks of a DeepSpeed config that offloads to NVMe (ZeRO-Infinity), before anything loads: the
folder exists and takes files, DeepSpeed's async_io op is prebuilt or can be built (libaio), and
the parameter swap buffers can hold the model's largest parameter partition."""

from __future__ import annotations

import math
from pathlib import Path

from finetune_kit.errors import ConfigError

SECTIONS = ("offload_optimizer", "offload_param")
# ZeRO-Infinity's parameter swap buffers as the shipped NVMe config sets them: buffer_count, buffer_size (elements)
PARAM_BUFFERS = (5, 6e8)
# DeepSpeed 0.19.8's defaults (runtime/zero/offload_config.py, runtime/swap_tensor/utils.py): the
# parameter buffers when the JSON leaves them out, and the smallest partition it swaps to NVMe (bytes;
# or aio.block_size when larger): smaller ones stay in host memory and need no buffer.
DEFAULT_BUFFER_COUNT, DEFAULT_BUFFER_SIZE = 5, 100_000_000
MIN_AIO_BYTES, DEFAULT_AIO_BLOCK_SIZE = 2**20, 1_048_576


def nvme_paths(ds_config: dict) -> dict[str, str | None]:
    """{section: nvme_path} for each zero_optimization offload section whose device is nvme."""
    zero = ds_config.get("zero_optimization") or {}
    return {name: zero[name].get("nvme_path") for name in SECTIONS
            if isinstance(zero.get(name), dict) and str(zero[name].get("device", "")).lower() == "nvme"}


def check_paths(ds_config: dict, source: str) -> None:
    """ConfigError naming the value, the rule and the fix; nothing when no section offloads to NVMe."""
    from finetune_kit.outputs import check_writable

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


def check_param_buffers(ds_config: dict, model_config, world_size: int, source: str) -> None:
    """ConfigError when ZeRO-3's NVMe parameter buffers cannot hold the model; nothing when
    offload_param does not go to NVMe (or the stage is not 3).

    DeepSpeed (0.19.8, runtime/swap_tensor/partitioned_param_swapper.py ``get_buffer``) gives each
    parameter partition it swaps one pinned buffer of ``buffer_size`` elements and asserts
    ``partition <= buffer_size``, where a rank's partition of a parameter is ceil(numel / ranks)
    (zero/partition_parameters.py pads numel to a multiple of the ranks). DeepSpeed fails while it
    partitions the model (under zero.Init as it is built, else in deepspeed.initialize after the
    weights load); this check fails in seconds. Partitions under 1 MiB (or aio.block_size) stay in
    host memory and need no buffer.
    ``model_config``: a transformers config, a config.json dict, a ModelShape or a known name.
    """
    from finetune_kit.models.shapes import resolve_model

    if "offload_param" not in nvme_paths(ds_config) or str(ds_config["zero_optimization"].get("stage")) != "3":
        return  # only ZeRO-3 partitions, and so swaps, the parameters
    count, size = param_buffers(ds_config, source)
    shape = resolve_model(model_config)
    name, numel = _largest_parameter(shape)
    partition = math.ceil(numel / max(1, world_size))
    element_bytes = 2 if any((ds_config.get(p) or {}).get("enabled") for p in ("bf16", "fp16")) else 4
    block = (ds_config.get("aio") or {}).get("block_size", DEFAULT_AIO_BLOCK_SIZE)
    if partition * element_bytes < max(MIN_AIO_BYTES, int(block)):
        return  # DeepSpeed keeps every partition in host memory; the buffers stay unused
    key = "zero_optimization.offload_param"
    ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
    if count < 1:
        raise ConfigError(f"{source}: {key}.buffer_count is {count}, but every parameter partition DeepSpeed "
                          f"reads from or writes to NVMe takes one of these buffers ({shape.name}'s {name} is one). "
                          f"Set {key}.buffer_count to at least 1 in {source} (DeepSpeed's default: "
                          f"{DEFAULT_BUFFER_COUNT}).")
    if partition > size:
        needed = _round_up(partition)
        pinned = count * needed * element_bytes / 2**30
        raise ConfigError(
            f"{source}: {key}.buffer_size is {size:,} elements, but {shape.name}'s largest parameter, {name}, "
            f"has a partition of {partition:,} elements per rank across {ranks} (ceil(numel / ranks)); "
            f"each NVMe parameter buffer must hold one partition, or DeepSpeed stops with 'More elements ... than "
            f"buffer size' while partitioning the model. Set {key}.buffer_size to at least {needed:,} in "
            f"{source} (pinned host memory per rank: buffer_count {count} x {needed:,} x {element_bytes} bytes "
            f"= {pinned:.1f} GiB), or launch on more GPUs.")


def param_buffers(ds_config: dict, source: str = "the DeepSpeed config") -> tuple[int, int] | None:
    """(buffer_count, buffer_size) of the NVMe parameter buffers, DeepSpeed's defaults where the JSON
    has none; None when parameters are not offloaded to NVMe."""
    if "offload_param" not in nvme_paths(ds_config):
        return None
    section = ds_config["zero_optimization"]["offload_param"]
    return (_number(section, "buffer_count", DEFAULT_BUFFER_COUNT, source),
            _number(section, "buffer_size", DEFAULT_BUFFER_SIZE, source))


def _number(section: dict, key: str, default: int, source: str) -> int:
    value = section.get(key, default)
    try:
        return int(float(value))
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: zero_optimization.offload_param.{key} is {value!r}; it must be a whole "
                          f"number (DeepSpeed's default: {default:,}).") from None


def _largest_parameter(shape) -> tuple[str, int]:
    """(description, numel) of the model's largest single parameter; a tied head is the embedding."""
    h, v = shape.hidden_size, shape.vocab_size
    candidates = [("the embedding", v, h)] + ([] if shape.tie_word_embeddings else [("lm_head", v, h)])
    candidates += [(layer, o, i) for layer, (i, o) in shape.linear_shapes().items()]
    name, rows, cols = max(candidates, key=lambda c: c[1] * c[2])
    return f"{name} ({rows:,} x {cols:,} = {rows * cols:,} elements)", rows * cols


def _round_up(n: int) -> int:
    """n rounded up to two significant digits (525,336,576 -> 530,000,000)."""
    step = 10 ** max(0, len(str(n)) - 2)
    return -(-n // step) * step
