"""Will it fit? Memory per GPU and per node before launch (:mod:`.memory`): every recipe checks its launch
with it; ``make plan`` (finetune_tools.planning) prints it. Needs no torch."""
