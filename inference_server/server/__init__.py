"""The gRPC edge: servicer (servicer.py), pb <-> domain conversion (convert.py,
response_format.py), uploads (upload.py), the interceptors (interceptor.py: errors -> status
codes; auth_interceptor.py: bearer tokens) and the server object with health and reflection
(app.py). What it shares with the HTTP edge lives in the edge core (edge/)."""
