"""LoRA adapters on the service's side: the models ListModels and Info name, and the
run-time loads and unloads (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter,
behind the API key like every RPC)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ..engine.adapters import AdapterRegistry
from ..errors import ErrorType
from ..intake.validation import BASE_MODEL_ALIASES
from ..models.lora import AdapterError, LoraAdapter
from ..processes.cpus import in_own_thread
from ..proto import text_generation_service_pb2 as svc_pb
from .errors import abort

NAME = re.compile(r"^[\w.\-/:@]+$")  # as --lora-adapters' names (settings/table.py)


@dataclass
class LoraServing:
    """What the servicer needs of the LoRA adapters."""

    registry: AdapterRegistry
    # (name, folder or Hub id) -> the adapter read and checked for the served model, on a
    # worker thread; None: no load at run time, for the reason in `refusal`
    read: Callable[[str, str], LoraAdapter] | None
    refusal: str = ""
    on_load: Callable[[str], None] = lambda name: None  # metrics
    on_unload: Callable[[str], None] = lambda name: None


class LoraRpcs:
    """Mixed into TextGenerationServicer (uses its `lora`, `served` and `request`)."""

    lora: LoraServing | None

    def adapter_names(self) -> list[str]:
        return [a.name for a in self.lora.registry.serving()] if self.lora else []

    def model_cards(self) -> list[svc_pb.Model]:
        """The base model, then every served adapter (vLLM's `root` and `parent`)."""
        base = self.served.info.model_id
        cards = [self._card(base, root=base)]
        if self.lora is not None:
            cards += [
                self._card(a.name, root=a.source, parent=base) for a in self.lora.registry.serving()
            ]
        return cards

    def _card(self, name: str, **fields) -> svc_pb.Model:
        return svc_pb.Model(
            id=name, object="model", created=self.served.created, owned_by="textgen", **fields
        )

    async def LoadLoraAdapter(self, request, context):
        name, path = request.lora_name.strip(), request.lora_path.strip()
        await self._check_name(context, name)
        if not path:
            await _refuse(context, "`lora_path` is required", "lora_path")
        if self.lora.read is None:
            await _refuse(context, self.lora.refusal, "lora_path")
        if self.lora.registry.lookup(name) is not None:
            await _refuse(context, f"a LoRA adapter named {name!r} is already loaded", "lora_name")
        try:
            adapter = await in_own_thread(self.lora.read, name, path)
            self.lora.registry.add(adapter)
        except (AdapterError, ValueError) as exc:
            await _refuse(context, str(exc), "lora_path")
        self.lora.on_load(name)
        return self._answer(f"Success: LoRA adapter '{name}' added successfully.")

    async def UnloadLoraAdapter(self, request, context):
        name = request.lora_name.strip()
        await self._check_name(context, name)
        adapter = self.lora.registry.unload(name)
        if adapter is None:
            await _refuse(context, f"no LoRA adapter named {name!r} is loaded", "lora_name")
        self.lora.on_unload(name)
        running = self.lora.registry.in_use(adapter.uid)
        note = f" ({running} running requests finish with it)" if running else ""
        return self._answer(f"Success: LoRA adapter '{name}' removed successfully.{note}")

    async def _check_name(self, context, name: str) -> None:
        if self.lora is None or self.lora.registry.max_loras == 0:
            await _refuse(
                context,
                "this server has no LoRA slots: start it with --lora-adapters or --max-loras N",
                "lora_name",
            )
        if not name:
            await _refuse(context, "`lora_name` is required", "lora_name")
        if not NAME.match(name) or name in BASE_MODEL_ALIASES or name == self.served.info.model_id:
            await _refuse(
                context,
                f"`lora_name` {name!r} can't name an adapter: letters, digits and . _ - / : @ "
                "only, and not the base model's name",
                "lora_name",
            )

    def _answer(self, message: str) -> svc_pb.LoraAdapterResponse:
        return svc_pb.LoraAdapterResponse(message=message, lora_adapters=self.adapter_names())


async def _refuse(context, message: str, param: str) -> None:
    await abort(context, message, ErrorType.VALIDATION, param)
