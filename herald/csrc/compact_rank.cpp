// The compact selection's second half (compact_select.cpp has the first): pass 2 over the
// candidates' bf16 rows, the certificate of the top-k, the outputs, and the entry point
// herald_compact_select. Proofs: herald/offload/selection/compact.py.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "compact_select.h"
#include "selection.h"

namespace herald {
namespace compact_detail {

// Exact float32 scores of the n2 rows cpos[0, n2) (raw dots in e3, sums of |x k| in e1). With
// `bounded`, each row's interval becomes [max(lo, score - E), min(hi, score + E)], written in
// place at its index into lo / hi (index <= position, so no later read is overwritten), where E
// bounds our rounding and the exact kernel's; with `check`, a row whose real score lies surely
// outside the pass-1 interval is a VIOLATION. Returns CERTIFIED, VIOLATION or NONFINITE.
int CompactSelection::exact_pass(const CItem& it, CBuf& b, int n2, bool bounded, bool check) const {
  for (int i0 = 0; i0 < n2; i0 += kBlock) {
    const int n = std::min(kBlock, n2 - i0);
    for (int j = 0; j < n; ++j) b.rows[j] = k_row(it, b.cpos[i0 + j]);
    const int nx = std::min(kBlock, n2 - i0 - n);
    for (int j = 0; j < nx; ++j) __builtin_prefetch(k_row(it, b.cpos[i0 + n + j]), 0, 3);
    ck_.exact_scores(b.rows, n, D_, b.x, Qn_, b.kt, b.e3 + i0, b.e1 + i0, ld_);
  }
  const double c = a_.scale, g = gamma_n(D_), rel = 1.0 / 1048576.0;
  for (int q = 0; q < Qn_; ++q) {
    float* lo = b.lo + q * ld_;
    float* hi = b.hi + q * ld_;
    const float* raw = b.e3 + q * ld_;
    const float* ab = b.e1 + q * ld_;
    for (int i = 0; i < n2; ++i) {
      const double s = c * raw[i], sa = c * ab[i];
      if (!std::isfinite(s) || !std::isfinite(sa)) return HERALD_COMPACT_NONFINITE;
      if (!bounded) continue;
      const double e_real = sa * (g + rel) + std::fabs(s) * rel + kTiny;
      const double e_tot = e_real + sa * g;
      const int pos = b.cpos[i];
      const double l = lo[pos], h = hi[pos];
      if (check && (s + e_real < l || s - e_real > h)) return HERALD_COMPACT_VIOLATION;
      lo[i] = static_cast<float>(std::max(l, s - e_tot));
      hi[i] = static_cast<float>(std::min(h, s + e_tot));
    }
  }
  return HERALD_COMPACT_CERTIFIED;
}

// The certificate (compact.py: certify) over nc ranked candidates and n2 - nc tail rows whose
// intervals are in lo / hi [q][i]; theta / eta: the exact kernel's slack per term / per row
// normaliser. On CERTIFIED, b.tmp[0, k) holds the selected candidates' indices ascending.
int CompactSelection::certify(const CItem& it, CBuf& b, int nc, int n2, double theta,
                              double eta) const {
  for (int q = 0; q < Qn_; ++q) {
    float* elo = b.e1 + q * ld_;
    float* ehi = b.e2 + q * ld_;
    ck_.exp_bounds(b.lo + q * ld_, n2, b.shift[q], 0, elo);
    ck_.exp_bounds(b.hi + q * ld_, n2, b.shift[q], 1, ehi);
    b.zlo[q] = (ck_.sum_where(elo, nullptr, n2) + b.rlo[q]) * (1.0 - kRel) * (1.0 - eta);
    b.zhi[q] = (ck_.sum_where(ehi, nullptr, n2) + b.rhi[q]) * (1.0 + kRel) * (1.0 + eta);
  }
  for (int i = 0; i < nc; ++i) {  // ranking keys: importance at the normalisers' midpoints
    double v = 0.0;
    for (int q = 0; q < Qn_; ++q)
      v += 0.5 * (b.e1[q * ld_ + i] + b.e2[q * ld_ + i]) * 2.0 / (b.zlo[q] + b.zhi[q]);
    b.il[i] = static_cast<float>(v);
  }
  select_topk_keys(reinterpret_cast<const uint32_t*>(b.il), nullptr, 0, nc, it.k, b.tmp,
                   nullptr, b.topk);
  if (nc <= it.k) return HERALD_COMPACT_CERTIFIED;
  std::memset(b.sel, 0, static_cast<size_t>(nc));
  for (int j = 0; j < it.k; ++j) b.sel[b.tmp[j]] = 1;
  const double margin = 2.0 * Qn_ * kAbs, pad = 1.0 / 1073741824.0;
  double min_a = INFINITY, max_b = -INFINITY;
  for (int i = 0; i < nc; ++i) {
    double v = 0.0;
    for (int q = 0; q < Qn_; ++q)
      v += b.sel[i] ? b.e1[q * ld_ + i] / b.zhi[q] : b.e2[q * ld_ + i] / b.zlo[q];
    if (b.sel[i]) {
      b.A[i] = v * (1.0 - theta) * (1.0 - pad);
      min_a = std::min(min_a, b.A[i]);
    } else {
      b.B[i] = v * (1.0 + theta) * (1.0 + pad);
      max_b = std::max(max_b, b.B[i]);
    }
  }
  if (min_a > max_b + margin) return HERALD_COMPACT_CERTIFIED;
  int ns = 0, nt = 0;  // ambiguous selected ones (in b.cpos past n2) and unselected (b.keys)
  int32_t* ss = b.cpos + n2;
  for (int i = 0; i < nc; ++i) {
    if (b.sel[i] && b.A[i] <= max_b + margin) ss[ns++] = i;
    if (!b.sel[i] && b.B[i] >= min_a - margin) b.keys[nt++] = static_cast<uint32_t>(i);
  }
  if (static_cast<int64_t>(ns) * nt * Qn_ > kMaxPairWork) return HERALD_COMPACT_PAIRS;
  for (int x = 0; x < ns; ++x) {
    const int s = ss[x];
    for (int y = 0; y < nt; ++y) {
      const int t = static_cast<int>(b.keys[y]);
      if (b.A[s] - b.B[t] > margin) continue;
      double worst = 0.0, mag = 0.0;
      for (int q = 0; q < Qn_; ++q) {
        const double d = (1.0 - theta) * b.e1[q * ld_ + s] - (1.0 + theta) * b.e2[q * ld_ + t];
        const double w = d > 0.0 ? d / b.zhi[q] : d / b.zlo[q];
        worst += w;
        mag += std::fabs(w);
      }
      if (!(worst > margin + mag * 1e-12)) return HERALD_COMPACT_AMBIGUOUS;
    }
  }
  return HERALD_COMPACT_CERTIFIED;
}

// Indices and the selected-mode attention output (softmax over the selected rows and the tail,
// from the pass-2 scores). `all`: every ranked position is selected (k >= R).
void CompactSelection::output(const CItem& it, CBuf& b, int nc, int n2, bool all) const {
  const int64_t rh = static_cast<int64_t>(it.r) * a_.num_kv_heads + it.h;
  int32_t* idx = a_.indices + rh * a_.k_max;
  int m = 0;  // rows: index into the pass-2 arrays, selected ascending then the tail
  int32_t* ri = b.cpos + n2;
  for (int j = 0; j < it.k; ++j) ri[m++] = all ? j : b.tmp[j];
  for (int i = nc; i < n2; ++i) ri[m++] = i;
  for (int j = 0; j < it.k; ++j) idx[j] = b.cpos[ri[j]];
  for (int j = it.k; j < a_.k_max; ++j) idx[j] = -1;
  std::memset(b.o, 0, sizeof(float) * Qn_ * D_);
  for (int q = 0; q < Qn_; ++q) {
    float* sc = b.e1 + q * ld_;
    float mx = -INFINITY;
    for (int j = 0; j < m; ++j) mx = std::max(mx, sc[j] = a_.scale * b.e3[q * ld_ + ri[j]]);
    ck_.exp_bounds(sc, m, mx, 0, b.e2 + q * ld_);
  }
  for (int j0 = 0; j0 < m; j0 += kBlock) {
    const int n = std::min(kBlock, m - j0);
    for (int j = 0; j < n; ++j) b.rows[j] = v_row(it, b.cpos[ri[j0 + j]]);
    ck_.weighted_rows(b.rows, n, D_, b.e2 + j0, ld_, Qn_, b.o, b.vf);
  }
  for (int q = 0; q < Qn_; ++q) {
    const double l = ck_.sum_where(b.e2 + q * ld_, nullptr, m);
    const int qi = q / G_, g = q % G_;
    float* dst = a_.attn_output +
                 ((static_cast<int64_t>(it.r) * a_.n_q + qi) * a_.num_heads + it.h * G_ + g) * D_;
    for (int d = 0; d < D_; ++d) dst[d] = static_cast<float>(b.o[q * D_ + d] / l);
  }
}

int CompactSelection::item(const CItem& it, CBuf& b) {
  if (!prep_query(it, b)) return HERALD_COMPACT_NONFINITE;
  const bool all = it.k >= it.R;
  double theta = 0.0, eta = 0.0;
  int nc = it.R;
  if (all) {
    for (int s = 0; s < it.S; ++s) b.cpos[s] = s;
    for (int s = 0; s < it.R; ++s) b.cand[s] = 1;
  } else {
    if (!first_pass(it, b, &theta, &eta)) return HERALD_COMPACT_NONFINITE;
    nc = candidates(it, b, theta, eta);
  }
  const int n2 = nc + (it.S - it.R);
  const int64_t rh = static_cast<int64_t>(it.r) * a_.num_kv_heads + it.h;
  a_.num_candidates[rh] = nc;
  if (a_.candidates != nullptr) {
    uint8_t* mask = a_.candidates + rh * a_.s_max;
    std::memcpy(mask, b.cand, static_cast<size_t>(it.R));
    std::memset(mask + it.R, 0, static_cast<size_t>(a_.s_max - it.R));
  }
  int st = exact_pass(it, b, n2, !all, a_.check_bounds != 0);
  if (st == HERALD_COMPACT_CERTIFIED && !all) st = certify(it, b, nc, n2, theta, eta);
  if (st == HERALD_COMPACT_CERTIFIED) output(it, b, nc, n2, all);
  return st;
}

int CompactSelection::run(Runtime& rt) {
  if (int rc = plan(); rc != HERALD_OK) return rc;
  const size_t bytes = arena_bytes();
  rt.pool->run([&](int tid) {
    Arena& ar = rt.arenas[tid];
    ar.reset(bytes);
    CBuf b = carve(ar);
    for (;;) {
      const int i = next_.fetch_add(1);
      if (i >= static_cast<int>(items_.size())) break;
      const CItem& it = items_[i];
      a_.status[static_cast<int64_t>(it.r) * a_.num_kv_heads + it.h] = item(it, b);
    }
  });
  return HERALD_OK;
}

}  // namespace compact_detail
}  // namespace herald

