"""Resumable DeepSpeed checkpoints and the final consolidated 16-bit model.

Layout under a run's output folder::

    checkpoints/step_000050/   accelerate.save_state: DeepSpeed shards (model, optimizer,
                               scheduler), RNG states, and trainer_state.json
    model/                     consolidated safetensors + tokenizer, loadable with plain
                               AutoModelForCausalLM.from_pretrained

A checkpoint is written whole or not at all: every rank saves into
``step_000050.partial/``; once all have finished, rank 0 writes ``manifest.json`` (every
file and its size) and ``trainer_state.json``, then renames the folder to ``step_000050``.
Only then are checkpoints beyond the newest ``--keep-checkpoints`` deleted, so the last
complete one always survives a failed save. A ``.partial`` folder (a save that was
interrupted) is never resumed from; the next launch deletes it and says so. Resuming checks
the files against the manifest. The checkpoints folder must be one that every node sees.

``--resume auto`` (the default) makes relaunching the same command continue from the newest
complete checkpoint, and start fresh when there is none. A finished run (``run_record.json``
written) is never overwritten: train on with ``--resume latest``, or pick a new output.

Recipes driven by the Hugging Face ``Trainer`` keep its own layout instead
(``TRAINER_LAYOUT``: ``<output_dir>/checkpoint-50/``, resumed with ``--resume_from_checkpoint``;
an output folder that already holds checkpoints must be resumed or replaced).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from finetune_kit.errors import ConfigError
from finetune_kit.outputs import written_whole

STATE_FILE = "trainer_state.json"  # the same name as the Trainer's, written last in both layouts
MANIFEST = "manifest.json"  # files and sizes of a complete checkpoint (recipe layout)
PARTIAL = ".partial"  # suffix of a checkpoint still being written
FINISHED = "run_record.json"  # written at the end of a run: the output holds finished work
PREFIX = "step_"
FREE_SPACE_MARGIN = 1.1  # free disk needed = the checkpoint's predicted size x this


@dataclass(frozen=True)
class Layout:
    """Where a recipe keeps its checkpoints and how its command line resumes them."""

    subdir: str  # folder under the run's output that holds the checkpoints ("" = the output itself)
    prefix: str  # checkpoint folder = prefix + step number
    resume_flag: str
    atomic: bool = False  # written under a temporary name, complete only with its manifest


RECIPE_LAYOUT = Layout("checkpoints", PREFIX, "--resume", atomic=True)
TRAINER_LAYOUT = Layout("", "checkpoint-", "--resume_from_checkpoint")  # transformers.Trainer's own


def checkpoint_root(output: Path, layout: Layout = RECIPE_LAYOUT) -> Path:
    return Path(output) / layout.subdir


def checkpoint_path(output: Path, step: int) -> Path:
    return checkpoint_root(output) / f"{PREFIX}{step:06d}"


def list_checkpoints(output: Path, layout: Layout = RECIPE_LAYOUT) -> list[Path]:
    """Complete checkpoints (a trainer state, and a manifest where the layout writes one), oldest first."""
    root = checkpoint_root(output, layout)
    if not root.is_dir():
        return []
    found = [p for p in root.glob(f"{layout.prefix}*")
             if p.name[len(layout.prefix):].isdigit() and (p / STATE_FILE).is_file()
             and (not layout.atomic or (p / MANIFEST).is_file())]
    return sorted(found, key=lambda p: int(p.name[len(layout.prefix):]))


def resolve_resume(resume: str | None, output: Path, layout: Layout = RECIPE_LAYOUT) -> Path | None:
    """The checkpoint to resume from, or None for a fresh run; raise on a risky start.

    ``resume`` is ``"auto"`` (the newest complete checkpoint if any, else fresh; never over a
    finished run), None (fresh; refused if there are checkpoints), ``"latest"`` (the newest
    checkpoint under ``output``), or a checkpoint folder. A chosen checkpoint is verified
    against its manifest.
    """
    existing = list_checkpoints(output, layout)
    flag, root = layout.resume_flag, checkpoint_root(output, layout)
    if resume == "auto" and (Path(output) / FINISHED).is_file():
        held = f" and already holds {len(existing)} checkpoint(s) (newest: {existing[-1].name})" if existing else ""
        raise ConfigError(
            f"output folder '{output}' holds a finished run ({FINISHED}){held}. Choose a new output folder, or "
            f"pass {flag} latest to train on from its newest checkpoint; nothing was overwritten."
        )
    if resume == "auto":
        if not existing:
            _check_no_outputs(output, flag)
        return _checked(existing[-1], layout) if existing else None
    if resume is None:
        if existing:
            raise ConfigError(
                f"output folder '{output}' already holds {len(existing)} checkpoint(s) (newest: "
                f"{existing[-1].name}). Pass {flag} to continue that run, or choose a new "
                "output folder; nothing was overwritten."
            )
        return None
    if resume == "latest":
        if not existing:
            raise ConfigError(f"{flag}: no checkpoint found under '{root}'. "
                              f"Start without {flag}, or pass the checkpoint folder explicitly.")
        return _checked(existing[-1], layout)
    path = Path(resume)
    if not (path / STATE_FILE).is_file() or (layout.atomic and not (path / MANIFEST).is_file()):
        raise ConfigError(f"{flag} '{resume}' is not a complete checkpoint folder (no "
                          f"{STATE_FILE if not (path / STATE_FILE).is_file() else MANIFEST}: an interrupted save, or "
                          f"not a checkpoint). Complete checkpoints live under '{root}'.")
    return _checked(path, layout)


OUTPUTS = ("model", "adapter", "merged")  # what the recipes write at the end of a run


def _check_no_outputs(output: Path, flag: str) -> None:
    """A fresh start must not overwrite a model or adapter an earlier, unfinished run left."""
    found = [name for name in OUTPUTS if (Path(output) / name).is_dir()]
    if found:
        raise ConfigError(
            f"output folder '{output}' holds {', '.join(f'{n}/' for n in found)} from an earlier run that has no "
            f"checkpoint to continue and did not finish ({FINISHED} missing); a fresh start would overwrite it. "
            "Choose a new output folder, or move those folders away; nothing was overwritten.")


def _checked(path: Path, layout: Layout) -> Path:
    return verify(path) if layout.atomic else path


def write_manifest(path: Path) -> dict:
    """Record every file under ``path`` with its size (bytes) in ``manifest.json``."""
    files = {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*"))
             if f.is_file() and f.name != MANIFEST}
    manifest = {"files": files, "bytes": sum(files.values())}
    (path / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def verify(path: Path) -> Path:
    """``path`` if every file of its manifest is there with its size; else ConfigError naming it."""
    manifest = json.loads((Path(path) / MANIFEST).read_text())
    for name, size in manifest["files"].items():
        f = Path(path) / name
        got = f.stat().st_size if f.is_file() else None
        if got != size:
            state = "is missing" if got is None else f"has {got:,} bytes, the manifest says {size:,}"
            raise ConfigError(
                f"checkpoint '{path}' is damaged: {name} {state}. Resume from an earlier checkpoint "
                f"(--resume <folder>), or move this one away to resume from the one before it."
            )
    return Path(path)


def clean_partial(output: Path, layout: Layout = RECIPE_LAYOUT) -> list[Path]:
    """Delete the folders of interrupted saves (never complete checkpoints); return them. In the
    recipe layout: ``step_N.partial``; in the Trainer's: ``checkpoint-N`` without its trainer state
    (the Trainer writes it last, after DeepSpeed's barrier at the end of every rank's save)."""
    root = checkpoint_root(output, layout)
    if not root.is_dir():
        return []
    if layout.atomic:
        removed = sorted(root.glob(f"{layout.prefix}*{PARTIAL}"))
    else:
        removed = sorted(p for p in root.glob(f"{layout.prefix}*") if p.is_dir()
                         and p.name[len(layout.prefix):].isdigit() and not (p / STATE_FILE).is_file())
    for path in removed:
        shutil.rmtree(path)
    return removed


def save_checkpoint(accelerator, output: Path, step: int, state: dict, keep: int, estimate: int = 0) -> Path:
    """Save a resumable checkpoint atomically (all ranks must call); then prune to the newest ``keep``.

    First, the disk must hold it: the size of the newest checkpoint (or ``estimate`` bytes for the
    first one) with a margin; otherwise every rank raises ConfigError and nothing is touched."""
    path = checkpoint_path(output, step)
    problem = free_space_problem(output, predicted_bytes(output, estimate)) if accelerator.is_main_process else None
    problem = same_on_every_rank(accelerator, problem)
    if problem:
        newest = list_checkpoints(output)
        kept = f"the newest complete checkpoint is {newest[-1]}" if newest else "no checkpoint was saved yet"
        raise ConfigError(f"not saving the step-{step} checkpoint: {problem}; {kept}. Relaunch the same "
                          "command once there is room: it resumes from the newest complete checkpoint.")
    partial = path.with_name(path.name + PARTIAL)
    if accelerator.is_main_process and partial.exists():
        shutil.rmtree(partial)  # an earlier, interrupted save of the same step
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()  # every rank's shards are on disk
    if accelerator.is_main_process:
        (partial / STATE_FILE).write_text(json.dumps(state, indent=2))
        write_manifest(partial)
        if path.exists():  # the same step saved before (a resumed run): replaced only now, complete
            shutil.rmtree(path)
        partial.rename(path)
        if keep > 0:
            for old in list_checkpoints(output)[:-keep]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return path


def same_on_every_rank(accelerator, value):
    """Rank 0's ``value`` on every rank (so that all ranks take the same branch)."""
    if getattr(accelerator, "num_processes", 1) == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value], from_process=0)[0]


