"""Resumable DeepSpeed checkpoints and the final consolidated 16-bit model.

Layout under a run's output folder::

    checkpoints/step_000050/   accelerate.save_state: DeepSpeed shards (model, optimizer,
                               scheduler), RNG states, and trainer_state.json
    model/                     consolidated safetensors + tokenizer, loadable with plain
                               AutoModelForCausalLM.from_pretrained

Recipes driven by the Hugging Face ``Trainer`` keep its own layout instead
(``TRAINER_LAYOUT``: ``<output_dir>/checkpoint-50/``, resumed with ``--resume_from_checkpoint``).

An output folder that already holds checkpoints is never overwritten silently: the run
must be resumed (``--resume``) or pointed at a new folder.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from finetune_kit.errors import ConfigError

STATE_FILE = "trainer_state.json"  # the same name as the Trainer's, written last in both layouts
PREFIX = "step_"


@dataclass(frozen=True)
class Layout:
    """Where a recipe keeps its checkpoints and how its command line resumes them."""

    subdir: str  # folder under the run's output that holds the checkpoints ("" = the output itself)
    prefix: str  # checkpoint folder = prefix + step number
    resume_flag: str


RECIPE_LAYOUT = Layout("checkpoints", PREFIX, "--resume")
TRAINER_LAYOUT = Layout("", "checkpoint-", "--resume_from_checkpoint")  # transformers.Trainer's own


def checkpoint_root(output: Path, layout: Layout = RECIPE_LAYOUT) -> Path:
    return Path(output) / layout.subdir


def checkpoint_path(output: Path, step: int) -> Path:
    return checkpoint_root(output) / f"{PREFIX}{step:06d}"


def list_checkpoints(output: Path, layout: Layout = RECIPE_LAYOUT) -> list[Path]:
    """Complete checkpoints (those with a trainer state), oldest first."""
    root = checkpoint_root(output, layout)
    if not root.is_dir():
        return []
    found = [p for p in root.glob(f"{layout.prefix}*")
             if p.name[len(layout.prefix):].isdigit() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(layout.prefix):]))


def resolve_resume(resume: str | None, output: Path, layout: Layout = RECIPE_LAYOUT) -> Path | None:
    """The checkpoint to resume from, or None for a fresh run; raise on a risky start.

    ``resume`` is None (fresh run), ``"latest"`` (newest checkpoint under ``output``),
    or a checkpoint folder.
    """
    existing = list_checkpoints(output, layout)
    flag, root = layout.resume_flag, checkpoint_root(output, layout)
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
        return existing[-1]
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise ConfigError(f"{flag} '{resume}' is not a complete checkpoint folder (no {STATE_FILE}). "
                          f"Checkpoints live under '{root}'.")
    return path


def save_checkpoint(accelerator, output: Path, step: int, state: dict, keep: int) -> Path:
    """Save a resumable checkpoint (all ranks must call) and prune to the newest ``keep``."""
    path = checkpoint_path(output, step)
    accelerator.save_state(str(path))
    if accelerator.is_main_process:
        (path / STATE_FILE).write_text(json.dumps(state, indent=2))  # written last: marks complete
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
