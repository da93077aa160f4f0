// C ABI of the compact first pass of the CPU selection (HERALD §IV-B4): an int8 copy of K with
// one float32 scale per (token, KV head), certified score and importance bounds from it, a
// candidate set that provably holds the exact top-k, and an exact re-rank of the candidates.
//
// Loaded through ctypes (herald/offload/selection/compact_cpu.py mirrors these structs field by
// field; bump HERALD_COMPACT_ABI_VERSION on any change). The PyTorch reference and the proofs of
// the bounds are herald/offload/selection/compact.py.
#pragma once

#include <stdint.h>

#include "herald_selection.h"  // HERALD_API and the return codes

#ifdef __cplusplus
extern "C" {
#endif

#define HERALD_COMPACT_ABI_VERSION 1

// Per-item outcome of herald_compact_select (compact.py: CERTIFIED, ...).
#define HERALD_COMPACT_CERTIFIED 0   // indices equal the exact kernel's
#define HERALD_COMPACT_AMBIGUOUS 1   // the normaliser bounds leave the k-th place open
#define HERALD_COMPACT_VIOLATION 2   // an exact score outside its certified interval (a bug)
#define HERALD_COMPACT_NONFINITE 3   // NaN/inf in q, a scale or a score
#define HERALD_COMPACT_PAIRS 4       // the pairwise certificate would cost too much

// Quantize whole pages: for every layer l < num_layers and page id pages[i], each (KV head,
// slot) row of D bf16 keys -> D int8 and one float32 scale (compact.py: quantize_keys, same
// bits). Source K of layer l, page p, head h, slot t, element d at
//   k + l * k_layer_stride + p * k_page_stride + h * k_head_stride + t * D + d,
// destination int8 at q8 + ((l * num_pages + p) * H + h) * P * D + t * D + d and scale at
// scales + ((l * num_pages + p) * H + h) * P + t.
typedef struct {
  int32_t num_layers, num_kv_heads, page_size, head_dim, n, num_threads;
  int64_t num_pages;
  int64_t k_layer_stride, k_page_stride, k_head_stride;  // elements
  const uint16_t* k;
  const int64_t* pages;  // [n] page ids in [0, num_pages)
  int8_t* q8;            // [num_layers, num_pages, H, P, D]
  float* scales;         // [num_layers, num_pages, H, P]
} herald_quantize_args;

// The compact selection of one layer, "selected" output mode only (attention over the selected
// rows and the tail, exact from the re-read bf16 rows). Sizes, pages and tails as in
// herald_select_args; the int8 pages and scales of the layer have the layout above (one layer:
// q8 [num_pages, H, P, D], scales [num_pages, H, P]). Outputs of an item are defined when its
// status is HERALD_COMPACT_CERTIFIED; the caller runs the exact kernel otherwise.
typedef struct {
  int32_t n_req, n_q, num_heads, num_kv_heads, head_dim, page_size, max_pages, k_max, s_max;
  int32_t num_threads;
  int32_t isa;            // 0: best here, 1: AVX-512 (VNNI), 2: portable, 3: AVX2
  int32_t check_bounds;   // 1: flag an exact score outside its interval (VIOLATION); tests: 0
  float radius_scale;     // 1.0; tests shrink it to show that a loosened bound is caught
  float scale;            // score scale, float32(head_dim ** -0.5)
  int64_t num_pages;
  int64_t page_stride, head_stride;  // of k_pages / v_pages, elements
  const uint16_t* q;           // [n_req, n_q, num_heads, head_dim] contiguous
  const uint16_t* k_pages;
  const uint16_t* v_pages;
  const int8_t* q8_pages;      // [num_pages, H, P, D]
  const float* scale_pages;    // [num_pages, H, P]
  const int32_t* page_table;   // [n_req, max_pages]
  const int32_t* seq_lens;     // [n_req]
  const int32_t* budget;       // [n_req]
  const int32_t* tail_lens;    // [n_req] or NULL
  int32_t* indices;            // out [n_req, H, k_max], ascending, -1 padded
  int32_t* num_selected;       // out [n_req]
  float* attn_output;          // out [n_req, n_q, num_heads, head_dim]
  int32_t* status;             // out [n_req, H]
  int32_t* num_candidates;     // out [n_req, H]: ranked positions re-read in bf16
  uint8_t* candidates;         // out [n_req, H, s_max] candidate mask, or NULL
} herald_compact_args;

HERALD_API int32_t herald_compact_abi_version(void);
// Which kernels isa 0 picks here: 1 AVX-512, 2 portable, 3 AVX2.
HERALD_API int32_t herald_compact_best_isa(void);
HERALD_API int32_t herald_quantize_keys(const herald_quantize_args* args);
HERALD_API int32_t herald_compact_select(const herald_compact_args* args);
// Largest relative error of the pass's exp bounds over the float32 arguments in [-87, 0] taken
// with `stride` (1: every one), against exp in double, signed so that a value > 0 means a bound
// on the wrong side (returned in *wrong_side); for tests of the proof's 2**-20.
HERALD_API double herald_compact_exp_error(int32_t isa, int32_t stride, double* wrong_side);

#ifdef __cplusplus
}
#endif
