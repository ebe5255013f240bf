"""Resuming on another number of ranks than saved the checkpoint.

ZeRO-3 checkpoints of the recipe layout resume on any number of ranks, with the same global
batch: DeepSpeed's universal checkpoint format (converted once, beside the checkpoint) under
DeepSpeed, ``torch.distributed.checkpoint``'s own resharding under FSDP2; the data position is
recounted in the new launch's micro-batches. What cannot reshape (ZeRO-2, NVMe swap files,
another global batch) is refused by the input checks with the launch that would work.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from finetune_kit import command_line
from finetune_kit.errors import ConfigError
from finetune_kit.launch import env, nvme
from finetune_kit.training.arguments import global_batch
from finetune_kit.training.checkpointing import checkpoints
from finetune_kit.training.checkpointing.checkpoints import DS_TAG, PARTIAL, read_state

UNIVERSAL = "universal"  # DeepSpeed's universal checkpoint of a checkpoint, for another number of ranks


def saved_world(path: Path) -> int | None:
    """The number of ranks that saved the checkpoint (None for checkpoints that predate the record)."""
    return read_state(path).get("world_size")


def trainer_saved_world(path: Path) -> int | None:
    """Ranks that saved an HF Trainer checkpoint: its ZeRO optimizer partitions (one per rank)."""
    ranks = {f.name.split("zero_pp_rank_")[1].split("_")[0] for f in Path(path).glob("global_step*/*zero_pp_rank_*")}
    return len(ranks) or None


def universal_folder(path: Path) -> Path:
    """Where :func:`to_universal` writes the checkpoint's rank-independent copy: ``<path>/universal``, laid
    out as accelerate's ``load_state`` reads it (``universal/pytorch_model/``)."""
    return Path(path) / UNIVERSAL


def to_universal(path: Path, workers: int = 4) -> Path:
    """Convert a DeepSpeed checkpoint saved on N ranks into DeepSpeed's universal format (every
    parameter and optimizer state whole, one folder per parameter), which any number of ranks loads
    with ``checkpoint.load_universal``. Done once; later calls return the existing copy.

    A resume on another number of ranks calls it on rank 0 while the others wait, which must fit in
    the collective timeout; for a large model, convert first (``workers`` processes):
    ``python -m finetune_kit.training.checkpointing.resharding to-universal <checkpoint>``."""
    import argparse

    from deepspeed.checkpoint import ds_to_universal

    out = universal_folder(path)
    if (out / DS_TAG / "zero").is_dir():
        return out
    tmp = out.with_name(out.name + PARTIAL)
    shutil.rmtree(tmp, ignore_errors=True)
    ds_to_universal.main(argparse.Namespace(
        input_folder=str(Path(path) / DS_TAG), output_folder=str(tmp / DS_TAG), num_extract_workers=workers,
        num_merge_workers=workers, keep_temp_folder=False, strict=True, inject_missing_state=False))
    tmp.rename(out)
    return out


def reshaped_position(state: dict, *, data_ranks: int, micro_batch: int) -> dict:
    """The data position of a checkpoint, counted in this launch's micro-batches per data rank (the same sequences
    consumed, the global batch being the same). A checkpoint says which ``data_ranks`` (ranks reading different rows:
    the ranks of a sequence-parallel group read the same) and ``micro_batch`` counted its position; one saved before it
    said so counted every rank a data rank and had this launch's micro-batch."""
    saved_ranks = state.get("data_ranks", state.get("world_size", data_ranks))
    consumed = state["batch_in_epoch"] * saved_ranks * state.get("micro_batch", micro_batch)  # sequences of all ranks
    return {**state, "batch_in_epoch": consumed // (data_ranks * micro_batch)}


def check_reshape(checkpoint: Path, args, zero_stage: int, ds_config: dict | None = None,
                  data_ranks: int | None = None) -> None:
    """A checkpoint of another number of ranks resumes exactly only with the same global batch, and
    not at all when it offloads to NVMe (its swap files are per rank). ``data_ranks``: the launch's
    (:attr:`~finetune_kit.training.input_checks.CheckedLaunch.data_ranks`); None: every rank reads its own."""
    state = read_state(checkpoint)
    saved, world = state.get("world_size"), env.world_size()
    if not saved or saved == world:
        return
    if nvme.nvme_paths(ds_config or {}):
        raise ConfigError(f"checkpoint '{checkpoint}' was saved by {ranks(saved)}, this launch has {world}: "
                          "a run that offloads to NVMe resumes on the same number of ranks (its swap files are "
                          f"per rank). Launch {ranks(saved)}.")
    if zero_stage != 3:
        raise ConfigError(f"checkpoint '{checkpoint}' was saved by {ranks(saved)}, this launch has {world}: "
                          f"resuming on another number of ranks is supported under ZeRO-3. Launch {ranks(saved)}.")
    given = global_batch(args, world if data_ranks is None else data_ranks)
    if given != state["global_batch"]:
        accum = state["global_batch"] / (args.micro_batch_size * world)
        fix = (f"pass --grad-accum {accum:g}" if accum.is_integer() else
               f"choose --micro-batch-size and --grad-accum whose product is {state['global_batch'] / world:g}")
        raise ConfigError(
            f"checkpoint '{checkpoint}' was saved by {ranks(saved)} with {state['global_batch']} sequences per "
            f"optimizer step; this launch's {world} ranks take {args.micro_batch_size} x {args.grad_accum} x {world} "
            f"= {given}. Keep the global batch so that the schedule and the data position carry over: {fix}.")


def ranks(n: int) -> str:
    return f"{n} rank" + ("" if n == 1 else "s")


def main(argv=None) -> None:
    parser = command_line.ArgumentParser(prog="python -m finetune_kit.training.checkpointing.resharding")
    parser.add_argument("command", choices=["to-universal"])
    parser.add_argument("checkpoint", type=Path, help="a complete checkpoint folder (checkpoints/step_N)")
    parser.add_argument("--workers", type=int, default=4, help="processes reading and merging the shards")
    cli = parser.parse_args(argv)
    if not (cli.checkpoint / checkpoints.MANIFEST).is_file():
        parser.error(f"'{cli.checkpoint}' is not a complete checkpoint folder (no {checkpoints.MANIFEST})")
    print(f"universal checkpoint: {to_universal(checkpoints.verify(cli.checkpoint), cli.workers)}")


if __name__ == "__main__":
    main()
