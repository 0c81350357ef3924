// Public entry points of cpu_optimizers.h / cpu_isa.h: check arguments, derive the per-step
// constants once, pick the ISA table, and split the arrays across OpenMP threads.
#ifdef _OPENMP
#include <omp.h>
#else
// Built without OpenMP: every kernel call runs on the calling thread.
static int omp_get_thread_num() { return 0; }
static int omp_get_num_threads() { return 1; }
static int omp_get_max_threads() { return 1; }
#endif

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/half_convert.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu_isa.h"
#include "kernels/warn.h"

namespace zeroshard::kernels {

// ---------------------------------------------------------------- ISA and thread selection

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
  }
  return "unknown";
}

bool parse_isa(const char* name, Isa* out) {
  for (Isa i : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (name != nullptr && std::strcmp(name, isa_name(i)) == 0) {
      *out = i;
      return true;
    }
  }
  return false;
}

bool cpu_isa_supported(Isa isa) {
#if defined(__x86_64__) && defined(__GNUC__)
  // libgcc's checks include the OS (XCR0) enabling the AVX / AVX-512 register state.
  switch (isa) {
    case Isa::scalar: return true;
    case Isa::avx2:
      return detail::avx2_table() != nullptr && __builtin_cpu_supports("avx2") &&
             __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Isa::avx512:
      return detail::avx512_table() != nullptr && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw");
  }
  return false;
#else
  return isa == Isa::scalar;
#endif
}

Isa best_cpu_isa() {
  static const Isa best = cpu_isa_supported(Isa::avx512) ? Isa::avx512
                          : cpu_isa_supported(Isa::avx2) ? Isa::avx2
                                                         : Isa::scalar;
  return best;
}

Isa cpu_isa_from_env() {
  const char* env = std::getenv("ZEROSHARD_CPU_ISA");
  if (env == nullptr || *env == '\0') return best_cpu_isa();
  Isa isa;
  const std::string asked = std::string("ZEROSHARD_CPU_ISA=") + env;
  const std::string best = isa_name(best_cpu_isa());
  if (!parse_isa(env, &isa)) {
    warn((asked + ": expected one of scalar, avx2, avx512; using " + best).c_str());
    return best_cpu_isa();
  }
  if (!cpu_isa_supported(isa)) {
    warn((asked + ": this CPU does not support it; using " + best).c_str());
    return best_cpu_isa();
  }
  return isa;
}

namespace {

std::atomic<int>& isa_slot() {
  static std::atomic<int> slot{int(cpu_isa_from_env())};
  return slot;
}

int threads_from_env() {
  if (const char* env = std::getenv("ZEROSHARD_CPU_THREADS")) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && n > 0 && n <= 4096) return int(n);
    warn((std::string("ZEROSHARD_CPU_THREADS=") + env + ": expected a positive integer; ignored").c_str());
  }
  return 0;
}

std::atomic<int> g_threads_override{0};

const detail::KernelTable& table() {
  switch (Isa(isa_slot().load(std::memory_order_relaxed))) {
    case Isa::avx512: return *detail::avx512_table();
    case Isa::avx2: return *detail::avx2_table();
    default: return detail::scalar_table();
  }
}

// Chunks start on 64-element boundaries (a cache line of fp32 and of 16-bit data alike); below
// this many elements per thread the fork/join costs more than it saves.
constexpr int64_t kAlign = 64;
constexpr int64_t kMinPerThread = 1 << 15;
// scale_copy uses non-temporal stores from this size on (larger than a core's L2 cache).
constexpr int64_t kStreamMinBytes = int64_t(1) << 20;

// Calls fn(thread_index, begin, count) on disjoint chunks covering [0, n); returns the number
// of chunks used (<= max_threads, which defaults to cpu_threads()).
template <class Fn>
int parallel_chunks(int64_t n, Fn&& fn, int max_threads = 0) {
  int threads = max_threads > 0 ? max_threads : cpu_threads();
  const int64_t by_size = (n + kMinPerThread - 1) / kMinPerThread;
  if (by_size < threads) threads = int(by_size < 1 ? 1 : by_size);
  if (threads <= 1) {
    fn(0, int64_t{0}, n);
    return 1;
  }
  int used = threads;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    if (t == 0) used = nt;
    const int64_t per = ((n + nt - 1) / nt + kAlign - 1) / kAlign * kAlign;
    const int64_t begin = per * t < n ? per * t : n;
    const int64_t end = begin + per < n ? begin + per : n;
    if (end > begin) fn(t, begin, end - begin);
  }
  return used;
}