# ---- room on disk and a folder to write to ----

def estimate_bytes(total_params: int, trainable_params: int, zero_stage: int, model_copy: bool = False) -> int:
    """A DeepSpeed checkpoint's size before the first one exists: fp32 master weights and Adam's two
    moments (12 bytes per trainable parameter), plus the 16-bit module weights below ZeRO-3 (ZeRO-3
    keeps only the partitions; a frozen base, as in QLoRA, is rebuilt from the model, not saved),
    plus a 16-bit copy of the model where the checkpoint holds one too (``model_copy``: the Trainer's)."""
    return 12 * trainable_params + (2 * total_params if zero_stage < 3 else 0) + (2 * total_params if model_copy else 0)


def predicted_bytes(output: Path, estimate: int, layout: Layout = RECIPE_LAYOUT) -> int:
    """The newest complete checkpoint's size (its manifest, or its files), else ``estimate``."""
    existing = list_checkpoints(output, layout)
    if not existing:
        return estimate
    if layout.atomic:
        return int(json.loads((existing[-1] / MANIFEST).read_text())["bytes"])
    return sum(f.stat().st_size for f in existing[-1].rglob("*") if f.is_file())


def free_space_problem(output: Path, needed: int, layout: Layout = RECIPE_LAYOUT) -> str | None:
    """None if the disk of ``output``'s checkpoints has room for ``needed`` bytes (with the margin),
    else a sentence with both numbers and the fix."""
    root = checkpoint_root(output, layout)
    existing = next(p for p in (root, *root.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if free >= needed * FREE_SPACE_MARGIN:
        return None
    keep = "--keep-checkpoints 1" if layout.atomic else "--save_total_limit 1"
    return (f"'{root}' has {_gib(free)} free and a checkpoint takes about {_gib(needed)} (x{FREE_SPACE_MARGIN} "
            f"margin). Free space on that disk ({keep} keeps only the newest checkpoint), or point the output "
            "at a larger disk")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


# ---- a resume must continue the same run ----

def check_same_run(path: Path, identity: dict) -> None:
    """ConfigError if the checkpoint at ``path`` was saved with other ``identity`` values (the model's
    architecture, LoRA settings, ...) than this launch's; checkpoints without them pass."""
    saved = json.loads((Path(path) / STATE_FILE).read_text()).get("run")
    if not saved:
        return
    diffs = [f"{key} {saved.get(key)!r} in the checkpoint, {value!r} now"
             for key, value in identity.items() if saved.get(key) != value]
    if diffs:
        raise ConfigError(f"checkpoint '{path}' belongs to a different run: " + "; ".join(diffs) + ". Relaunch "
                          "with the checkpoint's settings to continue it, or pass a new --output to start over; "
                          "nothing was overwritten.")


# ---- another number of ranks ----
UNIVERSAL = "universal"  # DeepSpeed's universal checkpoint of a checkpoint, for another number of ranks
DS_TAG = "pytorch_model"  # the folder accelerate.save_state gives DeepSpeed's own checkpoint


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
    ``python -m finetune_kit.training.checkpoints to-universal <checkpoint>``."""
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


def reshaped_position(state: dict, saved: int, world: int) -> dict:
    """The data position of a checkpoint saved on ``saved`` ranks, counted in this launch's
    micro-batches per rank (the same examples consumed, the global batch being the same)."""
    consumed = state["batch_in_epoch"] * saved  # micro-batches of all ranks
    return {**state, "batch_in_epoch": consumed // world}


def read_state(path: Path) -> dict:
    """A checkpoint's ``trainer_state.json``: position, ranks, global batch, the run's identity."""
    return json.loads((Path(path) / STATE_FILE).read_text())


def restore_nvme_optimizer(engine, path: Path) -> None:
    """Finish DeepSpeed's load of a ZeRO-3 checkpoint whose optimizer is offloaded to NVMe.

    DeepSpeed 0.19.8 (``engine.load_checkpoint``) copies the checkpoint's swap files back into the
    swap folder, but skips the rank's optimizer state file. Left there, the resumed run differs
    from the uninterrupted one:

    * the optimizer's hyperparameters keep their initial values until the schedule steps again: the
      first update after the resume is made with the schedule's first learning rate (0 in warm-up);
    * Adam's step count restarts, and the fresh optimizer does not know the moment files that were
      copied back: the moments restart at zero;
    * sub-groups too small to swap (DeepSpeed keeps tensors under 1 MiB in memory) lose their fp32
      weights and moments.

    This restores the hyperparameters and step counts from the state file, registers the copied
    moment files with the swapper (read at the next swap-in), and restores the in-memory sub-groups
    and their 16-bit weights. Call it on every rank right after ``accelerator.load_state``.
    """
    import torch

    opt = engine.optimizer  # DeepSpeedZeroOptimizer_Stage3; opt.optimizer is the CPU Adam
    [saved_file] = (Path(path) / DS_TAG).glob(f"*zero_pp_rank_{engine.global_rank}_mp_rank_00_optim_states.pt")
    saved = torch.load(saved_file, weights_only=False, map_location="cpu")["optimizer_state_dict"]
    inner = saved["optimizer_state_dict"]
    for group, saved_group in zip(opt.optimizer.param_groups, inner["param_groups"], strict=True):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    swapper = opt.optimizer_swapper
    for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        state = inner["state"].get(i)
        if not state:
            continue
        if opt._swappable_optimizer_subgroup(i):
            # Placeholders of the right size (no memory); the next swap-in points them at the files' contents.
            numel = opt.fp16_partitioned_groups_flat_numel[i]
            opt.optimizer.state[fp32] = {k: torch.zeros(1, dtype=fp32.dtype).expand(numel) if torch.is_tensor(v)
                                         else v for k, v in state.items()}
            swap_info = swapper._get_param_swap_info(fp32)
            swap_info.tensors, swap_info.has_state_tensors = swap_info.tensors[:1], False
            swapper._update_param_state_info(swap_info, fp32)  # exp_avg-<id>.tensor.swp, ...: the copied files
        else:
            fp32.data.copy_(saved["fp32_flat_groups"][i].data)
            opt.optimizer.state[fp32] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
            opt._reassign_or_swap_out_partitioned_parameters(i)  # the 16-bit weights from the fp32 ones


def load_checkpoint(accelerator, path: Path, state: bool = True, **load_kwargs) -> dict | None:
    """Restore model, optimizer, scheduler and RNG states; return the trainer state (if ``state``).

    ``load_kwargs`` go to ``accelerator.load_state`` (under DeepSpeed: ``load_checkpoint``).
    """
    accelerator.load_state(str(path), **load_kwargs)
    return read_state(path) if state else None


def save_consolidated(accelerator, model, tokenizer, out: Path) -> Path:
    """Gather the full 16-bit weights (ZeRO-3: needs stage3_gather_16bit_weights_on_model_save)
    and write safetensors plus tokenizer. All ranks must call; rank 0 writes. FSDP2 keeps fp32
    weights (its master copy): they are written in the model's own dtype (``config.dtype``, bf16
    for Llama), as DeepSpeed writes its 16-bit weights."""
    import torch

    state_dict = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    dtype = getattr(unwrapped.config, "dtype", None)  # what the model was loaded as
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if accelerator.is_main_process and state_dict and isinstance(dtype, torch.dtype):
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    if accelerator.is_main_process:
        with written_whole(out) as folder:
            unwrapped.save_pretrained(folder, state_dict=state_dict, safe_serialization=True)
            if isinstance(dtype, torch.dtype):  # save_pretrained records the modules' dtype (FSDP2: fp32)
                unwrapped.config.dtype = dtype
                unwrapped.config.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
    accelerator.wait_for_everyone()
    return Path(out)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m finetune_kit.training.checkpoints")
    parser.add_argument("command", choices=["to-universal"])
    parser.add_argument("checkpoint", type=Path, help="a complete checkpoint folder (checkpoints/step_N)")
    parser.add_argument("--workers", type=int, default=4, help="processes reading and merging the shards")
    cli = parser.parse_args()
    if not (cli.checkpoint / MANIFEST).is_file():
        parser.error(f"'{cli.checkpoint}' is not a complete checkpoint folder (no {MANIFEST})")
    print(f"universal checkpoint: {to_universal(verify(cli.checkpoint), cli.workers)}")
