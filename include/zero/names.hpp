// Why: parameter, unit and state-slot names end up as JSON strings (the
// checkpoint manifest, safetensors headers, the Hugging Face index), so a
// name those files cannot hold must be refused where the user registers it,
// not at the first save hours later with a JSON library's error that names
// neither the parameter nor the file. Plain code without nlohmann-json: the
// layout includes it in programs that never checkpoint.
#pragma once

#include "zero/compiler.hpp"

#include <cstddef>
#include <cstdio>
#include <string>
#include <string_view>

#include "zero/error.hpp"

namespace zero {

// The byte offset of the first byte of `s` that is not part of well-formed
// UTF-8 (RFC 3629: no overlong forms, no surrogates, nothing past U+10FFFF;
// what JSON writers accept), or npos when all of it is.
inline std::size_t invalid_utf8_at(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<unsigned char>(s[i]);
    std::size_t n = 0;             // continuation bytes
    unsigned char lo = 0x80, hi = 0xBF;  // the range of the first continuation byte
    if (b < 0x80) {
      ++i;
      continue;
    } else if (b >= 0xC2 && b <= 0xDF) {
      n = 1;
    } else if (b >= 0xE0 && b <= 0xEF) {
      n = 2;
      if (b == 0xE0) lo = 0xA0;  // overlong
      if (b == 0xED) hi = 0x9F;  // surrogates U+D800..U+DFFF
    } else if (b >= 0xF0 && b <= 0xF4) {
      n = 3;
      if (b == 0xF0) lo = 0x90;  // overlong
      if (b == 0xF4) hi = 0x8F;  // past U+10FFFF
    } else {
      return i;
    }
    if (s.size() - i <= n) return i;
    for (std::size_t k = 1; k <= n; ++k) {
      const auto c = static_cast<unsigned char>(s[i + k]);
      if (c < (k == 1 ? lo : 0x80) || c > (k == 1 ? hi : 0xBF)) return i;
    }
    i += n + 1;
  }
  return std::string_view::npos;
}

// `s` for an error message: printable ASCII as is, every other byte as \xNN
// (a name that is not UTF-8 cannot be printed as it is).
inline std::string escaped_name(std::string_view s) {
  std::string out;
  for (const char ch : s) {
    const auto b = static_cast<unsigned char>(ch);
    if (b >= 0x20 && b < 0x7F && b != '\\') {
      out += ch;
    } else {
      char hex[5];
      std::snprintf(hex, sizeof hex, "\\x%02X", b);
      out += hex;
    }
  }
  return out;
}

// Throws InvalidArgument unless `name` is UTF-8: `where` is the call
// ("add_unit"), `kind` what the name is ("unit").
inline void require_utf8_name(std::string_view where, std::string_view kind, std::string_view name) {
  const std::size_t bad = invalid_utf8_at(name);
  require(bad == std::string_view::npos, where, ": the ", kind, " name '", escaped_name(name),
          "' is not valid UTF-8 (byte ", bad, "): checkpoints and safetensors files store names as JSON strings, "
          "which must be UTF-8; rename the ", kind, " (or convert the name to UTF-8)");
}

// Throws InvalidArgument unless `name` can name a tensor of a checkpoint and
// of a Hugging Face export: not empty (tensors are found by name), not
// safetensors' reserved '__metadata__', UTF-8.
inline void require_saveable_name(std::string_view where, std::string_view kind, std::string_view name) {
  require(!name.empty(), where, ": the ", kind, " name is empty; checkpoints and Hugging Face exports find each ", kind,
          " by its name: give it one (e.g. \"fc1.weight\")");
  require(name != "__metadata__", where, ": the ", kind,
          " name '__metadata__' is reserved by safetensors (its header's metadata entry): rename the ", kind);
  require_utf8_name(where, kind, name);
}

}  // namespace zero
