"""Peak memory of the causal-LM loss step, whole logits against the chunked loss, on CPU.

The 8B recipe's loss layer at its micro-batch: 4 x 2,048 tokens, Llama 3's 128,256-entry
vocabulary, bf16 head; the hidden width is cut to 256 (the logits do not depend on it, and the
head's matmul stays a few seconds on CPU). Each mode runs in a process of its own: the forward
and backward of the loss, the process's peak resident memory (``ru_maxrss``) measured before and
after; the difference is what the loss step added. ``transformers`` computes the whole-logits loss
(``ForCausalLMLoss``, what ``LlamaForCausalLM`` calls); ``finetune_kit.losses`` the other.

    python benchmarks/loss_memory.py [--out results/benchmarks/loss-memory.json]

Needs the stack environment and the package importable; about a minute and up to ~14 GB of RAM.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import record

ROOT = Path(__file__).resolve().parents[1]
VOCAB, MICRO_BATCH, SEQ_LEN, HIDDEN = 128_256, 4, 2048, 256
MODES = {"whole logits (transformers)": 0, "chunked, 8 chunks": 8, "chunked, 16 chunks": 16}


def peak_GiB() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def one(chunks: int) -> dict:
    import torch
    from transformers.loss.loss_utils import ForCausalLMLoss

    from finetune_kit.losses import chunked_cross_entropy

    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.bfloat16)
    hidden = torch.randn(MICRO_BATCH, SEQ_LEN, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ_LEN))
    labels[:, :256] = -100  # a prompt
    before = peak_GiB()
    start = time.perf_counter()
    if chunks:
        loss = chunked_cross_entropy(head, hidden, labels, chunks=chunks)
    else:
        loss = ForCausalLMLoss(head(hidden), labels, vocab_size=VOCAB)
    loss.backward()
    return {"chunks": chunks, "loss": loss.item(), "seconds": round(time.perf_counter() - start, 2),
            "added_peak_GiB": round(peak_GiB() - before, 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=ROOT / "results/benchmarks/loss-memory.json")
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one)))
        return 0

    from finetune_kit.models.shapes import resolve_model
    from finetune_kit.planning.activations import activation_bytes

    shape = resolve_model("llama3-8b")
    rows = []
    for label, chunks in MODES.items():
        out = subprocess.run([sys.executable, __file__, "--one", str(chunks)], capture_output=True, text=True,
                             check=True)
        row = {"mode": label, **json.loads(out.stdout.strip().splitlines()[-1]),
               "planner_loss_GiB": round(activation_bytes(shape, MICRO_BATCH, SEQ_LEN, True,
                                                          loss_chunks=chunks)["loss"] / 2**30, 3)}
        rows.append(row)
        print(f"{label:28s} +{row['added_peak_GiB']:6.2f} GiB peak (planner's loss term {row['planner_loss_GiB']:.2f}),"
              f" {row['seconds']:.1f} s, loss {row['loss']:.4f}")
    record.write(args.out, __doc__.split("\n")[0], "peak resident memory added by the loss step (ru_maxrss)",
                 shape={"vocab": VOCAB, "micro_batch": MICRO_BATCH, "seq_len": SEQ_LEN, "hidden": HIDDEN}, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
