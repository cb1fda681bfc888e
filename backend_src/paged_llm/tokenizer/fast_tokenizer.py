"""The stub's tokenizer: the checkpoint's `tokenizer.json` through the `tokenizers` library alone.

Why not transformers' AutoTokenizer: it runs in Triton's stub, which needs numpy < 2, and
a current transformers imports scikit-learn and SciPy on the way to AutoTokenizer, which need
numpy >= 2 (seen on the GPU hosts). `tokenizers` needs neither numpy nor torch, and for a
`tokenizer.json` checkpoint it is what AutoTokenizer's fast tokenizer runs underneath; the tests
check that both give the same ids, text and pieces.

It offers the part of HF's tokenizer interface that paged_llm uses (encode, decode, pieces, special
ids, length) with HF's meaning; `load_tokenizer` falls back to AutoTokenizer for checkpoints
without a tokenizer.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class FastTokenizer:
    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        self.name_or_path = str(model_dir)
        self.backend_tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        # Special tokens as HF marks them: the added tokens flagged special (tokenizer.json), plus
        # those tokenizer_config.json flags.
        added = self.backend_tokenizer.get_added_tokens_decoder()
        special = {token_id for token_id, token in added.items() if token.special}
        for token_id, entry in self.config.get("added_tokens_decoder", {}).items():
            if entry.get("special"):
                special.add(int(token_id))
        self.added_tokens_decoder = added
        self.all_special_ids = sorted(special)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added (what a prompt becomes)."""
        return self._encode(text, add_special_tokens=False)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        """HF-style: `tokenizer(text)["input_ids"]`."""
        return {"input_ids": self._encode(text, add_special_tokens)}

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not): a megabyte of prompt takes
        # about a second to tokenize, and every other thread of the stub must keep running meanwhile.
        return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False, **_: Any) -> str:
        """HF's decode with clean_up_tokenization_spaces=False (what paged_llm always uses)."""
        return self.backend_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.backend_tokenizer.id_to_token(int(token_id))

    def convert_tokens_to_ids(self, tokens: list[str]) -> list[int | None]:
        return [self.backend_tokenizer.token_to_id(token) for token in tokens]

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


def load_stub_tokenizer(model_dir: Path) -> Any:
    """FastTokenizer where the checkpoint has a tokenizer.json; else HF's AutoTokenizer."""
    if (Path(model_dir) / "tokenizer.json").is_file():
        return FastTokenizer(model_dir)
    from paged_llm.tokenizer.hf_tokenizer import load_tokenizer

    return load_tokenizer(model_dir)
