"""Corpora, splits, the token cache and packing."""
