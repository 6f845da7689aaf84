// Decode attention over the paged K/V pool, read in place (cpu_decode.py compiles and calls
// this file). One query token a sequence; the G query heads of each KV head share its keys.
// A second entry first stores the step's new K/V rows in the pool (a decode step's layer in
// one call: no index_copy_ around it).
//
// cpu_decode.py prepends the layer's shapes as constants (so that loops unroll and the
// accumulators stay in registers) and the pool's element type:
//   KV_HEADS, GROUP (query heads per KV head), HEAD_DIM, V_DIM, BLOCK_SIZE, POOL_T
//   (float, or uint16_t holding bfloat16 bits).
//
// Work is split into items of SPLIT tokens of one sequence, shared among the threads: each
// item scores its keys (pass 1), takes their softmax against its own maximum, sums its
// values weighted by it (pass 2) and leaves (maximum, sum, weighted values) per query head;
// a second loop merges each sequence's items (the split-K of paged attention's v2 kernels).
// Keys and values are read once, where they lie, and widened to float32 in registers.

#include <torch/csrc/inductor/cpp_prefix.h>

#include <algorithm>
#include <cstring>
#include <limits>

#if !defined(KV_HEADS) || !defined(GROUP) || !defined(HEAD_DIM) || !defined(V_DIM) || \
    !defined(BLOCK_SIZE) || !defined(POOL_T)
#error "cpu_decode.py defines the layer's shapes"
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t H = KV_HEADS, G = GROUP, D = HEAD_DIM, DV = V_DIM, BS = BLOCK_SIZE;
constexpr int64_t R = H * G;  // query heads
constexpr int64_t SPLIT = 256;  // tokens an item attends
constexpr int64_t AHEAD = 16;  // tokens ahead whose rows are prefetched (blocks lie anywhere)
constexpr int64_t W = Vec::size();
constexpr int64_t ND = (D + W - 1) / W, NV = (DV + W - 1) / W;  // vectors a row spans
constexpr int64_t PART = DV + 2;  // an item's result per query head: max, sum, values
constexpr float NEG = -std::numeric_limits<float>::infinity();

