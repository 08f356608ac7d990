"""gRPC serving: jaxserve.v1.Generation, a JetStream-compatible Orchestrator, health, reflection,
Prometheus metrics, backpressure, cancellation, deadlines, graceful drain, TLS and tokens.

One request's path through this package:

    gRPC call (event loop thread)
      -> calls.py          parse safely (a bad message is INVALID_ARGUMENT naming the field)
      -> messages.py       proto -> RequestSpec (prompt + SamplingParams), field checks
      -> frontend.py       serving? Engine.check_request; room in the queue (backpressure.py)?
                           Engine.validate (thread pool: tokenize, BOS, token-level limits),
                           then hand over to ...
      -> engine_loop.py    the engine thread: priority queue -> Engine.add_request / step / abort
      <- frontend.py       deltas routed back to the call's queue (call_soon_threadsafe)
      <- generation_service.py / jetstream_service.py   messages streamed as tokens are produced

Modules: app (Server, BackgroundServer, serve), config (ServerConfig), health (readiness and
liveness), metrics (prometheus_client), security (TLS, bearer token), decoding (safe request
parsing), proto (the .proto files, their committed compiled schema, stubs built from it), fake_engine (the
real Engine over a hand-computable fake model, for tests and client development), client and
cli (`jaxserve serve`, `jaxserve client`).

Importing this package is cheap; the submodules pull in grpc and the engine.
"""
