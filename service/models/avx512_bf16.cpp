// int4 and int8 weight x bfloat16 activation products on CPUs with AVX512-BF16: the CPU
// kernels of the ops `textgen::int4_linear` and `textgen::int8_linear`, and bfloat16's
// RMSNorm in one call, `textgen::rms_norm` (fused_norms.py) (avx512_bf16.py
// defines the ops, compiles this file with inductor's C++ toolchain and loads it, which
// registers the kernels; int4_avx512.py and int8_avx512.py pack the weights).
//
// torch's `_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm` widen each weight to
// float32 and multiply in float32 FMAs (16 products an instruction); here each 4-bit weight
// (or each half of an 8-bit one) becomes an exact bfloat16 integer through a 32-entry table
// (vpermw) and `vdpbf16ps` takes 32 products an instruction, accumulated in float32. Each
// product is exact in float32 (bfloat16 x small integer), so the result differs from the
// dequantized weights' float32 product only in the order of the float32 sums.
//
// int4: a group's scale and zero are applied once per 32 inputs: with
// w = (q - 8) * s + z, sum_k x_k w_k = s * sum_k x_k q_k + (z - 8 s) * sum_k x_k.
// Layout (int4_avx512.pack): rows in blocks of 32 (N padded), each block 2 vectors of 16
// rows; per block, per quad of inputs k = 4kq .. 4kq + 3, per vector, 32 bytes: byte 2i =
// q[n][4kq] | q[n][4kq + 2] << 4 and byte 2i + 1 = q[n][4kq + 1] | q[n][4kq + 3] << 4, for
// row n = 32b + 16v + i. One 32-bit lane per row then holds that row's (k, k + 1) pair
// (low nibbles) or (k + 2, k + 3) pair (high nibbles), to be multiplied by the broadcast
// input pair: no horizontal sums. Scales and zeros: [blocks][K / 32][32] bfloat16.
//
// int8: q = 16 h + l with l = q & 15 (0 .. 15) and h = q >> 4 (signed, -8 .. 7), so
// sum_k x_k q_k = 16 sum_k x_k h_k + sum_k x_k l_k: two lookups and two vdpbf16ps per 32
// bytes, as int4's, then the row's scale once. Layout (int8_avx512.pack): blocks of 32 rows
// as int4's; per block, per pair of inputs k = 2kp, 2kp + 1, per vector, 32 bytes: byte
// 2i = q[n][2kp], byte 2i + 1 = q[n][2kp + 1], row n = 32b + 16v + i. Scales: [padded N]
// float32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t GROUP = 32;  // inputs a scale and zero cover
constexpr int64_t ROWS = 32;   // rows a block packs
constexpr int64_t QUAD_BYTES = 64;  // int4: a block's bytes per quad of inputs (2 vectors x 32)
constexpr int64_t PAIR_BYTES = 64;  // int8: a block's bytes per pair of inputs (2 vectors x 32)
#ifndef PREFETCH
#define PREFETCH 2048
#endif
// input rows from which a product dequantizes the weight to bfloat16 and hands it to
// torch's dense matmul: a long prefill chunk is bound by arithmetic, not by the weight's
// bytes. Measured on the embedded model's products: int4's kernel even at 512 rows is 0.9x
// the dense path at 1,024; int8's (two products a weight per input row) beats dequantizing
// and the dense matmul up to ~100 rows
#ifndef INT4_DENSE_FROM
#define INT4_DENSE_FROM 512
#endif
#ifndef INT8_DENSE_FROM
#define INT8_DENSE_FROM 128
#endif

#define TEXTGEN_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

TEXTGEN_AVX512_BF16 inline __m512 widen16(const uint16_t* bits) {  // 16 bfloat16 -> float
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)bits));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// vpermw's table: the bfloat16 of each index's low 4 bits (0 .. 15, twice: it reads 5 bits)
TEXTGEN_AVX512_BF16 inline __m512i nibble_table() {
  return _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
                          0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0, 0x4170,
                          0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0,
                          0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0);
}

