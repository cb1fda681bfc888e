"""A small Llama-2-style (SentencePiece) tokenizer built in memory, for the tokenizer tests: "▁" for
spaces, <0xNN> byte fallback, and a decoder that strips the text's leading space."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, normalizers
from tokenizers.models import Unigram
from transformers import PreTrainedTokenizerFast


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    pieces += [(f"<0x{byte:02X}>", -10.0) for byte in range(256)]
    words = [*"▁ ▁▁ ▁Hello ▁world Hello world ▁the ▁a a b c e l o ▁foo ! é 世 ▁世界 界".split(), "\n", "\t"]
    pieces += [(word, -1.0 - 0.01 * index) for index, word in enumerate(words)]
    backend = Tokenizer(Unigram(pieces, unk_id=0, byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
