"""``mmis bench``: measure any OpenAI-compatible endpoint (mmis, vLLM, SGLang) under load.

``datasets`` builds the workload, ``client`` sends and measures one request, ``metrics`` turns
the measurements into vLLM's figures, ``serve`` runs the load (``mmis bench serve``) and
``compare`` prints two saved results side by side (``mmis bench compare``). Invariant: nothing
here imports torch, ``mmis.engine`` or ``mmis.frontend`` (an import-linter contract), so the
plain ``pip install mmis`` runs it against a remote server.
"""
