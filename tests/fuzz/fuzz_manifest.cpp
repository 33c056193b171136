// libFuzzer harness: any bytes as manifest.json either parse into a manifest
// that validates (and survives a round trip through its JSON) or raise
// CheckpointError; never a crash, a hang or another exception.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "zero/checkpoint/manifest.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const auto m = zero::checkpoint::parse_manifest(text, "fuzz/manifest.json");
    const auto again = zero::checkpoint::parse_manifest(zero::checkpoint::manifest_to_json(m).dump(), "again");
    if (zero::checkpoint::manifest_to_json(again) != zero::checkpoint::manifest_to_json(m)) std::abort();
  } catch (const zero::CheckpointError&) {
  }
  return 0;
}
