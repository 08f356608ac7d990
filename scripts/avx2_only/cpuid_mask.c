// Preloaded into a process (avx2_only/run.sh) so it, its threads and the programs it starts see an
// AVX2-only x86 CPU: what a developer's AVX-512 machine needs to measure and test jaxserve as it
// runs on the AVX2 servers users have (issue 34: `make setup`'s -march=native build, the native
// kernels' vector width, `auto`'s choice, XLA's and its libraries' own CPU dispatch, all decide
// from CPUID at run time; a library built -march=x86-64-v3 alone leaves the rest on AVX-512).
//
// How: CPUID faulting (arch_prctl ARCH_SET_CPUID, 0; the /proc/cpuinfo flag cpuid_fault, which
// KVM guests have) makes every CPUID instruction of this thread raise SIGSEGV. Our handler runs
// the real CPUID with faulting briefly off, clears what an AVX2-only CPU lacks, writes the four
// registers back and steps over the two-byte instruction. The flag is per thread, inherited by
// threads and forks and cleared by exec (hence LD_PRELOAD: each new program sets it again).
// The program's own SIGSEGV handler (Python's faulthandler, say) is kept aside and called for
// every other fault; its sa_flags (SA_RESETHAND, SA_NODEFER) are not honoured.
// What it cannot change: the instructions a program was compiled with (the kernel still lets
// AVX-512 run) and glibc's start-up choice of string functions (made before any preload:
// run.sh masks those with GLIBC_TUNABLES). Static programs (no preload) see the real CPU.
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

static struct sigaction program_segv;  // what the program asked for SIGSEGV; ours stays installed
static int (*real_sigaction)(int, const struct sigaction *, struct sigaction *);

static long set_cpuid(int enabled) { return syscall(SYS_arch_prctl, ARCH_SET_CPUID, enabled); }

static void mask(unsigned leaf, unsigned sub, unsigned *a, unsigned *b, unsigned *c, unsigned *d) {
  if (leaf == 1) {
    unsigned family = ((*a >> 8) & 0xf) + ((*a >> 20) & 0xff);
    if (family == 0x19) *a &= ~(0xfu << 16);  // AMD 19h: Zen 4 (models 10h-7fh) reads as Zen 3 (0xh)
  } else if (leaf == 7 && sub == 0) {
    *b &= ~((1u << 16) | (1u << 17) | (1u << 21) | (1u << 26) | (1u << 27) | (1u << 28) | (1u << 30) |
            (1u << 31));  // avx512 f dq ifma pf er cd bw vl
    *c &= ~((1u << 1) | (1u << 6) | (1u << 8) | (1u << 11) | (1u << 12) | (1u << 14));  // vbmi vbmi2 gfni vnni bitalg vpopcntdq
    *d &= ~((1u << 2) | (1u << 3) | (1u << 8) | (1u << 22) | (1u << 23) | (1u << 24) |
            (1u << 25));  // 4vnniw 4fmaps vp2intersect amx-bf16 fp16 amx-tile amx-int8
  } else if (leaf == 7 && sub == 1) {
    *a &= ~((1u << 4) | (1u << 5));  // avx-vnni avx512_bf16
    *d &= ~(1u << 19);                // avx10
  } else if (leaf == 0xd && sub == 0) {
    *a &= ~0xe0u;  // XCR0 components opmask, ZMM_Hi256, Hi16_ZMM
  }
}

static void on_segv(int sig, siginfo_t *si, void *ctx) {
  ucontext_t *uc = ctx;
  greg_t *r = uc->uc_mcontext.gregs;
  const unsigned char *ip = (const unsigned char *)r[REG_RIP];
  if (si->si_code == SI_KERNEL && ip[0] == 0x0f && ip[1] == 0xa2) {
    unsigned a, b, c, d, leaf = (unsigned)r[REG_RAX], sub = (unsigned)r[REG_RCX];
    set_cpuid(1);
    __cpuid_count(leaf, sub, a, b, c, d);
    set_cpuid(0);
    mask(leaf, sub, &a, &b, &c, &d);
    r[REG_RAX] = a; r[REG_RBX] = b; r[REG_RCX] = c; r[REG_RDX] = d;
    r[REG_RIP] += 2;
    return;
  }
  if (program_segv.sa_flags & SA_SIGINFO) {
    program_segv.sa_sigaction(sig, si, ctx);
  } else if (program_segv.sa_handler != SIG_DFL && program_segv.sa_handler != SIG_IGN) {
    program_segv.sa_handler(sig);
  } else {  // the default action: restore it; the faulting instruction runs again and kills us
    struct sigaction dfl = {0};
    dfl.sa_handler = SIG_DFL;
    real_sigaction(SIGSEGV, &dfl, NULL);
  }
}

int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
  if (!real_sigaction) real_sigaction = dlsym(RTLD_NEXT, "sigaction");
  if (sig != SIGSEGV) return real_sigaction(sig, act, old);
  if (old) *old = program_segv;
  if (act) program_segv = *act;
  return 0;
}

sighandler_t signal(int sig, sighandler_t h) {
  struct sigaction act = {0}, old;
  act.sa_handler = h;
  sigemptyset(&act.sa_mask);
  act.sa_flags = SA_RESTART;
  if (sigaction(sig, &act, &old) != 0) return SIG_ERR;
  return old.sa_handler;
}

__attribute__((constructor)) static void start(void) {
  real_sigaction = dlsym(RTLD_NEXT, "sigaction");
  program_segv.sa_handler = SIG_DFL;
  struct sigaction act = {0};
  act.sa_sigaction = on_segv;
  act.sa_flags = SA_SIGINFO | SA_RESTART | SA_ONSTACK;
  sigemptyset(&act.sa_mask);
  if (real_sigaction(SIGSEGV, &act, NULL) != 0 || set_cpuid(0) != 0) {
    fprintf(stderr, "avx2_only: CPUID faulting unavailable (no cpuid_fault flag?)\n");
    _exit(97);
  }
}
