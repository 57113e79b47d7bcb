"""Images on split instances of a vision model (Gemma 3, Idefics3, Mistral 3, Qwen2.5-VL,
Qwen3-VL): the tower runs on rank 0 only; the step header carries each prefill segment's
image blocks, the image rows and Qwen-VL's multimodal rotary positions
(`parallel/rank_steps.py`), a tensor step also the rows' features, a pipeline step
Qwen3-VL's deepstack features to a later rank holding a layer they feed.

Without processes: the header's encoding and the pipeline's micro-batch split keep the
blocks, rows and positions. With processes (gloo over 127.0.0.1, tiny random float32 vision
checkouts): a 2-rank pipeline (and, marked slow, a 2-rank tensor group) gives the single
process's greedy tokens and logprobs for a prompt with two images of different sizes, for
chunked prefills whose chunk boundaries fall near and inside the images, for two image
prompts prefilled together (one step split into two micro-batches), and for a second turn
that hits the prefix cache past the image. Gemma 3's pipeline runs by default (the default
run's one vision family), the rest marked slow: Qwen3-VL's pipeline splits after text layer
0, so rank 1's layer 1 takes its deepstack feature from rank 0."""

from __future__ import annotations

import dataclasses
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from exo.shared.models.cards import card_from_local_directory
from exo.shared.types.common import ModelId
from exo.shared.types.shards import Sharding, ShardMetadata
from exo.shared.types.text_generation import IMAGE_MARKER, ChatMessage, TextGenerationTaskParams
from exo.testing.qwen_vl_checkpoints import (
    QWEN_VL_IMAGE,
    save_tiny_qwen2_5_vl,
    save_tiny_qwen3_vl,
)
from exo.testing.rank_processes import run_rank_processes
from exo.testing.vision_checkpoints import (
    GEMMA3_SOFT,
    image_input,
    png,
    save_gemma3_checkout,
    tiny_gemma3_vision,
)
from exo.worker.engines.torch.batching.batch_attention import PrefillSegment
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.parallel.rank_steps import (
    STEP,
    StepHeader,
    split_micro_batches,
)
from exo.worker.engines.torch.tests.test_distributed import GROUP_DEADLINE_S, split_layers

# Split and single runs compare token for token: float32 KV (`float32_kv`).
pytestmark = pytest.mark.usefixtures("float32_kv")

LOGPROB_TOLERANCE = 1e-4  # float32, as the families' checks against transformers
WORDS = " ".join(f"w{index % 60 + 1}" for index in range(24))
PICTURES = ((40, 24, 1), (17, 50, 2))  # (width, height, seed) of the prompt's two images
OTHER_PICTURES = ((40, 24, 3), (17, 50, 4))
MODES = ("pipeline", "tensor")

# One outcome per scenario: per request, its tokens, each token's logprob, and the
# request's cached prompt tokens.
Outcome = tuple[list[int], list[float], int]


# -- without processes ------------------------------------------------------------------


def test_header_keeps_image_blocks_and_rows() -> None:
    """Segments' image blocks, the image rows and their width and the multimodal rotary
    positions survive the header's encoding."""
    header = StepHeader(
        STEP,
        decode_slots=(0,),
        decode_positions=(40,),
        prefill=(PrefillSegment(1, 0, 1, 12, ((5, 9),)), PrefillSegment(2, 8, 13, 6)),
        input_ids=tuple(range(19)),
        position_ids=(40, *range(12), *range(8, 14)),
        logit_rows=(0, 12),
        image_rows=((6, 4),),
        image_width=192,
        rotary_positions=tuple(range(3 * 19)),
    )
    assert StepHeader.decode(header.encode()) == header
    two_blocks = PrefillSegment(3, 4, 0, 20, ((6, 10), (14, 18)))
    both = StepHeader(
        STEP, prefill=(two_blocks,), input_ids=(7,) * 20, position_ids=tuple(range(4, 24)),
        image_rows=((2, 4), (10, 4)),
    )  # fmt: skip
    assert StepHeader.decode(both.encode()) == both


