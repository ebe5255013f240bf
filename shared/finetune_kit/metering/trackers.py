"""Experiment trackers through accelerate's tracking API: ``--report-to`` picks one, off by default.

``none`` (the default) sends nothing anywhere; ``tensorboard`` writes event files into
``<output>/tensorboard/<recipe>/``; ``wandb`` and ``mlflow`` log to whatever their own settings
point at (``WANDB_MODE=offline``, ``MLFLOW_TRACKING_URI``; mlflow's default is a local ``mlruns/``).
Metric names are metrics.jsonl's (:mod:`finetune_kit.metering.keys`), at the optimizer step. The
HF Trainer recipe uses the Trainer's own ``--report_to`` with the same choices and names.

None of the tracker packages is in the pinned stack: install the one you pick (the start-of-run
check names the command).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from finetune_kit.errors import ConfigError

# --report-to choice -> the import that must work (accelerate's TensorBoard tracker takes torch's
# writer, which needs the tensorboard package).
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
CHOICES = ("none", *PACKAGES)


def check_trackers(report_to: str | list[str] | None, flag: str = "--report-to") -> list[str]:
    """The trackers asked for (``none`` and empty: ``[]``); a ConfigError, before anything loads,
    for an unknown one or one whose package is missing."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    names = [n for name in names for n in str(name).split(",") if n and n != "none"]
    for name in names:
        if name not in PACKAGES:
            raise ConfigError(f"{flag} {name}: not a tracker this project supports; choose one of "
                              f"{', '.join(CHOICES)}.")
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise ConfigError(f"{flag} {name} needs the {PACKAGES[name]} package, which is not installed here: "
                              f"pip install {PACKAGES[name]} (or {flag} none, the default: metrics.jsonl has "
                              "every metric).")
    return names


def accelerator_kwargs(report_to: str | None, output: Path) -> dict:
    """``Accelerator(...)`` arguments for the trackers asked for: ``log_with`` and where
    TensorBoard writes; ``{}`` for none."""
    from accelerate.utils import ProjectConfiguration

    names = check_trackers(report_to)
    if not names:
        return {}
    where = ProjectConfiguration(project_dir=str(output), logging_dir=str(Path(output) / "tensorboard"))
    return {"log_with": names, "project_config": where}


def start(accelerator, recipe: str, config: dict) -> None:
    """Open the trackers (main process) with the run's settings as hyperparameters: scalars as
    they are, anything else as text (trackers store only numbers, strings and booleans)."""
    if not accelerator.log_with:
        return
    plain = {k: v if isinstance(v, bool | int | float | str) else str(v) for k, v in config.items()}
    accelerator.init_trackers(recipe, config=plain)
