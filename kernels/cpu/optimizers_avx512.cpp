// AVX-512 (F + BW) instantiation of the optimizer loops (simd_body.inl), 16 floats per vector.
// Compiled with -mavx512f -mavx512bw for this file only; the dispatcher calls it only on CPUs
// (and kernels) that enable AVX-512 state.
#include "kernels/cpu/kernel_table.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace zeroshard::kernels::detail {
namespace {

struct V {
  using F = __m512;
  static constexpr int W = 16;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  // Non-temporal store: p 64-byte aligned; the line is written without being read first.
  static void stream(float* p, F x) { _mm512_stream_ps(p, x); }
  static void fence() { _mm_sfence(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F sign(F x) {
    const F one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    const __mmask16 gt = _mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ);
    const __mmask16 lt = _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ);
    return _mm512_sub_ps(_mm512_maskz_mov_ps(gt, one), _mm512_maskz_mov_ps(lt, one));
  }
  static F load_bf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static void store_bf16(uint16_t* p, F x) {
    // Round to nearest even on the integer bits; NaN becomes 0x7fc0 as in torch.
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static F load_fp16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_fp16(uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  struct Acc { __m512d lo, hi; };
  static Acc acc_zero() { return {_mm512_setzero_pd(), _mm512_setzero_pd()}; }
  static void acc_sq(Acc& a, F x) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    a.lo = _mm512_fmadd_pd(lo, lo, a.lo);
    a.hi = _mm512_fmadd_pd(hi, hi, a.hi);
  }
  static double acc_sum(const Acc& a) { return _mm512_reduce_add_pd(_mm512_add_pd(a.lo, a.hi)); }
};

}  // namespace

#include "kernels/cpu/simd_body.inl"

const KernelTable* avx512_table() { return &kTable; }

}  // namespace zeroshard::kernels::detail

#else

namespace zeroshard::kernels::detail {
const KernelTable* avx512_table() { return nullptr; }
}  // namespace zeroshard::kernels::detail

#endif
