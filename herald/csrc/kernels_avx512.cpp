// AVX-512 kernels of the selection kernel (HERALD §IV-B4), fp32-FMA variant (the default).
//
// bf16 K/V are widened to fp32 once per element (a shift or a mask) and multiplied with
// vfmadd231ps. On Sapphire/Emerald Rapids that is twice the multiply-add rate of vdpbf16ps zmm
// (measured on the development Xeon: 1.8 FMA/cycle x 16 MACs vs 0.45 vdpbf16ps/cycle x 32 MACs);
// the vdpbf16ps variant lives in kernels_avx512_bf16.cpp and is selectable for comparison.
//
// Scores: a page of K is transposed (16 x 16 dword transposes of bf16 pairs) into fp32
// kf[d][slot], then 8 queries x 32 keys are register-blocked: one K load feeds 8 FMAs.
#include "selection.h"

#if defined(__x86_64__)
#include "avx512_common.h"  // opens the AVX-512 target region

namespace herald {
namespace {

// Prepared queries: [Qn][D] fp32 in natural order (transposed path), then [Qn][D] fp32 in
// "split" order (per 32-element chunk c: the 16 even elements, then the 16 odd ones; dot path).
size_t qprep_bytes(int Qn, int D) { return static_cast<size_t>(Qn) * D * 8; }

void prep_q(const uint16_t* q, int Qn, int D, void* out) {
  float* qf = static_cast<float*>(out);
  float* qs = qf + static_cast<size_t>(Qn) * D;
  for (int i = 0; i < Qn * D; ++i) qf[i] = bf16_to_f32(q[i]);
  for (int r = 0; r < Qn; ++r)
    for (int c = 0; c < D / 32; ++c)
      for (int i = 0; i < 16; ++i)
        for (int h = 0; h < 2; ++h)
          qs[r * D + 32 * c + 16 * h + i] = bf16_to_f32(q[r * D + 32 * c + 2 * i + h]);
}

// Few query rows (Qn <= kDotMaxRows): no transpose. Each (query, key) pair gets one accumulator
// of 16 partial dot products over the whole D; 16 of them (QB queries x 16/QB keys) are summed
// horizontally by one reduction tree. Cheaper than the transpose when few queries share a key.
#ifndef HERALD_DOT_MAX_ROWS
#define HERALD_DOT_MAX_ROWS 4  // measured crossover: 4 rows dot-path, 8 rows transposed
#endif
constexpr int kDotMaxRows = HERALD_DOT_MAX_ROWS;

// Lane k of the result = sum of the 16 lanes of acc[k] (46 instructions, 30 of them shuffles).
inline __m512 reduce16(const __m512 acc[16]) {
  __m512 s1[8], s2[4], s3[2];
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p)  // 128-bit lanes: accumulator 2p in lanes 0-1, 2p+1 in 2-3
    s1[p] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], 0x44),
                          _mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], 0xEE));
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p)  // lane L: accumulator 4p + L
    s2[p] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * p], s1[2 * p + 1], 0x88),
                          _mm512_shuffle_f32x4(s1[2 * p], s1[2 * p + 1], 0xDD));
#pragma GCC unroll 2
  for (int p = 0; p < 2; ++p) {  // lane L: elements 0-1 accumulator 8p + L, 2-3 8p + 4 + L
    const __m512d a = _mm512_castps_pd(s2[2 * p]), b = _mm512_castps_pd(s2[2 * p + 1]);
    s3[p] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                          _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // lane L, element e: accumulator 4e + L
  const __m512 s4 = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], 0x88),
                                  _mm512_shuffle_ps(s3[0], s3[1], 0xDD));
  const __m512i perm = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(perm, s4);
}

// Scores of QB query rows (split-order qs) against R = 16 / QB keys starting at row s0.
template <int QB, bool FULL, int DC>
inline void score_dot(const uint16_t* k, int nr, const float* qs, int Drt, float scale,
                      float* sbuf, int Pp, int s0) {
  constexpr int R = 16 / QB;
  const int D = DC != 0 ? DC : Drt;
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int c = 0; c < D / 32; ++c) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      if (!FULL && r >= nr) break;
      const __m512i x = _mm512_loadu_si512(k + (s0 + r) * D + 32 * c);
      const __m512 ke = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      const __m512 ko = _mm512_castsi512_ps(_mm512_and_si512(x, hi));
#pragma GCC unroll 8
      for (int i = 0; i < QB; ++i) {
        const float* qc = qs + i * D + 32 * c;
        acc[i * R + r] = _mm512_fmadd_ps(ke, _mm512_load_ps(qc), acc[i * R + r]);
        acc[i * R + r] = _mm512_fmadd_ps(ko, _mm512_load_ps(qc + 16), acc[i * R + r]);
      }
    }
  }
  const __m512 v = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale));
  const int rows = FULL ? R : nr;
#pragma GCC unroll 8
  for (int i = 0; i < QB; ++i) {  // lanes [i*R, i*R + rows) -> sbuf[i][s0 .. s0 + rows)
    const __mmask16 m = static_cast<__mmask16>(((1u << rows) - 1u) << (i * R));
    _mm512_mask_storeu_ps(sbuf + i * Pp + s0 - i * R, m, v);
  }
}

