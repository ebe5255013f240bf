"""What a launch command will give its ranks, worked out without starting it.

``python -m finetune_kit.check`` runs a recipe's input checks once, before any rank exists; for that
it needs the environment a rank would see: the world size and this node's place in it, the DeepSpeed
JSON that ``accelerate launch`` exports as ``ACCELERATE_DEEPSPEED_CONFIG_FILE``, the ``FSDP_*``
settings of an FSDP YAML (:mod:`.env` and :mod:`.fsdp` read them). Each launcher's own code
computes it, so a YAML, flag or default means here what it means to the launcher:

* ``accelerate launch``: its parser and validation (``launch_command_parser``,
  ``_validate_launch_command`` in accelerate/commands/launch.py, which merge the YAML and the
  flags) and the ``prepare_*_env`` helpers of accelerate/utils/launch.py, picked as
  ``launch_command`` picks its launcher;
* ``deepspeed``: its runner's parser, hostfile and ``--include``/``--exclude``/``--num_nodes``/
  ``--num_gpus`` rules (deepspeed/launcher/runner.py);
* ``torchrun``: its parser and ``--nproc_per_node``/``--nnodes`` rules (torch/distributed/run.py).

To that come the variables torchrun (or DeepSpeed's per-node launcher, deepspeed/launcher/launch.py)
sets for each rank, as the first rank of this node gets them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from finetune_kit.errors import ConfigError

LAUNCHERS = ("accelerate launch", "deepspeed", "torchrun")


@dataclass(frozen=True)
class Launch:
    """A launch command, read: the script it starts, with what arguments, and the variables the
    launcher sets (or changes) for the first rank of this node."""

    command: tuple[str, ...]
    launcher: str  # one of LAUNCHERS
    script: str  # as given, relative to the folder the command runs from
    script_args: tuple[str, ...]
    env: Mapping[str, str]

    @property
    def world_size(self) -> int:
        return int(self.env.get("WORLD_SIZE", "1"))

    @property
    def nodes(self) -> int:
        return int(self.env.get("GROUP_WORLD_SIZE", self.env.get("CROSS_SIZE", "1")))

    def describe(self) -> str:
        """``train.py, 2 processes on 1 node (accelerate launch, DeepSpeed config configs/zero3.json)``."""
        engine = ("FSDP" if self.env.get("ACCELERATE_USE_FSDP") == "true" else
                  f"DeepSpeed config {self.env['ACCELERATE_DEEPSPEED_CONFIG_FILE']}"
                  if self.env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") else None)
        where = (f"{self.world_size} process{'es' * (self.world_size != 1)} "
                 f"on {self.nodes} node{'s' * (self.nodes != 1)}")
        return f"{self.script}, {where} ({', '.join(filter(None, (self.launcher, engine)))})"

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        """``os.environ`` as this launch's first rank would have it, until the block ends."""
        saved = dict(os.environ)
        os.environ.update(self.env)
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved)


def parse(command: Sequence[str]) -> Launch:
    """Read ``command`` (``accelerate launch ...``, ``deepspeed ...`` or ``torchrun ...``, as the
    recipes' READMEs write them). Raise ConfigError for a command no launcher would start; a flag
    the launcher does not know ends with its own usage message (SystemExit 2), as the launch would."""
    command = tuple(command)
    name = Path(command[0]).name if command else ""
    if name == "accelerate" and command[1:2] == ("launch",):
        return _accelerate(command, list(command[2:]))
    if name == "deepspeed":
        return _deepspeed(command, list(command[1:]))
    if name == "torchrun":
        return _torchrun(command, list(command[1:]))
    raise ConfigError(f"'{shlex.join(command[:3]) or '(nothing)'}' is not a launch command this check knows: give it "
                      f"the recipe's launch command, starting with {', '.join(repr(x) for x in LAUNCHERS)}, e.g. "
                      "'python -m finetune_kit.check accelerate launch --config_file configs/zero3.yaml train.py ...'.")


@contextlib.contextmanager
def _launcher_code(launcher: str) -> Iterator[None]:
    """Run a launcher's own helpers here: without their warnings and log lines (a port in use,
    OMP_NUM_THREADS: the launch says them again), without the variables they set in passing, and
    with their refusals as one ConfigError."""
    saved = dict(os.environ)
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    except (ValueError, RuntimeError, AssertionError, OSError) as err:  # what the helpers raise for bad flags
        raise ConfigError(f"{launcher} would refuse this command: {err}") from err
    finally:
        logging.disable(logging.NOTSET)
        os.environ.clear()
        os.environ.update(saved)


