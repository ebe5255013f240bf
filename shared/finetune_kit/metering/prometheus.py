"""Live training metrics for Prometheus: an opt-in HTTP endpoint on every rank.

Off unless asked for. ``FINETUNE_METRICS_PORT=9450`` in the launch's environment (``make ...
METRICS_PORT=9450``) turns it on for every recipe: each process serves
``http://<host>:<9450 + local rank>/metrics``, so a node with 8 GPUs answers on 9450-9457 and
every node uses the same ports. One endpoint per rank, not one per node: a straggler is a rank,
and aggregating in the trainer would add a collective to every step. ``FINETUNE_METRICS_ADDR``
picks the address it listens on: every interface by default, since Prometheus on another node must
reach it; ``127.0.0.1`` when Prometheus runs on the node itself; or one of the node's own addresses
(the cluster network's). Another address is refused before anything loads (:func:`requested_addr`).

The series carry numbers and the labels :data:`LABELS` only (the recipe's name, rank numbers and the
host name): no text of the training data reaches Prometheus.

What a rank exports (names: :data:`SERIES`; every series carries the labels :data:`LABELS`):

- the step's figures, the same on every rank (reduced over ranks, as in ``metrics.jsonl``): step,
  epoch, loss, learning rate, tokens/s (all ranks, and per device), padding fraction, model
  TFLOP/s per device, MFU, step time; the fp16 loss scale and skipped steps when they exist;
- this rank's own: real tokens trained (a counter; ``rate()`` of it is the rank's tokens/s), GPU
  memory now and at peak (torch's allocator), host RSS now and at peak; and, with a GPU, its
  utilisation, temperature and power from NVML (read when Prometheus scrapes).

A port already in use is reported on that rank and training goes on without its endpoint. The
endpoint closes when the run ends (:meth:`MetricsEndpoint.close`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from finetune_kit.errors import ConfigError
from finetune_kit.metering import keys

ENV_PORT = "FINETUNE_METRICS_PORT"
ENV_ADDR = "FINETUNE_METRICS_ADDR"
DEFAULT_PORT = 9450  # the documented base; nothing listens unless ENV_PORT is set
LABELS = ("recipe", "rank", "local_rank", "node", "host")
PREFIX = "finetune_"


@dataclass(frozen=True)
class Series:
    name: str  # without the exposition's suffixes (a counter gains _total)
    kind: str  # "gauge" | "counter"
    help: str
    key: str | None = None  # the metrics.jsonl key it mirrors, when there is one

    @property
    def exposed(self) -> str:
        """The name Prometheus stores (and a dashboard queries)."""
        return self.name + ("_total" if self.kind == "counter" else "")


def _mirror(metric: keys.Metric, name: str) -> Series:
    return Series(PREFIX + name, "gauge", f"{metric.description} ({metric.unit})", metric.key)


# The step's figures, reduced over ranks: each mirrors a metrics.jsonl key.
STEP_SERIES = (
    _mirror(keys.STEP, "step"), _mirror(keys.EPOCH, "epoch"), _mirror(keys.LOSS, "loss"),
    _mirror(keys.LR, "learning_rate"), _mirror(keys.TOKENS_PER_S, "tokens_per_second"),
    _mirror(keys.TOKENS_PER_S_PER_DEVICE, "tokens_per_second_per_device"),
    _mirror(keys.PADDING_FRACTION, "padding_fraction"),
    _mirror(keys.TFLOPS_PER_DEVICE, "model_tflops_per_second_per_device"), _mirror(keys.MFU, "mfu_percent"),
    _mirror(keys.STEP_TIME, "step_time_seconds"), _mirror(keys.LOSS_SCALE, "loss_scale"),
    _mirror(keys.SKIPPED_STEPS, "skipped_steps"),
    *(_mirror(metric, "dpo_" + metric.key) for metric in keys.PREFERENCE.values()),  # DPO runs only
)
RANK_TOKENS = Series(PREFIX + "rank_tokens", "counter", "real (non-padding) tokens this rank trained on (tokens)")
GPU_MEMORY = Series(PREFIX + "gpu_memory_bytes", "gauge",
                    "GPU memory of this rank now: kind=allocated (live tensors) or reserved (torch's cache) (bytes)")
GPU_MEMORY_PEAK = Series(PREFIX + "gpu_memory_peak_bytes", "gauge",
                         "peak GPU memory of this rank so far, kind=allocated or reserved (bytes)")
HOST_RSS = Series(PREFIX + "host_rss_bytes", "gauge", "resident set size of this rank's process now (bytes)")
HOST_RSS_PEAK = Series(PREFIX + "host_rss_peak_bytes", "gauge", "peak resident set size of this rank's process (bytes)")
GPU_UTILIZATION = Series(PREFIX + "gpu_utilization_percent", "gauge",
                         "share of the last sample period a kernel ran on this rank's GPU, NVML (%)")
GPU_TEMPERATURE = Series(PREFIX + "gpu_temperature_celsius", "gauge", "this rank's GPU temperature, NVML (°C)")
GPU_POWER = Series(PREFIX + "gpu_power_watts", "gauge", "this rank's GPU power draw, NVML (W)")
RANK_SERIES = (RANK_TOKENS, GPU_MEMORY, GPU_MEMORY_PEAK, HOST_RSS, HOST_RSS_PEAK)
NVML_SERIES = (GPU_UTILIZATION, GPU_TEMPERATURE, GPU_POWER)
SERIES = STEP_SERIES + RANK_SERIES + NVML_SERIES


def exported_names() -> frozenset[str]:
    """Every metric name a trainer's endpoint can expose (what a dashboard may query)."""
    return frozenset(s.exposed for s in SERIES)


