"""P1, the engine core. Never imports mmis.frontend (import-linter contract)."""
