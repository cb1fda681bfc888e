"""Masking logits with a packed token bitmask (structured output): bit t of a row's int32 words
(word t // 32, bit t % 32) allows token t; every other token's logit becomes -inf.

On CUDA one Triton kernel writes the -inf in place (a 64-row step of a 152k vocabulary: the plain
torch version's temporaries cost ~0.3 ms of device time there, a tenth of a Qwen3-0.6B decode step).
Elsewhere plain torch, so it runs wherever the sampler does: the bitmask's bytes index a 256 x 8
table of their bits, one bool per token (B x V bytes of temporaries, only on steps with a
constrained row)."""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the plain torch version
    triton = None

WORDS_PER_PROGRAM = 64  # 2048 tokens a program
ARGMAX_TOKENS_PER_PROGRAM = 4096  # masked_argmax: a 64-row step of a 152k vocabulary is 64 x 38 programs

if triton is not None:

    @triton.jit
    def _apply_bitmask_kernel(
        logits_ptr, bitmask_ptr, logits_stride, bitmask_stride, vocab_size, num_words,
        WORDS: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        words = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
        packed = tl.load(bitmask_ptr + row * bitmask_stride + words, mask=words < num_words, other=-1)
        bits = tl.arange(0, 32)
        blocked = ((packed[:, None] >> bits[None, :]) & 1) == 0  # [WORDS, 32]
        tokens = words[:, None] * 32 + bits[None, :]
        tl.store(
            logits_ptr + row * logits_stride + tokens, float("-inf"), mask=blocked & (tokens < vocab_size)
        )

    @triton.jit
    def _masked_argmax_partial_kernel(
        logits_ptr, bitmask_ptr, max_ptr, index_ptr, logits_stride, bitmask_stride, vocab_size,
        num_chunks, TOKENS: tl.constexpr,
    ):  # fmt: skip
        # Each program: the largest allowed logit of one row's chunk of TOKENS tokens, and its first
        # index (blocked tokens count as -inf, as the masked logits would).
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        tokens = chunk * TOKENS + tl.arange(0, TOKENS)
        in_vocab = tokens < vocab_size
        logits = tl.load(logits_ptr + row * logits_stride + tokens, mask=in_vocab, other=float("-inf"))
        words = tl.load(bitmask_ptr + row * bitmask_stride + tokens // 32, mask=in_vocab, other=0)
        allowed = ((words >> (tokens % 32)) & 1) != 0
        values = tl.where(allowed & in_vocab, logits.to(tl.float32), float("-inf"))
        best = tl.argmax(values, axis=0, tie_break_left=True)
        tl.store(max_ptr + row * num_chunks + chunk, tl.max(values, axis=0))
        tl.store(index_ptr + row * num_chunks + chunk, chunk * TOKENS + best)


_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def _byte_bits(device: torch.device) -> torch.Tensor:
    table = _BYTE_BITS.get(device)
    if table is None:
        values = torch.arange(256, dtype=torch.int32).unsqueeze(1)
        table = ((values >> torch.arange(8, dtype=torch.int32)) & 1).bool().to(device)
        _BYTE_BITS[device] = table
    return table


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Sets logits[r, t] to -inf where bit t of bitmask[r] is 0, in place. `logits` [B, V] float;
    `bitmask` [B, ceil(V / 32)] int32 on the same device (little-endian words: byte k of word w
    holds tokens 32w + 8k .. 32w + 8k + 7)."""
    num_rows, vocab_size = logits.shape
    assert bitmask.dtype == torch.int32 and bitmask.shape[0] == num_rows
    assert bitmask.shape[1] * 32 >= vocab_size, "the bitmask covers fewer tokens than the logits"
    if num_rows == 0:
        return logits
    if triton is not None and logits.is_cuda and logits.stride(1) == 1:
        bitmask = bitmask.contiguous()
        num_words = -(-vocab_size // 32)
        grid = (num_rows, triton.cdiv(num_words, WORDS_PER_PROGRAM))
        _apply_bitmask_kernel[grid](
            logits,
            bitmask,
            logits.stride(0),
            bitmask.stride(0),
            vocab_size,
            num_words,
            WORDS=WORDS_PER_PROGRAM,
        )
        return logits
    return apply_token_bitmask_torch_(logits, bitmask)


def apply_token_bitmask_torch_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """apply_token_bitmask_ in plain torch (any device)."""
    num_rows, vocab_size = logits.shape
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [B, W * 4]
    allowed = _byte_bits(logits.device)[as_bytes.long()].view(num_rows, -1)[:, :vocab_size]
    return logits.masked_fill_(~allowed, -math.inf)


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """[B] int64: each row's argmax among the tokens its bitmask allows (the greedy token under a
    grammar; the same as the Sampler's masked float32 argmax: ties go to the lowest token).
    `logits` stay untouched. On CUDA one Triton pass over the logits (masked_argmax_triton)."""
    if triton is not None and logits.is_cuda and logits.stride(1) == 1:
        return masked_argmax_triton(logits, bitmask)
    masked = logits.clone(memory_format=torch.contiguous_format)
    return apply_token_bitmask_(masked, bitmask).argmax(dim=-1)


def masked_argmax_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """masked_argmax in one read of the logits (the torch version copies them, masks the copy and
    reads it again: ~3x the bytes of a c64 step's 19 MB of bf16 logits), then a reduction over the
    rows' chunk maxima. Any device Triton runs on (the interpreter on CPU, for tests)."""
    assert triton is not None, "needs triton"
    num_rows, vocab_size = logits.shape
    assert bitmask.dtype == torch.int32 and bitmask.shape[0] == num_rows
    assert bitmask.shape[1] * 32 >= vocab_size, "the bitmask covers fewer tokens than the logits"
    assert logits.stride(1) == 1, "the vocabulary must be contiguous"
    bitmask = bitmask.contiguous()
    num_chunks = triton.cdiv(vocab_size, ARGMAX_TOKENS_PER_PROGRAM)
    chunk_max = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_index = torch.empty(num_rows, num_chunks, dtype=torch.int64, device=logits.device)
    if num_rows:
        _masked_argmax_partial_kernel[(num_rows, num_chunks)](
            logits,
            bitmask,
            chunk_max,
            chunk_index,
            logits.stride(0),
            bitmask.stride(0),
            vocab_size,
            num_chunks,
            TOKENS=ARGMAX_TOKENS_PER_PROGRAM,
        )
    # The first chunk holding a row's maximum holds its first maximal token (chunks go in order).
    best_chunk = chunk_max.argmax(dim=1, keepdim=True)
    return chunk_index.gather(1, best_chunk).view(num_rows)
