"""Multimodal helpers shared by P0 and P1: hashing, payload stripping, the cache mirror."""