def test_micro_batches_keep_each_segments_images() -> None:
    """A step of a decode row and two image prompts' chunks split into two micro-batches:
    each chunk keeps its blocks, its image rows are renumbered to the micro-batch's rows,
    and `MicroBatch.row_embeddings` hands each micro-batch its own features."""
    first = PrefillSegment(1, 0, 1, 40, ((10, 14),))
    second = PrefillSegment(2, 3, 41, 30, ((5, 9), (20, 24)))
    step = StepHeader(
        STEP, decode_slots=(0,), decode_positions=(50,), prefill=(first, second),
        input_ids=tuple(range(71)), position_ids=(50, *range(40), *range(3, 33)),
        logit_rows=(0, 40, 70), image_rows=((11, 4), (43, 4), (58, 4)),
    )  # fmt: skip
    step = dataclasses.replace(
        step, image_width=8, rotary_positions=tuple(range(3 * 71))
    )  # position row a of step row r: 71 a + r
    features = [(row, torch.full((4, 8), float(row))) for row, _ in step.image_rows]
    micro_batches = split_micro_batches(step, 2)
    assert len(micro_batches) == 2
    seen: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {}
    for batch in micro_batches:
        header = batch.header
        for segment in header.prefill:
            seen[(segment.slot, segment.start)] = segment.image_blocks
        embeddings = batch.row_embeddings(features)
        assert [(row, int(rows.shape[0])) for row, rows in embeddings] == list(header.image_rows)
        assert header.image_width == 8
        rotary = torch.tensor(header.rotary_positions).view(3, header.rows)
        assert torch.equal(
            rotary, torch.tensor([[71 * a + r for r in batch.step_rows] for a in range(3)])
        )
        for local, rows in embeddings:
            step_row = batch.step_rows[local]
            assert header.input_ids[local] == step.input_ids[step_row]
            assert torch.equal(rows, torch.full((4, 8), float(step_row)))
    assert seen == {(1, 0): first.image_blocks, (2, 3): second.image_blocks}
    assert sorted(row for batch in micro_batches for row in batch.step_rows) == list(range(71))


# -- with processes ---------------------------------------------------------------------


def _gemma3_checkout(directory: Path) -> Path:
    """A tiny Gemma 3 vision checkout (as `test_gemma3_vision`: 4 text layers, a 2-layer
    SigLIP tower, 4 tokens per image, a random projection so images move the logits)."""
    _, text, encoder = tiny_gemma3_vision()
    return save_gemma3_checkout(directory, text, encoder)


def _qwen_checkout(save: Any) -> Any:
    def build(directory: Path) -> Path:
        directory.mkdir(parents=True)
        save(directory)
        return directory

    return build


def _idefics3_checkout(directory: Path) -> Path:
    from exo.worker.engines.torch.tests.test_idefics3_vision import _save_checkout

    directory.mkdir(parents=True)
    return _save_checkout(directory, "idefics3")[0]


def _mistral3_checkout(directory: Path) -> Path:
    from exo.worker.engines.torch.tests.test_mistral3_vision import save_checkout

    directory.mkdir(parents=True)
    return save_checkout(directory)[0]


# family -> (checkout builder, its image token id, the 2-rank pipeline's layers or None for
# `split_layers`'). Qwen3-VL's 3 text layers split after layer 0: its deepstack features
# feed layers 0 and 1, so rank 1 needs the second one from rank 0.
FAMILIES: dict[str, tuple[Any, int, list[tuple[int, int]] | None]] = {
    "gemma3": (_gemma3_checkout, GEMMA3_SOFT, None),
    "idefics3": (_idefics3_checkout, 45, None),  # "<image>" (test_idefics3_vision.IMAGE_ID)
    "mistral3": (_mistral3_checkout, 44, None),  # "[IMG]" (test_mistral3_vision.IMAGE_ID)
    "qwen2_5_vl": (_qwen_checkout(save_tiny_qwen2_5_vl), QWEN_VL_IMAGE, None),
    "qwen3_vl": (_qwen_checkout(save_tiny_qwen3_vl), QWEN_VL_IMAGE, [(0, 1), (1, 3)]),
}
DEFAULT_RUNS = {("gemma3", "pipeline")}


def _family_of(model_dir: Path) -> str:
    return model_dir.parent.name.split("-")[0]


def _shard(model_dir: Path, mode: str, rank: int, world_size: int) -> ShardMetadata:
    card = card_from_local_directory(model_dir).model_copy(
        update={"capabilities": ("text", "vision")}
    )
    start, end = (0, card.n_layers)
    if mode == "pipeline" and world_size > 1:
        layers = FAMILIES[_family_of(model_dir)][2] or split_layers(card.n_layers, world_size)
        start, end = layers[rank]
    sharding: Sharding = "pipeline" if mode == "pipeline" else "tensor"
    return ShardMetadata(
        sharding=sharding, model_card=card, device_rank=rank, world_size=world_size,
        start_layer=start, end_layer=end,
    )  # fmt: skip


