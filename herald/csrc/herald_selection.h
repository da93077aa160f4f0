// Plain C ABI of the CPU selection kernel (HERALD §IV-B4).
//
// Loaded from Python through ctypes (herald/offload/selection/_kernel.py mirrors these structs
// field by field; bump HERALD_ABI_VERSION on any change). No libtorch, no Python headers: every
// tensor is a raw pointer plus the sizes and strides needed to read it. All element types are
// fixed: bf16 as uint16_t, int32 indices, fp32 outputs.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// The library is built with -fvisibility=hidden; only these entry points are exported.
#define HERALD_API __attribute__((visibility("default")))

#define HERALD_ABI_VERSION 6

// Return codes of the entry points; herald_last_error() holds the message.
#define HERALD_OK 0
#define HERALD_EINVAL 1     // bad argument (page id out of range, unsupported ISA, ...)
#define HERALD_ENONFINITE 2 // a NaN/inf attention score: NaN or inf in q or K
#define HERALD_EINTERNAL 3  // allocation failure or other internal error

// Fused attention + top-k selection for a batch of requests of one layer.
//
// Positions [0, S) of request r (S = seq_lens[r]) split into the ranked part [0, R) and the tail
// [R, S), R = S - tail_lens[r] (tail: a draft block that the sparse attention always sees). Softmax
// statistics and importance cover all S positions; top-k (k = min(budget[r], R), 0 allowed) is taken
// over the ranked part only, so the tail never appears in `indices`. Selected mode attends over the
// selected rows and the tail rows. With `gather_out`, each item also copies its selected K and V
// rows there (the layout of herald_gather_args.out) as soon as its top-k is known, with
// non-temporal stores on the AVX-512 paths: the gather without a second pass over the items.
typedef struct {
  int32_t n_req, n_q, num_heads, num_kv_heads, head_dim, page_size, max_pages;
  int32_t k_max;    // columns of `indices` (>= min(budget[r], seq_lens[r] - tail_lens[r]) for all r)
  int32_t s_max;    // columns of `importance` (>= seq_lens[r] for every r)
  int32_t output_mode;  // 0: full (attention over all S keys), 1: selected (selected + tail rows)
  int32_t isa;  // 0: auto, 1: avx512 fp32-FMA, 2: portable, 3: avx512 vdpbf16ps (1, 3: error if unsupported)
  int32_t num_threads;  // >= 1
  int32_t schedule;     // 0: auto, 1: whole (request, KV head) items, 2: tiles of S
  int32_t prefetch_hint;      // 0: none, 1: T0, 2: T1, 3: NTA
  int32_t prefetch_distance;  // pages ahead (>= 1)
  int32_t _pad0;
  int64_t num_pages;
  int64_t page_stride, head_stride;  // elements; a page slab [page_size, head_dim] is contiguous
  float scale;                       // score scale, head_dim ** -0.5
  int32_t _pad1;
  const uint16_t* q;        // [n_req, n_q, num_heads, head_dim] contiguous
  const uint16_t* k_pages;  // [num_pages, num_kv_heads, page_size, head_dim] with the strides above
  const uint16_t* v_pages;  // same shape and strides as k_pages
  const int32_t* page_table;  // [n_req, max_pages]
  const int32_t* seq_lens;    // [n_req], 1 <= S <= max_pages * page_size
  const int32_t* budget;      // [n_req], >= 1
  int32_t* indices;           // out [n_req, num_kv_heads, k_max], ascending, -1 padded
  int32_t* num_selected;      // out [n_req]
  float* attn_output;         // out [n_req, n_q, num_heads, head_dim]
  float* importance;          // out [n_req, num_kv_heads, s_max] or NULL
  const int32_t* tail_lens;   // [n_req], 0 <= tail <= S, or NULL (no tail)
  uint16_t* gather_out;       // out [2, n_req, num_kv_heads, k_max, head_dim] contiguous, or NULL;
                              // rows past num_selected[r] untouched
} herald_select_args;

// Copy the selected K and V rows into out[2, n_req, num_kv_heads, k_max, head_dim] (bf16), with
// non-temporal stores on the AVX-512 path.
typedef struct {
  int32_t n_req, num_kv_heads, head_dim, page_size, max_pages, k_max, num_threads;
  int32_t isa;  // as herald_select_args.isa (2: portable stores; anything else: the best here)
  int64_t num_pages, page_stride, head_stride;
  const uint16_t* k_pages;
  const uint16_t* v_pages;
  const int32_t* page_table;    // [n_req, max_pages]
  const int32_t* indices;       // [n_req, num_kv_heads, k_max]
  const int32_t* num_selected;  // [n_req], each <= k_max
  uint16_t* out;                // [2, n_req, num_kv_heads, k_max, head_dim] contiguous
} herald_gather_args;

// Scatter blocks into pages: dst[o, index[i]] = src[o, i] for o < outer, i < n, each a run of
// block_bytes bytes (src [outer, n, block], dst [outer, num_dst, block], both contiguous): the
// CPU pool's block hand-off, on the kernel's own threads, with non-temporal stores on the
// AVX-512 path (the pages are read next by other cores, from memory).
typedef struct {
  int32_t outer, n, num_dst, num_threads;
  int32_t isa;  // as herald_gather_args.isa
  int32_t _pad0;
  int64_t block_bytes;
  const void* src;
  void* dst;
  const int64_t* index;  // [n], each in [0, num_dst)
} herald_scatter_args;

HERALD_API int32_t herald_abi_version(void);
HERALD_API const char* herald_source_hash(void);  // hash of the sources this library was built from
HERALD_API int32_t herald_cpu_has_avx512bf16(void);  // 1 if the AVX-512 BF16 path can run here
HERALD_API const char* herald_last_error(void);   // message of the last failed call on this thread
HERALD_API int32_t herald_select_topk(const herald_select_args* args);
HERALD_API int32_t herald_gather_selected(const herald_gather_args* args);
HERALD_API int32_t herald_scatter_blocks(const herald_scatter_args* args);
// Sum `nbytes` bytes at `data` with `num_threads` threads (a DRAM read-bandwidth probe).
HERALD_API double herald_read_probe(const void* data, int64_t nbytes, int32_t num_threads);

#ifdef __cplusplus
}
#endif
