"""Where a benchmark ran, and its record written beside the results (``results/benchmarks/``)."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path


def where() -> dict:
    """The CPU model, its count, torch's version and the date."""
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cpus": os.cpu_count(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}


def write(out: Path, what: str, measured: str, **facts) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"what": what, "measured": measured, "where": where(), **facts}, indent=2) + "\n")
    print(f"wrote {out}")
    return out
