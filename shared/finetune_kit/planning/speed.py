"""How fast a setup trains: tokens/s per GPU from compute, communication and CPU offload, per step.

One optimizer step of ``micro_batch x seq_len x grad_accum`` tokens on each of N GPUs takes:

* **compute**: the FLOPs the GPU executes (:meth:`Job.executed_per_token`) at ``efficiency`` x the GPU's dense
  bf16 peak: the model FLOPs (:class:`~finetune_kit.metering.flops.FlopCounter`: 6N + 12LHQT per token, or
  4N_frozen + 6N_trainable + 12LHQT with a frozen base) with causal attention at half of 12LHQT (flash attention
  skips the masked blocks), plus the forward again of the decoder layers checkpointing recomputes (all of them, or
  every ``recompute_every``-th) and, with the chunked loss, of the LM head. ``efficiency`` is the share of the peak
  a GPU reaches while it computes (kernels, launch gaps folded in); it is fitted on measured and published runs
  (:func:`fit_efficiency`), one value per method (full fine-tuning, frozen base). Compiled decoder layers take
  ``Efficiency.compiled`` of that time, fitted on pairs of runs that differ only in compilation
  (:func:`fit_compiled`).
* **communication**: the bytes each GPU sends in the step's collectives over the slowest link of the
  ring, the seed's T = 2(N-1)/N x M / B generalised: an all-gather or a reduce-scatter of M bytes
  moves (N-1)/N x M per GPU, an all-reduce twice that. Per micro-batch under ZeRO-3/FSDP2: the bf16
  weights gathered for the forward and again for the backward, the gradients reduce-scattered
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

* **fp8 matmuls** (``--fp8``, torchao's float8 linear layers; :func:`predict_fp8`): the share of the model
  FLOPs that the converted layers carry (:func:`fp8_share`: 6 x the parameters of the decoder's linear layers,
  not the LM head, not attention's 12LHQT) runs at the GPU's fp8 peak, the rest at the bf16 peak, both at the
  same fitted ``efficiency``; plus the time fp8 adds (:func:`fp8_overhead`), as a fraction of what the covered
  matmuls take in bf16: the casts to fp8 with their amax reductions, and fp8 matmuls reaching less of their
  peak than bf16 ones. Compiled, that fraction is fitted on torchao's published Llama 3 8B pair per scaling
  recipe (:data:`FP8_PUBLISHED`); uncompiled, each cast is its own unfused kernels, an assumption stated at
  :data:`UNFUSED_CASTS`. Communication, the optimizer step and offload stay as in bf16 (the weights are
  gathered in bf16).

Overlap is an assumption, stated as a range: the fast end hides the communication behind the
compute (step = max(compute, communication) + offload), the slow end does not (their sum); the
point estimate is their middle. The dominant term is the largest of compute, intra-node,
inter-node and offload time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from finetune_kit.metering.flops import FlopCounter
from finetune_kit.models import fp8
from finetune_kit.models.shapes import Adapter, ModelShape, resolve_model
from finetune_kit.planning.hardware import GPUS, LINK_EFFICIENCY, NETWORKS, Gpu, Network

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
                              head_trainable=bool(self.num_labels and self.adapter))
        return counter.per_token(self.seq_len)

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
        again in the backward (2 x its parameters)."""
        causal = self.attention_per_token() / 2
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
               recompute_every=setup.recompute_every)


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
    """"A100", "H100", "H200": the GPU generation a compute efficiency is fitted per."""
    return gpu.name.split()[0]


CALIBRATION_FILE = "speed-calibration.json"  # results/ beside README.md: what make results fits, make plan reads


def calibrated(path=None) -> tuple[Efficiency, str]:
    """The constants ``make results`` fitted (``results/speed-calibration.json``, or ``path``) and
    where they came from; the uncalibrated defaults without such a file."""
    import json
    from pathlib import Path

    if path is None or not Path(path).is_file():
        return Efficiency(), "uncalibrated defaults (no results/speed-calibration.json given)"
    data = json.loads(Path(path).read_text())
    return (Efficiency(data["compute"], data["step_s_per_param"], data["adam_params_per_s_per_core"],
                       data.get("compiled", 1.0), data.get("fp8_overhead", {})), str(path))


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

    def tokens_per_s_range(self, gpus: int) -> tuple[float, float]:
        fast, slow = self.step_s_range
        return self.tokens_per_step / slow / gpus, self.tokens_per_step / fast / gpus

    @property
    def terms(self) -> dict[str, float]:
        return {"compute": self.compute_s, "intra-node": self.intra_node_s, "inter-node": self.inter_node_s,
                "offload": self.offload_s}

    @property
    def dominant(self) -> str:
        return max(self.terms, key=self.terms.get)


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
        per_micro = 2 * _ring(weights, gpus) + _ring(trainable * grad_bytes, gpus)
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
                         tokens=job.micro_batch * job.seq_len / sp, passes=2 + job.gradient_checkpointing)


