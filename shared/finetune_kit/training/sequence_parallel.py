"""Ulysses sequence parallelism (DeepSpeed's ALST): several ranks share each sequence.

With ``--sequence-parallel N``, N consecutive ranks (part of a node, a node, or whole nodes) read the same
micro-batches and each computes its N-th of every sequence: embeddings, MLPs, norms and the loss on
``tokens / N`` positions. Around attention, DeepSpeed's ``UlyssesSPAttentionHF`` exchanges the
query, key and value slices (one all-to-all each) so that every rank attends over the whole sequence
for ``heads / N`` of the heads, then exchanges the output back. Activation memory per GPU falls by N;
ZeRO-3 still shards the weights and optimizer over all ranks.

What this module adds to DeepSpeed's pieces, and why:

- The data: :class:`SequenceShard` wraps the collator. Every rank of a group collates the same rows
  (the loader is sharded over the data-parallel ranks only, :func:`shard_loader`) and keeps its slice
  of ``input_ids``, ``position_ids`` (global positions: attention needs them after the exchange;
  packed rows restart them per example) and ``shift_labels`` (the labels shifted before slicing, so
  the token at a slice's edge predicts the first token of the next slice). DeepSpeed's own
  ``UlyssesSPDataLoaderAdapter`` instead gathers each rank's batch and processes them in turn, which
  changes the order in which sequences reach the optimizer with N; reading the same rows on every
  rank of a group keeps the order, and the run, that of a launch without sequence parallelism.
- The loss: each rank's loss is the sum of its slice's token losses over the labelled tokens of the
  whole step on all ranks (:mod:`finetune_kit.losses`); summed over ranks it is the step's token mean. DeepSpeed is
  not told about the groups (no ``mpu``): it averages gradients over all ranks, and the step's
  backward scale (accumulation x all ranks) makes that average the sum again. A rank's gradient
  includes, through the all-to-all's backward, what its keys and values contributed to the other
  ranks' attention, so the summed gradient is the whole sequence's.

The checks (:func:`check`) run before any process starts: the size against the ranks, the nodes and
the heads, the attention kernel, the engine. A group may span whole nodes (ALST's 15M-token record ran one
group of 32 over 4 nodes of 8): the all-to-alls then cross the network, which :func:`across_nodes` says in
one line before the launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from finetune_kit.errors import ConfigError
from finetune_kit.planning.speed import ulysses_bytes

KERNELS = ("sdpa", "packed_varlen", "flex_attention", "flash_attention_2", "flash_attention_3")  # not eager


@dataclass(frozen=True)
class Groups:
    """This rank's place: ``size`` ranks per sequence, ``rank`` within its group, ``data_rank`` of
    ``data_ranks`` groups that read different rows."""

    size: int = 1
    rank: int = 0
    data_rank: int = 0
    data_ranks: int = 1



def sequence_groups(accelerator, size: int) -> Groups:
    """This rank's place when ``size`` consecutive ranks share each sequence (1: every rank its own)."""
    world, rank = accelerator.num_processes, accelerator.process_index
    return Groups(size, rank % size, rank // size, world // size)


def check(size: int, *, world: int, gpus_per_node: int, model_config, max_seq_len: int, attention: str,
          pack: bool, engine: str, loss_chunks: int) -> None:
    """ConfigError, naming the value, the rule and the fix, when ``--sequence-parallel size`` cannot run."""
    if size == 1:
        return
    flag = f"--sequence-parallel {size}"
    if size < 1:
        raise ConfigError(f"--sequence-parallel {size}: the size is the number of ranks that share a sequence, "
                          "at least 1 (1: off).")
    if engine != "deepspeed":
        raise ConfigError(f"{flag} under FSDP2: Ulysses sequence parallelism is DeepSpeed's (ALST). Launch with "
                          "configs/zero3-ulysses.yaml, or drop the flag.")
    if world % size:
        raise ConfigError(f"{flag} with {world} ranks: the size must divide the number of ranks (each group of "
                          f"{size} consecutive ranks shares a sequence). Use a divisor of {world}, or launch a "
                          f"multiple of {size} ranks.")
    if size > gpus_per_node and size % gpus_per_node:
        raise ConfigError(f"{flag} with {gpus_per_node} GPUs per node: a group larger than a node must hold whole "
                          f"nodes, or one node's ranks would belong to two groups. Use a multiple of {gpus_per_node} "
                          f"(groups across nodes), or at most {gpus_per_node} (groups inside a node).")
    heads = model_config.num_attention_heads
    kv = getattr(model_config, "num_key_value_heads", None) or heads
    if heads % size:
        raise ConfigError(f"{flag}: the model's {heads} attention heads do not divide into {size} groups (each rank "
                          f"attends with heads / size of them). Use a size that divides {heads}.")
    if kv % size and size % kv:
        raise ConfigError(f"{flag}: the model's {kv} key/value heads neither divide by {size} nor divide it (DeepSpeed "
                          f"splits them, or repeats them when fewer). Use a divisor or multiple of {kv}.")
    if max_seq_len % size:
        raise ConfigError(f"--max-seq-len {max_seq_len} is not divisible by {flag}: each rank holds an equal slice "
                          f"of every sequence. Use a multiple of {size}, e.g. {max_seq_len - max_seq_len % size}.")
    name = attention if attention != "auto" else ("packed_varlen" if pack else "sdpa")
    if name not in KERNELS:
        raise ConfigError(f"--attention {attention} with {flag}: the sequence-parallel attention drops the dense "
                          f"mask that '{name}' needs (tokens x tokens per layer). Use --attention auto.")
    if pack and name == "sdpa":
        raise ConfigError(f"--pack --attention sdpa with {flag}: SDPA would attend across the packed examples once "
                          "the mask is dropped; the boundaries must come from the position ids. Use --attention "
                          "auto (packed_varlen) or flex_attention.")
    if not loss_chunks:
        raise ConfigError(f"--loss-chunks 0 with {flag}: each rank computes the loss of its slice from labels "
                          "shifted before slicing, which the chunked loss reads. Use --loss-chunks 8 (the default).")


def across_nodes(size: int, *, gpus_per_node: int, model_config, max_seq_len: int, micro_batch: int) -> str | None:
    """What a group spanning nodes costs, in one line (None inside a node): the share of each layer's all-to-alls
    that leaves the node, and their bytes per rank and micro-batch over all layers
    (:func:`finetune_kit.planning.speed.ulysses_bytes`, with the recipes' checkpointing: three passes), of which
    (size - GPUs per node)/(size - 1) go to other nodes."""
    if size <= gpus_per_node:
        return None
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    sent = ulysses_bytes(size=size, layers=model_config.num_hidden_layers, hidden_size=heads * head_dim,
                            kv_dim=kv_heads * head_dim, tokens=micro_batch * max_seq_len // size, passes=3)
    share = (size - gpus_per_node) / size
    gib = sent * (size - gpus_per_node) / (size - 1) / 2**30
    return (f"--sequence-parallel {size} spans {size // gpus_per_node} nodes per group: each decoder layer's "
            f"all-to-alls send {share:.0%} of every rank's slice over the network, up to {gib:,.1f} GiB per rank "
            f"per micro-batch of {max_seq_len:,} tokens (forward, recompute and backward); `make plan ... NETWORK=` "
            "prices it against your network.")


def multiple(size: int, base: int = 8) -> int:
    """What to pad a sequence's length to: a multiple of ``base`` and of the sequence-parallel size."""
    return base * size // math.gcd(base, size)


def shard_sequences(collate, groups: Groups, pad_token_id: int):
    """``collate``, or with sequence parallelism a :class:`SequenceShard` of it."""
    return collate if groups.size == 1 else SequenceShard(collate, groups, pad_token_id)


@dataclass
class SequenceShard:
    """Wrap a collator: the micro-batch as this rank of a sequence-parallel group computes it."""

    collate: object
    groups: Groups
    pad_token_id: int

    def __call__(self, rows) -> dict:
        import torch
        from torch.nn import functional as F

        from finetune_kit.losses import IGNORE_INDEX

        batch = self.collate(rows)
        ids, labels = batch["input_ids"], batch["labels"]
        positions = batch.get("position_ids")
        if positions is None:  # padded rows: each row one example, positions 0..T-1
            positions = torch.arange(ids.shape[1]).expand_as(ids)
        extra = -ids.shape[1] % multiple(self.groups.size)
        if extra:  # packed rows: a tail of padding, positions restarting (its own example), no labels
            ids = F.pad(ids, (0, extra), value=self.pad_token_id)
            labels = F.pad(labels, (0, extra), value=IGNORE_INDEX)
            positions = torch.cat([positions, torch.arange(extra).expand(ids.shape[0], extra)], dim=1)
        shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]  # the next token of each position
        width = ids.shape[1] // self.groups.size
        keep = slice(self.groups.rank * width, (self.groups.rank + 1) * width)
        return {"input_ids": ids[:, keep].contiguous(), "position_ids": positions[:, keep].contiguous(),
                "shift_labels": shifted[:, keep].contiguous(), "example_ids": batch["example_ids"]}


def shard_loader(accelerator, loader, groups: Groups):
    """``loader`` sharded over the data-parallel ranks only: the ranks of a group read the same
    micro-batches, in the order a launch of ``groups.data_ranks`` ranks without sequence parallelism
    reads them (accelerate's own sharding, seeded the same). Unchanged when sequence parallelism is off:
    ``accelerator.prepare`` shards it."""
    if groups.size == 1:
        return loader
    from accelerate.data_loader import prepare_data_loader

    sharded = prepare_data_loader(
        loader, accelerator.device, num_processes=groups.data_ranks, process_index=groups.data_rank,
        split_batches=accelerator.split_batches, put_on_device=True, rng_types=accelerator.rng_types.copy(),
        dispatch_batches=accelerator.dispatch_batches, even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler, data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking)
    sharded._is_accelerate_prepared = True  # accelerator.prepare keeps it as it is (and tracks it)
    return sharded


def use_sequence_parallel(model, groups: Groups, attention: str, micro_batch: int) -> None:
    """Route the model's attention through DeepSpeed's Ulysses all-to-all over ``groups``' ranks (after the
    process group exists, before the first forward). Evaluation runs without it: each rank attends over
    its own whole sequences."""
    if groups.size == 1:
        return
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=attention, sequence_parallel_size=groups.size,
        micro_batch_size=micro_batch, seq_length_is_variable=True, disable_in_eval=True)
