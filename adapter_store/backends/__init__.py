"""Backends of the store: one file each, behind the interfaces in base.py."""
