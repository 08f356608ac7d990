#!/usr/bin/env bash
# Run a command as on an AVX2-only x86 CPU (AVX2 + FMA, no AVX-512 or AMX; an AMD Zen 4 reads as
# a Zen 3), on a machine with AVX-512: every program it starts sees the masked CPUID
# (cpuid_mask.c says how and what it cannot mask). For measuring and testing the AVX2 path where
# no AVX2-only machine is at hand (issue 34), e.g. in a fresh clone:
#   scripts/avx2_only/run.sh make setup      # the native kernels built -march=native: AVX2 here
#   scripts/avx2_only/run.sh .venv/bin/python scripts/bench_offline.py ../shared/workloads/offline-mixed-48.json
# The hardware stays what it is (caches, memory bandwidth, a Zen 4's 256-bit datapaths), so
# figures stand for an AVX2-only machine of this microarchitecture, not for another one.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if ! grep -qw cpuid_fault /proc/cpuinfo; then
  echo "avx2_only: this CPU (or its hypervisor) offers no CPUID faulting (/proc/cpuinfo flag cpuid_fault)" >&2
  exit 2
fi
lib=$here/../../build/avx2_only/cpuid_mask.so
if [[ ! -e $lib || $here/cpuid_mask.c -nt $lib ]]; then
  mkdir -p "$(dirname "$lib")"
  ${CC:-cc} -O2 -Wall -shared -fPIC -o "$lib" "$here/cpuid_mask.c" -ldl
fi
# glibc picks its string functions' variants in ld.so, before any preload runs: these tunables
# take the AVX-512 ones away from it.
export GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX512F,-AVX512VL,-AVX512BW,-AVX512DQ,-AVX512CD${GLIBC_TUNABLES:+:$GLIBC_TUNABLES}
export LD_PRELOAD=$lib${LD_PRELOAD:+:$LD_PRELOAD}
exec "$@"