def offload_pcie_s(job: Job, cluster: Cluster) -> float:
    """Each GPU's share of the gradients to host memory after every micro-batch's backward (ZeRO-3 accumulates them
    there), and of the updated bf16 weights back once per step, over its PCIe link."""
    share = job.trainable() * BF16 / cluster.gpus
    return (job.grad_accum + 1) * share / (cluster.gpu.host_link_GBps * 1e9 * LINK_EFFICIENCY)


def cpu_adam_s(job: Job, cluster: Cluster, efficiency: Efficiency) -> float:
    """DeepSpeed's CPU Adam over the node's share of the trainable parameters (:meth:`Efficiency.adam_params_per_s`:
    the host's cores, bounded by its memory's bandwidth)."""
    return job.trainable() / cluster.nodes / efficiency.adam_params_per_s(cluster)


def predict(job: Job, cluster: Cluster, efficiency: Efficiency | None = None) -> Prediction:
    eff = efficiency or Efficiency()
    gpus = cluster.gpus
    tokens = job.micro_batch * job.seq_len * job.grad_accum * gpus // max(1, job.sequence_parallel)
    matmul = tokens / gpus * job.executed_per_token() / (cluster.gpu.peak_bf16_tflops * 1e12
                                                         * eff.compute_for(job.method, cluster.gpu))
    matmul *= eff.compiled if job.compiled else 1.0
    shard = job.trainable() / (gpus if job.stage >= 1 else 1)
    optimizer = shard * eff.step_s_per_param[optimizer_kind(job)] * (not job.offload_optimizer)
    sent = bytes_per_step(job, gpus)
    intra_rate = cluster.gpu.intra_node_GBps * 1e9 * LINK_EFFICIENCY
    intra = inter = 0.0
    if cluster.nodes > 1:
        if cluster.network is None:
            from finetune_kit.errors import ConfigError

            raise ConfigError(f"{cluster.nodes} nodes need the network between them for the speed: pass NETWORK= to "
                              f"make plan (--network here), one of {', '.join(NETWORKS)} (ib400: 8 x 400 Gb/s "
                              "InfiniBand NICs per node; --network-gbps overrides a profile's GB/s).")
        inter_rate = cluster.network.per_node_GBps * 1e9 * LINK_EFFICIENCY / cluster.gpus_per_node
        if inter_rate < intra_rate:
            inter = sent / inter_rate
        else:
            intra = sent / intra_rate
    else:
        intra = sent / intra_rate
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


# ---- fp8 matmuls (torchao float8 linear layers) ----

# Published fp8 speed-ups the compiled overhead is fitted on, per scaling recipe: (bf16, fp8) tokens/s per GPU of
# the torchao float8 README's training benchmark (Llama 3 8B, 8 x H100, FSDP2, torch.compile, batch 1 x 8,192
# tokens, torchao 0.10; https://github.com/pytorch/ao/blob/main/torchao/float8/README.md). Its selective
# checkpointing is modelled as full checkpointing, as for every run; its tensorwise run gathered the weights in
# fp8, which the model leaves out: the weight gathers are under 10% of that step.
FP8_PUBLISHED = {"tensorwise": (6150.0, 7689.5), "rowwise": (6150.0, 6768.0)}
FP8_PUBLISHED_SEQ_LEN = 8192

# Assumption: what the casts cost on top when nothing fuses them (no torch.compile), as a fraction of the covered
# matmuls' bf16 time. Unfused, each cast is an amax reduction, a scale and a saturated cast, each its own kernel
# reading and writing the whole bf16 tensor, for every operand of the forward, the recomputed forward and the
# backward. Basis: torchao's float8 FFN at width 4,096 on one H100 (https://github.com/pytorch/ao/issues/685)
# took 1.14x the bf16 time uncompiled and 0.61x compiled, a difference of about half the bf16 time.
UNFUSED_CASTS = 0.5


