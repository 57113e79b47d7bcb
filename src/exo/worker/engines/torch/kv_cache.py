"""Prefill and decode over one request's KV cache.

The model's own forward is called directly with a transformers cache object (no `generate()`
machinery per token). Full-attention layers keep keys/values in buffers preallocated for the
request (`PreallocatedLayer`): appending a token writes one position, where transformers'
`DynamicLayer` re-concatenates the whole cache every step (O(length) copy per token), and
attention sees only the filled prefix, where `StaticCache` attends over (and reads) the whole
capacity. `torch.empty` only reserves the buffers; the OS backs pages as they are written.
(Measured on the 2-core reference machine, SmolLM2-135M: StaticCache + torch.compile decoded
slower than eager and took ~57 s to compile, so the engine runs eager.)
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from exo.worker.engines.torch.families import family_for_architecture


class PreallocatedLayer(DynamicLayer):
    """A full-attention cache layer backed by `[batch, kv_heads, capacity, head_dim]` buffers.

    `keys` / `values` are views of the filled prefix `[batch, kv_heads, length, head_dim]`, so
    the model's attention and mask code treat it exactly like a `DynamicLayer`.

    Args:
        capacity_tokens: positions to reserve; exceeding them grows the buffers (doubling).
    """

    def __init__(self, capacity_tokens: int) -> None:
        super().__init__()
        self._capacity = max(1, capacity_tokens)
        self._length = 0
        self._key_buffer = torch.empty(0)
        self._value_buffer = torch.empty(0)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        batch, heads = key_states.shape[:2]
        self._key_buffer = key_states.new_empty(
            (batch, heads, self._capacity, key_states.shape[-1])
        )
        self._value_buffer = value_states.new_empty(
            (batch, heads, self._capacity, value_states.shape[-1])
        )
        self._length = 0

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self._capacity)
        for name in ("_key_buffer", "_value_buffer"):
            old: torch.Tensor = getattr(self, name)
            new = old.new_empty((*old.shape[:2], capacity, old.shape[-1]))
            new[:, :, : self._length].copy_(old[:, :, : self._length])
            setattr(self, name, new)
        self._capacity = capacity

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `[batch, kv_heads, new, head_dim]` states; returns all cached keys, values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self._length, self._length + key_states.shape[-2]
        if end > self._capacity:
            self._grow(end)
        self._key_buffer[:, :, start:end].copy_(key_states)
        self._value_buffer[:, :, start:end].copy_(value_states)
        self._length = end
        self.keys = self._key_buffer[:, :, :end]
        self.values = self._value_buffer[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `-tokens_to_remove` positions (transformers' negative convention)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._length = max(0, self._length + tokens_to_remove)
        self.keys = self._key_buffer[:, :, : self._length]
        self.values = self._value_buffer[:, :, : self._length]

    def reset(self) -> None:
        super().reset()
        self._length = 0
        self._key_buffer = self._value_buffer = torch.empty(0)


def new_request_cache(model: PreTrainedModel, capacity_tokens: int) -> DynamicCache:
    """A cache for one request laid out as the model's family file says
    (`ModelFamily.attention_windows`): a `PreallocatedLayer` of `capacity_tokens` positions
    per full-attention layer, a sliding-window layer per windowed one.

    Raises:
        UnsupportedArchitectureError: no family file for the model's class.
        ValueError: the layout's length differs from the model's (cut) layer count.
    """
    family = family_for_architecture(type(model).__name__)
    text_config = model.config.get_text_config()
    windows = family.attention_windows(text_config)
    if len(windows) != text_config.num_hidden_layers:
        raise ValueError(
            f"{family.name}: the cache layout has {len(windows)} layers, the model "
            f"{text_config.num_hidden_layers}"
        )
    cache = DynamicCache(config=model.config)
    cache.layers = [
        PreallocatedLayer(capacity_tokens)
        if window is None
        else DynamicSlidingWindowLayer(sliding_window=window)
        for window in windows
    ]
    return cache


# Prompts are prefilled in chunks so activation memory stays bounded for long contexts
# ([chunk, intermediate] MLP activations, [heads, chunk, keys] attention scores).
PREFILL_CHUNK_TOKENS = 1024


class DecodeSession:
    """The KV cache of one request and the forward steps that fill it.

    Args:
        model: a transformers causal LM in eval mode.
        device: where inputs are placed.
        capacity_tokens: prompt plus the most tokens this request may generate.
    """

    __slots__ = ("_cache", "_device", "_model", "capacity_tokens", "position")

    def __init__(self, model: PreTrainedModel, device: torch.device, capacity_tokens: int):
        self._model = model
        self._device = device
        self._cache: DynamicCache | None = new_request_cache(model, capacity_tokens)
        self.capacity_tokens = capacity_tokens
        self.position = 0  # tokens already in the cache

    @property
    def closed(self) -> bool:
        return self._cache is None

    def _forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Run `input_ids` ([1, n] int64) through the model, appending to the cache.

        Returns:
            `[vocab]` float32 logits of the last position.
        """
        if self._cache is None:
            raise RuntimeError("the decode session is closed")
        length = input_ids.shape[1]
        if self.position + length > self.capacity_tokens:
            raise RuntimeError(
                f"KV cache overflow: {self.position} + {length} > {self.capacity_tokens}"
            )
        position_ids = torch.arange(
            self.position, self.position + length, device=self._device
        ).unsqueeze(0)  # [1, n]
        output = self._model(
            input_ids=input_ids,
            position_ids=position_ids,
            cache=self._cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.position += length
        logits: torch.Tensor = output.logits[0, -1]  # [vocab]
        return logits

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        """Fill the cache with the prompt.

        Args:
            prompt_ids: the prompt's token ids (at least one).

        Returns:
            `[vocab]` logits for the first generated token.
        """
        if not prompt_ids:
            raise ValueError("cannot prefill an empty prompt")
        tokens = torch.tensor([prompt_ids], dtype=torch.long, device=self._device)  # [1, n]
        logits = torch.empty(0)
        for start in range(0, tokens.shape[1], PREFILL_CHUNK_TOKENS):
            logits = self._forward(tokens[:, start : start + PREFILL_CHUNK_TOKENS])
        return logits

    @torch.inference_mode()
    def decode(self, token_id: int) -> torch.Tensor:
        """Append one sampled token; returns `[vocab]` logits for the next one."""
        tokens = torch.tensor([[token_id]], dtype=torch.long, device=self._device)  # [1, 1]
        return self._forward(tokens)

    def close(self) -> None:
        """Drop the KV cache (idempotent)."""
        self._cache = None


class KVCachePool:
    """Hands out one decode session at a time for a model (the engine serves one request at
    a time; a second open session would mean a leaked generator)."""

    def __init__(self, model: PreTrainedModel, device: torch.device) -> None:
        self._model = model
        self._device = device
        self._active: DecodeSession | None = None

    def open(self, capacity_tokens: int) -> DecodeSession:
        """A fresh session with room for `capacity_tokens` tokens; closes any session left
        open by a generator that was never closed."""
        if self._active is not None and not self._active.closed:
            self._active.close()
        self._active = DecodeSession(self._model, self._device, capacity_tokens)
        return self._active

    @property
    def active_session(self) -> DecodeSession | None:
        """The open session, if a request is in flight."""
        if self._active is not None and self._active.closed:
            self._active = None
        return self._active
