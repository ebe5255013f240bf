"""Build the ``Accelerator`` for a recipe; the one place that knows about CPU-only runs.

On GPUs this is a plain ``Accelerator(...)``: everything comes from the accelerate YAML
and its DeepSpeed JSON. On a machine without GPUs (CI, ``make demo``), accelerate under
DeepSpeed reports ``num_processes == 1`` on every rank unless the process group is
created with the gloo backend: the ranks would then silently train as independent
single-process jobs. Passing ``InitProcessGroupKwargs(backend="gloo")`` fixes it.

An FSDP launch meets a second trap there: accelerate enables FSDP only for GPU (and other
accelerator) process groups, so on CPU the YAML's FSDP settings would be dropped and the ranks
would train unsharded, as plain data parallel. :func:`make_accelerator` marks the state as FSDP
itself (:func:`_fsdp_on_cpu`); ``fully_shard`` then shards over the gloo group as it does over NCCL.

Recipes driven by the Hugging Face ``Trainer`` meet the same trap one level up:
``TrainingArguments`` builds its own accelerate state. ``trainer_cpu_overrides()`` is their
fix, again a no-op on GPUs.

A third, on every CPU run under DeepSpeed: its shared-memory collectives (the shm_comm op) give
each rank a 64 MiB buffer in ``/dev/shm`` and never remove it, so every run would leave its
buffers behind in RAM. Both entry points remove this rank's name once every rank has mapped every
other's (:func:`release_shm_buffer`); the mappings stay valid until the ranks exit.

Both entry points also apply the start-up speed-ups for CPU launches (:mod:`finetune_kit.launch.startup`):
py-cpuinfo's answer and the NUMA layout, which DeepSpeed would otherwise ask of a new process at each op it
loads and at each gradient reduce.
"""

from __future__ import annotations

import atexit
import os
import warnings
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs

from finetune_kit.launch import env, fsdp, startup

# DeepSpeed 0.19 calls torch's deprecated collective names on every step; the warning is
# repeated per rank per step and says nothing the user can act on.
warnings.filterwarnings(
    "ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`"
)


def on_cpu_only() -> bool:
    return not torch.cuda.is_available()


class RecipeAccelerator(Accelerator):
    """accelerate's Accelerator, whose prepared learning-rate schedules step once per optimizer step.

    accelerate steps a prepared schedule once per rank at each optimizer step (it assumes one written
    for a single process's data); the recipes' schedules count optimizer steps, as DeepSpeed, which
    steps its own once. Once, then: the schedule's state is in optimizer steps under FSDP2 as under
    DeepSpeed, and resumes on any number of ranks."""

    def prepare_scheduler(self, scheduler):
        prepared = super().prepare_scheduler(scheduler)
        prepared.split_batches = True  # AcceleratedScheduler.step: one step, not one per process
        return prepared


def make_accelerator(**kwargs) -> Accelerator:
    """A :class:`RecipeAccelerator` with ``kwargs`` whose process group fails a collective after
    :func:`~finetune_kit.launch.env.collective_timeout_s`; gloo on CPU-only machines."""
    handlers = list(kwargs.pop("kwargs_handlers", []) or [])
    timeout = timedelta(seconds=env.collective_timeout_s())
    startup.speed_up()  # on a CPU-only machine: py-cpuinfo's answer and the NUMA layout kept
    if on_cpu_only() and env.world_size() > 1:
        handlers.append(InitProcessGroupKwargs(backend="gloo", timeout=timeout))
    elif not on_cpu_only():
        handlers.append(InitProcessGroupKwargs(timeout=timeout))  # NCCL: accelerate's own backend
    if fsdp.launched():
        kwargs.setdefault("fsdp_plugin", fsdp.plugin())  # the YAML's settings, fp32 gradient reduction
    accelerator = RecipeAccelerator(kwargs_handlers=handlers, **kwargs)
    release_shm_buffer(lambda: accelerator.wait_for_everyone())
    if fsdp.launched() and accelerator.distributed_type != DistributedType.FSDP:
        _fsdp_on_cpu(accelerator, kwargs["fsdp_plugin"])
    return accelerator


def _fsdp_on_cpu(accelerator: Accelerator, plugin) -> None:
    """Make accelerate treat a CPU (gloo) process group launched with an FSDP config as FSDP. The
    shared state is set in both of accelerate's state singletons: ``AcceleratorState`` copies
    ``PartialState``'s fields whenever it is instantiated again, and the collectives of
    ``accelerate.utils`` (gather, broadcast) read ``PartialState``."""
    from accelerate import PartialState

    if not on_cpu_only():
        raise RuntimeError(f"accelerate did not enable FSDP on {accelerator.device}; check the accelerate YAML")
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def trainer_cpu_overrides() -> dict:
    """TrainingArguments overrides for DeepSpeed under the HF Trainer, launched on a CPU-only
    machine; ``{}`` on GPUs or without a launcher. Call it before building TrainingArguments.

    Left alone, TrainingArguments resets the accelerate state, fills DeepSpeed's batch size
    for world size 1 and refuses bf16 without a GPU. A gloo ``PartialState`` created first and
    kept (``use_configured_state``) gives the real world size; ``use_cpu`` lets the bf16 of the
    DeepSpeed JSON through, and DeepSpeed stays on because the configured state is a DeepSpeed one.
    """
    if not on_cpu_only() or not env.launched():
        return {}
    from accelerate import PartialState

    startup.speed_up()
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    state = PartialState(backend="gloo", timeout=timedelta(seconds=env.collective_timeout_s()))
    release_shm_buffer(state.wait_for_everyone)
    return {"use_cpu": True, "accelerator_config": {"use_configured_state": True}}


SHM_DIR = Path("/dev/shm")


def shm_buffer() -> Path | None:
    """This rank's buffer of DeepSpeed's CPU collectives, named as its shm_comm op names it
    (``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``); None without a launcher."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not env.launched() or addr is None or port is None:
        return None
    return SHM_DIR / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{env.view().rank}"


def release_shm_buffer(barrier) -> None:
    """On a CPU-only machine, remove this rank's shm_comm buffer from /dev/shm, which DeepSpeed never
    does (each run would keep 64 MiB of RAM per rank until the machine restarts). Call it on every
    rank once the process group exists: DeepSpeed's init has then created this rank's buffer and
    mapped the others', so after ``barrier`` (every rank past its init) the names are no longer
    needed. A buffer created later (or a run that never reaches this) is removed at exit instead."""
    buffer = shm_buffer() if on_cpu_only() else None
    if buffer is None:
        return
    atexit.register(buffer.unlink, missing_ok=True)
    if env.world_size() > 1:
        barrier()
    buffer.unlink(missing_ok=True)
