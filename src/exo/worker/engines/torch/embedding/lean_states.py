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

A whole input's activations grow with it; so does the time the runner spends on it between
two decode steps of running streams. An input longer than the runner's piece of work
(`runner/embedding_batch.py`) is therefore prefilled in chunks, exactly as a generation's
long prompt is (`ChunkedInput`): each chunk is one step of one `PrefillSegment` starting
where the last one ended, over a scratch cache of its own that holds every layer's keys and
values (a chunk after the first reads every earlier position's keys in every layer), in the
runner's KV dtype (bfloat16 by default on CPU, as a generation's KV: attention still
computes in float32), with the model's sliding windows (a windowed layer releases the
positions its window no longer sees: `SlotKVCache.commit`). That cache is the price of
chunking: per token `layers x 2 x kv_heads x head_dim x` the dtype's bytes, less the
released windowed positions (`scratch_bytes`; Qwen3-Embedding-0.6B, no windows: 112 KiB
per token in bfloat16, 3.7 GB for a 32k-token input, twice that in float32). It is dropped
when the input ends or is cancelled, and an input whose cache would not fit the memory free
on the node now is refused before it starts (`backend.check_scratch_memory`), not left to
the kernel's out-of-memory killer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from exo.shared.models.kv_cache_memory import kv_geometry_of_config
from exo.worker.engines.torch.batching.batch_attention import (
    BatchPlan,
    LeanStep,
    PrefillSegment,
    lean_step_of,
)
from exo.worker.engines.torch.batching.kv_footprint import KVFootprint
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.batching.whole_inputs import WholeInputs
from exo.worker.engines.torch.embedding.backend import check_scratch_memory
from exo.worker.engines.torch.model.direct_forward_parts import LeanUnsupportedError, norm_weight
from exo.worker.engines.torch.model.families import (
    UnsupportedArchitectureError,
    family_for_architecture,
)

# Inputs up to this many tokens attend in one padded call per layer (`whole_inputs`: its
# `[inputs, longest, longest]` mask and padded rows stay small); longer ones, and a lone
# input, segment by segment through the scratch cache (a handful per step).
WHOLE_INPUTS_LONGEST = 512

