// Loop bodies of the compact first pass, compiled once per ISA: compact_isa.cpp includes this
// file several times, each inside its own target region with HERALD_CK_NS naming a namespace.
// No include guard on purpose. Plain C++ written for the auto-vectoriser: integer dot products
// (int16 query x int8 key, exact in int32: vpmaddwd / vpdpwssd), float loops over positions with
// per-lane accumulators (no reassociation needed), no calls, no std:: templates (NOTE: a template
// instantiated inside a target region could be linked into portable code: see avx512_common.h).
// Arithmetic and its error bounds: herald/offload/selection/compact.py.

namespace herald {
namespace HERALD_CK_NS {
namespace {

inline float ck_abs(float x) { return x < 0.0f ? -x : x; }

inline float ck_bf16(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

// Round to the nearest integer, ties to even (|t| < 2**22; the default rounding mode).
inline float ck_rint(float t) { return (t + 12582912.0f) - 12582912.0f; }

// exp(x) for x in [-87, 0]: n = rint(x / ln2), r = x - n ln2 (Cody-Waite, two constants),
// degree-6 Taylor polynomial on |r| <= ln2/2 + 2**-20, times 2**n built from the exponent bits.
// Relative error < 2**-20 (truncation r**7/7! < 1.3e-7, Horner and reduction < 6e-7): checked
// over every float argument by herald_compact_exp_error. Clamped to x >= -87.
inline float ck_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = ck_rint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  __builtin_memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// Rows of D bf16 keys -> int8 and one scale each (compact.py: quantize_keys, same bits).
void quantize_rows(const uint16_t* __restrict k, int n, int D, int8_t* __restrict q8,
                   float* __restrict s) {
  for (int j = 0; j < n; ++j) {
    const uint16_t* row = k + static_cast<int64_t>(j) * D;
    uint16_t mbits = 0;  // max |k| as bf16 bits (sign cleared: order = magnitude; NaN largest)
    for (int d = 0; d < D; ++d) {
      const uint16_t b = static_cast<uint16_t>(row[d] & 0x7fffu);
      mbits = b > mbits ? b : mbits;
    }
    const float sc = ck_bf16(mbits) / 127.0f;
    s[j] = sc;
    int8_t* out = q8 + static_cast<int64_t>(j) * D;
    if (!(sc > 0.0f && sc <= 3.0e38f)) {  // zero row, or inf / NaN: q8 = 0 (scale says why)
      for (int d = 0; d < D; ++d) out[d] = 0;
      continue;
    }
    for (int d = 0; d < D; ++d) {
      float t = ck_rint(ck_bf16(row[d]) / sc);
      t = t > 127.0f ? 127.0f : t < -127.0f ? -127.0f : t;
      out[d] = static_cast<int8_t>(static_cast<int32_t>(t));
    }
  }
}

// out[q * ld + j] = sum_d qq[q * D + d] * k8[j * D + d], exact (|sum| < 2**31 for D <= 512).
void int_dots(const int8_t* __restrict k8, int n, int D, const int16_t* __restrict qq, int Qn,
              int32_t* __restrict out, int64_t ld) {
  for (int j = 0; j < n; ++j) {
    const int8_t* kr = k8 + static_cast<int64_t>(j) * D;
    for (int q = 0; q < Qn; ++q) {
      const int16_t* qr = qq + static_cast<int64_t>(q) * D;
      int32_t acc = 0;
      for (int d = 0; d < D; ++d) acc += static_cast<int32_t>(qr[d]) * static_cast<int32_t>(kr[d]);
      out[q * ld + j] = acc;
    }
  }
}

// Score bounds of one query row over n positions: center a = alpha s I, radius
// w = rho s + (rho s + |a|) 2**-18 + 2**-126 (compact.py: first_pass_bounds; 2**-18 = 64 u covers
// the center's four roundings, the radius's, the kernel's 2u|score| and lo/hi's own). Returns
// the max of hi; *bad |= a non-finite bound.
float score_bounds(const int32_t* __restrict dot, const float* __restrict s, int n, float alpha,
                   float rho, float* __restrict lo, float* __restrict hi, int* bad) {
  float mx[16];
  int bd[16];
  for (int l = 0; l < 16; ++l) {
    mx[l] = -3.0e38f;
    bd[l] = 0;
  }
  int j = 0;
  for (; j + 16 <= n; j += 16) {
    for (int l = 0; l < 16; ++l) {
      const float a = alpha * s[j + l] * static_cast<float>(dot[j + l]);
      const float r0 = rho * s[j + l];
      const float w = r0 + (r0 + ck_abs(a)) * 3.814697265625e-06f + 1.1754943508222875e-38f;
      const float h = a + w;
      lo[j + l] = a - w;
      hi[j + l] = h;
      mx[l] = h > mx[l] ? h : mx[l];
      bd[l] |= !(ck_abs(a) + w <= 3.0e38f);
    }
  }
  for (int l = 0; j < n; ++j, ++l) {
    const float a = alpha * s[j] * static_cast<float>(dot[j]);
    const float r0 = rho * s[j];
    const float w = r0 + (r0 + ck_abs(a)) * 3.814697265625e-06f + 1.1754943508222875e-38f;
    lo[j] = a - w;
    hi[j] = a + w;
    mx[l] = hi[j] > mx[l] ? hi[j] : mx[l];
    bd[l] |= !(ck_abs(a) + w <= 3.0e38f);
  }
  float m = -3.0e38f;
  for (int l = 0; l < 16; ++l) {
    m = mx[l] > m ? mx[l] : m;
    *bad |= bd[l];
  }
  return m;
}

// e[j] = a bound on exp(x[j] - shift) (x <= shift): lower (upper = 0) = ck_exp * (1 - 2**-13),
// 0 below -87; upper = ck_exp(max(arg, -87)) * (1 + 2**-13). 2**-13 covers ck_exp's 2**-20, the
// argument's rounding (<= 87 u) and the product's.
void exp_bounds(const float* __restrict x, int n, float shift, int upper, float* __restrict e) {
  const float f = upper ? 1.0f + 1.220703125e-04f : 1.0f - 1.220703125e-04f;
  const float floor_arg = upper ? -3.0e38f : -87.0f;
  for (int j = 0; j < n; ++j) {
    const float arg = x[j] - shift;
    const float v = ck_exp(arg) * f;
    e[j] = arg < floor_arg ? 0.0f : v;
  }
}

// sum of e[j] over j < n with skip == nullptr or skip[j] == 0: float partial sums of <= 16
// terms per lane and chunk, chunks added in double (relative error <= gamma(20) + 2**-40).
double sum_where(const float* __restrict e, const uint8_t* __restrict skip, int n) {
  double total = 0.0;
  for (int j0 = 0; j0 < n; j0 += 256) {
    float acc[16];
    for (int l = 0; l < 16; ++l) acc[l] = 0.0f;
    const int end = j0 + 256 < n ? j0 + 256 : n;
    int j = j0;
    if (skip == nullptr) {
      for (; j + 16 <= end; j += 16)
        for (int l = 0; l < 16; ++l) acc[l] += e[j + l];
      for (int l = 0; j < end; ++j, ++l) acc[l] += e[j];
    } else {
      // NOTE: a product, not a select: GCC 12 miscompiles the select of this loop for AVX2
      // (measured: wrong sums); e is finite, so e * 0 = 0.
      for (; j + 16 <= end; j += 16)
        for (int l = 0; l < 16; ++l) acc[l] += e[j + l] * static_cast<float>(skip[j + l] == 0);
      for (int l = 0; j < end; ++j, ++l) acc[l] += e[j] * static_cast<float>(skip[j] == 0);
    }
    for (int l = 0; l < 16; ++l) total += static_cast<double>(acc[l]);
  }
  return total;
}

// il[s] = sum_q e_lo[q][s] * inv_zhi[q]; iu[s] = sum_q e_hi[q][s] / (zlo[q] - e_lo[q][s] +
// e_hi[q][s]) for s < n (compact.py: candidate_set; the caller applies theta and the slack).
void importance_bounds(const float* __restrict elo, const float* __restrict ehi, int64_t ld,
                       int Qn, int n, const float* __restrict inv_zhi,
                       const float* __restrict zlo, float* __restrict il, float* __restrict iu) {
  for (int s = 0; s < n; ++s) {
    il[s] = 0.0f;
    iu[s] = 0.0f;
  }
  for (int q = 0; q < Qn; ++q) {
    const float* el = elo + q * ld;
    const float* eh = ehi + q * ld;
    const float w = inv_zhi[q], z = zlo[q];
    for (int s = 0; s < n; ++s) {
      il[s] += el[s] * w;
      iu[s] += eh[s] / (z - el[s] + eh[s]);
    }
  }
}

// Exact float32 scores of n <= 64 bf16 key rows against Qn query rows x [Qn][D] (fp32), and the
// sums of |x_d k_d| (for the rounding bound): score[q * ld + j], absdot[q * ld + j]. Products of
// bf16 values are exact in float32; each sum runs over d in order (error <= gamma(D) absdot).
void exact_scores(const uint16_t* const* rows, int n, int D, const float* __restrict x, int Qn,
                  float* __restrict kt, float* __restrict score, float* __restrict absdot,
                  int64_t ld) {
  for (int j = 0; j < 64; ++j)
    for (int d = 0; d < D; ++d) kt[d * 64 + j] = j < n ? ck_bf16(rows[j][d]) : 0.0f;
  for (int q = 0; q < Qn; ++q) {
    float acc[64], aab[64];
    for (int j = 0; j < 64; ++j) {
      acc[j] = 0.0f;
      aab[j] = 0.0f;
    }
    const float* xr = x + static_cast<int64_t>(q) * D;
    for (int d = 0; d < D; ++d) {
      const float xv = xr[d], xa = ck_abs(xr[d]);
      const float* kr = kt + d * 64;
      for (int j = 0; j < 64; ++j) {
        acc[j] += xv * kr[j];
        aab[j] += xa * ck_abs(kr[j]);
      }
    }
    for (int j = 0; j < n; ++j) {
      score[q * ld + j] = acc[j];
      absdot[q * ld + j] = aab[j];
    }
  }
}

// o[q][d] += p[q * ldp + j] * v_j[d] over n rows (selected-mode attention output).
void weighted_rows(const uint16_t* const* rows, int n, int D, const float* __restrict p,
                   int64_t ldp, int Qn, float* __restrict o, float* __restrict vf) {
  for (int j = 0; j < n; ++j) {
    for (int d = 0; d < D; ++d) vf[d] = ck_bf16(rows[j][d]);
    for (int q = 0; q < Qn; ++q) {
      const float w = p[q * ldp + j];
      float* oq = o + static_cast<int64_t>(q) * D;
      for (int d = 0; d < D; ++d) oq[d] += w * vf[d];
    }
  }
}

}  // namespace
}  // namespace HERALD_CK_NS
}  // namespace herald
