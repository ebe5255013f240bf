"""How fast, how long, at what cost: the speed model (:mod:`.speed`), GPU and network profiles
(:mod:`.hardware`), the recipes' planner tables (:mod:`.recipe_tables`) and the command line (:mod:`.cli`,
``python -m finetune_tools.planning``, ``make plan``) over the memory formulas of
``finetune_kit.planning`` (model_states, activations, verdict). Needs no torch."""
