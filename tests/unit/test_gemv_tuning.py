"""The GEMV launch table: the measured settings per kernel and (N, K) for a card, the old rule elsewhere."""

from __future__ import annotations

import json

import pytest
import torch

from paged_llm.layers import gemv_tuning
from paged_llm.layers.gemv_tuning import (
    KERNELS,
    GemvConfig,
    default_gemv_config,
    gemv_config,
    parse_section,
    parse_table,
)

CUDA = torch.device("cuda", 0)


@pytest.fixture
def table_in_env(tmp_path, monkeypatch):
    """table_in_env(text): PAGED_LLM_GEMV_TABLE names a file holding `text` (a dict: its JSON) on
    "Some GPU"; the table cache is cleared before and after."""

    def use(text) -> None:
        path = tmp_path / "table.json"
        path.write_text(text if isinstance(text, str) else json.dumps(text))
        monkeypatch.setenv(gemv_tuning.TABLE_ENV, str(path))
        monkeypatch.setattr(gemv_tuning, "_device_name", lambda index: "Some GPU")
        gemv_tuning._table_for.cache_clear()

    yield use
    gemv_tuning._table_for.cache_clear()


def test_entries_that_cannot_launch_are_dropped():
    """BLOCK_K must divide K; blocks and warps must be powers of two (Triton's aranges)."""
    configs = {
        "4096,1024": [16, 256, 8, 4],
        "1024,3072": [4, 2048, 4, 3],  # 2048 does not divide 3072
        "2048,3072": [4, 768, 4, 3],  # divides, not a power of two
        "6144,1024": [0, 1024, 4, 3],
        "8192,1024": [2, 1024, 6, 3],
    }
    assert parse_section(configs) == {(4096, 1024): GemvConfig(16, 256, 8, 4)}
    table = parse_table({"configs": {}, "norm_gemv_configs": configs, "silu_mul_gemv_configs": {}})
    assert table == {
        "gemv": {},
        "norm_gemv": {(4096, 1024): GemvConfig(16, 256, 8, 4)},
        "silu_mul_gemv": {},
        "fp8_gemv": {},
        "fp8_norm_gemv": {},
        "fp8_silu_mul_gemv": {},
    }


def test_an_unreadable_table_gives_the_default_rule(table_in_env):
    table_in_env("{not json")
    assert gemv_config(6144, 1024, CUDA) == default_gemv_config(6144, 1024)


def test_an_unknown_kernel_name_is_an_error():
    with pytest.raises(ValueError, match="unknown GEMV kernel 'norm_gemv_typo'"):
        gemv_config(4096, 1024, torch.device("cpu"), "norm_gemv_typo")


def test_cpu_and_unknown_shapes_get_the_default_rule():
    assert (
        gemv_config(4096, 1024, torch.device("cpu")) == default_gemv_config(4096, 1024) == GemvConfig(8, 256)
    )
    assert default_gemv_config(1024, 3072) == GemvConfig(4, 512)


def test_the_environment_names_a_table(table_in_env):
    table_in_env({"configs": {"6144,1024": [2, 1024, 4, 2]}})
    assert gemv_config(6144, 1024, CUDA) == GemvConfig(2, 1024, 4, 2)
    assert gemv_config(1024, 3072, CUDA) == default_gemv_config(1024, 3072)


def test_shipped_tables_parse_and_are_named_after_their_card():
    for path in gemv_tuning.TABLES_DIR.glob("*.json"):
        payload = json.loads(path.read_text())
        assert path.name == gemv_tuning.table_file_name(payload["device"])
        table = parse_table(payload)
        assert set(table) == set(KERNELS) and any(table.values())


def test_each_kernel_takes_its_own_section(table_in_env):
    """A fused kernel's entry is its own; a shape missing from its section gets the rule, not the
    plain GEMV's entry (the sweep left it out because the rule was as fast for that kernel)."""
    table_in_env(
        {
            "configs": {"6144,1024": [2, 1024, 4, 2], "1024,3072": [2, 1024, 4, 4]},
            "norm_gemv_configs": {"6144,1024": [8, 512, 4, 3]},
            "silu_mul_gemv_configs": {},
        }
    )
    assert gemv_config(6144, 1024, CUDA) == GemvConfig(2, 1024, 4, 2)
    assert gemv_config(6144, 1024, CUDA, "norm_gemv") == GemvConfig(8, 512, 4, 3)
    assert gemv_config(1024, 3072, CUDA, "silu_mul_gemv") == default_gemv_config(1024, 3072)
    assert gemv_config(1024, 3072, CUDA, "gemv") == GemvConfig(2, 1024, 4, 4)


def test_a_table_without_fused_sections_gives_them_the_plain_entries(table_in_env):
    """Tables written before the sweep timed the fused kernels (the H100's) keep their behaviour;
    the FP8 kernels, which load half the bytes, take the FP8 rule rather than 16-bit settings."""
    table_in_env({"configs": {"1024,3072": [2, 1024, 4, 4]}})
    for kernel in ("gemv", "norm_gemv", "silu_mul_gemv"):
        assert gemv_config(1024, 3072, CUDA, kernel) == GemvConfig(2, 1024, 4, 4)
    for kernel in ("fp8_gemv", "fp8_norm_gemv", "fp8_silu_mul_gemv"):
        assert gemv_config(1024, 3072, CUDA, kernel) == default_gemv_config(1024, 3072, fp8=True)


def test_the_fp8_rule_loads_the_bytes_of_the_16_bit_rule():
    """Twice the columns a load where that divides K, else the 16-bit rule; FP8 sections are their own."""
    assert default_gemv_config(4096, 4096, fp8=True) == GemvConfig(8, 1024)
    assert default_gemv_config(4096, 1024, fp8=True) == GemvConfig(8, 512)
    assert default_gemv_config(1024, 1536, fp8=True) == GemvConfig(4, 512)  # 1024 does not divide 1536
    table = parse_table(
        {"configs": {"4096,4096": [2, 512, 4, 2]}, "fp8_configs": {"4096,4096": [4, 2048, 8, 3]}}
    )
    assert table["fp8_gemv"] == {(4096, 4096): GemvConfig(4, 2048, 8, 3)}
    assert table["gemv"] == {(4096, 4096): GemvConfig(2, 512, 4, 2)}
