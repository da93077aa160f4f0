// Library-wide runtime, the gather into the staging buffer, the block scatter into the CPU pool, a
// read-bandwidth probe and the small C entry points (version, source hash, CPU features, last
// error).
#include "runtime.h"

#include <pthread.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "herald_selection.h"
#include "selection.h"

#ifndef HERALD_SOURCE_HASH
#define HERALD_SOURCE_HASH "unknown"
#endif

namespace herald {

Arena::~Arena() { std::free(data_); }

void Arena::reset(size_t bytes) {
  if (bytes > cap_) {
    std::free(data_);
    data_ = nullptr;
    cap_ = 0;
    const size_t want = slot(bytes + bytes / 4);
    data_ = static_cast<char*>(std::aligned_alloc(64, want));
    if (data_ == nullptr) throw std::bad_alloc();
    cap_ = want;
  }
  used_ = 0;
}

void* Arena::take_bytes(size_t bytes) {
  const size_t n = slot(bytes);
  if (used_ + n > cap_) throw std::bad_alloc();  // a sizing bug in the caller, not OOM
  void* p = data_ + used_;
  used_ += n;
  return p;
}

namespace {

Runtime* g_runtime = new Runtime();  // leaked on purpose: no destructor ordering at exit
thread_local std::string g_last_error;

// After fork() only the forking thread exists in the child: the pool's workers are gone and the
// lock may be held. Start over with a fresh runtime (the old one is leaked, not joined).
void reset_after_fork() { g_runtime = new Runtime(); }

struct ForkHandlerInstaller {
  ForkHandlerInstaller() { pthread_atfork(nullptr, nullptr, &reset_after_fork); }
} g_fork_handler_installer;

}  // namespace

Runtime& acquire_runtime(int num_threads, std::unique_lock<std::mutex>* lock) {
  Runtime& rt = *g_runtime;
  *lock = std::unique_lock<std::mutex>(rt.call_mu);
  if (!rt.pool || rt.pool->size() != num_threads) {
    rt.pool.reset();
    rt.pool = std::make_unique<ThreadPool>(num_threads);
    rt.arenas.clear();
    rt.arenas.resize(static_cast<size_t>(num_threads));
  }
  return rt;
}

void set_last_error(const std::string& msg) { g_last_error = msg; }

const Kernels& copy_kernels(int isa) {
  const Kernels* simd = avx512_kernels();
  return isa != 2 && simd != nullptr && cpu_has_avx512bf16() ? *simd : portable_kernels();
}

}  // namespace herald

using herald::set_last_error;

