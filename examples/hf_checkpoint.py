"""Hugging Face checkpoint files with numpy only: the safetensors reader the
pipeline example uses for the parts of a model layerserve does not run, and
the writer the two checkpoint commands (gguf_to_hf.py, random_checkpoint.py)
write with (the Python tests write their checkpoints with it too).

A .safetensors file is an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets}} (offsets relative to the end of the
header), then the tensors' bytes. bfloat16 has no numpy type: it is kept as
uint16 bit patterns and widened to float32 exactly.
"""

import json
import struct
from pathlib import Path

import numpy as np

# Stored dtype -> little-endian numpy dtype of its bytes (BF16 as bit patterns).
_STORED = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}
# The dtypes the writer writes, and the bytes of each (F8_E4M3: the
# float8_e4m3fn bit patterns it is given).
_WRITTEN = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F8_E4M3": "u1"}


def bf16_bits_to_f32(bits):
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x):
    """float32 -> bfloat16 bit patterns, rounding to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_safetensors(path, tensors, dtype="F32", dtypes=None):
    """Writes {name: float array} to `path` as one .safetensors file, every
    tensor in `dtype` ("F32", "F16" or "BF16", rounded to nearest even) or in
    the one `dtypes` maps its name to; an "F8_E4M3" tensor is given as its
    float8_e4m3fn bit patterns (uint8)."""
    kinds = {name: (dtypes or {}).get(name, dtype) for name in tensors}
    unknown = sorted({dtype, *kinds.values()} - set(_WRITTEN))
    if unknown:
        raise ValueError(f"cannot write dtype {', '.join(unknown)}")
    for name in tensors:
        if kinds[name] == "F8_E4M3" and np.asarray(tensors[name]).dtype != np.uint8:
            raise ValueError(f"{name}: F8_E4M3 is written from its bit patterns (uint8)")
    header, offset = {}, 0
    for name in sorted(tensors):
        shape = [int(d) for d in np.shape(tensors[name])]
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(_WRITTEN[kinds[name]]).itemsize
        header[name] = {"dtype": kinds[name], "shape": shape,
                        "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # keeps the data section 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in sorted(tensors):
            if kinds[name] == "BF16":
                blob = f32_to_bf16_bits(tensors[name]).astype("<u2")
            else:
                blob = np.ascontiguousarray(tensors[name], dtype=_WRITTEN[kinds[name]])
            f.write(blob.tobytes())


class Checkpoint:
    """The tensors of a Hugging Face checkpoint directory: model.safetensors,
    or the shards model.safetensors.index.json names. Tensors are
    memory-mapped, so only the rows read are loaded. Errors are SystemExit
    with a line naming the file (the examples are commands)."""

    def __init__(self, model_dir):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (self.dir / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise SystemExit(f"{self.dir}: no model.safetensors or model.safetensors.index.json")
        self.entries = {}  # name -> (path, dtype, shape, absolute offset, bytes)
        for file in files:
            path = self.dir / file
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            size = path.stat().st_size
            data_start = 8 + header_len
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                dtype, shape = entry["dtype"], [int(d) for d in entry["shape"]]
                begin, end = entry["data_offsets"]
                if dtype not in _STORED:
                    raise SystemExit(f"{path}: tensor {name} has dtype {dtype}; "
                                     f"this reader knows {', '.join(_STORED)}")
                nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_STORED[dtype]).itemsize
                if end - begin != nbytes or data_start + end > size:
                    raise SystemExit(f"{path}: tensor {name}: data_offsets {begin}..{end} do not "
                                     f"hold {dtype}{shape} inside the file")
                self.entries[name] = (path, dtype, shape, data_start + begin, nbytes)

    def __contains__(self, name):
        return name in self.entries

    def names(self):
        return sorted(self.entries)

    def raw(self, name):
        """The stored array (memory-mapped; BF16 as uint16 bit patterns)."""
        if name not in self.entries:
            raise SystemExit(f"{self.dir}: the checkpoint has no tensor {name}")
        path, dtype, shape, offset, nbytes = self.entries[name]
        if nbytes == 0:
            return np.zeros(shape, dtype=_STORED[dtype])
        return np.memmap(path, dtype=_STORED[dtype], mode="r", offset=offset, shape=tuple(shape))

    def dtype(self, name):
        return self.entries[name][1]

    def float32(self, name, rows=None):
        """The tensor (or the given rows of it) as float32."""
        values = self.raw(name)
        if rows is not None:
            values = values[np.asarray(rows)]
        if self.dtype(name) == "BF16":
            return bf16_bits_to_f32(values)
        return np.asarray(values, dtype=np.float32)
