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

STATE_FILE = "trainer_state.json"  # the same name as the Trainer's, written last in both layouts
MANIFEST = "manifest.json"  # files and sizes of a complete checkpoint (recipe layout)
PARTIAL = ".partial"  # suffix of a checkpoint still being written
FINISHED = "run_record.json"  # written at the end of a run: the output holds finished work
PREFIX = "step_"


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


def clean_partial(output: Path) -> list[Path]:
    """Delete the folders of interrupted saves (never complete checkpoints); return them."""
    root = checkpoint_root(output)
    removed = sorted(root.glob(f"{PREFIX}*{PARTIAL}")) if root.is_dir() else []
    for path in removed:
        shutil.rmtree(path)
    return removed


def save_checkpoint(accelerator, output: Path, step: int, state: dict, keep: int) -> Path:
    """Save a resumable checkpoint atomically (all ranks must call); then prune to the newest ``keep``."""
    path = checkpoint_path(output, step)
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


def load_checkpoint(accelerator, path: Path, **load_kwargs) -> dict:
    """Restore model, optimizer, scheduler and RNG states; return the trainer state.

    ``load_kwargs`` go to ``accelerator.load_state`` (under DeepSpeed: ``load_checkpoint``).
    """
    accelerator.load_state(str(path), **load_kwargs)
    return json.loads((Path(path) / STATE_FILE).read_text())


def save_consolidated(accelerator, model, tokenizer, out: Path) -> Path:
    """Gather the full 16-bit weights (ZeRO-3: needs stage3_gather_16bit_weights_on_model_save)
    and write safetensors plus tokenizer. All ranks must call; rank 0 writes."""
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(out)
    accelerator.wait_for_everyone()
    return Path(out)
