"""P0, the front end (docs/ARCHITECTURE.md §1 steps 1-5 and 11). Never imports mmis.engine."""
