// AVX2 + FMA + F16C instantiation of the optimizer loops (simd_body.inl), 8 floats per vector.
// Compiled with -mavx2 -mfma -mf16c for this file only; the dispatcher calls it only on CPUs
// that report all three.
#include "kernels/cpu/kernel_table.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

namespace zeroshard::kernels::detail {
namespace {

struct V {
  using F = __m256;
  static constexpr int W = 8;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  // Non-temporal store: p 32-byte aligned; the line is written without being read first.
  static void stream(float* p, F x) { _mm256_stream_ps(p, x); }
  static void fence() { _mm_sfence(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F sign(F x) {
    const F one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    return _mm256_sub_ps(_mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_GT_OQ), one),
                         _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_LT_OQ), one));
  }
  static F load_bf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static void store_bf16(uint16_t* p, F x) {
    // Round to nearest even on the integer bits; NaN becomes 0x7fc0 as in torch.
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    // packus works per 128-bit lane; the permute gathers lanes 0 and 2 into the low half.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static F load_fp16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_fp16(uint16_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  struct Acc { __m256d lo, hi; };
  static Acc acc_zero() { return {_mm256_setzero_pd(), _mm256_setzero_pd()}; }
  static void acc_sq(Acc& a, F x) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    a.lo = _mm256_fmadd_pd(lo, lo, a.lo);
    a.hi = _mm256_fmadd_pd(hi, hi, a.hi);
  }
  static double acc_sum(const Acc& a) {
    alignas(32) double t[4];
    _mm256_store_pd(t, _mm256_add_pd(a.lo, a.hi));
    return (t[0] + t[1]) + (t[2] + t[3]);
  }
};

}  // namespace

#include "kernels/cpu/simd_body.inl"

const KernelTable* avx2_table() { return &kTable; }

}  // namespace zeroshard::kernels::detail

#else

namespace zeroshard::kernels::detail {
const KernelTable* avx2_table() { return nullptr; }
}  // namespace zeroshard::kernels::detail

#endif
