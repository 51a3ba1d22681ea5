// Fused causal-by-position attention for XLA:CPU, flash style: the scores of a block of queries against a tile of
// keys live in a small buffer and are softmaxed online, never written out as a [T, S] array (what XLA:CPU does).
//
// Semantics are those of `mot_jax.models.attention.attend` (no `allowed` key set): q [B, T, H, d]; k, v [B, K, S, d];
// q_pos [B, T], k_pos [B, S] int32; k_valid [B, S] bool; window (int32) and scale (float32) scalars. A key is
// visible to a query when it is valid, not after it (q_pos - k_pos >= 0) and less than `window` positions behind
// it; logits are (q . k) * scale, optionally soft-capped (softcap > 0: tanh(x / softcap) * softcap); a query with no
// visible key attends uniformly to all S keys. Output [B, T, H, d] in v's dtype. float32 runs on vector FMAs;
// bfloat16 on AMX tiles (bf16 products with float32 sums, the probabilities rounded to bf16 before their product
// with v as XLA's path does) where the head width is a multiple of 32 and the CPU has AMX, else widened to float32.
//
// Work items are (batch row, KV head, query block); the G query heads sharing a KV head are stacked as rows of one
// block, so each key tile is loaded once for all of them. Key tiles wholly hidden from a query block (after its
// last query, out of its window, or all invalid) are skipped, which is the causal skip of a fresh prefill and the
// empty slots of a cache. Items run on XLA's intra-op thread pool.

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define MOT_AMX 1
#endif

#include "common.h"

