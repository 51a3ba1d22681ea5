// A row (or a few) times a bfloat16 matrix, for XLA:CPU: decoding multiplies one row per sequence by every weight, and
// XLA:CPU's bf16 kernel (YNNPACK) repacks the whole matrix for each such product. Here the matrix is read once, as
// stored, and widened to float32 in registers; the sums are float32.
//
// x [M, K] bfloat16; w [K, N] (out = x @ w) or, with `transposed`, [N, K] (out = x @ w^T: a tied head's table);
// out [M, N] float32. Items, on XLA's intra-op pool, are blocks of w's rows: of K (their partial sums added after) or,
// when transposed, of N.

#include "common.h"

namespace {

constexpr int kPair = 2 * kLanes;  // bfloat16 per vector of 32-bit words

// kPair bfloat16 from p as the float32 vectors of its even- and odd-indexed elements: a bfloat16 is the high half of
// its float32, so two vector ops widen kPair of them (a widening in order costs three shuffles a vector)
inline void widen_pairs(const uint16_t* p, vf& even, vf& odd) {
  vu words;
  std::memcpy(&words, p, sizeof(words));
  const vu e = words << 16, o = words & 0xffff0000u;
  std::memcpy(&even, &e, sizeof(even));
  std::memcpy(&odd, &o, sizeof(odd));
}

// Asks for w's element `offset` into L2 (prefetcht2): the hardware prefetchers alone left a core's stream of w about
// half as fast. The dots ask kAhead bytes ahead, the straight layout for the same columns of the next 4 rows. Near w's
// end that lies past it: the address is formed as an integer, and a prefetch never faults.
constexpr int64_t kAhead = 8192;
inline void ahead(const uint16_t* w, int64_t offset) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(w) + 2 * offset), 0, 1);
}

// Where element i of a row lies when its first `full` elements (a multiple of kPair) are stored as w widens: each
// kPair block even-indexed first.
inline int64_t paired(int64_t i, int64_t full) {
  return i < full ? i / kPair * kPair + i % 2 * kLanes + i % kPair / 2 : i;
}

// Items of a multiple of 4 rows of w, ~4 a thread
inline int64_t rows_per_item(int64_t rows, int64_t threads) {
  return std::max<int64_t>(4, (rows / (4 * threads) + 3) / 4 * 4);
}

inline float sum(vf x) {
  float s = 0;
  for (int i = 0; i < kLanes; ++i) s += x[i];
  return s;
}

struct None {};

struct Problem {
  const float* x;  // [M, K] widened; when transposed each full kPair block stored even-indexed first (as w widens)
  const uint16_t* w;
  float* out;
  int64_t m, k, n;
};

// sums[r][:] = x[r, k0 : k0 + count] @ w[k0 : k0 + count]: w's rows are read whole and in order (one stream), 4 at a
// time against sums in L1 (each kPair of columns even-indexed first, as w widens).
void straight(const Problem& p, int64_t k0, int64_t count, float* sums) {
  const int64_t full = p.n / kPair * kPair;
  int64_t k = k0;
  for (; k + 4 <= k0 + count; k += 4) {
    const uint16_t* row = p.w + k * p.n;
    for (int64_t j = 0; j < full; j += kPair) {
      vf even[4], odd[4];
      for (int i = 0; i < 4; ++i) {
        widen_pairs(row + i * p.n + j, even[i], odd[i]);
        ahead(p.w, (k + i + 4) * p.n + j);  // the same columns of the next 4 rows
      }
      for (int64_t r = 0; r < p.m; ++r) {
        const float* a = p.x + r * p.k + k;
        float* c = sums + r * p.n + j;
        store(c, load(c) + a[0] * even[0] + a[1] * even[1] + a[2] * even[2] + a[3] * even[3]);
        store(c + kLanes, load(c + kLanes) + a[0] * odd[0] + a[1] * odd[1] + a[2] * odd[2] + a[3] * odd[3]);
      }
    }
  }
  for (; k < k0 + count; ++k) {
    const uint16_t* row = p.w + k * p.n;
    for (int64_t j = 0; j < full; j += kPair) {
      vf even, odd;
      widen_pairs(row + j, even, odd);
      for (int64_t r = 0; r < p.m; ++r) {
        float* c = sums + r * p.n + j;
        store(c, load(c) + p.x[r * p.k + k] * even);
        store(c + kLanes, load(c + kLanes) + p.x[r * p.k + k] * odd);
      }
    }
  }
  for (k = k0; k < k0 + count; ++k)
    for (int64_t j = full; j < p.n; ++j)
      for (int64_t r = 0; r < p.m; ++r) sums[r * p.n + j] += p.x[r * p.k + k] * widen(p.w[k * p.n + j]);
}

