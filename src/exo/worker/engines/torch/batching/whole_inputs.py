"""Attention of a prefill step whose segments are independent whole inputs, each from
position 0 (embedding and rerank inputs: `embedding/lean_states.py`), in one call per
layer.

`batch_attention.attend` runs a step's prompt segments one by one: per segment and layer it
writes the keys and values into the segment's slot and makes one or two attention calls.
For a generation's prompt chunks (a handful per step) that is cheap; for 64 short
embedding inputs it is ~200 small operators per layer, each waking the threads (on a
shared 2-core machine each cost milliseconds, more than the attention's arithmetic).
Here the step's rows are scattered into a right-padded `[inputs, longest]` layout, every
input attends in one `F.scaled_dot_product_attention` call under a causal key-validity
mask (built once per step), and the rows are gathered back: four indexing operators and
one attention call per layer. Nothing is written to a KV cache: no later step reads these
inputs' keys. Padded query rows see their input's keys (never a fully masked row, so no
NaN) and are dropped by the gather; a real row never sees a padded key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class WholeInputs:
    """The padded layout of a step's independent inputs.

    Attributes:
        rows: `[T]` int64, the padded row (`input * longest + position`) of each step row.
        mask: `[inputs, 1, longest, longest]` float32, additive: 0 where a query sees a
            key (the input's own, at or before the query), -inf elsewhere (SDPA would
            convert a boolean mask in every layer).
        inputs / longest: the number of inputs and the longest one's tokens.
    """

    rows: torch.Tensor
    mask: torch.Tensor
    inputs: int
    longest: int

    @classmethod
    def of_lengths(cls, lengths: Sequence[int], device: torch.device) -> WholeInputs:
        """The layout of inputs of `lengths` tokens laid out one after another in the
        step's rows (the first input's rows first)."""
        longest = max(lengths)
        rows = torch.cat(
            [index * longest + torch.arange(length) for index, length in enumerate(lengths)]
        )
        positions = torch.arange(longest)
        valid = positions[None, :] < torch.tensor(lengths)[:, None]  # [inputs, longest] keys
        causal = positions[None, :] <= positions[:, None]  # [query, key]
        visible = causal[None, None] & valid[:, None, None, :]
        mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        return cls(rows.to(device), mask.to(device), len(lengths), longest)


def whole_input_attention(
    inputs: WholeInputs,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """Causal attention of each input to its own keys, in one call.

    Args:
        query: `[1, heads, T, head_dim]` (rotary applied; any strides).
        key / value: `[1, kv_heads, T, head_dim]`.
        scaling: the softmax scale (None: `head_dim ** -0.5`).

    Returns:
        `[1, T, heads, head_dim]` in the queries' dtype (`attend`'s layout).
    """
    padded = [
        _padded(inputs, tensor.to(query.dtype)) for tensor in (query, key, value)
    ]  # [inputs, heads, longest, head_dim] each
    mask = inputs.mask.to(query.dtype)
    attended = F.scaled_dot_product_attention(
        padded[0], padded[1], padded[2], attn_mask=mask, scale=scaling, enable_gqa=True
    )  # [inputs, heads, longest, head_dim]
    heads, head_dim = attended.shape[1], attended.shape[3]
    flat = attended.transpose(1, 2).reshape(inputs.inputs * inputs.longest, heads, head_dim)
    return flat.index_select(0, inputs.rows).unsqueeze(0)


def _padded(inputs: WholeInputs, tensor: torch.Tensor) -> torch.Tensor:
    """`[1, heads, T, dim]` step rows -> `[inputs, heads, longest, dim]`, zeros at padding."""
    rows = tensor[0].transpose(0, 1)  # [T, heads, dim]
    padded = rows.new_zeros(inputs.inputs * inputs.longest, *rows.shape[1:])
    padded.index_copy_(0, inputs.rows, rows)
    return padded.view(inputs.inputs, inputs.longest, *rows.shape[1:]).transpose(1, 2)
