"""P0, the front end. Never imports mmis.engine (import-linter contract)."""
