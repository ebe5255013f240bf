"""Where the kit keeps what it reuses between launches on a machine: ``$FINETUNE_CACHE_DIR``, by default
``~/.cache/finetune_kit`` (tokenised data, py-cpuinfo's answer); each user of it names its own subfolder."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_VAR = "FINETUNE_CACHE_DIR"


def root() -> Path:
    """The folder ``FINETUNE_CACHE_DIR`` names, or ``~/.cache/finetune_kit``."""
    return Path(os.environ.get(CACHE_VAR) or Path.home() / ".cache/finetune_kit").expanduser()
