// The headers the unoptimized test programs share (the engine, checkpoint,
// offload, runtime, example and GPT tests: test_options in tests/meson.build),
// precompiled once for all of them with Clang's -fpch-codegen: the inline
// functions and template instances these headers make (the host kernels of
// comm::Local and the engines, Catch2's matchers, the checkpoint reader and
// writer, the test harness) are then compiled into one object that every
// such program links, instead of once in every file. A test file still
// includes what it uses (the includes below are then skipped), compiles
// without this header under g++, and its code does not change.
//
// What may be here: headers whose code does not depend on a macro that one
// test program defines and another does not (late_copies.hpp does:
// ZERO_TEST_PRECOMPILED_LATE_COPIES), and none that defines Catch2's runner
// (CATCH_CONFIG_RUNNER: test_engine_mpi.cpp, which is left out).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/engine_harness.hpp"
#include "zero/checkpoint/hugging_face.hpp"
#include "zero/checkpoint/optimizer_io.hpp"
#include "zero/offload/disk_state_store.hpp"
#include "zero/runtime/make_optimizer.hpp"
#include "zero/zero.hpp"
