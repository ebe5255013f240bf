"""What docs/gpu.md states about a block of ablation rows, held against ablation.py."""

from __future__ import annotations

import re

from finetune_tools.gpu_check import ablation
from tests.harness import REPO

COMMAND_S = 540  # one GPU command: 10 minutes, less a minute for the machine's start and the copies


def assert_documented_total(rows, label: str) -> None:
    """docs/gpu.md says "<n> <label> rows take about <minutes> minutes ... in <k> commands", and those numbers are
    the rows' count, their predicted total and the commands ablation.batches makes of them."""
    total = sum(map(ablation.expected_seconds, rows))
    groups = ablation.batches(rows, COMMAND_S)
    text = (REPO / "docs" / "gpu.md").read_text()
    stated = re.search(rf"(\d+) {label} rows take about (\d+) minutes.*?in (\d+) commands", text, re.S)
    assert stated, f"docs/gpu.md: the {label} paragraph's predicted total is missing"
    assert tuple(map(int, stated.groups())) == (len(rows), round(total / 60), len(groups))
