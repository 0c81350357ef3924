// Tests kernels/cpu_isa.h: the dispatcher picks the best ISA this CPU has, refuses ones it lacks
// (and warns about a bad ZEROSHARD_CPU_ISA), and every ISA available here converts
// fp32 <-> bf16 / fp16 bit-exactly like the scalar path.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu_isa.h"
#include "kernels/warn.h"

using namespace zeroshard::kernels;

namespace {

std::vector<Isa> available_isas() {
  std::vector<Isa> out;
  for (Isa i : {Isa::scalar, Isa::avx2, Isa::avx512})
    if (cpu_isa_supported(i)) out.push_back(i);
  return out;
}

// Restores the process-wide ISA when a test section ends.
struct IsaGuard {
  Isa saved = cpu_isa();
  ~IsaGuard() { set_cpu_isa(saved); }
};

bool same_bits_or_both_nan(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  uint32_t x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y;
}
bool is_half_nan(uint16_t h, Half k) {
  return k == Half::bf16 ? ((h & 0x7f80) == 0x7f80 && (h & 0x7f)) : ((h & 0x7c00) == 0x7c00 && (h & 0x3ff));
}

}  // namespace

TEST_CASE("dispatcher picks the best ISA the CPU supports", "[isa]") {
#if defined(__x86_64__)
  const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  const Isa expected = has512 ? Isa::avx512 : has2 ? Isa::avx2 : Isa::scalar;
  CHECK(best_cpu_isa() == expected);
  CHECK(cpu_isa_supported(Isa::avx512) == has512);
  CHECK(cpu_isa_supported(Isa::avx2) == has2);
  INFO("this CPU: best ISA " << isa_name(best_cpu_isa()));
  WARN("CPU kernels here: best ISA = " << isa_name(best_cpu_isa()));
#endif
  CHECK(cpu_isa_supported(Isa::scalar));
  if (std::getenv("ZEROSHARD_CPU_ISA") == nullptr) CHECK(cpu_isa() == best_cpu_isa());
}

TEST_CASE("set_cpu_isa accepts supported ISAs and refuses the rest", "[isa]") {
  IsaGuard guard;
  for (Isa i : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (cpu_isa_supported(i)) {
      CHECK(set_cpu_isa(i) == Status::ok);
      CHECK(cpu_isa() == i);
    } else {
      const Isa before = cpu_isa();
      CHECK(set_cpu_isa(i) == Status::unsupported);
      CHECK(cpu_isa() == before);
    }
  }
  Isa parsed;
  CHECK(parse_isa("avx2", &parsed));
  CHECK(parsed == Isa::avx2);
  CHECK_FALSE(parse_isa("sse9", &parsed));
}

namespace {
std::vector<std::string> g_warnings;
void collect_warning(const char* message) { g_warnings.emplace_back(message); }

// Routes kernels/warn.h into g_warnings and owns ZEROSHARD_CPU_ISA for one test; both are put
// back afterwards, a failed REQUIRE included.
struct IsaEnvGuard {
  const char* saved = std::getenv("ZEROSHARD_CPU_ISA");
  std::string saved_value = saved ? saved : "";
  IsaEnvGuard() { set_warning_handler(&collect_warning); }
  ~IsaEnvGuard() {
    set_warning_handler(nullptr);
    if (saved) setenv("ZEROSHARD_CPU_ISA", saved_value.c_str(), 1);
    else unsetenv("ZEROSHARD_CPU_ISA");
  }
};
}  // namespace

TEST_CASE("ZEROSHARD_CPU_ISA: a bad or unsupported value warns and gives the best ISA", "[isa]") {
  IsaEnvGuard guard;
  const std::string best = isa_name(best_cpu_isa());
  // (value, ISA it gives, warning or "")
  std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {"", best, ""},
      {"scalar", "scalar", ""},
      {"sse9", best, "ZEROSHARD_CPU_ISA=sse9: expected one of scalar, avx2, avx512; using " + best}};
  for (Isa i : {Isa::avx2, Isa::avx512})
    if (!cpu_isa_supported(i))
      cases.emplace_back(isa_name(i), best, std::string("ZEROSHARD_CPU_ISA=") + isa_name(i) +
                                                ": this CPU does not support it; using " + best);
  for (const auto& [value, expected_isa, warning] : cases) {
    INFO("ZEROSHARD_CPU_ISA=" << value);
    g_warnings.clear();
    setenv("ZEROSHARD_CPU_ISA", value.c_str(), 1);
    REQUIRE(isa_name(cpu_isa_from_env()) == expected_isa);
    REQUIRE(g_warnings == (warning.empty() ? std::vector<std::string>{}
                                           : std::vector<std::string>{warning}));
  }
}

