"""What a recipe imports when it runs. Each folder answers one question (README.md beside this file: where
each thing a newcomer looks for lives):

    losses.py   the loss: labels that take none, the step's labelled-token count and backward scale, the
                causal LM's loss without the full logits (chunked, or Liger's kernel), the classifier's
    data/       what the model reads: instruction rows (prompt masking, packing), review CSVs, samples
    models/     shapes from a config (no weights), loading with a real pad token, QLoRA, fp8, attention
                kernels, activation offload, compiled layers, tiled MLP
    launch/     what the launcher set up: its environment, the launched configs' checks, the Accelerator,
                multi-node checks and handshake, CPU start-up
    planning/   will it fit? model states and activations, added up in the verdict every launch checks
    metering/   metric names and units, model FLOPs and MFU, tokens/s, peak memory, metrics.jsonl, the run record
    training/   a run from its input checks to its records: the checks, the loop around the recipe's body (or the
                metered HF Trainer's), checkpointing/, the final model, the shared flags
    check.py    ``python -m finetune_kit.check``: a launch's inputs checked once, before any rank starts
    output_lock.py  one run per output folder, held by the ``with`` block a recipe wraps its run in
    model_card.py  each saved folder's README.md, generated from the run's files

The tools that work on the repository (the speed model, the results page, the GPU check, the evaluation
harness, the merge, the README blocks, the tiny test models) are the second package, ``finetune_tools``
(shared/tools/). A recipe needs a handful of names, importable from here without loading torch until used: the
packages ``data``, ``models`` and ``training`` (whose ``__init__`` export the names a recipe uses, statically for
editors too), the module ``losses`` and ``run_main``.
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
