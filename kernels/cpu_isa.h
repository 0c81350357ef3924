// Run-time choice of the CPU instruction set and thread count for the optimizer kernels. One
// binary serves every x86-64 machine: each ISA lives in its own translation unit compiled with
// its own flags, and the best one this CPU (and OS) supports is picked on first use.
#pragma once

#include "kernels/cpu_optimizers.h"

namespace zeroshard::kernels {

enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2 };

const char* isa_name(Isa isa);                  // "scalar", "avx2", "avx512"
bool parse_isa(const char* name, Isa* out);     // inverse of isa_name; false for anything else

// Compiled in and supported by this CPU: scalar always; avx2 needs AVX2+FMA+F16C; avx512 needs
// AVX-512F+BW.
bool cpu_isa_supported(Isa isa);
Isa best_cpu_isa();
// The ISA the kernels use now: best_cpu_isa(), lowered by ZEROSHARD_CPU_ISA=scalar|avx2|avx512
// or set_cpu_isa(). Asking for one this CPU lacks returns unsupported and changes nothing.
Isa cpu_isa();
Status set_cpu_isa(Isa isa);
// What ZEROSHARD_CPU_ISA asks for, read now (cpu_isa() reads it once, on first use):
// best_cpu_isa() when unset, or, with a warning (kernels/warn.h), for a value that is no ISA
// name or names one this CPU lacks.
Isa cpu_isa_from_env();

// Threads per kernel call: set_cpu_threads(n > 0), else ZEROSHARD_CPU_THREADS, else OpenMP's
// default (OMP_NUM_THREADS or the core count). set_cpu_threads(0) goes back to the default.
int cpu_threads();
void set_cpu_threads(int n);

}  // namespace zeroshard::kernels
