// The configure-time probe of tests/fuzz/meson.build: does Clang link a
// libFuzzer harness (with its sanitizers) here?
#include <cstddef>
#include <cstdint>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t*, std::size_t) { return 0; }
