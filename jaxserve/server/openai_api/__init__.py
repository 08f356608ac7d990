"""The OpenAI-compatible HTTP API (`jaxserve serve --http-port`), beside gRPC on one engine.

protocol.py (request bodies -> RequestSpec), serving.py (engine deltas -> OpenAI JSON / SSE),
errors.py (gRPC statuses -> OpenAI error bodies), routes.py (the FastAPI app), openapi.py (its
published schema: limits, statuses, media types), http_server.py (uvicorn on the server's own
event loop).
"""
