"""For tests, benchmarks and scripts only; nothing of the product imports it (the top layer of
tests/unit/test_import_layers.py). server_process.py: a tritonserver on free ports; bench_workload.py:
the benchmark workload and its metrics.
"""
