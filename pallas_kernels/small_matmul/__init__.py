"""Small-M fp32 matmul for the CPU (decode-step projections): the native XLA FFI kernel."""
