"""Pipeline parallelism's engine side: a rank keeps its range of decoder layers (the first
also the embedding, the last the final norm and LM head) and a step travels rank to rank.

Up to `world_size` steps are in flight at once, each over its own requests (the scheduler's
`max_in_flight`: rank 0 runs step t+1's layers while the next ranks run step t's, and
samples step t when its logits come back). Speculative decoding: a drafting request's k + 1
rows go in one step; a greedy request's, and a sampling request's n-gram draft's, come back
as the last rank's chosen tokens up to the first rejected draft token (the last rank runs
the point-mass rejection rule with the request's own keys:
`last_rank_sampling.py`), a sampling request's draft-model draft as whole logits rows
(`speculation.remote_rows`, or penalties, bias or a constraint), and rank 0
verifies them; the verified length reaches the other ranks as a `CACHE_COMMIT` in
a later step's header (every rank applies it between the same two steps), and until then
each rank's slot carries the draft's positions (`SlotKVCache.hold_unverified`).

A step of at least `MICRO_BATCH_MIN_ROWS` rows (prefill) is also split into up to
`world_size` micro-batches of requests (`micro_batch_count`; a decode step stays whole).
For each, rank 0 runs its layers and sends the header and `[1, T, hidden]` float32 hidden
states to rank 1 (which runs its layers while rank 0 computes the next micro-batch), and so
on; the last rank sends rank 0 its answer for the micro-batch's logit rows (rank 0 posts
that receive before sending the micro-batch, so no send waits on a rank that is itself
sending): per row the token it chose (and its logprobs, only when asked), or the row's
`[vocab]` float32 logits for a request whose penalties, logit bias or constraint rank 0
applies (`last_rank_sampling.py`: what each row's request needs travels in the header). Per
micro-batch and hop: two messages (the header with its length, the hidden states), over the
group's `comm/tcp_mesh.py` TCP links when it has them (else gloo).

A vision model's images: the first rank alone holds the embedding, so it alone runs the
vision tower and puts the image rows into the hidden states it sends on; the header's
prefill segments carry their image blocks for every rank's attention, and Qwen-VL's
multimodal rotary positions (`rank_steps.py`). Qwen3-VL's deepstack features (added to the
image rows after the first few decoder layers) follow the hidden states, as a third message
(`send_image_rows`), to each next rank that holds such a layer (`_deepstack_after`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar, cast

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from exo.shared.types.shards import Sharding, ShardMetadata
from exo.worker.engines.torch.batching.batch_attention import BatchPlan
from exo.worker.engines.torch.batching.scheduler import StepLogits
from exo.worker.engines.torch.batching.speculation import RemoteRow
from exo.worker.engines.torch.comm.process_group import post_receive, receive_tensor, send_tensor
from exo.worker.engines.torch.decoding.sampling import SampledToken
from exo.worker.engines.torch.model.direct_forward import FIRST_LAYER_ATTRIBUTE
from exo.worker.engines.torch.model.families import ModelFamily
from exo.worker.engines.torch.model.sharding import (
    AbsentModule,
    TensorReader,
    decoder_layers,
    read_whole,
)
from exo.worker.engines.torch.parallel.base import EngineTransform, RankEngine, SchedulerHooks
from exo.worker.engines.torch.parallel.last_rank_sampling import (
    FULL_ROW,
    RowSampling,
    answer_rows,
    read_answer,
)
from exo.worker.engines.torch.parallel.rank_steps import (
    MicroBatch,
    StepHeader,
    micro_batch_count,
    receive_image_rows,
    receive_step,
    send_image_rows,
    send_step,
    split_micro_batches,
    stage_forward_batch,
)


def _deepstack_after(header: StepHeader, hidden_size: int, layer: int) -> bool:
    """Whether the step's image rows carry deepstack features for a decoder layer at or
    after global index `layer` (rows of `image_width` = hidden x (1 + deepstack layers),
    feature k added after layer k: Qwen3-VL), which a pipeline rank from that layer on needs."""
    if not header.image_rows or header.image_width <= hidden_size:
        return False
    return header.image_width // hidden_size - 1 > layer


def cut_to_pipeline_stage(model: PreTrainedModel, shard: ShardMetadata) -> None:
    """Keep decoder layers [start_layer, end_layer) (renumbered from 0 for the KV cache), the
    embedding on the first rank only, the final norm and LM head on the last rank only.

    Raises:
        ValueError: the model's layer count differs from the card's.
    """
    layers = decoder_layers(model)
    inner: Any = model.model
    if len(layers) != shard.model_card.n_layers:
        raise ValueError(
            f"the model has {len(layers)} decoder layers, its card says {shard.model_card.n_layers}"
        )
    if (shard.start_layer, shard.end_layer) == (0, len(layers)) and shard.world_size == 1:
        return
    kept = list(layers)[shard.start_layer : shard.end_layer]
    inner.layers = nn.ModuleList(kept)
    # The global index of the first kept layer (`direct_forward.FIRST_LAYER_ATTRIBUTE`: the
    # lean forward adds Qwen3-VL's deepstack feature k after global layer k).
    setattr(inner, FIRST_LAYER_ATTRIBUTE, shard.start_layer)
    for layer in kept:
        for module in layer.modules():
            layer_index = getattr(module, "layer_idx", None)
            if isinstance(layer_index, int):
                setattr(module, "layer_idx", layer_index - shard.start_layer)  # noqa: B010
    # Attention modules read their layer type at construction (done above with the global
    # index); the model's forward and the cache read the per-layer lists by local index.
    text_config = model.config.get_text_config()
    text_config.num_hidden_layers = len(kept)
    layer_types = getattr(text_config, "layer_types", None)
    if isinstance(layer_types, list | tuple):
        text_config.layer_types = list(layer_types)[shard.start_layer : shard.end_layer]
    if not shard.is_first_rank:
        inner.embed_tokens = AbsentModule("token embedding")
    if not shard.is_last_rank:
        inner.norm = nn.Identity()
        model.lm_head = AbsentModule("LM head")


class PipelineTransform(EngineTransform):
    sharding: ClassVar[Sharding] = "pipeline"

    def cut(self, model: PreTrainedModel, family: ModelFamily, shard: ShardMetadata) -> None:
        cut_to_pipeline_stage(model, shard)

    def tensor_reader(
        self, family: ModelFamily, config: PretrainedConfig, model_name: str, shard: ShardMetadata
    ) -> TensorReader:
        return read_whole

    def split_output_layer(self, model: PreTrainedModel, shard: ShardMetadata) -> bool:
        return False  # the last rank holds the whole head

    def runs_vision_tower(self, shard: ShardMetadata) -> bool:
        return shard.is_first_rank  # the rank with the token embedding

    def scheduler_hooks(self, engine: RankEngine) -> SchedulerHooks:
        def launch(
            model: PreTrainedModel,
            plan: BatchPlan,
            input_ids: torch.Tensor,
            position_ids: torch.Tensor,
            logit_rows: torch.Tensor,
            requests: list[RemoteRow | None],
        ) -> Callable[[], StepLogits]:
            # Rows wanted whole (None: a sampling request's draft-model draft) travel whole.
            samplings = tuple(
                FULL_ROW if row is None else RowSampling.of(row.state, row.ahead, row.draft_token)
                for row in requests
            )
            return _launch(engine, model, plan, input_ids, position_ids, logit_rows, samplings)

        # One step in flight per rank (see scheduler.py).
        return SchedulerHooks(launch=launch, max_in_flight=engine.world_size)

    def agree(self, engine: RankEngine, value: torch.Tensor) -> None:
        if engine.rank > 0:
            receive_tensor(value, engine.rank - 1)
        if not engine.is_last_rank:
            send_tensor(value, engine.rank + 1)

    def send_control(self, engine: RankEngine, header: StepHeader) -> None:
        send_step(header, 1)

    def receive_header(self, engine: RankEngine, idle_wait: timedelta) -> StepHeader:
        return receive_step(engine.rank - 1, idle_wait)

    def pass_on_control(self, engine: RankEngine, header: StepHeader) -> None:
        if not engine.is_last_rank:
            send_step(header, engine.rank + 1)

    def serve_step(self, engine: RankEngine, header: StepHeader, plan: BatchPlan) -> None:
        model, device, rank = engine.model, engine.device, engine.rank
        dtype = next(model.parameters()).dtype
        received = torch.empty((1, header.rows, engine.hidden_size), dtype=torch.float32)
        receive_tensor(received, rank - 1)
        hidden = received.to(device=device, dtype=dtype)
        start, end = engine.layer_range
        if _deepstack_after(header, engine.hidden_size, start):
            # Deepstack features for this rank's layers (the image rows are in `hidden`).
            plan.row_embeddings = receive_image_rows(
                header.image_rows, header.image_width, device, source=rank - 1
            )
        output = stage_forward_batch(
            model, plan, header, hidden=hidden, is_last=engine.is_last_rank, device=device
        )
        if not engine.is_last_rank:
            send_step(header, rank + 1)
            send_tensor(output.cpu().contiguous(), rank + 1)
            if _deepstack_after(header, engine.hidden_size, end):
                send_image_rows(plan.row_embeddings, (rank + 1,))
        elif header.logit_rows:
            answer = answer_rows(output, header.row_samplings)
            send_tensor(answer.contiguous(), 0)


def _launch(
    engine: RankEngine,
    model: PreTrainedModel,
    plan: BatchPlan,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    logit_rows: torch.Tensor,
    samplings: tuple[RowSampling, ...],
) -> Callable[[], StepLogits]:
    """Rank 0's part of a pipeline step: its layers for each micro-batch in turn, sent on as
    soon as done (the receive of the last rank's answer posted first); returns the function
    that waits for every micro-batch's answer and puts its rows in order (a row's `[vocab]`
    logits or the `SampledToken` the last rank chose)."""
    step = StepHeader.from_plan(
        plan, input_ids, position_ids, logit_rows, engine.take_cache_ops(), samplings
    )
    last = engine.world_size - 1
    vocab_size, device = engine.vocab_size, engine.device
    answers: list[tuple[Callable[[], None] | None, torch.Tensor, MicroBatch]] = []
    for micro_batch in split_micro_batches(step, micro_batch_count(step, engine.world_size)):
        header = micro_batch.header
        samplings = header.row_samplings
        size = sum(sampling.answer_size(vocab_size) for sampling in samplings)
        answer = torch.empty(size, dtype=torch.float32)
        wait = post_receive(answer, last) if header.logit_rows else None
        engine.traffic.count(samplings, vocab_size)
        micro_plan = header.plan(plan.cache, plan.windows, plan.layer_of)
        # Image tokens: rank 0 embeds them with the tower's rows (the later ranks get them
        # in the hidden states; every rank reads the segments' image blocks).
        micro_plan.row_embeddings = micro_batch.row_embeddings(plan.row_embeddings)
        hidden = stage_forward_batch(
            model, micro_plan, header, hidden=None, is_last=False, device=device
        )
        send_step(header, 1)
        send_tensor(hidden.cpu().contiguous(), 1)
        if _deepstack_after(header, engine.hidden_size, engine.layer_range[1]):
            send_image_rows(micro_plan.row_embeddings, (1,))
        answers.append((wait, answer, micro_batch))

    def collect() -> StepLogits:
        rows: list[torch.Tensor | SampledToken | None] = [None] * len(step.logit_rows)
        for wait, answer, micro_batch in answers:
            if wait is None:
                continue
            wait()
            for order, row in zip(
                micro_batch.logit_order,
                read_answer(answer, micro_batch.header.row_samplings, vocab_size),
                strict=True,
            ):
                rows[order] = row.to(device) if isinstance(row, torch.Tensor) else row
        assert all(row is not None for row in rows)
        return cast(list[torch.Tensor | SampledToken], rows)

    return collect
