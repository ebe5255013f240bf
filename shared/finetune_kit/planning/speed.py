"""How fast a setup trains: tokens/s per GPU from compute, communication and CPU offload, per step.

One optimizer step of ``micro_batch x seq_len x grad_accum`` tokens on each of N GPUs (under DPO twice that:
``micro_batch`` counts pairs of a chosen and a rejected sequence, :mod:`.preference`) takes:

* **compute**: the FLOPs the GPU executes (:meth:`Job.executed_per_token`) at ``efficiency`` x the GPU's dense
  bf16 peak: the model FLOPs (:class:`~finetune_kit.metering.flops.FlopCounter`: 6N + 12LHQT per token, or
  4N_frozen + 6N_trainable + 12LHQT with a frozen base) with causal attention at half of 12LHQT (flash attention
  skips the masked blocks), plus the forward again of the decoder layers checkpointing recomputes (all of them, or
  every ``recompute_every``-th) and, with the chunked loss, of the LM head. Under DPO a reference that runs in the
  step adds its forward over both sequences (model FLOPs 2N + 4LHQT per token, the causal half of attention
  executed; :func:`.preference.reference_forward_per_token`); a precomputed one runs before training, its time
  :func:`reference_pass`. ``efficiency`` is the share of the peak
  a GPU reaches while it computes (kernels, launch gaps folded in); it is fitted on measured and published runs
  (``finetune_tools.planning.speed_fit``), one value per method (full fine-tuning, frozen base). Compiled decoder
  layers take ``Efficiency.compiled`` of that time, fitted on pairs of runs that differ only in compilation
  (``speed_fit.fit_compiled``).
* **communication**: the bytes each GPU sends in the step's collectives over the slowest link of the
  ring, the seed's T = 2(N-1)/N x M / B generalised: an all-gather or a reduce-scatter of M bytes
  moves (N-1)/N x M per GPU, an all-reduce twice that. Per micro-batch under ZeRO-3/FSDP2: the bf16
  weights gathered for the forward and again for the backward (and for DPO's reference forward, once more), the
  gradients reduce-scattered
  (fp32 under this repository's FSDP2 config, bf16 otherwise); under ZeRO-2 the gradients are
  reduce-scattered per micro-batch and the updated bf16 weights gathered once per step; ZeRO-0/1:
  one all-reduce of the gradients per step. A frozen 4-bit base (QLoRA under ZeRO-3/FSDP) gathers
  its packed weights (half a byte per parameter) and reduces only the trainable gradients. On one
  node the link is the GPU's NVLink/PCIe; across nodes the ring crosses the network, whose per-node
  rate is shared by the node's GPUs. Links reach :data:`~.hardware.LINK_EFFICIENCY` of their rate.
* **Ulysses sequence parallelism** (``sequence_parallel`` sp > 1, DeepSpeed ALST): each rank computes
  seq_len/sp tokens of a sequence, and its attention FLOPs are those of the whole sequence (12LHQT per
  token with T the full length, so they grow with seq^2 per sequence). Per layer and micro-batch, four
  all-to-alls in the forward (q, k, v in; the attention output back), four in the backward and four
  more in the recomputed forward under checkpointing, each sending (sp-1)/sp of a local bf16 tensor
  (:func:`all_to_all_bytes`). A group inside one node uses NVLink/PCIe; a group over several nodes
  sends the share bound for other nodes over the network.
* **the optimizer step**: a fixed time per optimizer step for each trainable parameter a GPU
  updates (its shard under ZeRO; the Adam update, the engine's per-step bookkeeping), fitted per
  engine (DeepSpeed, or PyTorch's own optimizer under FSDP2 or on one device): ``step_s_per_param``.
  It is why gradient accumulation speeds a step up (measured on one H100: 1.5x from 1 to 4
  micro-batches per step on the 8B shape).
* **CPU offload** (ZeRO's ``offload_optimizer``): each GPU's share of the gradients to host memory after
  every micro-batch and of the updated weights back once per step over PCIe (:func:`offload_pcie_s`), then
  DeepSpeed's CPU Adam over the node's share of the trainable parameters (:func:`cpu_adam_s`): the host's cores
  (``Cluster.host_cores``) at a rate per core fitted on the offloaded runs measured here, at most what the host's
  memory bandwidth (``Cluster.host_memory_GBps``) streams at :data:`ADAM_BYTES` a parameter.

Overlap is an assumption, stated as a range: the fast end hides the communication behind the
compute (step = max(compute, communication) + offload), the slow end does not (their sum); the
point estimate is their middle. The dominant term is the largest of compute, intra-node,
inter-node and offload time.

This is what a recipe's ``--levers auto`` ranks with (:mod:`.levers`). Fitting the constants on runs of known speed
(``finetune_tools.planning.speed_fit``) and fp8's speed (``finetune_tools.planning.fp8_speed``) are the tools'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from finetune_kit.metering.flops import FlopCounter
from finetune_kit.models.shapes import Adapter, ModelShape
from finetune_kit.planning.hardware import LINK_EFFICIENCY, NETWORKS, Gpu, Network
from finetune_kit.planning.preference import Dpo, check_reference, reference_forward_per_token, sequences_per_example

BF16 = 2
FP32 = 4
NF4 = 0.5  # packed 4-bit weights, bytes per parameter


@dataclass(frozen=True)
class Job:
    """What trains and how: model, method, engine, batch shape."""

    shape: ModelShape
    seq_len: int = 2048
    micro_batch: int = 1
    grad_accum: int = 1
    stage: int = 3  # ZeRO stage; 3 for FSDP2's full sharding
    engine: str = "deepspeed"  # "deepspeed" | "fsdp2" | "torch" (one device, PyTorch's optimizer)
    offload_optimizer: bool = False
    gradient_checkpointing: bool = True
    adapter: Adapter | None = None  # LoRA/QLoRA: a frozen base (quantized: nf4)
    num_labels: int | None = None
    sequence_parallel: int = 1  # Ulysses SP degree: ranks that share one sequence
    recompute_every: int = 1  # with checkpointing: every N-th decoder layer recomputed (1: all)
    loss_kernel: str = "none"  # "chunked": the head's forward again in the backward | "liger" | "none": neither
    compiled: bool = False  # decoder layers through torch.compile
    dpo: Dpo | None = None  # preference pairs: micro_batch counts pairs, each two sequences through the policy

    def __post_init__(self) -> None:
        check_reference(self.dpo, self.adapter)

    @property
    def sequences(self) -> int:
        """Sequences per micro-batch through the policy: ``micro_batch``, twice that under DPO."""
        return self.micro_batch * sequences_per_example(self.dpo)

    @property
    def reference_forward(self) -> bool:
        """Whether each micro-batch runs DPO's reference forward."""
        return self.dpo is not None and self.dpo.reference_forward

    @property
    def method(self) -> str:
        return "full" if self.adapter is None else "frozen-base"

    def trainable(self) -> int:
        if self.adapter is None:
            return self.shape.total_params(self.num_labels)
        return self.shape.lora_params(self.adapter.rank, self.adapter.targets) + (
            self.shape.head_params(self.num_labels) if self.num_labels else 0)

    def flops_per_token(self) -> float:
        counter = FlopCounter(self.shape, num_labels=self.num_labels,
                              trainable=None if self.adapter is None else self.trainable(),
                              head_trainable=bool(self.num_labels and self.adapter),
                              reference_forward=self.reference_forward)
        return counter.per_token(self.seq_len)

    def flops_per_example(self) -> float:
        """Model FLOPs per training example: one sequence of ``seq_len`` tokens, or under DPO a pair of them."""
        return sequences_per_example(self.dpo) * self.seq_len * self.flops_per_token()

    def attention_per_token(self) -> float:
        """The 12LHQT of :meth:`flops_per_token`: attention's scores and their use, forward and backward, counted
        over the whole sequence as the MFU convention does."""
        s = self.shape
        return 12 * s.num_hidden_layers * s.num_attention_heads * s.dim_per_head * self.seq_len

    def recomputed_layers(self) -> float:
        """Share of the decoder layers whose forward runs again in the backward: ceil(L / every) / L with
        checkpointing (transformers checkpoints layers 0, every, 2 x every, ...), else 0."""
        if not self.gradient_checkpointing:
            return 0.0
        layers = self.shape.num_hidden_layers
        return math.ceil(layers / max(1, self.recompute_every)) / layers

    def executed_per_token(self) -> float:
        """FLOPs per token the GPU runs: :meth:`flops_per_token` with causal attention at the half flash attention
        computes (the blocks above the diagonal are skipped), plus the forward of the recomputed decoder layers
        (2 x their parameters and causal attention's forward, 2LHQT) and, with the chunked loss, the head's forward
        again in the backward (2 x its parameters). DPO's reference forward, where it runs, is in
        :meth:`flops_per_token` with its attention at the causal half too."""
        causal = self.attention_per_token() / 2 * (1 + self.reference_forward / 3)
        blocks = self.shape.num_hidden_layers * self.shape.block_linear_params()
        recompute = self.recomputed_layers() * (2 * blocks + causal / 3)
        head = 2 * self.shape.head_params(self.num_labels) * (self.loss_kernel == "chunked")
        return self.flops_per_token() - causal + recompute + head


