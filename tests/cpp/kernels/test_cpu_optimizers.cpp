// Tests kernels/cpu_optimizers.h: every SIMD path available on this CPU against the scalar
// reference, for sizes 1 .. 1M that are and are not multiples of the vector width, with fp32,
// bf16 and fp16 gradients and 16-bit parameter copies; plus the fused offload step and stats.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu_isa.h"

using namespace zeroshard::kernels;

namespace {

const std::vector<int64_t> kSizes = {1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 127, 1000,
                                     4097, 65537, 1 << 20};

struct IsaGuard {
  Isa saved = cpu_isa();
  ~IsaGuard() { set_cpu_isa(saved); set_cpu_threads(0); }
};

std::vector<Isa> simd_isas() {
  std::vector<Isa> out;
  for (Isa i : {Isa::avx2, Isa::avx512})
    if (cpu_isa_supported(i)) out.push_back(i);
  return out;
}

// The scalar reference first, then every SIMD path this CPU has.
std::vector<Isa> all_isas() {
  std::vector<Isa> out = simd_isas();
  out.insert(out.begin(), Isa::scalar);
  return out;
}

// The state of one optimizer run: fp32 arrays (param + state), gradient and 16-bit copy.
struct State {
  std::vector<float> param, s1, s2, grad;
  std::vector<uint16_t> grad16, out16;
};

State make_state(int64_t n, uint32_t seed, bool lion_safe) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  State s;
  s.param.resize(n); s.s1.resize(n); s.s2.resize(n); s.grad.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    s.param[i] = nd(rng);
    s.grad[i] = nd(rng);
    s.s1[i] = 0.1f * nd(rng);
    s.s2[i] = std::fabs(0.01f * nd(rng));
    if (lion_safe) {
      // Lion's sign(beta1*m + (1-beta1)*g) must not sit at 0, where an FMA can flip it: give m
      // and g one sign and magnitudes away from 0.
      const float sign = s.grad[i] < 0 ? -1.0f : 1.0f;
      s.grad[i] = sign * (0.5f + std::fabs(s.grad[i]));
      s.s1[i] = sign * (0.1f + std::fabs(s.s1[i]));
    }
  }
  return s;
}

struct Case {
  std::string name;
  bool lion_safe;
  Half grad_kind;   // Adam only: none = fp32 gradients
  // Runs one step on s with step index t, writing s.out16 when out != none.
  std::function<Status(State&, int64_t t, Half out)> step;
};

HalfOut out_of(State& s, Half k) {
  if (k == Half::none) return {};
  s.out16.resize(s.param.size());
  return {s.out16.data(), k};
}

