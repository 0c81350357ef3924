// The optimizer loops, written once over a vector type V and included by each SIMD translation
// unit (optimizers_avx2.cpp, optimizers_avx512.cpp) after it defines V for its instruction set.
// Everything here has internal linkage: an inline function compiled with -mavx512f must never be
// merged with, and then picked over, the same function compiled for a smaller ISA.
//
// V provides: F (vector of W floats); load/store, stream (non-temporal store to a W-float aligned
// address) and fence, set1, add, sub, mul, div, sqrt, fmadd(a,b,c) =
// a*b+c, fnmadd(a,b,c) = c-a*b, sign (-1/0/+1); load_bf16/load_fp16/store_bf16/store_fp16 (round
// to nearest even); Acc, acc_zero, acc_sq (adds x*x in double), acc_sum.

namespace {

enum class Fmt { f32, bf16, fp16, none };
constexpr int W = V::W;

template <Fmt G>
inline typename V::F load_as_f32(const void* base, int64_t i) {
  if constexpr (G == Fmt::f32) return V::load(static_cast<const float*>(base) + i);
  else if constexpr (G == Fmt::bf16) return V::load_bf16(static_cast<const uint16_t*>(base) + i);
  else return V::load_fp16(static_cast<const uint16_t*>(base) + i);
}
template <Fmt O>
inline void store_half(uint16_t* base, int64_t i, typename V::F x) {
  if constexpr (O == Fmt::bf16) V::store_bf16(base + i, x);
  else if constexpr (O == Fmt::fp16) V::store_fp16(base + i, x);
}
constexpr int64_t elem_bytes(Fmt f) { return f == Fmt::f32 ? 4 : 2; }

// Runs step(s[0..K), g, o, index) over n elements, W at a time. The last partial vector runs on
// zero-padded copies so it takes exactly the arithmetic of the full vectors. s are the fp32
// arrays read and written in place, g the gradient (format G), o the 16-bit output (format O).
template <int K, Fmt G, Fmt O, class Step>
inline void drive(int64_t n, float* const (&s)[K], const void* g, uint16_t* o, Step&& step) {
  int64_t i = 0;
  for (; i + W <= n; i += W) step(s, g, o, i);
  const int64_t r = n - i;
  if (r == 0) return;
  alignas(64) float sb[K][W] = {};
  alignas(64) unsigned char gb[W * 4] = {};
  alignas(64) uint16_t ob[W] = {};
  float* sp[K];
  for (int k = 0; k < K; ++k) {
    for (int64_t j = 0; j < r; ++j) sb[k][j] = s[k][i + j];
    sp[k] = sb[k];
  }
  __builtin_memcpy(gb, static_cast<const unsigned char*>(g) + i * elem_bytes(G), r * elem_bytes(G));
  step(sp, static_cast<const void*>(gb), ob, int64_t{0});
  for (int k = 0; k < K; ++k)
    for (int64_t j = 0; j < r; ++j) s[k][i + j] = sb[k][j];
  if constexpr (O != Fmt::none)
    for (int64_t j = 0; j < r; ++j) o[i + j] = ob[j];
}

// kSumSq: the same pass also returns the gradient's sum of squares (as read, before grad_scale),
// so a global norm that nothing needs before the update costs no second read of the gradient.
template <Fmt G, Fmt O, bool kAdamW, bool kSumSq>
double adam_loop(float* p, const void* g, float* m, float* v, int64_t n, const AdamConsts& c,
                 uint16_t* o) {
  const auto b1 = V::set1(c.beta1), b2 = V::set1(c.beta2), omb1 = V::set1(c.one_minus_beta1),
             omb2 = V::set1(c.one_minus_beta2), eps = V::set1(c.eps), wd = V::set1(c.weight_decay),
             step_size = V::set1(c.step_size), bc2 = V::set1(c.bc2_sqrt), decay = V::set1(c.decay),
             gs = V::set1(c.grad_scale);
  float* const s[3] = {p, m, v};
  auto acc = V::acc_zero();
  // The zero-padded tail vector adds nothing to the sum.
  drive<3, G, O>(n, s, g, o, [&](float* const* a, const void* gp, uint16_t* op, int64_t i) {
    const auto raw = load_as_f32<G>(gp, i);
    if constexpr (kSumSq) V::acc_sq(acc, raw);
    auto gv = V::mul(raw, gs);
    auto w = V::load(a[0] + i);
    if constexpr (kAdamW) w = V::mul(w, decay);
    else gv = V::fmadd(wd, w, gv);
    const auto mv = V::fmadd(b1, V::load(a[1] + i), V::mul(omb1, gv));
    const auto vv = V::fmadd(b2, V::load(a[2] + i), V::mul(V::mul(omb2, gv), gv));
    const auto denom = V::add(V::div(V::sqrt(vv), bc2), eps);
    w = V::fnmadd(step_size, V::div(mv, denom), w);
    V::store(a[0] + i, w);
    V::store(a[1] + i, mv);
    V::store(a[2] + i, vv);
    store_half<O>(op, i, w);
  });
  return kSumSq ? V::acc_sum(acc) : 0.0;
}

template <Fmt O, bool kMomentum>
void sgd_loop(float* p, const float* g, float* buf, int64_t n, const SgdConsts& c, uint16_t* o) {
  const auto lr = V::set1(c.lr), mom = V::set1(c.momentum), omd = V::set1(c.one_minus_dampening),
             wd = V::set1(c.weight_decay);
  auto step = [&](float* const* a, const void* gp, uint16_t* op, int64_t i) {
    auto w = V::load(a[0] + i);
    auto gv = V::fmadd(wd, w, V::load(static_cast<const float*>(gp) + i));
    if constexpr (kMomentum) {
      const auto b = c.first_step ? gv : V::fmadd(mom, V::load(a[1] + i), V::mul(omd, gv));
      V::store(a[1] + i, b);
      gv = c.nesterov ? V::fmadd(mom, b, gv) : b;
    }
    w = V::fnmadd(lr, gv, w);
    V::store(a[0] + i, w);
    store_half<O>(op, i, w);
  };
  if constexpr (kMomentum) {
    float* const s[2] = {p, buf};
    drive<2, Fmt::f32, O>(n, s, g, o, step);
  } else {
    float* const s[1] = {p};
    drive<1, Fmt::f32, O>(n, s, g, o, step);
  }
}

template <Fmt O>
void adagrad_loop(float* p, const float* g, float* sum, int64_t n, const AdagradConsts& c,
                  uint16_t* o) {
  const auto clr = V::set1(c.clr), eps = V::set1(c.eps), wd = V::set1(c.weight_decay);
  float* const s[2] = {p, sum};
  drive<2, Fmt::f32, O>(n, s, g, o, [&](float* const* a, const void* gp, uint16_t* op, int64_t i) {
    auto w = V::load(a[0] + i);
    const auto gv = V::fmadd(wd, w, V::load(static_cast<const float*>(gp) + i));
    const auto sv = V::fmadd(gv, gv, V::load(a[1] + i));
    w = V::sub(w, V::div(V::mul(clr, gv), V::add(V::sqrt(sv), eps)));
    V::store(a[0] + i, w);
    V::store(a[1] + i, sv);
    store_half<O>(op, i, w);
  });
}

template <Fmt O>
void lion_loop(float* p, const float* g, float* m, int64_t n, const LionConsts& c, uint16_t* o) {
  const auto lr = V::set1(c.lr), b1 = V::set1(c.beta1), omb1 = V::set1(c.one_minus_beta1),
             b2 = V::set1(c.beta2), omb2 = V::set1(c.one_minus_beta2), decay = V::set1(c.decay);
  float* const s[2] = {p, m};
  drive<2, Fmt::f32, O>(n, s, g, o, [&](float* const* a, const void* gp, uint16_t* op, int64_t i) {
    const auto gv = V::load(static_cast<const float*>(gp) + i);
    const auto mv = V::load(a[1] + i);
    const auto u = V::fmadd(b1, mv, V::mul(omb1, gv));
    const auto w = V::fnmadd(lr, V::sign(u), V::mul(V::load(a[0] + i), decay));
    V::store(a[0] + i, w);
    V::store(a[1] + i, V::fmadd(b2, mv, V::mul(omb2, gv)));
    store_half<O>(op, i, w);
  });
}

template <Fmt G>
double sum_sq_loop(const void* g, int64_t n) {
  auto acc = V::acc_zero();
  int64_t i = 0;
  for (; i + W <= n; i += W) V::acc_sq(acc, load_as_f32<G>(g, i));
  if (i < n) {
    alignas(64) unsigned char gb[W * 4] = {};
    __builtin_memcpy(gb, static_cast<const unsigned char*>(g) + i * elem_bytes(G),
                     (n - i) * elem_bytes(G));
    V::acc_sq(acc, load_as_f32<G>(gb, 0));
  }
  return V::acc_sum(acc);
}

// Format dispatch: one branch per call, none inside the loops.
Fmt grad_fmt(Half k) { return k == Half::bf16 ? Fmt::bf16 : k == Half::fp16 ? Fmt::fp16 : Fmt::f32; }
Fmt out_fmt(HalfOut o) {
  if (o.data == nullptr) return Fmt::none;
  return o.kind == Half::bf16 ? Fmt::bf16 : o.kind == Half::fp16 ? Fmt::fp16 : Fmt::none;
}

template <Fmt G, Fmt O>
double adam_go(float* p, const void* g, float* m, float* v, int64_t n, const AdamConsts& c,
               uint16_t* o) {
  if (c.sum_sq) {
    return c.adamw ? adam_loop<G, O, true, true>(p, g, m, v, n, c, o)
                   : adam_loop<G, O, false, true>(p, g, m, v, n, c, o);
  }
  return c.adamw ? adam_loop<G, O, true, false>(p, g, m, v, n, c, o)
                 : adam_loop<G, O, false, false>(p, g, m, v, n, c, o);
}
template <Fmt G>
double adam_out(float* p, const void* g, float* m, float* v, int64_t n, const AdamConsts& c,
                HalfOut o) {
  switch (out_fmt(o)) {
    case Fmt::bf16: return adam_go<G, Fmt::bf16>(p, g, m, v, n, c, o.data);
    case Fmt::fp16: return adam_go<G, Fmt::fp16>(p, g, m, v, n, c, o.data);
    default: return adam_go<G, Fmt::none>(p, g, m, v, n, c, nullptr);
  }
}
double adam(float* p, GradRef g, float* m, float* v, int64_t n, const AdamConsts& c, HalfOut o) {
  switch (grad_fmt(g.kind)) {
    case Fmt::bf16: return adam_out<Fmt::bf16>(p, g.data, m, v, n, c, o);
    case Fmt::fp16: return adam_out<Fmt::fp16>(p, g.data, m, v, n, c, o);
    default: return adam_out<Fmt::f32>(p, g.data, m, v, n, c, o);
  }
}

template <Fmt O>
void sgd_go(float* p, const float* g, float* b, int64_t n, const SgdConsts& c, uint16_t* o) {
  if (c.has_momentum) sgd_loop<O, true>(p, g, b, n, c, o);
  else sgd_loop<O, false>(p, g, b, n, c, o);
}
void sgd(float* p, const float* g, float* b, int64_t n, const SgdConsts& c, HalfOut o) {
  switch (out_fmt(o)) {
    case Fmt::bf16: sgd_go<Fmt::bf16>(p, g, b, n, c, o.data); break;
    case Fmt::fp16: sgd_go<Fmt::fp16>(p, g, b, n, c, o.data); break;
    default: sgd_go<Fmt::none>(p, g, b, n, c, nullptr); break;
  }
}
void adagrad(float* p, const float* g, float* s, int64_t n, const AdagradConsts& c, HalfOut o) {
  switch (out_fmt(o)) {
    case Fmt::bf16: adagrad_loop<Fmt::bf16>(p, g, s, n, c, o.data); break;
    case Fmt::fp16: adagrad_loop<Fmt::fp16>(p, g, s, n, c, o.data); break;
    default: adagrad_loop<Fmt::none>(p, g, s, n, c, nullptr); break;
  }
}
void lion(float* p, const float* g, float* m, int64_t n, const LionConsts& c, HalfOut o) {
  switch (out_fmt(o)) {
    case Fmt::bf16: lion_loop<Fmt::bf16>(p, g, m, n, c, o.data); break;
    case Fmt::fp16: lion_loop<Fmt::fp16>(p, g, m, n, c, o.data); break;
    default: lion_loop<Fmt::none>(p, g, m, n, c, nullptr); break;
  }
}
double sum_sq(GradRef g, int64_t n) {
  switch (grad_fmt(g.kind)) {
    case Fmt::bf16: return sum_sq_loop<Fmt::bf16>(g.data, n);
    case Fmt::fp16: return sum_sq_loop<Fmt::fp16>(g.data, n);
    default: return sum_sq_loop<Fmt::f32>(g.data, n);
  }
}

// dst = src * scale. With stream, dst is written with non-temporal stores from its first
// W-float aligned element on: a large copy does not read the destination lines first and does not
// evict the caches for data that is read next from memory anyway.
void scale_copy(const float* src, float* dst, int64_t n, float scale, bool stream) {
  const auto a = V::set1(scale);
  int64_t i = 0;
  const auto addr = reinterpret_cast<uintptr_t>(dst);
  if (stream && addr % sizeof(float) == 0) {  // float-aligned, as every tensor is
    // Elements before the first vector-aligned one: 0 .. W-1.
    const int64_t head = int64_t((0 - addr) % (W * sizeof(float)) / sizeof(float));
    for (; i < head && i < n; ++i) dst[i] = src[i] * scale;
    for (; i + W <= n; i += W) V::stream(dst + i, V::mul(V::load(src + i), a));
    V::fence();
  }
  for (; i + W <= n; i += W) V::store(dst + i, V::mul(V::load(src + i), a));
  for (; i < n; ++i) dst[i] = src[i] * scale;
}

template <Fmt O>
void cast_to_loop(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) store_half<O>(dst, i, V::load(src + i));
  if (i == n) return;
  alignas(64) float sb[W] = {};
  alignas(64) uint16_t ob[W] = {};
  for (int64_t j = 0; j < n - i; ++j) sb[j] = src[i + j];
  store_half<O>(ob, 0, V::load(sb));
  for (int64_t j = 0; j < n - i; ++j) dst[i + j] = ob[j];
}
void cast_to_half(const float* src, uint16_t* dst, Half kind, int64_t n) {
  if (kind == Half::bf16) cast_to_loop<Fmt::bf16>(src, dst, n);
  else cast_to_loop<Fmt::fp16>(src, dst, n);
}
template <Fmt G>
void cast_from_loop(const uint16_t* src, float* dst, int64_t n) {
  float* const s[1] = {dst};
  drive<1, G, Fmt::none>(n, s, src, nullptr, [&](float* const* a, const void* gp, uint16_t*, int64_t i) {
    V::store(a[0] + i, load_as_f32<G>(gp, i));
  });
}
void cast_from_half(const uint16_t* src, Half kind, float* dst, int64_t n) {
  if (kind == Half::bf16) cast_from_loop<Fmt::bf16>(src, dst, n);
  else cast_from_loop<Fmt::fp16>(src, dst, n);
}

const KernelTable kTable{adam, sgd, adagrad, lion, sum_sq, cast_to_half, cast_from_half, scale_copy};

}  // namespace
