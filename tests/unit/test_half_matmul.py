"""The test processes' bf16 and fp16 matrix products in fp32 on a CPU without instructions for them
(tests/half_matmul.py), in fresh interpreters: that CPU imitated with ``ONEDNN_MAX_CPU_ISA=AVX2``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.harness import REPO

PROBE = """
import json, sys
sys.path.insert(0, {tests!r})
import half_matmul  # before torch, as the environment's .pth file loads it
import importlib.util
importlib.util.find_spec("torch")  # a library looking for torch first (transformers' checks): no import yet
import torch

state = half_matmul._state
report = {{"dtypes": [str(d) for d in state.get("dtypes", ())], "registered": "library" in state, "equal": {{}},
          "lacking": [str(d) for d in half_matmul.half_dtypes_without_kernels(torch)]}}
torch.manual_seed(0)
for dtype in (torch.bfloat16, torch.float16):
    a, b = torch.randn(3, 40, 700).to(dtype), torch.randn(3, 700, 24).to(dtype)
    bias = torch.randn(24).to(dtype)
    want = torch.bmm(a.float(), b.float()).to(dtype)  # fp32 products and sums, one rounding
    want_addmm = (bias.float() + a[0].float() @ b[0].float()).to(dtype)
    x = a[0].clone().requires_grad_()
    (x @ b[0]).float().sum().backward()  # autograd's backward product goes through the same kernel
    report["equal"][str(dtype)] = [torch.equal(a[0] @ b[0], want[0]), torch.equal(torch.bmm(a, b), want),
                                   torch.equal(torch.addmm(bias, a[0], b[0]), want_addmm),
                                   torch.equal(x.grad, (torch.ones(40, 24) @ b[0].float().T).to(dtype))]
try:
    torch.mm(a[0], b[0].float())
    report["mixed"] = "no error"
except RuntimeError as err:
    report["mixed"] = str(err)
print(json.dumps(report))
"""


def probe(**env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k != "HALF_MATMUL_VIA_FP32"}
    done = subprocess.run([sys.executable, "-c", PROBE.format(tests=str(REPO / "tests"))], env={**base, **env},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_on_a_cpu_without_half_matrix_instructions_products_are_fp32_rounded_once():
    """With the variable, on an AVX2-only CPU: both half dtypes registered (torch looked for before it is imported,
    as a 70B QLoRA rank does), every product equal to the fp32 product rounded once (700-long sums, in which torch's
    own loop and fp32 need not agree to the bit), mixed dtypes still refused by torch's own check."""
    report = probe(HALF_MATMUL_VIA_FP32="1", ONEDNN_MAX_CPU_ISA="AVX2")
    assert report["dtypes"] == ["torch.bfloat16", "torch.float16"] and report["registered"], report
    assert all(all(checks) for checks in report["equal"].values()), report
    assert "same dtype" in report["mixed"], report


def test_without_the_variable_or_with_the_instructions_torch_is_untouched():
    """Without the variable nothing registers (the demo's processes); with it, on this CPU (whichever it is, as the
    test's environment has it), only the dtypes torch lacks kernels for are taken."""
    off = probe(ONEDNN_MAX_CPU_ISA="AVX2")
    assert off["dtypes"] == [] and not off["registered"], off
    # the negative control of the first test's equalities: torch's own fp16 loop rounds otherwise (measured)
    assert not all(off["equal"]["torch.float16"][:3]), off
    native = probe(HALF_MATMUL_VIA_FP32="1")  # not imported here: this process has the environment's copy loaded
    assert native["dtypes"] == native["lacking"], native
    assert native["registered"] == bool(native["dtypes"]), native