inline float widen(float x) { return x; }
inline float widen(uint16_t x) {  // bfloat16: the high half of a float32
  const uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void narrow(float x, float* out) { *out = x; }
inline void narrow(float x, uint16_t* out) {  // to the nearest bfloat16, ties to even
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if (x != x) {  // NaN stays NaN
    *out = uint16_t((bits >> 16) | 0x40);
    return;
  }
  *out = uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// N elements at `row` as float32 in `out` (the caller's zeros past N stay)
#pragma GCC push_options
#pragma GCC optimize("tree-loop-vectorize")
template <int64_t N>
inline void widen_row(const POOL_T* row, float* out) {
#pragma omp simd
  for (int64_t i = 0; i < N; ++i) out[i] = widen(row[i]);
}
#pragma GCC pop_options

inline void prefetch_row(const POOL_T* row, int64_t n) {
  for (int64_t at = 0; at < n * int64_t(sizeof(POOL_T)); at += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(row) + at);
}

// row t of KV head h of `pool` (a block table's sequence, N wide) as float32 vectors in
// `vecs`, widened through `row`; the row AHEAD tokens on (before t_end) is prefetched
template <int64_t N, int64_t NVEC>
inline void load_row(const POOL_T* pool, const int64_t* table, int64_t t, int64_t t_end,
                     int64_t h, float* row, Vec (&vecs)[NVEC]) {
  const auto at = [&](int64_t u) { return pool + ((table[u / BS] * BS + u % BS) * H + h) * N; };
  if (t + AHEAD < t_end) prefetch_row(at(t + AHEAD), N);
  widen_row<N>(at(t), row);
  for (int64_t c = 0; c < NVEC; ++c) vecs[c] = Vec::loadu(row + c * W);
}

inline float sum_lanes(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// one item: tokens [t0, t1) of a sequence whose block table is `table`, for KV heads
// [h0, h1)
void attend_item(const POOL_T* q, float scale, float softcap, const POOL_T* keys,
                 const POOL_T* values, const int64_t* table, int64_t t0, int64_t t1,
                 int64_t h0, int64_t h1, float* part, float* scores) {
  alignas(64) float row[std::max(ND, NV) * W] = {};
  for (int64_t h = h0; h < h1; ++h) {  // pass 1: scores, the query rows in registers
    Vec qv[G][ND];
    for (int64_t j = 0; j < G; ++j) {
      widen_row<D>(q + (h * G + j) * D, row);
      for (int64_t c = 0; c < ND; ++c) qv[j][c] = Vec::loadu(row + c * W) * Vec(scale);
    }
    for (int64_t t = t0; t < t1; ++t) {
      Vec kv[ND];
      load_row<D>(keys, table, t, t1, h, row, kv);
      for (int64_t j = 0; j < G; ++j) {
        Vec dot = qv[j][0] * kv[0];
        for (int64_t c = 1; c < ND; ++c) dot = at::vec::fmadd(qv[j][c], kv[c], dot);
        scores[(h * G + j) * SPLIT + (t - t0)] = sum_lanes(dot);
      }
    }
  }
  const int64_t n = t1 - t0;
  for (int64_t r = h0 * G; r < h1 * G; ++r) {  // softmax against the item's own maximum
    float* s = scores + r * SPLIT;
    if (softcap > 0.f) {
      int64_t i = 0;
      for (; i + W <= n; i += W)
        ((Vec::loadu(s + i) * Vec(1.f / softcap)).tanh() * Vec(softcap)).store(s + i);
      for (; i < n; ++i) s[i] = std::tanh(s[i] / softcap) * softcap;
    }
    float top = NEG;
    for (int64_t i = 0; i < n; ++i) top = std::max(top, s[i]);
    Vec sum(0.f);
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      const Vec e = (Vec::loadu(s + i) - Vec(top)).exp_u20();
      e.store(s + i);
      sum = sum + e;
    }
    float total = sum_lanes(sum);
    for (; i < n; ++i) total += (s[i] = std::exp(s[i] - top));
    part[r * PART] = top;
    part[r * PART + 1] = total;
  }
  for (int64_t h = h0; h < h1; ++h) {  // pass 2: weighted values, accumulated in registers
    Vec acc[G][NV];
    for (int64_t j = 0; j < G; ++j)
      for (int64_t c = 0; c < NV; ++c) acc[j][c] = Vec(0.f);
    for (int64_t t = t0; t < t1; ++t) {
      Vec vv[NV];
      load_row<DV>(values, table, t, t1, h, row, vv);
      for (int64_t j = 0; j < G; ++j) {
        const Vec p(scores[(h * G + j) * SPLIT + (t - t0)]);
        for (int64_t c = 0; c < NV; ++c) acc[j][c] = at::vec::fmadd(p, vv[c], acc[j][c]);
      }
    }
    for (int64_t j = 0; j < G; ++j)
      for (int64_t c = 0; c < NV; ++c) {
        float* out = part + (h * G + j) * PART + 2 + c * W;
        acc[j][c].store(out, std::min(W, DV - c * W));
      }
  }
}

}  // namespace

// q [B, R, HEAD_DIM] (R = KV_HEADS x GROUP, the heads of a KV head adjacent); keys/values
// [blocks, BLOCK_SIZE, KV_HEADS, dim]; tables [B, width] (padded with any valid block);
// lengths [B] (a padding row's 0 gives zeros); out [B, R, V_DIM]; part: B * ceil(width * BLOCK_SIZE / SPLIT)
// * R * (V_DIM + 2) floats of scratch. All contiguous; q, pools and out are POOL_T.
// window: the keys a query sees, its own included (0: all); softcap (0: none); sinks: R
// float32 logits, or null. Fewer items than threads (short contexts, few sequences): each
// item's KV heads are shared out among the threads too.
extern "C" void textgen_decode_attention(const POOL_T* q, const POOL_T* keys,
                                         const POOL_T* values, const int64_t* tables,
                                         const int64_t* lengths, POOL_T* out, float* part,
                                         int64_t batch, int64_t width, float scale,
                                         int64_t window, float softcap, const float* sinks,
                                         int threads) {
  const int64_t splits = (width * BS + SPLIT - 1) / SPLIT, items = batch * splits;
  const int64_t parts = items >= threads ? 1 : std::min<int64_t>(H, (threads + items - 1) / items);
#pragma omp parallel num_threads(threads)
  {
    alignas(64) float scores[R * SPLIT];
#pragma omp for schedule(dynamic, 1)
    for (int64_t work = 0; work < items * parts; ++work) {
      const int64_t item = work / parts, h0 = work % parts * H / parts;
      const int64_t h1 = (work % parts + 1) * H / parts;
      const int64_t b = item / splits, start = item % splits * SPLIT;
      const int64_t first = window > 0 ? std::max<int64_t>(0, lengths[b] - window) : 0;
      const int64_t t0 = std::max(start, first), t1 = std::min(lengths[b], start + SPLIT);
      float* p = part + item * R * PART;
      if (t0 >= t1) {  // past this sequence's end
        for (int64_t r = h0 * G; r < h1 * G; ++r) p[r * PART] = NEG;
        continue;
      }
      attend_item(q + b * R * D, scale, softcap, keys, values, tables + b * width, t0, t1, h0, h1,
                  p, scores);
    }
#pragma omp for
    for (int64_t row = 0; row < batch * R; ++row) {  // merge a sequence's items
      const int64_t b = row / R, r = row % R;
      const float* first = part + (b * splits * R + r) * PART;
      float top = NEG;
      for (int64_t s = 0; s < splits; ++s) top = std::max(top, first[s * R * PART]);
      if (sinks != nullptr) top = std::max(top, sinks[r]);
      float total = sinks != nullptr ? std::exp(sinks[r] - top) : 0.f, merged[DV] = {};
      for (int64_t s = 0; s < splits; ++s) {
        const float* p = first + s * R * PART;
        if (p[0] == NEG) continue;
        const float w = std::exp(p[0] - top);
        total += w * p[1];
        for (int64_t i = 0; i < DV; ++i) merged[i] += w * p[2 + i];
      }
      const float scale_out = total > 0.f ? 1.f / total : 0.f;  // 0: a padding row, no keys
      for (int64_t i = 0; i < DV; ++i) narrow(merged[i] * scale_out, out + row * DV + i);
    }
  }
}

// The step's new K/V, k_new [B, KV_HEADS, HEAD_DIM] and v_new [B, KV_HEADS, V_DIM] (POOL_T,
// contiguous), stored at pool slots `slots` [B] (block * BLOCK_SIZE + offset), then
// textgen_decode_attention over the pools with the arguments as there.
extern "C" void textgen_decode_write_attention(const POOL_T* q, const POOL_T* k_new,
                                               const POOL_T* v_new, const int64_t* slots,
                                               POOL_T* keys, POOL_T* values,
                                               const int64_t* tables, const int64_t* lengths,
                                               POOL_T* out, float* part, int64_t batch,
                                               int64_t width, float scale, int64_t window,
                                               float softcap, const float* sinks, int threads) {
  for (int64_t b = 0; b < batch; ++b) {  // a token's heads are one row of the pool's slot
    std::memcpy(keys + slots[b] * H * D, k_new + b * H * D, H * D * sizeof(POOL_T));
    std::memcpy(values + slots[b] * H * DV, v_new + b * H * DV, H * DV * sizeof(POOL_T));
  }
  textgen_decode_attention(q, keys, values, tables, lengths, out, part, batch, width, scale,
                           window, softcap, sinks, threads);
}