std::vector<Case> cases() {
  std::vector<Case> cs;
  for (Half gk : {Half::none, Half::bf16, Half::fp16}) {
    for (bool adamw : {true, false}) {
      std::string name = std::string(adamw ? "adamw" : "adam") +
                         (gk == Half::none ? "" : gk == Half::bf16 ? " bf16-grad" : " fp16-grad");
      cs.push_back({name, false, gk, [gk, adamw](State& s, int64_t t, Half out) {
        AdamParams p;
        p.lr = 1e-2f; p.weight_decay = 0.05f; p.adamw_mode = adamw; p.step = t;
        const int64_t n = int64_t(s.param.size());
        if (gk == Half::none)
          return adam_step(s.param.data(), s.grad.data(), s.s1.data(), s.s2.data(), n, p, out_of(s, out));
        p.grad_scale = 0.25f;   // unscale + clip folded into one factor
        return adam_step(s.param.data(), s.grad16.data(), gk, s.s1.data(), s.s2.data(), n, p,
                         out_of(s, out));
      }});
    }
  }
  cs.push_back({"adam no bias correction", false, Half::none, [](State& s, int64_t t, Half out) {
    AdamParams p;
    p.bias_correction = false; p.step = t;
    return adam_step(s.param.data(), s.grad.data(), s.s1.data(), s.s2.data(), int64_t(s.param.size()), p, out_of(s, out));
  }});
  for (bool nesterov : {false, true}) {
    cs.push_back({nesterov ? "sgd nesterov" : "sgd momentum", false, Half::none,
                  [nesterov](State& s, int64_t t, Half out) {
      SgdParams p;
      p.lr = 0.05f; p.momentum = 0.9f; p.weight_decay = 0.01f; p.nesterov = nesterov;
      p.dampening = nesterov ? 0.0f : 0.1f; p.first_step = t == 1;
      return sgd_step(s.param.data(), s.grad.data(), s.s1.data(), int64_t(s.param.size()), p, out_of(s, out));
    }});
  }
  cs.push_back({"sgd plain", false, Half::none, [](State& s, int64_t, Half out) {
    SgdParams p;
    p.lr = 0.05f;
    return sgd_step(s.param.data(), s.grad.data(), nullptr, int64_t(s.param.size()), p, out_of(s, out));
  }});
  cs.push_back({"adagrad", false, Half::none, [](State& s, int64_t t, Half out) {
    AdagradParams p;
    p.lr = 0.1f; p.lr_decay = 0.01f; p.weight_decay = 0.02f; p.step = t;
    return adagrad_step(s.param.data(), s.grad.data(), s.s2.data(), int64_t(s.param.size()), p, out_of(s, out));
  }});
  cs.push_back({"lion", true, Half::none, [](State& s, int64_t, Half out) {
    LionParams p;
    p.lr = 1e-3f; p.weight_decay = 0.1f;
    return lion_step(s.param.data(), s.grad.data(), s.s1.data(), int64_t(s.param.size()), p, out_of(s, out));
  }});
  return cs;
}

// Runs 3 steps of c on a fresh state under isa; 16-bit gradients are rounded from the fp32 ones.
State run(const Case& c, Isa isa, int64_t n, Half out) {
  REQUIRE(set_cpu_isa(isa) == Status::ok);
  State s = make_state(n, uint32_t(n * 31 + 5), c.lion_safe);
  if (c.grad_kind != Half::none) {
    s.grad16.resize(n);
    REQUIRE(cast_to_half(s.grad.data(), s.grad16.data(), c.grad_kind, n) == Status::ok);
  }
  for (int64_t t = 1; t <= 3; ++t) REQUIRE(c.step(s, t, out) == Status::ok);
  return s;
}

// Mixed absolute/relative closeness: FMA contraction and vector order change the last bits.
int64_t count_far(const std::vector<float>& a, const std::vector<float>& b, float tol) {
  int64_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (!(std::fabs(a[i] - b[i]) <= tol * (1.0f + std::fabs(b[i])))) ++bad;
  return bad;
}

// 16-bit copies: at most one unit in the last place apart (the fp32 values, a few fp32 ulps
// apart, may straddle a rounding tie), measured on the values so that a crossing of zero counts
// as close.
int64_t count_far16(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, Half k) {
  const float ulp = k == Half::bf16 ? 1.0f / 128 : 1.0f / 1024;
  int64_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const float x = half_bits_to_float(a[i], k), y = half_bits_to_float(b[i], k);
    bad += !(std::fabs(x - y) <= 1e-6f + ulp * std::fabs(y));
  }
  return bad;
}

// n floats starting on a 64-byte boundary (std::vector's alignment is not controlled).
struct AlignedFloats {
  explicit AlignedFloats(int64_t n)
      : data(static_cast<float*>(std::aligned_alloc(64, size_t((n * 4 + 63) / 64 * 64)))) {
    REQUIRE(data != nullptr);
  }
  ~AlignedFloats() { std::free(data); }
  AlignedFloats(const AlignedFloats&) = delete;
  AlignedFloats& operator=(const AlignedFloats&) = delete;
  float* data;
};

}  // namespace