// Runs fn(begin, count) -> double on parallel_chunks' chunks and adds the results in chunk order,
// so a fixed thread count gives a fixed sum. grad_stats and Adam's in-pass statistics share it,
// so both give the same sum for the same gradient. The thread count is read once: the split may
// not use more threads than there are slots.
template <class Fn>
double chunk_sum(int64_t n, Fn&& fn) {
  const int threads = cpu_threads();
  std::vector<double> partial(size_t(threads), 0.0);
  parallel_chunks(n, [&](int t, int64_t b, int64_t k) { partial[size_t(t)] = fn(b, k); }, threads);
  double s = 0.0;
  for (double x : partial) s += x;
  return s;
}

GradStats stats_of(double sum_sq) { return {sum_sq, std::isfinite(sum_sq)}; }

bool bad(const void* a, int64_t n) { return n < 0 || (n > 0 && a == nullptr); }
bool bad_out(HalfOut o, int64_t n) {
  return o.data != nullptr && (n < 0 || (o.kind != Half::bf16 && o.kind != Half::fp16));
}
HalfOut at(HalfOut o, int64_t off) { return o.data ? HalfOut{o.data + off, o.kind} : o; }
detail::GradRef at(detail::GradRef g, int64_t off) {
  const int64_t bytes = g.kind == Half::none ? 4 : 2;
  return {static_cast<const unsigned char*>(g.data) + off * bytes, g.kind};
}

Status adam_any(float* param, detail::GradRef grad, float* m, float* v, int64_t n,
                const AdamParams& p, HalfOut o, GradStats* stats) {
  if (bad(param, n) || bad(grad.data, n) || bad(m, n) || bad(v, n) || bad_out(o, n) || p.step < 1)
    return Status::invalid_argument;
  // Bias corrections in double, then applied in fp32 as torch.optim.Adam(W) does.
  const double bc1 = p.bias_correction ? 1.0 - std::pow(double(p.beta1), double(p.step)) : 1.0;
  const double bc2 = p.bias_correction ? 1.0 - std::pow(double(p.beta2), double(p.step)) : 1.0;
  const detail::AdamConsts c{p.beta1, p.beta2, 1.0f - p.beta1, 1.0f - p.beta2, p.eps, p.weight_decay,
                             float(double(p.lr) / bc1), float(std::sqrt(bc2)),
                             1.0f - p.lr * p.weight_decay, p.grad_scale, p.adamw_mode,
                             stats != nullptr};
  const auto& t = table();
  const auto run = [&](int64_t b, int64_t k) {
    return t.adam(param + b, at(grad, b), m + b, v + b, k, c, at(o, b));
  };
  if (stats != nullptr) *stats = stats_of(chunk_sum(n, run));
  else parallel_chunks(n, [&](int, int64_t b, int64_t k) { run(b, k); });
  return Status::ok;
}

}  // namespace

Isa cpu_isa() { return Isa(isa_slot().load(std::memory_order_relaxed)); }

Status set_cpu_isa(Isa isa) {
  if (!cpu_isa_supported(isa)) return Status::unsupported;
  isa_slot().store(int(isa), std::memory_order_relaxed);
  return Status::ok;
}

int cpu_threads() {
  const int forced = g_threads_override.load(std::memory_order_relaxed);
  if (forced > 0) return forced;
  static const int from_env = threads_from_env();
  return from_env > 0 ? from_env : omp_get_max_threads();
}

void set_cpu_threads(int n) { g_threads_override.store(n > 0 ? n : 0, std::memory_order_relaxed); }

// ---------------------------------------------------------------- optimizer steps

const char* status_message(Status s) {
  switch (s) {
    case Status::ok: return "ok";
    case Status::invalid_argument:
      return "invalid argument (null pointer, negative size, step < 1 or 16-bit kind not bf16/fp16)";
    case Status::unsupported: return "not supported on this CPU";
  }
  return "unknown status";
}

Status adam_step(float* param, const float* grad, float* m, float* v, int64_t n,
                 const AdamParams& p, HalfOut o, GradStats* stats) {
  return adam_any(param, {grad, Half::none}, m, v, n, p, o, stats);
}

Status adam_step(float* param, const uint16_t* grad, Half grad_kind, float* m, float* v, int64_t n,
                 const AdamParams& p, HalfOut o, GradStats* stats) {
  if (grad_kind != Half::bf16 && grad_kind != Half::fp16) return Status::invalid_argument;
  return adam_any(param, {grad, grad_kind}, m, v, n, p, o, stats);
}

