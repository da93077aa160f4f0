// Entry points of the compact first pass besides the selection (compact_rank.cpp): the ABI
// version, the ISA this CPU gets, the key quantizer (the CPU pool's int8 copy of K, written
// wherever K is written) and the exhaustive check of the pass's exp bounds.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <vector>

#include "compact.h"
#include "herald_compact.h"
#include "runtime.h"

extern "C" int32_t herald_compact_abi_version(void) { return HERALD_COMPACT_ABI_VERSION; }

extern "C" int32_t herald_compact_best_isa(void) { return herald::compact_best_isa(); }

extern "C" int32_t herald_quantize_keys(const herald_quantize_args* a) {
  using namespace herald;
  if (a->num_layers < 1 || a->num_kv_heads < 1 || a->page_size < 1 || a->head_dim < 1 ||
      a->n < 0 || a->num_threads < 1 || a->num_pages < 1) {
    set_last_error("quantize_keys: invalid sizes");
    return HERALD_EINVAL;
  }
  for (int i = 0; i < a->n; ++i)
    if (a->pages[i] < 0 || a->pages[i] >= a->num_pages) {
      set_last_error("quantize_keys: pages[" + std::to_string(i) + "] = " +
                     std::to_string(a->pages[i]) + " is outside [0, num_pages)");
      return HERALD_EINVAL;
    }
  const CompactKernels* ck = compact_kernels(0);
  const int64_t H = a->num_kv_heads, P = a->page_size, D = a->head_dim;
  const int64_t units = static_cast<int64_t>(a->num_layers) * a->n;
  try {
    std::unique_lock<std::mutex> lock;
    Runtime& rt = acquire_runtime(a->num_threads, &lock);
    std::atomic<int64_t> next{0};
    rt.pool->run([&](int) {
      for (;;) {
        const int64_t u = next.fetch_add(1);
        if (u >= units) break;
        const int64_t l = u / a->n, p = a->pages[u % a->n];
        for (int64_t h = 0; h < H; ++h) {
          const uint16_t* src =
              a->k + l * a->k_layer_stride + p * a->k_page_stride + h * a->k_head_stride;
          const int64_t row = (l * a->num_pages + p) * H + h;
          ck->quantize_rows(src, static_cast<int>(P), static_cast<int>(D), a->q8 + row * P * D,
                            a->scales + row * P);
        }
      }
    });
  } catch (const std::exception& e) {
    set_last_error(std::string("quantize_keys: internal error: ") + e.what());
    return HERALD_EINTERNAL;
  }
  return HERALD_OK;
}

extern "C" double herald_compact_exp_error(int32_t isa, int32_t stride, double* wrong_side) {
  const herald::CompactKernels* ck = herald::compact_kernels(isa);
  *wrong_side = 1.0;
  if (ck == nullptr || stride < 1) return -1.0;
  // Every stride-th float in [-104, 0] (bit patterns 0x80000000 .. that of -104), batched.
  const uint32_t first = 0x80000000u, last = 0xC2D00000u;
  constexpr int kBatch = 4096;
  std::vector<float> x(kBatch), lo(kBatch), hi(kBatch);
  double worst_raw = 0.0, worst_side = -1.0;
  const double f_lo = 1.0 - 1.0 / 8192.0;
  for (uint64_t b0 = first; b0 <= last; b0 += static_cast<uint64_t>(stride) * kBatch) {
    int n = 0;
    for (uint64_t b = b0; n < kBatch && b <= last; b += static_cast<uint64_t>(stride), ++n) {
      const uint32_t bits = static_cast<uint32_t>(b);
      __builtin_memcpy(&x[n], &bits, sizeof(float));
    }
    ck->exp_bounds(x.data(), n, 0.0f, 0, lo.data());
    ck->exp_bounds(x.data(), n, 0.0f, 1, hi.data());
    for (int i = 0; i < n; ++i) {
      const double t = std::exp(static_cast<double>(x[i]));
      worst_side = std::max(worst_side, std::max(lo[i] - t, t - hi[i]) / t);
      if (x[i] >= -87.0f) worst_raw = std::max(worst_raw, std::fabs(lo[i] / f_lo - t) / t);
    }
  }
  *wrong_side = worst_side;
  return worst_raw;
}
