"""How far the recipes' golden losses move with the CPU's instruction set and threads per rank.

Runs every golden-loss test of the recipe suites once per variant, each run appending its losses and
largest difference from the committed golden file to a log (``GOLDEN_SPREAD_LOG``, read by
``tests.harness.assert_matches_golden``), then prints one row per golden file and variant. The
golden tolerance (``tests.harness.LOSS_ATOL``) is chosen from these figures.

    python benchmarks/loss_spread.py [--out spread.jsonl] [--variants native avx2 threads2]

Variants: ``native`` (the tests' own settings on this CPU), ``avx2``
(``ONEDNN_MAX_CPU_ISA=AVX2``: oneDNN kernels as on a CPU without AVX-512 or AMX), ``threads2`` (two
threads per rank: other reduction orders inside the kernels). Needs the stack environment
(``.nox/stack``) on PATH and the package importable; about 1.5 minutes per variant on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITES = ["tests/recipes/test_llama3_8b_zero3.py", "tests/recipes/test_llama2_13b_zero2.py",
          "tests/recipes/test_llama3_70b_qlora.py", "tests/recipes/test_llama3_70b_qlora_chat.py"]
VARIANTS = {"native": {}, "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"}, "threads2": {"OMP_NUM_THREADS": "2"}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", type=Path, default=None, help="keep the per-run log (JSON lines) here")
    p.add_argument("-k", default="golden and not catch",
                   help="pytest -k expression selecting the golden tests (not their negative control)")
    args = p.parse_args(argv)
    out = args.out or Path(tempfile.mkstemp(suffix=".jsonl")[1])
    rows: dict[tuple[str, str], float] = {}
    for name in args.variants:
        log = Path(tempfile.mkstemp(suffix=".jsonl")[1])
        env = {**os.environ, **VARIANTS[name], "GOLDEN_SPREAD_LOG": str(log)}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUITES, "-k", args.k],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        print(f"{name}: pytest exit {proc.returncode}: {proc.stdout.strip().splitlines()[-1]}", flush=True)
        with out.open("a") as keep:
            for line in log.read_text().splitlines():
                entry = {"variant": name, **json.loads(line)}
                keep.write(json.dumps(entry) + "\n")
                rows[(entry["golden"], name)] = entry["max_abs_diff"]
        log.unlink()
    by_golden = defaultdict(dict)
    for (golden, name), diff in rows.items():
        by_golden[golden][name] = diff
    print(f"\nlargest |loss - golden| over all steps ({out})")
    print(f"{'golden file':40s}" + "".join(f"{v:>12s}" for v in args.variants))
    for golden, diffs in sorted(by_golden.items()):
        print(f"{golden:40s}" + "".join(f"{diffs.get(v, float('nan')):12.2e}" for v in args.variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
