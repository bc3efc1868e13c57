"""The CUDA IPC handle crosses from the judge to its workers as hex and goes back to the driver
as 64 bytes by value. It runs on CPU: the packing is plain ctypes, and its one bug so far (a
handle cut at its first NUL byte, which every CUDA evaluation then failed on) showed only on a
GPU."""

import ctypes
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "skills"))
import cuda_agent_harness as h  # noqa: E402


def test_every_byte_of_the_handle_reaches_the_driver():
    raw = bytes(range(1, 9)) + b"\0" + bytes(range(10, 65))  # a NUL early, as real handles have
    handle = h.ipc_handle_struct(raw.hex())
    assert ctypes.sizeof(handle) == 64
    assert ctypes.string_at(ctypes.addressof(handle), 64) == raw


def test_a_handle_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError):
        h.ipc_handle_struct("00" * 63)
