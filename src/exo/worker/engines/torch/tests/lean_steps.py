"""A fixed sequence of batched steps, run through `forward_batch` (single rank, tensor rank)
or the pipeline stages, with the lean forward on or off: the tests compare the two.

Two requests with fixed token ids (teacher forcing: the same tokens whatever the logits):
request A (12 prompt tokens, longer than the tiny models' sliding window of 8) and request B
(5 tokens) are prefilled in one step (two segments), then both decode `DECODE_STEPS` tokens
together, and request C joins beside the decoding A and B in two prompt chunks over the last
two steps (the second from position `PROMPT_C_FIRST_CHUNK` on, its later rows past the
sliding window).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from exo.shared.models.kv_cache_memory import kv_geometry_of_config
from exo.worker.engines.torch.batching.batch_attention import (
    BatchPlan,
    PrefillSegment,
    attention_layers,
    forward_batch,
    lean_step_of,
    use_batched_attention,
)
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.comm.process_group import receive_tensor, send_tensor
from exo.worker.engines.torch.model.families import family_for_architecture
from exo.worker.engines.torch.parallel.rank_steps import StepHeader, stage_forward_batch

DECODE_STEPS = 6
PROMPT_A_LENGTH = 12
PROMPT_B_LENGTH = 5
PROMPT_C_LENGTH = 13
PROMPT_C_FIRST_CHUNK = 7


def forced_tokens(vocab: int, seed: int = 0) -> list[list[int]]:
    """Per request, its prompt then the tokens fed while decoding (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = (PROMPT_A_LENGTH + DECODE_STEPS, PROMPT_B_LENGTH + DECODE_STEPS, PROMPT_C_LENGTH)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def new_cache(
    model: nn.Module, world_size: int = 1, kv_dtype: torch.dtype = torch.float32
) -> tuple[SlotKVCache, Any, dict[int, int]]:
    config: Any = model.config
    text_config: Any = config.get_text_config()
    windows = family_for_architecture(type(model).__name__).attention_windows(text_config)
    geometry = kv_geometry_of_config(text_config, len(windows))
    kv_heads = geometry.kv_heads if geometry.latent_values else geometry.kv_heads // world_size
    use_batched_attention(model)  # type: ignore[arg-type]
    for layer in model.model.layers:  # type: ignore[union-attr]
        own = getattr(layer.self_attn, "config", None)
        if own is not None and own is not text_config:
            own._attn_implementation = text_config._attn_implementation
    cache = SlotKVCache(
        len(windows), kv_heads, geometry.head_dim, kv_dtype, torch.device("cpu"), 3,
        geometry.latent_values,
    )  # fmt: skip
    return cache, windows, attention_layers(model)  # type: ignore[arg-type]


def steps(
    tokens: list[list[int]],
) -> list[tuple[list[int], list[int], list[PrefillSegment], list[int], list[int], list[int]]]:
    """The steps as (decode slots, decode positions, prefill segments, input ids, positions,
    logit rows)."""
    a, b, c = tokens
    out: list[Any] = []
    ids = a[:PROMPT_A_LENGTH] + b[:PROMPT_B_LENGTH]
    positions = list(range(PROMPT_A_LENGTH)) + list(range(PROMPT_B_LENGTH))
    segments = [
        PrefillSegment(0, 0, 0, PROMPT_A_LENGTH),
        PrefillSegment(1, 0, PROMPT_A_LENGTH, PROMPT_B_LENGTH),
    ]
    out.append(([], [], segments, ids, positions, [PROMPT_A_LENGTH - 1, len(ids) - 1]))
    for step in range(DECODE_STEPS):
        ids = [a[PROMPT_A_LENGTH + step], b[PROMPT_B_LENGTH + step]]
        positions = [PROMPT_A_LENGTH + step, PROMPT_B_LENGTH + step]
        prefill: list[PrefillSegment] = []
        rows = [0, 1]
        if step >= DECODE_STEPS - 2:  # C joins beside the decodes, one chunk a step
            first = 0 if step == DECODE_STEPS - 2 else PROMPT_C_FIRST_CHUNK
            end = PROMPT_C_FIRST_CHUNK if step == DECODE_STEPS - 2 else PROMPT_C_LENGTH
            prefill = [PrefillSegment(2, first, 2, end - first)]
            ids = ids + c[first:end]
            positions = positions + list(range(first, end))
            if end == PROMPT_C_LENGTH:  # its first token's logits
                rows = [0, 1, 1 + end - first]
        out.append(([0, 1], positions[:2], prefill, ids, positions, rows))
    return out


def run_single(
    model: Any,
    tokens: list[list[int]],
    lean: bool,
    world_size: int = 1,
    kv_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Every step through `forward_batch` (a whole model or a tensor rank's; collective on
    tensor ranks), keys and values stored in `kv_dtype`. Returns the logits of every step's
    logit rows, `[rows, vocab]`."""
    step_fn = lean_step_of(model) if lean else None
    attached = model.__dict__.get("_exo_lean_step")
    if lean and step_fn is None:
        raise AssertionError("the model has no lean forward attached")
    if attached is not None:
        attached.enabled = lean
    try:
        cache, windows, layer_of = new_cache(model, world_size, kv_dtype)
        if not lean and cache.latent_values:  # MLA: transformers' forward cannot use it
            return whole_sequence_logits(model, tokens)
        logits = []
        for decode_slots, decode_positions, prefill, ids, positions, rows in steps(tokens):
            for segment in prefill:
                if segment.start == 0:
                    assert cache.allocate() == segment.slot
            plan = BatchPlan(cache, windows, decode_slots, decode_positions, prefill, layer_of)
            logits.append(
                forward_batch(
                    model,
                    plan,
                    torch.tensor([ids]),
                    torch.tensor([positions]),
                    torch.tensor(rows),
                )
            )
        return torch.cat(logits)
    finally:
        if attached is not None:
            attached.enabled = True


@torch.inference_mode()
def whole_sequence_logits(model: Any, tokens: list[list[int]]) -> torch.Tensor:
    """`run_single`'s logit rows from transformers' own forward over each request's whole
    token list (no plan: SDPA with its causal mask), for models whose slot cache holds
    what transformers' attention does not give the attention function (MLA's latents).
    The rows come in `steps`' order, so they compare row by row with `run_single`'s."""
    full = [model(input_ids=torch.tensor([ids])).logits[0].float() for ids in tokens]
    a, b, c = full
    rows = [a[PROMPT_A_LENGTH - 1], b[PROMPT_B_LENGTH - 1]]
    for step in range(DECODE_STEPS):
        rows += [a[PROMPT_A_LENGTH + step], b[PROMPT_B_LENGTH + step]]
        if step == DECODE_STEPS - 1:
            rows.append(c[PROMPT_C_LENGTH - 1])
    return torch.stack(rows)


def run_pipeline_rank(
    model: nn.Module, tokens: list[list[int]], lean: bool, rank: int, world_size: int
) -> torch.Tensor | None:
    """Every step through this pipeline rank's stage (hidden states sent rank to rank);
    the last rank returns the logits `[rows, vocab]`, the others None."""
    attached = model.__dict__.get("_exo_lean_step")
    if lean and attached is None:
        raise AssertionError("the model has no lean forward attached")
    if attached is not None:
        attached.enabled = lean
    is_last = rank == world_size - 1
    config: Any = model.config
    hidden_size = int(config.get_text_config().hidden_size)
    try:
        cache, windows, layer_of = new_cache(model)
        logits = []
        for decode_slots, decode_positions, prefill, ids, positions, rows in steps(tokens):
            for segment in prefill:
                if segment.start == 0:
                    assert cache.allocate() == segment.slot
            header = StepHeader(
                1, (), tuple(decode_slots), tuple(decode_positions), tuple(prefill), tuple(ids),
                tuple(positions), tuple(rows),
            )  # fmt: skip
            plan = header.plan(cache, windows, layer_of)
            hidden = None
            if rank > 0:
                hidden = torch.empty((1, len(ids), hidden_size))
                receive_tensor(hidden, rank - 1)
            output = stage_forward_batch(
                model, plan, header, hidden=hidden, is_last=is_last,  # type: ignore[arg-type]
                device=torch.device("cpu"),
            )  # fmt: skip
            if is_last:
                logits.append(output)
            else:
                send_tensor(output.float().contiguous(), rank + 1)
        return torch.cat(logits) if is_last else None
    finally:
        if attached is not None:
            attached.enabled = True
