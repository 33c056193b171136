// libFuzzer harness: any bytes, taken as a whole safetensors file, either
// parse into a header that tiles the data exactly or raise CheckpointError;
// never a crash, a hang, another exception or an unbounded allocation.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "zero/checkpoint/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    const auto h = zero::checkpoint::parse_safetensors_bytes(bytes, "fuzz.safetensors");
    // What a successful parse promises: tensors in order, tiling the data.
    std::uint64_t at = 0;
    for (const auto& t : h.tensors) {
      if (t.begin != at || t.end - t.begin != t.bytes()) std::abort();
      at = t.end;
    }
    if (h.data_start + at != size) std::abort();
  } catch (const zero::CheckpointError&) {
  }
  return 0;
}