extern "C" {

int32_t herald_abi_version(void) { return HERALD_ABI_VERSION; }

const char* herald_source_hash(void) { return HERALD_SOURCE_HASH; }

int32_t herald_cpu_has_avx512bf16(void) {
  return herald::avx512_kernels() != nullptr && herald::cpu_has_avx512bf16() ? 1 : 0;
}

const char* herald_last_error(void) { return herald::g_last_error.c_str(); }

int32_t herald_gather_selected(const herald_gather_args* a) {
  if (a->n_req < 0 || a->num_kv_heads < 1 || a->head_dim < 1 || a->page_size < 1 ||
      a->num_threads < 1 || a->k_max < 0) {
    set_last_error("gather_selected: invalid sizes");
    return HERALD_EINVAL;
  }
  const int64_t Hkv = a->num_kv_heads, D = a->head_dim, P = a->page_size, K = a->k_max;
  // Segments (kv, r, h) of num_selected[r] rows each, in output order.
  std::vector<int64_t> seg_start;  // prefix sums of rows, one entry per (kv, r)
  seg_start.reserve(2 * static_cast<size_t>(a->n_req) + 1);
  int64_t total = 0;
  for (int kv = 0; kv < 2; ++kv)
    for (int r = 0; r < a->n_req; ++r) {
      const int ns = a->num_selected[r];
      if (ns < 0 || ns > a->k_max) {
        set_last_error("gather_selected: num_selected[" + std::to_string(r) + "] = " +
                       std::to_string(ns) + " is outside [0, k_max=" + std::to_string(K) + "]");
        return HERALD_EINVAL;
      }
      seg_start.push_back(total);
      total += ns * Hkv;
    }
  seg_start.push_back(total);
  try {
    std::unique_lock<std::mutex> lock;
    herald::Runtime& rt = herald::acquire_runtime(a->num_threads, &lock);
    const herald::Kernels& kern = herald::copy_kernels(a->isa);
    const int T = rt.pool->size();
    const int64_t chunk = (total + T - 1) / T;
    std::vector<int64_t> bad(static_cast<size_t>(T), -1);
    rt.pool->run([&](int tid) {
      int64_t g = chunk * tid;
      const int64_t end = std::min(total, g + chunk);
      if (g >= end) return;
      struct Fence {  // on every exit of this thread's share, the early returns included
        const herald::Kernels& k;
        ~Fence() { k.store_fence(); }
      } fence{kern};
      // Find the (kv, r) segment holding row g, then walk forward.
      size_t s = static_cast<size_t>(std::upper_bound(seg_start.begin(), seg_start.end(), g) -
                                     seg_start.begin()) - 1;
      while (g < end) {
        const int kv = static_cast<int>(s) / a->n_req, r = static_cast<int>(s) % a->n_req;
        const int64_t ns = a->num_selected[r];
        const uint16_t* base = kv == 0 ? a->k_pages : a->v_pages;
        const int64_t seg_end = std::min(end, seg_start[s + 1]);
        for (; g < seg_end; ++g) {
          const int64_t off = g - seg_start[s];
          const int64_t h = off / ns, j = off % ns;
          const int32_t pos = a->indices[(r * Hkv + h) * K + j];
          const int64_t pg = pos / P;
          if (pos < 0 || pg >= a->max_pages) {
            bad[tid] = g;
            return;
          }
          const int32_t pid = a->page_table[static_cast<int64_t>(r) * a->max_pages + pg];
          if (pid < 0 || pid >= a->num_pages) {
            bad[tid] = g;
            return;
          }
          const uint16_t* src = base + pid * a->page_stride + h * a->head_stride + (pos % P) * D;
          uint16_t* dst = a->out + (((kv * static_cast<int64_t>(a->n_req) + r) * Hkv + h) * K + j) * D;
          kern.copy_stream(dst, src, static_cast<size_t>(D) * 2);
        }
        ++s;
      }
    });
    for (int t = 0; t < T; ++t)
      if (bad[t] >= 0) {
        set_last_error("gather_selected: an index or its page id is out of range (indices must be "
                       "in [0, max_pages * page_size) with valid page_table entries)");
        return HERALD_EINVAL;
      }
  } catch (const std::exception& e) {
    set_last_error(std::string("gather_selected: ") + e.what());
    return HERALD_EINTERNAL;
  }
  return HERALD_OK;
}

int32_t herald_scatter_blocks(const herald_scatter_args* a) {
  if (a->outer < 0 || a->n < 0 || a->num_dst < 1 || a->num_threads < 1 || a->block_bytes < 0) {
    set_last_error("scatter_blocks: invalid sizes");
    return HERALD_EINVAL;
  }
  for (int i = 0; i < a->n; ++i)
    if (a->index[i] < 0 || a->index[i] >= a->num_dst) {
      set_last_error("scatter_blocks: index[" + std::to_string(i) + "] = " +
                     std::to_string(a->index[i]) + " is outside [0, " + std::to_string(a->num_dst) +
                     ")");
      return HERALD_EINVAL;
    }
  try {
    std::unique_lock<std::mutex> lock;
    herald::Runtime& rt = herald::acquire_runtime(a->num_threads, &lock);
    const herald::Kernels& kern = herald::copy_kernels(a->isa);
    const int T = rt.pool->size();
    const int64_t total = static_cast<int64_t>(a->outer) * a->n, chunk = (total + T - 1) / T;
    const char* src = static_cast<const char*>(a->src);
    char* dst = static_cast<char*>(a->dst);
    rt.pool->run([&](int tid) {
      const int64_t end = std::min(total, chunk * (tid + 1));
      for (int64_t c = chunk * tid; c < end; ++c) {  // block c = (o, i), in src order
        const int64_t o = c / a->n, i = c % a->n;
        const int64_t to = o * a->num_dst + a->index[i];
        kern.copy_stream(dst + to * a->block_bytes, src + c * a->block_bytes,
                         static_cast<size_t>(a->block_bytes));
      }
      kern.store_fence();
    });
  } catch (const std::exception& e) {
    set_last_error(std::string("scatter_blocks: ") + e.what());
    return HERALD_EINTERNAL;
  }
  return HERALD_OK;
}

double herald_read_probe(const void* data, int64_t nbytes, int32_t num_threads) {
  const int64_t words = nbytes / 8;
  const uint64_t* p = static_cast<const uint64_t*>(data);
  try {
    std::unique_lock<std::mutex> lock;
    herald::Runtime& rt = herald::acquire_runtime(num_threads < 1 ? 1 : num_threads, &lock);
    const int T = rt.pool->size();
    std::vector<uint64_t> sums(static_cast<size_t>(T) * 8, 0);  // 64 bytes apart per thread
    const int64_t chunk = (words + T - 1) / T;
    rt.pool->run([&](int tid) {
      const int64_t b = std::min(words, chunk * tid), e = std::min(words, b + chunk);
      uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
      int64_t i = b;
      for (; i + 8 <= e; i += 8) {  // eight independent chains: one cache line per iteration
        s0 += p[i]; s1 += p[i + 1]; s2 += p[i + 2]; s3 += p[i + 3];
        s4 += p[i + 4]; s5 += p[i + 5]; s6 += p[i + 6]; s7 += p[i + 7];
      }
      for (; i < e; ++i) s0 += p[i];
      sums[static_cast<size_t>(tid) * 8] = s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7;
    });
    uint64_t total = 0;
    for (int t = 0; t < T; ++t) total += sums[static_cast<size_t>(t) * 8];
    return static_cast<double>(total);
  } catch (const std::exception&) {
    return -1.0;
  }
}

}  // extern "C"
