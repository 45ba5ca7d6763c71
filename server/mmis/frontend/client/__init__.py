"""P0's engine client: everything between an OpenAI request and P1.

It owns the ZMQ link to P1 (:mod:`.engine_client`) and its liveness (:mod:`.engine_liveness`),
rendering prompts and media through the model's processor (:mod:`.renderer`,
:mod:`.processor`, :mod:`.media` with its SSRF guard :mod:`.ssrf`), the sender half of the
multimodal cache mirror's invalidations (:mod:`.pending_invalidations`), one generation
attempt and the recovery/retry rules around it (:mod:`.generation`, :mod:`.recovery`), a
request from its prepared prompt to finished outputs with text (:mod:`.output_processor`:
engine requests per choice, detokenizing, stop strings, logprob rows), and
the engine's numbers (:mod:`.levels`, :mod:`.stats_poller`).

Imports flow one way: ``client`` imports only the shared modules at ``mmis.frontend`` level
(``config``, ``errors``, ``request_telemetry``) and never :mod:`mmis.frontend.api` nor
``mmis.frontend.state`` (which wires ``client`` for ``api``); ``api`` may import ``client``
(import-linter contracts in ``pyproject.toml``).
"""
