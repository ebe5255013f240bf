"""Training: a run from preflight to records.

:mod:`.preflight` (every check before anything heavy), :mod:`.run` (the loop around an accelerate
recipe's body), :mod:`.trainer_run` and :mod:`.trainer` (the HF Trainer's loop, metered the same way),
:mod:`.ending` (what both share and the end: records, summary), :mod:`.checkpoints` (layout, atomic
save, which to resume), :mod:`.resharding` (resume on another number of ranks), :mod:`.nvme_resume`,
:mod:`.final_model` (model, Trainer model or adapter), :mod:`.arguments` (the shared flags),
:mod:`.evaluation`, :mod:`.partitions` (ZeRO shard reports) and :mod:`.preemption` (stop signals)."""
