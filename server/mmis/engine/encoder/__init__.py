"""``mmis encoder``: the encoder-only process of encoder disaggregation (E/PD, issue 46).

It loads a model's vision tower and projector only (``loader.py``), answers
:class:`~mmis.protocol.encoder.EncodeRequest` messages on a ZMQ ROUTER (``server.py``) from a
byte-budgeted LRU of encoder outputs (``output_cache.py``) or by encoding the items it
received in batches, and announces what its cache stored and evicted on an mm-events stream
(``engine/mm_events.py``'s format). Settings: ``config.py``; the command:
``entrypoints/encoder.py``.
"""
