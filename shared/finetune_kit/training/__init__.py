"""Training: the run lifecycle (:mod:`.run`), the flags every recipe shares (:mod:`.arguments`),
checkpoints (:mod:`.checkpoints`), evaluation (:mod:`.evaluation`), ZeRO partition reports
(:mod:`.partitions`) and the metered HF Trainer (:mod:`.trainer`)."""