def _changed(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` (a copy of os.environ the launcher added to) that differ from ours."""
    return {k: str(v) for k, v in env.items() if os.environ.get(k) != str(v)}


def _torchrun_rank(per_node: int, nodes: int, node: int, addr: str, port) -> dict[str, str]:
    """What torchrun sets for local rank 0 of node ``node`` (torch/distributed/elastic/agent/server/api.py)."""
    return {"RANK": str(node * per_node), "WORLD_SIZE": str(per_node * nodes), "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(nodes),
            "MASTER_ADDR": addr, "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0"}


def _accelerate(command: tuple[str, ...], argv: list[str]) -> Launch:
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(argv)
    with _launcher_code("accelerate launch"):
        from accelerate.utils import launch as helpers
        from accelerate.utils.constants import DEEPSPEED_MULTINODE_LAUNCHERS

        args, defaults, mixed_precision_from_config = _validate_launch_command(args)
        if args.use_deepspeed and not args.cpu:  # the branches of accelerate's launch_command
            fields = list(defaults.deepspeed_config) if defaults else []
            args.deepspeed_fields_from_accelerate_config = ",".join(
                fields + ["mixed_precision"] * mixed_precision_from_config)
            _, env = helpers.prepare_deepspeed_cmd_env(args)
            # several nodes through DeepSpeed's runner (pdsh, ...): it starts every node from this one
            runner = args.num_machines > 1 and args.deepspeed_multinode_launcher != DEEPSPEED_MULTINODE_LAUNCHERS[1]
        elif (args.use_fsdp or args.use_megatron_lm or args.multi_gpu) and not args.cpu:
            env, runner = helpers.prepare_multi_gpu_env(args), False
        else:  # one process (or CPU processes under MPI): the script runs without torchrun
            _, env = helpers.prepare_simple_launcher_cmd_env(args)
            return Launch(command, "accelerate launch", args.training_script, tuple(args.training_script_args),
                          _changed(env))
        env = _changed(env)
        nodes = int(args.num_machines or 1)
        per_node, addr = int(args.num_processes) // nodes, args.main_process_ip or "127.0.0.1"
        env.update(_deepspeed_rank(per_node * nodes, [per_node] * nodes, addr, args.main_process_port) if runner else
                   _torchrun_rank(per_node, nodes, int(args.machine_rank or 0), addr, args.main_process_port))
    return Launch(command, "accelerate launch", args.training_script, tuple(args.training_script_args), env)


def _deepspeed_rank(world: int, per_node: list[int], addr: str, port) -> dict[str, str]:
    """What DeepSpeed's per-node launcher sets for the job's first rank (deepspeed/launcher/launch.py)."""
    return {"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_SIZE": str(per_node[0]),
            "CROSS_RANK": "0", "CROSS_SIZE": str(len(per_node)), "MASTER_ADDR": addr, "MASTER_PORT": str(port)}


def _deepspeed(command: tuple[str, ...], argv: list[str]) -> Launch:
    with _launcher_code("deepspeed"):
        from deepspeed.accelerator import get_accelerator
        from deepspeed.launcher import runner

        args = runner.parse_args(argv)
        pool = runner.fetch_hostfile(args.hostfile)
        include = args.include
        visible = os.environ.get(get_accelerator().visible_devices_envs()[0], "")
        if not pool and visible and not (args.include or args.exclude or args.num_nodes > 1 or args.num_gpus > 0):
            include = f"localhost:{visible}"  # the runner's reading of CUDA_VISIBLE_DEVICES on one node
        if (args.num_nodes >= 0 or args.num_gpus >= 0) and (include or args.exclude):
            raise ValueError("--num_nodes/--num_gpus cannot be combined with --include/--exclude")
        if not pool:
            count = get_accelerator().device_count()
            if count == 0:
                raise RuntimeError("Unable to proceed, no GPU resources available")  # the runner's words
            pool = {"localhost": count}
            args.master_addr = args.master_addr or "127.0.0.1"
        active = runner.apply_num_nodes_and_gpus(runner.parse_inclusion_exclusion(pool, include, args.exclude),
                                                 args.num_nodes, args.num_gpus)
        per_node = [len(slots) for slots in active.values()]
        node = args.node_rank if args.no_ssh else 0  # without ssh each node runs the command; else the first does
        env = _deepspeed_rank(sum(per_node), per_node, args.master_addr or next(iter(active)), args.master_port)
        env.update(RANK=str(sum(per_node[:node])), CROSS_RANK=str(node), LOCAL_SIZE=str(per_node[node]))
    return Launch(command, "deepspeed", args.user_script, tuple(args.user_args), env)


def _torchrun(command: tuple[str, ...], argv: list[str]) -> Launch:
    with _launcher_code("torchrun"):
        from torch.distributed import run

        args = run.parse_args(argv)
        min_nodes, max_nodes = run.parse_min_max_nnodes(args.nnodes)
        if min_nodes != max_nodes:
            raise ValueError(f"--nnodes {args.nnodes} is elastic; these recipes run a fixed number of nodes")
        per_node = run.determine_local_world_size(args.nproc_per_node)
        env = _torchrun_rank(per_node, max_nodes, args.node_rank, args.master_addr, args.master_port or 29500)
    return Launch(command, "torchrun", args.training_script, tuple(args.training_script_args), env)
