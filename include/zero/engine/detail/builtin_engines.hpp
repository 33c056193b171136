// Why: the built-in engines listed once, below the engine's users: which
// optimizers and precisions make_optimizer chooses from, and the macros that
// declare their engines compiled elsewhere (ZERO_EXTERN_ENGINES, at the end
// of engine.hpp under ZERO_PRECOMPILED_ENGINES) or compile them
// (ZERO_INSTANTIATE_ENGINES). How a program compiles them once, with
// make_optimizer's handles and the disk tier's stores:
// zero/runtime/precompiled.hpp.
#pragma once

#include "zero/compiler.hpp"

#include "zero/backend/host.hpp"
#include "zero/optim/adam.hpp"
#include "zero/optim/sgd.hpp"
#include "zero/policies.hpp"

// X(Optimizer, Precision, Backend) for the four built-in optimizer policies of
// one precision, and for all twelve (the list make_optimizer chooses from).
#define ZERO_FOR_EACH_BUILTIN_OPTIMIZER(X, Precision, Backend) \
  X(::zero::optim::Adam, Precision, Backend)                   \
  X(::zero::optim::AdamW, Precision, Backend)                  \
  X(::zero::optim::Sgd, Precision, Backend)                    \
  X(::zero::optim::PlainSgd, Precision, Backend)
#define ZERO_FOR_EACH_BUILTIN_ENGINE(X, Backend)                              \
  ZERO_FOR_EACH_BUILTIN_OPTIMIZER(X, ZERO_PRECISION_POLICY(fp32), Backend)   \
  ZERO_FOR_EACH_BUILTIN_OPTIMIZER(X, ZERO_PRECISION_POLICY(bf16), Backend)   \
  ZERO_FOR_EACH_BUILTIN_OPTIMIZER(X, ZERO_PRECISION_POLICY(fp16), Backend)

// The precision policy of each short name (fp32, bf16, fp16), the one list
// of the three: also for a file compiled once per precision with
// -DNAME=fp32 and so on (src/zero_engines.cpp), where NAME is expanded first.
#define ZERO_DETAIL_PRECISION_fp32 ::zero::precision::Full<float>
#define ZERO_DETAIL_PRECISION_bf16 ::zero::precision::Mixed<::zero::bf16>
#define ZERO_DETAIL_PRECISION_fp16 ::zero::precision::Mixed<::zero::fp16>
#define ZERO_DETAIL_PASTE(a, b) a##b
#define ZERO_PRECISION_POLICY(NAME) ZERO_DETAIL_PASTE(ZERO_DETAIL_PRECISION_, NAME)

// One engine: KEYWORD is `extern` to declare it, nothing to compile it.
#define ZERO_DETAIL_ENGINE_INSTANCE(KEYWORD, Optimizer, Precision, Backend) \
  KEYWORD template class ::zero::detail::Engine<Precision, Optimizer, Backend>;
#define ZERO_DETAIL_EXTERN_ENGINE(O, P, B) ZERO_DETAIL_ENGINE_INSTANCE(extern, O, P, B)
#define ZERO_DETAIL_ENGINE(O, P, B) ZERO_DETAIL_ENGINE_INSTANCE(, O, P, B)

// The twelve engines of a backend declared compiled elsewhere: at the end of
// engine.hpp (backend::Host, under ZERO_PRECOMPILED_ENGINES), or after the
// header of a backend of your own (tests/engine/late_copies.hpp does).
#define ZERO_EXTERN_ENGINES(Backend) ZERO_FOR_EACH_BUILTIN_ENGINE(ZERO_DETAIL_EXTERN_ENGINE, Backend)

// What the file that compiles one precision's engines writes.
#define ZERO_INSTANTIATE_ENGINES(Precision, Backend) \
  ZERO_FOR_EACH_BUILTIN_OPTIMIZER(ZERO_DETAIL_ENGINE, Precision, Backend)