extern "C" int32_t herald_compact_select(const herald_compact_args* a) {
  using namespace herald;
  const int qn = a->n_q * (a->num_kv_heads > 0 ? a->num_heads / a->num_kv_heads : 0);
  if (a->n_req < 1 || a->n_q < 1 || a->num_kv_heads < 1 || a->num_heads % a->num_kv_heads != 0 ||
      a->head_dim < 1 || a->head_dim > 512 || a->page_size < 1 || a->max_pages < 1 ||
      a->num_threads < 1 || a->k_max < 1 || a->s_max < 1 || qn > 1024) {
    set_last_error("compact_select: invalid sizes (head_dim <= 512, n_q * group <= 1024)");
    return HERALD_EINVAL;
  }
  const CompactKernels* ck = compact_kernels(a->isa);
  if (ck == nullptr) {
    set_last_error("compact_select: this CPU cannot run the requested ISA");
    return HERALD_EINVAL;
  }
  try {
    std::unique_lock<std::mutex> lock;
    Runtime& rt = acquire_runtime(a->num_threads, &lock);
    compact_detail::CompactSelection sel(*a, *ck);
    return sel.run(rt);
  } catch (const std::exception& e) {
    set_last_error(std::string("compact_select: internal error: ") + e.what());
    return HERALD_EINTERNAL;
  }
}
