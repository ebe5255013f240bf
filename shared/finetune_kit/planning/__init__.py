"""Will it fit? Memory per GPU and per node before launch: formulas (:mod:`.memory`) and the command
line (:mod:`.cli`, run as ``python -m finetune_kit.planning``). Needs no torch."""
