"""Training: a run from its checks to its records, in parts a recipe holds.

:mod:`.arguments` (the flags, one dataclass family), :mod:`.input_checks` (every check before anything
heavy), :mod:`.engine` (process group, optimizer, schedule), :mod:`.loop` (the schedule, the position,
each step's micro-batches and labelled tokens), :mod:`.checkpointing` (resume and save, the checkpoint
folders, resharding, what DeepSpeed's load leaves out), :mod:`.stop` (stop signals), :mod:`.records` (the
step meter, validations, the run's records), :mod:`.final_model` (model, Trainer model or adapter),
:mod:`.nonfinite` (a step whose loss or gradient norm is NaN or Inf), :mod:`.evaluation`, :mod:`.samples`
(what the model answers), :mod:`.hf_trainer` (the HF Trainer recipe's loop) and :mod:`.sequence_parallel`
(ranks that share each sequence). The names a recipe uses are importable
from here, each from the module the table below names (an editor's go-to-definition follows them too).
"""

from importlib import import_module
from typing import TYPE_CHECKING

_LAZY = {
    **dict.fromkeys(("ModelArguments", "InstructionData", "Adapters", "Samples", "Kernels", "LongContext",
                     "LoopArguments", "NonfiniteSteps", "flag", "parse"),
                    "finetune_kit.training.arguments"),
    **dict.fromkeys(("for_accelerate", "for_trainer"), "finetune_kit.training.input_checks"),
    **dict.fromkeys(("start", "optimizer_and_schedule", "max_grad_norm"), "finetune_kit.training.engine"),
    **dict.fromkeys(("Schedule", "Position", "Step", "steps"), "finetune_kit.training.loop"),
    "Checkpointer": "finetune_kit.training.checkpointing.checkpointer",
    "StopSignal": "finetune_kit.training.stop",
    "finite": "finetune_kit.training.nonfinite",
    **dict.fromkeys(("DataSplit", "step_meter", "validation", "finish", "stopped", "batch_shape"),
                    "finetune_kit.training.records"),
    **dict.fromkeys(("save_trained", "save_consolidated", "save_adapter", "save_merged",
                     "save_trainer_model"), "finetune_kit.training.final_model"),
    "evaluate_loss": "finetune_kit.training.evaluation",
    **dict.fromkeys(("sample_prompts", "answers_before", "sample_answers"), "finetune_kit.training.samples"),
    **dict.fromkeys(("sequence_groups", "shard_sequences", "shard_loader", "use_sequence_parallel"),
                    "finetune_kit.training.sequence_parallel"),
    "hold_output": "finetune_kit.output_lock",
}
__all__ = list(_LAZY)

if TYPE_CHECKING:  # the same names for editors, type checkers and import tracers; at run time they load on first use
    from finetune_kit.output_lock import hold_output
    from finetune_kit.training.arguments import (
        Adapters,
        InstructionData,
        Kernels,
        LongContext,
        LoopArguments,
        ModelArguments,
        NonfiniteSteps,
        Samples,
        flag,
        parse,
    )
    from finetune_kit.training.checkpointing.checkpointer import Checkpointer
    from finetune_kit.training.engine import max_grad_norm, optimizer_and_schedule, start
    from finetune_kit.training.evaluation import evaluate_loss
    from finetune_kit.training.final_model import (
        save_adapter,
        save_consolidated,
        save_merged,
        save_trained,
        save_trainer_model,
    )
    from finetune_kit.training.input_checks import for_accelerate, for_trainer
    from finetune_kit.training.loop import Position, Schedule, Step, steps
    from finetune_kit.training.nonfinite import finite
    from finetune_kit.training.records import DataSplit, batch_shape, finish, step_meter, stopped, validation
    from finetune_kit.training.samples import answers_before, sample_answers, sample_prompts
    from finetune_kit.training.sequence_parallel import (
        sequence_groups,
        shard_loader,
        shard_sequences,
        use_sequence_parallel,
    )
    from finetune_kit.training.stop import StopSignal


def __getattr__(name: str):  # lazy: the checks and the planner import parts of this package without torch
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
