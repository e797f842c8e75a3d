"""Transports: what moves messages between processes (see `base` for the contract)."""
