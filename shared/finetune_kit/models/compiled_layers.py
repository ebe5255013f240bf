"""Each decoder layer compiled by ``torch.compile``, in place.

:func:`compile_layers` calls ``Module.compile()`` on every decoder layer: the layer's forward is
traced once (all layers share one compiled graph, since their code and shapes are the same) and
runs as fused kernels (Inductor: Triton on CUDA, C++ on CPU). ``Module.compile`` keeps the module
and its parameter names as they are, so checkpoints, the consolidated save and a resume without
``--compile`` see the same state dict; activation checkpointing wraps the compiled layer and
recomputes through it. Regional, not whole-model, compilation: the first step waits for one
layer's compilation instead of the whole model's (torchtune compiles the same way).

The cost is the compilation before the first step: measured on CPU (AMD EPYC, 2 cores, the tiny
Llama 3 of the tests), about 30 s per process for the forward and the backward. The passes that do not
train (validation, sample answers) run the layers eager (:func:`eager`): under no_grad, and for each
length a generated answer reaches, they would otherwise compile the layer again (two more compilations
for a validation pass, measured on the tests' run: 30 of its 135 s) for passes that take seconds. The GPU gain is
what the ablation measures (``gpu_check --ablation``, row ``8b-compile``); torchtune reports
7,075 → 8,998 tokens/s on Llama 3.2 3B with packing on one A100.
"""

from __future__ import annotations


def decoder_layers(model):
    """The repeated decoder layers of a causal LM (or of the base model under a PEFT wrapper)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(getattr(lm, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"{type(lm).__name__} has no model.layers: compile_layers is for Llama-style decoders")
    return layers


def compile_layers(model, enabled: bool = True, **compile_kwargs) -> int:
    """``torch.compile`` each decoder layer in place (``compile_kwargs`` go to ``torch.compile``), into a cache
    folder of this rank's own (:func:`cache_per_rank`); returns how many were compiled (0 when not ``enabled``)."""
    if not enabled:
        return 0
    cache_per_rank()
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(**compile_kwargs)
    return len(layers)


def cache_per_rank() -> str | None:
    """Point Inductor's cache (``TORCHINDUCTOR_CACHE_DIR``, or its default) at a folder of this rank's own inside it,
    ``rank<LOCAL_RANK>``, and return it (None outside a launch). The ranks of a node compile the same layer at
    the same moment, into the same kernel library path: measured on CPU, one rank loaded the library another was
    still writing and died (``ImportError: ...main.so: file too short``). Each rank's own folder is still reused
    by the next launch."""
    import os

    local = os.environ.get("LOCAL_RANK")
    if local is None:
        return None
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    base = cache_dir()
    own = base if os.path.basename(base) == f"rank{local}" else os.path.join(base, f"rank{local}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = own
    return own


def eager():
    """A context in which compiled modules run their original, eager forward and nothing compiles
    (``torch.compiler.set_stance("force_eager")``); no effect on a model that was not compiled."""
    import torch

    return torch.compiler.set_stance("force_eager")
