"""Balancing: how a worker is chosen and how many tasks it gets."""
