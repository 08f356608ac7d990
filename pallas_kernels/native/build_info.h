// Which kernel source a library was built from: setup.py defines JAXSERVE_SOURCE_HASH (the
// sha256 of the kernel's .cc, 16 hex digits) and each kernel includes this header once; the
// loader compares the hash with the source it ships beside, so a library built from an older
// source is refused, never run. A header, not a shared build_info.cc: both extensions compiled
// that one file to the same object path, so `build_ext --parallel` linked one library's hash
// into the other (both stamped with the same hash, and the loader refused one of them).
#ifndef JAXSERVE_NATIVE_BUILD_INFO_H_
#define JAXSERVE_NATIVE_BUILD_INFO_H_

#ifndef JAXSERVE_SOURCE_HASH
#error "JAXSERVE_SOURCE_HASH must be defined by the build (setup.py)"
#endif

extern "C" const char* JaxserveNativeSourceHash() { return JAXSERVE_SOURCE_HASH; }

#endif  // JAXSERVE_NATIVE_BUILD_INFO_H_
