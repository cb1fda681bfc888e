"""FastTokenizer (tokenizers alone, no transformers) against HF's AutoTokenizer on the same files:
the same ids, text, pieces and special ids, for Qwen's byte-level BPE and a SentencePiece-style
tokenizer with byte fallback."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from paged_llm.models.tiny_model import ensure_tiny_model
from paged_llm.tokenizer.detokenizer import IncrementalDetokenizer
from paged_llm.tokenizer.fast_tokenizer import FastTokenizer
from tests.unit.sentencepiece_tokenizer import sentencepiece_tokenizer

TEXTS = [
    "Hello world",
    "  leading spaces and trailing  ",
    "你好，世界！ café naïve Zürich 🎉",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n\treturn {'a': [1, 2]}  # ✓\n",
    "",
]


def sentencepiece_dir(tmp_path: Path) -> Path:
    sentencepiece_tokenizer().save_pretrained(tmp_path)
    return tmp_path


@pytest.fixture(scope="module", params=["qwen", "sentencepiece"])
def model_dir(request, tmp_path_factory) -> Path:
    if request.param == "qwen":
        return ensure_tiny_model()
    return sentencepiece_dir(tmp_path_factory.mktemp("sp"))


def test_matches_hf_on_encode_decode_pieces_and_specials(model_dir):
    ours, hf = FastTokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert len(ours) == len(hf)
    assert set(ours.all_special_ids) >= set(hf.all_special_ids)
    for text in TEXTS:
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == ids == ours(text)["input_ids"]
        for skip in (False, True):
            expected = hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert ours.decode(ids, skip_special_tokens=skip) == expected
    rng = random.Random(0)
    sample = [rng.randrange(len(hf)) for _ in range(300)] + list(hf.all_special_ids)
    assert [ours.convert_ids_to_tokens(i) for i in sample] == hf.convert_ids_to_tokens(sample)
    for skip in (False, True):
        got = ours.decode(sample, skip_special_tokens=skip)
        assert got == hf.decode(sample, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_streamed_text_is_the_same_with_either_tokenizer(model_dir):
    ours, hf = FastTokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(1)
    ids = [rng.randrange(len(hf)) for _ in range(200)] + hf(TEXTS[2], add_special_tokens=False)["input_ids"]

    def streamed(tokenizer) -> str:
        detokenizer = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=True)
        return "".join(detokenizer.update([i]).text_delta for i in ids) + detokenizer.finish()

    assert streamed(ours) == streamed(hf)


def test_the_stub_imports_neither_torch_nor_transformers():
    """The stub runs with numpy < 2; a host's transformers / torch stack may need numpy >= 2."""
    code = (
        "import sys\n"
        "import paged_llm.engine.async_llm, paged_llm.triton_model.triton_codec\n"
        "import paged_llm.triton_model.metrics, paged_llm.triton_model.server_watch\n"
        "import paged_llm.triton_model.stub_process\n"
        "from paged_llm.tokenizer.fast_tokenizer import load_stub_tokenizer\n"
        f"tokenizer = load_stub_tokenizer({str(ensure_tiny_model())!r})\n"
        "assert type(tokenizer).__name__ == 'FastTokenizer'\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert completed.stdout.strip() == "[]", completed.stdout + completed.stderr
