"""A GGUF container reader: the metadata key/values and the tensor index, with each tensor's
data as a view of the memory-mapped file (nothing is copied).

It offers the part of gguf-py's GGUFReader folio uses (`fields[key].contents()`, `tensors`
with name / tensor_type / shape / n_elements / n_bytes / data_offset / data, laid out as
gguf-py lays them), and parses the metadata with `struct` over one buffer. gguf-py builds a
numpy view per value: the default model's 49,152-token vocabulary and its merges took ~2 s of
its ~6 s start on this project's 2-core machine; this reader reads them in a few tens of
milliseconds. Little-endian files only (what llama.cpp writes)."""
from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# GGUF value types (gguf's GGUFValueType): struct formats of the scalar ones.
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, \
    _UINT64, _INT64, _FLOAT64 = range(13)
_SCALAR = {_UINT8: "<B", _INT8: "<b", _UINT16: "<H", _INT16: "<h", _UINT32: "<I",
           _INT32: "<i", _FLOAT32: "<f", _BOOL: "<?", _UINT64: "<Q", _INT64: "<q",
           _FLOAT64: "<d"}
_NUMPY = {_UINT8: np.uint8, _INT8: np.int8, _UINT16: np.uint16, _INT16: np.int16,
          _UINT32: np.uint32, _INT32: np.int32, _FLOAT32: np.float32, _BOOL: np.bool_,
          _UINT64: np.uint64, _INT64: np.int64, _FLOAT64: np.float64}
# Tensor types stored as plain numbers (gguf-py gives these their dtype, the rest bytes).
_PLAIN_TENSORS = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                  "I16": np.int16, "I32": np.int32, "I64": np.int64}


class GGUFField:
    """One metadata value: `types` as gguf-py lists them ([type] or [ARRAY, item type]), and
    the value itself (str, a number, or a list)."""
    __slots__ = ("name", "types", "_value")

    def __init__(self, name: str, types: list[int], value: Any) -> None:
        self.name, self.types, self._value = name, types, value

    def contents(self) -> Any:
        return self._value


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: Any            # gguf.GGMLQuantizationType
    shape: np.ndarray           # GGUF order (innermost first), as gguf-py gives it
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray            # a view of the file: the dtype for plain types, else bytes


class GGUFFile:
    def __init__(self, path: str) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.data = np.memmap(path, mode="r")
        buf = memoryview(self.data)
        self._buf = buf
        if bytes(buf[:4]) != _MAGIC:
            raise ValueError("GGUF magic invalid")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (big-endian file, or "
                             f"not one of {list(_VERSIONS)})")
        tensor_count, kv_count = struct.unpack_from("<QQ", buf, 8)
        offs = 24
        self.fields: dict[str, GGUFField] = {}
        for _ in range(kv_count):
            key, offs = self._string(offs)
            (kind,) = struct.unpack_from("<I", buf, offs)
            value, types, offs = self._value(offs + 4, kind)
            self.fields[key] = GGUFField(key, types, value)
        infos = []
        for _ in range(tensor_count):
            name, offs = self._string(offs)
            (n_dims,) = struct.unpack_from("<I", buf, offs)
            dims = np.frombuffer(buf, np.uint64, n_dims, offs + 4).copy()
            offs += 4 + 8 * n_dims
            kind, offset = struct.unpack_from("<IQ", buf, offs)
            offs += 12
            infos.append((name, dims, kind, offset))
        alignment = _DEFAULT_ALIGNMENT
        field = self.fields.get("general.alignment")
        if field is not None:
            alignment = field.contents()
            if field.types != [_UINT32] or alignment <= 0 or alignment & (alignment - 1):
                raise ValueError("general.alignment must be a power of two (uint32)")
        self.data_offset = offs + (-offs) % alignment
        self.tensors: list[GGUFTensor] = []
        seen: set[str] = set()
        for name, dims, kind, offset in infos:
            if name in seen:
                raise ValueError(f"duplicated tensor {name}")
            seen.add(name)
            ggml_type = GGMLQuantizationType(kind)
            n_elems = int(np.prod(dims, dtype=np.int64))
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            n_bytes = n_elems * type_size // block_size
            start = self.data_offset + offset
            np_dims = tuple(int(d) for d in reversed(dims.tolist()))
            plain = _PLAIN_TENSORS.get(ggml_type.name)
            if plain is not None:
                data = self._array(start, plain, n_elems).reshape(np_dims)
            else:
                if np_dims[-1] % block_size:
                    raise ValueError(f"tensor {name}: row of {np_dims[-1]} is not a multiple "
                                     f"of {ggml_type.name}'s block of {block_size}")
                byte_dims = (*np_dims[:-1], np_dims[-1] // block_size * type_size)
                data = self._array(start, np.uint8, n_bytes).reshape(byte_dims)
            self.tensors.append(GGUFTensor(name, ggml_type, dims, n_elems, n_bytes, start,
                                           data))

    def _array(self, offset: int, dtype: Any, count: int) -> np.ndarray:
        end = offset + count * np.dtype(dtype).itemsize
        if end > len(self.data):
            raise ValueError(f"data at {offset} runs past the end of the file")
        return self.data[offset:end].view(dtype)

    def _string(self, offs: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._buf, offs)
        start = offs + 8
        if start + length > len(self._buf):
            raise ValueError(f"string at {offs} runs past the end of the file")
        return str(self._buf[start:start + length], "utf-8"), start + length

    def _value(self, offs: int, kind: int) -> tuple[Any, list[int], int]:
        """(value, gguf-py's type list, offset after it)."""
        buf = self._buf
        if kind == _STRING:
            value, offs = self._string(offs)
            return value, [kind], offs
        fmt = _SCALAR.get(kind)
        if fmt is not None:
            (value,) = struct.unpack_from(fmt, buf, offs)
            return value, [kind], offs + struct.calcsize(fmt)
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item_kind, count = struct.unpack_from("<IQ", buf, offs)
        offs += 12
        if item_kind in _NUMPY:
            dtype = np.dtype(_NUMPY[item_kind]).newbyteorder("<")
            end = offs + count * dtype.itemsize
            if end > len(buf):
                raise ValueError(f"array at {offs} runs past the end of the file")
            return np.frombuffer(buf, dtype, count, offs).tolist(), [kind, item_kind], end
        items, types = [], [kind, item_kind]
        if item_kind == _STRING:
            unpack, decode = struct.unpack_from, str
            for _ in range(count):
                (length,) = unpack("<Q", buf, offs)
                offs += 8
                items.append(decode(buf[offs:offs + length], "utf-8"))
                offs += length
            if offs > len(buf):
                raise ValueError("string array runs past the end of the file")
            return items, types, offs
        for _ in range(count):  # arrays of arrays
            item, sub_types, offs = self._value(offs, item_kind)
            items.append(item)
        return items, types + sub_types[1:], offs
