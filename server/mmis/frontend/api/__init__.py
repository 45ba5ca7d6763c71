"""P0's OpenAI surface: the HTTP app and what shapes requests and responses.

It owns the FastAPI app and its routes (:mod:`.api_server`), the gate every request passes
first (:mod:`.http_gate`), the ``/openapi.json`` document (:mod:`.openapi`), the pydantic
request/response models (:mod:`.schemas`), the endpoint handlers (``serving_*``: chat,
completions, embeddings, Responses, and the generation loop they share) with the message
templating chat and Responses share (:mod:`.templating`), and the output
shaping: the logprob layouts (:mod:`.logprobs`), tool calls (:mod:`.tool_calls`), the
translation of structured-output requests into the wire constraint
(:mod:`.structured_outputs`) and the model's generation defaults
(:mod:`.generation_defaults`). It renders formats only: from a prepared prompt on, a request
belongs to the client (:mod:`mmis.frontend.client.output_processor`: the engine requests, the
retry, detokenizing, stop strings), which hands back outputs with text.

Data and imports flow one way: ``api`` may import :mod:`mmis.frontend.client` (the engine
client) and the shared modules at ``mmis.frontend`` level (``config``, ``errors``, ``state``,
``request_telemetry``); nothing in ``client`` imports ``api`` (an import-linter contract in
``pyproject.toml``), and ``api`` hands ``client`` data, never a callable to call back
(checked at run time: ``tests/e2e/test_request_walk.py``,
``tests/frontend/test_output_processor.py``).
"""
