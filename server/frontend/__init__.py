"""P0, the front end. Never imports mmis.server.engine (import-linter contract)."""
