"""Read a GGUF file's metadata and tensors (llama.cpp's container, versions 2 and 3).

The `gguf` package's GGUFReader parses every value through numpy memmap views: for Gemma 3's
vocabulary (262,144 strings) that was 12 s of the demo's 20 s conversion on 2 cores, on a
newcomer's first start. This reads the same layout with `struct` over an mmap (a fraction of a
second) and leaves the quantization formats to the package (`gguf.dequantize`, `GGML_QUANT_SIZES`).

Layout, little-endian: "GGUF", version u32, tensor count u64, metadata count u64. Each metadata
entry: key (string), value type u32, value; a string is a u64 byte length then UTF-8; an array is
its element type u32, a u64 count, then the elements. Each tensor: name (string), dimension count
u32, dimensions u64 (the fastest-varying first), ggml type u32, offset u64 into the data section,
which starts at the next multiple of `general.alignment` (32 by default) after the tensor list.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
STRING, ARRAY = 8, 9
# Value type -> struct format of one scalar (the spec's numbering).
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
         7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


class GGUFFormatError(ValueError):
    pass


@dataclass
class GGUFTensor:
    name: str
    tensor_type: Any  # its ggml type, a gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: the fastest-varying dimension last
    data: np.ndarray  # its bytes, uint8, one row of blocks per row of the tensor (what gguf.dequantize takes)


class GGUFFile:
    """`fields`: metadata key -> value (str, int, float, bool; arrays as lists of strings or numpy
    arrays); `tensors`: in the file's order. The tensors' bytes stay mapped from the file."""

    def __init__(self, path: str | Path):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        self.path = str(path)
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self._map[:4] != MAGIC:
            raise GGUFFormatError(f"{path}: not a GGUF file")
        self._offset = 4
        self.version = self._scalar("I")
        if self.version not in (2, 3):
            raise GGUFFormatError(f"{path}: GGUF version {self.version} (big-endian, or unknown) is not supported")
        tensor_count, field_count = self._scalar("Q"), self._scalar("Q")
        self.fields: dict[str, Any] = {}
        for _ in range(field_count):
            key = self._string()
            self.fields[key] = self._value(self._scalar("I"))
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            dims = [self._scalar("Q") for _ in range(self._scalar("I"))]
            infos.append((name, dims, self._scalar("I"), self._scalar("Q")))
        alignment = int(self.fields.get("general.alignment", 32))
        start = -(-self._offset // alignment) * alignment
        data = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors: list[GGUFTensor] = []
        for name, dims, kind, offset in infos:
            if kind not in GGML_QUANT_SIZES:
                raise GGUFFormatError(f"{path}: tensor {name} has an unknown ggml type {kind}")
            kind, shape = GGMLQuantizationType(kind), tuple(int(d) for d in reversed(dims))
            byte_shape = quant_shape_to_byte_shape(shape, kind)
            begin = start + offset
            size = int(np.prod(byte_shape))
            if begin + size > len(data):
                raise GGUFFormatError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
            self.tensors.append(GGUFTensor(name, kind, shape, data[begin:begin + size].reshape(byte_shape)))

    def _scalar(self, fmt: str):
        try:
            (value,) = struct.unpack_from("<" + fmt, self._map, self._offset)
        except struct.error:
            raise GGUFFormatError(f"{self.path}: its metadata runs past the end of the file (truncated?)") from None
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("Q")
        if self._offset + length > len(self._map):
            raise GGUFFormatError(f"{self.path}: its metadata runs past the end of the file (truncated?)")
        value = self._map[self._offset:self._offset + length].decode("utf-8")
        self._offset += length
        return value

    def _value(self, kind: int):
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            item, count = self._scalar("I"), self._scalar("Q")
            if item == STRING:
                return [self._string() for _ in range(count)]
            if item not in NUMPY:
                raise GGUFFormatError(f"{self.path}: an array of value type {item} is not supported")
            try:
                values = np.frombuffer(self._map, dtype=NUMPY[item], count=count, offset=self._offset).copy()
            except ValueError:
                raise GGUFFormatError(f"{self.path}: its metadata runs past the end of the file (truncated?)") from None
            self._offset += values.nbytes
            return values
        if kind not in SCALARS:
            raise GGUFFormatError(f"{self.path}: unknown metadata value type {kind}")
        return self._scalar(SCALARS[kind])
