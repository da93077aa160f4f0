// Top-k selection over an importance vector (HERALD §IV-B4: one top-k pass per KV head).
//
// Keys are the bit patterns of non-negative floats, so integer order = float order. Instead of a
// heap we find the k-th largest key with two 11-bit radix histograms and a partial sort of the
// few keys left in the boundary bucket, then collect the winners in one ascending pass: the
// output comes out sorted by position for free (the gather wants ascending indices).
// Ties are broken toward the smaller position: the order is (key descending, position ascending).
#include <algorithm>
#include <cstring>

#include "selection.h"

namespace herald {
namespace {

constexpr int kBins = 2048;

// Bucket holding the k-th largest element of the histogram; sets `above` to the count of
// elements in higher buckets.
int boundary_bin(const uint32_t* hist, int k, int* above) {
  int cum = 0;
  for (int b = kBins - 1; b >= 0; --b) {
    if (cum + static_cast<int>(hist[b]) >= k) {
      *above = cum;
      return b;
    }
    cum += static_cast<int>(hist[b]);
  }
  *above = cum;
  return 0;
}

}  // namespace

int select_topk_keys(const uint32_t* keys, const int32_t* pos, int32_t base, int n, int k,
                     int32_t* out, uint32_t* out_keys, uint32_t* scratch) {
  auto position = [&](int i) { return pos != nullptr ? pos[i] : base + i; };
  if (k >= n) {
    for (int i = 0; i < n; ++i) out[i] = position(i);
    if (out_keys != nullptr) std::memcpy(out_keys, keys, sizeof(uint32_t) * n);
    return n;
  }
  if (k <= 0) return 0;
  uint32_t* hist = scratch;            // kBins
  uint32_t* cand = scratch + kBins;    // n candidate indices
  // Level 1: bits 30..20 (sign bit is 0 for non-negative floats).
  std::memset(hist, 0, sizeof(uint32_t) * kBins);
  for (int i = 0; i < n; ++i) ++hist[keys[i] >> 20];
  int above1 = 0;
  const uint32_t b1 = static_cast<uint32_t>(boundary_bin(hist, k, &above1));
  int nc = 0;
  for (int i = 0; i < n; ++i) {
    cand[nc] = static_cast<uint32_t>(i);
    nc += (keys[i] >> 20) == b1;
  }
  int need = k - above1;  // 1..nc
  // Level 2: bits 19..9 of the boundary bucket's keys, when it is large.
  if (nc > 64) {
    std::memset(hist, 0, sizeof(uint32_t) * kBins);
    for (int j = 0; j < nc; ++j) ++hist[(keys[cand[j]] >> 9) & (kBins - 1)];
    int above2 = 0;
    const uint32_t b2 = static_cast<uint32_t>(boundary_bin(hist, need, &above2));
    int m = 0;
    for (int j = 0; j < nc; ++j) {
      cand[m] = cand[j];
      m += ((keys[cand[j]] >> 9) & (kBins - 1)) == b2;
    }
    nc = m;
    need -= above2;
  }
  // The need-th element of the boundary bucket in (key desc, index asc) order is the threshold.
  auto before = [&](uint32_t a, uint32_t b) {
    return keys[a] > keys[b] || (keys[a] == keys[b] && a < b);
  };
  std::nth_element(cand, cand + (need - 1), cand + nc, before);
  const uint32_t tk = keys[cand[need - 1]];
  const uint32_t ti = cand[need - 1];
  // Collect ascending: key > tk, or key == tk at an index <= ti. Exactly k elements pass.
  int32_t* tmp = reinterpret_cast<int32_t*>(cand);  // reuse: indices of the winners (k + 1)
  int cnt = 0;
  for (int i = 0; i < n; ++i) {
    tmp[cnt] = i;
    const uint32_t key = keys[i];
    cnt += key > tk || (key == tk && static_cast<uint32_t>(i) <= ti);
  }
  for (int j = 0; j < k; ++j) out[j] = position(tmp[j]);
  if (out_keys != nullptr)
    for (int j = 0; j < k; ++j) out_keys[j] = keys[tmp[j]];
  return k;
}

}  // namespace herald
