"""Memory for KV-cache slots that the OS backs only where positions are written, and gives
back when a slot is released.

A slot buffer is `[slots, kv_heads, capacity, head_dim]`, sized for the longest request
(capacity doubles when one outgrows it), while the scheduler's KV budget counts only the
positions requests hold. If every slot a request ever used stayed backed over the whole
capacity, a runner's KV memory would drift from the budget towards `slots x capacity`
positions (8 slots x 8,192 positions of SmolLM2-135M in float32 is 3 GB against a 377 MB
budget) — the 30-minute soak saw exactly that drift as runner RSS growth in ~90 MB steps.

So on Linux CPU the buffers are anonymous private mappings (`mmap`): they read as zeros
until written, and `release` hands a range's whole pages back with `madvise(MADV_DONTNEED)`
(the range reads as zeros again; Linux `madvise(2)`). Resident KV memory then follows the
positions written since each slot's last release, which the scheduler keeps within budget.
Elsewhere (another OS, a GPU) buffers are `torch.zeros` and `release` zeroes the range.

The buffers' dtype is the runner's KV dtype (`kv_cache_torch_dtype`: bfloat16 on CPU by
default, half float32's bytes per token; `--kv-cache-dtype`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys

import torch

from exo.shared.models.kv_cache_memory import KV_CACHE_DTYPES, KVCacheDtype

# "float32" / "bfloat16": the KV dtype of engines built without one (`kv_cache_torch_dtype`):
# how tests that compare with transformers' float32 forward opt into float32 KV, in this
# process and the nodes it starts.
KV_CACHE_DTYPE_ENV = "EXO_KV_CACHE_DTYPE"
_TORCH_KV_DTYPES: dict[KVCacheDtype, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}

_MADV_DONTNEED = 4  # <sys/mman.h> on Linux
_PAGE = mmap.PAGESIZE


def _load_madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _load_madvise()


def kv_cache_torch_dtype(
    requested: KVCacheDtype | None, device: torch.device, model_dtype: torch.dtype
) -> torch.dtype:
    """The dtype a runner stores keys and values in: `requested` (`--kv-cache-dtype`), else
    `KV_CACHE_DTYPE_ENV`, else bfloat16 on CPU (attention still multiplies and sums in
    float32: decode_attention.cpp, `batch_attention.attend`) and the model's dtype elsewhere.

    Raises:
        ValueError: `KV_CACHE_DTYPE_ENV` names no KV dtype.
    """
    if requested is not None:
        return _TORCH_KV_DTYPES[requested]
    configured = os.environ.get(KV_CACHE_DTYPE_ENV)
    if configured:
        if configured not in KV_CACHE_DTYPES:
            raise ValueError(
                f"{KV_CACHE_DTYPE_ENV}={configured!r}: expected one of {', '.join(KV_CACHE_DTYPES)}"
            )
        return _TORCH_KV_DTYPES[configured]
    return torch.bfloat16 if device.type == "cpu" else model_dtype


def zeroed_kv_buffer(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A zero-filled tensor of `shape` whose pages are backed only when written (Linux CPU:
    an anonymous mapping; elsewhere `torch.zeros`, backed at once)."""
    if device.type != "cpu" or _madvise is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # The tensor keeps the mapping alive; freeing the tensor unmaps it.
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype, count=numel).view(shape)


def release(region: torch.Tensor) -> None:
    """Zero `region` (a contiguous tensor or view), giving its whole pages back to the OS
    where the buffer came from `zeroed_kv_buffer` on Linux (partial pages at its ends are
    zeroed in place).

    Raises:
        ValueError: `region` is not contiguous.
    """
    if region.numel() == 0:
        return
    if not region.is_contiguous():
        raise ValueError("release needs a contiguous region")
    if region.device.type != "cpu" or _madvise is None:
        region.zero_()
        return
    flat = region.view(-1)
    item = region.element_size()
    start = region.data_ptr()
    end = start + region.numel() * item
    page_start = -(-start // _PAGE) * _PAGE
    page_end = end // _PAGE * _PAGE
    if page_end <= page_start or (page_start - start) % item or (end - page_end) % item:
        region.zero_()
        return
    if _madvise(page_start, page_end - page_start, _MADV_DONTNEED) != 0:
        region.zero_()  # the pages stay backed, but the range still reads as zeros
        return
    flat[: (page_start - start) // item].zero_()
    flat[flat.numel() - (end - page_end) // item :].zero_()


def release_positions(buffer: torch.Tensor, slot: int, start: int, end: int | None = None) -> None:
    """Release positions `start .. end - 1` (None: to the capacity) of `slot` in a `[slots,
    kv_heads, capacity, head_dim]` buffer (one contiguous run per head)."""
    stop = buffer.shape[2] if end is None else min(end, buffer.shape[2])
    if start >= stop:
        return
    if start == 0 and stop == buffer.shape[2] and buffer.is_contiguous():
        release(buffer[slot])
        return
    for head in range(buffer.shape[1]):
        release(buffer[slot, head, start:stop])