TEST_CASE("thread count can be overridden", "[isa]") {
  set_cpu_threads(3);
  CHECK(cpu_threads() == 3);
  set_cpu_threads(0);
  CHECK(cpu_threads() >= 1);
}

TEST_CASE("16-bit -> fp32 casts are exact on every ISA, all 65536 patterns", "[isa][cast]") {
  IsaGuard guard;
  std::vector<uint16_t> all(65536);
  for (int i = 0; i < 65536; ++i) all[i] = uint16_t(i);
  for (Half k : {Half::bf16, Half::fp16}) {
    for (Isa isa : available_isas()) {
      REQUIRE(set_cpu_isa(isa) == Status::ok);
      std::vector<float> out(all.size());
      REQUIRE(cast_from_half(all.data(), k, out.data(), int64_t(all.size())) == Status::ok);
      int wrong = 0;
      for (int i = 0; i < 65536; ++i)
        wrong += !same_bits_or_both_nan(out[i], half_bits_to_float(uint16_t(i), k));
      INFO(isa_name(isa) << (k == Half::bf16 ? " bf16" : " fp16"));
      CHECK(wrong == 0);
    }
  }
  // Spot values of the portable conversion itself.
  CHECK(half_bits_to_float(0x3c00, Half::fp16) == 1.0f);
  CHECK(half_bits_to_float(0x0001, Half::fp16) == std::ldexp(1.0f, -24));
  CHECK(half_bits_to_float(0x3f80, Half::bf16) == 1.0f);
}

TEST_CASE("fp32 -> 16-bit casts round to nearest even, identically on every ISA", "[isa][cast]") {
  IsaGuard guard;
  std::mt19937 rng(7);
  std::vector<float> src;
  // Random bit patterns cover every exponent (subnormals, overflow, NaN); the fixed values are
  // the tie and boundary cases.
  for (int i = 0; i < (1 << 20) + 13; ++i) {
    uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, 4);
    src.push_back(f);
  }
  for (float f : {0.0f, -0.0f, 1.0f, 65504.0f, 65519.99f, 65520.0f, 1e-8f, 5.9604645e-8f,
                  2.9802322e-8f, 6.1035156e-5f, 1.00048828125f, 1.00146484375f, INFINITY, -INFINITY,
                  1.0039062f, 1.01171875f, 3.4028235e38f})
    src.push_back(f);
  for (Half k : {Half::bf16, Half::fp16}) {
    std::vector<uint16_t> ref(src.size());
    for (size_t i = 0; i < src.size(); ++i) ref[i] = float_to_half_bits(src[i], k);
    for (Isa isa : available_isas()) {
      REQUIRE(set_cpu_isa(isa) == Status::ok);
      std::vector<uint16_t> out(src.size());
      REQUIRE(cast_to_half(src.data(), out.data(), k, int64_t(src.size())) == Status::ok);
      int wrong = 0;
      for (size_t i = 0; i < src.size(); ++i) {
        const bool ok = is_half_nan(ref[i], k) ? is_half_nan(out[i], k) : out[i] == ref[i];
        wrong += !ok;
      }
      INFO(isa_name(isa) << (k == Half::bf16 ? " bf16" : " fp16"));
      CHECK(wrong == 0);
    }
  }
  // Ties: 1 + 2^-8 is halfway between two bf16 values and rounds to the even one (1.0).
  CHECK(float_to_half_bits(1.00390625f, Half::bf16) == 0x3f80);
  CHECK(float_to_half_bits(1.01171875f, Half::bf16) == 0x3f82);
  CHECK(float_to_half_bits(1.00048828125f, Half::fp16) == 0x3c00);
  CHECK(float_to_half_bits(65520.0f, Half::fp16) == 0x7c00);
  CHECK(float_to_half_bits(NAN, Half::bf16) == 0x7fc0);
}
