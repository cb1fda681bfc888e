"""Llama-family decoder (Llama 2/3, Qwen2, Qwen3) over a flat token batch and a paged KV cache.

The architectures differ only in flags of the ModelSpec: Qwen3 normalises each head of q and k
before RoPE (`qk_norm`), Qwen2 has q/k/v biases, Llama 3 scales RoPE frequencies. The numerics
follow HF transformers step by step (float32 RMSNorm, rotate-half RoPE) so greedy outputs match.
q/k/v and gate/up projections are fused into one matmul each; the loader fills the slices.

The residual stream is carried next to the hidden states so that "add the residual, then
normalise" is one fused op (`FusedOps.rms_norm`), as are q/k-norm + RoPE and SiLU * up: on CUDA
each is one Triton kernel instead of a handful of eager launches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from paged_llm.layers.attention.metadata import AttentionMetadata
from paged_llm.layers.fp8_format import E4M3
from paged_llm.layers.fp8_linear import new_group_scales
from paged_llm.layers.fused_ops import FusedOps
from paged_llm.layers.parallel import ShardPlan, TensorParallelGroup
from paged_llm.lora.slots import LayerLoRA, LoRASlots
from paged_llm.models.hf_config import ModelSpec, RopeSpec


class AttentionBackend(Protocol):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    """Holds the weight; the math is `FusedOps.rms_norm` (fused with the residual add)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


def rope_inv_freq(head_dim: int, rope: RopeSpec) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.scaling_type != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_freq_wavelen = rope.original_max_position / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to `max_positions`, looked up by position id."""

    def __init__(self, head_dim: int, rope: RopeSpec, max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        self.max_positions = max_positions
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)

    def build(self, device: torch.device, dtype: torch.dtype) -> None:
        inv_freq = rope_inv_freq(self.head_dim, self.rope).to(device)
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # Computed in float32 and cast to the activation dtype, as HF does.
        self.cos_sin = torch.stack((emb.cos(), emb.sin())).to(dtype).contiguous()  # [2, positions, D]


def weight_scale_of(linear: nn.Linear) -> torch.Tensor | None:
    """An FP8 projection's float32 row scales (keep_fp8_projections), else None."""
    return linear._buffers.get("weight_scale")  # not nn.Module.__getattr__: on every call


def project(ops: FusedOps, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """`linear` of `x` through the model's linear op (FP8 weights with their scales)."""
    return ops.linear(x, linear.weight, linear.bias, weight_scale=weight_scale_of(linear))


class Attention(nn.Module):
    """This rank's query and KV heads (all of them without tensor parallelism)."""

    def __init__(
        self,
        spec: ModelSpec,
        backend: AttentionBackend,
        ops: FusedOps,
        shard: ShardPlan | None = None,
        parallel: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        shard = shard or ShardPlan.of(spec)
        self.ops = ops
        self.parallel = parallel or TensorParallelGroup()
        self.eps = spec.rms_norm_eps
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = shard.num_heads * spec.head_dim
        self.kv_size = shard.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim**-0.5
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=False)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.backend = backend
        # The RoPE kernel writes the step's keys and values to the cache, the backend only reads it
        # (where the ops have that kernel: read per call, FusedOps.pytorch_ops() swaps them).
        self.backend_reads_kv_written_in_rope = getattr(backend, "kv_write_in_rope", False)
        # An FP8 KV cache holds keys / values divided by these (the checkpoint's, else 1.0: the loader)
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.lora: LayerLoRA | None = None  # set by attach_lora; active in steps with adapter rows

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        norm: RMSNorm,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention output, the residual stream): `norm` is the layer's input norm, applied to
        hidden + residual together with the QKV projection (one kernel for a one-row batch)."""
        lora = self.lora if self.lora is not None and self.lora.active else None
        if lora is not None:  # the adapters read the normalised input: no fused norm + projection
            normed, residual = self.ops.rms_norm(hidden, norm.weight, norm.eps, residual)
            qkv = lora.add("qkv_proj", normed, project(self.ops, normed, self.qkv_proj))
        else:
            qkv, residual = self.ops.norm_linear(
                hidden, residual, norm.weight, norm.eps, self.qkv_proj.weight, self.qkv_proj.bias,
                weight_scale=weight_scale_of(self.qkv_proj),
            )  # fmt: skip
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q_weight = self.q_norm.weight if self.q_norm is not None else None
        k_weight = self.k_norm.weight if self.k_norm is not None else None
        # The fused RoPE kernel writes a cache in the model dtype only; an FP8 one the backend writes.
        fused_write = kv_cache[0].dtype != E4M3
        if (
            fused_write
            and self.backend_reads_kv_written_in_rope
            and self.ops.qk_norm_rope_write_kv is not None
        ):
            k_cache, v_cache = kv_cache
            q = self.ops.qk_norm_rope_write_kv(
                q, k, v, q_weight, k_weight, self.eps, rotary.cos_sin, positions, k_cache, v_cache,
                metadata.slot_mapping,
            )  # fmt: skip
            out = self.backend.attend(q, k_cache, v_cache, metadata, self.scale)
        else:
            q, k = self.ops.qk_norm_rope(q, k, q_weight, k_weight, self.eps, rotary.cos_sin, positions)
            out = self.backend.forward(
                q,
                k,
                v,
                kv_cache[0],
                kv_cache[1],
                metadata,
                self.scale,
                k_scale=self.k_scale,
                v_scale=self.v_scale,
            )
        attended = out.reshape(-1, self.q_size)
        out = self.ops.linear(attended, self.o_proj.weight, weight_scale=weight_scale_of(self.o_proj))
        if lora is not None:
            out = lora.add("o_proj", attended, out)
        return self.parallel.all_reduce(out), residual


class MLP(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        ops: FusedOps,
        shard: ShardPlan | None = None,
        parallel: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        shard = shard or ShardPlan.of(spec)
        self.ops = ops
        self.parallel = parallel or TensorParallelGroup()
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * shard.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shard.intermediate_size, spec.hidden_size, bias=False)
        self.lora: LayerLoRA | None = None  # as Attention.lora

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, the residual stream): `norm` (post-attention) is applied with gate/up."""
        if self.lora is not None and self.lora.active:
            return self._forward_with_lora(self.lora, hidden, residual, norm)
        gate_up, residual = self.ops.norm_linear(
            hidden, residual, norm.weight, norm.eps, self.gate_up_proj.weight,
            weight_scale=weight_scale_of(self.gate_up_proj),
        )  # fmt: skip
        out = self.ops.silu_mul_linear(gate_up, self.down_proj.weight, weight_scale_of(self.down_proj))
        return self.parallel.all_reduce(out), residual

    def _forward_with_lora(
        self, lora: LayerLoRA, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = self.ops.rms_norm(hidden, norm.weight, norm.eps, residual)
        gate_up = lora.add("gate_up_proj", normed, project(self.ops, normed, self.gate_up_proj))
        activated = self.ops.silu_and_mul(gate_up)
        out = lora.add("down_proj", activated, project(self.ops, activated, self.down_proj))
        return self.parallel.all_reduce(out), residual


class DecoderLayer(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        backend: AttentionBackend,
        ops: FusedOps,
        shard: ShardPlan | None = None,
        parallel: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, backend, ops, shard, parallel)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec, ops, shard, parallel)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the next layer adds
        them. HF's `h = h + attn(norm(h)); h = h + mlp(norm(h))` in the same order of operations."""
        hidden, residual = self.self_attn(
            positions, hidden, residual, self.input_layernorm, kv_cache, metadata, rotary
        )
        return self.mlp(hidden, residual, self.post_attention_layernorm)


