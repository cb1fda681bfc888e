"""Command line of the package: `paged-llm serve` (cli/serve.py)."""
