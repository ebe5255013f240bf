"""Where a run's checkpoints live, how one is written whole, and which one a launch resumes.

Layout under a run's output folder::

    checkpoints/step_000050/   accelerate.save_state: DeepSpeed shards (model, optimizer,
                               scheduler), RNG states, and trainer_state.json

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

STATE_FILE = "trainer_state.json"  # the same name as the Trainer's, written last in both layouts
MANIFEST = "manifest.json"  # files and sizes of a complete checkpoint (recipe layout)
PARTIAL = ".partial"  # suffix of a checkpoint still being written
FINISHED = "run_record.json"  # written at the end of a run: the output holds finished work
PREFIX = "step_"
DS_TAG = "pytorch_model"  # the folder accelerate.save_state gives DeepSpeed's own checkpoint
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


def read_state(path: Path) -> dict:
    """A checkpoint's ``trainer_state.json``: position, ranks, global batch, the run's identity."""
    return json.loads((Path(path) / STATE_FILE).read_text())


def load_checkpoint(accelerator, path: Path, state: bool = True, **load_kwargs) -> dict | None:
    """Restore model, optimizer, scheduler and RNG states; return the trainer state (if ``state``).

    ``load_kwargs`` go to ``accelerator.load_state`` (under DeepSpeed: ``load_checkpoint``).
    """
    accelerator.load_state(str(path), **load_kwargs)
    return read_state(path) if state else None

