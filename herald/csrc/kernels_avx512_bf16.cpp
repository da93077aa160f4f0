// AVX-512 kernels of the selection kernel, vdpbf16ps variant (HERALD_SELECTION_ISA=avx512bf16).
//
// Same contract as kernels_avx512.cpp, with the multiply-adds done by vdpbf16ps on bf16 pairs:
// scores from K transposed to kt[pair][slot] (no widening), P @ V with the weights rounded to
// bf16. Kept for comparison: on Sapphire/Emerald Rapids vdpbf16ps zmm retires ~0.5/cycle, half
// the multiply-add rate of the fp32-FMA variant (see bench results).
#include "selection.h"

#if defined(__x86_64__)
#include "avx512_common.h"  // opens the AVX-512 target region

namespace herald {
namespace {

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

size_t qprep_bytes(int Qn, int D) { return static_cast<size_t>(Qn) * D * 2; }

void prep_q(const uint16_t* q, int Qn, int D, void* out) {
  __builtin_memcpy(out, q, static_cast<size_t>(Qn) * D * 2);
}

// Scores of QB query rows against NB blocks of 16 keys; kt: [D/2][Pp] bf16-pair dwords.
template <int QB, int NB>
inline void score_rows(const uint32_t* kt, int Pp, int sb, const uint32_t* qw, int q0, int D2,
                       float scale, float* sbuf) {
  __m512 acc[QB][NB];
  for (int i = 0; i < QB; ++i)
    for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_setzero_ps();
  const uint32_t* kp = kt + sb * kLanes;
  for (int p = 0; p < D2; ++p) {
    __m512i kv[NB];
    for (int b = 0; b < NB; ++b) kv[b] = _mm512_load_si512(kp + p * Pp + b * kLanes);
    for (int i = 0; i < QB; ++i) {
      const __m512i qb = _mm512_set1_epi32(static_cast<int>(qw[(q0 + i) * D2 + p]));
      for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_dpbf16_ps(acc[i][b], as_bh(kv[b]), as_bh(qb));
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int i = 0; i < QB; ++i)
    for (int b = 0; b < NB; ++b)
      _mm512_store_ps(sbuf + (q0 + i) * Pp + (sb + b) * kLanes, _mm512_mul_ps(acc[i][b], sc));
}

template <int QB>
void score_qblock(const uint32_t* kt, int Pp, int nb, const uint32_t* qw, int q0, int D2,
                  float scale, float* sbuf) {
  int sb = 0;
  for (; sb + 1 < nb; sb += 2) score_rows<QB, 2>(kt, Pp, sb, qw, q0, D2, scale, sbuf);
  if (sb < nb) score_rows<QB, 1>(kt, Pp, sb, qw, q0, D2, scale, sbuf);
}

bool score_page(const PageScoreArgs& a) {
  const int D = a.D, D2 = D / 2, Pp = a.Pp, n = a.n, nb = (n + kLanes - 1) / kLanes;
  uint32_t* kt = static_cast<uint32_t*>(a.kt);
  const int lines = a.k_next != nullptr ? a.n_next * D / 32 : 0;
  int line = 0;
  for (int b = 0; b < nb; ++b) {
    const int rows = n - b * kLanes < kLanes ? n - b * kLanes : kLanes;
    for (int c = 0; c < D / 32; ++c) {
      __m512i r[16];
      const uint16_t* src = a.k + b * kLanes * D + 32 * c;
      if (rows == kLanes) {
        load_transposed<true>(src, D, rows, r);
      } else {
        load_transposed<false>(src, D, rows, r);
      }
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) _mm512_store_si512(kt + (16 * c + j) * Pp + b * kLanes, r[j]);
      prefetch_some(a, &line, lines);
    }
  }
  const uint32_t* qw = static_cast<const uint32_t*>(a.qprep);
  int q0 = 0;
  for (; q0 + 8 <= a.Qn; q0 += 8) score_qblock<8>(kt, Pp, nb, qw, q0, D2, a.scale, a.sbuf);
  switch (a.Qn - q0) {
    case 1: score_qblock<1>(kt, Pp, nb, qw, q0, D2, a.scale, a.sbuf); break;
    case 2: score_qblock<2>(kt, Pp, nb, qw, q0, D2, a.scale, a.sbuf); break;
    case 3: score_qblock<3>(kt, Pp, nb, qw, q0, D2, a.scale, a.sbuf); break;
    case 4: score_qblock<4>(kt, Pp, nb, qw, q0, D2, a.scale, a.sbuf); break;
    case 5: score_qblock<5>(kt, Pp, nb, qw, q0, D2, a.scale, a.sbuf); break;
    case 6: score_qblock<6>(kt, Pp, nb, qw, q0, D2, a.scale, a.sbuf); break;
    case 7: score_qblock<7>(kt, Pp, nb, qw, q0, D2, a.scale, a.sbuf); break;
    default: break;
  }
  return page_stats(a);
}

// P @ V: V rows interleaved in pairs (row 2j, 2j+1) along D, so one dword holds
// (v[2j][d], v[2j+1][d]) and the two rows' bf16 weights form the broadcast dword.
// unpacklo/hi_epi16 work per 128-bit lane: accumulator 32c + 16h + 4L + t holds
// d = 32c + 8L + 4h + t.
template <int NZ, int QB>
inline void pv_block(const uint32_t* vt, int D, int dg, int np, const uint32_t* wp, int q0,
                     float* o) {
  __m512 acc[QB][NZ];
  for (int i = 0; i < QB; ++i)
    for (int z = 0; z < NZ; ++z) acc[i][z] = _mm512_setzero_ps();
  for (int j = 0; j < np; ++j) {
    __m512i v[NZ];
    for (int z = 0; z < NZ; ++z) v[z] = _mm512_load_si512(vt + j * D + dg + z * kLanes);
    for (int i = 0; i < QB; ++i) {
      const __m512i w = _mm512_set1_epi32(static_cast<int>(wp[(q0 + i) * 16 + j]));
      for (int z = 0; z < NZ; ++z) acc[i][z] = _mm512_dpbf16_ps(acc[i][z], as_bh(v[z]), as_bh(w));
    }
  }
  for (int i = 0; i < QB; ++i)
    for (int z = 0; z < NZ; ++z) {
      float* dst = o + (q0 + i) * D + dg + z * kLanes;
      _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), acc[i][z]));
    }
}