// vpermw's table for int8's high nibbles (index 0 .. 15, read as a signed 4-bit integer):
// the bfloat16 of 0 .. 7, then -8 .. -1
TEXTGEN_AVX512_BF16 inline __m512i signed_nibble_table() {
  return _mm512_set_epi16(0xbf80, 0xc000, 0xc040, 0xc080, 0xc0a0, 0xc0c0, 0xc0e0, 0xc100,
                          0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0, 0xbf80,
                          0xc000, 0xc040, 0xc080, 0xc0a0, 0xc0c0, 0xc0e0, 0xc100, 0x40e0,
                          0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0);
}

// 16 rows' results from row n on (fewer at the end of the matrix), rounded to bfloat16
TEXTGEN_AVX512_BF16 inline void store16(uint16_t* out, __m512 sums, int64_t n, int64_t N) {
  __m256i rounded = (__m256i)_mm512_cvtneps_pbh(sums);
  if (n + 16 <= N) {
    _mm256_storeu_si256((__m256i*)out, rounded);
    return;
  }
  alignas(32) uint16_t tail[16];
  _mm256_store_si256((__m256i*)tail, rounded);
  for (int64_t i = 0; n + i < N; ++i) out[i] = tail[i];
}

// MB input rows times NV vectors (16 rows each, from vector v0) of one block. Two
// accumulators per (input row, vector) within a group, so that no chain of dependent
// vdpbf16ps is longer than 8.
template <int MB, int NV>
TEXTGEN_AVX512_BF16 void block(const uint8_t* __restrict weight, const uint16_t* __restrict scales,
                               const uint16_t* __restrict zeros, const uint16_t* __restrict x,
                               const float* __restrict x_sums, uint16_t* __restrict y, int v0,
                               int64_t n0, int64_t N, int64_t K) {
  const __m512i table = nibble_table();
  const int64_t groups = K / GROUP;
  __m512 acc[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 low[MB][NV], high[MB][NV];
    for (int m = 0; m < MB; ++m)
      for (int v = 0; v < NV; ++v) low[m][v] = high[m][v] = _mm512_setzero_ps();
    const uint8_t* bytes = weight + g * (GROUP / 4) * QUAD_BYTES;
    for (int quad = 0; quad < GROUP / 4; ++quad) {
      if (PREFETCH) _mm_prefetch((const char*)(bytes + quad * QUAD_BYTES + PREFETCH), _MM_HINT_T0);
      __m512i pair01[MB], pair23[MB];  // the inputs (k, k + 1) and (k + 2, k + 3), broadcast
      for (int m = 0; m < MB; ++m) {
        const uint16_t* xq = x + m * K + g * GROUP + quad * 4;
        uint32_t a, b;
        std::memcpy(&a, xq, 4);
        std::memcpy(&b, xq + 2, 4);
        pair01[m] = _mm512_set1_epi32(a);
        pair23[m] = _mm512_set1_epi32(b);
      }
      for (int v = 0; v < NV; ++v) {
        const uint8_t* at = bytes + quad * QUAD_BYTES + (v0 + v) * 32;
        __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)at));
        __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(words, table);
        __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
        for (int m = 0; m < MB; ++m) {
          low[m][v] = _mm512_dpbf16_ps(low[m][v], (__m512bh)pair01[m], lo);
          high[m][v] = _mm512_dpbf16_ps(high[m][v], (__m512bh)pair23[m], hi);
        }
      }
    }
    for (int v = 0; v < NV; ++v) {
      const int64_t at = g * ROWS + (v0 + v) * 16;
      __m512 s = widen16(scales + at), z = widen16(zeros + at);
      __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, z);  // z - 8 s
      for (int m = 0; m < MB; ++m) {
        acc[m][v] = _mm512_fmadd_ps(_mm512_add_ps(low[m][v], high[m][v]), s, acc[m][v]);
        acc[m][v] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x_sums[m * groups + g]), acc[m][v]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < NV; ++v) {
      const int64_t n = n0 + (v0 + v) * 16;
      if (n < N) store16(y + m * N + n, acc[m][v], n, N);
    }
}

// each group's sum of inputs (x is [M, K], groups of GROUP in a row: `count` of them)
TEXTGEN_AVX512_BF16 void group_sums(const uint16_t* x, float* sums, int64_t count) {
  for (int64_t i = 0; i < count; ++i)
    sums[i] = _mm512_reduce_add_ps(_mm512_add_ps(widen16(x + i * GROUP), widen16(x + i * GROUP + 16)));
}

