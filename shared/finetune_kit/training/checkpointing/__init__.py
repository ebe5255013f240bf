"""Checkpoints of a run: :mod:`.checkpointer` (resume at the start, save every --save-every steps, the last and on
a stop) over :mod:`.checkpoints` (the folder layout, the atomic save, which checkpoint to resume); what DeepSpeed's
load leaves out (:mod:`.adam_resume`: Adam's step count under the HF Trainer, :mod:`.nvme_resume`: optimizer
states swapped to NVMe); :mod:`.resharding` (resume on another number of ranks, through DeepSpeed's universal
checkpoint) and :mod:`.partitions` (what each ZeRO rank holds, for the run's records)."""
