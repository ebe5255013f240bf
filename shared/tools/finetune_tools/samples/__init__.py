"""The generators of the shipped samples in ``finetune_kit/data/samples/`` (deterministic: the same files every
run): instruction pairs (:mod:`.instructions`), the same pairs in the other row formats (:mod:`.formats`), preference
pairs built from them (:mod:`.preferences`), reviews (:mod:`.reviews`)."""