TEST_CASE("every SIMD path matches the scalar reference", "[optimizers]") {
  IsaGuard guard;
  if (simd_isas().empty()) WARN("no SIMD ISA on this CPU; only the scalar path is exercised");
  for (const Case& c : cases()) {
    for (Half out : {Half::none, Half::bf16, Half::fp16}) {
      for (int64_t n : kSizes) {
        const State ref = run(c, Isa::scalar, n, out);
        for (Isa isa : simd_isas()) {
          const State got = run(c, isa, n, out);
          INFO(c.name << " isa=" << isa_name(isa) << " n=" << n << " out16=" << int(out));
          CHECK(count_far(got.param, ref.param, 2e-6f) == 0);
          CHECK(count_far(got.s1, ref.s1, 2e-6f) == 0);
          CHECK(count_far(got.s2, ref.s2, 2e-6f) == 0);
          if (out != Half::none) {
            CHECK(count_far16(got.out16, ref.out16, out) == 0);
            // The copy is exactly this path's own fp32 result rounded to nearest even.
            int64_t inexact = 0;
            for (int64_t i = 0; i < n; ++i)
              inexact += got.out16[i] != float_to_half_bits(got.param[i], out);
            CHECK(inexact == 0);
          }
        }
      }
    }
  }
}

TEST_CASE("the thread split does not change the result", "[optimizers]") {
  IsaGuard guard;
  const Case c = cases()[0];
  const int64_t n = (1 << 20) + 77;
  set_cpu_threads(1);
  const State one = run(c, best_cpu_isa(), n, Half::bf16);
  set_cpu_threads(3);
  const State three = run(c, best_cpu_isa(), n, Half::bf16);
  CHECK(one.param == three.param);
  CHECK(one.s2 == three.s2);
  CHECK(one.out16 == three.out16);
}

TEST_CASE("fused offload step equals widen + scale + Adam + cast", "[optimizers][fused]") {
  IsaGuard guard;
  const int64_t n = 100003;
  for (Half gk : {Half::bf16, Half::fp16}) {
    State fused = make_state(n, 11, false), seq = fused;
    fused.grad16.resize(n);
    REQUIRE(cast_to_half(fused.grad.data(), fused.grad16.data(), gk, n) == Status::ok);
    // The separate-pass sequence DeepSpeed runs: widen, unscale/clip, Adam, cast back.
    std::vector<float> g32(n);
    REQUIRE(cast_from_half(fused.grad16.data(), gk, g32.data(), n) == Status::ok);
    const float scale = 1.0f / 1024.0f * 0.5f;
    for (float& g : g32) g *= scale;
    AdamParams p;
    p.weight_decay = 0.01f;
    REQUIRE(adam_step(seq.param.data(), g32.data(), seq.s1.data(), seq.s2.data(), n, p) == Status::ok);
    std::vector<uint16_t> seq16(n);
    REQUIRE(cast_to_half(seq.param.data(), seq16.data(), gk, n) == Status::ok);
    p.grad_scale = scale;
    fused.out16.resize(n);
    REQUIRE(adam_step(fused.param.data(), fused.grad16.data(), gk, fused.s1.data(), fused.s2.data(),
                      n, p, {fused.out16.data(), gk}) == Status::ok);
    CHECK(count_far(fused.param, seq.param, 1e-6f) == 0);
    CHECK(count_far(fused.s2, seq.s2, 1e-6f) == 0);
    CHECK(count_far16(fused.out16, seq16, gk) == 0);
  }
}

