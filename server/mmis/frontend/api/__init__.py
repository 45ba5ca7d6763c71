"""P0's OpenAI surface: the HTTP app and what shapes requests and responses.

It owns the FastAPI app and its routes (:mod:`.api_server`), the gate every request passes
first (:mod:`.http_gate`), the ``/openapi.json`` document (:mod:`.openapi`), the pydantic
request/response models (:mod:`.schemas`), the endpoint handlers (``serving_*``: chat,
completions, embeddings, Responses, and the generation loop they share) with the message
templating chat and Responses share (:mod:`.templating`), and the output
shaping: detokenizing (:mod:`.detokenizer`), logprobs (:mod:`.logprobs`), tool calls
(:mod:`.tool_calls`), the translation of structured-output requests into the wire constraint
(:mod:`.structured_outputs`) and the model's generation defaults
(:mod:`.generation_defaults`).

Imports flow one way: ``api`` may import :mod:`mmis.frontend.client` (the engine client) and
the shared modules at ``mmis.frontend`` level (``config``, ``errors``, ``state``,
``request_telemetry``); nothing in ``client`` imports ``api`` (an import-linter contract in
``pyproject.toml``).
"""