def job_for(shape: ModelShape, setup, grad_accum: int = 4) -> Job:
    """The :class:`Job` of a memory planner's ``Setup`` (:mod:`.memory`) at ``grad_accum``."""
    return Job(shape, seq_len=setup.seq_len, micro_batch=setup.micro_batch, grad_accum=grad_accum,
               stage=setup.stage, engine=setup.engine, offload_optimizer=setup.offload_optimizer,
               gradient_checkpointing=setup.gradient_checkpointing, adapter=setup.adapter,
               num_labels=setup.num_labels, sequence_parallel=setup.sequence_parallel,
               recompute_every=setup.recompute_every, dpo=setup.dpo)


# A node's host, for the offloaded optimizer step: an assumption where the user gives none (make plan's --host-cores,
# --host-memory-gbps). 16 cores: the GPU machine the records in results/runs/ were measured on, one GPU with 16 CPU
# cores; 100 GB/s: a fraction of one socket's DDR5 that a streaming update sustains.
HOST_CORES = 16
HOST_MEMORY_GBPS = 100.0
# Bytes CPU Adam moves per parameter: reads the fp32 weight, gradient and both moments (16), writes the weight and
# both moments (12) and the bf16 copy sent back to the GPU (2).
ADAM_BYTES = 30


@dataclass(frozen=True)
class Cluster:
    gpu: Gpu
    gpus_per_node: int = 8
    nodes: int = 1
    network: Network | None = None  # between nodes; needed when nodes > 1
    host_cores: int = HOST_CORES  # per node: the threads DeepSpeed's CPU Adam runs on (offload)
    host_memory_GBps: float = HOST_MEMORY_GBPS  # per node: what CPU Adam's reads and writes share (offload)

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Efficiency:
    """Fitted constants: the compute share of the bf16 peak per method (and per method on a GPU
    family, "full on A100", where runs of that family were fitted), the time per trained parameter
    per optimizer step per method, CPU Adam's rate per host core, torch.compile's time over eager."""

    compute: dict = field(default_factory=lambda: {"full": 0.35, "frozen-base": 0.30})
    step_s_per_param: dict = field(default_factory=lambda: {"deepspeed": 5e-11, "torch": 1e-11})
    adam_params_per_s_per_core: float = 6.0e7
    compiled: float = 1.0  # the matmul time of compiled decoder layers over uncompiled ones (fitted on measured pairs)
    # fp8's added time, a fraction of the covered matmuls' bf16 time, fitted on measured bf16/fp8 pairs per
    # "<scaling> compiled|uncompiled" (results/runs/fp8/; empty: none measured, see fp8_overhead)
    fp8_overhead: dict = field(default_factory=dict)

    def adam_params_per_s(self, cluster: Cluster) -> float:
        """CPU Adam's parameters per second on one node: its cores at the fitted rate per core, at most what its
        memory streams at :data:`ADAM_BYTES` a parameter."""
        return min(cluster.host_cores * self.adam_params_per_s_per_core, cluster.host_memory_GBps * 1e9 / ADAM_BYTES)

    def compute_for(self, method: str, gpu: Gpu) -> float:
        return self.compute.get(f"{method} on {family(gpu)}", self.compute[method])