template <int NZ>
void pv_group(const uint32_t* vt, int D, int dg, int np, const uint32_t* wp, int Qn, float* o) {
  int q0 = 0;
  for (; q0 + 2 <= Qn; q0 += 2) pv_block<NZ, 2>(vt, D, dg, np, wp, q0, o);
  if (q0 < Qn) pv_block<NZ, 1>(vt, D, dg, np, wp, q0, o);
}

void pv(const PvArgs& a) {
  const int D = a.D, n = a.n, np = (n + 1) / 2;
  uint32_t* vt = static_cast<uint32_t*>(a.scratch);  // [16][D] dwords
  uint32_t* wp = vt + 16 * D;                         // [Qn][16] dwords
  for (int j = 0; j < np; ++j) {
    const uint16_t* ra = a.rows[2 * j];
    const uint16_t* rb = 2 * j + 1 < n ? a.rows[2 * j + 1] : nullptr;
    for (int c = 0; c < D / 32; ++c) {
      const __m512i x = _mm512_loadu_si512(ra + 32 * c);
      const __m512i y = rb != nullptr ? _mm512_loadu_si512(rb + 32 * c) : _mm512_setzero_si512();
      _mm512_store_si512(vt + j * D + 32 * c, _mm512_unpacklo_epi16(x, y));
      _mm512_store_si512(vt + j * D + 32 * c + 16, _mm512_unpackhi_epi16(x, y));
    }
  }
  const __mmask16 mlo = tail_mask(n), mhi = tail_mask(n - 16);
  for (int q = 0; q < a.Qn; ++q) {
    const float* w = a.w + q * a.ldw;
    __m512 lo = _mm512_maskz_loadu_ps(mlo, w), hi = _mm512_maskz_loadu_ps(mhi, w + 16);
    if (a.wscale != nullptr) {
      const __m512 sc = _mm512_set1_ps(a.wscale[q * a.ldscale]);
      lo = _mm512_mul_ps(lo, sc);
      hi = _mm512_mul_ps(hi, sc);
    }
    _mm512_store_si512(wp + q * 16, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
  for (int dg = 0; dg < D; dg += 128) {
    switch ((D - dg >= 128 ? 128 : D - dg) / kLanes) {
      case 8: pv_group<8>(vt, D, dg, np, wp, a.Qn, a.o); break;
      case 6: pv_group<6>(vt, D, dg, np, wp, a.Qn, a.o); break;
      case 4: pv_group<4>(vt, D, dg, np, wp, a.Qn, a.o); break;
      case 2: pv_group<2>(vt, D, dg, np, wp, a.Qn, a.o); break;
      default: break;
    }
  }
}

void unpermute(const float* src, float mul, float* dst, int D) {
  for (int c = 0; c < D / 32; ++c)
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 16; ++i)
        dst[32 * c + 8 * (i / 4) + 4 * h + (i % 4)] = src[32 * c + 16 * h + i] * mul;
}

}  // namespace
}  // namespace herald

HERALD_AVX512_END

namespace herald {
const Kernels* avx512bf16_kernels() {
  static const Kernels k = {"avx512bf16", &qprep_bytes, &prep_q,   &score_page,
                            &importance,  &pv,          &unpermute,
                            &copy_stream, &store_fence};
  return &k;
}
}  // namespace herald

#else

namespace herald {
const Kernels* avx512bf16_kernels() { return nullptr; }
}  // namespace herald

#endif
