"""The shared-memory object store: one writer (P0), readers that acknowledge (P1)."""
