// Internal interface between the selection driver (select.cpp) and the per-ISA kernels
// (kernels_avx512.cpp, kernels_portable.cpp). Not part of the C ABI.
//
// Data the kernels see, for one (request, KV head) "item" with Qn = n_q * G query rows
// (row = query_index * G + g, g the query head inside the GQA group):
//   K/V page slab: [n rows, D] bf16, contiguous, one page of one KV head.
//   e buffer:      [pages][Qn][Pp] fp32, Pp = page_size rounded up to 16. Holds, per page,
//                  exp(score - page_max) (scores already scaled by D**-0.5); padding lanes are 0.
//   stats:         [pages][Qn] page max and page sum of e (later overwritten by the factor
//                  f = exp(page_max - m) / l, which turns e into softmax probabilities).
#pragma once

#include <cstddef>
#include <cstdint>

namespace herald {

constexpr int kLanes = 16;  // fp32 lanes of one 512-bit vector; Pp is a multiple of it

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

inline float bf16_to_f32(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

// One page of one KV head: scores for all Qn rows, then per-page softmax statistics.
struct PageScoreArgs {
  const uint16_t* k;       // page slab, row s at k + s * D
  int n;                   // valid rows, 1..page_size
  const uint16_t* k_next;  // slab to prefetch (nullptr: none)
  int n_next;
  int prefetch_hint;       // 0 none, 1 T0, 2 T1, 3 NTA
  const void* qprep;       // prepared queries (Kernels::prep_q)
  int Qn, D, Pp;
  float scale;
  float* sbuf;             // scratch [Qn][Pp]
  void* kt;                // scratch, D * Pp * 4 bytes
  float* e;                // out [Qn][Pp] (this page's block of the e buffer, 64-byte aligned)
  float* page_max;         // out [Qn]
  float* page_sum;         // out [Qn]
  bool stream_store;       // write e with non-temporal stores (e buffer larger than the cache)
};

// Accumulate o[q] += sum_j w[q][j] * v_row_j over up to 32 V rows.
struct PvArgs {
  const uint16_t* const* rows;  // n row pointers, each D bf16
  int n;                        // 1..32
  const float* w;               // weights, row q at w + q * ldw, n entries
  int64_t ldw;
  const float* wscale;          // per-row factor (nullptr: 1), row q at wscale[q * ldscale]
  int64_t ldscale;
  int Qn, D;
  float* o;                     // in/out [Qn][D] in the ISA's accumulator order (see unpermute)
  void* scratch;                // >= (32 * D + 16 * Qn) * 4 bytes, 64-byte aligned
};

struct Kernels {
  const char* name;
  // Bytes of prepared queries for Qn rows of D.
  size_t (*qprep_bytes)(int Qn, int D);
  // q rows [Qn][D] bf16 (contiguous) -> the layout score_page reads.
  void (*prep_q)(const uint16_t* q, int Qn, int D, void* out);
  // Returns false if any valid score is NaN or +-inf (outputs are then unspecified).
  bool (*score_page)(const PageScoreArgs& a);
  // imp[s] = sum_q f[p][q] * e[p][q][s] for pages p < npages of one unit; the page p covers
  // positions [p * page_size, p * page_size + rows_p) of imp, rows_p = page_size except the last
  // (last_rows).
  void (*importance)(const float* e, const float* f, int Qn, int Pp, int page_size, int npages,
                     int last_rows, float* imp);
  void (*pv)(const PvArgs& a);
  // One row of D accumulator values -> natural order d = 0..D-1, times `mul`.
  void (*unpermute)(const float* src, float mul, float* dst, int D);
  // Copy `bytes` bytes to memory that is not read again soon by this core (staging buffers, pool
  // pages): non-temporal stores where the ISA has them and `dst` is 64-byte aligned (no
  // read-for-ownership of the destination lines), plain stores otherwise. A thread calls
  // store_fence() after its copies and before anyone else reads them.
  void (*copy_stream)(void* dst, const void* src, size_t bytes);
  void (*store_fence)();
};

const Kernels& portable_kernels();
// nullptr if the library was built without the AVX-512 paths (non-x86 target).
const Kernels* avx512_kernels();      // fp32 FMA (default)
const Kernels* avx512bf16_kernels();  // vdpbf16ps
// True if this CPU and OS can run the AVX-512 BF16 kernels.
bool cpu_has_avx512bf16();
// The kernels whose copy_stream / store_fence a plain copy uses: AVX-512 where it runs and `isa`
// (the herald_select_args codes) does not ask for the portable path.
const Kernels& copy_kernels(int isa);

// Top-k by key (uint32 bit pattern of a non-negative float: order-preserving), ties broken
// toward the smaller index. keys[i] belongs to position pos ? pos[i] : base + i, with positions
// ascending in i. Writes min(k, n) positions, ascending, to out and their keys to out_keys
// (nullable). `scratch` must hold at least 2 * n + 4096 uint32 plus n + 1 int32 (topk_scratch_words).
int select_topk_keys(const uint32_t* keys, const int32_t* pos, int32_t base, int n, int k,
                     int32_t* out, uint32_t* out_keys, uint32_t* scratch);
inline size_t topk_scratch_words(int n) { return 3 * static_cast<size_t>(n) + 4096 + 16; }

}  // namespace herald
