"""Float32 linear layers through oneDNN on CPU (layers/cpu_linear.py) keep greedy tokens HF's, on a
random Qwen3 checkpoint wide enough (hidden 512) for every decoder matrix and the LM head to take
that path; the same engine with the path off gives the same tokens."""

from __future__ import annotations

import pytest
import torch

from paged_llm.layers.cpu_linear import onednn_linear, onednn_linear_op_exists, uses_onednn
from paged_llm.models.random_model import write_random_model
from paged_llm.sampling_params import SamplingParams
from tests.integration.conftest import HFReference, make_engine, run_to_completion

VOCAB_SIZE = 8192
NEW_TOKENS = 16

pytestmark = pytest.mark.skipif(not onednn_linear_op_exists(), reason="torch has no oneDNN linear here")


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    overrides = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 512,
        "intermediate_size": 2048,
        "num_hidden_layers": 3,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return write_random_model(
        tmp_path_factory.mktemp("wide") / "wide-qwen3",
        "qwen3-0.6b",
        dtype="float32",
        seed=5,
        config_overrides=overrides,
    )


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    lengths = (5, 23, 64, 9)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist() for n in lengths]


def test_wide_model_greedy_matches_hf_through_onednn(wide_model_dir):
    prompts = _prompts()
    reference = HFReference(wide_model_dir)
    expected = [reference.greedy(p, NEW_TOKENS) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for enable in (True, False):
        # Chunked prefill and a batch of decodes: rows M = 1..16 go through the same layers.
        engine = make_engine(
            wide_model_dir,
            num_blocks=200,
            block_size_tokens=4,
            max_num_batched_tokens=16,
            enable_onednn_linear=enable,
        )
        try:
            model = engine.core.runner.model
            assert (model.ops.linear is onednn_linear) == enable
            assert (model.ops.lm_head_linear is onednn_linear) == enable
            weights = [p for p in model.parameters() if p.dim() == 2]  # the tied LM head among them
            assert len(weights) == 1 + 3 * 4
            assert all(uses_onednn(torch.empty(1, w.shape[1]), w) for w in weights)
            results = run_to_completion(engine, prompts, params)
        finally:
            engine.shutdown()
        assert [r[0].token_ids for r in results] == expected, f"enable_onednn_linear={enable}"
