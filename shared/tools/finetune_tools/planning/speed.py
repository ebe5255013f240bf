"""How fast a setup trains: tokens/s per GPU from compute, communication and CPU offload, per step.

One optimizer step of ``micro_batch x seq_len x grad_accum`` tokens on each of N GPUs takes:

* **compute**: its model FLOPs (:class:`~finetune_kit.metering.flops.FlopCounter`: 6N + 12LHQT per
  token, or 4N_frozen + 6N_trainable + 12LHQT with a frozen base) at ``efficiency`` x the GPU's dense
  bf16 peak, plus the forward pass again under activation checkpointing (2N of 6N per token, or of
  4N with a frozen base). ``efficiency`` is the share of the peak a GPU reaches as model FLOPs while it computes
  (recomputation, kernels, launch gaps folded in); it is fitted on measured and published runs
  (:func:`fit_efficiency`), one value per method (full fine-tuning, frozen base).
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
* **CPU offload** (ZeRO's ``offload_optimizer``): each GPU's share of the gradients to host memory
  and of the updated weights back over PCIe, then DeepSpeed's CPU Adam over the node's share of the
  trainable parameters at ``adam_params_per_s`` per node (fitted on the offloaded runs).

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
from finetune_kit.training import sequence_parallel
from finetune_tools.planning.hardware import GPUS, LINK_EFFICIENCY, NETWORKS, Gpu, Network

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


def job_for(shape: ModelShape, setup, grad_accum: int = 4) -> Job:
    """The :class:`Job` of a memory planner's ``Setup`` (:mod:`.memory`) at ``grad_accum``."""
    return Job(shape, seq_len=setup.seq_len, micro_batch=setup.micro_batch, grad_accum=grad_accum,
               stage=setup.stage, engine=setup.engine, offload_optimizer=setup.offload_optimizer,
               gradient_checkpointing=setup.gradient_checkpointing, adapter=setup.adapter,
               num_labels=setup.num_labels, sequence_parallel=setup.sequence_parallel)


@dataclass(frozen=True)
class Cluster:
    gpu: Gpu
    gpus_per_node: int = 8
    nodes: int = 1
    network: Network | None = None  # between nodes; needed when nodes > 1

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Efficiency:
    """Fitted constants: the compute share of the bf16 peak per method (and per method on a GPU
    family, "full on A100", where runs of that family were fitted), the time per trained parameter
    per optimizer step per method, CPU Adam's rate per node."""

    compute: dict = field(default_factory=lambda: {"full": 0.35, "frozen-base": 0.30})
    step_s_per_param: dict = field(default_factory=lambda: {"deepspeed": 5e-11, "torch": 1e-11})
    adam_params_per_s: float = 1.0e9
    # fp8's added time, a fraction of the covered matmuls' bf16 time, fitted on measured bf16/fp8 pairs per
    # "<scaling> compiled|uncompiled" (results/runs/fp8/; empty: none measured, see fp8_overhead)
    fp8_overhead: dict = field(default_factory=dict)

    def compute_for(self, method: str, gpu: Gpu) -> float:
        return self.compute.get(f"{method} on {family(gpu)}", self.compute[method])


def family(gpu: Gpu) -> str:
    """"A100", "H100", "H200": the GPU generation a compute efficiency is fitted per."""
    return gpu.name.split()[0]


def calibrated(path=None) -> tuple[Efficiency, str]:
    """The constants ``make results`` fitted (``results/speed-calibration.json``, or ``path``) and
    where they came from; the uncalibrated defaults without such a file."""
    import json
    from pathlib import Path

    if path is None or not Path(path).is_file():
        return Efficiency(), "uncalibrated defaults (no results/speed-calibration.json given)"
    data = json.loads(Path(path).read_text())
    return (Efficiency(data["compute"], data["step_s_per_param"], data["adam_params_per_s"],
                       data.get("fp8_overhead", {})), str(path))


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