def requested_addr() -> str:
    """The address the endpoint listens on: ``FINETUNE_METRICS_ADDR``, or every interface (``0.0.0.0``). Raises a
    ConfigError, in one line, for a value that is not an IP address of this host (a loopback address, one of its
    interfaces', or ``0.0.0.0`` / ``::`` for all), before anything loads."""
    import ipaddress
    import socket

    raw = os.environ.get(ENV_ADDR, "").strip()
    if not raw:
        return "0.0.0.0"
    own = _host_addresses()
    try:
        ip = ipaddress.ip_address(raw.strip("[]"))
    except ValueError:
        ip = None
    if ip is not None and (ip.is_unspecified or ip.is_loopback or str(ip) in own):
        return str(ip)
    what = "not an IP address" if ip is None else "not an address of this host"
    raise ConfigError(f"{ENV_ADDR}={raw!r}: {what}, so no metrics endpoint can listen there. This host "
                      f"({socket.gethostname()}) has {', '.join(sorted(own, key=_by_kind))}. Set it to one of them "
                      "(127.0.0.1: Prometheus on this node only), or unset it to listen on every interface, which "
                      "Prometheus on another node needs.")


def _host_addresses() -> set[str]:
    """The IPv4 and IPv6 addresses of this host's interfaces (IPv6 link-local ones without their zone)."""
    import socket

    import psutil

    return {a.address.split("%")[0] for addresses in psutil.net_if_addrs().values() for a in addresses
            if a.family in (socket.AF_INET, socket.AF_INET6)}


def _by_kind(address: str) -> tuple[bool, str]:
    return ":" in address, address  # IPv4 first


def requested_port() -> int | None:
    """The base port ``FINETUNE_METRICS_PORT`` asks for, or None (no endpoint). Raises a
    ConfigError for a value that is not a usable port, before anything loads."""
    raw = os.environ.get(ENV_PORT, "").strip()
    if not raw:
        return None
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    if not raw.isdigit() or not 1024 <= int(raw) <= 65535 - (local_world - 1):
        raise ConfigError(f"{ENV_PORT}={raw!r}: the metrics endpoint needs a base port from 1024 to "
                          f"{65535 - (local_world - 1)} (rank k of a node serves base + k). Set e.g. "
                          f"{ENV_PORT}={DEFAULT_PORT}, or unset it to train without the endpoint.")
    return int(raw)


