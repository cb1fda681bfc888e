"""Counter-based sampling noise: u(seed, position, token_index) in (0, 1), computed batched on the device.

A sampled token must depend only on its own request (seed, how many tokens it generated so far), never
on which other rows share the batch, their order or the device's global RNG. So instead of drawing from
a stateful generator, every (row, token) pair hashes its coordinates:

* on the host, once per row and step: a 32-bit row key = SplitMix64(seed + (position + 1) * golden64),
  the top 32 bits; SplitMix64 is a strong 64-bit mixer, so nearby seeds and positions get unrelated keys;
* on the device, per vocabulary entry: the murmur3 32-bit finalizer (fmix32) of
  row_key + token_index * golden32 (mod 2**32), i.e. a Weyl sequence fed through a full-avalanche
  bijection, so the noises of one row are distinct and look independent.

The device lanes are int32 tensors: torch's integer add/multiply wrap modulo 2**32 on CPU and CUDA, and
right shifts (arithmetic on int32) are masked to make them logical. `uniform_noise_reference` is the
same function in plain Python; the tests compare both so that a backend that stopped wrapping is caught.
"""

from __future__ import annotations

import torch

_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: the SplitMix64 increment
_GOLDEN32 = 0x9E3779B9  # 2**32 / golden ratio: spreads consecutive token indices over the 32-bit ring
_FMIX_MUL_1 = 0x85EBCA6B  # murmur3 fmix32 constants
_FMIX_MUL_2 = 0xC2B2AE35
_MANTISSA_BITS = 23  # u = (2m + 1) / 2**24 with m < 2**23: exact in float32 and never 0 or 1
_MANTISSA_MASK = (1 << _MANTISSA_BITS) - 1
_UNIFORM_SCALE = 2.0 ** -(_MANTISSA_BITS + 1)


def _as_int32(value: int) -> int:
    """The signed int32 with the same 32-bit pattern as the unsigned `value` (what torch stores)."""
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def _splitmix64_finalize(value: int) -> int:
    value &= _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def row_noise_key(seed: int, position: int) -> int:
    """Unsigned 32-bit key of one row's noise at one output position (host side, once per row)."""
    return _splitmix64_finalize((seed & _MASK64) + (position + 1) * _GOLDEN64) >> 32


def row_noise_key_int32(seed: int, position: int) -> int:
    """`row_noise_key` as the signed value an int32 tensor holds."""
    return _as_int32(row_noise_key(seed, position))


def _fmix32_reference(value: int) -> int:
    value &= _MASK32
    value ^= value >> 16
    value = (value * _FMIX_MUL_1) & _MASK32
    value ^= value >> 13
    value = (value * _FMIX_MUL_2) & _MASK32
    return value ^ (value >> 16)


def uniform_noise_reference(seed: int, position: int, token_index: int) -> float:
    """Plain-Python u(seed, position, token_index); the specification `uniform_noise` must match."""
    hashed = _fmix32_reference(row_noise_key(seed, position) + token_index * _GOLDEN32)
    mantissa = (hashed >> (32 - _MANTISSA_BITS)) & _MANTISSA_MASK
    return (2 * mantissa + 1) * _UNIFORM_SCALE


def _fmix32_(lanes: torch.Tensor) -> torch.Tensor:
    """murmur3 fmix32 in place on int32 lanes; masks turn the arithmetic shifts into logical ones."""
    lanes ^= (lanes >> 16) & 0xFFFF
    lanes *= _as_int32(_FMIX_MUL_1)
    lanes ^= (lanes >> 13) & 0x7FFFF
    lanes *= _as_int32(_FMIX_MUL_2)
    lanes ^= (lanes >> 16) & 0xFFFF
    return lanes


def uniform_noise(row_keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 noise in (0, 1) from [B] int32 row keys (see `row_noise_key_int32`).

    Values are odd multiples of 2**-24, so `log(u)` and `log(-log(u))` are always finite.
    """
    token_offsets = torch.arange(vocab_size, dtype=torch.int32, device=row_keys.device)
    token_offsets *= _as_int32(_GOLDEN32)  # wraps modulo 2**32, like the reference
    lanes = row_keys.to(torch.int32).unsqueeze(1) + token_offsets.unsqueeze(0)
    _fmix32_(lanes)
    # The top 24 bits with the lowest forced to 1: 2 * (top 23 bits) + 1, as in the reference.
    odd_numerators = ((lanes >> (31 - _MANTISSA_BITS)) & ((1 << (_MANTISSA_BITS + 1)) - 1)) | 1
    return odd_numerators.to(torch.float32).mul_(_UNIFORM_SCALE)


def exponential_noise(row_keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 Exp(1) draws, -log(u): argmax(probs / E) samples from probs (exponential race)."""
    return uniform_noise(row_keys, vocab_size).log_().neg_()
