// Causal attention of prefill chunks in bfloat16 on CPUs with AVX512-BF16: each query row
// over its sequence's keys up to its own position. The CPU kernel of the op
// `textgen::causal_prefill` (cpu_prefill.py defines the op, compiles this file with
// inductor's C++ toolchain and loads it, which registers the kernel).
//
// torch's CPU flash attention computes bfloat16 inputs in float32 (~95 GFLOP/s on two
// cores here, where the bfloat16 GEMMs reach ~390): here both products take `vdpbf16ps`,
// 32 bfloat16 products an instruction into float32, flash attention's way (online softmax,
// float32 statistics and output, one pass over the keys up to each query's position).
//
// Each (sequence, KV head) has its keys packed for the scores, [keys / 16][D / 2][16][2]
// (a vector holds 16 keys' pair of dimensions, the query's pair broadcast), and its values
// for the output, [keys / 2][Dv][2] (a vector holds 16 output dimensions of a pair of keys,
// the pair's probabilities broadcast): no horizontal sums. Then every ROWS query rows of a
// query head walk the keys in tiles of 64: scores, the causal mask on the diagonal tile,
// the running max and sum, probabilities rounded to bfloat16, and the values' product.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t ROWS = 8;   // query rows walked together (they share each key load)
constexpr int64_t TILE = 64;  // keys a step of the walk
constexpr int64_t MAX_DIM = 256;

#define TEXTGEN_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// e^x for x <= 0 (scores minus their max): 2^n * p(r), r = x - n ln 2 in [-ln2/2, ln2/2],
// p of degree 6 (relative error ~1e-7); below -87 the result is ~1e-38, nothing a sum sees
TEXTGEN_AVX512_BF16 inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// One (sequence, KV head)'s keys and values in the packed layouts above, `padded` keys
// (zeros past `keys`). k and v: token t's row at base + t * token_stride.
void pack(const uint16_t* k, const uint16_t* v, int64_t token_stride_k, int64_t token_stride_v,
          int64_t keys, int64_t padded, int64_t D, int64_t DV, uint16_t* kp, uint16_t* vp) {
  std::memset(kp, 0, padded * D * sizeof(uint16_t));
  std::memset(vp, 0, padded * DV * sizeof(uint16_t));
  for (int64_t t = 0; t < keys; ++t) {
    const uint16_t* kr = k + t * token_stride_k;
    uint16_t* kb = kp + (t / 16) * 16 * D + (t % 16) * 2;  // [t / 16][d / 2][t % 16][d % 2]
    for (int64_t d = 0; d < D; d += 2) {
      kb[(d / 2) * 32] = kr[d];
      kb[(d / 2) * 32 + 1] = kr[d + 1];
    }
    const uint16_t* vr = v + t * token_stride_v;
    uint16_t* vb = vp + (t / 2) * 2 * DV + (t % 2);  // [t / 2][dv][t % 2]
    for (int64_t d = 0; d < DV; ++d) vb[d * 2] = vr[d];
  }
}

