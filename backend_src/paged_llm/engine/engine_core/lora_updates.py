"""LoRA adapters loaded and unloaded while the core serves (`allow_runtime_lora_updates`).

An unloaded adapter leaves the names a request may give at once (new requests for it are
refused, naming `lora_name`); the sequences that run or wait with it finish with it, and it is
forgotten (its slot free for another) once none is left."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from paged_llm.engine.core_types import EngineCoreInfo
from paged_llm.errors import InvalidRequestError
from paged_llm.lora.adapter import LoRAAdapterError
from paged_llm.lora.manager import LoRAManager
from paged_llm.sampling_params import MAX_LORA_NAME_CHARS
from paged_llm.sequence import Sequence


class LoRAUpdates:
    def __init__(
        self,
        manager: LoRAManager | None,
        allowed: bool,
        info: EngineCoreInfo,
        live_sequences: Callable[[], Iterable[Sequence]],
        forget_kv: Callable[[str], None] = lambda name: None,
    ) -> None:
        """`forget_kv(name)`: drops the KV computed with an adapter being forgotten that an adapter
        loaded later under the same name could find (its sessions'; the prefix cache keys blocks
        by the load, Sequence.lora_load_id)."""
        self.manager = manager
        self.allowed = allowed
        self.info = info  # its lora_names are kept up to date here
        self.live_sequences = live_sequences
        self.forget_kv = forget_kv
        self.unloading: set[str] = set()

    def load(self, name: str, path: str) -> tuple[str, ...]:
        """Adds adapter `name` from `path`; returns the names requests may give now."""
        manager = self._manager()
        if not name or len(name) > MAX_LORA_NAME_CHARS or any(c.isspace() or c in ",=" for c in name):
            raise InvalidRequestError(
                "lora_name",
                f"an adapter's name has 1..{MAX_LORA_NAME_CHARS} characters, no spaces, ',' or '='",
            )
        if name in self.unloading:
            raise InvalidRequestError(
                "lora_name", f"LoRA adapter {name!r} is being unloaded; load it again once its requests ended"
            )
        if name in manager.names:
            raise InvalidRequestError("lora_name", f"LoRA adapter {name!r} is loaded already")
        try:
            manager.add(name, Path(path))
        except (LoRAAdapterError, OSError, ValueError) as error:
            raise InvalidRequestError("lora_path", str(error)) from None
        return self._publish()

    def unload(self, name: str) -> tuple[str, ...]:
        """Refuses new requests for `name` from now; it goes once its sequences ended."""
        manager = self._manager()
        if name not in manager.names or name in self.unloading:
            raise InvalidRequestError("lora_name", f"LoRA adapter {name!r} is not loaded")
        self.unloading.add(name)
        self.forget_unused()
        return self._publish()

    def forget_unused(self) -> None:
        """Forgets the unloaded adapters no live sequence uses any more (after each step)."""
        if not self.unloading or self.manager is None:
            return
        in_use = {seq.sampling_params.lora_name for seq in self.live_sequences()}
        for name in sorted(self.unloading - in_use):
            self.manager.remove(name)
            self.forget_kv(name)
            self.unloading.discard(name)

    def _publish(self) -> tuple[str, ...]:
        assert self.manager is not None
        self.info.lora_names = tuple(n for n in self.manager.names if n not in self.unloading)
        return self.info.lora_names

    def _manager(self) -> LoRAManager:
        if self.manager is None or not self.allowed:
            raise InvalidRequestError(
                "lora_name",
                "this server does not load or unload LoRA adapters while serving "
                "(allow_runtime_lora_updates is off)",
            )
        return self.manager
