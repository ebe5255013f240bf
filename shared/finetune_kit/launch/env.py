"""What the launcher (torchrun, ``accelerate launch``, ``deepspeed``) told this process, read in one place.

torchrun (and ``accelerate launch``, which runs it) exports ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``/``GROUP_WORLD_SIZE`` (this node's rank, the number of nodes)
and ``MASTER_ADDR``/``MASTER_PORT``; DeepSpeed's own launcher names the per-node ones
``LOCAL_SIZE``, ``CROSS_RANK`` and ``CROSS_SIZE``. ``accelerate launch`` adds
``ACCELERATE_DEEPSPEED_CONFIG_FILE``. Without a launcher the process is rank 0 of a world of 1.
Nothing here imports torch.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class LaunchView:
    """How the launcher set up this process."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    machine_rank: int
    num_machines: int
    host: str

    def as_dict(self) -> dict:
        return asdict(self)


def _read(*names: str, default: str) -> int:
    """The first of ``names`` the launcher set (torchrun's name first, then DeepSpeed's)."""
    return int(next((os.environ[n] for n in names if n in os.environ), default))


def view() -> LaunchView:
    world = _read("WORLD_SIZE", default="1")
    return LaunchView(rank=_read("RANK", default="0"), world_size=world, local_rank=_read("LOCAL_RANK", default="0"),
                      local_world_size=_read("LOCAL_WORLD_SIZE", "LOCAL_SIZE", default=str(world)),
                      machine_rank=_read("GROUP_RANK", "CROSS_RANK", default="0"),
                      num_machines=_read("GROUP_WORLD_SIZE", "CROSS_SIZE", default="1"), host=os.uname().nodename)


def launched() -> bool:
    """True when a launcher started this process (even a world of 1)."""
    return "WORLD_SIZE" in os.environ


def world_size() -> int:
    """Processes in the job as the launcher set them up (1 when run without a launcher)."""
    return view().world_size


def num_nodes() -> int:
    """Machines in the job: world size over processes per machine."""
    v = view()
    return max(1, v.world_size // max(1, v.local_world_size))


def is_main_rank() -> bool:
    return view().rank == 0


def rendezvous() -> tuple[str, int] | None:
    """The main node's (address, port) of the launcher's key-value store; None without one."""
    if "MASTER_ADDR" not in os.environ:
        return None
    return os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500"))  # torchrun's default port


def restart_count() -> int:
    """How often torchrun's elastic agent has restarted the workers (0 on the first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def launched_deepspeed_config() -> Path | None:
    """The DeepSpeed JSON that ``accelerate launch`` passed to this process, if any."""
    value = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    return Path(value) if value and value != "none" else None


COLLECTIVE_TIMEOUT_VAR = "FINETUNE_COLLECTIVE_TIMEOUT_S"
COLLECTIVE_TIMEOUT_S = 600  # torch's NCCL default, made explicit and applied to gloo too (its own: 30 min)


def collective_timeout_s() -> int:
    """Seconds a collective waits for a rank that does not answer before every rank fails
    (``FINETUNE_COLLECTIVE_TIMEOUT_S``, default 600). Work one rank does alone while the others
    wait in a barrier (writing the consolidated model, tokenising huge data first on rank 0)
    must fit in it."""
    raw = os.environ.get(COLLECTIVE_TIMEOUT_VAR, str(COLLECTIVE_TIMEOUT_S))
    if not raw.isdigit() or int(raw) < 1:
        from finetune_kit.errors import ConfigError

        raise ConfigError(f"{COLLECTIVE_TIMEOUT_VAR}={raw!r} is not a whole number of seconds above 0; "
                          f"unset it for the default ({COLLECTIVE_TIMEOUT_S} s) or set e.g. 1800.")
    return int(raw)
