"""What the product runs around tritonserver: `paged-llm serve` (cli/serve.py) and `make serve-triton`
(launch.py) build on it. Modules:
  launch.py         the tritonserver command line and environment, ports, `python -m ... serve`
  repository.py     copies of the model repository template with overridden engine settings
  supervise.py      running tritonserver supervised: signals, restarts, exit status
  stub_watch.py     the Python-backend stubs below a server, and which of them died
  guard_process.py  starting the HTTP guard (http_guard.py) in front of Triton's HTTP and metrics ports
  triton_args.py    tritonserver's own reading of its options
  private_files.py  the umask 077 / seccomp wrapper tritonserver runs under
  shm_regions.py    the stubs' shared-memory regions, removed once unused
  procfs.py         /proc reading (descendants, process groups)
"""
