"""The tensor directory and metadata of a GGUF file, read without `gguf.GGUFReader`.

`gguf.GGUFReader` turns every metadata value into numpy views, which for a vocabulary of
~50k tokens costs seconds and ~200 MB; converting weights and reading a card need only the
scalar and string metadata, array lengths and the tensor infos.

Format (GGUF v2/v3, ggml's `docs/gguf.md`): magic "GGUF", u32 version, u64 tensor count,
u64 metadata count; each metadata entry a string key, a u32 value type and the value
(strings: u64 length + bytes; arrays: u32 element type, u64 count, elements); each tensor
info a string name, u32 dimension count, u64 dimensions (fastest first), u32 GGML type, u64
offset into the data section, which starts at the next multiple of `general.alignment`
(default 32). All little-endian.

A model may be split over several files (`<name>-00001-of-00003.gguf`, llama.cpp's
`gguf-split` and gguf-py's writer): the first holds the metadata, every part holds its own
tensors and the `split.no` / `split.count` keys. `read_gguf_model` reads them as one.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types → struct format of a scalar (8: string, 9: array).
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
# The retired GGML type id (Q4_2) Ollama's first gpt-oss blobs store MXFP4 under (Ollama's
# `fs/ggml/type.go` at its gpt-oss commit fa7776f: blocks of 32 as a scale byte + 16 bytes in
# Hugging Face's nibble order, which Ollama's loader turns into ggml's MXFP4), read under
# the type name `OLLAMA_MXFP4` (`gguf_gptoss`).
_OLLAMA_MXFP4 = 4
OLLAMA_MXFP4 = "OLLAMA_MXFP4"
# A decoder layer's tensor (`blk.N.`).
_BLOCK = re.compile(r"^blk\.(\d+)\.")
# A split GGUF's part name (gguf-py's `SHARD_NAME_FORMAT`, llama.cpp's `llama_split_path`).
_SPLIT_PART = re.compile(r"^(?P<stem>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GgufFormatError(ValueError):
    """Not a GGUF file this reader understands (named, with the reason)."""


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One tensor of the file: `shape` in GGUF order (fastest dimension first, as
    `gguf.ReaderTensor.shape`), `data` its bytes (read-only memory map, uint8)."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class GgufArray:
    """A metadata array, by its length only (its elements are skipped, not read)."""

    count: int


@dataclass(frozen=True, slots=True)
class GgufDirectory:
    """The file's architecture, its scalar and string metadata (arrays as `GgufArray`) and
    its tensors."""

    architecture: str
    tensors: tuple[GgufTensor, ...]
    metadata: dict[str, object]


class _Cursor:
    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.offset = 0

    def unpack(self, fmt: str) -> int | float | bool:
        size = struct.calcsize("<" + fmt)
        if self.offset + size > len(self.data):
            raise GgufFormatError("the file ends inside its header")
        (value,) = struct.unpack_from("<" + fmt, self.data, self.offset)
        self.offset += size
        result: int | float | bool = value
        return result

    def string(self) -> str:
        length = int(self.unpack("Q"))
        end = self.offset + length
        if end > len(self.data):
            raise GgufFormatError("the file ends inside a string")
        text = bytes(self.data[self.offset : end]).decode("utf-8", errors="replace")
        self.offset = end
        return text

    def value(self, value_type: int) -> object:
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            element_type = int(self.unpack("I"))
            count = int(self.unpack("Q"))
            if element_type in _SCALARS:  # skipped whole: nothing here needs array values
                self.offset += count * struct.calcsize("<" + _SCALARS[element_type])
            else:
                for _ in range(count):
                    self.value(element_type)
            return GgufArray(count)
        raise GgufFormatError(f"unknown metadata value type {value_type}")


def read_gguf_tensors(path: Path) -> GgufDirectory:
    """The architecture, metadata and tensors of the GGUF file at `path` (tensor data
    memory-mapped, nothing read until used).

    Raises:
        GgufFormatError: not a GGUF file, an unsupported version, a truncated header, a
            tensor of a type `gguf` does not know, or tensor data past the end of the file.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    file_map = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(file_map.data)
    if bytes(file_map[:4]) != _MAGIC:
        raise GgufFormatError(f"{path} is not a GGUF file (no GGUF magic)")
    cursor.offset = 4
    version = int(cursor.unpack("I"))
    if version not in (2, 3):
        raise GgufFormatError(f"{path}: GGUF version {version} (2 and 3 are read)")
    tensor_count = int(cursor.unpack("Q"))
    metadata_count = int(cursor.unpack("Q"))
    metadata: dict[str, object] = {}
    for _ in range(metadata_count):
        key = cursor.string()
        metadata[key] = cursor.value(int(cursor.unpack("I")))
    architecture = str(metadata.get("general.architecture", ""))
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise GgufFormatError(f"{path}: general.alignment {alignment!r} is no positive integer")
    infos: list[tuple[str, str, tuple[int, ...], int, int]] = []
    for _ in range(tensor_count):
        name = cursor.string()
        dimensions = int(cursor.unpack("I"))
        shape = tuple(int(cursor.unpack("Q")) for _ in range(dimensions))
        type_id = int(cursor.unpack("I"))
        offset = int(cursor.unpack("Q"))
        if type_id == _OLLAMA_MXFP4:
            type_name, (block_size, type_size) = (
                OLLAMA_MXFP4,
                GGML_QUANT_SIZES[GGMLQuantizationType.MXFP4],
            )
        else:
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise GgufFormatError(f"{path}: tensor {name} has unknown type {type_id}") from None
            type_name, (block_size, type_size) = qtype.name, GGML_QUANT_SIZES[qtype]
        elements = int(np.prod(shape)) if shape else 1
        infos.append((name, type_name, shape, offset, elements // block_size * type_size))
    start = -(-cursor.offset // alignment) * alignment
    tensors = []
    for name, type_name, shape, offset, size in infos:
        begin = start + offset
        if begin + size > len(file_map):
            raise GgufFormatError(f"{path}: tensor {name} runs past the end of the file")
        tensors.append(GgufTensor(name, type_name, shape, file_map[begin : begin + size]))
    return GgufDirectory(architecture, tuple(tensors), metadata)


def gguf_parts(path: Path) -> list[Path]:
    """Every file of the model whose file (or first part) is at `path`, in order: `[path]` for
    a single file, else the `-0000i-of-0000N` siblings of a split one.

    Raises:
        GgufFormatError: a part of a split model that is not its first, or a missing part.
    """
    match = _SPLIT_PART.match(path.name)
    if match is None:
        return [path]
    count = int(match.group("count"))
    if int(match.group("number")) != 1:
        raise GgufFormatError(
            f"{path} is part {int(match.group('number'))} of {count}: name part 1"
        )
    parts = [
        path.with_name(f"{match.group('stem')}-{number:05d}-of-{count:05d}.gguf")
        for number in range(1, count + 1)
    ]
    missing = [part.name for part in parts if not part.is_file()]
    if missing:
        raise GgufFormatError(f"{path} is split in {count} files; missing: {', '.join(missing)}")
    return parts


def read_gguf_model(path: Path) -> GgufDirectory:
    """The directory of the whole model at `path`: its own for a single file; for a split
    one (`gguf_parts`) the first part's metadata and every part's tensors, in part order.

    Raises:
        GgufFormatError: as `read_gguf_tensors` and `gguf_parts`, a part whose `split.no` is
            not its place or whose `split.count` differs, or a tensor in two parts.
    """
    parts = gguf_parts(path)
    if len(parts) == 1:
        return read_gguf_tensors(path)
    directories = [read_gguf_tensors(part) for part in parts]
    tensors: list[GgufTensor] = []
    names: set[str] = set()
    for index, (part, directory) in enumerate(zip(parts, directories, strict=True)):
        number, count = directory.metadata.get("split.no"), directory.metadata.get("split.count")
        if number != index or count != len(parts):
            raise GgufFormatError(
                f"{part}: split.no {number!r} / split.count {count!r}, expected "
                f"{index} / {len(parts)}"
            )
        for tensor in directory.tensors:
            if tensor.name in names:
                raise GgufFormatError(f"{part}: tensor {tensor.name} is in an earlier part too")
            names.add(tensor.name)
            tensors.append(tensor)
    first = directories[0]
    return GgufDirectory(first.architecture, tuple(tensors), first.metadata)


def decoder_tensors(tensors: Iterable[GgufTensor], layers: int) -> Iterator[GgufTensor]:
    """`tensors` but those of blocks from `layers` on (`blk.N.` with N >= layers: the MTP
    layers GLM's files keep after the decoder layers)."""
    for tensor in tensors:
        block = _BLOCK.match(tensor.name)
        if block is None or int(block.group(1)) < layers:
            yield tensor
