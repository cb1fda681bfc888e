"""Copies of the package's model repository template with overridden engine settings: what
`paged-llm serve` writes before it starts tritonserver, and the `make-repository` command that tests,
benchmarks and scripts use (`python -m paged_llm.launcher.repository make-repository TARGET key=value`).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from paged_llm.paths import model_repository_template

# The TensorRT-LLM client convention: llm_trtllm (the tensorrt_llm model's outputs), and the names
# TensorRT-LLM's own clients use (ensemble / tensorrt_llm_bls, the ensemble's outputs); all forward to llm.
TRTLLM_MODEL_NAMES = ("llm_trtllm", "ensemble", "tensorrt_llm_bls")


def make_model_repository(
    target: Path,
    parameters: dict[str, str] | None = None,
    models: tuple[str, ...] = ("llm", "llm_trtllm"),
    source: Path | None = None,
    instance_count: int | None = None,
    instance_gpus: list[int] | None = None,
) -> Path:
    """Copies the models of `source` (default: the package's template) into `target`, overriding
    `parameters` of the llm model (and its instance_group count: that many Triton instances, sharing
    one engine core). `instance_gpus`: a KIND_GPU group instead, `instance_count` instances on each
    listed GPU, one engine per GPU."""
    source = source or model_repository_template()
    for name in models:
        shutil.rmtree(target / name, ignore_errors=True)  # a fresh copy each time
        shutil.copytree(source / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))
    config_path = target / "llm" / "config.pbtxt"
    if instance_gpus:
        gpus = ", ".join(str(gpu) for gpu in instance_gpus)
        group = f"instance_group [ {{ count: {instance_count or 1}, kind: KIND_GPU, gpus: [ {gpus} ] }} ]"
        config, found = re.subn(r"^instance_group \[.*\]$", group, config_path.read_text(), flags=re.M)
        if found != 1:
            raise ValueError(f"no instance_group in {config_path}")
        config_path.write_text(config)
    elif instance_count is not None:
        config, found = re.subn(
            r"instance_group \[ \{ count: \d+",
            f"instance_group [ {{ count: {instance_count}",
            config_path.read_text(),
        )
        if found != 1:
            raise ValueError(f"no instance_group count in {config_path}")
        config_path.write_text(config)
    if parameters:
        config = config_path.read_text()
        lines = [line for line in config.splitlines() if not any(f'key: "{k}"' in line for k in parameters)]
        for key, value in parameters.items():
            lines.append(f'parameters: {{ key: "{key}", value: {{ string_value: "{value}" }} }}')
        config_path.write_text("\n".join(lines) + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    """`python -m paged_llm.launcher.repository make-repository TARGET key=value ...`"""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m paged_llm.launcher.repository")
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-repository", help="copy the llm model with overridden parameters")
    make.add_argument("target", type=Path)
    make.add_argument("parameters", nargs="*", help="key=value engine settings for config.pbtxt")
    make.add_argument("--instance-count", type=int, help="Triton instances of llm (they share one core)")
    make.add_argument(
        "--instance-gpus", help="comma-separated GPU ids: a KIND_GPU instance group (one engine per GPU)"
    )
    args, rest = parser.parse_known_args(argv)  # key=value pairs may also follow the options
    if any("=" not in item for item in rest):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    parameters = dict(item.split("=", 1) for item in args.parameters + rest)
    gpus = [int(gpu) for gpu in args.instance_gpus.split(",")] if args.instance_gpus else None
    target = make_model_repository(
        args.target, parameters, models=("llm",), instance_count=args.instance_count, instance_gpus=gpus
    )
    print(target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