def fp8_share(job: Job) -> float:
    """Share of the job's model FLOPs per token that fp8 matmuls carry: 6 x the parameters of the decoder's linear
    layers that convert (:func:`finetune_kit.models.fp8.keeps_fp8`: both widths multiples of 16; never the LM head)
    over :meth:`Job.flops_per_token`. The rest, the head and attention's 12LHQT, stays bf16."""
    converted = sum(i * o for i, o in job.shape.linear_shapes().values()
                    if i % fp8.ALIGNMENT == 0 and o % fp8.ALIGNMENT == 0)
    return 6 * job.shape.num_hidden_layers * converted / job.flops_per_token()


def check_fp8(job: Job, gpu: Gpu, recipe: str) -> None:
    """ConfigError where ``--fp8 recipe`` cannot run or cannot gain, as the recipes refuse it
    (:func:`finetune_kit.models.fp8.check`)."""
    from finetune_kit.errors import ConfigError

    if recipe not in FP8_PUBLISHED:
        raise ConfigError(f"--fp8 {recipe}: not one of {', '.join(FP8_PUBLISHED)}.")
    if gpu.peak_fp8_tflops is None:
        raise ConfigError(f"--fp8 {recipe} on {gpu.name}: it has no fp8 tensor cores (its profile has no fp8 peak); "
                          "fp8 matmuls need compute capability 8.9 or above. Use --gpu h100 or h200, or drop --fp8.")
    if job.adapter is not None:
        raise ConfigError(f"--fp8 {recipe} on a LoRA/QLoRA plan: the frozen base computes in bf16 and the LoRA "
                          "matrices are too small for fp8 matmuls to gain. Drop --fp8.")


def _with_fp8(base: Prediction, share: float, gpu: Gpu, overhead: float) -> Prediction:
    covered = base.matmul_s * share  # bf16 seconds of the matmuls that turn fp8
    fp8_matmul = covered * gpu.peak_bf16_tflops / gpu.peak_fp8_tflops
    return replace(base, matmul_s=base.matmul_s - covered + fp8_matmul + overhead * covered)


def fit_fp8_overhead(job: Job, cluster: Cluster, speedup: float, efficiency: Efficiency | None = None) -> float:
    """The overhead (a fraction of the covered matmuls' bf16 time) at which the model predicts ``speedup``, fp8's
    tokens/s over bf16's, for ``job`` on ``cluster``, by bisection; 0 where even no overhead falls short."""
    base = predict(job, cluster, efficiency)
    share = fp8_share(job)

    def predicted(overhead: float) -> float:
        return base.step_s / _with_fp8(base, share, cluster.gpu, overhead).step_s

    low, high = 0.0, 16.0
    if predicted(low) <= speedup:
        return 0.0
    for _ in range(80):
        middle = (low + high) / 2
        low, high = (middle, high) if predicted(middle) > speedup else (low, middle)
    return (low + high) / 2


def fitted_fp8_overhead(recipe: str, efficiency: Efficiency | None = None) -> float:
    """The compiled overhead at which the model reproduces the published speed-up of ``recipe``
    (:data:`FP8_PUBLISHED`: torchao's Llama 3 8B on 8 H100s)."""
    bf16, fp8_speed = FP8_PUBLISHED[recipe]
    job = Job(resolve_model("llama3-8b"), seq_len=FP8_PUBLISHED_SEQ_LEN, micro_batch=1, engine="fsdp2")
    return fit_fp8_overhead(job, Cluster(GPUS["h100"], 8, 1), fp8_speed / bf16, efficiency)


def fp8_key(recipe: str, compiled: bool) -> str:
    """The key of :attr:`Efficiency.fp8_overhead`: ``"tensorwise compiled"``, ``"rowwise uncompiled"``."""
    return f"{recipe} {'compiled' if compiled else 'uncompiled'}"


