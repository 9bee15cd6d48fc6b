// Dynamic work sharing over torch's threads for folio's CPU kernels.
//
// at::parallel_for hands each thread one fixed share of the range. On a small machine that
// also runs the API server, the tokenizer and the client, one of those shares is often
// delayed by a thread of another process, and the whole call waits for it. parallel_tasks
// instead lets every thread take the next task from a shared counter until none are left, so
// a thread that is held up leaves its unstarted tasks to the others.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace folio_cpu {

// Runs body(take) on up to `n` of torch's threads (on the calling thread alone when already
// inside a parallel region or with one thread); take() gives the next task index in [0, n),
// or -1 when none are left. Each thread keeps its own scratch inside body.
template <typename Body>
void parallel_tasks(int64_t n, const Body& body) {
  std::atomic<int64_t> next{0};
  auto take = [&]() -> int64_t {
    const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    return i < n ? i : -1;
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    body(take);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { body(take); });
}

}  // namespace folio_cpu
