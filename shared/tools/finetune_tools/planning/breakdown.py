"""What ``make plan`` and the README tables show of a plan and a prediction beyond what ``--levers auto`` ranks with:
memory by kind and on disk, the speed's range and its terms, DPO's pairs per second and its reference pass."""

from __future__ import annotations

from finetune_kit.planning.speed import Cluster, Job, Prediction, reference_pass
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


def dpo_rows(job: Job, cluster: Cluster, efficiency, pred, tokens: float | None) -> list[list[str]]:
    """DPO's rows of the speed table: pairs per second (the tokens above count chosen and rejected sequences both),
    and for a precomputed reference its pass over the training pairs before training, forward only."""
    if job.dpo is None:
        return []
    pairs = pred.tokens_per_s(cluster.gpus) * cluster.gpus / (job.sequences // job.micro_batch * job.seq_len)
    rows = [["DPO pairs/s, all GPUs", f"{pairs:,.1f} (tokens above: chosen + rejected, reference: "
                                      f"{job.dpo.reference})"]]
    if job.dpo.reference == "precomputed":
        rate = reference_pass(job, cluster, efficiency).tokens_per_s(cluster.gpus)
        when = (f"{tokens / (rate * cluster.gpus) / 3600:,.2f} h for {tokens:,.0f} tokens, before training" if tokens
                else "pass --tokens for its time")
        rows.append(["DPO reference pass (once, forward only)", f"{rate:,.0f} tokens/s per GPU; {when}"])
    return rows