// y [M, N] = x [M, K] @ W^T, W packed as above: a block's weights are one contiguous
// stretch, read once for every 4 input rows.
void int4_mm(const uint8_t* weight, const uint16_t* scales, const uint16_t* zeros,
             const uint16_t* x, uint16_t* y, float* x_sums, int64_t M, int64_t N, int64_t K,
             int threads) {
  const int64_t groups = K / GROUP, blocks = (N + ROWS - 1) / ROWS;
  group_sums(x, x_sums, M * groups);
  const int64_t block_bytes = (K / 4) * QUAD_BYTES, block_scales = groups * ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* w = weight + b * block_bytes;
    const uint16_t *s = scales + b * block_scales, *z = zeros + b * block_scales;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4)
      for (int v = 0; v < 2; ++v)
        block<4, 1>(w, s, z, x + m * K, x_sums + m * groups, y + m * N, v, b * ROWS, N, K);
    for (; m + 2 <= M; m += 2)
      block<2, 2>(w, s, z, x + m * K, x_sums + m * groups, y + m * N, 0, b * ROWS, N, K);
    for (; m < M; ++m)
      block<1, 2>(w, s, z, x + m * K, x_sums + m * groups, y + m * N, 0, b * ROWS, N, K);
  }
}

// The packed weight transposed, as a dense [K, padded N] bfloat16 matrix: each
// q * s + (z - 8 s) in float32 (one FMA), rounded to nearest even. The same table lookup as
// the products: lane i of a vector is row 16v + i, so each input's 16 rows are one store.
TEXTGEN_AVX512_BF16 void dequantize_t(const uint8_t* weight, const uint16_t* scales,
                                      const uint16_t* zeros, uint16_t* out, int64_t N,
                                      int64_t K, int threads) {
  const __m512i table = nibble_table();
  const __m512i high_half = _mm512_set1_epi32(int(0xffff0000u));
  const int64_t groups = K / GROUP, blocks = (N + ROWS - 1) / ROWS, width = blocks * ROWS;
  const int64_t block_bytes = (K / 4) * QUAD_BYTES, block_scales = groups * ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t g = 0; g < groups; ++g)
      for (int v = 0; v < 2; ++v) {
        const int64_t at = b * block_scales + g * ROWS + v * 16;
        const __m512 s = widen16(scales + at);
        const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, widen16(zeros + at));
        for (int64_t quad = g * GROUP / 4; quad < (g + 1) * GROUP / 4; ++quad) {
          const uint8_t* bytes = weight + b * block_bytes + quad * QUAD_BYTES + v * 32;
          __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)bytes));
          __m512i lo = _mm512_permutexvar_epi16(words, table);  // inputs k, k + 1
          __m512i hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);  // k + 2, 3
          const __m512i q[4] = {_mm512_slli_epi32(lo, 16), _mm512_and_si512(lo, high_half),
                                _mm512_slli_epi32(hi, 16), _mm512_and_si512(hi, high_half)};
          for (int j = 0; j < 4; ++j) {
            __m512 w = _mm512_fmadd_ps(_mm512_castsi512_ps(q[j]), s, offset);
            uint16_t* row = out + (quad * 4 + j) * width + b * ROWS + v * 16;
            _mm256_storeu_si256((__m256i*)row, (__m256i)_mm512_cvtneps_pbh(w));
          }
        }
      }
  }
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       const at::Tensor& zeros, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "textgen::int4_linear: x must be a contiguous [M, K] bfloat16 matrix");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const int64_t padded = (N + ROWS - 1) / ROWS * ROWS;
  TORCH_CHECK(K % GROUP == 0 && weight.numel() == padded * K / 2 &&
                  scales.numel() == padded * K / GROUP && zeros.numel() == scales.numel() &&
                  weight.is_contiguous() && scales.is_contiguous() && zeros.is_contiguous(),
              "textgen::int4_linear: weights not packed for [", N, ", ", K, "]");
  if (M >= INT4_DENSE_FROM) {
    at::Tensor dense_t = at::empty({K, padded}, x.options());
    dequantize_t(weight.const_data_ptr<uint8_t>(), (const uint16_t*)scales.const_data_ptr(),
                 (const uint16_t*)zeros.const_data_ptr(), (uint16_t*)dense_t.data_ptr(), N, K,
                 at::get_num_threads());
    return at::mm(x, dense_t.narrow(1, 0, N));
  }
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor x_sums = at::empty({M, K / GROUP}, x.options().dtype(at::kFloat));
  int4_mm(weight.const_data_ptr<uint8_t>(), (const uint16_t*)scales.const_data_ptr(),
          (const uint16_t*)zeros.const_data_ptr(), (const uint16_t*)x.const_data_ptr(),
          (uint16_t*)y.data_ptr(), x_sums.data_ptr<float>(), M, N, K, at::get_num_threads());
  return y;
}

