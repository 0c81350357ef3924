// kernels/ops.cpp's ATen paths: scale_copy between dtypes rounds once, in the wider dtype;
// scale_ and add_scaled_ apply a double factor unrounded to 16-bit tensors.
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

TEST_CASE("scale_ and add_scaled_ keep a factor that 16 bits cannot hold exact") {
  at::manual_seed(1);
  const int64_t n = (int64_t(1) << 20) + 4099;  // more than one slice of add_scaled_
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    const at::Tensor x = at::randn({n}).to(dtype);
    const at::Tensor y = at::randn({n}).to(dtype);
    for (double scale : {1.0 / 3.0, 1.5, 0.25, 1.0 / 48.0}) {
      at::Tensor t = x.clone();
      zeroshard::ops::scale_(t, scale);
      REQUIRE(at::equal(t, (x.to(at::kFloat) * scale).to(dtype)));
      at::Tensor d = y.clone();
      zeroshard::ops::add_scaled_(d, x, scale);
      const at::Tensor expect = (x.to(at::kFloat) * scale + y.to(at::kFloat)).to(dtype);
      REQUIRE(at::equal(d, expect));
      // Into fp32 from a 16-bit source (stage 2's fp32 gradient shard): ATen's own add_, whose
      // fused multiply-add may round once where this reference rounds twice; an alpha rounded
      // to 16 bits would be off by up to 0.4%.
      at::Tensor f = y.to(at::kFloat);
      zeroshard::ops::add_scaled_(f, x, scale);
      REQUIRE(at::allclose(f, x.to(at::kFloat) * scale + y.to(at::kFloat), 1e-6, 1e-6));
    }
    // An fp32 source into a 16-bit destination (an fp32 communication dtype's sum into bf16
    // gradients) is left as it was.
    const at::Tensor wide = x.to(at::kFloat);
    const at::Tensor wide_before = wide.clone();
    at::Tensor narrow = y.clone();
    zeroshard::ops::add_scaled_(narrow, wide, 1.0 / 3.0);
    REQUIRE(at::equal(wide, wide_before));
    REQUIRE(at::equal(narrow, (wide * (1.0 / 3.0) + y.to(at::kFloat)).to(dtype)));
    // What the helpers avoid: ATen's in-place mul_ rounds 1/3 to the tensor's dtype first.
    at::Tensor biased = x.clone();
    biased.mul_(1.0 / 3.0);
    REQUIRE_FALSE(at::equal(biased, (x.to(at::kFloat) * (1.0 / 3.0)).to(dtype)));
  }
}
