"""Reads a tritonserver 2.51 argument list the way tritonserver does, so that the launcher's checks
see what the server will act on.

tritonserver parses its arguments with glibc's `getopt_long(argc, argv, "", ...)`:

* `--name=value` or `--name value` (an option that takes a value takes the next argument, even one
  that starts with `-`); `--name` alone for the two options without a value;
* `name` may be any unique prefix of an option (`--model-control=explicit`); an exact name wins over
  longer ones that it prefixes; a prefix of several options is an error (ambiguous);
* arguments that are not options are skipped over and make the server refuse to start, as does any
  short option (`-x`); `--` ends the options;
* every option is read in order, so for a single-valued option the last one wins.

`parse` returns the (name, value) pairs in order, with full option names, or raises TritonArgError
where tritonserver would refuse to start.
"""

from __future__ import annotations

from collections.abc import Sequence

# tritonserver 2.51's options (`tritonserver --help`), each True if it takes a value.
_NO_VALUE = frozenset({"help", "disable-auto-complete-config"})
OPTION_NAMES: tuple[str, ...] = (
    "help", "id", "exit-timeout-secs", "log-verbose", "log-info", "log-warning", "log-error",
    "log-format", "log-file", "model-store", "model-repository", "exit-on-error",
    "disable-auto-complete-config", "strict-readiness", "model-control-mode", "repository-poll-secs",
    "load-model", "model-config-name", "model-load-thread-count", "model-load-retry-count",
    "model-namespacing", "enable-peer-access", "allow-http", "http-address", "http-port",
    "reuse-http-port", "http-header-forward-pattern", "http-thread-count", "http-restricted-api",
    "allow-grpc", "grpc-address", "grpc-port", "reuse-grpc-port", "grpc-header-forward-pattern",
    "grpc-infer-allocation-pool-size", "grpc-use-ssl", "grpc-use-ssl-mutual", "grpc-server-cert",
    "grpc-server-key", "grpc-root-cert", "grpc-infer-response-compression-level",
    "grpc-keepalive-time", "grpc-keepalive-timeout", "grpc-keepalive-permit-without-calls",
    "grpc-http2-max-pings-without-data", "grpc-http2-min-recv-ping-interval-without-data",
    "grpc-http2-max-ping-strikes", "grpc-max-connection-age", "grpc-max-connection-age-grace",
    "grpc-restricted-protocol", "allow-sagemaker", "sagemaker-port", "sagemaker-safe-port-range",
    "sagemaker-thread-count", "allow-vertex-ai", "vertex-ai-port", "vertex-ai-thread-count",
    "vertex-ai-default-model", "allow-metrics", "allow-gpu-metrics", "allow-cpu-metrics",
    "metrics-address", "metrics-port", "metrics-interval-ms", "metrics-config", "trace-config",
    "backend-directory", "backend-config", "repoagent-directory", "cache-config", "cache-directory",
    "rate-limit", "rate-limit-resource", "pinned-memory-pool-byte-size", "cuda-memory-pool-byte-size",
    "cuda-virtual-address-size", "min-supported-compute-capability", "buffer-manager-thread-count",
    "host-policy", "model-load-gpu-limit", "strict-model-config", "response-cache-byte-size",
    "trace-file", "trace-level", "trace-rate", "trace-count", "trace-log-frequency",
)  # fmt: skip

# The APIs (HTTP) / protocols (gRPC) that --http-restricted-api / --grpc-restricted-protocol name.
RESTRICTABLE_APIS = frozenset(
    {
        "health", "metadata", "inference", "shared-memory", "model-config", "model-repository",
        "statistics", "trace", "logging",
    }
)  # fmt: skip


class TritonArgError(ValueError):
    """tritonserver would refuse to start with these arguments."""


def resolve_name(written: str) -> str:
    """The option `--written` names: itself, or the one option it is a prefix of."""
    if written in OPTION_NAMES:
        return written
    matches = [name for name in OPTION_NAMES if name.startswith(written)]
    if not written or not matches:
        raise TritonArgError(f"unrecognized tritonserver option '--{written}'")
    if len(matches) > 1:
        raise TritonArgError(f"tritonserver option '--{written}' is ambiguous: {', '.join(matches)}")
    return matches[0]


def parse(args: Sequence[str]) -> list[tuple[str, str | None]]:
    options: list[tuple[str, str | None]] = []
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        if arg == "--":
            if index < len(args):
                raise TritonArgError(f"tritonserver takes no arguments besides options: {args[index]!r}")
            break
        if not arg.startswith("--"):
            what = "short options" if arg.startswith("-") and arg != "-" else "arguments besides options"
            raise TritonArgError(f"tritonserver takes no {what}: {arg!r}")
        written, has_value, value = arg[2:].partition("=")
        name = resolve_name(written)
        if name in _NO_VALUE:
            if has_value:
                raise TritonArgError(f"tritonserver option '--{name}' takes no value")
            options.append((name, None))
            continue
        if not has_value:
            if index >= len(args):
                raise TritonArgError(f"tritonserver option '--{name}' needs a value")
            value = args[index]
            index += 1
        options.append((name, value))
    return options


def values(options: list[tuple[str, str | None]], name: str) -> list[str]:
    return [value for option, value in options if option == name and value is not None]


def last_value(options: list[tuple[str, str | None]], name: str, default: str | None = None) -> str | None:
    found = values(options, name)
    return found[-1] if found else default


def parse_bool(value: str, name: str) -> bool:
    """A boolean option's value, as tritonserver reads one."""
    lowered = value.lower()
    if lowered in ("true", "on", "1"):
        return True
    if lowered in ("false", "off", "0"):
        return False
    raise TritonArgError(f"tritonserver option '--{name}': {value!r} is not a boolean")


def restricted_apis(options: list[tuple[str, str | None]], name: str) -> dict[str, tuple[str, str]]:
    """The APIs `--http-restricted-api` / `--grpc-restricted-protocol` restrict, each with its
    (header key, value). Each flag reads `<api>,<api>:<key>=<value>`; flags add up, an API named in
    two of them or an unknown one is an error, as in tritonserver."""
    restricted: dict[str, tuple[str, str]] = {}
    for value in values(options, name):
        apis, colon, setting = value.partition(":")
        key, equals, secret = setting.partition("=")
        if not (colon and equals and apis and key and secret):
            raise TritonArgError(f"--{name} reads <apis>:<key>=<value>, got {value!r}")
        for api in apis.split(","):
            if api not in RESTRICTABLE_APIS:
                raise TritonArgError(f"--{name}: unknown API {api!r}")
            if api in restricted:
                raise TritonArgError(f"--{name}: API {api!r} named in two restrictions")
            restricted[api] = (key, secret)
    return restricted
