"""A draft model for speculative decoding on the target's node: a small model sharing the
target's tokenizer, loaded in the same runner process, proposing each speculating request's
next tokens (`DraftModelSource`, a `speculative_drafts.DraftSource`).

The draft model keeps its own KV (`SlotKVCache`, one slot per request it drafts for) in step
with each request's text: at every `propose` it compares the text it holds KV for with the
request's tokens, rolls its slot back to their common prefix (a rejected draft, or tokens
the target chose otherwise) and computes what it has not seen (the whole prompt at first,
then the accepted tokens and the target's own token). The speculating requests of a step
are drafted together: one batched forward pass of the draft model per draft position
(`batch_attention.forward_batch`, the lean step where the family has one), the first also
prefilling what each request's slot lacks.

What the first pass prefills is bounded per step: at most `DRAFT_PREFILL_CHUNK` positions
in all (so a long prompt's draft prefill never stalls the step of every stream in the
batch: the step's cost grows by one chunk at most). The requests' feeds are served
shortest first (the usual one: the target's last token and the draft tokens it accepted);
a feed that no longer fits gets what is left of the budget as a catch-up segment and no
draft this step: a request with a long prompt speculates once its draft KV has caught up,
one chunk per step.

A greedy request's draft is the draft model's likeliest tokens (deterministic: the target
accepts a draft token iff it is its own argmax, so the output is plain decoding's token for
token). A sampling request's draft tokens are drawn from the draft's distribution q under
the request's temperature / top-k / top-p / min-p (penalties, bias and grammar are the
target's alone: any q keeps the output exact), with a generator seeded from the request's
seed, and the draft carries q for the general rejection rule (`RequestState.accept_drafts`).

Placement counts the draft's memory and chooses it (`exo.shared.models.drafts`), leaving
out one whose card's vocabulary is not the target's; loading checks the tokenizers
themselves (`check_same_vocabulary`), and a draft refused or failing to load leaves the
target serving without it (`draft_left_out`: a draft is an optimisation). A draft
model on another node serves the same source over a link (`remote_drafts.DraftServer`,
greedy drafts only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from loguru import logger
from transformers import PreTrainedModel

from exo.download.pypi_gguf import prepare_model
from exo.shared.models.cards import card_from_local_directory, load_builtin_cards, resolve_card
from exo.shared.models.kv_cache_memory import kv_geometry_of_config
from exo.shared.types.shards import ShardMetadata
from exo.worker.engines.torch.batching.batch_attention import (
    BatchPlan,
    PrefillSegment,
    attention_layers,
    forward_batch,
    use_batched_attention,
)
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.decoding.gumbel_race import draw_key, race_index
from exo.worker.engines.torch.decoding.sampling import argmax_token, filter_logits
from exo.worker.engines.torch.decoding.sampling_params import SamplingParams
from exo.worker.engines.torch.decoding.speculative_drafts import Draft, DraftRequest
from exo.worker.engines.torch.model.families import family_for_architecture
from exo.worker.engines.torch.model.loading import load_parts
from exo.worker.engines.torch.quant.quantize import WeightDtype

# Most positions the draft model prefills per step, all requests together (its activations
# are [tokens, intermediate]: as the target's idle prefill chunk, `PREFILL_TOKENS_PER_IDLE_STEP`).
DRAFT_PREFILL_CHUNK = 512
# Mixed into a request's seed for its draft draws, so they are not the target's own
# sequence of keys (any fixed value would do).
DRAFT_SEED_SALT = 0x5EED_D4AF


class VocabularyMismatchError(ValueError):
    """The draft model's tokenizer is not the target's."""


@dataclass(slots=True)
class _DraftSequence:
    """One request's text as the draft model holds it: `tokens` have KV in `slot`."""

    slot: int
    tokens: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