def fp8_cost(recipe: str, compiled: bool, efficiency: Efficiency | None = None) -> tuple[float, str]:
    """What fp8 adds, as a fraction of the covered matmuls' bf16 time, and where that figure comes from:

    * fitted on a measured pair of this scaling and compile setting (``efficiency.fp8_overhead``);
    * uncompiled, with this scaling measured compiled and another scaling measured both ways: this scaling's
      compiled cost plus the unfused casts' measured cost of the other (predicted);
    * else the compiled cost fitted on torchao's published pair (:data:`FP8_PUBLISHED`), plus
      :data:`UNFUSED_CASTS` (an assumption) when not compiled (predicted)."""
    measured = (efficiency or Efficiency()).fp8_overhead
    key = fp8_key(recipe, compiled)
    if key in measured:
        return measured[key], "fitted on a measured pair"
    both = [r for r in FP8_PUBLISHED if fp8_key(r, True) in measured and fp8_key(r, False) in measured]
    if not compiled and fp8_key(recipe, True) in measured and both:
        casts = measured[fp8_key(both[0], False)] - measured[fp8_key(both[0], True)]
        return (measured[fp8_key(recipe, True)] + casts,
                f"predicted: its measured compiled cost plus {both[0]}'s measured unfused casts")
    return (fitted_fp8_overhead(recipe, efficiency) + (0.0 if compiled else UNFUSED_CASTS),
            "predicted: torchao's published pair" + ("" if compiled else " plus assumed unfused casts"))


def fp8_overhead(recipe: str, compiled: bool, efficiency: Efficiency | None = None) -> float:
    """What fp8 adds, as a fraction of the covered matmuls' bf16 time (:func:`fp8_cost`)."""
    return fp8_cost(recipe, compiled, efficiency)[0]


def predict_fp8(job: Job, cluster: Cluster, efficiency: Efficiency | None = None, recipe: str = "tensorwise",
                compiled: bool = False) -> Prediction:
    """:func:`predict` with the decoder's linear layers in fp8 (torchao float8, ``recipe`` scaling), each decoder
    layer through torch.compile or not."""
    check_fp8(job, cluster.gpu, recipe)
    base = predict(job, cluster, efficiency)
    return _with_fp8(base, fp8_share(job), cluster.gpu, fp8_overhead(recipe, compiled, efficiency))


# ---- fitting the efficiencies on runs with a known speed ----

@dataclass(frozen=True)
class Observation:
    """A run whose speed is known: its job, its cluster, tokens/s per GPU as measured or published."""

    name: str
    job: Job
    cluster: Cluster
    tokens_per_s_per_gpu: float
    source: str = "published"  # "published" | "measured"
    fitted: bool = True  # False: predicted and compared, kept out of every fit (a source too vague to fit on)
    fp8: str = ""  # torchao float8 scaling of an fp8 run ("tensorwise", "rowwise"); "" for bf16. Never fitted.
    compiled: bool = False  # decoder layers through torch.compile (what fp8's cost depends on)

    def __post_init__(self):
        if self.fp8 and self.fitted:
            raise ValueError(f"{self.name}: an fp8 run is compared, never fitted (the fit is of bf16 compute)")


def predict_observation(obs: Observation, efficiency: Efficiency | None = None) -> Prediction:
    """:func:`predict`, or :func:`predict_fp8` for an fp8 run."""
    if obs.fp8:
        return predict_fp8(obs.job, obs.cluster, efficiency, obs.fp8, obs.compiled)
    return predict(obs.job, obs.cluster, efficiency)


def fit_efficiency(observations: list[Observation], start: Efficiency | None = None) -> Efficiency:
    """The compute shares and step times on the uncompiled fitted runs, then torch.compile's factor on the
    compiled ones (:func:`fit_compiled`)."""
    observations = [o for o in observations if o.fitted]
    eff = _fit([o for o in observations if not o.job.compiled], start)
    return replace(eff, compiled=fit_compiled(observations, eff))