TEST_CASE("grad_stats: sum of squares and inf/nan detection on every ISA", "[optimizers][stats]") {
  IsaGuard guard;
  const std::vector<Isa> isas = all_isas();
  for (int64_t n : kSizes) {
    State s = make_state(n, 3, false);
    std::vector<uint16_t> b16(n), f16(n);
    cast_to_half(s.grad.data(), b16.data(), Half::bf16, n);
    cast_to_half(s.grad.data(), f16.data(), Half::fp16, n);
    double ref32 = 0, refb = 0, reff = 0;
    for (int64_t i = 0; i < n; ++i) {
      ref32 += double(s.grad[i]) * s.grad[i];
      const double b = half_bits_to_float(b16[i], Half::bf16), f = half_bits_to_float(f16[i], Half::fp16);
      refb += b * b;
      reff += f * f;
    }
    for (Isa isa : isas) {
      REQUIRE(set_cpu_isa(isa) == Status::ok);
      INFO("isa=" << isa_name(isa) << " n=" << n);
      GradStats st;
      REQUIRE(grad_stats(s.grad.data(), n, &st) == Status::ok);
      CHECK(st.sum_sq == Approx(ref32).epsilon(1e-12));
      CHECK(st.finite);
      REQUIRE(grad_stats(b16.data(), Half::bf16, n, &st) == Status::ok);
      CHECK(st.sum_sq == Approx(refb).epsilon(1e-12));
      REQUIRE(grad_stats(f16.data(), Half::fp16, n, &st) == Status::ok);
      CHECK(st.sum_sq == Approx(reff).epsilon(1e-12));
      // One bad element anywhere, including the tail, is reported.
      for (uint16_t bad : {uint16_t(0x7c00), uint16_t(0x7e00)}) {
        std::vector<uint16_t> g = f16;
        g[n - 1] = bad;
        REQUIRE(grad_stats(g.data(), Half::fp16, n, &st) == Status::ok);
        CHECK_FALSE(st.finite);
      }
      std::vector<float> g = s.grad;
      g[n / 2] = NAN;
      REQUIRE(grad_stats(g.data(), n, &st) == Status::ok);
      CHECK_FALSE(st.finite);
    }
  }
}

TEST_CASE("Adam's in-pass gradient statistics equal grad_stats and leave the update unchanged",
          "[optimizers][stats]") {
  IsaGuard guard;
  for (int threads : {1, 3}) {
    set_cpu_threads(threads);
    for (int64_t n : kSizes) {
      for (Half gk : {Half::none, Half::bf16, Half::fp16}) {
        for (Isa isa : all_isas()) {
          REQUIRE(set_cpu_isa(isa) == Status::ok);
          INFO("isa=" << isa_name(isa) << " n=" << n << " grad=" << int(gk) << " threads=" << threads);
          State plain = make_state(n, uint32_t(n + 9), false);
          plain.grad16.resize(n);
          cast_to_half(plain.grad.data(), plain.grad16.data(), gk == Half::none ? Half::bf16 : gk, n);
          State fused = plain;
          AdamParams p;
          p.weight_decay = 0.01f;
          p.grad_scale = 0.5f;   // the statistics are of the gradient as read, before the scale
          // One Adam step on s with gradients g (fp32 or gk, as the case runs), stats optional.
          const auto step = [&](State& s, const std::vector<float>& g32,
                                const std::vector<uint16_t>& g16, GradStats* stats) {
            if (gk == Half::none)
              return adam_step(s.param.data(), g32.data(), s.s1.data(), s.s2.data(), n, p, {}, stats);
            return adam_step(s.param.data(), g16.data(), gk, s.s1.data(), s.s2.data(), n, p, {}, stats);
          };
          GradStats expect, got{-1.0, false};
          REQUIRE((gk == Half::none ? grad_stats(plain.grad.data(), n, &expect)
                                    : grad_stats(plain.grad16.data(), gk, n, &expect)) == Status::ok);
          REQUIRE(step(plain, plain.grad, plain.grad16, nullptr) == Status::ok);
          REQUIRE(step(fused, fused.grad, fused.grad16, &got) == Status::ok);
          CHECK(got.sum_sq == Approx(expect.sum_sq).epsilon(1e-12));
          CHECK(got.finite);
          CHECK(fused.param == plain.param);
          CHECK(fused.s1 == plain.s1);
          CHECK(fused.s2 == plain.s2);
          // An inf or nan anywhere, the zero-padded tail included, is reported, in the gradient's
          // own format.
          std::vector<float> bad32 = plain.grad;
          std::vector<uint16_t> bad16 = plain.grad16;
          bad32[size_t(n - 1)] = NAN;
          bad16[size_t(n - 1)] = gk == Half::fp16 ? uint16_t(0x7c00) : uint16_t(0x7f80);  // +inf
          got.finite = true;
          REQUIRE(step(fused, bad32, bad16, &got) == Status::ok);
          CHECK_FALSE(got.finite);
        }
      }
    }
  }
}

