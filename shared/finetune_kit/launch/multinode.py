"""Check a multi-node launch before any node waits for another.

A node whose accelerate YAML disagrees with the main node's (another ``num_machines``,
the same ``machine_rank`` twice, another port or DeepSpeed config) does not fail: it
waits at the rendezvous for peers that never come, for up to the rendezvous timeout.
``check_pair`` compares the YAMLs of the main node and a worker in well under a second:

    python -m finetune_kit.launch.multinode configs/zero3-main.yaml configs/zero3-worker.yaml --node-rank 1

exits 0 with a summary, or 2 with the first disagreement, naming both values and the fix.

``handshake`` is the same check at run time, for nodes started by hand or by a scheduler:
before the process group forms (where a mismatch would hang for the 30-minute collective
timeout), every rank posts how the launcher set it up to the launcher's own key-value store
on the main node and compares it with every other rank's. A disagreement fails as soon as
both nodes are up; a node that never comes fails after ``timeout_s``.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

from finetune_kit import command_line
from finetune_kit.errors import ConfigError
from finetune_kit.launch import env

# Keys both nodes must agree on; machine_rank and main_process_ip are per node.
SHARED_KEYS = ("distributed_type", "num_machines", "num_processes", "main_process_port", "rdzv_backend",
               "same_network", "mixed_precision", "use_cpu")
SHARED_DEEPSPEED_KEYS = ("deepspeed_config_file", "zero3_init_flag", "deepspeed_multinode_launcher", "zero_stage")


def load_launch_config(path: str | Path) -> dict:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"accelerate config '{path}' does not exist (looked from {Path.cwd()}).")
    config = yaml.safe_load(path.read_text()) or {}
    if not isinstance(config, dict):
        raise ConfigError(f"accelerate config '{path}' is not a YAML mapping.")
    return config


def check_pair(main: dict, worker: dict, main_name: str = "main", worker_name: str = "worker",
               node_rank: int | None = None) -> str:
    """Raise ConfigError if the two nodes' configs cannot form one job; return a summary."""
    for key in SHARED_KEYS:
        if main.get(key) != worker.get(key):
            raise ConfigError(
                f"{key} differs between the nodes: {main_name} has {main.get(key)!r}, {worker_name} has "
                f"{worker.get(key)!r}. Every node must use the same {key}; copy it from {main_name}."
            )
    ds_main, ds_worker = main.get("deepspeed_config") or {}, worker.get("deepspeed_config") or {}
    for key in SHARED_DEEPSPEED_KEYS:
        if ds_main.get(key) != ds_worker.get(key):
            raise ConfigError(
                f"deepspeed_config.{key} differs between the nodes: {main_name} has {ds_main.get(key)!r}, "
                f"{worker_name} has {ds_worker.get(key)!r}. Use the same value on every node."
            )
    machines = int(main.get("num_machines", 1))
    processes = int(main.get("num_processes", 1))
    if machines < 2:
        raise ConfigError(f"{main_name} sets num_machines = {machines}; a multi-node job needs 2 or more.")
    if processes % machines:
        raise ConfigError(f"num_processes = {processes} (total over all nodes) is not a multiple of "
                          f"num_machines = {machines}; each node runs num_processes / num_machines processes.")
    main_rank, worker_rank = int(main.get("machine_rank", 0)), int(worker.get("machine_rank", 0))
    if main_rank != 0:
        raise ConfigError(f"{main_name} sets machine_rank = {main_rank}; the main node must be machine_rank 0.")
    if not 1 <= worker_rank < machines:
        raise ConfigError(
            f"{worker_name} sets machine_rank = {worker_rank}; with num_machines = {machines} a worker must have "
            f"a machine_rank from 1 to {machines - 1}, different on every worker."
        )
    if node_rank is not None and node_rank not in (main_rank, worker_rank):
        raise ConfigError(f"NODE_RANK={node_rank}, but {main_name} is machine_rank {main_rank} and {worker_name} "
                          f"is machine_rank {worker_rank}. Set NODE_RANK to the machine_rank of this node.")
    if ds_main.get("deepspeed_multinode_launcher", "pdsh") != "standard":
        raise ConfigError(
            f"{main_name}: deepspeed_config.deepspeed_multinode_launcher is "
            f"{ds_main.get('deepspeed_multinode_launcher', 'pdsh (the default)')!r}; set it to 'standard' to start "
            "each node with its own 'accelerate launch' (the other launchers ssh from the main node)."
        )
    return (f"ok: {machines} machines x {processes // machines} processes, port {main.get('main_process_port')}, "
            f"{main_name} is machine_rank {main_rank}, {worker_name} is machine_rank {worker_rank}")


