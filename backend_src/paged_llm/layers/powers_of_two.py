"""Powers of two for kernel launch parameters, as plain Python ints.

`triton.next_power_of_2` is a ConstexprFunction in Triton 3.6 and costs ~5 us a host call (0.3 us
here); an eager step calls it about ten times a layer (tile and block sizes of the attention, KV
write, norm/rope and GEMV launches), ~1 ms a step of 28 layers. CUDA graphs replay without Python,
so only eager steps paid it.
"""

from __future__ import annotations


def next_power_of_2(value: int) -> int:
    """The smallest power of two >= value (0 for 0), as triton.next_power_of_2."""
    return 1 << (value - 1).bit_length() if value > 0 else 0


def prev_power_of_2(value: int) -> int:
    """The largest power of two <= value (0 for 0)."""
    return 1 << (value.bit_length() - 1) if value > 0 else 0
