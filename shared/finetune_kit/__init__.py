"""What a recipe imports when it runs. Each folder answers one question:

    data/       what the model reads: instruction rows (prompt masking, packing), review CSVs, samples
    models/     shapes from a config (no weights), loading with a real pad token, QLoRA, the loss and
                attention kernels, activation offload, compiled layers
    launch/     what the launcher set up: its environment, the launched configs' checks, the Accelerator,
                multi-node checks and handshake
    planning/   will it fit? the memory formulas every launch checks before it loads anything
    metering/   metric names and units, model FLOPs and MFU, tokens/s, peak memory, metrics.jsonl, the run record
    training/   a run from its input checks to its records: the checks, the loop around the recipe's body (or the
                metered HF Trainer's), checkpoints and resharding, the final model, the shared flags
    check.py    ``python -m finetune_kit.check``: a launch's inputs checked once, before any rank starts
    harness/    ``python -m finetune_kit.harness`` (``make eval``): lm-evaluation-harness on a finished run's model
    model_card.py  each saved folder's README.md, generated from the run's files
    merge.py    ``python -m finetune_kit.merge`` (``make merge``): a QLoRA adapter merged into its 16-bit base

The tools that work on the repository (the speed model, the results page, the GPU check, the README
blocks, the tiny test models) are the second package, ``finetune_tools`` (shared/tools/).
A recipe needs a handful of names, importable from here without loading torch until used: the packages
``data``, ``models`` and ``training`` (whose ``__init__`` export the names a recipe uses) and ``run_main``.
"""

import logging
from importlib import import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# bitsandbytes, on a CPU with AVX512-BF16, tries a 4-bit kernel it would download from the Hugging
# Face hub (the `kernels` package) and warns in every process when that package is missing. The
# recipes download nothing at run time and bitsandbytes' own CPU kernel runs instead: not news.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
# torchao (imported by transformers wherever it is installed) warns in every process that its mxfp8 and
# CUTLASS extensions do not load on a machine without their CUDA kernels, and registers two enums with torch's
# pytree in a way torch calls deprecated: neither touches the float8 training this package uses
# (torch._scaled_mm), and neither is the user's to act on.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

# What a recipe imports from here: its parts' packages (``data``, ``models``, ``training``) and ``run_main``.
_EXPORTS = {
    "UserInputError": "finetune_kit.errors",
    "run_main": "finetune_kit.launch.failures",
}
__all__ = ["UserInputError", "__version__", "run_main"]  # = _EXPORTS, spelled out for static tools

if TYPE_CHECKING:  # the same names for editors and type checkers; at run time they load on first use
    from finetune_kit.errors import UserInputError
    from finetune_kit.launch.failures import run_main


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'finetune_kit' has no attribute {name!r}")