// Query rows r0 .. r0 + rows - 1 of one head, row r over keys 0 .. seen[r] (its position,
// at most the last key). q: row r at q + r * q_stride; out: row r at out + r * out_stride.
TEXTGEN_AVX512_BF16 void attend_rows(const uint16_t* q, int64_t q_stride, const uint16_t* kp,
                                     const uint16_t* vp, uint16_t* out, int64_t out_stride,
                                     const int64_t* seen, int64_t r0, int64_t rows, int64_t D,
                                     int64_t DV, float scale) {
  alignas(64) float o[ROWS][MAX_DIM];
  alignas(64) float s[ROWS][TILE];
  alignas(64) uint16_t p[ROWS][TILE];
  float row_max[ROWS], row_sum[ROWS];
  for (int m = 0; m < ROWS; ++m) {
    row_max[m] = -INFINITY;
    row_sum[m] = 0.f;
    for (int64_t d = 0; d < DV; ++d) o[m][d] = 0.f;
  }
  const uint16_t* qr[ROWS];
  int64_t last = 0;  // the last key any of the rows sees
  int position[ROWS];
  for (int m = 0; m < ROWS; ++m) {
    const int64_t r = r0 + (m < rows ? m : 0);  // (rows past the end: row r0 again, unused)
    qr[m] = q + r * q_stride;
    position[m] = int(seen[r]);
    last = std::max(last, seen[r]);
  }
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t t0 = 0; t0 <= last; t0 += TILE) {
    // scores: 4 vectors of 16 keys
    for (int64_t kv = 0; kv < TILE / 16; ++kv) {
      const int64_t key0 = t0 + kv * 16;
      if (key0 > last) {
        for (int m = 0; m < ROWS; ++m) _mm512_store_ps(s[m] + kv * 16, _mm512_set1_ps(-INFINITY));
        continue;
      }
      const uint16_t* kb = kp + (key0 / 16) * 16 * D;
      __m512 acc[ROWS];
      for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
      for (int64_t dp = 0; dp < D / 2; ++dp) {
        const __m512bh keys = (__m512bh)_mm512_load_si512((const void*)(kb + dp * 32));
        for (int m = 0; m < ROWS; ++m) {
          uint32_t pair;
          std::memcpy(&pair, qr[m] + 2 * dp, 4);
          acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32(pair), keys);
        }
      }
      const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(int(key0)));
      for (int m = 0; m < ROWS; ++m) {
        // causal: a row sees the keys up to its own position
        __mmask16 visible = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(position[m]));
        __m512 scaled = _mm512_mul_ps(acc[m], _mm512_set1_ps(scale));
        _mm512_store_ps(s[m] + kv * 16,
                        _mm512_mask_blend_ps(visible, _mm512_set1_ps(-INFINITY), scaled));
      }
    }
    // the running max and sum; probabilities rounded to bfloat16
    for (int m = 0; m < ROWS; ++m) {
      __m512 tile_max = _mm512_max_ps(_mm512_max_ps(_mm512_load_ps(s[m]), _mm512_load_ps(s[m] + 16)),
                                      _mm512_max_ps(_mm512_load_ps(s[m] + 32), _mm512_load_ps(s[m] + 48)));
      const float new_max = std::fmax(row_max[m], _mm512_reduce_max_ps(tile_max));
      // (a row's first tile always holds key 0: new_max is finite from there on)
      const float correction = std::exp(row_max[m] - new_max);
      row_max[m] = new_max;
      __m512 sum = _mm512_setzero_ps();
      for (int64_t kv = 0; kv < TILE / 16; ++kv) {
        __m512 e = exp_neg(_mm512_sub_ps(_mm512_load_ps(s[m] + kv * 16), _mm512_set1_ps(new_max)));
        e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(_mm512_load_ps(s[m] + kv * 16),
                                                   _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), e);
        sum = _mm512_add_ps(sum, e);
        _mm256_store_si256((__m256i*)(p[m] + kv * 16), (__m256i)_mm512_cvtneps_pbh(e));
      }
      row_sum[m] = row_sum[m] * correction + _mm512_reduce_add_ps(sum);
      if (correction != 1.f)
        for (int64_t d = 0; d < DV; d += 16)
          _mm512_store_ps(o[m] + d, _mm512_mul_ps(_mm512_load_ps(o[m] + d), _mm512_set1_ps(correction)));
    }
    // the values' product, 16 output dimensions a vector
    const int64_t pairs = (std::min(TILE, last + 1 - t0) + 1) / 2;
    const uint16_t* vb = vp + t0 * DV;  // [t / 2][dv][2] from key t0 on
    for (int64_t d = 0; d < DV; d += 16) {
      __m512 acc[ROWS];
      for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_load_ps(o[m] + d);
      for (int64_t kp2 = 0; kp2 < pairs; ++kp2) {
        const __m512bh values = (__m512bh)_mm512_loadu_si512((const void*)(vb + kp2 * 2 * DV + d * 2));
        for (int m = 0; m < ROWS; ++m) {
          uint32_t pair;
          std::memcpy(&pair, p[m] + 2 * kp2, 4);
          acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32(pair), values);
        }
      }
      for (int m = 0; m < ROWS; ++m) _mm512_store_ps(o[m] + d, acc[m]);
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 inverse = _mm512_set1_ps(1.f / row_sum[m]);
    uint16_t* row = out + (r0 + m) * out_stride;
    for (int64_t d = 0; d < DV; d += 16)
      _mm256_storeu_si256((__m256i*)(row + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o[m] + d), inverse)));
  }
}

