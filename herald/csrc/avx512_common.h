// Helpers shared by the AVX-512 kernel files. Include only between HERALD_AVX512_BEGIN and
// HERALD_AVX512_END (this header opens the target region itself; the .cpp closes it).
//
// NOTE: everything compiled inside the region uses AVX-512 instructions. Keep it in an anonymous
// namespace and never instantiate std:: templates here: an inline function with external
// linkage compiled for AVX-512 could be picked by the linker for portable code too and crash a
// CPU without AVX-512.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include "selection.h"

#if defined(__clang__)
// (_Pragma takes one string literal, hence the long line)
#define HERALD_AVX512_BEGIN _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma\"))), apply_to = function)")
#define HERALD_AVX512_END _Pragma("clang attribute pop")
#else
#define HERALD_AVX512_BEGIN \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma\")")
#define HERALD_AVX512_END _Pragma("GCC pop_options")
#endif

HERALD_AVX512_BEGIN

namespace herald {
namespace {

inline __mmask16 tail_mask(int n) {  // lanes [0, n), n in 0..16
  return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

// exp(x) for x <= 0 (larger x works too); ~2 ulp. Cody-Waite range reduction, degree-6 Taylor
// polynomial on |r| <= ln2/2, scalef by 2^n.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline void prefetch_line(const void* p, int hint) {
  const char* c = static_cast<const char*>(p);
  switch (hint) {
    case 1: _mm_prefetch(c, _MM_HINT_T0); break;
    case 2: _mm_prefetch(c, _MM_HINT_T1); break;
    case 3: _mm_prefetch(c, _MM_HINT_NTA); break;
    default: break;
  }
}

// In-place transpose of a 16 x 16 matrix of 32-bit elements held in 16 registers.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
#pragma GCC unroll 8
  for (int a = 0; a < 8; ++a) {
    t[2 * a] = _mm512_unpacklo_epi32(r[2 * a], r[2 * a + 1]);
    t[2 * a + 1] = _mm512_unpackhi_epi32(r[2 * a], r[2 * a + 1]);
  }
  __m512i w[4][4];  // w[b][c]: lane L holds column 4L + c of rows 4b..4b+3
#pragma GCC unroll 4
  for (int b = 0; b < 4; ++b) {
    w[b][0] = _mm512_unpacklo_epi64(t[4 * b], t[4 * b + 2]);
    w[b][1] = _mm512_unpackhi_epi64(t[4 * b], t[4 * b + 2]);
    w[b][2] = _mm512_unpacklo_epi64(t[4 * b + 1], t[4 * b + 3]);
    w[b][3] = _mm512_unpackhi_epi64(t[4 * b + 1], t[4 * b + 3]);
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(w[0][c], w[1][c], 0x44);
    const __m512i x1 = _mm512_shuffle_i32x4(w[0][c], w[1][c], 0xEE);
    const __m512i x2 = _mm512_shuffle_i32x4(w[2][c], w[3][c], 0x44);
    const __m512i x3 = _mm512_shuffle_i32x4(w[2][c], w[3][c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(x0, x2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(x1, x3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
  }
}

// Load rows [0, rows) of a 16 x 32-bf16 block (row stride D elements), zeros past `rows`;
// transposed, so r[j] holds the bf16 pair (2j, 2j+1) of the block for the 16 rows.
// DC: the row stride as a compile-time constant (0: use D), which frees the address registers.
template <bool FULL, int DC = 0>
inline void load_transposed(const uint16_t* src, int D, int rows, __m512i r[16]) {
  const int stride = DC != 0 ? DC : D;
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i)
    r[i] = (FULL || i < rows) ? _mm512_loadu_si512(src + i * stride) : _mm512_setzero_si512();
  transpose16(r);
}

// Step 3 of score_page: per row q, the page max m, e = exp(s - m) (0 in padding lanes) and
// the sum of e. Returns false on a NaN or +-inf score.
inline bool page_stats(const PageScoreArgs& a) {
  const int Pp = a.Pp, n = a.n, nb = (n + kLanes - 1) / kLanes;
  for (int q = 0; q < a.Qn; ++q) {
    const float* s = a.sbuf + q * Pp;
    __m512 mx = _mm512_set1_ps(-__builtin_inff());
    __mmask16 bad = 0;
    for (int c = 0; c < nb; ++c) {
      const __mmask16 m = tail_mask(n - c * kLanes);
      const __m512 v = _mm512_load_ps(s + c * kLanes);
      bad |= static_cast<__mmask16>(_mm512_fpclass_ps_mask(v, 0x99) & m);  // NaN or +-inf
      mx = _mm512_mask_max_ps(mx, m, mx, v);
    }
    if (bad != 0) return false;
    const float mval = _mm512_reduce_max_ps(mx);
    const __m512 mv = _mm512_set1_ps(mval);
    __m512 sum = _mm512_setzero_ps();
    float* e = a.e + q * Pp;
    for (int c = 0; c < Pp / kLanes; ++c) {
      const __mmask16 m = tail_mask(n - c * kLanes);
      const __m512 ex =
          _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_load_ps(s + c * kLanes), mv)));
      if (a.stream_store) {
        _mm512_stream_ps(e + c * kLanes, ex);
      } else {
        _mm512_store_ps(e + c * kLanes, ex);
      }
      sum = _mm512_add_ps(sum, ex);
    }
    a.page_max[q] = mval;
    a.page_sum[q] = _mm512_reduce_add_ps(sum);
  }
  // NOTE: non-temporal stores are weakly ordered; fence so that another thread reading e after
  // the pool's barrier sees them.
  if (a.stream_store) _mm_sfence();
  return true;
}

// Spread the next page's prefetches over the page's transposes: 16 lines per call.
inline void prefetch_some(const PageScoreArgs& a, int* line, int lines) {
  for (int x = 0; x < 16 && *line < lines; ++x, ++*line)
    prefetch_line(reinterpret_cast<const char*>(a.k_next) + 64 * *line, a.prefetch_hint);
}

void importance(const float* e, const float* f, int Qn, int Pp, int page_size, int npages,
                int last_rows, float* imp) {
  for (int p = 0; p < npages; ++p) {
    const int rows = p == npages - 1 ? last_rows : page_size;
    const float* ep = e + static_cast<int64_t>(p) * Qn * Pp;
    const float* fp = f + static_cast<int64_t>(p) * Qn;
    float* out = imp + static_cast<int64_t>(p) * page_size;
    for (int c = 0; c * kLanes < rows; ++c) {
      __m512 acc = _mm512_setzero_ps();
      for (int q = 0; q < Qn; ++q)
        acc = _mm512_fmadd_ps(_mm512_load_ps(ep + q * Pp + c * kLanes), _mm512_set1_ps(fp[q]), acc);
      _mm512_mask_storeu_ps(out + c * kLanes, tail_mask(rows - c * kLanes), acc);
    }
  }
}

// Non-temporal copy: whole 64-byte lines streamed when dst is 64-byte aligned (the source may be
// unaligned), the rest with memcpy. Weakly ordered: store_fence() before the data is read.
void copy_stream(void* dst, const void* src, size_t bytes) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  size_t done = 0;
  if (reinterpret_cast<uintptr_t>(d) % 64 == 0) {
    for (; done + 256 <= bytes; done += 256) {
      const __m512i x0 = _mm512_loadu_si512(s + done);
      const __m512i x1 = _mm512_loadu_si512(s + done + 64);
      const __m512i x2 = _mm512_loadu_si512(s + done + 128);
      const __m512i x3 = _mm512_loadu_si512(s + done + 192);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d + done), x0);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d + done + 64), x1);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d + done + 128), x2);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d + done + 192), x3);
    }
    for (; done + 64 <= bytes; done += 64)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d + done), _mm512_loadu_si512(s + done));
  }
  if (done < bytes) __builtin_memcpy(d + done, s + done, bytes - done);
}

void store_fence() { _mm_sfence(); }

}  // namespace
}  // namespace herald

#endif  // __x86_64__
