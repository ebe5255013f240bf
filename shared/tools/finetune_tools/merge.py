"""The merged export of an adapter run: ``python -m finetune_tools.merge RUN`` (``make merge RUN=...``).

The adapter of ``RUN/adapter`` (``--peft lora`` or ``qlora``) trained against a frozen base; merging it into 4-bit
weights would round the update away, so the base is loaded in 16-bit (``--dtype``; 70B in bf16: about 140 GB of
host RAM, no GPU) and the adapter merged into it (:func:`finetune_kit.models.qlora.merge_adapter`). ``RUN/merged``
then loads with plain ``AutoModelForCausalLM`` (a chat run: with its chat template and end of turn) or
``AutoModelForSequenceClassification`` (the review classifier) and serves like any model of its architecture (vLLM
included); its model card says so. The same as the recipe's ``--merge``, for a run that finished without it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from finetune_kit import command_line
from finetune_kit.errors import UserInputError


def main(argv=None) -> int:
    parser = command_line.ArgumentParser(prog="python -m finetune_tools.merge", description=__doc__.splitlines()[0])
    parser.add_argument("run", help="the run folder (--output of the training run)")
    parser.add_argument("--base", default=None, help="the base model (default: the run's, from run_info.json)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="the dtype the base is loaded and merged in")
    args = parser.parse_args(argv)
    try:
        run, base = check(Path(args.run), args.base)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch

    from finetune_kit import model_card
    from finetune_kit.data.reviews import LABELS
    from finetune_kit.models import qlora

    merged = qlora.merge_adapter(base, run / "adapter", run / "merged", dtype=getattr(torch, args.dtype),
                                 labels=LABELS)
    cards = model_card.write(run)
    print(f"merged model saved to {merged} (the adapter merged into {base} in {args.dtype}); model cards: "
          f"{', '.join(map(str, cards))}")
    return 0


def check(run: Path, base: str | None) -> tuple[Path, str]:
    """The run folder and the base model, or UserInputError naming what is missing and what to pass."""
    if not (run / "adapter/adapter_config.json").is_file():
        raise UserInputError(f"'{run}' holds no adapter/adapter_config.json: merging needs the adapter a run with "
                             "--peft lora or qlora saved. Pass the --output folder of such a finished run.")
    if base is None:
        info = run / "run_info.json"
        if not info.is_file():
            raise UserInputError(f"'{run}' has no run_info.json to read the base model from. Pass --base with the "
                                 "model the run trained (hub id or folder).")
        base = json.loads(info.read_text())["model"]
    return run, base


if __name__ == "__main__":
    sys.exit(main())
