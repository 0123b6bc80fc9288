// SPDX-License-Identifier: Apache-2.0
// Run-time choice of the CPU instruction set (portable builds; issue: a wheel built with
// -march=native can crash on another CPU).
//
// Every kernels/cpu/*.cpp is compiled once per instruction-set variant (CMakeLists.txt): avx512
// (-mavx512f -mavx512bw -mavx512vl ...), avx2 (-mavx2 -mf16c ...) and generic (the compiler's
// baseline), each with GRADCOMP_CPU_ISA set to the variant's name, so a family's file defines its
// kernel table in namespace cpu::<variant> (GRADCOMP_CPU_NAMESPACE). The generic compilation (or
// the single one of a GRADCOMP_NATIVE=ON build) also defines the table the core uses, cpu::<family>,
// through GRADCOMP_CPU_TABLE: its three entries forward to the variant detail::cpu_isa() names
// (the best one the processor supports: __builtin_cpu_supports; GRADCOMP_CPU_ISA in the
// environment or set_cpu_isa() may ask for a lower one). The variants run the same fixed float32
// expressions, so their packets are byte-identical (tests/cpp/test_isa.cpp).
#pragma once

#include "../core/backend.hpp"

#ifndef GRADCOMP_CPU_ISA
#define GRADCOMP_CPU_ISA generic
#endif

#define GRADCOMP_CPU_NAMESPACE gradcomp::detail::cpu::GRADCOMP_CPU_ISA

//! GRADCOMP_CPU_TABLE(PLAN, NAME, WORKSPACE_BYTES, ENCODE, DECODE), at global scope after a
//! family's kernels: defines this variant's table cpu::<variant>::NAME and, in the dispatching
//! compilation, cpu::NAME (declared in kernels/core/codecs/<family>.hpp) forwarding to the variant
//! that runs.
#define GRADCOMP_CPU_VARIANT_TABLE(PLAN, NAME, WS, ENC, DEC)                                        \
  namespace GRADCOMP_CPU_NAMESPACE {                                                               \
  extern const Kernels<PLAN> NAME;                                                                 \
  const Kernels<PLAN> NAME = {&WS, &ENC, &DEC};                                                    \
  }

#if defined(GRADCOMP_CPU_EMIT_TABLES)
#if defined(GRADCOMP_CPU_SINGLE_VARIANT)
#define GRADCOMP_CPU_DISPATCH_TABLE(PLAN, NAME)                                                    \
  namespace gradcomp::detail::cpu {                                                                \
  const Kernels<PLAN> NAME = GRADCOMP_CPU_ISA::NAME;                                               \
  }
#else
#define GRADCOMP_CPU_DISPATCH_TABLE(PLAN, NAME)                                                    \
  namespace gradcomp::detail::cpu {                                                                \
  namespace avx512 { extern const Kernels<PLAN> NAME; }                                            \
  namespace avx2 { extern const Kernels<PLAN> NAME; }                                              \
  namespace generic { extern const Kernels<PLAN> NAME; }                                           \
  namespace {                                                                                      \
  inline const Kernels<PLAN>& NAME##_variant() {                                                   \
    switch (cpu_isa()) {                                                                           \
      case CpuIsa::avx512: return avx512::NAME;                                                    \
      case CpuIsa::avx2: return avx2::NAME;                                                        \
      default: return generic::NAME;                                                               \
    }                                                                                              \
  }                                                                                                \
  }                                                                                                \
  const Kernels<PLAN> NAME = {                                                                     \
      [](const PLAN& p) { return NAME##_variant().workspace_bytes(p); },                           \
      [](const PLAN& p, const EncodeArgs& a) { NAME##_variant().encode(p, a); },                   \
      [](const PLAN& p, const DecodeArgs& a) { NAME##_variant().decode(p, a); },                   \
  };                                                                                               \
  }
#endif
#else
#define GRADCOMP_CPU_DISPATCH_TABLE(PLAN, NAME)
#endif

#define GRADCOMP_CPU_TABLE(PLAN, NAME, WS, ENC, DEC)                                               \
  GRADCOMP_CPU_VARIANT_TABLE(PLAN, NAME, WS, ENC, DEC)                                             \
  GRADCOMP_CPU_DISPATCH_TABLE(PLAN, NAME)
