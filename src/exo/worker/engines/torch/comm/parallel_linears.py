"""Linears split across the ranks of a tensor-parallel group, and the collectives that
join their parts: row-parallel linears (partial sums all-reduced, bias added once) and the
vocabulary-parallel LM head (Megatron-LM's layout, Shoeybi et al. 2019).

They hold no knowledge of models or quantized formats: `model/sharding.py` decides which
linear of a family is cut which way and swaps these in.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from exo.shared.models.memory import vocab_share
from exo.worker.engines.torch.comm.tcp_mesh import all_reduce_sum, current_links


class RowParallelLinear(nn.Linear):
    """A linear holding columns `[rank * in/world, (rank+1) * in/world)` of the full weight:
    the local matmul gives a partial sum, all-reduced over the group; the bias is added once,
    after the reduce."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = torch.nn.functional.linear(input, self.weight)  # [batch, seq, out] partial
        all_reduce_sum(output)
        if self.bias is not None:
            output = output + self.bias
        return output


class AllReducedLinear(nn.Module):
    """A row-parallel linear whose local matmul is some other module (a quantized linear):
    partial sum, all-reduce over the group, then the bias once."""

    def __init__(self, local: nn.Module, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.local = local
        self.bias: torch.Tensor | None
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.local(input)  # [batch, seq, out] partial sum
        all_reduce_sum(output)
        if self.bias is not None:
            output = output + self.bias
        return output


class SplitWidthRMSNorm(nn.Module):
    """An RMSNorm over a whole column-parallel projection's output when each tensor rank
    holds only its columns of it (MiniMax-M2's q/k norms over all heads together): the
    rank's sum of squares per row is all-reduced, so the mean is over the whole width and
    the result equals the unsplit norm's columns of this rank.

    Args:
        local_width / total_width: this rank's columns and the whole projection's.
        eps: added to the mean square (the norm's `variance_epsilon`).

    `weight` `[local_width]` holds this rank's part of the norm's weight (read like the
    projection's rows).
    """

    def __init__(self, local_width: int, total_width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(local_width, device="meta"))
        self.variance_epsilon = eps
        self.total_width = total_width

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[..., local_width]` → the same shape, normalized over the whole width."""
        rows = hidden_states.float()
        squares = rows.pow(2).sum(-1, keepdim=True)  # [..., 1]
        all_reduce_sum(squares)
        normed = rows * torch.rsqrt(squares / self.total_width + self.variance_epsilon)
        return self.weight * normed.to(hidden_states.dtype)


class VocabParallelHead(nn.Module):
    """A tensor rank's LM head: output rows (vocabulary ids) `[start, start + local
    outputs)` of the full head; the logits are all-reduced into the full vocabulary
    (each rank fills its own columns of a zeroed `[..., vocab]`), so every rank reads only
    its share of the head's weight per token (Megatron-LM's vocabulary-parallel output
    layer, Shoeybi et al. 2019; the logits are summed rather than gathered because the
    engine's collective is a sum).

    Args:
        local: the head's rows for this rank (`nn.Linear` or a quantized linear).
        vocab: the full vocabulary size.
        start: the first vocabulary id this rank holds.
    """

    def __init__(self, local: nn.Module, vocab: int, start: int) -> None:
        super().__init__()
        self.local = local
        self.vocab = vocab
        self.start = start

    def gather(self, local_logits: torch.Tensor) -> torch.Tensor:
        """`[..., local outputs]` → `[..., vocab]` float32 logits (collective). Over the
        rank links (`links.RankLinks.all_gather`) each rank sends only its columns; else
        (no links: `EXO_RANK_LINKS=0`'s gloo, or nccl) the zero-filled whole is
        all-reduced, which takes milliseconds for a large vocabulary (figures:
        docs/benchmarks/engine-design-figures.md#parallel_linearspy)."""
        links = current_links()
        if links is not None and links.world_size > 1:
            return self._gather_over_links(local_logits.float().contiguous(), links)
        full = local_logits.new_zeros(*local_logits.shape[:-1], self.vocab, dtype=torch.float32)
        full[..., self.start : self.start + local_logits.shape[-1]] = local_logits
        all_reduce_sum(full)
        return full

    def _gather_over_links(self, local: torch.Tensor, links: Any) -> torch.Tensor:
        share = vocab_share(self.vocab, links.world_size)
        bounds = {
            rank: (min(self.vocab, rank * share), min(self.vocab, (rank + 1) * share))
            for rank in range(links.world_size)
        }
        if bounds[links.rank] != (self.start, self.start + local.shape[-1]):
            raise ValueError(
                f"rank {links.rank} holds vocabulary ids from {self.start}, "
                f"not {bounds[links.rank][0]}"
            )
        lead = local.shape[:-1]
        parts = {
            rank: torch.empty(*lead, end - start, dtype=torch.float32)
            for rank, (start, end) in bounds.items()
            if rank != links.rank
        }
        links.all_gather(local, parts)
        full = torch.empty(*lead, self.vocab, dtype=torch.float32)
        for rank, (start, end) in bounds.items():
            full[..., start:end] = local if rank == links.rank else parts[rank]
        return full

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.gather(self.local(input))