def family(gpu: Gpu) -> str:
    """"A100", "H100", "H200", "RTX 4090", ...: the GPU generation a compute efficiency is fitted per."""
    return gpu.kind


CALIBRATION_FILE = "speed-calibration.json"  # package data of finetune_kit.planning: what make results fits
CALIBRATED = "finetune_kit/planning/speed-calibration.json (package data, fitted by make results)"  # the source


def calibrated(path=None) -> tuple[Efficiency, str]:
    """The constants ``make results`` fitted and where they came from: the package's own
    ``speed-calibration.json`` (package data, so an installed package ranks as a checkout does), or ``path``'s;
    the uncalibrated defaults only where the package was installed without its data."""
    import json
    from importlib import resources
    from pathlib import Path

    if path is not None:
        text, source = Path(path).read_text(), str(path)
    else:
        packaged = resources.files("finetune_kit.planning").joinpath(CALIBRATION_FILE)
        if not packaged.is_file():
            return Efficiency(), f"uncalibrated defaults (the package has no {CALIBRATION_FILE})"
        text, source = packaged.read_text(), CALIBRATED
    data = json.loads(text)
    return (Efficiency(data["compute"], data["step_s_per_param"], data["adam_params_per_s_per_core"],
                       data.get("compiled", 1.0), data.get("fp8_overhead", {})), source)