Pooling = Literal["mean", "last"]


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
        kv_dtype: the chunked inputs' scratch cache's dtype (the runner's KV dtype).
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
        kv_dtype: torch.dtype = torch.float32,
    ) -> None:
        self._step = step
        self.windows = tuple(windows)
        self._kv_heads = kv_heads
        self._head_dim = head_dim
        self._latent_values = latent_values
        self._norm_weight, self._norm_eps = final_norm
        self.device = device
        self.kv_dtype = kv_dtype

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
            cache=cache, windows=self.windows, decode_slots=[], decode_positions=[],
            prefill=segments, layer_of={},
        )  # fmt: skip
        if len(lengths) > 1 and max(lengths) <= WHOLE_INPUTS_LONGEST:
            plan.whole_inputs = WholeInputs.of_lengths(lengths, self.device)
        plan.prepare(self.device)
        hidden = self._step(
            plan, flat.to(self.device), None, positions.to(self.device), None
        )  # [T, hidden] float32
        return hidden, offsets

    def chunked(self, token_ids: Sequence[int], pooling: Pooling) -> ChunkedInput:
        """One input to prefill chunk by chunk (`ChunkedInput`), pooled by `pooling`.

        Raises:
            ValueError: an empty input.
            ScratchMemoryError: its scratch cache would not fit the memory free now.
        """
        if not token_ids:
            raise ValueError("an input has no tokens")
        check_scratch_memory(self.scratch_bytes(len(token_ids)), len(token_ids))
        cache = SlotKVCache(
            len(self.windows), self._kv_heads, self._head_dim, self.kv_dtype, self.device,
            1, self._latent_values, self.windows,
        )  # fmt: skip
        cache.reserve(len(token_ids))
        return ChunkedInput(self, cache, list(token_ids), pooling)

    def scratch_bytes(self, tokens: int) -> int:
        """Bytes the scratch cache of an input of `tokens` chunked (`chunked`) holds at most:
        every full layer's keys and values for all of them, a windowed layer's for at most
        its window and the release's slack (`KVFootprint.tokens`), in `kv_dtype` (an MLA
        cache: its keys alone, which hold the latent values)."""
        element = torch.empty((), dtype=self.kv_dtype).element_size()
        width = (1 if self._latent_values else 2) * self._kv_heads * self._head_dim
        layers = len(self.windows)
        return KVFootprint(self.windows).tokens(tokens) * layers * width * element

    def step(
        self, plan: BatchPlan, token_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The lean step over a prepared plan (`[T]` ids and positions on the model's
        device): `[T, hidden]` float32 residual rows after the last decoder layer."""
        return self._step(plan, token_ids, None, positions, None)

    def norm(self, rows: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm of `[N, hidden]` residual rows, float32."""
        return F.rms_norm(rows.float(), (rows.shape[-1],), self._norm_weight, self._norm_eps)

    def _scratch_cache(self, inputs: int, longest: int) -> SlotKVCache:
        """A cache of one slot per input, `longest` positions, float32, whose one layer's
        buffers every layer shares (module docstring)."""
        cache = SlotKVCache(
            1, self._kv_heads, self._head_dim, torch.float32, self.device, inputs,
            self._latent_values,
        )  # fmt: skip
        cache.reserve(longest)
        layers = len(self.windows)
        cache.keys = cache.keys * layers
        cache.values = cache.values * layers
        return cache


class ChunkedInput:
    """One input prefilled in chunks over its own all-layer scratch cache (module
    docstring), pooled as the chunks go: "mean" sums the final norm's states, "last" keeps
    the last position's. Build with `LeanFinalStates.chunked`; `advance` until `done`,
    then read `pooled`. Dropping the object frees its cache.

    The chunks' states equal those of the input run whole up to summation order (the same
    kernels; a later chunk's attention splits its keys at the chunk's start,
    `prefill_attention.prefill_attention`), not bit for bit.
    """

    def __init__(
        self, states: LeanFinalStates, cache: SlotKVCache, token_ids: list[int], pooling: Pooling
    ) -> None:
        self._states = states
        self._cache = cache
        self._slot = cache.allocate()
        self._ids = torch.tensor(token_ids, dtype=torch.long)
        self._pooling: Pooling = pooling
        self.position = 0
        """Tokens prefilled so far."""
        self.length = len(token_ids)
        self._pooled: torch.Tensor | None = None  # the sum of states so far, or the last one

    @property
    def done(self) -> bool:
        return self.position >= self.length

    @torch.inference_mode()
    def advance(self, tokens: int) -> int:
        """Prefill the next `tokens` (at least 1) positions, at most those left.

        Returns:
            The tokens prefilled (0 once `done`).
        """
        count = min(max(tokens, 1), self.length - self.position)
        if count <= 0:
            return 0
        start, end = self.position, self.position + count
        device = self._states.device
        plan = BatchPlan(
            cache=self._cache, windows=self._states.windows, decode_slots=[],
            decode_positions=[], prefill=[PrefillSegment(self._slot, start, 0, count)],
            layer_of={},
        )  # fmt: skip
        plan.prepare(device)
        positions = torch.arange(start, end, dtype=torch.long)
        residual = self._states.step(plan, self._ids[start:end].to(device), positions.to(device))
        self._cache.commit(self._slot, end)
        if self._pooling == "last":
            if end == self.length:
                self._pooled = self._states.norm(residual[-1:])[0]
        else:
            total = self._states.norm(residual).sum(dim=0)  # [hidden]
            self._pooled = total if self._pooled is None else self._pooled + total
        self.position = end
        return count

    def pooled(self) -> torch.Tensor:
        """`[hidden]` float32 (on the model's device): the mean of the final norm's states
        ("mean") or the last position's ("last").

        Raises:
            RuntimeError: the input is not fully prefilled.
        """
        if not self.done or self._pooled is None:
            raise RuntimeError("the input is not fully prefilled")
        return self._pooled / self.length if self._pooling == "mean" else self._pooled


def lean_final_states(
    model: nn.Module, device: torch.device, kv_dtype: torch.dtype = torch.float32
) -> LeanFinalStates | None:
    """`LeanFinalStates` over `model` (a loaded, whole `*ForCausalLM`; chunked inputs' scratch
    cache in `kv_dtype`), or None where it has
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
        (final_norm[0].to(device), final_norm[1]), device, kv_dtype,
    )  # fmt: skip