// q [B, H, L, D], k [B, KVH, N, D], v [B, KVH, N, Dv] (bfloat16, any strides but a
// contiguous last dimension), positions [B, L] int64 -> [B, L, H, Dv] bfloat16: query row
// (b, r) over keys 0 .. positions[b][r] of sequence b (clamped to N - 1: a padding row's
// position may lie past its keys).
at::Tensor causal_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& positions, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 &&
                  q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16 && q.stride(3) == 1 && k.stride(3) == 1 &&
                  v.stride(3) == 1,
              "textgen::causal_prefill: bfloat16 [B, H, L, D] tensors, the last dim contiguous");
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3);
  const int64_t KVH = k.size(1), DV = v.size(3);
  const int64_t N = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == KVH && v.size(2) == N && N > 0 &&
                  k.size(3) == D && H % KVH == 0 && D % 2 == 0 && D <= MAX_DIM &&
                  DV % 16 == 0 && DV <= MAX_DIM,
              "textgen::causal_prefill: shapes it does not take");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == B * L,
              "textgen::causal_prefill: positions must be a contiguous [B, L] int64 tensor");
  at::Tensor seen = positions.clamp(0, N - 1);  // a padding row's position may pass the keys
  const int64_t* seen_d = seen.const_data_ptr<int64_t>();
  const int64_t used = std::min(N, seen.max().item<int64_t>() + 1);  // keys any row sees
  const int64_t padded = (used + TILE - 1) / TILE * TILE, G = H / KVH;
  at::Tensor kp = at::empty({B, KVH, padded * D}, q.options());
  at::Tensor vp = at::empty({B, KVH, padded * DV}, q.options());
  at::Tensor out = at::empty({B, L, H, DV}, q.options());
  const uint16_t *qd = (const uint16_t*)q.const_data_ptr(), *kd = (const uint16_t*)k.const_data_ptr(),
                 *vd = (const uint16_t*)v.const_data_ptr();
  uint16_t *kpd = (uint16_t*)kp.data_ptr(), *vpd = (uint16_t*)vp.data_ptr(),
           *od = (uint16_t*)out.data_ptr();
  const int threads = at::get_num_threads();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t bh = 0; bh < B * KVH; ++bh) {
    const int64_t b = bh / KVH, h = bh % KVH;
    pack(kd + b * k.stride(0) + h * k.stride(1), vd + b * v.stride(0) + h * v.stride(1),
         k.stride(2), v.stride(2), used, padded, D, DV, kpd + bh * padded * D,
         vpd + bh * padded * DV);
  }
  const int64_t blocks = (L + ROWS - 1) / ROWS;
  const float s = float(scale);
  // the longest walks (the last rows) first, so the threads end together
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t item = 0; item < B * H * blocks; ++item) {
    const int64_t block = blocks - 1 - item % blocks, bh = item / blocks;
    const int64_t b = bh / H, h = bh % H, kvh = h / G;
    const int64_t r0 = block * ROWS;
    attend_rows(qd + b * q.stride(0) + h * q.stride(1), q.stride(2),
                kpd + (b * KVH + kvh) * padded * D, vpd + (b * KVH + kvh) * padded * DV,
                od + b * L * H * DV + h * DV, H * DV, seen_d + b * L, r0, std::min(ROWS, L - r0),
                D, DV, s);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(textgen, CPU, m) { m.impl("causal_prefill", &causal_prefill); }
