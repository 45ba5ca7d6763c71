"""Multimodal helpers shared by P0 and P1: hashing, item sizing, the byte-budget LRU."""
