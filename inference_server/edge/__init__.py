"""The edge core both protocols share: a generation's lifecycle (generation.py), the tenant
rules (tenancy.py, caller.py, tenant_metrics.py), request limits and checks (checks.py),
serving state (state.py: admission, draining) and the Prometheus metrics (metrics.py,
pool_metrics.py). The gRPC edge (server/) and the HTTP edge (http/) convert their own wire
formats to and from these, and import neither each other."""
