"""A prompt's images as the batch sees them: where each image's tokens sit in the prompt,
the embeddings that replace those tokens' own, and the key the prefix cache sees for them.
An image whose soft tokens come in several runs (Idefics3's tiles, between their marker
tokens) is one `PromptImage` per run.

Gemma 3 lets the tokens of one image attend to each other in both directions inside the
otherwise causal prompt (transformers' `Gemma3Model`: blocks of consecutive image tokens,
`token_type_ids == 1`); such an image is `bidirectional`. The scheduler therefore never ends
a prompt chunk inside one (`align_chunk`), and each prompt segment carries the blocks it
overlaps (`PrefillSegment.image_blocks`) for its attention mask. Other families (Idefics3)
attend causally over image tokens as over text: their images only replace embeddings.

Qwen2.5-VL also places an image's tokens by their row and column in the rotary positions
(`MultimodalPositions`): a request with images carries its prompt's 3-D positions, and the
batch gives them to the direct forward in place of the cache positions for rotary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, eq=False)
class PromptImage:
    """One image of a prompt.

    Attributes:
        start: prompt position of the image's first token (its first soft token; the
            begin/end-of-image tokens around it are ordinary text tokens).
        embeddings: `[length, hidden]` float32, the projected vision features that replace
            the embeddings of positions `start .. start + length - 1`; Qwen3-VL's are
            `[length, hidden x (1 + deepstack layers)]`, the replacement followed by each
            deepstack layer's addition (`model.qwen3_vl_vision`).
        sha256: hex digest of the image's file bytes (the prefix cache keys on it).
        bidirectional: the image's tokens attend to each other in both directions (Gemma
            3); False: causally, as text.
    """

    start: int
    embeddings: torch.Tensor
    sha256: str
    bidirectional: bool = True

    @property
    def length(self) -> int:
        return int(self.embeddings.shape[0])

    @property
    def end(self) -> int:
        """One past the image's last position."""
        return self.start + self.length

    @property
    def cache_token(self) -> int:
        """The id the prefix cache sees at each of the image's positions: negative (no
        vocabulary id is), from the first 60 bits of the image's sha256, so prompts with
        the same text but different images share KV only up to the first image token."""
        return -1 - int(self.sha256[:15], 16)


def cache_key_tokens(tokens: list[int], images: tuple[PromptImage, ...]) -> list[int]:
    """`tokens` with each image's positions replaced by its `cache_token` (a copy; `tokens`
    itself when there are no images)."""
    if not images:
        return tokens
    keyed = list(tokens)
    for image in images:
        end = min(image.end, len(keyed))
        keyed[image.start : end] = [image.cache_token] * max(0, end - image.start)
    return keyed


def align_chunk(start: int, length: int, images: tuple[PromptImage, ...]) -> int:
    """The length of a prompt chunk from position `start` that ends outside every image:
    cut before an image the chunk would end inside, or (when the chunk starts at or
    inside that image) stretched to the image's end, so an image's bidirectional block is
    always attended to within one chunk (the simplest correct choice; a chunk may then
    exceed its token budget by up to one image's tokens). Causal images may be cut."""
    end = start + length
    for image in images:
        if image.bidirectional and image.start < end < image.end:
            return image.start - start if image.start > start else image.end - start
    return length


def segment_images(
    start: int, length: int, images: tuple[PromptImage, ...]
) -> tuple[tuple[tuple[int, int], ...], list[tuple[int, torch.Tensor]]]:
    """The images a prompt chunk of positions `start .. start + length - 1` overlaps.

    Returns:
        `(blocks, rows)`: each overlapped bidirectional image's whole span `(first, end)`
        in prompt positions (for the attention mask), and `(chunk row, embeddings [n, hidden])` for
        the chunk's rows that hold image tokens (a chunk starting inside an image, after a
        prefix-cache hit, takes the image's remaining rows).
    """
    blocks: list[tuple[int, int]] = []
    rows: list[tuple[int, torch.Tensor]] = []
    end = start + length
    for image in images:
        first, last = max(image.start, start), min(image.end, end)
        if first >= last:
            continue
        if image.bidirectional:
            blocks.append((image.start, image.end))
        rows.append((first - start, image.embeddings[first - image.start : last - image.start]))
    return tuple(blocks), rows


@dataclass(frozen=True, slots=True, eq=False)
class MultimodalPositions:
    """A request's multimodal rotary positions (Qwen2-VL's "mrope"; facts from
    transformers' `Qwen2_5_VLModel.get_rope_index`): three position ids per token
    (temporal, height, width). A text token has the same id in all three, one past the
    previous token's largest; an image's tokens, row by row over its merged patches, have
    temporal id `s`, height id `s + row` and width id `s + col` (`s`: the next id when the
    image starts), and the text after it goes on from `s + max(rows, cols)`. Positions are
    therefore not token indices, and the KV cache keeps its token indices.

    Attributes:
        prompt: `[3, prompt tokens]` int64, every prompt token's ids.
        delta: added to a token index past the prompt (a generated token) for its id in
            all three (the prompt's largest id + 1 - its length).
    """

    prompt: torch.Tensor
    delta: int

    @classmethod
    def of_prompt(cls, length: int, images: list[tuple[int, int, int]]) -> MultimodalPositions:
        """The positions of a prompt of `length` tokens whose images are `(start, rows,
        cols)`: the first image token's index and the image's merged-patch grid (its
        `rows * cols` tokens follow in row order), in prompt order, not overlapping.

        Raises:
            ValueError: an image past the prompt's end or overlapping the previous one.
        """
        pieces: list[torch.Tensor] = []
        index = 0  # the next token index
        current = 0  # the next position id
        for start, rows, cols in images:
            if start < index or start + rows * cols > length:
                raise ValueError(f"an image at token {start} of {rows}x{cols} does not fit")
            text = start - index
            pieces.append(torch.arange(current, current + text).expand(3, -1))
            current += text
            grid_rows = torch.arange(rows).repeat_interleave(cols)
            grid_cols = torch.arange(cols).repeat(rows)
            grid = torch.stack([torch.zeros_like(grid_rows), grid_rows, grid_cols])
            pieces.append(grid + current)
            current += max(rows, cols)
            index = start + rows * cols
        pieces.append(torch.arange(current, current + length - index).expand(3, -1))
        prompt = torch.cat(pieces, dim=1).to(torch.int64)
        largest = int(prompt.max()) if prompt.numel() else -1
        return cls(prompt.contiguous(), largest + 1 - length)

    def rows(self, start: int, length: int) -> torch.Tensor:
        """`[3, length]` int64: the ids of token indices `start .. start + length - 1`
        (prompt tokens from `prompt`, later ones their index + `delta`)."""
        end = start + length
        inside = self.prompt[:, start : min(end, self.prompt.shape[1])]
        prompt_end = self.prompt.shape[1]
        after = torch.arange(max(start, prompt_end), max(end, prompt_end)) + self.delta
        return torch.cat([inside, after.expand(3, -1)], dim=1)
