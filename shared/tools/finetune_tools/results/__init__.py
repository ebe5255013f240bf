"""The results/ page and plot built from the run records (``finetune_kit.metering.run_record``) and published
figures (:mod:`.report`, run as ``python -m finetune_tools.results``), and the speed model's calibration
(:mod:`.calibration`)."""
