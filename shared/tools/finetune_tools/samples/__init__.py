"""The generators of the shipped samples in ``finetune_kit/data/samples/`` (deterministic: the same files every
run): instruction pairs (:mod:`.instructions`), the same pairs in the other row formats (:mod:`.formats`), reviews
(:mod:`.reviews`)."""