// int8: MB input rows times NV vectors (16 rows each, from vector v0) of one block; the
// low and high nibbles' sums apart, combined (16 h + l) and scaled once at the end.
template <int MB, int NV>
TEXTGEN_AVX512_BF16 void block8(const uint8_t* __restrict weight, const float* __restrict scales,
                                const uint16_t* __restrict x, uint16_t* __restrict y, int v0,
                                int64_t n0, int64_t N, int64_t K) {
  const __m512i low_table = nibble_table(), high_table = signed_nibble_table();
  __m512 low[MB][NV], high[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < NV; ++v) low[m][v] = high[m][v] = _mm512_setzero_ps();
  for (int64_t pair = 0; pair < K / 2; ++pair) {
    const uint8_t* bytes = weight + pair * PAIR_BYTES;
    if (PREFETCH) _mm_prefetch((const char*)(bytes + PREFETCH), _MM_HINT_T0);
    __m512i inputs[MB];  // the inputs (k, k + 1), broadcast
    for (int m = 0; m < MB; ++m) {
      uint32_t a;
      std::memcpy(&a, x + m * K + 2 * pair, 4);
      inputs[m] = _mm512_set1_epi32(a);
    }
    for (int v = 0; v < NV; ++v) {
      __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(bytes + (v0 + v) * 32)));
      __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(words, low_table);
      __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), high_table);
      for (int m = 0; m < MB; ++m) {
        low[m][v] = _mm512_dpbf16_ps(low[m][v], (__m512bh)inputs[m], lo);
        high[m][v] = _mm512_dpbf16_ps(high[m][v], (__m512bh)inputs[m], hi);
      }
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t n = n0 + (v0 + v) * 16;
    if (n >= N) continue;
    const __m512 s = _mm512_loadu_ps(scales + (v0 + v) * 16);
    for (int m = 0; m < MB; ++m) {
      __m512 sums = _mm512_fmadd_ps(high[m][v], _mm512_set1_ps(16.f), low[m][v]);
      store16(y + m * N + n, _mm512_mul_ps(sums, s), n, N);
    }
  }
}

// y [M, N] = x [M, K] @ W^T for int8 W packed as above (blocks read once per 4 input rows)
void int8_mm(const uint8_t* weight, const float* scales, const uint16_t* x, uint16_t* y,
             int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t blocks = (N + ROWS - 1) / ROWS, block_bytes = ROWS * K;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* w = weight + b * block_bytes;
    const float* s = scales + b * ROWS;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4)
      for (int v = 0; v < 2; ++v) block8<4, 1>(w, s, x + m * K, y + m * N, v, b * ROWS, N, K);
    for (; m + 2 <= M; m += 2) block8<2, 2>(w, s, x + m * K, y + m * N, 0, b * ROWS, N, K);
    for (; m < M; ++m) block8<1, 2>(w, s, x + m * K, y + m * N, 0, b * ROWS, N, K);
  }
}

