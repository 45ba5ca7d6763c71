"""vLLM's runtime LoRA routes and the operator's internal twins (issue 47): ``POST
/v1/load_lora_adapter`` ``{lora_name, lora_path}`` and ``POST /v1/unload_lora_adapter``
``{lora_name}`` (``lora_int_id`` is accepted and ignored: P0 assigns ids, ``client/lora.py``).

Invariants:
- The ``/v1`` routes exist only with ``--allow-runtime-lora-updating`` (vLLM registers them
  only under ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: without it they are a 404), and are behind
  the API key like every ``/v1`` route (``http_gate.py``).
- The answers are vLLM's: 200 with the text ``Success: LoRA adapter '<name>' added
  successfully.`` / ``... removed successfully.``; an adapter that cannot be loaded (rank over
  the limit, missing or corrupt files, target modules the model lacks, a name already loaded or
  the base model's) is a 400 whose message is the engine's cause, and every other adapter keeps
  being served; unloading an unknown name is a 404 (``model_not_found``); unloading one that a
  live request uses is a 409 (vLLM has no such check; mmis's engine refuses it).
- The operator's twins, ``POST /internal/load_lora_adapter`` and
  ``/internal/unload_lora_adapter`` (same bodies, same answers), exist whatever
  ``--allow-runtime-lora-updating`` says, behind the internal token like every
  ``/internal/*`` route and on ``--ops-port`` when set (``http_gate.py``), and reconcile
  (``LoRARegistry.ensure_loaded`` / ``ensure_unloaded``): loading a name the engine holds from
  the same path is a 200 (``... already loaded.``), from another path a 409
  ``lora_already_loaded``; unloading a name it does not hold is a 200 (``... not loaded.``).
  On a server whose engine runs without ``--enable-lora`` they answer a 400 saying so.
  Like the ``/v1`` pair they are left out of the OpenAPI document (vLLM's routes, not the
  OpenAI API).
- ``lora_path`` is a directory on the server or a hub id ``hf://<org>/<name>[@<revision>]``
  that P0 downloads first (``client/lora_hub.py``); a malformed or unreachable one is a 400
  naming the cause.
- Both pairs have one handler each (``load`` / ``unload`` below) and are answered by the
  engine, the source of truth shared by every ``--api-servers`` sibling: an adapter loaded
  through one P0 is served by all of them.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import Field

from mmis.frontend.api.schemas import parse_request
from mmis.frontend.api.schemas.common import OpenAIModel
from mmis.frontend.client.lora import LoRAAdapterError, LoRARegistry
from mmis.frontend.config import FrontendConfig
from mmis.frontend.state import FrontendState

# the operator's own bounds on spec.adapters (operator/mmis_operator/spec.py, the CRD): an
# adapter's name is a model name, its path a filesystem path (PATH_MAX)
NAME_MAX = 128
PATH_MAX = 4096


class LoadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field(
        min_length=1, max_length=NAME_MAX, description="the name requests use as `model`"
    )
    lora_path: str = Field(
        min_length=1,
        max_length=PATH_MAX,
        description="a PEFT adapter directory on the server, or hf://<org>/<name>[@<revision>]",
    )
    lora_int_id: int | None = Field(None, description="ignored (vLLM's; the server assigns ids)")


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1, max_length=NAME_MAX)
    lora_int_id: int | None = None


def install_lora_routes(app: FastAPI, settings: FrontendConfig) -> None:
    """Add the ``/v1`` routes when ``--allow-runtime-lora-updating`` is on, and the internal
    ones always (module docstring)."""
    served = set(settings.served_names)

    def registry(request: Request, name: str) -> LoRARegistry:
        if name in served:
            raise LoRAAdapterError(f"{name!r} names the served base model", param="lora_name")
        state: FrontendState = request.app.state.mmis
        return state.lora

    async def load(request: Request, *, reconcile: bool) -> Response:
        body = parse_request(LoadLoRAAdapterRequest, await request.body())
        lora = registry(request, body.lora_name)
        if reconcile and not await lora.ensure_loaded(body.lora_name, body.lora_path):
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' already loaded.")
        if not reconcile:
            await lora.load(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(request: Request, *, reconcile: bool) -> Response:
        body = parse_request(UnloadLoRAAdapterRequest, await request.body())
        lora = registry(request, body.lora_name)
        if reconcile and not await lora.ensure_unloaded(body.lora_name):
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' not loaded.")
        if not reconcile:
            await lora.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/internal/load_lora_adapter", include_in_schema=False)
    async def internal_load_lora_adapter(request: Request) -> Response:
        return await load(request, reconcile=True)

    @app.post("/internal/unload_lora_adapter", include_in_schema=False)
    async def internal_unload_lora_adapter(request: Request) -> Response:
        return await unload(request, reconcile=True)

    if not settings.allow_runtime_lora_updating:
        return

    @app.post("/v1/load_lora_adapter", include_in_schema=False)
    async def load_lora_adapter(request: Request) -> Response:
        return await load(request, reconcile=False)

    @app.post("/v1/unload_lora_adapter", include_in_schema=False)
    async def unload_lora_adapter(request: Request) -> Response:
        return await unload(request, reconcile=False)