template <int QB>
void score_dot_rows(const PageScoreArgs& a, const float* qs, int q0, int* line, int lines) {
  constexpr int R = 16 / QB;
  const int groups = (a.n + R - 1) / R, per = (lines + groups - 1) / (groups > 0 ? groups : 1);
  for (int s0 = 0; s0 < a.n; s0 += R) {
    const float* q = qs + q0 * a.D;
    float* sb = a.sbuf + q0 * a.Pp;
    if (s0 + R <= a.n && a.D == 128) {
      score_dot<QB, true, 128>(a.k, R, q, a.D, a.scale, sb, a.Pp, s0);
    } else if (s0 + R <= a.n) {
      score_dot<QB, true, 0>(a.k, R, q, a.D, a.scale, sb, a.Pp, s0);
    } else {
      score_dot<QB, false, 0>(a.k, a.n - s0, q, a.D, a.scale, sb, a.Pp, s0);
    }
    if (q0 == 0)
      for (int x = 0; x < per && *line < lines; ++x, ++*line)
        prefetch_line(reinterpret_cast<const char*>(a.k_next) + 64 * *line, a.prefetch_hint);
  }
}

// kf[32c + 2j][16 rows] = even element of pair j, kf[32c + 2j + 1] = odd element.
template <bool FULL, int DC>
inline void transpose_block(const uint16_t* src, int D, int rows, float* dst, int Pp) {
  __m512i r[16];
  load_transposed<FULL, DC>(src, D, rows, r);
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    _mm512_store_si512(dst + (2 * j) * Pp, _mm512_slli_epi32(r[j], 16));
    _mm512_store_si512(dst + (2 * j + 1) * Pp, _mm512_and_si512(r[j], hi));
  }
}

// Scores of QB query rows against NB blocks of 16 keys starting at block sb.
template <int QB, int NB>
inline void score_rows(const float* kf, int Pp, int sb, const float* qf, int q0, int D,
                       float scale, float* sbuf) {
  __m512 acc[QB][NB];
#pragma GCC unroll 8
  for (int i = 0; i < QB; ++i)
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_setzero_ps();
  const float* kp = kf + sb * kLanes;
  const float* qp = qf + q0 * D;
  for (int d = 0; d < D; ++d) {
    __m512 kv[NB];
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) kv[b] = _mm512_load_ps(kp + d * Pp + b * kLanes);
#pragma GCC unroll 8
    for (int i = 0; i < QB; ++i) {
      const __m512 qb = _mm512_set1_ps(qp[i * D + d]);
#pragma GCC unroll 2
      for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_fmadd_ps(kv[b], qb, acc[i][b]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int i = 0; i < QB; ++i)
    for (int b = 0; b < NB; ++b)
      _mm512_store_ps(sbuf + (q0 + i) * Pp + (sb + b) * kLanes, _mm512_mul_ps(acc[i][b], sc));
}

template <int QB>
void score_qblock(const float* kf, int Pp, int nb, const float* qf, int q0, int D, float scale,
                  float* sbuf) {
  int sb = 0;
  for (; sb + 1 < nb; sb += 2) score_rows<QB, 2>(kf, Pp, sb, qf, q0, D, scale, sbuf);
  if (sb < nb) score_rows<QB, 1>(kf, Pp, sb, qf, q0, D, scale, sbuf);
}

bool score_page(const PageScoreArgs& a) {
  const int D = a.D, Pp = a.Pp, n = a.n, nb = (n + kLanes - 1) / kLanes;
  float* kf = static_cast<float*>(a.kt);
  const int lines = a.k_next != nullptr ? a.n_next * D / 32 : 0;  // 64-byte lines of next page
  int line = 0;
  if (a.Qn <= kDotMaxRows) {
    const float* qs = static_cast<const float*>(a.qprep) + static_cast<size_t>(a.Qn) * D;
    int q0 = 0;
    for (; q0 + 4 <= a.Qn; q0 += 4) score_dot_rows<4>(a, qs, q0, &line, lines);
    if (a.Qn - q0 >= 2) {
      score_dot_rows<2>(a, qs, q0, &line, lines);
      q0 += 2;
    }
    if (q0 < a.Qn) score_dot_rows<1>(a, qs, q0, &line, lines);
    return page_stats(a);
  }
  for (int b = 0; b < nb; ++b) {
    const int rows = n - b * kLanes < kLanes ? n - b * kLanes : kLanes;
    for (int c = 0; c < D / 32; ++c) {
      const uint16_t* src = a.k + b * kLanes * D + 32 * c;
      float* dst = kf + 32 * c * Pp + b * kLanes;
      if (rows == kLanes && D == 128) {
        transpose_block<true, 128>(src, D, rows, dst, Pp);
      } else if (rows == kLanes) {
        transpose_block<true, 0>(src, D, rows, dst, Pp);
      } else {
        transpose_block<false, 0>(src, D, rows, dst, Pp);
      }
      prefetch_some(a, &line, lines);
    }
  }
  const float* qf = static_cast<const float*>(a.qprep);
  int q0 = 0;
  for (; q0 + 8 <= a.Qn; q0 += 8) score_qblock<8>(kf, Pp, nb, qf, q0, D, a.scale, a.sbuf);
  switch (a.Qn - q0) {
    case 1: score_qblock<1>(kf, Pp, nb, qf, q0, D, a.scale, a.sbuf); break;
    case 2: score_qblock<2>(kf, Pp, nb, qf, q0, D, a.scale, a.sbuf); break;
    case 3: score_qblock<3>(kf, Pp, nb, qf, q0, D, a.scale, a.sbuf); break;
    case 4: score_qblock<4>(kf, Pp, nb, qf, q0, D, a.scale, a.sbuf); break;
    case 5: score_qblock<5>(kf, Pp, nb, qf, q0, D, a.scale, a.sbuf); break;
    case 6: score_qblock<6>(kf, Pp, nb, qf, q0, D, a.scale, a.sbuf); break;
    case 7: score_qblock<7>(kf, Pp, nb, qf, q0, D, a.scale, a.sbuf); break;
    default: break;
  }
  return page_stats(a);
}

// P @ V: V rows widened to fp32 in "split" order (per 32-element chunk c: the 16 even elements,
// then the 16 odd ones), so accumulator index 32c + 16h + i holds d = 32c + 2i + h.
template <int NZ, int QB>
inline void pv_block(const float* vf, int D, int dg, int n, const float* w, int64_t ldw,
                     const float* sc, int q0, float* o) {
  __m512 acc[QB][NZ];
  for (int i = 0; i < QB; ++i)
    for (int z = 0; z < NZ; ++z) acc[i][z] = _mm512_setzero_ps();
  for (int j = 0; j < n; ++j) {
    __m512 v[NZ];
#pragma GCC unroll 8
    for (int z = 0; z < NZ; ++z) v[z] = _mm512_load_ps(vf + j * D + dg + z * kLanes);
#pragma GCC unroll 2
    for (int i = 0; i < QB; ++i) {
      const __m512 wb = _mm512_set1_ps(w[(q0 + i) * ldw + j] * sc[i]);
#pragma GCC unroll 8
      for (int z = 0; z < NZ; ++z) acc[i][z] = _mm512_fmadd_ps(v[z], wb, acc[i][z]);
    }
  }
  for (int i = 0; i < QB; ++i)
    for (int z = 0; z < NZ; ++z) {
      float* dst = o + (q0 + i) * D + dg + z * kLanes;
      _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), acc[i][z]));
    }
}

