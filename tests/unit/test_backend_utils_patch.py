"""Our copy of Triton's triton_python_backend_utils.py serializes BYTES tensors faster, to the same
bytes as the original (the stub calls it for every BYTES output of every response)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from paged_llm.launcher.launch import prepare_backend_dir


@pytest.fixture(scope="module")
def utils():
    path = prepare_backend_dir() / "python" / "triton_python_backend_utils.py"
    spec = importlib.util.spec_from_file_location("patched_backend_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "array",
    [
        np.array([b" hello"], dtype=np.object_),
        np.array([b"a", b"", "caf\u00e9", 12, 1.5], dtype=np.object_),
        np.array([[b"x", b"yy"], [b"zzz", "\u4e16"]], dtype=np.object_),
        np.array([[b"x", b"yy"], [b"zzz", b"w"]], dtype=np.object_).T,  # not C-contiguous
        np.array([b"ab", b"c\x00"], dtype=np.bytes_),  # not an object array: the original runs
    ],
)
def test_fast_path_gives_the_original_bytes(utils, array):
    assert utils.serialize_byte_tensor(array) == utils._nditer_serialize_byte_tensor(array)


def test_empty_arrays_keep_the_original_answer(utils):
    empty = np.array([], dtype=np.object_)
    assert utils.serialize_byte_tensor(empty) == utils._nditer_serialize_byte_tensor(empty) == ()