class CausalLM(nn.Module):
    """The whole model, or one tensor-parallel rank's share of it (`parallel`, layers/parallel.py)."""

    def __init__(
        self,
        spec: ModelSpec,
        backend: AttentionBackend,
        max_positions: int,
        ops: FusedOps | None = None,
        parallel: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.ops = ops or FusedOps(use_triton=False)
        self.parallel = parallel or TensorParallelGroup()
        self.shard = ShardPlan.of(spec, self.parallel.rank, self.parallel.world_size)
        vocab_rows = self.shard.vocab_rows if self.parallel.is_parallel else spec.vocab_size
        # An uninitialised table: the loader copies the checkpoint's in. Embedding's own N(0, 1) init
        # on the meta device runs through torch._refs, whose first use imports torch._dynamo (~2.5 s
        # of every engine start on a CPU, for numbers nobody reads).
        self.embed_tokens = nn.Embedding(
            vocab_rows, spec.hidden_size, _weight=torch.empty(vocab_rows, spec.hidden_size)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(spec, backend, self.ops, self.shard, self.parallel) for _ in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = (
            None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, vocab_rows, bias=False)
        )
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope, max_positions)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.parallel.embed(input_ids, self.embed_tokens.weight, self.shard.vocab_start)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata, self.rotary)
        return self.ops.rms_norm(hidden, self.norm.weight, self.norm.eps, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.parallel.gather_vocab(self.ops.lm_head_linear(hidden, weight), self.spec.vocab_size)


def projections(model: CausalLM) -> Iterator[tuple[str, nn.Linear]]:
    """(name, module) of every decoder layer's four projections (q/k/v and gate/up fused)."""
    for index, layer in enumerate(model.layers):
        yield f"layers.{index}.self_attn.qkv_proj", layer.self_attn.qkv_proj
        yield f"layers.{index}.self_attn.o_proj", layer.self_attn.o_proj
        yield f"layers.{index}.mlp.gate_up_proj", layer.mlp.gate_up_proj
        yield f"layers.{index}.mlp.down_proj", layer.mlp.down_proj


def attach_lora(model: CausalLM, slots: LoRASlots) -> None:
    """Gives every decoder layer's attention and MLP its view of `slots`: a step whose rows
    `slots.set_step` gave adapters adds their updates to the projections."""
    for index, layer in enumerate(model.layers):
        layer.self_attn.lora = layer.mlp.lora = LayerLoRA(slots, index)


def keep_fp8_projections(model: CausalLM, block_scaled: bool = False) -> None:
    """Gives every projection an FP8 weight and a float32 `weight_scale` buffer [out] (one scale a
    row), or with `block_scaled` [out, ceil(in / 128)] (a scale a row and 128 columns), as
    layers/fp8_linear.py reads them, on the model's device and uninitialised (the loader fills
    both). After any dtype cast of the model: a cast would turn the FP8 weights into the model dtype."""
    for _, linear in projections(model):
        weight = linear.weight
        linear.weight = nn.Parameter(
            torch.empty(weight.shape, dtype=E4M3, device=weight.device), requires_grad=False
        )
        if block_scaled:
            scale = new_group_scales(weight.shape[0], weight.shape[1], weight.device)
        else:
            scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
        linear.register_buffer("weight_scale", scale)
