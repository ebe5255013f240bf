"""Tools that work on this repository, beside the runtime package: no recipe imports them.

    planning/   how fast, how long, at what cost (``make plan``): the speed model, GPU and network profiles,
                the recipes' planner tables (the memory formulas every launch checks are finetune_kit.planning)
    results/    the results/ page, plot and speed calibration from the run records (``make results``)
    gpu_check/  every recipe's code path on the real shapes on one GPU, tiny on CPU (``make gpu-check``)
    repo/       the generated README blocks, the pins against the locks and Dockerfiles (``make readmes``)
    samples/    the generators of the shipped sample data
    tiny_models tiny models of the recipes' families, for the tests and ``make demo``
    harness/    ``python -m finetune_tools.harness`` (``make eval``): lm-evaluation-harness on a finished run's model
    merge.py    ``python -m finetune_tools.merge`` (``make merge``): a QLoRA adapter merged into its 16-bit base

They run from a checkout (``PYTHONPATH=shared/tools``, as the Makefile sets it) or installed beside the
runtime (``pip install ./shared/tools``, as the test sessions do): most read and write the repository's own
files (results/, the recipes' memory_plan.json, the locks and Dockerfiles), so a practitioner's
``pip install .`` of the runtime leaves them out; an image has them in /workspace/shared/tools, where
``make eval`` and ``make merge`` find them.
"""
