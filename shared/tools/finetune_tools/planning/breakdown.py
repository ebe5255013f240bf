"""What ``make plan`` and the README tables show of a plan and a prediction beyond what ``--levers auto`` ranks with:
memory by kind and on disk, the speed's range and its terms."""

from __future__ import annotations

from finetune_kit.planning.speed import Prediction
from finetune_kit.planning.verdict import OVERHEAD_PART, Plan

ACTIVATION_PARTS = ("activations", "logits", "one layer")  # how verdict.plan names its activation parts


def gpu_by_kind(p: Plan) -> dict[str, int]:
    """GPU bytes grouped as model states, activations (incl. logits) and overhead."""
    kinds = {"model states": 0, "activations": 0, "overhead": 0}
    for name, value in p.gpu_parts.items():
        kind = ("activations" if name.startswith(ACTIVATION_PARTS) else
                "overhead" if name.startswith(OVERHEAD_PART) else "model states")
        kinds[kind] += value
    return kinds


def disk_bytes(p: Plan) -> int:
    """Per node, on the NVMe disk (ZeRO-Infinity)."""
    return sum(p.disk_parts.values())


def tokens_per_s_range(pred: Prediction, gpus: int) -> tuple[float, float]:
    """Per GPU: communication not overlapped with compute at all, and wholly hidden behind it."""
    fast, slow = pred.step_s_range
    return pred.tokens_per_step / slow / gpus, pred.tokens_per_step / fast / gpus


def terms(pred: Prediction) -> dict[str, float]:
    """Seconds per optimizer step of each term."""
    return {"compute": pred.compute_s, "intra-node": pred.intra_node_s, "inter-node": pred.inter_node_s,
            "offload": pred.offload_s}


def dominant(pred: Prediction) -> str:
    """The largest term."""
    found = terms(pred)
    return max(found, key=found.get)
