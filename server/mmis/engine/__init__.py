"""P1, the engine core (docs/ARCHITECTURE.md §1 steps 6-10). Never imports mmis.frontend."""