class DraftModelSource:
    """Drafts from a small model on this node (see the module docstring).

    Args:
        model: the draft model, whole (switched to `BATCHED_ATTENTION` here).
        cache: its KV slots (`cache.slots`: most requests drafted for at once).
        windows: per layer of the draft model, its sliding window in tokens or None.
        vocab_size: the length of the target's logits vectors: the draft's distributions
            are cut or padded (zero probability) to it.
        name: the draft model's id (logs, metrics).
        device: where inputs go.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        cache: SlotKVCache,
        windows: Sequence[int | None],
        vocab_size: int,
        name: str,
        device: torch.device,
    ) -> None:
        use_batched_attention(model)
        self.model = model
        self.cache = cache
        self._windows = windows
        self._layer_of = attention_layers(model)
        self.vocab_size = vocab_size
        self._name = name
        self._device = device
        self._sequences: dict[str, _DraftSequence] = {}
        # Forward passes run and positions computed (tests and logs).
        self.forward_passes = 0
        self.positions_computed = 0
        # The most positions a step's first pass prefills; None: `DRAFT_PREFILL_CHUNK` (a
        # draft server sizes it to its round trips' bound, `draft_server.prefill_chunk`).
        self.prefill_chunk: int | None = None

    @property
    def name(self) -> str:
        return self._name

    def forget(self, request_id: str) -> None:
        sequence = self._sequences.pop(request_id, None)
        if sequence is None:
            return
        moved = self.cache.free(sequence.slot)
        if moved is not None:
            for other in self._sequences.values():
                if other.slot == moved:
                    other.slot = sequence.slot
                    break

    def holds(self, request_id: str) -> bool:
        """Whether the request has a KV slot here."""
        return request_id in self._sequences

    @property
    def free_slots(self) -> int:
        """KV slots free for requests not held yet."""
        return self.cache.slots - self.cache.occupied

    def held_tokens(self, request_id: str) -> list[int]:
        """The tokens whose KV the draft model holds for the request (tests)."""
        sequence = self._sequences.get(request_id)
        return [] if sequence is None else list(sequence.tokens)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """Each request's draft, `max_tokens` long, or an empty one for a request whose draft
        KV is still catching up (see the module docstring).

        Returns:
            One `Draft` per request, in order; `probabilities` `[len(tokens), vocab_size]`
            float32 for a sampling request, None for a greedy one.
        """
        if not requests:
            return []
        sequences = [self._synced(request) for request in requests]
        # Per request: tokens still to feed (what its slot lacks, then each new draft token).
        feeds = [list(request.tokens[len(sequence.tokens) :]) for request, sequence in
                 zip(requests, sequences, strict=True)]  # fmt: skip
        chunk = DRAFT_PREFILL_CHUNK if self.prefill_chunk is None else self.prefill_chunk
        active, catching_up = _share_prefill(feeds, chunk)
        tokens: list[list[int]] = [[] for _ in requests]
        distributions: list[list[torch.Tensor]] = [[] for _ in requests]
        while active or catching_up:
            batch = [sequences[index] for index in active]
            batch += [sequences[index] for index, _ in catching_up]
            logits = self._forward(batch, [feeds[index] for index in active]
                                   + [segment for _, segment in catching_up])  # fmt: skip
            for index, segment in catching_up:  # no draft for it this step
                sequences[index].tokens.extend(segment)
            catching_up = []
            still: list[int] = []
            for row, index in enumerate(active):
                request, sequence = requests[index], sequences[index]
                sequence.tokens.extend(feeds[index])
                token, distribution = self._choose(request, sequence, logits[row])
                tokens[index].append(token)
                if distribution is not None:
                    distributions[index].append(distribution)
                if len(tokens[index]) < request.max_tokens:
                    feeds[index] = [token]
                    still.append(index)
            active = still
        drafts = []
        for index in range(len(requests)):
            probabilities = torch.stack(distributions[index]) if distributions[index] else None
            drafts.append(Draft(tuple(tokens[index]), probabilities))
        return drafts

    def _synced(self, request: DraftRequest) -> _DraftSequence:
        """The request's sequence, its KV rolled back to the longest prefix it shares with
        the request's tokens (less the last token, which is fed this step)."""
        sequence = self._sequences.get(request.request_id)
        if sequence is None:
            sequence = _DraftSequence(self.cache.allocate())
            self._sequences[request.request_id] = sequence
        held = sequence.tokens
        limit = min(len(held), len(request.tokens) - 1)
        common = 0
        while common < limit and held[common] == request.tokens[common]:
            common += 1
        if common < len(held):
            del held[common:]
            self.cache.commit(sequence.slot, common)
        if sequence.generator is None and _is_sampling(request.sampling):
            sequence.generator = torch.Generator(device="cpu")
            sequence.generator.manual_seed((request.seed ^ DRAFT_SEED_SALT) & (2**63 - 1))
        return sequence

    def _forward(self, sequences: list[_DraftSequence], feeds: list[list[int]]) -> torch.Tensor:
        """One batched forward pass: each sequence's `feeds` at its next positions (one
        token: a decode row; more: a prefill segment). Returns `[len(sequences), vocab]`
        float32 logits at each sequence's last fed position."""
        decoding = sorted(
            (index for index, feed in enumerate(feeds) if len(feed) == 1),
            key=lambda index: sequences[index].slot,
        )
        prefilling = [index for index, feed in enumerate(feeds) if len(feed) > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        logit_row_of: dict[int, int] = {}
        for index in decoding:
            logit_row_of[index] = len(input_ids)
            input_ids.append(feeds[index][0])
            positions.append(len(sequences[index].tokens))
        segments: list[PrefillSegment] = []
        for index in prefilling:
            sequence, feed = sequences[index], feeds[index]
            start = len(sequence.tokens)
            segments.append(PrefillSegment(sequence.slot, start, len(input_ids), len(feed)))
            input_ids.extend(feed)
            positions.extend(range(start, start + len(feed)))
            logit_row_of[index] = len(input_ids) - 1
        self.cache.reserve(
            max(len(s.tokens) + len(f) for s, f in zip(sequences, feeds, strict=True))
        )
        plan = BatchPlan(
            cache=self.cache,
            windows=self._windows,
            decode_slots=[sequences[index].slot for index in decoding],
            decode_positions=positions[: len(decoding)],
            prefill=segments,
            layer_of=self._layer_of,
        )
        device = self._device
        rows = [logit_row_of[index] for index in range(len(sequences))]
        logits = forward_batch(
            self.model,
            plan,
            torch.tensor([input_ids], dtype=torch.long, device=device),
            torch.tensor([positions], dtype=torch.long, device=device),
            torch.tensor(rows, dtype=torch.long, device=device),
        )
        self.forward_passes += 1
        self.positions_computed += len(input_ids)
        return logits

    def _choose(
        self, request: DraftRequest, sequence: _DraftSequence, logits: torch.Tensor
    ) -> tuple[int, torch.Tensor | None]:
        """The next draft token from the draft's `[vocab]` logits, and the `[vocab_size]`
        float32 distribution it was drawn from (None: greedy)."""
        scores = _fit(logits.float(), self.vocab_size)
        sampling = request.sampling
        if sampling is None or not _is_sampling(sampling):
            return argmax_token(scores), None
        assert sequence.generator is not None
        filtered = filter_logits(scores, sampling)  # [vocab_size], -inf where filtered out
        token = race_index(filtered, None, draw_key(sequence.generator))
        return token, torch.softmax(filtered, dim=-1)


def _share_prefill(
    feeds: Sequence[Sequence[int]], budget: int
) -> tuple[list[int], list[tuple[int, list[int]]]]:
    """Share a step's `budget` of draft prefill positions among the requests' `feeds`,
    shortest first (ties in request order).

    Returns:
        (the requests that draft this step, by index in order; for each request whose feed
        no longer fits: its index and the catch-up segment it prefills, its feed's first
        tokens up to what is left of the budget, none where nothing is left).
    """
    drafting: list[int] = []
    catching_up: list[tuple[int, list[int]]] = []
    for index in sorted(range(len(feeds)), key=lambda index: (len(feeds[index]), index)):
        feed = feeds[index]
        if len(feed) <= budget:
            drafting.append(index)
            budget -= len(feed)
        elif budget > 0:
            catching_up.append((index, list(feed[:budget])))
            budget = 0
    return sorted(drafting), catching_up


def _is_sampling(sampling: SamplingParams | None) -> bool:
    return sampling is not None and not sampling.is_greedy


def _fit(scores: torch.Tensor, size: int) -> torch.Tensor:
    """`[vocab]` draft scores cut or padded (with -inf: never drawn) to `size` entries (an
    output layer padded past the tokenizer differs between models of one tokenizer)."""
    if scores.shape[-1] >= size:
        return scores[:size]
    padding = torch.full((size - scores.shape[-1],), float("-inf"), device=scores.device)
    return torch.cat([scores, padding])


def check_same_vocabulary(
    draft_tokenizer: Any, target_tokenizer: Any, draft_name: str, target_name: str
) -> None:
    """Refuse a draft model whose tokenizer maps tokens to other ids than the target's
    (its drafts would be other text).

    Raises:
        VocabularyMismatchError: the vocabularies differ (naming both models).
    """
    draft_vocabulary = draft_tokenizer.get_vocab()
    target_vocabulary = target_tokenizer.get_vocab()
    if draft_vocabulary == target_vocabulary:
        return
    differing = sum(
        1
        for token in draft_vocabulary.keys() | target_vocabulary.keys()
        if draft_vocabulary.get(token) != target_vocabulary.get(token)
    )
    raise VocabularyMismatchError(
        f"draft model {draft_name} cannot draft for {target_name}: their vocabularies differ "
        f"({len(draft_vocabulary)} and {len(target_vocabulary)} tokens, {differing} tokens "
        "with other ids); a draft model needs the target's tokenizer"
    )


def draft_left_out(name: str, target_name: str, error: Exception) -> str:
    """Why the draft model `name` is not used for `target_name` after `error` while finding
    or loading it (its vocabulary, its files, its config), logged once as a warning without
    a traceback: a draft is an optimisation, and a wrong card or a custom draft's fault must
    never fail the model, which serves with prompt-lookup drafts instead
    (`RunnerReady.draft_left_out` carries it to the state)."""
    detail = str(error)
    if not isinstance(error, VocabularyMismatchError):  # that one names both models
        detail = f"draft model {name} could not be loaded: {detail}"
    reason = f"{detail} ({target_name} serves without it)"
    logger.warning("{}", reason)
    return reason


def load_draft_model(
    model_dir: Path,
    target_tokenizer: Any,
    target_name: str,
    vocab_size: int,
    slots: int,
    kv_dtype: torch.dtype,
    device: str = "cpu",
    weight_dtype: WeightDtype | None = None,
    model_id: str | None = None,
) -> DraftModelSource:
    """Load a draft model from an HF-format directory (the engine's loading path, its
    weights held as `weight_dtype`: the target's) and check its vocabulary.

    Args:
        model_dir: the draft model's directory.
        target_tokenizer / target_name: the target's tokenizer and id.
        vocab_size: the length of the target's logits vectors.
        slots: most requests drafted for at once (the target's batch).
        kv_dtype: how the draft's keys and values are stored (the target's).
        model_id: the draft model's id, which its source is named by (status, metrics,
            logs); None: its directory's card id (the directory's path).

    Raises:
        VocabularyMismatchError: the draft's tokenizer is not the target's.
        ValueError: the directory is not a loadable model (`card_from_local_directory`,
            `load_parts`).
    """
    source, tokenizer = load_draft_source(
        model_dir, vocab_size, slots, kv_dtype, device, weight_dtype, model_id
    )
    check_same_vocabulary(tokenizer, target_tokenizer, source.name, target_name)
    logger.info("draft model {} drafts for {}", source.name, target_name)
    return source


def load_draft_source(
    model_dir: Path,
    vocab_size: int | None,
    slots: int,
    kv_dtype: torch.dtype,
    device: str = "cpu",
    weight_dtype: WeightDtype | None = None,
    model_id: str | None = None,
) -> tuple[DraftModelSource, Any]:
    """Load a draft model and its KV slots (as `load_draft_model`, without a target to
    check against: a draft server's, which checks each client's vocabulary).

    Args:
        vocab_size: the length of the target's logits vectors; None: the draft's own.
        model_id: as `load_draft_model`'s.

    Returns:
        The source and the draft model's tokenizer.

    Raises:
        ValueError: the directory is not a loadable model.
    """
    card = card_from_local_directory(model_dir)
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    parts = load_parts(model_dir, shard, device, weight_dtype)
    text_config = parts.model.config.get_text_config()
    windows = family_for_architecture(type(parts.model).__name__).attention_windows(text_config)
    geometry = kv_geometry_of_config(text_config, len(windows))
    cache = SlotKVCache(
        geometry.layers, geometry.kv_heads, geometry.head_dim, kv_dtype, parts.device, slots,
        geometry.latent_values, windows,
    )  # fmt: skip
    if vocab_size is None:
        vocab_size = int(getattr(text_config, "vocab_size", None) or len(parts.tokenizer))
    logger.info("draft model {} loaded ({} weights)", model_dir, parts.weight_dtype)
    name = model_id or card.model_id
    source = DraftModelSource(parts.model, cache, windows, vocab_size, name, parts.device)
    return source, parts.tokenizer


def draft_model_directory(name: str, models_directory: Path) -> Path:
    """The directory of the draft model `name` (`--draft-model`): a catalog model by any of
    its names, or a local model directory, resolved as a requested model is
    (`resolve_card`) and found among this node's models without downloading
    (`prepare_model` offline: a catalog model must already be on the node).

    Raises:
        UnknownModelError (a ValueError): neither a catalog model nor a directory.
        ModelPreparationError: the model's files are not on this node.
    """
    return prepare_model(resolve_card(name, load_builtin_cards()), models_directory, offline=True)
