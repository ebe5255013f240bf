"""Results: the run record every recipe writes (:mod:`.record`) and the results/ page and plot built
from records and published figures (:mod:`.report`, run as ``python -m finetune_kit.results``)."""
