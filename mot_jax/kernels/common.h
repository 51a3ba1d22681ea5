// What the CPU kernels share: vectors of floats one register wide, bfloat16 <-> float32, a parallel loop on XLA's
// intra-op thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// A vector is one register: 16 floats with AVX-512, else 8 (AVX2). Wider vectors than the registers spill sums.
#ifdef __AVX512F__
#define MOT_LANES 16
#else
#define MOT_LANES 8
#endif
constexpr int kLanes = MOT_LANES;
typedef float vf __attribute__((vector_size(4 * MOT_LANES)));
typedef int32_t vi __attribute__((vector_size(4 * MOT_LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * MOT_LANES)));

inline vf load(const float* p) {
  vf x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
inline void store(float* p, vf x) { std::memcpy(p, &x, sizeof(x)); }
inline vi loadi(const int32_t* p) {
  vi x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
inline vf splat(float s) { return __builtin_shuffle(vf{s}, vi{}); }
// Keeps x in a register: GCC otherwise folds the load of b's vectors into every row's FMA, re-reading them from
// memory once per row, and the loads, not the FMAs, bound the micro-kernel.
inline void in_register(vf& x) {
#ifdef __x86_64__
  asm("" : "+v"(x));
#endif
}

inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
  uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline void narrow(float x, float* out) { *out = x; }
inline void narrow(float x, uint16_t* out) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffff) > 0x7f800000) {
    *out = uint16_t((bits >> 16) | 0x40);  // quiet NaN
    return;
  }
  *out = uint16_t((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// Runs items [0, n) on the caller and on the pool, each given its thread's `Local`; returns when all are done. Late pool tasks find no item left
// and only touch the shared counter, which they co-own.
template <typename Local, typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, F body) {
  struct State {
    std::atomic<int64_t> next{0};
    int64_t done = 0;
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  auto* fn = &body;
  auto work = [state, n, fn]() {
    int64_t mine = 0;
    thread_local Local local;  // a thread's buffers, kept between calls: no fresh pages for every layer
    for (int64_t i; (i = state->next.fetch_add(1)) < n; ++mine) (*fn)(i, local);
    if (mine) {
      std::lock_guard<std::mutex> lock(state->mu);
      state->done += mine;
      if (state->done == n) state->cv.notify_all();
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));
  work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done == n; });
}

}  // namespace