TEST_CASE("scale_copy equals src * scale exactly on every ISA, streamed or not, at any alignment",
          "[scale_copy]") {
  IsaGuard guard;
  const std::vector<Isa> isas = all_isas();
  std::vector<int64_t> sizes = kSizes;
  sizes.push_back((1 << 20) + 3);   // above the streaming threshold (1 MiB), odd length
  for (int threads : {1, 3}) {
    set_cpu_threads(threads);
    for (int64_t n : sizes) {
      State s = make_state(n, uint32_t(n), false);
      s.grad[size_t(n / 2)] = NAN;
      s.grad[0] = -INFINITY;
      for (float scale : {1.0f, 0.5f, 1.0f / 3.0f}) {
        std::vector<float> expect(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) expect[size_t(i)] = s.grad[size_t(i)] * scale;
        for (Isa isa : isas) {
          REQUIRE(set_cpu_isa(isa) == Status::ok);
          // Destinations 0, 1, 5 and 15 floats past a 64-byte line, so the streamed part starts
          // after a head of 0, 15, 11 and 1 elements.
          for (int64_t shift : {0, 1, 5, 15}) {
            if (shift != 0 && shift != 5 && n > 70000) continue;  // two shifts of the big size
            AlignedFloats buffer(n + 16);
            float* out = buffer.data;
            std::fill(out, out + n + 16, 7.0f);
            INFO("isa=" << isa_name(isa) << " n=" << n << " scale=" << scale << " shift=" << shift
                        << " threads=" << threads);
            REQUIRE(scale_copy(s.grad.data(), out + shift, n, scale) == Status::ok);
            int64_t wrong = 0;
            for (int64_t i = 0; i < n; ++i) {
              const float got = out[size_t(i + shift)], want = expect[size_t(i)];
              wrong += !(got == want || (std::isnan(got) && std::isnan(want)));
            }
            CHECK(wrong == 0);
            // Nothing outside [shift, shift + n) is written.
            for (int64_t i = 0; i < shift; ++i) CHECK(out[size_t(i)] == 7.0f);
            for (int64_t i = n + shift; i < n + 16; ++i) CHECK(out[size_t(i)] == 7.0f);
          }
        }
      }
    }
  }
  std::vector<float> a(64, 1.0f);
  CHECK(scale_copy(a.data(), a.data() + 8, 32, 2.0f) == Status::invalid_argument);  // overlap
  CHECK(scale_copy(a.data(), a.data(), 32, 2.0f) == Status::ok);                      // in place
  CHECK(a[0] == 2.0f);
  CHECK(scale_copy(nullptr, a.data(), 1, 1.0f) == Status::invalid_argument);
}

TEST_CASE("invalid arguments are refused, not crashed on", "[optimizers]") {
  float x = 0;
  AdamParams p;
  CHECK(adam_step(nullptr, &x, &x, &x, 1, p) == Status::invalid_argument);
  CHECK(adam_step(&x, &x, &x, &x, -1, p) == Status::invalid_argument);
  CHECK(adam_step(&x, &x, &x, &x, 0, p) == Status::ok);
  p.step = 0;
  CHECK(adam_step(&x, &x, &x, &x, 1, p) == Status::invalid_argument);
  p.step = 1;
  uint16_t h = 0;
  CHECK(adam_step(&x, &h, Half::none, &x, &x, 1, p) == Status::invalid_argument);
  CHECK(adam_step(&x, &x, &x, &x, 1, p, {&h, Half::none}) == Status::invalid_argument);
  SgdParams sp;
  sp.momentum = 0.9f;
  CHECK(sgd_step(&x, &x, nullptr, 1, sp) == Status::invalid_argument);
  GradStats st;
  CHECK(grad_stats(&h, Half::none, 1, &st) == Status::invalid_argument);
}
