// Driver of the fused attention + top-k selection kernel (HERALD §IV-B4).
//
// Work item = (request r, KV head h): Qn = n_q * G query rows against S prefix keys held in
// pages. Per item, in three steps:
//   A. scan:  stream the K pages once; per page the scores of all Qn rows, stored as
//             e = exp(score - page_max) with the page's (max, sum) statistics (per-thread buffer,
//             so ranking needs no second read of K);
//   B. rank:  global (m, l) per row from the page statistics, importance
//             imp[s] = sum_rows exp(score - m) / l, top-k over the ranked positions [0, R) (the
//             tail [R, S) is scored and normalised like any key, but never ranked); in full mode
//             also P @ V over all pages;
//   C. finish: (tiles only) merge the per-tile top-k; selected mode: P @ V over the selected rows
//             and the tail rows only, renormalised; write indices / outputs; with gather_out,
//             copy the selected K and V rows into the staging layout (V rows just read by
//             P @ V in selected mode are still in this core's cache).
// Scheduling: whole items over threads (dynamic, longest first) when that balances well;
// otherwise the pages of all items are cut into one contiguous tile per thread, with barriers
// between A, B and C (the pool's run() calls). A tile's B runs on the thread that ran its A, so
// its e buffer is still in that core's cache.
// Batch invariance: an item's results (importance bits, indices, outputs) do not depend on the
// schedule, so not on which other requests share the call nor on the thread count. The row
// statistics are summed page by page in position order whatever the cut; full mode's P @ V
// keeps one partial per group of kGroupPages pages, tiles are cut on group boundaries, and the
// partials are added in group order; the tiles' top-k merge is exact (same keys, same
// tie rule: larger key, then lower position).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "herald_selection.h"
#include "runtime.h"
#include "selection.h"

namespace herald {
namespace {

// Pages per P @ V partial (full mode): the unit of the fixed summation order (see above).
constexpr int kGroupPages = 64;

int groups_of(int pages) { return (pages + kGroupPages - 1) / kGroupPages; }

struct Item {
  int r, h, S, R, npages, k;  // R = S - tail: ranked positions [0, R); k = min(budget, R)
  int u0 = 0, nu = 0;      // units of this item: [u0, u0 + nu)
  int64_t goff = 0;        // tiles, full mode: first of this item's P @ V partials in go_
};

struct Unit {
  int item, pg0, pg1, tid;   // pages [pg0, pg1) of the item, run by thread tid (tiles)
  float* e = nullptr;        // [pages][Qn][Pp] in the owner's arena
  float* st = nullptr;       // [pages][Qn] page max (then factor f), then [pages][Qn] page sums
  int64_t cand_off = 0;      // tiles: this unit's top-k candidates in the shared arrays
  int cand_n = 0;
};

// Per-thread slices of the arena (taken once per call, in the first phase). Cache-line aligned:
// threads write rows[] in their inner loops, so neighbours in work_ must not share a line.
struct alignas(64) Work {
  float *sbuf, *imp, *o, *wsel, *m, *l, *lsel;
  float* gpart;  // whole items, full mode: the item's P @ V partials [groups][Qn][D]
  void *kt, *qprep, *pvscratch;
  uint16_t* qraw;
  uint32_t *topk, *mkeys;
  int32_t* mpos;
  const uint16_t* rows[32];
};

class Selection {
 public:
  Selection(const herald_select_args& a, const Kernels& kern) : a_(a), kern_(kern) {
    G_ = a.num_heads / a.num_kv_heads;
    Qn_ = a.n_q * G_;
    D_ = a.head_dim;
    P_ = a.page_size;
    Pp_ = round_up(P_, kLanes);
  }

  int run(Runtime& rt);