def all_to_all_bytes(job: Job) -> float:
    """What each GPU sends in one micro-batch's Ulysses all-to-alls, as the recipe's own line before a launch across
    nodes counts it (:func:`finetune_kit.training.sequence_parallel.all_to_all_bytes`): forward, backward and (with
    checkpointing) the recomputed forward."""
    sp, shape = job.sequence_parallel, job.shape
    return sequence_parallel.all_to_all_bytes(size=sp, layers=shape.num_hidden_layers, hidden_size=shape.hidden_size,
                                              kv_dim=shape.kv_dim, tokens=job.micro_batch * job.seq_len / sp,
                                              passes=2 + job.gradient_checkpointing)


def predict(job: Job, cluster: Cluster, efficiency: Efficiency | None = None) -> Prediction:
    eff = efficiency or Efficiency()
    gpus = cluster.gpus
    tokens = job.micro_batch * job.seq_len * job.grad_accum * gpus // max(1, job.sequence_parallel)
    recompute = 1 + (1 / 3 if job.adapter is None else 1 / 2) * job.gradient_checkpointing  # the forward again
    matmul = tokens / gpus * job.flops_per_token() * recompute / (cluster.gpu.peak_bf16_tflops * 1e12
                                                                  * eff.compute_for(job.method, cluster.gpu))
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
        trainable = job.trainable()
        pcie = 2 * trainable * BF16 / gpus / (cluster.gpu.host_link_GBps * 1e9 * LINK_EFFICIENCY)
        offload = pcie + trainable / cluster.nodes / eff.adam_params_per_s
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
    observations = [o for o in observations if o.fitted]
    return _fit(observations, start)


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
                                                        eff.adam_params_per_s))
            step = unit.tokens_per_step / o.cluster.gpus / o.tokens_per_s_per_gpu
            shard = o.job.trainable() / (o.cluster.gpus if o.job.stage >= 1 else 1)
            group = (method, family(o.cluster.gpu) if family(o.cluster.gpu) in own else None)
            rows.append((group, unit.matmul_s / step, optimizer_kind(o.job), shard / step))
            targets.append((step - unit.communication_s / 2) / step)
    if rows:
        matrix = [[x * (g == group) for group in groups] + [y * (k == kind) for kind, _ in columns_per_param]
                  for g, x, k, y in rows]
        solution = np.linalg.lstsq(np.array(matrix), np.array(targets), rcond=None)[0]
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
    eff = Efficiency(compute, per_param, eff.adam_params_per_s)
    rates = []
    for o in observations:
        if not o.job.offload_optimizer:
            continue
        base = predict(o.job, o.cluster, eff)
        step = base.tokens_per_step / o.cluster.gpus / o.tokens_per_s_per_gpu
        adam = step - (base.step_s - base.offload_s) - (base.offload_s - o.job.trainable() / o.cluster.nodes
                                                        / eff.adam_params_per_s)
        if adam > 0:
            rates.append(o.job.trainable() / o.cluster.nodes / adam)
    if rates:
        eff = Efficiency(compute, per_param, math.exp(sum(map(math.log, rates)) / len(rates)))
    return eff


def held_out_errors(observations: list[Observation], fp8_overhead: dict | None = None) -> dict[str, float]:
    """Each observation predicted by the efficiencies fitted on all the other fitted ones: the relative error
    (predicted / observed - 1) per observation name. fp8 runs take their cost from ``fp8_overhead`` (fitted on
    measured pairs, :attr:`Efficiency.fp8_overhead`)."""
    out = {}
    for i, obs in enumerate(observations):
        fitted = replace(fit_efficiency(observations[:i] + observations[i + 1:]), fp8_overhead=fp8_overhead or {})
        out[obs.name] = predict_observation(obs, fitted).tokens_per_s(obs.cluster.gpus) / obs.tokens_per_s_per_gpu - 1
    return out
