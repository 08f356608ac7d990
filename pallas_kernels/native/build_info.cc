// Which kernel source this library was built from: setup.py defines JAXSERVE_SOURCE_HASH (the
// sha256 of ragged_paged_attention_cpu.cc, 16 hex digits); the loader compares it with the
// source it ships beside, so a library built from an older source is refused, never run.
#ifndef JAXSERVE_SOURCE_HASH
#error "JAXSERVE_SOURCE_HASH must be defined by the build (setup.py)"
#endif

extern "C" const char* JaxserveNativeSourceHash() { return JAXSERVE_SOURCE_HASH; }
