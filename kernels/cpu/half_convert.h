// Portable fp32 <-> bf16 / fp16 conversions (round to nearest even), bit-exact with torch's and
// with the F16C / AVX-512 conversion instructions for finite values. Static so that a copy
// compiled with -mavx512f in one translation unit never replaces the portable one elsewhere.
#pragma once
#include <cstdint>
#include <cstring>

#include "kernels/cpu_optimizers.h"

namespace zeroshard::kernels::detail {

static inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
static inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline float bf16_to_f32(uint16_t h) { return bits_float(uint32_t(h) << 16); }

static inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;   // NaN -> canonical quiet NaN, as torch
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float fp16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));   // inf / NaN
  if (exp == 0) {                                                             // zero / subnormal
    const float f = float(mant) * 5.9604644775390625e-8f;                    // mant * 2^-24
    return sign ? -f : f;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

static inline uint16_t f32_to_fp16(float f) {
  uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((u >> 13) & 0x3ffu));   // NaN, quieted
  if (u >= 0x477ff000u) return uint16_t(sign | 0x7c00u);   // >= 65520 rounds to inf
  if (u < 0x38800000u) {
    // Below fp16's smallest normal: adding 0.5f lines the fp16 subnormal unit (2^-24) up with
    // the last mantissa bit, so the FPU's own round-to-nearest-even does the rounding.
    const float a = bits_float(u) + 0.5f;
    return uint16_t(sign | (float_bits(a) - 0x3f000000u));
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even.
  u += 0xc8000fffu + ((u >> 13) & 1u);
  return uint16_t(sign | (u >> 13));
}

static inline float half_to_f32(uint16_t h, Half kind) {
  return kind == Half::bf16 ? bf16_to_f32(h) : fp16_to_f32(h);
}
static inline uint16_t f32_to_half(float f, Half kind) {
  return kind == Half::bf16 ? f32_to_bf16(f) : f32_to_fp16(f);
}

}  // namespace zeroshard::kernels::detail
