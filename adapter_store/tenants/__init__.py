"""Tenancy shared by the store and the server: the caller (principal) and the namespace rules (policy)."""
