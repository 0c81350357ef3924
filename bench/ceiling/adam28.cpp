// The memory ceiling for the fp32 Adam step on this machine: the same in-place 28 bytes per
// parameter (read p, g, m, v; write p, m, v), first as plain adds (traffic28), then as a plain
// Adam loop the compiler vectorises (adam28). Built by bench/cpu_adam.py with
//   g++ -O3 -march=native -fno-math-errno -fopenmp bench/ceiling/adam28.cpp -o adam28
// (a benchmark, not shipped: -march=native is fine here). Usage: adam28 <n> <reps>; prints
// one line per kernel: name, median seconds, GB/s, Gparam/s.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

void traffic28(float* p, const float* g, float* m, float* v, long n) {
#pragma omp parallel for schedule(static)
  for (long i = 0; i < n; ++i) {
    p[i] += g[i];
    m[i] += g[i];
    v[i] += g[i];
  }
}

void adam28(float* p, const float* g, float* m, float* v, long n) {
  const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, step = 1e-3f / 0.1f, bc2 = std::sqrt(0.001f);
#pragma omp parallel for schedule(static)
  for (long i = 0; i < n; ++i) {
    m[i] = b1 * m[i] + (1 - b1) * g[i];
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    p[i] -= step * m[i] / (std::sqrt(v[i]) / bc2 + eps);
  }
}

template <class F>
double median_seconds(F&& f, int reps) {
  std::vector<double> t;
  f();   // warm-up: page faults and caches
  for (int r = 0; r < reps; ++r) {
    const auto a = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const long n = argc > 1 ? long(std::atof(argv[1])) : 100000000L;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 5;
  std::vector<float> p(n), g(n), m(n), v(n);
#pragma omp parallel for schedule(static)
  for (long i = 0; i < n; ++i) { p[i] = 1.0f; g[i] = 1e-3f; m[i] = 0; v[i] = 0; }
  for (auto [name, fn] : {std::pair{"traffic28", &traffic28}, std::pair{"adam28", &adam28}}) {
    const double s = median_seconds([&] { fn(p.data(), g.data(), m.data(), v.data(), n); }, reps);
    std::printf("%s %.6f %.2f %.4f\n", name, s, 28.0 * n / s / 1e9, n / s / 1e9);
  }
  std::printf("threads %d\n", omp_get_max_threads());
  return 0;
}