template <int NZ>
void pv_group(const float* vf, int D, int dg, const PvArgs& a) {
  int q0 = 0;
  float sc[2];
  for (; q0 < a.Qn; q0 += 2) {
    const int qb = a.Qn - q0 >= 2 ? 2 : 1;
    for (int i = 0; i < qb; ++i) sc[i] = a.wscale != nullptr ? a.wscale[(q0 + i) * a.ldscale] : 1.0f;
    if (qb == 2) {
      pv_block<NZ, 2>(vf, D, dg, a.n, a.w, a.ldw, sc, q0, a.o);
    } else {
      pv_block<NZ, 1>(vf, D, dg, a.n, a.w, a.ldw, sc, q0, a.o);
    }
  }
}

void pv(const PvArgs& a) {
  const int D = a.D;
  float* vf = static_cast<float*>(a.scratch);  // [32][D]
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int j = 0; j < a.n; ++j)
    for (int c = 0; c < D / 32; ++c) {
      const __m512i x = _mm512_loadu_si512(a.rows[j] + 32 * c);
      _mm512_store_si512(vf + j * D + 32 * c, _mm512_slli_epi32(x, 16));
      _mm512_store_si512(vf + j * D + 32 * c + 16, _mm512_and_si512(x, hi));
    }
  for (int dg = 0; dg < D; dg += 128) {
    switch ((D - dg >= 128 ? 128 : D - dg) / kLanes) {
      case 8: pv_group<8>(vf, D, dg, a); break;
      case 6: pv_group<6>(vf, D, dg, a); break;
      case 4: pv_group<4>(vf, D, dg, a); break;
      case 2: pv_group<2>(vf, D, dg, a); break;
      default: break;  // D % 32 == 0 is checked by the driver
    }
  }
}

void unpermute(const float* src, float mul, float* dst, int D) {
  for (int c = 0; c < D / 32; ++c)
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 16; ++i) dst[32 * c + 2 * i + h] = src[32 * c + 16 * h + i] * mul;
}

}  // namespace
}  // namespace herald

HERALD_AVX512_END

namespace herald {

const Kernels* avx512_kernels() {
  static const Kernels k = {"avx512", &qprep_bytes, &prep_q,   &score_page,
                            &importance, &pv,        &unpermute,
                            &copy_stream, &store_fence};
  return &k;
}

bool cpu_has_avx512bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bf16");
}

}  // namespace herald

#else  // not x86-64: portable path only

namespace herald {
const Kernels* avx512_kernels() { return nullptr; }
bool cpu_has_avx512bf16() { return false; }
}  // namespace herald

#endif