 private:
  int plan(int T);
  // Bytes of the Work slices (not the e / stats buffers) for units of up to cap_pages pages.
  size_t arena_bytes(int cap_pages) const;
  size_t unit_bytes(int pages) const {
    return Arena::slot(sizeof(float) * pages * Qn_ * Pp_) + Arena::slot(sizeof(float) * 2 * pages * Qn_);
  }
  Work carve(Arena& ar, int cap_pages) const;
  const uint16_t* k_slab(int r, int h, int pg) const {
    const int64_t pid = a_.page_table[static_cast<int64_t>(r) * a_.max_pages + pg];
    return a_.k_pages + pid * a_.page_stride + h * a_.head_stride;
  }
  const uint16_t* v_slab(int r, int h, int pg) const {
    const int64_t pid = a_.page_table[static_cast<int64_t>(r) * a_.max_pages + pg];
    return a_.v_pages + pid * a_.page_stride + h * a_.head_stride;
  }
  int rows_of(const Item& it, int pg) const { return pg == it.npages - 1 ? it.S - pg * P_ : P_; }
  void prefetch_slab(const uint16_t* p, int rows) const;
  bool scan(Unit& u, Work& w);
  void item_stats(const Item& it, float* m, float* linv) const;
  void rank(Unit& u, Work& w);
  void finish(int item_index, Work& w);
  void gather(const Item& it, const int32_t* sel) const;
  void fail(int code, const std::string& msg);