def _message(text: str, pictures: tuple[tuple[int, int, int], ...]) -> ChatMessage:
    images = tuple(image_input(png(width, height, seed)) for width, height, seed in pictures)
    return ChatMessage(role="user", content=text, images=images)


def _params(messages: tuple[ChatMessage, ...], max_tokens: int = 8) -> TextGenerationTaskParams:
    return TextGenerationTaskParams(
        model=ModelId("m"), messages=messages, max_tokens=max_tokens, temperature=0.0,
        logprobs=True,
    )  # fmt: skip


def _first_turn(pictures: tuple[tuple[int, int, int], ...] = PICTURES) -> ChatMessage:
    return _message(f"w1 w2 {IMAGE_MARKER} w3 w4 w5 {IMAGE_MARKER} w6", pictures)


def _outcome(pieces: list[Any]) -> Outcome:
    tokens = [token for piece in pieces for token in piece.token_ids]
    logprobs = [entry.logprob for piece in pieces for entry in piece.logprobs or ()]
    usage = pieces[-1].usage
    assert usage is not None
    return tokens, logprobs, usage.cached_tokens


def _generate(engine: TorchEngine, params: TextGenerationTaskParams) -> Outcome:
    return _outcome(list(engine.generate(params)))


def _chunked(engine: TorchEngine, params: TextGenerationTaskParams, chunk: int) -> Outcome:
    """`params` prefilled `chunk` tokens at a time (the cache cleared first: a whole
    prefill)."""
    import exo.worker.engines.torch.batching.scheduler as scheduler_module

    engine.clear_prefix_cache()
    saved = scheduler_module.PREFILL_TOKENS_PER_IDLE_STEP
    scheduler_module.PREFILL_TOKENS_PER_IDLE_STEP = chunk
    try:
        return _generate(engine, params)
    finally:
        scheduler_module.PREFILL_TOKENS_PER_IDLE_STEP = saved


def _together(engine: TorchEngine, requests: list[TextGenerationTaskParams]) -> list[Outcome]:
    """`requests` submitted at once and stepped to the end (prefilled in one step)."""
    engine.clear_prefix_cache()
    handles = [engine.submit(params) for params in requests]
    pieces: dict[str, list[Any]] = {handle.request_id: [] for handle in handles}
    for _ in range(200):
        if not engine.has_work:
            break
        for request_id, output in engine.step():
            assert not isinstance(output, Exception), output
            pieces[request_id].append(output)
    engine.store_finished()
    assert not engine.has_work
    return [_outcome(pieces[handle.request_id]) for handle in handles]


def scenarios(engine: TorchEngine, image: int) -> dict[str, list[Outcome]]:
    """Every scenario's outcomes on `engine` (a single process or a group's rank 0) of a
    model whose image token id is `image`."""
    engine.clear_prefix_cache()
    first = _params((_first_turn(),))
    prompt_ids = engine.render_prompt(first).token_ids
    image_starts = [
        i for i in range(1, len(prompt_ids)) if prompt_ids[i] == image != prompt_ids[i - 1]
    ]
    outcomes: dict[str, list[Outcome]] = {"two images": [_generate(engine, first)]}
    # A conversation's second turn: its prefix (both images included) from the cache.
    second = _params(
        (
            _first_turn(),
            ChatMessage(role="assistant", content="w10 w11"),
            ChatMessage(role="user", content="w7 w8 w9"),
        )
    )
    outcomes["second turn"] = [_generate(engine, second)]
    # Chunks of 3 tokens (an image of 4 is stretched into one chunk), and a chunk whose
    # end falls two tokens inside the first image (cut before it; the next chunk holds it).
    outcomes["chunks of 3"] = [_chunked(engine, first, 3)]
    outcomes["chunk ending inside an image"] = [_chunked(engine, first, image_starts[0] + 2)]
    # Two longer image prompts prefilled in one step of more than `MICRO_BATCH_MIN_ROWS` rows
    # (a pipeline splits it into one micro-batch per prompt).
    longer = [
        _params((_message(f"{WORDS} {IMAGE_MARKER} {WORDS} {IMAGE_MARKER} w7", pictures),))
        for pictures in (PICTURES, OTHER_PICTURES)
    ]
    outcomes["two prompts together"] = _together(engine, longer)
    return outcomes


