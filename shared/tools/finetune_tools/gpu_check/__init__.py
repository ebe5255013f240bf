"""Every recipe's own code path on the real model shapes, in one command (``make gpu-check``).

:mod:`.cases` says what runs (each recipe's ``train.py`` with its own configs; only the model,
the data, the step count and the sizes differ), :mod:`.synthetic` builds the models (a published
architecture truncated to a few decoder layers, random weights, no download) and the data
(synthetic text long enough that no token is padding), and :mod:`.runner` runs the cases and prints
the summary. On a machine without a GPU the same cases run at a tiny width on CPU.
"""
