"""Whole inputs through exo's own forward (`model/direct_forward.LeanModel`, the kernels a
generation's prefill runs), for embeddings and rerank scores.

One call is one batched prefill step: the inputs' tokens flattened into `[T]` rows, each
input a `PrefillSegment` of its own slot starting at position 0 (causal attention within
the input only, as `batch_attention.attend` runs a prompt's first chunk), no decode rows,
no logits (`logit_rows=None`: the residual stream after the last decoder layer, before the
final norm). The final norm is applied here, to the rows the pooling reads.

Several short inputs attend in one padded call per layer (`batching/whole_inputs.py`,
nothing written to a cache); otherwise, and in a sliding-window layer whose window cuts an
input, segment by segment as `attend` runs prompts. Their keys and values then live in a
scratch `SlotKVCache` built for the call and dropped after it, never in the serving
cache: running generations' slots, lengths and prefix cache are untouched, and nothing of
an embedding input stays behind. Its one `[inputs, kv_heads, longest, head_dim]` float32
buffer pair serves every layer: a segment starting at position
0 attends only to the keys its own layer just wrote for it, so layer `l + 1` may overwrite
what layer `l` wrote (the memory is that of one layer, not of all of them). Keys and values
stay float32 (attention in float32, as transformers' float32 forward computes it).

An input is never cut into chunks (as a generation's long prompt is): a chunk after the
first reads every earlier position's keys in every layer, which would need a cache of all
layers. Whole, a long input's activations grow with it (the caller's `BATCH_TOKENS` bounds
the rest), while its keys and values stay one layer's: at Qwen3-Embedding-0.6B's shape
(28 layers, 8 KV heads of 128) a 32k-token input's all-layer float32 cache would be
7.5 GB, more than its largest activation (the `[T, 2 x 3072]` gate/up product, 0.8 GB).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from exo.shared.models.memory import kv_geometry_of_config
from exo.worker.engines.torch.batching.batch_attention import (
    BatchPlan,
    LeanStep,
    PrefillSegment,
    lean_step_of,
)
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.batching.whole_inputs import WholeInputs
from exo.worker.engines.torch.model.direct_forward_parts import LeanUnsupportedError, norm_weight
from exo.worker.engines.torch.model.families import (
    UnsupportedArchitectureError,
    family_for_architecture,
)

# Inputs up to this many tokens attend in one padded call per layer (`whole_inputs`: its
# `[inputs, longest, longest]` mask and padded rows stay small); longer ones, and a lone
# input, segment by segment through the scratch cache (a handful per step).
WHOLE_INPUTS_LONGEST = 512


class LeanFinalStates:
    """The final norm's hidden states of whole inputs through a model's lean step.

    Build with `lean_final_states` (None where the model runs on transformers' forward).

    Args:
        step: the model's attached lean step (`batch_attention.lean_step_of`).
        windows: per decoder layer, its sliding window in tokens or None.
        kv_heads / head_dim / latent_values: the KV geometry of one layer
            (`kv_geometry_of_config`; `latent_values` > 0 for an MLA cache).
        final_norm: the final RMSNorm's `offset + weight` `[hidden]` float32 and epsilon.
        device: where the model runs.
    """

    def __init__(
        self,
        step: LeanStep,
        windows: Sequence[int | None],
        kv_heads: int,
        head_dim: int,
        latent_values: int,
        final_norm: tuple[torch.Tensor, float],
        device: torch.device,
    ) -> None:
        self._step = step
        self._windows = tuple(windows)
        self._kv_heads = kv_heads
        self._head_dim = head_dim
        self._latent_values = latent_values
        self._norm_weight, self._norm_eps = final_norm
        self._device = device

    @torch.inference_mode()
    def residual(self, token_ids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One prefill step over `token_ids` (each non-empty), in order.

        Returns:
            `([T, hidden] float32, [B + 1] int64)`: the residual stream after the last
            decoder layer (before the final norm; on the model's device), rows of input
            `i` at `offsets[i] .. offsets[i + 1] - 1`; and those offsets (CPU).
        """
        lengths = [len(ids) for ids in token_ids]
        if any(length == 0 for length in lengths):
            raise ValueError("an input has no tokens")
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
        offsets[1:] = torch.tensor(lengths, dtype=torch.long).cumsum(0)
        flat = torch.tensor([token for ids in token_ids for token in ids], dtype=torch.long)
        positions = torch.cat([torch.arange(length, dtype=torch.long) for length in lengths])
        cache = self._scratch_cache(len(lengths), max(lengths))
        segments = [
            PrefillSegment(slot=cache.allocate(), start=0, offset=int(offset), length=length)
            for offset, length in zip(offsets[:-1].tolist(), lengths, strict=True)
        ]
        plan = BatchPlan(
            cache=cache, windows=self._windows, decode_slots=[], decode_positions=[],
            prefill=segments, layer_of={},
        )  # fmt: skip
        if len(lengths) > 1 and max(lengths) <= WHOLE_INPUTS_LONGEST:
            plan.whole_inputs = WholeInputs.of_lengths(lengths, self._device)
        plan.prepare(self._device)
        hidden = self._step(
            plan, flat.to(self._device), None, positions.to(self._device), None
        )  # [T, hidden] float32
        return hidden, offsets

    def norm(self, rows: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm of `[N, hidden]` residual rows, float32."""
        return F.rms_norm(rows.float(), (rows.shape[-1],), self._norm_weight, self._norm_eps)

    def _scratch_cache(self, inputs: int, longest: int) -> SlotKVCache:
        """A cache of one slot per input, `longest` positions, float32, whose one layer's
        buffers every layer shares (module docstring)."""
        cache = SlotKVCache(
            1, self._kv_heads, self._head_dim, torch.float32, self._device, inputs,
            self._latent_values,
        )  # fmt: skip
        cache.reserve(longest)
        layers = len(self._windows)
        cache.keys = cache.keys * layers
        cache.values = cache.values * layers
        return cache


def lean_final_states(model: nn.Module, device: torch.device) -> LeanFinalStates | None:
    """`LeanFinalStates` over `model` (a loaded, whole `*ForCausalLM`), or None where it has
    no lean step attached (`EXO_LEAN_FORWARD=0`, a part the lean forward does not run) or
    its final norm is no RMSNorm the lean forward reads: the caller then keeps
    transformers' forward."""
    step = lean_step_of(model)
    if step is None:
        return None
    inner: Any = getattr(model, "model", None)
    config: Any = model.config
    text_config = config.get_text_config()
    try:
        family = family_for_architecture(type(model).__name__)
        if family.layout is None:
            return None
        final_norm = norm_weight(inner.norm, family.layout.norm_offset)
    except (AttributeError, LeanUnsupportedError, UnsupportedArchitectureError):
        return None
    windows = family.attention_windows(text_config)
    geometry = kv_geometry_of_config(text_config, len(windows))
    return LeanFinalStates(
        step, windows, geometry.kv_heads, geometry.head_dim, geometry.latent_values,
        (final_norm[0].to(device), final_norm[1]), device,
    )  # fmt: skip
