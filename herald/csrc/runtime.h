// Process-wide state of the library: one thread pool, per-thread scratch arenas, the
// last-error message. One call runs at a time (callers from several Python threads queue on
// the lock; ctypes has released the GIL, so the waiting costs no Python progress).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "thread_pool.h"

namespace herald {

// Grow-only, 64-byte aligned scratch memory owned by one pool thread.
// NOTE: slices taken with take() stay valid until the next reset(); the selection driver takes
// every slice a call needs in its first phase and reads some of them from other threads in later
// phases, so a call must never reset() or grow an arena between phases.
class Arena {
 public:
  Arena() = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  Arena(Arena&& o) noexcept : data_(o.data_), cap_(o.cap_), used_(o.used_) {
    o.data_ = nullptr;
    o.cap_ = o.used_ = 0;
  }
  ~Arena();
  // Make room for `bytes` (plus alignment slack) and start carving from the beginning.
  void reset(size_t bytes);
  template <class T>
  T* take(size_t count) {
    return static_cast<T*>(take_bytes(count * sizeof(T)));
  }
  static size_t slot(size_t bytes) { return (bytes + 63) / 64 * 64; }

 private:
  void* take_bytes(size_t bytes);
  char* data_ = nullptr;
  size_t cap_ = 0, used_ = 0;
};

struct Runtime {
  std::mutex call_mu;                 // held for the whole of one entry-point call
  std::unique_ptr<ThreadPool> pool;   // rebuilt when the requested size changes
  std::vector<Arena> arenas;          // one per pool thread, index = tid
};

// Locks the runtime and returns it with a pool of exactly num_threads threads.
Runtime& acquire_runtime(int num_threads, std::unique_lock<std::mutex>* lock);

void set_last_error(const std::string& msg);

}  // namespace herald
