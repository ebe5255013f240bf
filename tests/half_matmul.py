"""bf16 and fp16 matrix products computed in fp32 on a CPU that has no instructions for them: test processes only.

torch multiplies bf16 (and fp16) matrices on a CPU with oneDNN where the CPU has the instructions for it (AVX512 or
AMX; ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``), and otherwise with a scalar loop. Measured with torch 2.13 on
one core of a Xeon with AMX, imitating an AVX2-only CPU (``ONEDNN_MAX_CPU_ISA=AVX2``, which that check follows): the
tiny model's MLP product [4, 256, 64] x [64, 224], forward and backward, took 29.7 ms in bf16 against 1.3 ms in fp32
(0.6 ms in bf16 with AMX), and a training step of the tiny Llama 3 (sequences of 256, micro-batch 4) 270 ms, two
thirds of it in ``aten::mm``, against 61 ms with AMX. On the AVX2-only AMD EPYC the suite is timed on, the recipes'
bf16 steps spent about half their time there.

In a process of make test's shared environment started with ``HALF_MATMUL_VIA_FP32=1`` (the noxfile sets it for the
test sessions unless the environment says 0; not for the demo), and only on such a CPU, ``aten::mm``, ``aten::bmm``
and ``aten::addmm`` on bf16 or fp16 CPU tensors take their operands to fp32, multiply there (torch's fp32 kernel) and
round the product once to the operands' dtype: the products of two bf16 or fp16 numbers are exact in fp32 and the sums
are fp32 sums, in another order than torch's own loop: in the tiny models' products, one or two elements in ten
thousand round to the neighbouring bf16 number (fp16: more). Every process of a test then has to compute them this
way, or a resumed run is not its uninterrupted one: a library that looks for torch before importing it
(``importlib.util.find_spec``) must not make one process miss the registration. The same step then took 95 ms.
Every other operator, and every dtype on a CPU that has the instructions, is torch's own.

The environment loads this module at interpreter start (a ``.pth`` file, written with the module's copy by the
noxfile): without the variable it does nothing; with it, it waits for ``torch`` to be imported, then registers the
kernels (``torch.library``) if the CPU lacks the instructions.
"""

from __future__ import annotations

import os
import sys

VARIABLE = "HALF_MATMUL_VIA_FP32"
_state: dict = {}  # "library": the torch.library registration, kept alive; "dtypes": the dtypes computed in fp32


def half_dtypes_without_kernels(torch) -> tuple:
    """The half-precision dtypes this CPU has no oneDNN matrix kernels for (as torch decides it)."""
    mkldnn = torch.ops.mkldnn
    return tuple(dtype for dtype, has in ((torch.bfloat16, mkldnn._is_mkldnn_bf16_supported),
                                          (torch.float16, mkldnn._is_mkldnn_fp16_supported)) if not has())


def register(torch) -> tuple:
    """Register the kernels (once per process) for the dtypes this CPU lacks; those dtypes (empty: nothing done)."""
    if "dtypes" in _state:
        return _state["dtypes"]
    dtypes = _state["dtypes"] = half_dtypes_without_kernels(torch)
    if not dtypes:
        return dtypes

    def half(*tensors) -> bool:  # operands of one half dtype this CPU lacks (else torch's kernel, and its errors)
        return tensors[0].dtype in dtypes and all(t.dtype == tensors[0].dtype for t in tensors)

    def mm(a, b):
        if half(a, b):
            out = a.new_empty((a.shape[0], b.shape[1]), dtype=torch.float32)
            return torch.mm(a.float(), b.float(), out=out).to(a.dtype)
        return torch.mm(a, b, out=a.new_empty((a.shape[0], b.shape[1])))  # the out= kernel is torch's own

    def bmm(a, b):
        if half(a, b):
            out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]), dtype=torch.float32)
            return torch.bmm(a.float(), b.float(), out=out).to(a.dtype)
        return torch.bmm(a, b, out=a.new_empty((a.shape[0], a.shape[1], b.shape[2])))

    def addmm(bias, a, b, *, beta=1, alpha=1):
        if half(a, b, bias):
            out = a.new_empty((a.shape[0], b.shape[1]), dtype=torch.float32)
            return torch.addmm(bias.float(), a.float(), b.float(), beta=beta, alpha=alpha, out=out).to(a.dtype)
        return torch.addmm(bias, a, b, beta=beta, alpha=alpha, out=a.new_empty((a.shape[0], b.shape[1])))

    import warnings

    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "... other operators may also be overridden": these three are, on purpose
        warnings.simplefilter("ignore")
        for name, kernel in (("mm", mm), ("bmm", bmm), ("addmm", addmm)):
            library.impl(name, kernel, "CPU")
    _state["library"] = library
    return dtypes


class _AfterTorchImport:
    """A meta-path finder that lets the other finders find ``torch`` and registers the kernels once it has run. It
    stays in place until then: a library may look for torch (``importlib.util.find_spec``, as transformers' checks
    do) long before anything imports it, and the spec that lookup returns is not the one the import loads."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or "finding" in _state:
            return None
        _state["finding"] = True
        try:
            from importlib.util import find_spec

            spec = find_spec(name)
        finally:
            del _state["finding"]
        if spec is None or spec.loader is None:
            return spec
        run, finder = spec.loader.exec_module, self

        def exec_module(module):
            run(module)
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
            register(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get(VARIABLE) == "1":
    if "torch" in sys.modules:
        register(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, _AfterTorchImport())
