// Portable kernels of the selection kernel: plain C++ the compiler may auto-vectorise for the
// baseline ISA of the build (no -march flag), so they run on any CPU. Same contract as the
// AVX-512 kernels (selection.h); fp32 arithmetic throughout, accumulator order = natural order.
#include <cmath>
#include <cstring>

#include "selection.h"

namespace herald {
namespace {

size_t qprep_bytes(int Qn, int D) { return static_cast<size_t>(Qn) * D * sizeof(float); }

void prep_q(const uint16_t* q, int Qn, int D, void* out) {
  float* qf = static_cast<float*>(out);
  for (int i = 0; i < Qn * D; ++i) qf[i] = bf16_to_f32(q[i]);
}

bool score_page(const PageScoreArgs& a) {
  const int D = a.D, Pp = a.Pp, n = a.n;
  float* kf = static_cast<float*>(a.kt);  // [D][Pp]: key rows transposed, so the inner loop
                                          // over keys is contiguous and vectorises
  for (int s = 0; s < n; ++s)
    for (int d = 0; d < D; ++d) kf[d * Pp + s] = bf16_to_f32(a.k[s * D + d]);
  const float* qf = static_cast<const float*>(a.qprep);
  for (int q = 0; q < a.Qn; ++q) {
    float* s = a.sbuf + q * Pp;
    for (int j = 0; j < n; ++j) s[j] = 0.0f;
    for (int d = 0; d < D; ++d) {
      const float w = qf[q * D + d];
      const float* kr = kf + d * Pp;
      for (int j = 0; j < n; ++j) s[j] += w * kr[j];
    }
    bool finite = true;
    float m = -INFINITY;
    for (int j = 0; j < n; ++j) {
      s[j] *= a.scale;
      finite = finite && std::isfinite(s[j]);
      m = s[j] > m ? s[j] : m;
    }
    if (!finite) return false;
    float* e = a.e + q * Pp;
    float sum = 0.0f;
    for (int j = 0; j < n; ++j) {
      e[j] = std::exp(s[j] - m);
      sum += e[j];
    }
    for (int j = n; j < Pp; ++j) e[j] = 0.0f;
    a.page_max[q] = m;
    a.page_sum[q] = sum;
  }
  return true;
}

void importance(const float* e, const float* f, int Qn, int Pp, int page_size, int npages,
                int last_rows, float* imp) {
  for (int p = 0; p < npages; ++p) {
    const int rows = p == npages - 1 ? last_rows : page_size;
    const float* ep = e + static_cast<int64_t>(p) * Qn * Pp;
    const float* fp = f + static_cast<int64_t>(p) * Qn;
    float* out = imp + static_cast<int64_t>(p) * page_size;
    for (int j = 0; j < rows; ++j) out[j] = 0.0f;
    for (int q = 0; q < Qn; ++q)
      for (int j = 0; j < rows; ++j) out[j] += fp[q] * ep[q * Pp + j];
  }
}

void pv(const PvArgs& a) {
  float* vf = static_cast<float*>(a.scratch);  // one V row in fp32
  for (int j = 0; j < a.n; ++j) {
    for (int d = 0; d < a.D; ++d) vf[d] = bf16_to_f32(a.rows[j][d]);
    for (int q = 0; q < a.Qn; ++q) {
      float w = a.w[q * a.ldw + j];
      if (a.wscale != nullptr) w *= a.wscale[q * a.ldscale];
      float* o = a.o + q * a.D;
      for (int d = 0; d < a.D; ++d) o[d] += w * vf[d];
    }
  }
}

void unpermute(const float* src, float mul, float* dst, int D) {
  for (int d = 0; d < D; ++d) dst[d] = src[d] * mul;
}

void copy_stream(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }

void store_fence() {}  // plain stores: the pool's barrier orders them

}  // namespace

const Kernels& portable_kernels() {
  static const Kernels k = {"portable", &qprep_bytes, &prep_q,   &score_page,
                            &importance, &pv,          &unpermute,
                            &copy_stream, &store_fence};
  return k;
}

}  // namespace herald
