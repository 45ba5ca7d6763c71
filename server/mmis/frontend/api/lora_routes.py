"""vLLM's runtime LoRA routes (issue 47): ``POST /v1/load_lora_adapter`` ``{lora_name,
lora_path}`` and ``POST /v1/unload_lora_adapter`` ``{lora_name}`` (``lora_int_id`` is accepted
and ignored: P0 assigns ids, ``client/lora.py``).

Invariants:
- The routes exist only with ``--allow-runtime-lora-updating`` (vLLM registers them only under
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: without it they are a 404), and are behind the API key
  like every ``/v1`` route (``http_gate.py``).
- The answers are vLLM's: 200 with the text ``Success: LoRA adapter '<name>' added
  successfully.`` / ``... removed successfully.``; an adapter that cannot be loaded (rank over
  the limit, missing or corrupt files, target modules the model lacks, a name already loaded or
  the base model's) is a 400 whose message is the engine's cause, and every other adapter keeps
  being served; unloading an unknown name is a 404 (``model_not_found``); unloading one that a
  live request uses is a 409 (vLLM has no such check; mmis's engine refuses it).
- Both are answered by the engine, the source of truth shared by every ``--api-servers``
  sibling: an adapter loaded through one P0 is served by all of them.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import Field

from mmis.frontend.api.schemas import parse_request
from mmis.frontend.api.schemas.common import OpenAIModel
from mmis.frontend.client.lora import LoRAAdapterError
from mmis.frontend.config import FrontendConfig
from mmis.frontend.state import FrontendState


class LoadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1, description="the name requests use as `model`")
    lora_path: str = Field(min_length=1, description="a PEFT adapter directory on the server")
    lora_int_id: int | None = Field(None, description="ignored (vLLM's; the server assigns ids)")


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def install_lora_routes(app: FastAPI, settings: FrontendConfig) -> None:
    """Add the two routes to ``app`` when ``--allow-runtime-lora-updating`` is on."""
    if not settings.allow_runtime_lora_updating:
        return
    served = set(settings.served_names)

    @app.post("/v1/load_lora_adapter", include_in_schema=False)
    async def load_lora_adapter(request: Request) -> Response:
        body = parse_request(LoadLoRAAdapterRequest, await request.body())
        if body.lora_name in served:
            raise LoRAAdapterError(
                f"{body.lora_name!r} names the served base model", param="lora_name"
            )
        state: FrontendState = request.app.state.mmis
        await state.lora.load(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", include_in_schema=False)
    async def unload_lora_adapter(request: Request) -> Response:
        body = parse_request(UnloadLoRAAdapterRequest, await request.body())
        state: FrontendState = request.app.state.mmis
        await state.lora.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
