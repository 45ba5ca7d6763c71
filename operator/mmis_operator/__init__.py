"""mmis_operator: the kopf operator that turns MMInferenceService resources into pods.

It never imports the server package ``mmis`` (import-linter contract in pyproject.toml) and
installs from its own dependency set (operator/pyproject.toml), without torch.
"""
