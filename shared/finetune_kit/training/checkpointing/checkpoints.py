"""Where a run's checkpoints live, how one is written whole, and which one a launch resumes.

Layout under a run's output folder::

    checkpoints/step_000050/   accelerate.save_state: DeepSpeed shards (model, optimizer,
                               scheduler), RNG states, and trainer_state.json

A checkpoint is written whole or not at all: every rank saves into
``step_000050.partial/`` and checksums the files it wrote (xxh3-64); once all have finished,
rank 0 writes ``trainer_state.json`` and ``manifest.json`` (every file, its size and its
checksum), then renames the folder to ``step_000050``. Only then are checkpoints beyond the
newest ``--keep-checkpoints`` deleted, so the last complete one always survives a failed save.
A ``.partial`` folder (a save that was interrupted) is never resumed from; the next launch
deletes it and says so. Before anything loads, a resume checks every file's size and then its
checksum against the manifest (a manifest of sizes only, from an older save, is checked for
sizes, with a note). The checkpoints folder must be one that every node sees.

``--resume auto`` (the default) makes relaunching the same command continue from the newest
complete checkpoint that verifies -- a damaged newer one is named in one line, left in place,
and skipped -- and start fresh when there is none. A finished run (``run_record.json``
written) is never overwritten: train on with ``--resume latest``, or pick a new output.

Recipes driven by the Hugging Face ``Trainer`` keep its own layout instead
(``TRAINER_LAYOUT``: ``<output_dir>/checkpoint-50/``, resumed with ``--resume_from_checkpoint``;
an output folder that already holds checkpoints must be resumed or replaced).
"""

from __future__ import annotations

import json
import mmap
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from finetune_kit.errors import ConfigError
from finetune_kit.training.disk_full import MARGIN as FREE_SPACE_MARGIN
from finetune_kit.training.disk_full import free_bytes, gib, room_for, short_of_room

STATE_FILE = "trainer_state.json"  # the same name as the Trainer's, written last in both layouts
MANIFEST = "manifest.json"  # files, sizes and checksums of a complete checkpoint (recipe layout)
CHECKSUM = "xxh3_64"  # xxhash's XXH3, 64 bits: 7.2 GiB/s from the page cache on a 2-core EPYC (crc32: 1.4, sha256: 0.9)
PARTIAL = ".partial"  # suffix of a checkpoint still being written
FINISHED = "run_record.json"  # written at the end of a run: the output holds finished work
PREFIX = "step_"
DS_TAG = "pytorch_model"  # the folder accelerate.save_state gives DeepSpeed's own checkpoint


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


