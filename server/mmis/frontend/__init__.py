"""P0, the front end (docs/ARCHITECTURE.md §1 steps 1-5 and 11). Never imports mmis.engine.

Two inner packages, imports flowing one way (``api`` -> ``state`` -> ``client``):
:mod:`mmis.frontend.api` is the OpenAI surface (HTTP app, routes, schemas, the ``serving_*``
handlers, output shaping), :mod:`mmis.frontend.client` the engine client (ZMQ to P1,
liveness, rendering prompts and media, the cache mirror's invalidations, recovery, stats).
At this level sit what both use and what wires them: ``config`` (the settings), ``errors``
(the typed errors and the OpenAI error shape), ``request_telemetry`` (a request's span and
record) and ``state`` (the wired :class:`~mmis.frontend.state.FrontendState`).
"""