class MetricsEndpoint:
    """This rank's ``/metrics``. ``update(record)`` after each optimizer step with the step's
    metrics (``metrics.jsonl``'s keys); ``rank_tokens(n)`` with this rank's real tokens of it."""

    def __init__(self, port: int, *, recipe: str, rank: int, local_rank: int, node: int, host: str,
                 addr: str = "0.0.0.0"):
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.port, self.registry = port, CollectorRegistry()
        labels = {"recipe": recipe, "rank": str(rank), "local_rank": str(local_rank), "node": str(node), "host": host}

        def gauge(series: Series, *extra: str):
            return Gauge(series.name, series.help, (*LABELS, *extra), registry=self.registry)

        self._labels = labels
        self._step = {s.key: gauge(s) for s in STEP_SERIES}  # a series appears once it has a value
        self._tokens = Counter(RANK_TOKENS.name, RANK_TOKENS.help, LABELS, registry=self.registry).labels(**labels)
        self._watch(gauge, labels)
        self.server, self.thread = start_http_server(port, addr=addr, registry=self.registry)

    def _watch(self, gauge, labels: dict) -> None:
        """Series read when Prometheus scrapes: memory now and at peak; NVML's GPU health."""
        import psutil
        import torch

        from finetune_kit.metering import peak_memory

        process = psutil.Process()
        gauge(HOST_RSS).labels(**labels).set_function(lambda: process.memory_info().rss)
        gauge(HOST_RSS_PEAK).labels(**labels).set_function(lambda: peak_memory.peaks()[keys.HOST_RSS.key] * 2**30)
        if not torch.cuda.is_available():
            return
        device = torch.cuda.current_device()
        now, peak = gauge(GPU_MEMORY, "kind"), gauge(GPU_MEMORY_PEAK, "kind")
        now.labels(**labels, kind="allocated").set_function(lambda: torch.cuda.memory_allocated(device))
        now.labels(**labels, kind="reserved").set_function(lambda: torch.cuda.memory_reserved(device))
        peak.labels(**labels, kind="allocated").set_function(lambda: torch.cuda.max_memory_allocated(device))
        peak.labels(**labels, kind="reserved").set_function(lambda: torch.cuda.max_memory_reserved(device))
        try:  # torch maps the CUDA index to NVML's (CUDA_VISIBLE_DEVICES); needs nvidia-ml-py
            torch.cuda.utilization(device)
        except Exception as exc:  # noqa: BLE001 - no NVML: the GPU-health series are left out, training goes on
            print(f"metrics endpoint: no GPU utilisation, temperature or power ({exc}); DCGM's exporter has them")
            return
        for series, read in ((GPU_UTILIZATION, torch.cuda.utilization), (GPU_TEMPERATURE, torch.cuda.temperature),
                             (GPU_POWER, lambda d: torch.cuda.power_draw(d) / 1000)):  # NVML: milliwatts
            gauge(series).labels(**labels).set_function(lambda read=read: read(device))

    def update(self, record: dict) -> None:
        for key, value in record.items():
            if key in self._step and value is not None:
                self._step[key].labels(**self._labels).set(value)

    def rank_tokens(self, tokens: int) -> None:
        self._tokens.inc(tokens)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def open_endpoint(recipe: str) -> MetricsEndpoint | None:
    """This rank's endpoint when ``FINETUNE_METRICS_PORT`` is set, else None. A port in use is
    reported (which rank, which port, what to do) and the run goes on without it."""
    from finetune_kit.launch import env

    base = requested_port()
    if base is None:
        return None
    launch = env.view()
    port = base + launch.local_rank
    try:
        endpoint = MetricsEndpoint(port, recipe=recipe, rank=launch.rank, local_rank=launch.local_rank,
                                   node=launch.machine_rank, host=launch.host, addr=requested_addr())
    except OSError as exc:
        print(f"metrics endpoint: rank {launch.rank} could not listen on port {port} ({ENV_PORT}={base} + local "
              f"rank {launch.local_rank}): {exc.strerror or exc}. Training goes on without this rank's endpoint; "
              f"another {ENV_PORT} (ports {base}..{base + launch.local_world_size - 1} must be free on every node) "
              "brings it back on the next launch.", flush=True)
        return None
    if launch.local_rank == 0:
        print(f"metrics endpoint: http://{launch.host}:{base}..{base + launch.local_world_size - 1}/metrics "
              f"(one port per local rank), listening on {endpoint.server.server_address[0]}", flush=True)
    return endpoint
