"""The one loading path: a meta-device skeleton of the model's family, cut to the shard,
filled layer by layer from safetensors and quantized as each layer arrives.

A single rank is the world-size-1 case of a sharded load. Each decoder layer's tensors are
read (only this rank's slices), assigned, then its linears are quantized before the next
layer is read (a MoE layer's experts each as soon as it is read), and each file's memory
map is closed after every layer (and every expert), so a node's peak memory while loading
stays near the size of the format it holds (int4 on CPU) plus one layer in float32 (of a
MoE layer, its parts but the experts, and one expert; see
`exo.shared.models.memory.loading_peak_bytes`). Weights repacked from GGUF
(`exo.download.gguf_repack`) are read through the same per-rank slicing and go straight
into their quantized modules (`gguf_weights.load_repacked`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import json
import os
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from loguru import logger
from safetensors import safe_open
from torch import nn
from transformers import (
    AutoConfig,
    GenerationConfig,
    PreTrainedModel,
)

from exo.chat_protocol.format_detection import format_stop_token_ids
from exo.chat_protocol.tokenizer_loading import load_tokenizer
from exo.shared.models.architectures import MODEL_TYPE_ALIASES
from exo.shared.models.latent_attention import latent_attention_of_config
from exo.shared.models.skeleton import empty_model
from exo.shared.models.tensor_names import LAYER_TENSOR
from exo.shared.models.weight_formats import (
    DEFAULT_PREFILL_ACTIVATIONS,
    ENGINE_CPU_WEIGHT_FORMAT,
    PrefillActivations,
)
from exo.shared.types.shards import ShardMetadata
from exo.worker.engines.torch.model.direct_forward import enable_lean_forward
from exo.worker.engines.torch.model.families import (
    ModelFamily,
    UnsupportedArchitectureError,
    config_architecture,
    family_for_architecture,
)
from exo.worker.engines.torch.model.fp8_checkpoint import Fp8Checkpoint
from exo.worker.engines.torch.model.fused_experts import FusedExperts
from exo.worker.engines.torch.model.fusion import fuse_rms_norms
from exo.worker.engines.torch.model.moe import ExpertFormat, install_routed_experts
from exo.worker.engines.torch.model.sharding import AbsentModule, model_tensor_name
from exo.worker.engines.torch.parallel import engine_transform
from exo.worker.engines.torch.quant.gguf_weights import (
    load_repacked,
    split_output_layer,
    split_repacked_name,
)
from exo.worker.engines.torch.quant.native_kernels import (
    ROUNDS_ACTIVATIONS,
    bf16_prefill_available,
    native_int4_kernel,
)
from exo.worker.engines.torch.quant.quantize import (
    WEIGHT_DTYPES,
    WeightDtype,
    quantize_linears,
    quantize_output_layer,
    set_prefill_activations,
)

LayerProgressCallback = Callable[[int, int], None]
# (file, checkpoint tensor name, model tensor name) of one tensor to read.
PlannedTensor = tuple[Path, str, str]
EMBEDDING = "model.embed_tokens.weight"


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    try:
        function: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    return function


def release_freed_memory() -> None:
    """Give the memory of freed float32 tensors back to the OS. glibc keeps freed heap
    memory between the quantized buffers allocated meanwhile, so without this a node's
    resident memory after loading int4 stayed near the float32 size (figures:
    docs/benchmarks/engine-design-figures.md#loadingpy)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


HEADLESS_PREFIX = "model."
"""What a causal LM's decoder tensors are named under, which a checkpoint of the bare
decoder leaves out."""


def _plan_tensors(
    model_dir: Path,
    prefix: str,
    shard: ShardMetadata,
    wanted: set[str],
    family: ModelFamily,
    fused: FusedExperts | None = None,
) -> dict[int | None, list[PlannedTensor]]:
    """This rank's tensors grouped by decoder layer index on this rank (None: embedding,
    final norm, LM head), read from the safetensors headers only; checkpoint names the
    family's modules name otherwise are renamed (`ModelFamily.checkpoint_renames`). A
    stacked expert tensor (`fused`) is planned once per expert linear this rank holds."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors weights")
    groups: dict[int | None, list[PlannedTensor]] = defaultdict(list)
    skipped = 0
    headless = not prefix and _is_headless(files)
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                # A weight repacked from GGUF is planned once, under the name it stands for.
                repacked = split_repacked_name(name)
                if repacked is not None and repacked.companion:
                    continue
                base = name if repacked is None else repacked.base
                if headless and not base.startswith("lm_head."):
                    base = HEADLESS_PREFIX + base
                model_name = model_tensor_name(family.model_tensor_name(base), prefix, shard)
                if model_name is None:
                    skipped += 1
                    continue
                targets = [model_name] if fused is None else fused.targets(model_name)
                kept = [target for target in targets if target in wanted]
                if not kept:
                    skipped += 1
                for target in kept:
                    match = LAYER_TENSOR.match(target)
                    groups[int(match.group(1)) if match else None].append((path, name, target))
    logger.debug("{}: {} checkpoint tensors are not on this rank", model_dir, skipped)
    return groups


def _is_headless(files: list[Path]) -> bool:
    """Whether the checkpoint holds a bare decoder: its layers named `layers.N...`, not
    `model.layers.N...` (sentence-transformers saves Qwen3-Embedding so); its tensors are
    then read as `model.` + name."""
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.startswith(HEADLESS_PREFIX + "layers."):
                    return False
                if name.startswith("layers."):
                    return True
    return False


def _model_entries(model: nn.Module) -> set[str]:
    """Names of the parameters and persistent buffers a checkpoint may fill."""
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for buffer_name in module._buffers:
            if buffer_name not in module._non_persistent_buffers_set:
                names.add(f"{module_name}.{buffer_name}" if module_name else buffer_name)
    return names


def _assign_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put `tensor` in place of the parameter or persistent buffer `name`.

    Raises:
        ValueError: its shape differs from the skeleton's.
    """
    module_path, _, attribute = name.rpartition(".")
    module = model.get_submodule(module_path)
    if attribute in module._parameters:
        current = module._parameters[attribute]
        if current is not None and current.shape != tensor.shape:
            raise ValueError(
                f"tensor {name} has shape {tuple(tensor.shape)}, "
                f"this rank's model expects {tuple(current.shape)}"
            )
        module._parameters[attribute] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[attribute] = tensor


@contextlib.contextmanager
def _open_files() -> Iterator[Callable[[Path], Any]]:
    """Lazily opened safetensors handles, all closed (memory maps released) on exit."""
    handles: dict[Path, Any] = {}
    try:

        def handle_for(path: Path) -> Any:
            if path not in handles:
                handles[path] = safe_open(str(path), framework="pt")
            return handles[path]

        yield handle_for
    finally:
        handles.clear()


def _check_loaded(module: nn.Module, what: str, model_dir: Path, shard: ShardMetadata) -> None:
    missing = [name for name, parameter in module.named_parameters() if parameter.is_meta]
    # Persistent buffers a checkpoint fills too (a router's correction bias).
    missing += [
        f"{owner}.{name}" if owner else name
        for owner, child in module.named_modules()
        for name, buffer in child._buffers.items()
        if buffer is not None and buffer.is_meta and name not in child._non_persistent_buffers_set
    ]
    if missing:
        raise ValueError(
            f"{model_dir} lacks {len(missing)} tensors rank {shard.device_rank} needs for "
            f"{what}, e.g. {missing[:5]}"
        )


def _fill_tied_lm_head(
    model: PreTrainedModel, read: Callable[[Path, str, str], None], unlayered: list[PlannedTensor]
) -> None:
    """With tied embeddings the checkpoint stores the embedding only: share it with the LM
    head where both are here, or read it into the LM head (last pipeline rank)."""
    lm_head = getattr(model, "lm_head", None)
    weight = getattr(lm_head, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_meta:
        return
    if not getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        return
    embedding = getattr(model.model, "embed_tokens", None)
    if isinstance(embedding, nn.Embedding) and not embedding.weight.is_meta:
        lm_head.weight = embedding.weight  # type: ignore[union-attr]
        return
    for path, name, target in unlayered:
        if target == EMBEDDING:
            read(path, name, "lm_head.weight")
            return


def _stored_head(model: PreTrainedModel, unlayered: list[PlannedTensor]) -> tuple[Path, str] | None:
    """(file, stored name) of the tensor this rank's LM head was read from: `lm_head.weight`,
    or the embedding when they are tied; None without a head here."""
    if isinstance(getattr(model, "lm_head", None), AbsentModule | None):
        return None
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    for wanted in ("lm_head.weight", EMBEDDING) if tied else ("lm_head.weight",):
        for path, name, target in unlayered:
            if target == wanted:
                return path, name
    return None


def _plan_tied_lm_head(
    model_dir: Path,
    prefix: str,
    model: PreTrainedModel,
    groups: dict[int | None, Any],
    family: ModelFamily,
) -> None:
    """A last pipeline rank with a tied LM head needs the embedding tensor it does not keep
    as an embedding (`_fill_tied_lm_head` reads it into the LM head); its stored name is
    matched as `_plan_tensors` matches names (`ModelFamily.checkpoint_renames` applied:
    Qwen3-VL's `model.language_model.embed_tokens.weight`)."""
    embedding = getattr(model.model, "embed_tokens", None)
    if not isinstance(embedding, AbsentModule) or isinstance(model.lm_head, AbsentModule):
        return
    wanted = f"{prefix}{EMBEDDING}"
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                repacked = split_repacked_name(name)
                if repacked is not None and repacked.companion:
                    continue
                base = name if repacked is None else repacked.base
                if family.model_tensor_name(base) == wanted:
                    groups[None].append((path, name, EMBEDDING))
                    return


def model_config(model_dir: Path) -> Any:
    """The checkpoint's transformers config, without running code from the repository
    (`MODEL_TYPE_ALIASES`), its multi-head latent attention checked first (transformers'
    strict config classes would reject a missing rank with their own wording).

    Raises:
        UnsupportedArchitectureError: an MLA config without a usable `kv_lora_rank` (or
            head widths); the message names the field.
    """
    raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    text = {**raw, **(raw.get("text_config") or {})}
    try:
        latent_attention_of_config(text)
    except ValueError as error:
        raise UnsupportedArchitectureError(f"{model_dir.name}: {error}") from error
    alias = MODEL_TYPE_ALIASES.get(str(raw.get("model_type")))
    if alias is None:
        return AutoConfig.from_pretrained(model_dir)
    fields = {key: value for key, value in raw.items() if key not in ("model_type", "auto_map")}
    return AutoConfig.for_model(alias, **fields)


def load_model(
    model_dir: Path,
    shard: ShardMetadata,
    device: torch.device,
    weight_dtype: WeightDtype = "float32",
    on_layer_loaded: LayerProgressCallback | None = None,
    prefill_activations: PrefillActivations = DEFAULT_PREFILL_ACTIVATIONS,
) -> PreTrainedModel:
    """Load this rank's part of the model in `model_dir` onto `device`.

    Args:
        model_dir: HF-format directory (config.json + *.safetensors); a
            `*ForConditionalGeneration` checkpoint of a supported family loads its text model.
        shard: any pipeline shard (a layer range) or tensor shard (any world size); world
            size 1 is the whole model.
        device: target device; quantization and norm fusion apply on CPU only.
        weight_dtype: how decoder-layer linears and the LM head are held ("float32",
            "int8", "int4"; see `quantize.py`), converted layer by layer while loading.
        on_layer_loaded: called as (decoder layers loaded, decoder layers on this rank),
            first with 0 and then after each layer.
        prefill_activations: how prefill rounds the activations of exo's block weights
            ("int16" as decode, "int8" or "bf16"; `quantize.set_prefill_activations`).

    Returns:
        The cut-down model in eval mode: for a pipeline rank that is not the last,
        `model.model(...)` returns the hidden states to send on (its final norm is an
        identity); a tensor rank's forward all-reduces and needs the process group.

    Raises:
        UnsupportedArchitectureError: no family file for the checkpoint's architecture, or
            a structure the family file does not describe.
        ValueError: indivisible heads for tensor parallelism, missing or mis-shaped
            tensors, an unknown weight dtype or a quantized one off CPU.
    """
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"unknown weight dtype {weight_dtype!r}; expected one of {WEIGHT_DTYPES}")
    if weight_dtype != "float32" and device.type != "cpu":
        raise ValueError(f"weight dtype {weight_dtype} is only supported on CPU")
    config = model_config(model_dir)
    architecture = config_architecture(config)
    family = family_for_architecture(architecture)
    model = empty_model(config)
    if type(model).__name__ not in family.architectures:
        raise UnsupportedArchitectureError(
            f"{architecture}: its text model is {type(model).__name__}, which the "
            f"{family.name} family file does not describe"
        )
    # MoE blocks hold one linear per expert, named as checkpoints store them (`moe.py`);
    # MXFP4 experts stay MXFP4 (`quant/mxfp4.py`).
    expert_format = _expert_format(config, family)
    install_routed_experts(model, family, expert_format)
    transform = engine_transform(shard.sharding)
    transform.cut(model, family, shard)
    text_config = model.config.get_text_config()
    prefix = family.checkpoint_prefix(architecture)
    fused: FusedExperts | None = None
    if family.moe is not None and family.moe.fused_checkpoint is not None:
        experts = family.moe.routing(text_config).experts
        fused = FusedExperts(family.moe, experts, mxfp4=expert_format == "mxfp4")
    groups = _plan_tensors(model_dir, prefix, shard, _model_entries(model), family, fused)
    fp8 = Fp8Checkpoint.of(config, model_dir)  # FP8 block weights widen as they are read
    if getattr(text_config, "tie_word_embeddings", False):
        _plan_tied_lm_head(model_dir, prefix, model, groups, family)
    layers: Any = model.model.layers
    quantize = device.type == "cpu" and weight_dtype != "float32"
    if on_layer_loaded is not None:
        on_layer_loaded(0, len(layers))

    def read(handle_for: Callable[[Path], Any], path: Path, name: str, target: str) -> None:
        reader = transform.tensor_reader(family, text_config, target, shard)
        if split_repacked_name(name) is not None:
            held = weight_dtype if quantize else "float32"
            loaded = load_repacked(model, handle_for(path), name, target, reader, held)
            if loaded is None:  # a quantized module now holds it
                return
            tensor = loaded
        else:
            stored = fp8.widen(handle_for, name, handle_for(path).get_slice(name))
            if fused is not None and fused.stacks(name):
                stored = fused.cut(name, target, stored)  # one expert of a stacked tensor
            tensor = reader(stored)
        # A copy: a view would keep the file's whole memory map alive (and resident).
        # Float tensors as float32; integer ones (MXFP4 blocks and scales) as stored.
        dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
        _assign_tensor(model, target, tensor.to(device=device, dtype=dtype, copy=True))

    unlayered = groups.get(None, [])
    embedding_here = not isinstance(getattr(model.model, "embed_tokens", None), AbsentModule)
    with _open_files() as handle_for:
        for path, name, target in unlayered:
            if embedding_here or target != EMBEDDING:
                read(handle_for, path, name, target)
        _fill_tied_lm_head(model, lambda *entry: read(handle_for, *entry), unlayered)
    if quantize:
        head = _stored_head(model, unlayered)
        with _open_files() as handle_for:
            split = head is not None and split_output_layer(model, handle_for(head[0]), head[1])
        if not split:
            quantize_output_layer(model, weight_dtype)
        release_freed_memory()
    if transform.split_output_layer(model, shard):
        release_freed_memory()
    set_linears = 0
    for index, layer in enumerate(layers):
        # One layer's memory maps at a time; in a MoE layer, one expert's, each expert
        # quantized once read (its float32 copy and its file pages released before the next).
        planned = sorted(groups.get(index, []), key=_expert_order)
        for _, batch in itertools.groupby(planned, key=_expert_order):
            with _open_files() as handle_for:
                for path, name, target in batch:
                    read(handle_for, path, name, target)
            if quantize:
                _quantize_read_expert(layer, target, weight_dtype)
        _check_loaded(layer, f"decoder layer {index}", model_dir, shard)
        if quantize:
            quantize_linears(layer, weight_dtype)
            release_freed_memory()
        # Before the lean forward fuses them.
        set_linears += set_prefill_activations(layer, prefill_activations)
        if on_layer_loaded is not None:
            on_layer_loaded(index + 1, len(layers))
    _check_loaded(model, "the model", model_dir, shard)
    _report_prefill_activations(prefill_activations, set_linears)
    torch.nn.Module.to(model, device)  # non-persistent buffers (rotary frequencies)
    if device.type == "cpu":
        fuse_rms_norms(model, family.rms_norms)
    model.eval()
    model.requires_grad_(False)
    enable_lean_forward(model, family)
    return model


def _expert_format(config: Any, family: ModelFamily) -> ExpertFormat:
    """ "mxfp4" for a checkpoint whose `quantization_config.quant_method` is "mxfp4" (gpt-oss:
    its experts stored as MXFP4 blocks), else "float".

    Raises:
        UnsupportedArchitectureError: MXFP4 for a family whose checkpoints do not stack
            their experts.
    """
    quantization = getattr(config.get_text_config(), "quantization_config", None) or getattr(
        config, "quantization_config", None
    )
    if quantization is None:
        return "float"
    method = (
        quantization.get("quant_method")
        if isinstance(quantization, dict)
        else getattr(quantization, "quant_method", None)
    )
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    if method != "mxfp4":
        return "float"  # other methods are read (or refused) where their tensors are
    if family.moe is None or family.moe.fused_checkpoint is None:
        raise UnsupportedArchitectureError(
            f"quantization_config.quant_method='mxfp4' for the {family.name} family, whose "
            "checkpoints have no MXFP4 experts"
        )
    return "mxfp4"


# A routed expert's tensor on this rank: (its module's path in the layer, the expert id).
_EXPERT_TENSOR = re.compile(r"^model\.layers\.\d+\.((?:.+\.)?experts\.(\d+))\.")


def _expert_order(planned: PlannedTensor) -> int:
    """Sort key: a layer's other tensors first, then each expert's together, by expert id."""
    match = _EXPERT_TENSOR.match(planned[2])
    return -1 if match is None else int(match.group(2))


def _quantize_read_expert(layer: nn.Module, target: str, weight_dtype: WeightDtype) -> None:
    """Quantize an expert as soon as its last tensor is read: a MoE layer is then held in
    float32 one expert at a time, not whole (Qwen3-235B-A22B's 128 experts are 9.7 GB of
    float32 per layer, one of them 75 MB)."""
    match = _EXPERT_TENSOR.match(target)
    if match is None:
        return
    expert = layer.get_submodule(match.group(1))
    if not any(parameter.is_meta for parameter in expert.parameters()):
        quantize_linears(expert, weight_dtype)


def _report_prefill_activations(activations: PrefillActivations, linears: int) -> None:
    """Say in the log how prefill rounds activations when int8 or bf16 was asked for, or why
    it changes nothing here (no AVX2 integer GEMM, no linear held in exo's block formats;
    for bf16, no AMX-BF16)."""
    if activations == "int16":
        return
    if not ROUNDS_ACTIVATIONS or native_int4_kernel() is None or linears == 0:
        logger.warning(
            f"--prefill-activations {activations} has no effect here: it needs exo's AVX2 "
            "kernels and int4 / GGUF block weights (prefill rounds activations as decode does)"
        )
        return
    if activations == "bf16" and not bf16_prefill_available():
        logger.warning(
            "--prefill-activations bf16 needs AMX-BF16 (and exo's kernels built for it): "
            "prefill rounds activations to int16 here, as decode does"
        )
        return
    logger.info(f"prefill rounds activations to {activations} in {linears} linears (decode: int16)")


# Weight-only int4 (group 32) decodes a few times faster than float32 on CPU with greedy
# output close to float32's (figures: docs/benchmarks/engine-design-figures.md#enginepy);
# CUDA keeps float32 (the quantized kernels used here are the CPU ones).
DEFAULT_CPU_WEIGHT_DTYPE: WeightDtype = ENGINE_CPU_WEIGHT_FORMAT


def _configure_cpu_threads() -> None:
    """Keep torch's default (one intra-op thread per physical core, or OMP_NUM_THREADS) but
    never more threads than CPUs this process may run on: oversubscribed OpenMP threads
    spin-wait on each other and decode several times slower."""
    if "OMP_NUM_THREADS" in os.environ or not hasattr(os, "sched_getaffinity"):
        return
    allowed = max(1, len(os.sched_getaffinity(0)))
    if torch.get_num_threads() > allowed:
        torch.set_num_threads(allowed)


def _eos_token_ids(model_dir: Path, tokenizer: Any, model: PreTrainedModel) -> frozenset[int]:
    """Every token that ends generation: the tokenizer's, the model config's and the
    generation config's EOS, and the stop tokens of the model's own chat format
    (`format_stop_token_ids`: harmony's `<|call|>` and `<|return|>`)."""
    ids: set[int] = set(format_stop_token_ids(tokenizer))
    candidates: list[Any] = [tokenizer.eos_token_id, model.config.get_text_config().eos_token_id]
    with contextlib.suppress(OSError):  # no generation_config.json
        candidates.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    for candidate in candidates:
        if isinstance(candidate, int):
            ids.add(candidate)
        elif isinstance(candidate, list | tuple):
            ids.update(int(item) for item in candidate)
    if not ids:
        raise ValueError(f"{model_dir}: neither the tokenizer nor the config names an EOS token")
    return frozenset(ids)


@dataclass(slots=True)
class LoadedParts:
    """What every engine needs after loading: the (quantized) model and its tokenizer."""

    model: PreTrainedModel
    tokenizer: Any
    device: torch.device
    weight_dtype: WeightDtype
    eos_token_ids: frozenset[int]


def load_parts(
    model_dir: Path,
    shard: ShardMetadata,
    device: str,
    weight_dtype: WeightDtype | None,
    on_layer_loaded: LayerProgressCallback | None = None,
    prefill_activations: PrefillActivations = DEFAULT_PREFILL_ACTIVATIONS,
) -> LoadedParts:
    """Load the shard's model (whole or one rank's part; quantized and fused on CPU while
    loading, see `loading.load_model`) and the tokenizer: what every engine needs.

    Raises:
        UnsupportedArchitectureError (a ValueError): no family file for the model.
        ValueError: an unknown `weight_dtype`, a quantized one on a non-CPU device,
            or missing tensors.
    """
    torch_device = torch.device(device)
    if weight_dtype is None:
        weight_dtype = DEFAULT_CPU_WEIGHT_DTYPE if torch_device.type == "cpu" else "float32"
    if torch_device.type == "cpu":
        _configure_cpu_threads()
    model = load_model(
        model_dir, shard, torch_device, weight_dtype, on_layer_loaded, prefill_activations
    )
    # A tokenizer without a chat template is a base model's: it serves raw prompts only.
    # Kimi's TikToken tokenizer is built from its data files, never its code.
    tokenizer = load_tokenizer(model_dir)
    eos_token_ids = _eos_token_ids(model_dir, tokenizer, model)
    return LoadedParts(model, tokenizer, torch_device, weight_dtype, eos_token_ids)
