// The compact pass's loops (compact_kernels.h) compiled for three targets: the build's baseline
// (portable), AVX2 + FMA, and AVX-512 with VNNI (the int16 x int8 dot products become vpdpwssd).
// Chosen at run time from what the CPU reports. The integer dot products are exact on every
// target; the float loops differ only in rounding, which the bounds' slack covers.
#include <cstdint>

#include "compact.h"

#define HERALD_CK_NS ck_portable
#include "compact_kernels.h"
#undef HERALD_CK_NS

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
#define HERALD_CK_NS ck_avx2
#include "compact_kernels.h"
#undef HERALD_CK_NS
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")
#endif
#define HERALD_CK_NS ck_avx512
#include "compact_kernels.h"
#undef HERALD_CK_NS
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#define HERALD_CK_X86 1
#endif

namespace herald {
namespace {

#define HERALD_CK_TABLE(ns, label)                                                          \
  {label, &ns::quantize_rows, &ns::int_dots, &ns::score_bounds, &ns::exp_bounds,            \
   &ns::sum_where, &ns::importance_bounds, &ns::exact_scores, &ns::weighted_rows}

const CompactKernels kPortable = HERALD_CK_TABLE(ck_portable, "portable");
#ifdef HERALD_CK_X86
const CompactKernels kAvx2 = HERALD_CK_TABLE(ck_avx2, "avx2");
const CompactKernels kAvx512 = HERALD_CK_TABLE(ck_avx512, "avx512vnni");

bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni") && has_avx2();
}
#endif

}  // namespace

int compact_best_isa() {
#ifdef HERALD_CK_X86
  if (has_avx512()) return 1;
  if (has_avx2()) return 3;
#endif
  return 2;
}

const CompactKernels* compact_kernels(int isa) {
  if (isa == 0) isa = compact_best_isa();
  if (isa == 2) return &kPortable;
#ifdef HERALD_CK_X86
  if (isa == 1) return has_avx512() ? &kAvx512 : nullptr;
  if (isa == 3) return has_avx2() ? &kAvx2 : nullptr;
#endif
  return nullptr;
}

}  // namespace herald
