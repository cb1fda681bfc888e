"""The OpenAI server's settings: what its command line (server.py) gives each worker's app."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class OpenAISettings:
    triton_url: str  # host:port of Triton's gRPC endpoint
    # host:port of Triton's HTTP endpoint: generation requests then go over HTTP generate_stream
    # (cheaper per streamed response in Python than gRPC, triton_http.py); None: over gRPC.
    triton_http_url: str | None = None
    api_keys: tuple[str, ...] = ()  # none: no key needed
    health_model: str = "llm"  # /health is ready when Triton and this model are
    tokenizer_dirs: dict[str, Path] = field(default_factory=dict)  # model -> checkpoint dir (chat, echo)
    default_tokenizer_dir: Path | None = None
    max_body_bytes: int = 16 << 20
    # "auto": sampling parameters a request leaves unset take the checkpoint's generation_config.json
    # values (vLLM's default); "vllm": the engine's defaults (temperature 1, no top_p / top_k)
    generation_config: str = "auto"
    # With several worker processes: each writes its figures here every second, and /metrics in
    # any of them answers the sum.
    metrics_dir: Path | None = None
    chat_template: str | None = None  # --chat-template: the template text every model's chats use
    # Tool calling and reasoning, as vLLM's flags of the same names (tool_parsers.py, reasoning.py)
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    # LoRA adapter name -> the Triton model that serves it: a request whose `model` is the adapter
    # goes to that model with sampling parameter lora_name set (vLLM's --lora-modules convention)
    lora_adapters: dict[str, str] = field(default_factory=dict)
    # /v1/load_lora_adapter and /v1/unload_lora_adapter (to health_model), and a request for a model
    # Triton does not serve tried as an adapter of health_model (another worker may have loaded it)
    allow_runtime_lora_updates: bool = False

    def target(self, model: str) -> tuple[str, str | None]:
        """(the Triton model, the LoRA adapter or None) a request's `model` names."""
        parent = self.lora_adapters.get(model)
        return (model, None) if parent is None else (parent, model)

    def to_json(self) -> str:
        return json.dumps(
            {
                "triton_url": self.triton_url,
                "triton_http_url": self.triton_http_url,
                "api_keys": list(self.api_keys),
                "health_model": self.health_model,
                "tokenizer_dirs": {k: str(v) for k, v in self.tokenizer_dirs.items()},
                "default_tokenizer_dir": str(self.default_tokenizer_dir)
                if self.default_tokenizer_dir
                else None,
                "max_body_bytes": self.max_body_bytes,
                "generation_config": self.generation_config,
                "metrics_dir": str(self.metrics_dir) if self.metrics_dir else None,
                "chat_template": self.chat_template,
                "tool_call_parser": self.tool_call_parser,
                "enable_auto_tool_choice": self.enable_auto_tool_choice,
                "reasoning_parser": self.reasoning_parser,
                "lora_adapters": self.lora_adapters,
                "allow_runtime_lora_updates": self.allow_runtime_lora_updates,
            }
        )

    @staticmethod
    def from_json(text: str) -> OpenAISettings:
        data = json.loads(text)
        return OpenAISettings(
            triton_url=data["triton_url"],
            triton_http_url=data.get("triton_http_url"),
            api_keys=tuple(data["api_keys"]),
            health_model=data["health_model"],
            tokenizer_dirs={k: Path(v) for k, v in data["tokenizer_dirs"].items()},
            default_tokenizer_dir=Path(data["default_tokenizer_dir"])
            if data["default_tokenizer_dir"]
            else None,
            max_body_bytes=data["max_body_bytes"],
            generation_config=data.get("generation_config", "auto"),
            metrics_dir=Path(data["metrics_dir"]) if data["metrics_dir"] else None,
            chat_template=data.get("chat_template"),
            tool_call_parser=data.get("tool_call_parser"),
            enable_auto_tool_choice=data.get("enable_auto_tool_choice", False),
            reasoning_parser=data.get("reasoning_parser"),
            lora_adapters=dict(data.get("lora_adapters", {})),
            allow_runtime_lora_updates=data.get("allow_runtime_lora_updates", False),
        )