@dataclass(frozen=True)
class Prediction:
    tokens_per_step: int  # all GPUs
    matmul_s: float  # the micro-batches' forward and backward (and the forward again when checkpointing)
    optimizer_s: float  # the optimizer step's time per trained parameter (on the GPU; offloaded: offload_s)
    intra_node_s: float
    inter_node_s: float
    offload_s: float

    @property
    def compute_s(self) -> float:
        return self.matmul_s + self.optimizer_s

    @property
    def communication_s(self) -> float:
        return self.intra_node_s + self.inter_node_s

    @property
    def step_s_range(self) -> tuple[float, float]:
        """(overlapped, not overlapped) seconds per optimizer step."""
        return (max(self.compute_s, self.communication_s) + self.offload_s,
                self.compute_s + self.communication_s + self.offload_s)

    @property
    def step_s(self) -> float:
        fast, slow = self.step_s_range
        return (fast + slow) / 2

    def tokens_per_s(self, gpus: int) -> float:
        """Per GPU, at the point estimate."""
        return self.tokens_per_step / self.step_s / gpus


def optimizer_kind(job: Job) -> str:
    """Whose optimizer step: DeepSpeed's, or PyTorch's (FSDP2, one device)."""
    return "deepspeed" if job.engine == "deepspeed" else "torch"


def _ring(bytes_: float, ranks: int) -> float:
    """Bytes each rank sends in an all-gather or reduce-scatter of ``bytes_`` over ``ranks``."""
    return (ranks - 1) / ranks * bytes_ if ranks > 1 else 0.0


def bytes_per_step(job: Job, gpus: int) -> float:
    """What each GPU sends in one optimizer step's collectives."""
    if gpus == 1:
        return 0.0
    params, trainable = job.shape.total_params(job.num_labels), job.trainable()
    frozen = params - trainable
    grad_bytes = FP32 if job.engine == "fsdp2" else BF16
    if job.stage >= 3:
        weights = trainable * BF16 + frozen * (NF4 if job.adapter and job.adapter.quantized else BF16)
        per_micro = (2 + job.reference_forward) * _ring(weights, gpus) + _ring(trainable * grad_bytes, gpus)
        return job.grad_accum * per_micro
    if job.stage == 2:
        return job.grad_accum * _ring(trainable * BF16, gpus) + _ring(trainable * BF16, gpus)
    return 2 * _ring(trainable * BF16, gpus)  # ZeRO-0/1: all-reduce of the gradients


def ulysses_bytes(*, size: int, layers: int, hidden_size: int, kv_dim: int, tokens: float, passes: int) -> float:
    """What each rank sends in one micro-batch's Ulysses all-to-alls: per layer the query (``hidden_size``), key and
    value (``kv_dim`` each) and the attention output (``hidden_size``) of its ``tokens`` (its 1/size of the sequence),
    in bf16, over ``passes`` (forward and backward, and the recomputed forward with checkpointing); each all-to-all
    keeps 1/size of its tensor on the rank. The recipes' line before a launch across nodes counts the same bytes
    (:func:`finetune_kit.training.sequence_parallel.across_nodes`)."""
    if size <= 1:
        return 0.0
    per_layer = (2 * hidden_size + 2 * kv_dim) * 2 * tokens
    return layers * passes * (size - 1) / size * per_layer


def all_to_all_bytes(job: Job) -> float:
    """:func:`ulysses_bytes` of one micro-batch of ``job``: forward, backward and (with checkpointing) the recomputed
    forward."""
    sp, shape = job.sequence_parallel, job.shape
    return ulysses_bytes(size=sp, layers=shape.num_hidden_layers, hidden_size=shape.hidden_size, kv_dim=shape.kv_dim,
                         tokens=job.sequences * job.seq_len / sp,
                         passes=2 + job.gradient_checkpointing + job.reference_forward)


def offload_pcie_s(job: Job, cluster: Cluster) -> float:
    """Each GPU's share of the gradients to host memory after every micro-batch's backward (ZeRO-3 accumulates them
    there), and of the updated bf16 weights back once per step, over its PCIe link."""
    share = job.trainable() * BF16 / cluster.gpus
    return (job.grad_accum + 1) * share / (cluster.gpu.host_link_GBps * 1e9 * LINK_EFFICIENCY)