  const herald_select_args& a_;
  const Kernels& kern_;
  int G_, Qn_, D_, P_, Pp_;
  bool tiles_ = false;
  std::vector<Item> items_;
  std::vector<Unit> units_;
  std::vector<std::vector<int>> units_of_thread_;
  std::vector<int> order_;              // item order for the whole-item schedule
  std::vector<float> im_, il_;          // tiles: per item, per row: max and 1 / sum
  std::vector<float> go_;               // tiles, full mode: P @ V partials [groups][Qn][D]
  std::vector<int32_t> cand_pos_;       // tiles: per unit top-k candidates
  std::vector<uint32_t> cand_key_;
  std::vector<Work> work_;
  std::atomic<int> next_{0};
  std::atomic<int> err_code_{0};
  std::mutex err_mu_;
  std::string err_msg_;
};

void Selection::fail(int code, const std::string& msg) {
  std::lock_guard<std::mutex> lk(err_mu_);
  if (err_code_.load() == 0) {
    err_msg_ = msg;
    err_code_.store(code);
  }
}

int Selection::plan(int T) {
  const auto& a = a_;
  int64_t total_pages = 0;
  int max_pages_item = 0;
  for (int r = 0; r < a.n_req; ++r) {
    const int S = a.seq_lens[r], b = a.budget[r];
    if (S < 1 || S > static_cast<int64_t>(a.max_pages) * P_ || b < 1) {
      fail(HERALD_EINVAL, "seq_lens[" + std::to_string(r) + "] = " + std::to_string(S) +
                              " must be in [1, max_pages * page_size] and budget >= 1");
      return HERALD_EINVAL;
    }
    const int np = (S + P_ - 1) / P_;
    for (int pg = 0; pg < np; ++pg) {
      const int32_t pid = a.page_table[static_cast<int64_t>(r) * a.max_pages + pg];
      if (pid < 0 || pid >= a.num_pages) {
        fail(HERALD_EINVAL, "page_table[" + std::to_string(r) + ", " + std::to_string(pg) +
                                "] = " + std::to_string(pid) + " is outside [0, num_pages=" +
                                std::to_string(a.num_pages) + ")");
        return HERALD_EINVAL;
      }
    }
    const int tail = a.tail_lens != nullptr ? a.tail_lens[r] : 0;
    if (tail < 0 || tail > S) {
      fail(HERALD_EINVAL, "tail_lens[" + std::to_string(r) + "] = " + std::to_string(tail) +
                              " must be in [0, seq_lens[" + std::to_string(r) + "] = " +
                              std::to_string(S) + "]");
      return HERALD_EINVAL;
    }
    const int R = S - tail;
    const int k = std::min(b, R);
    if (k > a.k_max || (a.importance != nullptr && S > a.s_max)) {
      fail(HERALD_EINVAL, "k_max or s_max too small for request " + std::to_string(r));
      return HERALD_EINVAL;
    }
    a.num_selected[r] = k;
    for (int h = 0; h < a.num_kv_heads; ++h) items_.push_back({r, h, S, R, np, k});
    total_pages += static_cast<int64_t>(np) * a.num_kv_heads;
    max_pages_item = std::max(max_pages_item, np);
  }
  const int n = static_cast<int>(items_.size());
  order_.resize(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) order_[i] = i;
  std::stable_sort(order_.begin(), order_.end(),
                   [&](int x, int y) { return items_[x].npages > items_[y].npages; });
  // Whole items if greedy longest-first keeps >= 85% of the threads busy, else tiles.
  std::vector<int64_t> load(static_cast<size_t>(T), 0);
  for (int i : order_) *std::min_element(load.begin(), load.end()) += items_[i].npages;
  const int64_t makespan = *std::max_element(load.begin(), load.end());
  const bool balanced = total_pages >= 0.85 * static_cast<double>(T) * makespan;
  tiles_ = a.schedule == 2 || (a.schedule == 0 && !balanced && T > 1);
  units_of_thread_.assign(static_cast<size_t>(T), {});
  if (!tiles_) {
    for (int i = 0; i < n; ++i) {
      items_[i].u0 = i;
      items_[i].nu = 1;
      units_.push_back({i, 0, items_[i].npages, -1});
    }
  } else {
    const int64_t chunk = (total_pages + T - 1) / T;
    int64_t g = 0;  // global page offset of the current item
    for (int i = 0; i < n; ++i) {
      Item& it = items_[i];
      it.u0 = static_cast<int>(units_.size());
      for (int pg = 0; pg < it.npages;) {
        const int t = static_cast<int>((g + pg) / chunk);
        const int cut = static_cast<int>(std::min<int64_t>(it.npages, (t + 1) * chunk - g));
        const int end = std::min(it.npages, round_up(cut, kGroupPages));  // on a group boundary
        units_of_thread_[t].push_back(static_cast<int>(units_.size()));
        units_.push_back({i, pg, end, t});
        pg = end;
      }
      it.nu = static_cast<int>(units_.size()) - it.u0;
      g += it.npages;
    }
    int64_t ncand = 0;
    for (Unit& u : units_) {
      u.cand_off = ncand;
      ncand += std::min((u.pg1 - u.pg0) * P_, items_[u.item].k);
    }
    cand_pos_.resize(static_cast<size_t>(ncand));
    cand_key_.resize(static_cast<size_t>(ncand));
    int64_t groups = 0;
    for (Item& it : items_) {
      it.goff = groups;
      groups += groups_of(it.npages);
    }
    // Not zeroed here: each group's partial is cleared by the unit holding its first page
    // (units start on group boundaries), on that unit's thread.
    if (a.output_mode == 0) go_.resize(static_cast<size_t>(groups) * Qn_ * D_);
    im_.resize(items_.size() * Qn_);
    il_.resize(items_.size() * Qn_);
  }
  return HERALD_OK;
}

size_t Selection::arena_bytes(int cap_pages) const {
  const int s_max = std::max(a_.s_max, cap_pages * P_);
  const size_t f = sizeof(float);
  return Arena::slot(f * Qn_ * Pp_) + Arena::slot(f * cap_pages * P_) + Arena::slot(f * Qn_ * D_) +
         Arena::slot(f * Qn_ * 32) + 3 * Arena::slot(f * Qn_) + Arena::slot(f * D_ * Pp_) +
         Arena::slot(std::max(kern_.qprep_bytes(Qn_, D_), f * Qn_ * D_)) +
         Arena::slot(f * (32 * D_ + 16 * Qn_)) + Arena::slot(2 * Qn_ * D_) +
         Arena::slot(4 * topk_scratch_words(s_max)) + 2 * Arena::slot(4 * (s_max + 1)) + 4096;
}

Work Selection::carve(Arena& ar, int cap_pages) const {
  const int s_max = std::max(a_.s_max, cap_pages * P_);
  Work w;
  w.gpart = nullptr;
  w.sbuf = ar.take<float>(static_cast<size_t>(Qn_) * Pp_);
  w.imp = ar.take<float>(static_cast<size_t>(cap_pages) * P_);
  w.o = ar.take<float>(static_cast<size_t>(Qn_) * D_);
  w.wsel = ar.take<float>(static_cast<size_t>(Qn_) * 32);
  w.m = ar.take<float>(Qn_);
  w.l = ar.take<float>(Qn_);
  w.lsel = ar.take<float>(Qn_);
  w.kt = ar.take<float>(static_cast<size_t>(D_) * Pp_);
  w.qprep = ar.take<char>(std::max(kern_.qprep_bytes(Qn_, D_), sizeof(float) * Qn_ * D_));
  w.pvscratch = ar.take<float>(static_cast<size_t>(32) * D_ + 16 * Qn_);
  w.qraw = ar.take<uint16_t>(static_cast<size_t>(Qn_) * D_);
  w.topk = ar.take<uint32_t>(topk_scratch_words(s_max));
  w.mkeys = ar.take<uint32_t>(static_cast<size_t>(s_max) + 1);
  w.mpos = ar.take<int32_t>(static_cast<size_t>(s_max) + 1);
  return w;
}

void Selection::prefetch_slab(const uint16_t* p, int rows) const {
  if (a_.prefetch_hint == 0) return;
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = static_cast<int64_t>(rows) * D_ * 2;
  for (int64_t o = 0; o < bytes; o += 64) {
    switch (a_.prefetch_hint) {
      case 1: __builtin_prefetch(c + o, 0, 3); break;
      case 2: __builtin_prefetch(c + o, 0, 2); break;
      default: __builtin_prefetch(c + o, 0, 0); break;
    }
  }
}

bool Selection::scan(Unit& u, Work& w) {
  const Item& it = items_[u.item];
  const int H = a_.num_heads;
  for (int qi = 0; qi < a_.n_q; ++qi)  // rows of this KV head's group, row = qi * G + g
    std::memcpy(w.qraw + static_cast<size_t>(qi) * G_ * D_,
                a_.q + ((static_cast<int64_t>(it.r) * a_.n_q + qi) * H + it.h * G_) * D_,
                sizeof(uint16_t) * G_ * D_);
  kern_.prep_q(w.qraw, Qn_, D_, w.qprep);
  const int np = u.pg1 - u.pg0, dist = std::max(1, a_.prefetch_distance);
  for (int pg = u.pg0; pg < std::min(u.pg1, u.pg0 + dist); ++pg)
    prefetch_slab(k_slab(it.r, it.h, pg), rows_of(it, pg));
  PageScoreArgs pa{};
  pa.prefetch_hint = a_.prefetch_hint;
  pa.qprep = w.qprep;
  pa.Qn = Qn_;
  pa.D = D_;
  pa.Pp = Pp_;
  pa.scale = a_.scale;
  pa.sbuf = w.sbuf;
  pa.kt = w.kt;
  // NOTE: e larger than a core's share of the cache is written with non-temporal stores (no
  // read-for-ownership); it is read back once by rank() and finish().
  pa.stream_store = static_cast<size_t>(np) * Qn_ * Pp_ * sizeof(float) > (size_t{4} << 20);
  for (int pg = u.pg0; pg < u.pg1; ++pg) {
    const int i = pg - u.pg0;
    pa.k = k_slab(it.r, it.h, pg);
    pa.n = rows_of(it, pg);
    const int nxt = pg + dist;
    pa.k_next = nxt < u.pg1 && a_.prefetch_hint != 0 ? k_slab(it.r, it.h, nxt) : nullptr;
    pa.n_next = nxt < u.pg1 ? rows_of(it, nxt) : 0;
    pa.e = u.e + static_cast<int64_t>(i) * Qn_ * Pp_;
    pa.page_max = u.st + static_cast<int64_t>(i) * Qn_;
    pa.page_sum = u.st + static_cast<int64_t>(np + i) * Qn_;
    if (!kern_.score_page(pa)) {
      fail(HERALD_ENONFINITE,
           "non-finite attention score for request " + std::to_string(it.r) + ", KV head " +
               std::to_string(it.h) + " (NaN or inf in q or K, or a score overflowing float32)");
      return false;
    }
  }
  return true;
}

// Row statistics of an item from its units' page (max, sum), pages in position order whatever
// the units' cut: m = max over pages, linv = 1 / sum_pages page_sum * exp(page_max - m).
void Selection::item_stats(const Item& it, float* m, float* linv) const {
  for (int q = 0; q < Qn_; ++q) {
    float mq = -INFINITY, l = 0.0f;
    for (int v = it.u0; v < it.u0 + it.nu; ++v) {
      const Unit& u = units_[v];
      for (int i = 0; i < u.pg1 - u.pg0; ++i) mq = std::max(mq, u.st[i * Qn_ + q]);
    }
    for (int v = it.u0; v < it.u0 + it.nu; ++v) {
      const Unit& u = units_[v];
      const int np = u.pg1 - u.pg0;
      for (int i = 0; i < np; ++i) l += u.st[(np + i) * Qn_ + q] * std::exp(u.st[i * Qn_ + q] - mq);
    }
    m[q] = mq;
    linv[q] = 1.0f / l;
  }
}

void Selection::rank(Unit& u, Work& w) {
  const Item& it = items_[u.item];
  const int np = u.pg1 - u.pg0;
  // Row statistics over the whole item (tiles: computed between A and B, while every unit's
  // page maxima are intact; B overwrites them with the factors below).
  if (tiles_) {
    const size_t off = static_cast<size_t>(u.item) * Qn_;
    std::memcpy(w.m, &im_[off], sizeof(float) * Qn_);
    std::memcpy(w.l, &il_[off], sizeof(float) * Qn_);
  } else {
    item_stats(it, w.m, w.l);
  }
  // Page max -> factor f = exp(page_max - m) / l: e * f is the softmax probability.
  for (int i = 0; i < np; ++i)
    for (int q = 0; q < Qn_; ++q)
      u.st[i * Qn_ + q] = std::exp(u.st[i * Qn_ + q] - w.m[q]) * w.l[q];
  const int last_rows = rows_of(it, u.pg1 - 1);
  const int len = (np - 1) * P_ + last_rows;
  float* imp = a_.importance != nullptr
                   ? a_.importance + (static_cast<int64_t>(it.r) * a_.num_kv_heads + it.h) * a_.s_max +
                         static_cast<int64_t>(u.pg0) * P_
                   : w.imp;
  kern_.importance(u.e, u.st, Qn_, Pp_, P_, np, last_rows, imp);
  const uint32_t* keys = reinterpret_cast<const uint32_t*>(imp);
  // Only this unit's positions below R compete for the budget (the tail is the item's end).
  const int ranked = std::clamp(it.R - u.pg0 * P_, 0, len);
  if (!tiles_) {
    int32_t* out = a_.indices + (static_cast<int64_t>(it.r) * a_.num_kv_heads + it.h) * a_.k_max;
    const int k = select_topk_keys(keys, nullptr, 0, ranked, it.k, out, nullptr, w.topk);
    for (int j = k; j < a_.k_max; ++j) out[j] = -1;
  } else {
    u.cand_n = select_topk_keys(keys, nullptr, u.pg0 * P_, ranked, std::min(it.k, ranked),
                                &cand_pos_[u.cand_off], &cand_key_[u.cand_off], w.topk);
  }
  if (a_.output_mode != 0) return;
  // Full mode: P @ V over this unit's pages, one partial per group of kGroupPages pages.
  const size_t QD = static_cast<size_t>(Qn_) * D_;
  float* parts = tiles_ ? &go_[static_cast<size_t>(it.goff) * QD] : w.gpart;
  const int dist = std::max(1, a_.prefetch_distance);
  for (int pg = u.pg0; pg < std::min(u.pg1, u.pg0 + dist); ++pg)
    prefetch_slab(v_slab(it.r, it.h, pg), rows_of(it, pg));
  for (int pg = u.pg0; pg < u.pg1; ++pg) {
    const int i = pg - u.pg0, n = rows_of(it, pg);
    float* o = parts + static_cast<size_t>(pg / kGroupPages) * QD;
    if (pg % kGroupPages == 0) std::memset(o, 0, sizeof(float) * QD);  // units start on groups
    if (pg + dist < u.pg1) prefetch_slab(v_slab(it.r, it.h, pg + dist), rows_of(it, pg + dist));
    const uint16_t* v = v_slab(it.r, it.h, pg);
    for (int j0 = 0; j0 < n; j0 += 32) {
      const int cnt = std::min(32, n - j0);
      for (int j = 0; j < cnt; ++j) w.rows[j] = v + static_cast<int64_t>(j0 + j) * D_;
      PvArgs pv{w.rows, cnt, u.e + static_cast<int64_t>(i) * Qn_ * Pp_ + j0, Pp_,
                u.st + static_cast<int64_t>(i) * Qn_, 1, Qn_, D_, o, w.pvscratch};
      kern_.pv(pv);
    }
  }
}

// The item's selected K and V rows -> gather_out[kv, r, h, j], streamed (not read back here).
void Selection::gather(const Item& it, const int32_t* sel) const {
  const int64_t rows = static_cast<int64_t>(a_.num_kv_heads) * a_.k_max;  // per request
  uint16_t* kout = a_.gather_out + ((static_cast<int64_t>(it.r) * a_.num_kv_heads + it.h) *
                                    a_.k_max) * D_;
  uint16_t* vout = kout + static_cast<int64_t>(a_.n_req) * rows * D_;
  const size_t bytes = sizeof(uint16_t) * static_cast<size_t>(D_);
  constexpr int kAhead = 8;  // rows prefetched ahead: selected K rows are scattered over S
  for (int j = 0; j < std::min(it.k, kAhead); ++j)
    prefetch_slab(k_slab(it.r, it.h, sel[j] / P_) + static_cast<int64_t>(sel[j] % P_) * D_, 1);
  for (int j = 0; j < it.k; ++j) {
    if (j + kAhead < it.k) {
      const int nx = sel[j + kAhead];
      prefetch_slab(k_slab(it.r, it.h, nx / P_) + static_cast<int64_t>(nx % P_) * D_, 1);
    }
    const int pos = sel[j], pg = pos / P_;
    const int64_t off = static_cast<int64_t>(pos % P_) * D_;
    kern_.copy_stream(kout + static_cast<int64_t>(j) * D_, k_slab(it.r, it.h, pg) + off, bytes);
    kern_.copy_stream(vout + static_cast<int64_t>(j) * D_, v_slab(it.r, it.h, pg) + off, bytes);
  }
  kern_.store_fence();  // before the pool's barrier: the caller reads (DMAs) them next
}

void Selection::finish(int item_index, Work& w) {
  const Item& it = items_[item_index];
  const int64_t rh = static_cast<int64_t>(it.r) * a_.num_kv_heads + it.h;
  int32_t* sel = a_.indices + rh * a_.k_max;
  if (tiles_) {  // merge the per-tile candidates (tiles are in position order)
    int n = 0;
    for (int v = it.u0; v < it.u0 + it.nu; ++v) {
      const Unit& u = units_[v];
      std::memcpy(w.mkeys + n, &cand_key_[u.cand_off], sizeof(uint32_t) * u.cand_n);
      std::memcpy(w.mpos + n, &cand_pos_[u.cand_off], sizeof(int32_t) * u.cand_n);
      n += u.cand_n;
    }
    const int k = select_topk_keys(w.mkeys, w.mpos, 0, n, it.k, sel, nullptr, w.topk);
    for (int j = k; j < a_.k_max; ++j) sel[j] = -1;
  }
  if (a_.importance != nullptr)
    for (int s = it.S; s < a_.s_max; ++s) a_.importance[rh * a_.s_max + s] = 0.0f;
  std::vector<float> exact;  // rows whose selected probabilities underflowed (rare)
  // Rows the sparse attention sees: the k selected positions, then the tail [R, S); ascending.
  const int nrows = it.k + (it.S - it.R);
  auto row_pos = [&](int j) { return j < it.k ? sel[j] : it.R + (j - it.k); };
  float* o = w.o;
  if (a_.output_mode == 0) {
    const size_t QD = static_cast<size_t>(Qn_) * D_;
    const float* parts = tiles_ ? &go_[static_cast<size_t>(it.goff) * QD] : w.gpart;
    std::memset(o, 0, sizeof(float) * QD);
    for (int g = 0; g < groups_of(it.npages); ++g)  // group order: the fixed summation order
      for (size_t x = 0; x < QD; ++x) o[x] += parts[g * QD + x];
    for (int q = 0; q < Qn_; ++q) w.lsel[q] = 1.0f;
  } else {
    // Selected mode: softmax restricted to the selected and tail rows, from the stored
    // probabilities.
    std::memset(o, 0, sizeof(float) * Qn_ * D_);
    for (int q = 0; q < Qn_; ++q) w.lsel[q] = 0.0f;
    int v = it.u0;
    for (int j0 = 0; j0 < nrows; j0 += 32) {
      const int cnt = std::min(32, nrows - j0);
      for (int j = 0; j < cnt; ++j) {
        const int pos = row_pos(j0 + j), pg = pos / P_, slot = pos % P_;
        while (pg >= units_[v].pg1) ++v;  // positions ascend, so do their units
        const Unit& u = units_[v];
        const int64_t i = pg - u.pg0;
        for (int q = 0; q < Qn_; ++q) {
          const float p = u.e[(i * Qn_ + q) * Pp_ + slot] * u.st[i * Qn_ + q];
          w.wsel[q * 32 + j] = p;
          w.lsel[q] += p;
        }
        w.rows[j] = v_slab(it.r, it.h, pg) + static_cast<int64_t>(slot) * D_;
      }
      PvArgs pv{w.rows, cnt, w.wsel, 32, nullptr, 0, Qn_, D_, o, w.pvscratch};
      kern_.pv(pv);
    }
    for (int q = 0; q < Qn_; ++q) w.lsel[q] = w.lsel[q] > 1e-30f ? w.lsel[q] : 0.0f;
  }
  const int H = a_.num_heads;
  for (int q = 0; q < Qn_; ++q) {
    const int qi = q / G_, g = q % G_;
    float* dst = a_.attn_output + ((static_cast<int64_t>(it.r) * a_.n_q + qi) * H + it.h * G_ + g) * D_;
    if (w.lsel[q] > 0.0f) {
      kern_.unpermute(o + static_cast<int64_t>(q) * D_, 1.0f / w.lsel[q], dst, D_);
      continue;
    }
    // The selected rows' probabilities underflowed in float32 for this query row (its own
    // attention lies elsewhere): recompute its scores on the selected (and tail) rows, exactly.
    const uint16_t* qrow = a_.q + ((static_cast<int64_t>(it.r) * a_.n_q + qi) * H + it.h * G_ + g) * D_;
    exact.assign(static_cast<size_t>(nrows), 0.0f);
    float mx = -INFINITY;
    for (int j = 0; j < nrows; ++j) {
      const int pos = row_pos(j);
      const uint16_t* kr = k_slab(it.r, it.h, pos / P_) + static_cast<int64_t>(pos % P_) * D_;
      float s = 0.0f;
      for (int d = 0; d < D_; ++d) s += bf16_to_f32(qrow[d]) * bf16_to_f32(kr[d]);
      exact[j] = s * a_.scale;
      mx = std::max(mx, exact[j]);
    }
    float l = 0.0f;
    for (int j = 0; j < nrows; ++j) l += (exact[j] = std::exp(exact[j] - mx));
    for (int d = 0; d < D_; ++d) dst[d] = 0.0f;
    for (int j = 0; j < nrows; ++j) {
      const int pos = row_pos(j);
      const uint16_t* vr = v_slab(it.r, it.h, pos / P_) + static_cast<int64_t>(pos % P_) * D_;
      for (int d = 0; d < D_; ++d) dst[d] += exact[j] / l * bf16_to_f32(vr[d]);
    }
  }
  if (a_.gather_out != nullptr) gather(it, sel);
}

int Selection::run(Runtime& rt) {
  ThreadPool& pool = *rt.pool;
  const int T = pool.size();
  if (int rc = plan(T); rc != HERALD_OK) {
    set_last_error(err_msg_);
    return rc;
  }
  work_.resize(static_cast<size_t>(T));
  int max_item_pages = 0;
  for (const Item& it : items_) max_item_pages = std::max(max_item_pages, it.npages);
  if (!tiles_) {
    pool.run([&](int tid) {
      const size_t part_floats = a_.output_mode == 0
                                     ? static_cast<size_t>(groups_of(max_item_pages)) * Qn_ * D_
                                     : 0;
      Arena& ar = rt.arenas[tid];
      ar.reset(arena_bytes(max_item_pages) + unit_bytes(max_item_pages) +
               Arena::slot(sizeof(float) * part_floats));
      Work& w = work_[tid];
      w = carve(ar, max_item_pages);
      w.gpart = part_floats > 0 ? ar.take<float>(part_floats) : nullptr;
      float* e = ar.take<float>(static_cast<size_t>(max_item_pages) * Qn_ * Pp_);
      float* st = ar.take<float>(static_cast<size_t>(2) * max_item_pages * Qn_);
      for (;;) {
        const int idx = next_.fetch_add(1);
        if (idx >= static_cast<int>(order_.size()) || err_code_.load() != 0) break;
        Unit& u = units_[order_[idx]];
        u.e = e;
        u.st = st;
        if (!scan(u, w)) break;
        rank(u, w);
        finish(order_[idx], w);
      }
    });
  } else {
    pool.run([&](int tid) {  // A: scan this thread's tiles
      int pages = 0;
      size_t bytes = 0;
      for (int ui : units_of_thread_[tid]) {
        pages += units_[ui].pg1 - units_[ui].pg0;
        bytes += unit_bytes(units_[ui].pg1 - units_[ui].pg0);
      }
      Arena& ar = rt.arenas[tid];
      ar.reset(arena_bytes(std::max(pages, 1)) + bytes);
      Work& w = work_[tid];
      w = carve(ar, std::max(pages, 1));
      for (int ui : units_of_thread_[tid]) {
        Unit& u = units_[ui];
        u.e = ar.take<float>(static_cast<size_t>(u.pg1 - u.pg0) * Qn_ * Pp_);
        u.st = ar.take<float>(static_cast<size_t>(2) * (u.pg1 - u.pg0) * Qn_);
        if (!scan(u, w)) return;
      }
    });
    if (err_code_.load() == 0) {
      pool.run([&](int) {  // A2: each item's row statistics, from all its tiles' page stats
        for (;;) {
          const int idx = next_.fetch_add(1);
          if (idx >= static_cast<int>(items_.size())) break;
          const size_t off = static_cast<size_t>(idx) * Qn_;
          item_stats(items_[idx], &im_[off], &il_[off]);
        }
      });
      next_.store(0);
      pool.run([&](int tid) {  // B: rank tiles (and full-mode P @ V) where they were scanned
        for (int ui : units_of_thread_[tid]) rank(units_[ui], work_[tid]);
      });
      pool.run([&](int tid) {  // C: merge and finish items
        for (;;) {
          const int idx = next_.fetch_add(1);
          if (idx >= static_cast<int>(items_.size())) break;
          finish(idx, work_[tid]);
        }
      });
    }
  }
  if (err_code_.load() != 0) {
    set_last_error(err_msg_);
    return err_code_.load();
  }
  return HERALD_OK;
}

}  // namespace
}  // namespace herald

