// Internal interface between the compact pass's driver (compact.cpp) and its per-ISA loops
// (compact_kernels.h compiled by compact_isa.cpp). Not part of the C ABI.
#pragma once

#include <cstddef>
#include <cstdint>

namespace herald {

// The hot loops of the compact pass; contracts at their definitions in compact_kernels.h.
struct CompactKernels {
  const char* name;
  void (*quantize_rows)(const uint16_t* k, int n, int D, int8_t* q8, float* s);
  void (*int_dots)(const int8_t* k8, int n, int D, const int16_t* qq, int Qn, int32_t* out,
                   int64_t ld);
  float (*score_bounds)(const int32_t* dot, const float* s, int n, float alpha, float rho,
                        float* lo, float* hi, int* bad);
  void (*exp_bounds)(const float* x, int n, float shift, int upper, float* e);
  double (*sum_where)(const float* e, const uint8_t* skip, int n);
  void (*importance_bounds)(const float* elo, const float* ehi, int64_t ld, int Qn, int n,
                            const float* inv_zhi, const float* zlo, float* il, float* iu);
  void (*exact_scores)(const uint16_t* const* rows, int n, int D, const float* x, int Qn,
                       float* kt, float* score, float* absdot, int64_t ld);
  void (*weighted_rows)(const uint16_t* const* rows, int n, int D, const float* p, int64_t ldp,
                        int Qn, float* o, float* vf);
};

// isa: 0 best here, 1 AVX-512 (VNNI), 2 portable, 3 AVX2; nullptr if this CPU cannot run it.
const CompactKernels* compact_kernels(int isa);
int compact_best_isa();

}  // namespace herald