def resolve_resume(resume: str | None, output: Path, layout: Layout = RECIPE_LAYOUT,
                   report: Callable[[str], None] = print) -> Path | None:
    """The checkpoint to resume from, or None for a fresh run; raise on a risky start.

    ``resume`` is ``"auto"`` (the newest complete checkpoint that verifies, if any, else fresh; never
    over a finished run), None (fresh; refused if there are checkpoints), ``"latest"`` (the newest
    checkpoint under ``output`` that verifies), or a checkpoint folder (refused if it does not verify).
    Verified: every file's size and checksum against the manifest. ``report`` gets the one-line notes:
    a damaged checkpoint passed over, a manifest of sizes only.
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
        return _newest_intact(existing, layout, report) if existing else None
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
        return _newest_intact(existing, layout, report)
    path = Path(resume)
    if not (path / STATE_FILE).is_file() or (layout.atomic and not (path / MANIFEST).is_file()):
        raise ConfigError(f"{flag} '{resume}' is not a complete checkpoint folder (no "
                          f"{STATE_FILE if not (path / STATE_FILE).is_file() else MANIFEST}: an interrupted save, or "
                          f"not a checkpoint). Complete checkpoints live under '{root}'.")
    if layout.atomic:
        verify(path, report)
    return path


OUTPUTS = ("model", "adapter", "merged")  # what the recipes write at the end of a run


def _check_no_outputs(output: Path, flag: str) -> None:
    """A fresh start must not overwrite a model or adapter an earlier, unfinished run left."""
    found = [name for name in OUTPUTS if (Path(output) / name).is_dir()]
    if found:
        raise ConfigError(
            f"output folder '{output}' holds {', '.join(f'{n}/' for n in found)} from an earlier run that has no "
            f"checkpoint to continue and did not finish ({FINISHED} missing); a fresh start would overwrite it. "
            "Choose a new output folder, or move those folders away; nothing was overwritten.")


def _newest_intact(existing: list[Path], layout: Layout, report: Callable[[str], None]) -> Path:
    """The newest of ``existing`` that verifies (the recipe layout; the Trainer's has no manifest: the newest);
    each damaged one passed over is named in one line. ConfigError if none verifies."""
    if not layout.atomic:
        return existing[-1]
    passed = []
    for path in reversed(existing):
        problem = damage(path)
        if problem is None:
            for bad, why in passed:
                report(f"not resuming from {bad}: it is damaged ({why}); resuming from {path.name}, the newest "
                       "checkpoint that verifies. The damaged one is left in place; a later save of its step "
                       "replaces it.")
            verify(path, report)  # the note of a manifest of sizes only
            return path
        passed.append((path, problem))
    raise ConfigError(f"every checkpoint under '{existing[0].parent}' is damaged (the newest, {existing[-1].name}: "
                      f"{passed[0][1]}). Move them away to start fresh, or restore one from a copy; nothing was "
                      "deleted.")


def checksum(path: Path) -> str:
    """``path``'s contents hashed with :data:`CHECKSUM` (memory-mapped: no copy through Python)."""
    import xxhash

    with open(path, "rb") as f:
        if Path(path).stat().st_size == 0:
            return xxhash.xxh3_64_hexdigest(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return xxhash.xxh3_64_hexdigest(view)


_WRITER = re.compile(r"(?:zero_pp_rank_|random_states_|^__)(\d+)_?")  # DeepSpeed's, accelerate's, DCP's rank files


def writer(name: str) -> int:
    """The rank that wrote a checkpoint file, by its name (its own shard, RNG state or DCP file); else rank 0."""
    found = _WRITER.search(Path(name).name)
    return int(found.group(1)) if found else 0


def own_checksums(path: Path, rank: int) -> dict[str, str]:
    """The checksums of the files under ``path`` that ``rank`` wrote (:func:`writer`): each rank hashes its own
    files, which its node's page cache still holds, all ranks at once."""
    return {name: checksum(Path(path) / name) for name in _files(path) if writer(name) == rank}


def _files(path: Path) -> list[str]:
    return [str(f.relative_to(path)) for f in sorted(Path(path).rglob("*")) if f.is_file() and f.name != MANIFEST]


def write_manifest(path: Path, checksums: dict[str, str] | None = None, **timings: float) -> dict:
    """Record every file under ``path`` with its size (bytes) and its checksum in ``manifest.json``:
    ``checksums`` where given (the writing ranks'), computed here for the rest. ``timings``: seconds."""
    names = _files(path)
    given = checksums or {}
    files = {name: (Path(path) / name).stat().st_size for name in names}
    sums = {name: given[name] if name in given else checksum(Path(path) / name) for name in names}
    manifest = {"files": files, "bytes": sum(files.values()), "checksum": CHECKSUM, "checksums": sums, **timings}
    (Path(path) / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def damage(path: Path) -> str | None:
    """None if every file of ``path``'s manifest is there with its size and its checksum (sizes first, all of
    them: the cheap check); else what is wrong with the first file that fails, naming it."""
    manifest = json.loads((Path(path) / MANIFEST).read_text())
    for name, size in manifest["files"].items():
        f = Path(path) / name
        got = f.stat().st_size if f.is_file() else None
        if got != size:
            return f"{name} is missing" if got is None else f"{name} has {got:,} bytes, the manifest says {size:,}"
    for name, want in manifest.get("checksums", {}).items():
        if checksum(Path(path) / name) != want:
            return (f"{name} has the size the manifest says but not its contents ({manifest['checksum']} "
                    f"{want} when saved)")
    return None


def verify(path: Path, report: Callable[[str], None] = print) -> Path:
    """``path`` if every file of its manifest is there with its size and checksum; else ConfigError naming the
    first that is not. A manifest of sizes only (a save before checksums) passes on its sizes, with a note."""
    problem = damage(path)
    if problem:
        raise ConfigError(
            f"checkpoint '{path}' is damaged: {problem}. Resume from another checkpoint (--resume <folder>; "
            f"--resume auto takes the newest that verifies), or restore this one from a copy; nothing was deleted.")
    if "checksums" not in json.loads((Path(path) / MANIFEST).read_text()):
        report(f"note: checkpoint '{path}' has a manifest of file sizes only (saved before checksums were "
               "written): its sizes match; its contents are not checked.")
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
    first one) with a margin; otherwise every rank raises ConfigError and nothing is touched. A disk
    that fills while it is written (another writer, a quota) stops every rank with
    :class:`~finetune_kit.training.disk_full.DiskFull`: the partial folder is removed, the complete
    checkpoints are untouched (none is pruned before the new one is complete)."""
    path, needed = checkpoint_path(output, step), predicted_bytes(output, estimate)
    problem = free_space_problem(output, needed) if accelerator.is_main_process else None
    problem = same_on_every_rank(accelerator, problem)
    newest = list_checkpoints(output)
    kept = f"the newest complete checkpoint is {newest[-1]}" if newest else "no checkpoint was saved yet"
    if problem:
        raise ConfigError(f"not saving the step-{step} checkpoint: {problem}; {kept}. Relaunch the same "
                          "command once there is room: it resumes from the newest complete checkpoint.")
    partial = path.with_name(path.name + PARTIAL)
    if accelerator.is_main_process and partial.exists():
        shutil.rmtree(partial)  # an earlier, interrupted save of the same step
    accelerator.wait_for_everyone()
    with room_for(checkpoint_root(output), partial, needed, what=f"the step-{step} checkpoint",
                  kept=f"{kept[0].upper()}{kept[1:]} (kept). {_ROOM_FIX}", writer=accelerator.is_main_process):
        began = time.perf_counter()
        accelerator.save_state(str(partial))
        accelerator.wait_for_everyone()  # every rank's shards are on disk
        saved = time.perf_counter()
        sums = _gathered(accelerator, own_checksums(partial, accelerator.process_index))  # each rank its own files
        hashed = time.perf_counter()
        if accelerator.is_main_process:
            (partial / STATE_FILE).write_text(json.dumps(state, indent=2))
            write_manifest(partial, sums, save_seconds=round(saved - began, 4),
                           checksum_seconds=round(hashed - saved, 4))
        accelerator.wait_for_everyone()  # the manifest written: a failure to write it stops every rank here
    if accelerator.is_main_process:
        if path.exists():  # the same step saved before (a resumed run): replaced only now, complete
            shutil.rmtree(path)
        partial.rename(path)
        if keep > 0:
            for old in list_checkpoints(output)[:-keep]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return path


_ROOM_FIX = ("Free space on that disk (--keep-checkpoints 1 keeps only the newest checkpoint) or point --output at a "
             "larger one, then relaunch the same command: it resumes from the newest complete checkpoint.")


def _gathered(accelerator, checksums: dict[str, str]) -> dict[str, str]:
    """Every rank's checksums, merged (on every rank)."""
    if getattr(accelerator, "num_processes", 1) == 1:
        return checksums
    from accelerate.utils import gather_object

    return {name: value for part in gather_object([checksums]) for name, value in part.items()}


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


def final_save_bytes(total_params: int, trainable_params: int, *, adapted: bool, save_model: bool = True,
                     merge: bool = False) -> int:
    """The end of a run's saves: model/ in bf16 (2 bytes a parameter), or adapter/ (at most 4 bytes a trained
    parameter: fp32), plus merged/ in bf16 with ``merge``; nothing without ``save_model``."""
    if not save_model:
        return 0
    return (4 * trainable_params if adapted else 2 * total_params) + (2 * total_params if merge else 0)


def planned_room_warning(output: Path, checkpoint: int, keep: int, final: int, layout: Layout = RECIPE_LAYOUT,
                         keep_flag: str = "--keep-checkpoints") -> str | None:
    """None if the disk of ``output`` holds what the run will keep there at once: ``keep`` + 1 checkpoints of
    ``checkpoint`` bytes (the new one is complete before the oldest is deleted; ``keep`` 0, all kept: two are
    counted) and the final save's ``final`` bytes; else a one-line warning with the numbers."""
    count = keep + 1 if keep > 0 else 2
    root = checkpoint_root(output, layout)
    existing = next(p for p in (root, *root.parents) if p.exists())
    held = sum(f.stat().st_size for c in list_checkpoints(output, layout) for f in c.rglob("*") if f.is_file())
    free, needed = free_bytes(root), count * checkpoint + final
    if free + held >= needed:  # the checkpoints already there count: rotation deletes them
        return None
    kept = f"{keep_flag} {keep} keeps {keep} at once" if keep > 0 else f"{keep_flag} 0 keeps every one (counted: 2)"
    return (f"warning: '{existing}' has {gib(free)} free; this run needs about {gib(needed)} there ({count} "
            f"checkpoints of {gib(checkpoint)}: {kept}, plus one being written; and {gib(final)} for the final "
            f"save). It starts, but a save will stop it once the disk is full: free space, lower {keep_flag}, or point "
            "the output at a larger disk.")


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
    if short_of_room(root, needed) is None:
        return None
    free = free_bytes(root)
    keep = "--keep-checkpoints 1" if layout.atomic else "--save_total_limit 1"
    return (f"'{root}' has {gib(free)} free and a checkpoint takes about {gib(needed)} (x{FREE_SPACE_MARGIN} "
            f"margin). Free space on that disk ({keep} keeps only the newest checkpoint), or point the output "
            "at a larger disk")


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