extern "C" int32_t herald_select_topk(const herald_select_args* a) {
  using namespace herald;
  if (a->n_req < 1 || a->n_q < 1 || a->num_kv_heads < 1 || a->num_heads % a->num_kv_heads != 0 ||
      a->head_dim < 1 || a->page_size < 1 || a->max_pages < 1 || a->num_threads < 1 ||
      a->page_size > (1 << 20)) {
    set_last_error("select_topk: invalid sizes");
    return HERALD_EINVAL;
  }
  const bool simd_ok = avx512_kernels() != nullptr && cpu_has_avx512bf16() && a->head_dim % 32 == 0;
  if ((a->isa == 1 || a->isa == 3) && !simd_ok) {
    set_last_error("select_topk: the AVX-512 BF16 path was requested but "
                   "this CPU lacks AVX-512 BF16 or head_dim is not a multiple of 32");
    return HERALD_EINVAL;
  }
  const Kernels& kern = a->isa == 3 && simd_ok   ? *avx512bf16_kernels()
                        : a->isa != 2 && simd_ok ? *avx512_kernels()
                                                 : portable_kernels();
  try {
    std::unique_lock<std::mutex> lock;
    Runtime& rt = acquire_runtime(a->num_threads, &lock);
    Selection sel(*a, kern);
    return sel.run(rt);
  } catch (const std::exception& e) {
    set_last_error(std::string("select_topk: internal error: ") + e.what());
    return HERALD_EINTERNAL;
  }
}