// The packed int8 weight transposed, as a dense [K, padded N] bfloat16 matrix: each q * s
// in float32, rounded to nearest even (lane i of a vector is row 16v + i).
TEXTGEN_AVX512_BF16 void dequantize8_t(const uint8_t* weight, const float* scales,
                                       uint16_t* out, int64_t N, int64_t K, int threads) {
  const int64_t blocks = (N + ROWS - 1) / ROWS, width = blocks * ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; ++b)
    for (int v = 0; v < 2; ++v) {
      const __m512 s = _mm512_loadu_ps(scales + b * ROWS + v * 16);
      for (int64_t pair = 0; pair < K / 2; ++pair) {
        const uint8_t* bytes = weight + b * ROWS * K + pair * PAIR_BYTES + v * 32;
        __m512i words = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)bytes));
        const __m512i q[2] = {_mm512_srai_epi32(_mm512_slli_epi32(words, 16), 16),
                              _mm512_srai_epi32(words, 16)};  // inputs k, k + 1
        for (int j = 0; j < 2; ++j) {
          __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(q[j]), s);
          uint16_t* row = out + (pair * 2 + j) * width + b * ROWS + v * 16;
          _mm256_storeu_si256((__m256i*)row, (__m256i)_mm512_cvtneps_pbh(w));
        }
      }
    }
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       int64_t out_features) {
  // x [..., K]: the leading dimensions are its rows (a Linear's input as it comes)
  TORCH_CHECK(x.dim() >= 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "textgen::int8_linear: x must be a contiguous [..., K] bfloat16 tensor");
  const int64_t K = x.size(-1), M = x.numel() / K, N = out_features;
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  const int64_t padded = (N + ROWS - 1) / ROWS * ROWS;
  TORCH_CHECK(K % 2 == 0 && weight.numel() == padded * K && scales.numel() == padded &&
                  scales.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  scales.is_contiguous(),
              "textgen::int8_linear: weights not packed for [", N, ", ", K, "]");
  if (M >= INT8_DENSE_FROM) {
    at::Tensor dense_t = at::empty({K, padded}, x.options());
    dequantize8_t(weight.const_data_ptr<uint8_t>(), scales.const_data_ptr<float>(),
                  (uint16_t*)dense_t.data_ptr(), N, K, at::get_num_threads());
    return at::mm(x.view({M, K}), dense_t.narrow(1, 0, N)).view(shape);
  }
  at::Tensor y = at::empty(shape, x.options());
  int8_mm(weight.const_data_ptr<uint8_t>(), scales.const_data_ptr<float>(),
          (const uint16_t*)x.const_data_ptr(), (uint16_t*)y.data_ptr(), M, N, K,
          at::get_num_threads());
  return y;
}

// RMSNorm of bfloat16 rows [M, H] as transformers' Llama-style RMSNorm computes it: the
// mean of the squares in float32, x * rsqrt(mean + eps) rounded to bfloat16, times the
// (bfloat16) weight in float32, rounded again. Only the float32 sum's order differs from
// torch's reduction. Rows are shared out among the threads.
TEXTGEN_AVX512_BF16 inline __m512 widen_masked(const uint16_t* bits, __mmask16 mask) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bits));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

TEXTGEN_AVX512_BF16 void rms_norm_rows(const uint16_t* x, const uint16_t* weight, uint16_t* y,
                                       int64_t begin, int64_t end, int64_t H, float eps) {
  for (int64_t m = begin; m < end; ++m) {
    const uint16_t* row = x + m * H;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < H; i += 16) {
      const __mmask16 lanes = H - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (H - i)) - 1);
      const __m512 v = widen_masked(row + i, lanes);
      squares = _mm512_add_ps(squares, _mm512_mul_ps(v, v));  // each square rounded, as pow's
    }
    const float mean = _mm512_reduce_add_ps(squares) / (float)H;
    const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
    for (int64_t i = 0; i < H; i += 16) {
      const __mmask16 lanes = H - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (H - i)) - 1);
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(widen_masked(row + i, lanes), r));
      const __m512 scaled = _mm512_mul_ps(_mm512_cvtpbh_ps(h), widen_masked(weight + i, lanes));
      _mm256_mask_storeu_epi16(y + m * H + i, lanes, (__m256i)_mm512_cvtneps_pbh(scaled));
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
                  weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.dim() == 1 && weight.size(0) == x.size(-1),
              "textgen::rms_norm: x must be a contiguous [..., H] bfloat16 tensor, weight [H]");
  const int64_t H = x.size(-1), M = H ? x.numel() / H : 0;
  at::Tensor y = at::empty(x.sizes(), x.options());
  const uint16_t* in = (const uint16_t*)x.const_data_ptr();
  const uint16_t* w = (const uint16_t*)weight.const_data_ptr();
  uint16_t* out = (uint16_t*)y.data_ptr();
  const float e = (float)eps;
  // a decode's one row runs here; a chunk's rows are shared out (~64 rows a task)
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    rms_norm_rows(in, w, out, begin, end, H, e);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(textgen, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("rms_norm", &rms_norm);
}
