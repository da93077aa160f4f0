// Driver of the compact selection (herald_compact_select; the PyTorch reference and the proofs
// are herald/offload/selection/compact.py). Work item = (request r, KV head h), whole items over
// the pool's threads, longest first. Per item:
//   1. query rows -> int16 (qq, sigma) and the per-row constants of the score bounds;
//   2. pass 1: stream the int8 pages; exact integer dots, score bounds [lo, hi];
//   3. importance bounds from exp(lo - shift), exp(hi - shift) and their sums; tau = the k-th
//      largest lower bound; candidates = ranked positions whose upper bound reaches tau;
//   4. pass 2: the candidates' and the tail's bf16 K rows; exact float32 scores with their
//      rounding bound, checked against the pass-1 interval (a violation is never expected);
//   5. certificate: the candidates' top-k must beat every other candidate for every row
//      normaliser in its bounds (candidates + the other positions' pass-1 bounds);
//   6. certified: indices and the selected-mode attention output (selected rows + tail).
// An item that is not certified leaves its outputs undefined; the caller runs the exact kernel.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "compact_select.h"
#include "selection.h"

namespace herald {
namespace compact_detail {

int CompactSelection::plan() {
  for (int r = 0; r < a_.n_req; ++r) {
    const int S = a_.seq_lens[r], b = a_.budget[r];
    const int tail = a_.tail_lens != nullptr ? a_.tail_lens[r] : 0;
    if (S < 1 || S > static_cast<int64_t>(a_.max_pages) * P_ || S > a_.s_max || b < 1 ||
        tail < 0 || tail > S) {
      set_last_error("compact_select: bad seq_lens / budget / tail_lens for request " +
                     std::to_string(r));
      return HERALD_EINVAL;
    }
    const int np = (S + P_ - 1) / P_;
    for (int pg = 0; pg < np; ++pg)
      if (pid(r, pg) < 0 || pid(r, pg) >= a_.num_pages) {
        set_last_error("compact_select: page_table[" + std::to_string(r) + ", " +
                       std::to_string(pg) + "] is outside [0, num_pages)");
        return HERALD_EINVAL;
      }
    const int k = std::min(b, S - tail);
    if (k > a_.k_max) {
      set_last_error("compact_select: k_max too small for request " + std::to_string(r));
      return HERALD_EINVAL;
    }
    a_.num_selected[r] = k;
    for (int h = 0; h < a_.num_kv_heads; ++h) items_.push_back({r, h, S, S - tail, np, k});
  }
  std::stable_sort(items_.begin(), items_.end(),
                   [](const CItem& x, const CItem& y) { return x.S > y.S; });
  return HERALD_OK;
}

size_t CompactSelection::arena_bytes() const {
  const size_t qs = static_cast<size_t>(Qn_) * ld_, s = static_cast<size_t>(ld_) + 1;
  return 5 * Arena::slot(4 * qs) + Arena::slot(2 * Qn_ * D_) + 3 * Arena::slot(4 * Qn_ * D_) +
         Arena::slot(4 * Qn_ * P_) + 5 * Arena::slot(4 * Qn_) + 6 * Arena::slot(8 * Qn_) +
         2 * Arena::slot(8 * s) + 2 * Arena::slot(4 * s) + 2 * Arena::slot(s) +
         4 * Arena::slot(4 * s) + Arena::slot(4 * topk_scratch_words(static_cast<int>(s))) +
         Arena::slot(4 * kBlock * D_) + Arena::slot(4 * D_) + 4096;
}

CBuf CompactSelection::carve(Arena& ar) const {
  const size_t qs = static_cast<size_t>(Qn_) * ld_, s = static_cast<size_t>(ld_) + 1;
  CBuf b;
  b.lo = ar.take<float>(qs);
  b.hi = ar.take<float>(qs);
  b.e1 = ar.take<float>(qs);
  b.e2 = ar.take<float>(qs);
  b.e3 = ar.take<float>(qs);
  b.qq = ar.take<int16_t>(static_cast<size_t>(Qn_) * D_);
  b.x = ar.take<float>(static_cast<size_t>(Qn_) * D_);
  b.o = ar.take<float>(static_cast<size_t>(Qn_) * D_);
  b.dot = ar.take<int32_t>(static_cast<size_t>(Qn_) * P_);
  for (float** p : {&b.alpha, &b.rho, &b.shift, &b.inv_zhi, &b.zlo_f}) *p = ar.take<float>(Qn_);
  for (double** p : {&b.zlo, &b.zhi, &b.rlo, &b.rhi}) *p = ar.take<double>(Qn_);
  b.A = ar.take<double>(s);
  b.B = ar.take<double>(s);
  b.il = ar.take<float>(s);
  b.iu = ar.take<float>(s);
  b.cand = ar.take<uint8_t>(s);
  b.sel = ar.take<uint8_t>(s);
  b.cpos = ar.take<int32_t>(2 * s);  // positions, then scratch of the certificate / output
  b.tmp = ar.take<int32_t>(s);
  b.keys = ar.take<uint32_t>(s);
  b.topk = ar.take<uint32_t>(topk_scratch_words(static_cast<int>(s)));
  b.kt = ar.take<float>(static_cast<size_t>(kBlock) * D_);
  b.vf = ar.take<float>(D_);
  return b;
}

// Query rows of the item (row = qi * G + g) -> fp32 x, int16 qq and the bound constants.
bool CompactSelection::prep_query(const CItem& it, CBuf& b) const {
  const double c = a_.scale;
  for (int q = 0; q < Qn_; ++q) {
    const int qi = q / G_, g = q % G_;
    const uint16_t* src =
        a_.q + ((static_cast<int64_t>(it.r) * a_.n_q + qi) * a_.num_heads + it.h * G_ + g) * D_;
    float* x = b.x + static_cast<int64_t>(q) * D_;
    double m = 0.0, l1 = 0.0;
    for (int d = 0; d < D_; ++d) {
      x[d] = bf16_to_f32(src[d]);
      if (!std::isfinite(x[d])) return false;
      m = std::max(m, static_cast<double>(std::fabs(x[d])));
      l1 += std::fabs(static_cast<double>(x[d]));
    }
    l1 *= 1.0 + 1e-12;  // its float64 sum's rounding
    const double sigma = m > 0.0 ? m / 32767.0 : 1.0;
    for (int d = 0; d < D_; ++d)
      b.qq[q * D_ + d] = static_cast<int16_t>(std::nearbyint(x[d] / sigma));
    const double bq = kResidual * (l1 + 127.0 * D_ * sigma);
    const double kern = c * gamma_n(D_) * (1.0 + 4.0 * kU) * 127.0 * l1;
    b.alpha[q] = static_cast<float>(c * sigma);
    b.rho[q] = static_cast<float>((c * bq + kern) * (1.0 + 1.0 / 1048576.0) * a_.radius_scale);
  }
  return true;
}

// Pass 1 over the int8 pages: lo / hi, the row shifts, and the exact kernel's rounding slack:
// theta per importance term, eta per row normaliser (compact.py: kernel_slack).
bool CompactSelection::first_pass(const CItem& it, CBuf& b, double* theta, double* eta) const {
  const int64_t slab = static_cast<int64_t>(P_) * D_;
  int bad = 0;
  float smax = 0.0f;
  for (int q = 0; q < Qn_; ++q) b.shift[q] = -3.0e38f;
  for (int pg = 0; pg < it.np; ++pg) {
    const int64_t p = pid(it.r, pg), n = std::min(P_, it.S - pg * P_);
    const int8_t* k8 = a_.q8_pages + (p * a_.num_kv_heads + it.h) * slab;
    const float* s = a_.scale_pages + (p * a_.num_kv_heads + it.h) * P_;
    if (pg + 1 < it.np) {
      const int64_t p1 = pid(it.r, pg + 1);
      const char* nx = reinterpret_cast<const char*>(a_.q8_pages + (p1 * a_.num_kv_heads + it.h) * slab);
      for (int64_t o = 0; o < slab; o += 64) __builtin_prefetch(nx + o, 0, 3);
    }
    for (int j = 0; j < n; ++j) smax = s[j] > smax ? s[j] : smax;
    ck_.int_dots(k8, static_cast<int>(n), D_, b.qq, Qn_, b.dot, P_);
    for (int q = 0; q < Qn_; ++q) {
      const int64_t off = q * ld_ + static_cast<int64_t>(pg) * P_;
      const float m = ck_.score_bounds(b.dot + q * P_, s, static_cast<int>(n), b.alpha[q],
                                       b.rho[q], b.lo + off, b.hi + off, &bad);
      b.shift[q] = std::max(b.shift[q], m);
    }
  }
  if (bad != 0 || !std::isfinite(smax)) return false;
  // Score range for the kernel's exp arguments: |score| <= c ||x||_1 max|k| (Hoelder).
  double l1max = 0.0;
  for (int q = 0; q < Qn_; ++q) {
    double l1 = 0.0;
    for (int d = 0; d < D_; ++d) l1 += std::fabs(static_cast<double>(b.x[q * D_ + d]));
    l1max = std::max(l1max, l1);
  }
  const double span = 2.0 * a_.scale * l1max * 127.0 * smax * 1.01;
  *theta = gamma_n(Qn_ + 8.0) + 4.0 / 1048576.0 + 4.0 * kU * span;
  *eta = gamma_n(2.0 * it.S + Qn_ + 320.0) + 4.0 / 1048576.0 + 4.0 * kU * span;
  return true;
}

// Importance bounds, tau, the candidate mask and list (ranked candidates, then the tail);
// also the other positions' normaliser sums. Returns the number of ranked candidates.
int CompactSelection::candidates(const CItem& it, CBuf& b, double theta, double eta) const {
  for (int q = 0; q < Qn_; ++q) {
    float* elo = b.e1 + q * ld_;
    float* ehi = b.e2 + q * ld_;
    ck_.exp_bounds(b.lo + q * ld_, it.S, b.shift[q], 0, elo);
    ck_.exp_bounds(b.hi + q * ld_, it.S, b.shift[q], 1, ehi);
    const double zlo = ck_.sum_where(elo, nullptr, it.S) * (1.0 - kRel);
    const double zhi = ck_.sum_where(ehi, nullptr, it.S) * (1.0 + kRel);
    b.zlo_f[q] = static_cast<float>(zlo) * (1.0f - 1.0f / 8192.0f);
    b.inv_zhi[q] = static_cast<float>(1.0 / zhi);
  }
  ck_.importance_bounds(b.e1, b.e2, ld_, Qn_, it.R, b.inv_zhi, b.zlo_f, b.il, b.iu);
  const float fl = static_cast<float>((1.0 - theta) * (1.0 - kRel) * (1.0 - kRel) / (1.0 + eta));
  const float fu = static_cast<float>((1.0 + theta) * (1.0 + kRel) * (1.0 + kRel) / (1.0 - eta));
  const float ab = static_cast<float>(Qn_ * kAbs);
  for (int s = 0; s < it.R; ++s) {
    b.il[s] = std::max(0.0f, b.il[s] * fl - ab);
    b.iu[s] = b.iu[s] * fu + ab;
  }
  select_topk_keys(reinterpret_cast<const uint32_t*>(b.il), nullptr, 0, it.R, it.k, b.tmp,
                   b.keys, b.topk);
  uint32_t tk = b.keys[0];
  for (int j = 1; j < it.k; ++j) tk = std::min(tk, b.keys[j]);
  float tau;
  std::memcpy(&tau, &tk, sizeof tau);
  int nc = 0;
  for (int s = 0; s < it.R; ++s) {
    b.cand[s] = b.iu[s] >= tau;
    b.cpos[nc] = s;
    nc += b.cand[s];
  }
  for (int q = 0; q < Qn_; ++q) {
    b.rlo[q] = ck_.sum_where(b.e1 + q * ld_, b.cand, it.R);
    b.rhi[q] = ck_.sum_where(b.e2 + q * ld_, b.cand, it.R);
  }
  for (int t = it.R; t < it.S; ++t) b.cpos[nc + t - it.R] = t;
  return nc;
}

}  // namespace compact_detail
}  // namespace herald
