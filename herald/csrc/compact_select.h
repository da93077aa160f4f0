// The compact selection's per-call state (compact_select.cpp: plan, pass 1, candidates;
// compact_rank.cpp: pass 2, certificate, outputs, the entry point). Internal to the library.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "compact.h"
#include "herald_compact.h"
#include "runtime.h"

namespace herald {
namespace compact_detail {

constexpr double kU = 1.0 / 16777216.0;           // float32 unit roundoff, 2**-24
constexpr double kResidual = 0.5 + 1.0 / 4096.0;  // |k - s q8| <= kResidual s
constexpr double kRel = 1.0 / 8192.0;             // slack of the bounds' own arithmetic
constexpr double kAbs = 7.888609052210118e-31;    // 2**-100 per row: underflowed terms
constexpr double kTiny = 1.1754943508222875e-38;  // 2**-126
constexpr int64_t kMaxPairWork = int64_t{1} << 24;
constexpr int kBlock = 64;  // rows per exact_scores call

inline double gamma_n(double n) { return n * kU / (1.0 - n * kU); }

struct CItem {
  int r, h, S, R, np, k;
};

// Per-thread slices of the arena; [Qn][S] buffers have leading dimension ld = s_max.
struct CBuf {
  int16_t* qq;
  float *x, *alpha, *rho, *shift, *inv_zhi, *zlo_f;
  double *zlo, *zhi, *rlo, *rhi, *A, *B;
  int32_t* dot;
  float *lo, *hi, *e1, *e2, *e3, *il, *iu, *kt, *vf, *o;
  uint8_t *cand, *sel;
  int32_t *cpos, *tmp;
  uint32_t *keys, *topk;
  const uint16_t* rows[kBlock];
};

class CompactSelection {
 public:
  CompactSelection(const herald_compact_args& a, const CompactKernels& ck)
      : a_(a), ck_(ck), G_(a.num_heads / a.num_kv_heads), Qn_(a.n_q * G_), D_(a.head_dim),
        P_(a.page_size), ld_(a.s_max) {}
  int run(Runtime& rt);

 private:
  int plan();
  size_t arena_bytes() const;
  CBuf carve(Arena& ar) const;
  int64_t pid(int r, int pg) const { return a_.page_table[static_cast<int64_t>(r) * a_.max_pages + pg]; }
  const uint16_t* k_row(const CItem& it, int pos) const {
    return a_.k_pages + pid(it.r, pos / P_) * a_.page_stride + it.h * a_.head_stride +
           static_cast<int64_t>(pos % P_) * D_;
  }
  const uint16_t* v_row(const CItem& it, int pos) const {
    return a_.v_pages + pid(it.r, pos / P_) * a_.page_stride + it.h * a_.head_stride +
           static_cast<int64_t>(pos % P_) * D_;
  }
  int item(const CItem& it, CBuf& b);
  bool prep_query(const CItem& it, CBuf& b) const;
  bool first_pass(const CItem& it, CBuf& b, double* theta, double* eta) const;
  int candidates(const CItem& it, CBuf& b, double theta, double eta) const;
  int exact_pass(const CItem& it, CBuf& b, int n2, bool bounded, bool check) const;
  int certify(const CItem& it, CBuf& b, int nc, int n2, double theta, double eta) const;
  void output(const CItem& it, CBuf& b, int nc, int n2, bool all) const;

  const herald_compact_args& a_;
  const CompactKernels& ck_;
  int G_, Qn_, D_, P_;
  int64_t ld_;
  std::vector<CItem> items_;
  std::atomic<int> next_{0};
};

}  // namespace compact_detail
}  // namespace herald