def _vision_rank_main(
    rank: int, world_size: int, port: int, results: Any, model_dir: str, modes: list[str]
) -> None:
    """A spawned rank: for each mode, load its shard, warm up, then run the scenarios
    (rank 0) or serve them."""
    from exo.worker.engines.torch.comm.process_group import destroy_group, init_group
    from exo.worker.engines.torch.engine_factory import load_engine

    torch.set_num_threads(1)
    try:
        init_group("gloo", rank, world_size, "127.0.0.1", port, timeout_s=60)
        for mode in modes:
            engine = load_engine(
                Path(model_dir), _shard(Path(model_dir), mode, rank, world_size),
                weight_dtype="float32",
            )  # fmt: skip
            results.put(("tower", mode, rank, engine.images is not None))
            engine.warmup()
            if rank != 0:
                engine.serve_forever()
                continue
            image = FAMILIES[_family_of(Path(model_dir))][1]
            results.put(("outcomes", mode, rank, scenarios(engine, image)))
            engine.shutdown()
        results.put(("done", "", rank, None))
    except BaseException:
        results.put(("error", "", rank, traceback.format_exc()))
    finally:
        destroy_group()


@pytest.fixture(scope="module")
def vision_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkout of the family the test names (indirect parameter), in a directory
    named after the family (`_family_of`)."""
    family = request.param
    return FAMILIES[family][0](tmp_path_factory.mktemp(f"{family}-vision") / "checkout")


@pytest.fixture(scope="module")
def single_outcomes(vision_dir: Path) -> dict[str, list[Outcome]]:
    """The single process's outcomes, checked to exercise what they claim: the second turn
    hits the cache past both images, chunking changes nothing, and the images change the
    answer."""
    shard = _shard(vision_dir, "pipeline", 0, 1)
    engine = TorchEngine.load(vision_dir, shard, weight_dtype="float32")
    assert engine.images is not None
    image = FAMILIES[_family_of(vision_dir)][1]
    outcomes = scenarios(engine, image)
    prompt_ids = engine.render_prompt(_params((_first_turn(),))).token_ids
    last_image_end = max(i for i, token in enumerate(prompt_ids) if token == image) + 1
    [(first_tokens, _, _)] = outcomes["two images"]
    [(_, _, cached)] = outcomes["second turn"]
    assert cached > last_image_end
    for name in ("chunks of 3", "chunk ending inside an image"):
        assert outcomes[name][0][0] == first_tokens, name
    one, other = outcomes["two prompts together"]
    assert one[1] != other[1]  # different images: different logprobs
    return outcomes


def _split_reports(vision_dir: Path, mode: str) -> dict[str, Any]:
    """One 2-rank group that loads the checkout split by `mode`: which ranks loaded the
    tower, and rank 0's outcomes."""
    reports = run_rank_processes(_vision_rank_main, (str(vision_dir), [mode]), 2, GROUP_DEADLINE_S)
    towers = {rank: loaded for kind, _, rank, loaded in reports if kind == "tower"}
    [outcomes] = [value for kind, _, _, value in reports if kind == "outcomes"]
    return {"towers": towers, "outcomes": outcomes}


def _check_equal(single: dict[str, list[Outcome]], split: dict[str, list[Outcome]]) -> None:
    assert split.keys() == single.keys()
    for name, expected in single.items():
        for (tokens, logprobs, cached), (want_tokens, want_logprobs, want_cached) in zip(
            split[name], expected, strict=True
        ):
            assert tokens == want_tokens, name
            assert cached == want_cached, name
            difference = max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True))
            assert difference < LOGPROB_TOLERANCE, (name, difference)


@pytest.mark.parametrize(
    ("vision_dir", "mode"),
    [
        pytest.param(
            family, mode, marks=[] if (family, mode) in DEFAULT_RUNS else [pytest.mark.slow]
        )
        for family in FAMILIES
        for mode in MODES
    ],
    indirect=["vision_dir"],
)
def test_split_takes_images_as_single(
    vision_dir: Path, mode: str, single_outcomes: dict[str, list[Outcome]]
) -> None:
    """2-rank pipeline and tensor groups: the tower on rank 0 only; every scenario's
    tokens, logprobs and cached counts as the single process's."""
    reports = _split_reports(vision_dir, mode)
    assert (reports["towers"][0], reports["towers"][1]) == (True, False)
    _check_equal(single_outcomes, reports["outcomes"])