def handshake(timeout_s: float = 300.0, *, plan_digest: str = "", plan_summary: str = "") -> dict:
    """Check that all ranks agree on the job's shape and its launch plan; return this rank's view.

    A no-op in a single-process run. Raises ConfigError on the first disagreement (number
    of machines, world size, processes per node, two processes claiming one rank, the launch
    plan's ``plan_digest``: the batch split and levers each rank decided, which must be one
    schedule, named in the error by ``plan_summary``) or when a rank is missing after
    ``timeout_s`` seconds. Every rank compares with every other, so a disagreement fails on all.
    (torch takes the world size from the
    main node, so a worker with another ``num_machines`` would train and then hang for
    5 minutes in torchrun's exit barrier: caught here instead.)
    """
    view = {**env.view().as_dict(), "plan_digest": plan_digest, "plan_summary": plan_summary}
    store_at = env.rendezvous()
    if view["world_size"] == 1 or store_at is None:
        return view
    import torch.distributed as dist

    store = dist.TCPStore(*store_at, is_master=False, timeout=timedelta(seconds=timeout_s))
    prefix = f"finetune_kit/launch/{env.restart_count()}"
    if store.add(f"{prefix}/claims/{view['rank']}", 1) > 1:
        raise ConfigError(f"two processes claim global rank {view['rank']} (this one is on {view['host']}, "
                          f"machine_rank {view['machine_rank']}): two nodes share a machine_rank. Give every "
                          "node its own machine_rank (main 0, workers 1, 2, ...).")
    store.set(f"{prefix}/rank/{view['rank']}", json.dumps(view))
    for rank in range(view["world_size"]):
        try:
            store.wait([f"{prefix}/rank/{rank}"])
        except Exception as err:  # the store raises a timeout as DistStoreError or RuntimeError
            raise ConfigError(
                f"rank {rank} did not report within {timeout_s:.0f} s (this is rank {view['rank']} of "
                f"{view['world_size']} on machine_rank {view['machine_rank']}). Start every node with the same "
                "num_machines/num_processes and its own machine_rank, or raise --rendezvous-timeout "
                "if nodes start far apart."
            ) from err
        other = json.loads(store.get(f"{prefix}/rank/{rank}"))
        for key in ("num_machines", "world_size", "local_world_size"):
            if other[key] != view[key]:
                raise ConfigError(
                    f"the nodes disagree on {key}: machine_rank {view['machine_rank']} ({view['host']}) has "
                    f"{view[key]}, machine_rank {other['machine_rank']} ({other['host']}) has {other[key]}. "
                    "Use the same num_machines and num_processes in every node's accelerate config "
                    "(python -m finetune_kit.launch.multinode MAIN.yaml WORKER.yaml checks a pair)."
                )
        if other["plan_digest"] != view["plan_digest"]:
            raise ConfigError(
                f"the ranks decided different launch plans: rank {view['rank']} on {view['host']} has "
                f"{view['plan_summary']!r}, rank {other['rank']} on {other['host']} has {other['plan_summary']!r}; "
                "their schedules would differ and the run would hang. Give every rank the same flags and "
                "FINETUNE_GPU_MEMORY_GIB, and with --levers auto the same --levers-gpu (or GPUs of one kind)."
            )
    return view


def main(argv: list[str] | None = None) -> None:
    parser = command_line.ArgumentParser(prog="python -m finetune_kit.launch.multinode",
                                         description="Check that two nodes' accelerate configs form one job.")
    parser.add_argument("main_config", help="accelerate YAML of the main node (machine_rank 0)")
    parser.add_argument("worker_config", help="accelerate YAML of a worker node")
    parser.add_argument("--node-rank", type=int, default=None, help="the machine_rank this node is meant to have")
    parser.add_argument("--num-processes", type=int, default=None,
                        help="total processes over all nodes, as accelerate launch --num_processes overrides the YAMLs")
    args = parser.parse_args(argv)
    try:
        main_config, worker_config = load_launch_config(args.main_config), load_launch_config(args.worker_config)
        if args.num_processes is not None:
            main_config["num_processes"] = worker_config["num_processes"] = args.num_processes
        print(check_pair(main_config, worker_config, args.main_config, args.worker_config, node_rank=args.node_rank))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