// out[r][n] = x[r] . w[n] for N rows n of w from `n0` and R rows r of x from `r0` (x de-interleaved as w widens)
template <int N, int R>
void dots(const Problem& p, int64_t n0, int64_t r0) {
  vf acc[R][N] = {};
  const int64_t full = p.k / kPair * kPair;
  for (int64_t k = 0; k < full; k += kPair) {
    vf even[N], odd[N];
    for (int i = 0; i < N; ++i) widen_pairs(p.w + (n0 + i) * p.k + k, even[i], odd[i]);
    for (int i = 0; i < N; ++i) ahead(p.w, (n0 + i) * p.k + k + kAhead / 2);
    for (int r = 0; r < R; ++r) {
      const vf ae = load(p.x + (r0 + r) * p.k + k), ao = load(p.x + (r0 + r) * p.k + k + kLanes);
      for (int i = 0; i < N; ++i) acc[r][i] += ae * even[i] + ao * odd[i];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < N; ++i) {
      float s = sum(acc[r][i]);
      for (int64_t k = full; k < p.k; ++k) s += p.x[(r0 + r) * p.k + k] * widen(p.w[(n0 + i) * p.k + k]);
      p.out[(r0 + r) * p.n + n0 + i] = s;
    }
}

// out[:, n0 : n0 + count] = x @ w[n0 : n0 + count]^T, 4 rows of w at a time (read once from memory, from L1 for
// every further pair of x's rows)
void transposed(const Problem& p, int64_t n0, int64_t count) {
  int64_t n = n0;
  for (; n + 4 <= n0 + count; n += 4) {
    int64_t r = 0;
    for (; r + 2 <= p.m; r += 2) dots<4, 2>(p, n, r);
    if (r < p.m) dots<4, 1>(p, n, r);
  }
  for (; n < n0 + count; ++n)
    for (int64_t r = 0; r < p.m; ++r) dots<1, 1>(p, n, r);
}

ffi::Error Rows(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                ffi::ResultBuffer<ffi::F32> out, bool is_transposed) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("x and w must be matrices");
  Problem p{nullptr, reinterpret_cast<const uint16_t*>(w.typed_data()), out->typed_data(), xd[0], xd[1],
            is_transposed ? wd[0] : wd[1]};
  if ((is_transposed ? wd[1] : wd[0]) != p.k) return ffi::Error::InvalidArgument("x and w do not share K");
  thread_local std::vector<float> x32;  // this call's thread owns it (and `partial`) until the call returns
  x32.resize(p.m * p.k);
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.typed_data());
  const int64_t full = is_transposed ? p.k / kPair * kPair : 0;  // the dots take x de-interleaved, as w widens
  for (int64_t r = 0; r < p.m; ++r)
    for (int64_t k = 0; k < p.k; ++k)
      x32[r * p.k + paired(k, full)] = widen(xs[r * p.k + k]);
  p.x = x32.data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (is_transposed) {
    const int64_t per = rows_per_item(p.n, threads);
    const int64_t items = (p.n + per - 1) / per;
    parallel_for<None>(pool, items, [&p, per](int64_t i, None&) {
      transposed(p, i * per, std::min(per, p.n - i * per));
    });
  } else {  // items split w's rows; their partial sums are added after
    const int64_t per = rows_per_item(p.k, threads);
    const int64_t items = (p.k + per - 1) / per, size = p.m * p.n;
    thread_local std::vector<float> partial;
    partial.assign(items * size, 0.0f);
    float* sums = partial.data();
    parallel_for<None>(pool, items, [&p, per, sums, size](int64_t i, None&) {
      straight(p, i * per, std::min(per, p.k - i * per), sums + i * size);
    });
    for (int64_t r = 0; r < p.m; ++r)
      for (int64_t j = 0; j < p.n; ++j) {
        const int64_t at = r * p.n + paired(j, p.n / kPair * kPair);
        float s = 0;
        for (int64_t i = 0; i < items; ++i) s += sums[i * size + at];
        p.out[r * p.n + j] = s;
      }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MotRows, Rows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transposed"));
