"""Named hardware profiles for the speed model: GPUs and the networks between nodes.

Every figure is a datasheet number (dense bf16 and fp8 tensor-core peaks, link rates); what a collective
achieves of a link is one stated fraction, :data:`LINK_EFFICIENCY`, the same for every link. A
profile is a plain dataclass: ``dataclasses.replace(GPUS["h100"], intra_node_GBps=300)`` overrides
a field; the planner's ``--peak-tflops``, ``--intra-node-gbps``, ``--host-link-gbps`` and
``--network-gbps`` do that from the command line.
"""

from __future__ import annotations

from dataclasses import dataclass

# NCCL's ring collectives reach about this share of a link's one-way rate (nccl-tests bus bandwidth
# on DGX A100/H100: ~230 of 300 GB/s NVLink3, ~370 of 450 GB/s NVLink4). A stated assumption.
LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Gpu:
    name: str
    peak_bf16_tflops: float  # dense, without sparsity (datasheet)
    memory_GiB: float
    intra_node_GBps: float  # one-way link rate per GPU to the others of its node (NVLink, or PCIe)
    host_link_GBps: float  # one-way PCIe rate per GPU to host memory (CPU offload)
    peak_fp8_tflops: float | None = None  # dense fp8 (e4m3) tensor-core peak; None: no fp8 tensor cores (A100)


@dataclass(frozen=True)
class Network:
    name: str
    per_node_GBps: float  # one-way rate out of one node, all its NICs together
    description: str


GPUS = {
    "a100-40": Gpu("A100 SXM 40 GB", 312.0, 40, 300.0, 32.0),  # NVLink3 600 GB/s both ways; PCIe 4.0 x16
    "a100-80": Gpu("A100 SXM 80 GB", 312.0, 80, 300.0, 32.0),
    # fp8 peaks: half the datasheet's "with sparsity" figures (H100/H200 SXM 3,958, H100 PCIe 3,026 TFLOP/s)
    "h100": Gpu("H100 SXM 80 GB", 989.0, 80, 450.0, 64.0, 1979.0),  # NVLink4 900 GB/s both ways; PCIe 5.0 x16
    "h100-pcie": Gpu("H100 PCIe 80 GB", 756.0, 80, 64.0, 64.0, 1513.0),  # GPUs talk over PCIe 5.0
    "h200": Gpu("H200 SXM 141 GB", 989.0, 141, 450.0, 64.0, 1979.0),
}

NETWORKS = {
    "ib400": Network("ib400", 8 * 50.0, "InfiniBand NDR, one 400 Gb/s NIC per GPU (8 per node)"),
    "ib200": Network("ib200", 8 * 25.0, "InfiniBand HDR, one 200 Gb/s NIC per GPU (8 per node)"),
    "ib400x1": Network("ib400x1", 50.0, "one 400 Gb/s InfiniBand NIC per node"),
    "eth400": Network("eth400", 50.0, "400 Gb/s Ethernet per node"),
    "eth100": Network("eth100", 12.5, "100 Gb/s Ethernet per node"),
    "eth25": Network("eth25", 3.125, "25 Gb/s Ethernet per node"),
}


def gpu_profile(name: str) -> Gpu:
    from finetune_kit.errors import ConfigError

    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ConfigError(f"GPU '{name}' has no profile; known: {', '.join(GPUS)}.") from None


def network_profile(name: str) -> Network:
    from finetune_kit.errors import ConfigError

    try:
        return NETWORKS[name.lower()]
    except KeyError:
        raise ConfigError(f"network '{name}' has no profile; known: {', '.join(NETWORKS)}.") from None


def device_kind(device_name: str | None) -> str | None:
    """"H200", "H100 PCIe", "H100 SXM" or "A100" for a ``torch.cuda.get_device_name()`` string (or a source's
    "A100 80GB"); None for CPUs and unknown devices."""
    name = (device_name or "").upper()
    if "H200" in name:
        return "H200"
    if "H100" in name:
        return "H100 PCIe" if "PCIE" in name else "H100 SXM"
    if "A100" in name:
        return "A100"
    return None


def gpu_for_device(device: str | None) -> Gpu | None:
    """The profile of a device name as records and sources write it ("NVIDIA H100 80GB HBM3",
    "A100 80GB", "H100 96GB HBM2e (500 W)"); None for one without a profile."""
    kind = device_kind(device)
    if kind == "A100":
        return GPUS["a100-40" if "40GB" in (device or "").upper().replace(" ", "") else "a100-80"]
    return {"H200": GPUS["h200"], "H100 PCIe": GPUS["h100-pcie"], "H100 SXM": GPUS["h100"]}.get(kind)


def peak_bf16_tflops(device: str | None) -> float | None:
    """The dense bf16 peak (TFLOP/s) of a device name, what MFU is against; None for CPUs and unknown devices."""
    gpu = gpu_for_device(device)
    return gpu.peak_bf16_tflops if gpu else None
