"""P1, the engine core. Never imports mmis.server.frontend (import-linter contract)."""