def cpu_adam_s(job: Job, cluster: Cluster, efficiency: Efficiency) -> float:
    """DeepSpeed's CPU Adam over the node's share of the trainable parameters (:meth:`Efficiency.adam_params_per_s`:
    the host's cores, bounded by its memory's bandwidth)."""
    return job.trainable() / cluster.nodes / efficiency.adam_params_per_s(cluster)


def collective_s(sent: float, cluster: Cluster) -> tuple[float, float]:
    """(intra-node, inter-node) seconds of collectives in which each GPU sends ``sent`` bytes over the ring's slowest
    link: the GPU's NVLink/PCIe on one node; across nodes the network's per-node rate shared by the node's GPUs, where
    it is the slower."""
    intra_rate = cluster.gpu.intra_node_GBps * 1e9 * LINK_EFFICIENCY
    if cluster.nodes == 1:
        return sent / intra_rate, 0.0
    if cluster.network is None:
        from finetune_kit.errors import ConfigError

        raise ConfigError(f"{cluster.nodes} nodes need the network between them for the speed: pass NETWORK= to "
                          f"make plan (--network here), one of {', '.join(NETWORKS)} (ib400: 8 x 400 Gb/s "
                          "InfiniBand NICs per node; --network-gbps overrides a profile's GB/s).")
    inter_rate = cluster.network.per_node_GBps * 1e9 * LINK_EFFICIENCY / cluster.gpus_per_node
    return (0.0, sent / inter_rate) if inter_rate < intra_rate else (sent / intra_rate, 0.0)


def predict(job: Job, cluster: Cluster, efficiency: Efficiency | None = None) -> Prediction:
    eff = efficiency or Efficiency()
    gpus = cluster.gpus
    tokens = job.sequences * job.seq_len * job.grad_accum * gpus // max(1, job.sequence_parallel)
    matmul = tokens / gpus * job.executed_per_token() / (cluster.gpu.peak_bf16_tflops * 1e12
                                                         * eff.compute_for(job.method, cluster.gpu))
    matmul *= eff.compiled if job.compiled else 1.0
    shard = job.trainable() / (gpus if job.stage >= 1 else 1)
    optimizer = shard * eff.step_s_per_param[optimizer_kind(job)] * (not job.offload_optimizer)
    intra, inter = collective_s(bytes_per_step(job, gpus), cluster)
    intra_rate = cluster.gpu.intra_node_GBps * 1e9 * LINK_EFFICIENCY
    if job.sequence_parallel > 1:
        a2a = job.grad_accum * all_to_all_bytes(job)
        in_node = min(job.sequence_parallel, cluster.gpus_per_node)
        off_node = (job.sequence_parallel - in_node) / (job.sequence_parallel - 1)  # share bound for other nodes
        intra += a2a * (1 - off_node) / intra_rate
        if off_node:
            inter += a2a * off_node / (cluster.network.per_node_GBps * 1e9 * LINK_EFFICIENCY / cluster.gpus_per_node)
    offload = 0.0
    if job.offload_optimizer:
        offload = offload_pcie_s(job, cluster) + cpu_adam_s(job, cluster, eff)
    return Prediction(tokens, matmul, optimizer, intra, inter, offload)


def reference_pass(job: Job, cluster: Cluster, efficiency: Efficiency | None = None) -> Prediction:
    """DPO's precomputed reference (``Dpo("precomputed")``): the pass before training that runs the initial weights
    forward, without gradients, over both sequences of every training pair, one micro-batch of ``job.micro_batch``
    pairs per GPU at a time. A :class:`Prediction` of one such micro-batch (the time of T tokens: T /
    (``tokens_per_s(gpus)`` x gpus)): the executed FLOPs of a forward (:func:`.preference.reference_forward_per_token`)
    at the full fine-tune's fitted share of the peak (an assumption: no forward-only run is measured), and under
    ZeRO-3/FSDP2 one gather of the bf16 weights. No optimizer, no offload."""
    eff = efficiency or Efficiency()
    gpus = cluster.gpus
    tokens = job.sequences * job.seq_len * gpus // max(1, job.sequence_parallel)
    per_token = reference_forward_per_token(job.shape, job.attention_per_token(), job.num_labels)
    matmul = tokens / gpus * per_token / (cluster.gpu.peak_bf16_tflops * 1e12 * eff.compute_for("full", cluster.gpu))
    sent = _ring(job.shape.total_params(job.num_labels) * BF16, gpus) if job.stage >= 3 and gpus > 1 else 0.0
    intra, inter = collective_s(sent, cluster)
    return Prediction(tokens, matmul, 0.0, intra, inter, 0.0)