Status sgd_step(float* param, const float* grad, float* buf, int64_t n, const SgdParams& p,
                HalfOut o) {
  const bool momentum = p.momentum != 0.0f;
  if (bad(param, n) || bad(grad, n) || (momentum && bad(buf, n)) || bad_out(o, n))
    return Status::invalid_argument;
  const detail::SgdConsts c{p.lr, p.momentum, 1.0f - p.dampening, p.weight_decay,
                            p.nesterov, p.first_step, momentum};
  const auto& t = table();
  parallel_chunks(n, [&](int, int64_t b, int64_t k) {
    t.sgd(param + b, grad + b, momentum ? buf + b : nullptr, k, c, at(o, b));
  });
  return Status::ok;
}

Status adagrad_step(float* param, const float* grad, float* sum, int64_t n, const AdagradParams& p,
                    HalfOut o) {
  if (bad(param, n) || bad(grad, n) || bad(sum, n) || bad_out(o, n) || p.step < 1)
    return Status::invalid_argument;
  const detail::AdagradConsts c{p.lr / (1.0f + float(p.step - 1) * p.lr_decay), p.eps,
                                p.weight_decay};
  const auto& t = table();
  parallel_chunks(n, [&](int, int64_t b, int64_t k) {
    t.adagrad(param + b, grad + b, sum + b, k, c, at(o, b));
  });
  return Status::ok;
}

Status lion_step(float* param, const float* grad, float* m, int64_t n, const LionParams& p,
                 HalfOut o) {
  if (bad(param, n) || bad(grad, n) || bad(m, n) || bad_out(o, n)) return Status::invalid_argument;
  const detail::LionConsts c{p.lr, p.beta1, 1.0f - p.beta1, p.beta2, 1.0f - p.beta2,
                             1.0f - p.lr * p.weight_decay};
  const auto& t = table();
  parallel_chunks(n, [&](int, int64_t b, int64_t k) {
    t.lion(param + b, grad + b, m + b, k, c, at(o, b));
  });
  return Status::ok;
}

// ---------------------------------------------------------------- gradient statistics, casts

namespace {
Status stats_any(detail::GradRef g, int64_t n, GradStats* out) {
  if (bad(g.data, n) || out == nullptr) return Status::invalid_argument;
  const auto& t = table();
  *out = stats_of(chunk_sum(n, [&](int64_t b, int64_t k) { return t.sum_sq(at(g, b), k); }));
  return Status::ok;
}
}  // namespace

Status grad_stats(const float* grad, int64_t n, GradStats* out) {
  return stats_any({grad, Half::none}, n, out);
}
Status grad_stats(const uint16_t* grad, Half kind, int64_t n, GradStats* out) {
  if (kind != Half::bf16 && kind != Half::fp16) return Status::invalid_argument;
  return stats_any({grad, kind}, n, out);
}

Status cast_to_half(const float* src, uint16_t* dst, Half kind, int64_t n) {
  if (bad(src, n) || bad(dst, n) || (kind != Half::bf16 && kind != Half::fp16))
    return Status::invalid_argument;
  const auto& t = table();
  parallel_chunks(n, [&](int, int64_t b, int64_t k) { t.cast_to_half(src + b, dst + b, kind, k); });
  return Status::ok;
}

Status cast_from_half(const uint16_t* src, Half kind, float* dst, int64_t n) {
  if (bad(src, n) || bad(dst, n) || (kind != Half::bf16 && kind != Half::fp16))
    return Status::invalid_argument;
  const auto& t = table();
  parallel_chunks(n, [&](int, int64_t b, int64_t k) { t.cast_from_half(src + b, kind, dst + b, k); });
  return Status::ok;
}

Status scale_copy(const float* src, float* dst, int64_t n, float scale) {
  if (bad(src, n) || bad(dst, n)) return Status::invalid_argument;
  // Overlap would make the result depend on the chunk order.
  if (n > 0 && src != dst && src < dst + n && dst < src + n) return Status::invalid_argument;
  // Copies larger than a core's L2 cache stream past it: the destination is not read first.
  const bool stream = n * int64_t(sizeof(float)) >= kStreamMinBytes;
  const auto& t = table();
  parallel_chunks(n, [&](int, int64_t b, int64_t k) { t.scale_copy(src + b, dst + b, k, scale, stream); });
  return Status::ok;
}

uint16_t float_to_half_bits(float x, Half kind) { return detail::f32_to_half(x, kind); }
float half_bits_to_float(uint16_t h, Half kind) { return detail::half_to_f32(h, kind); }

}  // namespace zeroshard::kernels
