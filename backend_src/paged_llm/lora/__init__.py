"""LoRA adapters (PEFT checkpoints) applied to the decoder's projections, several per batch."""
