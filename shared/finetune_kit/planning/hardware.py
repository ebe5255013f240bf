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
    family: str = ""  # what a compute efficiency is fitted per (speed.family); "": the name's first word

    @property
    def kind(self) -> str:
        """The generation a compute efficiency is fitted per: "A100", "H100", "RTX 4090", ..."""
        return self.family or self.name.split()[0]


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
    # HGX B200 datasheet: 2.25 PFLOP/s bf16 and 4.5 fp8 dense (4.5 and 9 with sparsity), 180 GB HBM3e per GPU in
    # an 8-GPU board, NVLink5 1.8 TB/s both ways; PCIe 5.0 x16 to the host
    "b200": Gpu("B200 SXM 180 GB", 2250.0, 180, 900.0, 64.0, 4500.0),
    # L40S datasheet: 362.05 bf16 and 733 fp8 TFLOP/s dense (733 and 1,466 with sparsity), 48 GB GDDR6; no NVLink:
    # GPUs talk over PCIe 4.0 x16 (64 GB/s both ways)
    "l40s": Gpu("L40S 48 GB", 362.05, 48, 32.0, 32.0, 733.0),
    # RTX A6000 datasheet: 309.7 TFLOP/s tensor with sparsity, so 154.8 bf16 dense; 48 GB GDDR6; Ampere, no fp8. Its
    # NVLink bridge (112.5 GB/s both ways) joins two cards only: a node's GPUs talk over PCIe 4.0 x16
    "rtx-a6000": Gpu("RTX A6000 48 GB", 154.8, 48, 32.0, 32.0, None, "RTX A6000"),
    # GeForce cards run bf16 and fp8 at half rate when they accumulate in fp32, as training does (Ada and Blackwell
    # GeForce whitepapers, "with FP32 accumulate"): RTX 4090 165.2 bf16 and 330.3 fp8 dense, 24 GB GDDR6X, PCIe 4.0
    # x16 and no peer-to-peer NVLink; RTX 5090 209.5 bf16 and 419 fp8 dense, 32 GB GDDR7, PCIe 5.0 x16
    "rtx4090": Gpu("RTX 4090 24 GB", 165.2, 24, 32.0, 32.0, 330.3, "RTX 4090"),
    "rtx5090": Gpu("RTX 5090 32 GB", 209.5, 32, 64.0, 64.0, 419.0, "RTX 5090"),
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


# (what torch.cuda.get_device_name() holds, the profile), tried in this order: "GB200" is not a B200 profile's part
DEVICE_NAMES = (("GB200", None), ("B200", "b200"), ("H200", "h200"), ("L40S", "l40s"), ("RTX A6000", "rtx-a6000"),
                ("RTX 4090", "rtx4090"), ("RTX 5090", "rtx5090"))


def device_kind(device_name: str | None) -> str | None:
    """"H200", "H100 PCIe", "H100 SXM", "A100", "B200", "L40S", "RTX A6000", "RTX 4090" or "RTX 5090" for a
    ``torch.cuda.get_device_name()`` string (or a source's "A100 80GB"); None for CPUs and unknown devices."""
    name = (device_name or "").upper()
    if "H100" in name:
        return "H100 PCIe" if "PCIE" in name else "H100 SXM"
    if "A100" in name:
        return "A100"
    for part, profile in DEVICE_NAMES:
        if part in name:
            return GPUS[profile].kind if profile else None
    return None


def gpu_for_device(device: str | None) -> Gpu | None:
    """The profile of a device name as records and sources write it ("NVIDIA H100 80GB HBM3",
    "A100 80GB", "H100 96GB HBM2e (500 W)", "NVIDIA GeForce RTX 4090"); None for one without a profile."""
    kind = device_kind(device)
    if kind == "A100":
        return GPUS["a100-40" if "40GB" in (device or "").upper().replace(" ", "") else "a100-80"]
    if kind in ("H100 PCIe", "H100 SXM"):
        return GPUS["h100-pcie" if kind == "H100 PCIe" else "h100"]
    return next((gpu for gpu in GPUS.values() if kind and gpu.kind == kind), None)


def peak_bf16_tflops(device: str | None) -> float | None:
    """The dense bf16 peak (TFLOP/s) of a device name, what MFU is against; None for CPUs and unknown devices."""
    gpu = gpu_for_device(device)
    return gpu.peak_bf16_tflops if gpu else None
