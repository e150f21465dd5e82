"""The OpenAI-compatible HTTP edge (docs/HTTP.md): the same engine, tenants and metrics as gRPC."""
