"""Training: a run from its checks to its records, in parts a recipe holds.

:mod:`.arguments` (the flags, one dataclass family), :mod:`.input_checks` (every check before anything
heavy), :mod:`.engine` (process group, optimizer, schedule), :mod:`.loop` (the schedule, the position,
each step's micro-batches and labelled tokens), :mod:`.checkpointer` (resume, when to save) over
:mod:`.checkpoints` (layout, atomic save, which to resume), :mod:`.stop` (stop signals), :mod:`.records`
(the step meter, validations, the run's records), :mod:`.final_model` (model, Trainer model or adapter),
:mod:`.evaluation`, :mod:`.samples` (what the model answers), :mod:`.hf_trainer` (the HF Trainer recipe's loop);
and what they stand on:
:mod:`.resharding` (resume on another number of ranks), :mod:`.adam_resume` and :mod:`.nvme_resume` (what
DeepSpeed's load leaves out), :mod:`.partitions` (ZeRO shard reports), :mod:`.sequence_parallel` (ranks
that share each sequence). The names a recipe uses are
importable from here.
"""

from importlib import import_module

_LAZY = {
    **dict.fromkeys(("ModelArguments", "InstructionData", "Samples", "Kernels", "LongContext", "LoopArguments", "flag",
                     "parse"), "finetune_kit.training.arguments"),
    **dict.fromkeys(("for_accelerate", "for_trainer"), "finetune_kit.training.input_checks"),
    **dict.fromkeys(("start", "optimizer_and_schedule", "max_grad_norm"), "finetune_kit.training.engine"),
    **dict.fromkeys(("Schedule", "Position", "Step", "steps"), "finetune_kit.training.loop"),
    "Checkpointer": "finetune_kit.training.checkpointer",
    "StopSignal": "finetune_kit.training.stop",
    **dict.fromkeys(("DataSplit", "step_meter", "validation", "finish", "stopped", "batch_shape"),
                    "finetune_kit.training.records"),
    **dict.fromkeys(("save_consolidated", "save_adapter", "save_trainer_model"), "finetune_kit.training.final_model"),
    "evaluate_loss": "finetune_kit.training.evaluation",
    **dict.fromkeys(("sample_prompts", "answers_before", "sample_answers"), "finetune_kit.training.samples"),
    **dict.fromkeys(("sequence_groups", "shard_sequences", "shard_loader", "use_sequence_parallel"),
                    "finetune_kit.training.sequence_parallel"),
}
__all__ = list(_LAZY)


def __getattr__(name: str):  # lazy: the checks and the planner import parts of this package without torch
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'finetune_kit.training' has no attribute {name!r}")
