// kernels/ops.cpp's ATen paths: scale_copy between dtypes rounds once, in the wider dtype.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include "kernels/ops.h"

// c10's logging header defines its own CHECK (a fatal log, not a Catch2 assertion): REQUIRE here.

namespace {
// src * scale computed in fp32 and rounded once into `dtype`.
at::Tensor once(const at::Tensor& src, double scale, at::ScalarType dtype) {
  return (src.to(at::kFloat) * scale).to(dtype);
}
}  // namespace

TEST_CASE("scale_copy between dtypes computes in the wider one and rounds once") {
  at::manual_seed(0);
  // Small values and a factor that is not a power of two: rounding the product in 16 bits
  // (as at::mul_out with a 16-bit source does) differs from rounding it once in fp32.
  const at::Tensor base = at::randn({4096}) * 1e-3;
  for (const double scale : {1.0 / 3.0, 0.5, 1.0}) {
    for (const auto narrow : {at::kBFloat16, at::kHalf}) {
      const at::Tensor src16 = base.to(narrow);
      at::Tensor wide = at::empty({4096}, at::kFloat);
      zeroshard::ops::scale_copy(wide, src16, scale);
      REQUIRE(at::equal(wide, once(src16, scale, at::kFloat)));

      at::Tensor narrow_dst = at::empty({4096}, narrow);
      zeroshard::ops::scale_copy(narrow_dst, base, scale);
      REQUIRE(at::equal(narrow_dst, once(base, scale, narrow)));
    }
  }
}