def _fit(observations: list[Observation], start: Efficiency | None = None) -> Efficiency:
    """Weighted least squares on each run's step time (relative errors), the communication and
    offload terms held at the model's values and overlap at the point estimate: per method, one
    compute share per GPU family with two or more runs (the others share the method's) and one
    per-parameter step time per optimizer kind; then CPU Adam's rate from the offloaded runs."""
    import numpy as np

    eff = start or Efficiency()
    compute, per_param = dict(eff.compute), dict(eff.step_s_per_param)
    runs = [o for o in observations if not o.job.offload_optimizer]
    kinds = sorted({optimizer_kind(o.job) for o in runs})
    columns_per_param, rows, targets, groups = [(k, None) for k in kinds], [], [], []
    for method in sorted(compute):
        mine = [o for o in runs if o.job.method == method]
        sizes: dict[str, int] = {}
        for o in mine:
            sizes[family(o.cluster.gpu)] = sizes.get(family(o.cluster.gpu), 0) + 1
        own = [f for f, n in sorted(sizes.items()) if n >= 2] if len(sizes) > 1 else []
        groups += [(method, f) for f in own] + [(method, None)] * bool(set(sizes) - set(own))  # None: the rest
        for o in mine:
            unit = predict(o.job, o.cluster, Efficiency({method: 1.0}, dict.fromkeys(kinds, 0.0),
                                                        eff.adam_params_per_s_per_core, eff.compiled))
            step = unit.tokens_per_step / o.cluster.gpus / o.tokens_per_s_per_gpu
            shard = o.job.trainable() / (o.cluster.gpus if o.job.stage >= 1 else 1)
            group = (method, family(o.cluster.gpu) if family(o.cluster.gpu) in own else None)
            rows.append((group, unit.matmul_s / step, optimizer_kind(o.job), shard / step))
            targets.append((step - unit.communication_s / 2) / step)
    if rows:
        matrix = [[x * (g == group) for group in groups] + [y * (k == kind) for kind, _ in columns_per_param]
                  for g, x, k, y in rows]
        matrix = np.array(matrix)
        scale = np.where(np.abs(matrix).max(axis=0) > 0, np.abs(matrix).max(axis=0), 1.0)  # columns of one size
        solution = np.linalg.lstsq(matrix / scale, np.array(targets), rcond=None)[0] / scale
        inverses, seconds = solution[:len(groups)], solution[len(groups):]
        for (method, fam), inverse in zip(groups, inverses, strict=True):
            if inverse > 1:  # a share of the peak above 1 is no fit: keep the previous value
                compute[method if fam is None else f"{method} on {fam}"] = 1 / float(inverse)
        for (kind, _), value in zip(columns_per_param, seconds, strict=True):
            per_param[kind] = max(0.0, float(value))
        for method in compute.copy():  # a method fitted per family only: its fallback is their mean
            families = [v for k, v in compute.items() if k.startswith(f"{method} on ")]
            if families and (method, None) not in groups and " on " not in method:
                compute[method] = math.exp(sum(map(math.log, families)) / len(families))
    eff = Efficiency(compute, per_param, eff.adam_params_per_s_per_core, eff.compiled)
    rates = []
    for o in observations:
        if not o.job.offload_optimizer:
            continue
        base = predict(o.job, o.cluster, eff)
        step = base.tokens_per_step / o.cluster.gpus / o.tokens_per_s_per_gpu
        adam = step - (base.step_s - base.offload_s) - offload_pcie_s(o.job, o.cluster)
        if adam > 0:  # the rate per core at which CPU Adam takes the rest of the step
            rates.append(o.job.trainable() / o.cluster.nodes / adam / o.cluster.host_cores)
    if rates:
        eff = replace(eff, adam_params_per_s_per_core=math.exp(sum(map(math.log, rates)) / len(rates)))
    return eff


def fit_compiled(observations: list[Observation], efficiency: Efficiency) -> float:
    """``Efficiency.compiled`` from the pairs of fitted runs that differ only in torch.compile (same job otherwise,
    same GPUs): the compiled matmul time over the uncompiled, 1 + (compiled step - uncompiled step) / the uncompiled
    matmul time the model gives; their geometric mean, or 1 without a pair. A pair holds the rest of the step
    equal, so the model's errors elsewhere stay out of this factor."""
    runs = [o for o in observations if o.fitted]
    ratios = []
    for c in (o for o in runs if o.job.compiled):
        for u in (o for o in runs if not o.job.compiled and o.job == replace(c.job, compiled=False)
                  and o.cluster == c.cluster):
            p = predict(u.job, u.cluster, replace(efficiency, compiled=1.0))
            seconds = [p.tokens_per_step / o.cluster.gpus / o.tokens_per_s_per_gpu for o in (c, u)]
            ratio = 1 + (seconds[0] - seconds[1]) / p.matmul_s
            if ratio > 0:
                ratios.append(ratio)
    return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else 1.0


def held_out_errors(observations: list[Observation], fp8_overhead: dict | None = None) -> dict[str, float]:
    """Each observation predicted by the efficiencies fitted on all the other fitted ones: the relative error
    (predicted / observed - 1) per observation name. fp8 runs take their cost from ``fp8_overhead`` (fitted on
    measured pairs, :attr:`Efficiency.fp8_overhead`)."""
    out = {}
    for i, obs in enumerate(observations):
        fitted = replace(fit_efficiency(observations[:i] + observations[i + 1:]), fp8_overhead=fp8_overhead or {})
        out[obs.name] = predict_observation(obs, fitted).tokens_per_s(obs.cluster.gpus) / obs.tokens_per_s_per_gpu - 1
    return out