namespace {

// A micro-kernel keeps 4 x kPanel sums: 4 x 4 in AVX-512's 32 registers, 4 x 2 in AVX2's 16.
#ifdef __AVX512F__
constexpr int kPanel = 4;  // vectors of columns per micro-kernel
#else
constexpr int kPanel = 2;
#endif
constexpr int kKeys = 64;  // keys per tile

// exp for x <= 0 (Cephes' polynomial on a range-reduced argument); exactly 0 below -87.
inline vf vexp(vf x) {
  const vf lo = splat(-87.0f);
  vf xc = x < lo ? lo : x;
  vi n = __builtin_convertvector(xc * 1.44269504088896341f - 0.5f, vi);  // round(x / ln 2) for x <= 0
  vf nf = __builtin_convertvector(n, vf);
  vf r = xc - nf * 0.693359375f + nf * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vi bits = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  vf y = p * scale;
  return x < lo ? vf{} : y;
}

// two float32 vectors rounded to bfloat16 (nearest even) and paired in 32-bit words, `lo` in the low halves
inline vu bf16_pairs(vf lo, vf hi) {
  vu a, b;
  std::memcpy(&a, &lo, sizeof(a));
  std::memcpy(&b, &hi, sizeof(b));
  a = (a + 0x7fffu + ((a >> 16) & 1u)) >> 16;
  b = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  return a | (b << 16);
}

// The block's rows (query head x query) run along vectors: queries are stored transposed, qt[d][rows], and so are
// the scores st[keys][rows] and the output ot[d][rows]. K and V are read in their own [keys][d] layout.

// acc[4][NV] over 4 consecutive a-rows and NV vectors of b-columns: acc[i] += sum_x a[i][x] * b[x][:]
// (a: 4 rows `a_stride` apart, read along x; b: rows `b_stride` apart; x runs over `inner`)
template <int NV>
inline void gemm_4xNV(const float* a, int a_stride, int a_step, const float* b, int b_stride, int inner,
                      float* c, int c_stride, bool accumulate) {
  vf acc[4][NV];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = accumulate ? load(c + i * c_stride + j * kLanes) : vf{};
  const float *a0 = a, *a1 = a + a_stride, *a2 = a + 2 * a_stride, *a3 = a + 3 * a_stride;
  for (int x = 0; x < inner; ++x) {
    vf bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = load(b + x * b_stride + j * kLanes);
    for (int j = 0; j < NV; ++j) in_register(bv[j]);
    const int ax = x * a_step;
    vf x0 = splat(a0[ax]), x1 = splat(a1[ax]), x2 = splat(a2[ax]), x3 = splat(a3[ax]);
    for (int j = 0; j < NV; ++j) {
      acc[0][j] += x0 * bv[j];
      acc[1][j] += x1 * bv[j];
      acc[2][j] += x2 * bv[j];
      acc[3][j] += x3 * bv[j];
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < NV; ++j) store(c + i * c_stride + j * kLanes, acc[i][j]);
}

// gemm_4xNV for the `nv` (<= NV) vectors of columns left
template <int NV>
inline void panel(int nv, const float* a, int a_stride, int a_step, const float* b, int b_stride, int inner, float* c,
                  int c_stride, bool accumulate) {
  if (nv == NV)
    gemm_4xNV<NV>(a, a_stride, a_step, b, b_stride, inner, c, c_stride, accumulate);
  else if constexpr (NV > 1)
    panel<NV - 1>(nv, a, a_stride, a_step, b, b_stride, inner, c, c_stride, accumulate);
}

constexpr int kPanelCols = kPanel * kLanes;

// c[4 i][cols] (+)= sum_x a[i][x] b[x][cols] for every 4-row group of `rows4` and the `cols` (a multiple of kLanes),
// a panel of kPanelCols of b's columns at a time so that the panel stays in L1 across the row groups; panels p with
// `active[p] == 0` are left out
inline void gemm(const float* a, int a_stride, int a_step, int rows4, const float* b, int b_stride, int inner,
                 float* c, int c_stride, int cols, bool accumulate, const char* active) {
  for (int j = 0; j < cols; j += kPanelCols) {
    if (!active[j / kPanelCols]) continue;
    const int nv = std::min(kPanel, (cols - j) / kLanes);
    for (int i = 0; i < rows4; i += 4)
      panel<kPanel>(nv, a + i * a_stride, a_stride, a_step, b + j, b_stride, inner, c + i * c_stride + j, c_stride,
                    accumulate);
  }
}


#ifdef MOT_AMX
// bfloat16 blocks on AMX: the scores and the values' sums as tile products with float32 sums. Tile registers:
// 0-3 the 2 x 2 float32 results, 4-5 the left operands, 6-7 the right ones (VNNI: row pairs interleaved).
bool amx_ready() {  // Linux hands out the tile registers on request, once a process
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void amx_configure() {
  TileConfig config;
  for (int i = 0; i < 8; ++i) config.colsb[i] = 64, config.rows[i] = 16;
  _tile_loadconfig(&config);
}

// c[32 m][32 n] (+)= a[32 m][inner] . b, inner a multiple of 32: a rows `a_stride` bytes apart (bf16), b as VNNI
// pairs [inner / 2][n] of 32-bit words `b_stride` bytes apart, c float32 rows `c_stride` bytes apart
inline void amx_32x32(const uint16_t* a, int a_stride, const uint32_t* b, int b_stride, int inner, float* c,
                      int c_stride, bool accumulate) {
  char* c0 = reinterpret_cast<char*>(c);
  if (accumulate) {
    _tile_loadd(0, c0, c_stride);
    _tile_loadd(1, c0 + 64, c_stride);
    _tile_loadd(2, c0 + 16 * c_stride, c_stride);
    _tile_loadd(3, c0 + 16 * c_stride + 64, c_stride);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  const char* a0 = reinterpret_cast<const char*>(a);
  const char* b0 = reinterpret_cast<const char*>(b);
  for (int x = 0; x < inner; x += 32) {
    _tile_loadd(4, a0 + x * 2, a_stride);
    _tile_loadd(5, a0 + 16 * a_stride + x * 2, a_stride);
    _tile_loadd(6, b0 + (x / 2) * b_stride, b_stride);
    _tile_loadd(7, b0 + (x / 2) * b_stride + 64, b_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c0, c_stride);
  _tile_stored(1, c0 + 64, c_stride);
  _tile_stored(2, c0 + 16 * c_stride, c_stride);
  _tile_stored(3, c0 + 16 * c_stride + 64, c_stride);
}
#endif

// a tile's values [n][d] as [d][kKeys], zero after the n-th key (the left operand of the AMX values' product)
inline void transpose_values(const uint16_t* values, int n, int d, uint16_t* out) {
  for (int c = 0; c < kKeys; ++c)
    for (int e = 0; e < d; ++e) out[e * kKeys + c] = c < n ? values[c * d + e] : 0;
}

struct Shape {
  int64_t batch, queries, heads, kv_heads, keys, dim;
  int group() const { return int(heads / kv_heads); }
};

struct Scratch {
  std::vector<float> qt, ot, st, k, v, m, l, best, shift, correction;
  std::vector<int32_t> qpos, from, kpos;
  std::vector<int32_t> panel_qmax, panel_from;  // per panel of kPanelCols rows: the latest query, the earliest `from`
  std::vector<char> active;                     // per panel: some row may see a key of this tile
  std::vector<uint32_t> qv, pv;  // AMX: queries and probabilities as VNNI pairs
  std::vector<uint16_t> kb, vt;  // AMX: a partial tile's keys, the tile's values transposed [d][keys]
  const float *keys, *values;    // float32: the tile's keys and values [keys][kd]
  int kd;
};

template <typename T>
struct Problem {
  Shape shape;
  const T *q, *k, *v;
  const int32_t *q_pos, *k_pos;
  const bool* k_valid;
  int32_t window;
  float scale, softcap;
  T* out;
  int block;           // queries per work item
  int blocks;          // query blocks per (batch row, KV head)
  int tiles;           // key tiles
  bool amx = false;    // bfloat16 products on AMX tiles (else float32 vector FMAs)
  const uint16_t* values_transposed = nullptr;  // AMX: [B, K, tiles, d, keys], when several blocks share them
  std::vector<int32_t> tile_min, tile_max;  // [B, tiles]: the valid keys' position range (min > max: none valid)
  std::vector<char> tile_full;              // [B, tiles]: every key of the tile is valid

  void run(int64_t item, Scratch& w) const;
};

template <typename T>
void Problem<T>::run(int64_t item, Scratch& w) const {
  const Shape& sh = shape;
  const int g = sh.group(), d = int(sh.dim), d4 = (d + 3) / 4 * 4;
  const int64_t b = item / (sh.kv_heads * blocks), h = item / blocks % sh.kv_heads, qb = item % blocks;
  const int64_t t0 = qb * block, nt = std::min<int64_t>(block, sh.queries - t0);
  const int align = amx ? 32 : kLanes, rows = int(g * nt), cols = (rows + align - 1) / align * align;
  // the row stride of qt, st and ot: float32 rows a power of two apart fall into a few L1 sets and evict each other
  // (measured on the vector path; the AMX path keeps `cols`, not measured with the padding on an AMX machine)
  const int ld = amx ? cols : cols + kLanes;
  const float post_scale = amx ? scale : 1.f;  // the AMX path scales the scores, the other the queries
  if (amx) {
    w.qv.assign(size_t(d / 2) * cols, 0u);
  } else {
    w.qt.assign(size_t(d4) * ld, 0.f);
    w.k.assign(size_t(kKeys) * d4, 0.f);  // float32 copies of a tile's keys and values, zero past d and n
    w.v.assign(size_t(kKeys) * d4, 0.f);
  }
  w.ot.assign(size_t(d4) * ld, 0.f);
  w.st.resize(size_t(kKeys) * ld);
  w.m.assign(cols, -INFINITY);
  w.l.assign(cols, 0.f);
  w.qpos.assign(cols, INT_MIN);  // padding rows see no key
  w.from.assign(cols, INT_MAX);
  w.best.resize(cols);
  w.shift.resize(cols);
  w.correction.resize(cols);
  w.kpos.resize(kKeys);
  // row j * nt + t: query head h * g + j, query t0 + t
  int32_t qmin = INT_MAX, qmax = INT_MIN;
  for (int64_t t = 0; t < nt; ++t) {
    const int32_t p = q_pos[b * sh.queries + t0 + t];
    qmin = std::min(qmin, p);
    qmax = std::max(qmax, p);
    for (int j = 0; j < g; ++j) {
      const int64_t r = j * nt + t;
      const T* src = q + ((b * sh.queries + t0 + t) * sh.heads + h * g + j) * d;
      if (amx) {
        for (int e = 0; e < d / 2; ++e) std::memcpy(&w.qv[e * cols + r], src + 2 * e, sizeof(uint32_t));
      } else {
        for (int e = 0; e < d; ++e) w.qt[e * ld + r] = widen(src[e]) * scale;
      }
      w.qpos[r] = p;
      w.from[r] = int32_t(std::max<int64_t>(int64_t(p) - window, INT_MIN));  // visible: from < key position <= p
    }
  }
  const T* kh = k + (b * sh.kv_heads + h) * sh.keys * d;
  const T* vh = v + (b * sh.kv_heads + h) * sh.keys * d;
  const int32_t* kp = k_pos + b * sh.keys;
  const bool* kv = k_valid + b * sh.keys;
  const int64_t lower = int64_t(qmin) - window;  // a key at or below this is out of every query's window
  // A tile on the block's diagonal is hidden from the rows of its earlier queries: the products skip panels of such
  // rows. Their scores in st are then stale, but the mask below sets them to -inf (a tile visible to every row is
  // unmasked, and no panel of it is skipped), so their sums and outputs are left as they were.
  const int panels = (cols + kPanelCols - 1) / kPanelCols;
  w.panel_qmax.assign(panels, INT_MIN);
  w.panel_from.assign(panels, INT_MAX);
  w.active.assign(panels, 1);
  for (int r = 0; r < cols; ++r) {
    w.panel_qmax[r / kPanelCols] = std::max(w.panel_qmax[r / kPanelCols], w.qpos[r]);
    w.panel_from[r / kPanelCols] = std::min(w.panel_from[r / kPanelCols], w.from[r]);
  }
#ifdef MOT_AMX
  if (amx) amx_configure();
#endif
  for (int tile = 0; tile < tiles; ++tile) {
    const int32_t kmin = tile_min[b * tiles + tile], kmax = tile_max[b * tiles + tile];
    if (kmin > kmax || kmin > qmax || int64_t(kmax) <= lower) continue;
    if (!amx)  // (the AMX path computes every panel)
      for (int p = 0; p < panels; ++p) w.active[p] = w.panel_qmax[p] >= kmin && w.panel_from[p] < kmax;
    const int64_t s0 = int64_t(tile) * kKeys;
    const int n = int(std::min<int64_t>(kKeys, sh.keys - s0)), n4 = amx ? kKeys : (n + 3) / 4 * 4;
    for (int c = 0; c < kKeys; ++c) w.kpos[c] = c < n && kv[s0 + c] ? kp[s0 + c] : INT_MAX;
    const uint16_t* values_t = nullptr;  // AMX: this tile's values [d][keys]
    if (amx) {
#ifdef MOT_AMX
      const uint16_t* keys = reinterpret_cast<const uint16_t*>(kh + s0 * d);
      const uint16_t* values = reinterpret_cast<const uint16_t*>(vh + s0 * d);
      if (n < kKeys) {  // a partial tile: zero keys after the last
        w.kb.assign(size_t(kKeys) * d, 0);
        std::memcpy(w.kb.data(), keys, sizeof(uint16_t) * n * d);
        keys = w.kb.data();
      }
      if (values_transposed != nullptr) {
        values_t = values_transposed + ((b * sh.kv_heads + h) * tiles + tile) * d * kKeys;
      } else {
        w.vt.resize(size_t(d) * kKeys);
        transpose_values(values, n, d, w.vt.data());
        values_t = w.vt.data();
      }
      // st[key][row] = k[key] . q[row] (unscaled)
      for (int c = 0; c < kKeys; c += 32)
        for (int r = 0; r < cols; r += 32)
          amx_32x32(keys + c * d, d * 2, w.qv.data() + r, cols * 4, d, w.st.data() + c * ld + r, ld * 4, false);
#endif
    } else {
      // this tile's keys and values as float32 [n4][d] (read in place when they already are, whole and aligned)
      const float *kt, *vt;
      int kd;
      if (std::is_same_v<T, float> && n == n4 && d == d4) {
        kt = reinterpret_cast<const float*>(kh + s0 * d);
        vt = reinterpret_cast<const float*>(vh + s0 * d);
        kd = d;
      } else {
        for (int c = 0; c < n; ++c)
          for (int e = 0; e < d; ++e) {
            w.k[c * d4 + e] = widen(kh[(s0 + c) * d + e]);
            w.v[c * d4 + e] = widen(vh[(s0 + c) * d + e]);
          }
        for (int c = n; c < n4; ++c)
          for (int e = 0; e < d4; ++e) w.k[c * d4 + e] = w.v[c * d4 + e] = 0.f;
        kt = w.k.data(), vt = w.v.data(), kd = d4;
      }
      w.keys = kt, w.values = vt, w.kd = kd;
      // st[key][row] = k[key] . q[row]
      gemm(kt, kd, 1, n4, w.qt.data(), ld, d, w.st.data(), ld, cols, false, w.active.data());
    }
    // online softmax along each row (column of st), a key row of st at a time
    const bool all_visible = tile_full[b * tiles + tile] && kmax <= qmin && int64_t(kmin) > int64_t(qmax) - window;
    float* best = w.best.data();
    for (int r = 0; r < cols; r += kLanes) store(best + r, splat(-INFINITY));
    for (int c = 0; c < n; ++c) {
      float* sc = w.st.data() + size_t(c) * ld;
      const int32_t kpc = w.kpos[c];
      for (int r = 0; r < cols; r += kLanes) {
        vf x = load(sc + r) * post_scale;
        if (softcap > 0)
          for (int i = 0; i < kLanes; ++i) x[i] = std::tanh(x[i] / softcap) * softcap;
        if (!all_visible) {
          x = (kpc <= loadi(w.qpos.data() + r)) & (kpc > loadi(w.from.data() + r)) ? x : splat(-INFINITY);
          store(sc + r, x);
        } else if (softcap > 0 || amx) {
          store(sc + r, x);
        }
        const vf m = load(best + r);
        store(best + r, m > x ? m : x);
      }
    }
    float* shift = w.shift.data();
    float* correction = w.correction.data();
    for (int r = 0; r < cols; r += kLanes) {
      const vf m_old = load(w.m.data() + r), tile_max = load(best + r);
      const vf m_new = m_old > tile_max ? m_old : tile_max;
      const vf m_safe = m_new == splat(-INFINITY) ? vf{} : m_new;  // rows with nothing visible yet
      store(shift + r, m_safe);
      store(correction + r, vexp(m_old - m_safe));  // 0 where m_old = -inf
      store(w.m.data() + r, m_new);
      store(best + r, vf{});  // now the rows' sums over this tile
    }
    for (int c = 0; c < n; ++c) {
      float* sc = w.st.data() + size_t(c) * ld;
      for (int r = 0; r < cols; r += kLanes) {
        const vf e = vexp(load(sc + r) - load(shift + r));
        store(best + r, load(best + r) + e);
        store(sc + r, e);
      }
    }
    for (int c = n; c < n4; ++c) std::memset(w.st.data() + size_t(c) * ld, 0, sizeof(float) * cols);
    for (int r = 0; r < cols; r += kLanes)
      store(w.l.data() + r, load(w.l.data() + r) * load(correction + r) + load(best + r));
    for (int e = 0; e < d; ++e) {
      float* o = w.ot.data() + size_t(e) * ld;
      for (int r = 0; r < cols; r += kLanes) store(o + r, load(o + r) * load(correction + r));
    }
    // ot[e][row] += sum_key v[key][e] p[key][row]
    if (amx) {
#ifdef MOT_AMX
      w.pv.resize(size_t(kKeys / 2) * cols);
      for (int c = 0; c < kKeys; c += 2)
        for (int r = 0; r < cols; r += kLanes) {
          const vu pair = bf16_pairs(load(w.st.data() + c * ld + r), load(w.st.data() + (c + 1) * ld + r));
          std::memcpy(w.pv.data() + (c / 2) * cols + r, &pair, sizeof(pair));
        }
      for (int e = 0; e < d; e += 32)
        for (int r = 0; r < cols; r += 32)
          amx_32x32(values_t + e * kKeys, kKeys * 2, w.pv.data() + r, cols * 4, kKeys, w.ot.data() + e * ld + r,
                    ld * 4, true);
#endif
    } else {
      gemm(w.values, 1, w.kd, d4, w.st.data(), ld, n4, w.ot.data(), ld, cols, true, w.active.data());
    }
  }
#ifdef MOT_AMX
  if (amx) _tile_release();
#endif
  std::vector<float> mean;  // the uniform fallback of a row with no visible key: the mean of all S values
  for (int j = 0; j < g; ++j) {
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t r = j * nt + t;
      T* dst = out + ((b * sh.queries + t0 + t) * sh.heads + h * g + j) * d;
      if (w.m[r] != -INFINITY) {
        const float inv = 1.f / w.l[r];
        for (int e = 0; e < d; ++e) narrow(w.ot[e * ld + r] * inv, dst + e);
        continue;
      }
      if (mean.empty()) {
        mean.assign(d, 0.f);
        for (int64_t s = 0; s < sh.keys; ++s)
          for (int e = 0; e < d; ++e) mean[e] += widen(vh[s * d + e]);
        for (int e = 0; e < d; ++e) mean[e] /= float(sh.keys);
      }
      for (int e = 0; e < d; ++e) narrow(mean[e], dst + e);
    }
  }
}

template <typename T>
ffi::Error run(ffi::ThreadPool& pool, Problem<T>& pr) {
  const Shape& sh = pr.shape;
  const int g = sh.group();
  // ~256 rows (query heads x queries) per item, fewer queries per item when there are few
  int block = std::max(8, 256 / g);
  block = int(std::min<int64_t>(block, std::max<int64_t>(1, sh.queries)));
  pr.block = block;
#ifdef MOT_AMX
  pr.amx = std::is_same_v<T, uint16_t> && sh.dim % 32 == 0 && amx_ready();
#endif
  pr.blocks = int((sh.queries + block - 1) / block);
  pr.tiles = int((sh.keys + kKeys - 1) / kKeys);
  pr.tile_min.assign(sh.batch * pr.tiles, INT_MAX);
  pr.tile_max.assign(sh.batch * pr.tiles, INT_MIN);
  pr.tile_full.assign(sh.batch * pr.tiles, 1);
  for (int64_t b = 0; b < sh.batch; ++b)
    for (int64_t s = 0; s < sh.keys; ++s) {
      const int64_t at = b * pr.tiles + s / kKeys;
      if (!pr.k_valid[b * sh.keys + s]) {
        pr.tile_full[at] = 0;
        continue;
      }
      const int32_t p = pr.k_pos[b * sh.keys + s];
      pr.tile_min[at] = std::min(pr.tile_min[at], p);
      pr.tile_max[at] = std::max(pr.tile_max[at], p);
    }
  thread_local std::vector<uint16_t> values_transposed;  // this call's thread owns it until the call returns
  if (pr.amx && pr.blocks > 1) {  // every query block reads the same values: transpose them once
    values_transposed.resize(sh.batch * sh.kv_heads * pr.tiles * sh.dim * kKeys);
    uint16_t* transposed = values_transposed.data();
    parallel_for<Scratch>(pool, sh.batch * sh.kv_heads * pr.tiles, [&pr, transposed](int64_t i, Scratch&) {
      const Shape& sh = pr.shape;
      const int64_t s0 = i % pr.tiles * kKeys, d = sh.dim;
      const int n = int(std::min<int64_t>(kKeys, sh.keys - s0));
      const uint16_t* v = reinterpret_cast<const uint16_t*>(pr.v) + (i / pr.tiles * sh.keys + s0) * d;
      transpose_values(v, n, int(d), transposed + i * d * kKeys);
    });
    pr.values_transposed = transposed;
  }
  const int64_t per_head = pr.blocks, items = sh.batch * sh.kv_heads * per_head;
  // later query blocks see more keys: start them first so the last items to finish are short
  auto body = [&pr, per_head](int64_t i, Scratch& w) {
    const int64_t rest = i % per_head;
    pr.run(i - rest + (per_head - 1 - rest), w);
  };
  if (items) parallel_for<Scratch>(pool, items, body);
  return ffi::Error::Success();
}

ffi::Error Attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> k_pos, ffi::Buffer<ffi::PRED> k_valid,
                     ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::AnyBuffer> out,
                     float softcap) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4) return ffi::Error::InvalidArgument("q and k must be rank 4");
  Shape sh{qd[0], qd[1], qd[2], kd[1], kd[2], qd[3]};
  if (sh.kv_heads == 0 || sh.heads % sh.kv_heads || kd[3] != sh.dim || kd[0] != sh.batch)
    return ffi::Error::InvalidArgument("q [B, T, H, d] and k [B, K, S, d] do not match");
  const auto type = q.element_type();
  if (k.element_type() != type || v.element_type() != type || out->element_type() != type)
    return ffi::Error::InvalidArgument("q, k, v and the output must share one dtype");
  auto fill = [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    Problem<T> pr;
    pr.shape = sh;
    pr.q = static_cast<const T*>(q.untyped_data());
    pr.k = static_cast<const T*>(k.untyped_data());
    pr.v = static_cast<const T*>(v.untyped_data());
    pr.q_pos = q_pos.typed_data();
    pr.k_pos = k_pos.typed_data();
    pr.k_valid = k_valid.typed_data();
    pr.window = window.typed_data()[0];
    pr.scale = scale.typed_data()[0];
    pr.softcap = softcap;
    pr.out = static_cast<T*>(out->untyped_data());
    return run(pool, pr);
  };
  if (type == ffi::DataType::F32) return fill(static_cast<float*>(nullptr));
  if (type == ffi::DataType::BF16) return fill(static_cast<uint16_t*>(nullptr));
  return ffi::Error::InvalidArgument("only float32 and bfloat16 are supported");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MotAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("softcap"));
