"""DeepSpeed's Muon module imported without ``torch.compile``'s set-up, for a run whose optimizer is not Muon.

Building a ZeRO engine, DeepSpeed checks the optimizer against the ones ZeRO supports and imports its Muon optimizer's
module to list it (``deepspeed.runtime.zero.utils.is_zero_supported_optimizer``). That module wraps a function in
``torch.compile`` as it is imported, and ``torch.compile`` then imports Inductor's compiler: measured on a 2-core AMD
EPYC, a 4-step launch of the 8B recipe on 2 CPU ranks took 41 CPU seconds, 35 to 36 with the import made here first
(3 to 4 seconds less in all). Imported with TorchDynamo off (``TORCHDYNAMO_DISABLE=1``, for the import alone),
Muon's function stays plain Python in this process: nothing else changes, and a run that trains with Muon keeps it
compiled (:func:`import_muon_uncompiled` does nothing there).
"""

from __future__ import annotations

import os
import sys

MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def uses_muon(ds_config: dict) -> bool:
    """Whether the DeepSpeed config's optimizer is DeepSpeed's Muon (its type ``muon``, any case)."""
    return str((ds_config.get("optimizer") or {}).get("type", "")).lower() == "muon"


def import_muon_uncompiled(ds_config: dict) -> bool:
    """Import DeepSpeed's Muon module with TorchDynamo off, unless ``ds_config`` trains with Muon or it is already
    imported; returns whether this call imported it. The environment is as it was afterwards."""
    if uses_muon(ds_config) or MODULE in sys.modules:
        return False
    saved = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        __import__(MODULE)
    except ImportError:  # a DeepSpeed without Muon: nothing to import
        return False
    finally:
        if saved is None:
            os.environ.pop("TORCHDYNAMO_DISABLE", None)
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = saved
    return True
