"""The gRPC edge: servicer (servicer.py), pb <-> domain conversion (convert.py), the error
interceptor (interceptor.py), admission and draining (state.py), uploads (upload.py),
Prometheus metrics (metrics.py), and the server object with health and reflection (app.py)."""
