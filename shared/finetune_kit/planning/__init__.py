"""Will it fit? Memory per GPU and per node before launch: model states (:mod:`.model_states`) and activations
(:mod:`.activations`), and the plan's verdict and suggestions (:mod:`.verdict`): every recipe checks its launch
with it; ``make plan`` (finetune_tools.planning) prints it. Needs no torch."""
