// Host harness of the CUDA kernels' per-thread logic, without nvcc or a GPU: the FK_HD functions of
// csrc/cuda/*.cuh become plain inline functions, and tests/cuda_host/<op>.cpp emulates that op's
// thread grids around them. tests/host_harness.py compiles every tests/cuda_host/*.cpp into one
// program, as one translation unit (so a file's static helpers need names of their own); each op's tests
// (tests/test_<op>.py) drive it. Protocol: one command per line on stdin,
// numbers as C99 hex floats (exact) or decimal integers; one answer line each (ERR ... on a failed
// emulation check); each <op>.cpp lists its commands at its top.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

// the per-thread logic only: the launcher sections of the .cuh files need the CUDA runtime headers
#define FEDKERNELS_HD_ONLY

namespace fedkernels {
namespace cuda {}
}  // namespace fedkernels
using namespace fedkernels::cuda;

inline double rd(std::istream& in) {
  std::string s;
  in >> s;
  return std::strtod(s.c_str(), nullptr);
}
inline long long ri(std::istream& in) {
  long long v;
  in >> v;
  return v;
}
inline void put(double v) { std::printf(" %a", v); }

// warp_sum: butterfly x_l + x_{l^o} for o = 16..1 (every lane ends with lane 0's value)
inline double butterfly(double x[32]) {
  for (int o = 16; o > 0; o >>= 1) {
    double y[32];
    for (int l = 0; l < 32; ++l) y[l] = x[l] + x[l ^ o];
    for (int l = 0; l < 32; ++l) x[l] = y[l];
  }
  return x[0];
}

// A command reads its arguments from `in` and prints one answer line; FK_HOST_COMMAND(name) { ... }
// defines one and adds it to the table main.cpp dispatches on.
using HostCommand = void (*)(std::istream& in);
bool add_host_command(const char* name, HostCommand fn);
#define FK_HOST_COMMAND(name)                                                     \
  static void name##_command(std::istream& in);                                   \
  static const bool name##_added = add_host_command(#name, &name##_command);      \
  static void name##_command(std::istream& in)
