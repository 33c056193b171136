// Why: every JSON document the library reads (checkpoint manifests,
// safetensors headers, the Hugging Face index, configuration files) comes
// through here, so that a key written twice in one object is caught the same
// way everywhere (nlohmann keeps the last one silently: a config file that
// says "stage" twice would train with whichever came last) and a syntax error
// can be reported by line and column, not only by byte offset. Needs
// nlohmann-json, as the checkpoint and configuration headers that use it do.
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace zero::detail {

struct ParsedJson {
  nlohmann::json value;
  // The first key found twice in one object ("" when none), and the same with
  // the keys of the objects around it ("offload.tier").
  std::string duplicate_key;
  std::string duplicate_path;
};

// Parses `text`; a syntax error throws nlohmann::json::parse_error (its
// byte() says where; text_position turns that into a line and a column), a
// number beyond a double's range (1e400) nlohmann::json::out_of_range, which
// says neither where nor whose. Either way `key_at_error`, where given, is
// then the key path of the value being read ("loss_scale.min_scale"; "" at
// the top level).
inline ParsedJson parse_json_noting_duplicates(std::string_view text, std::string* key_at_error = nullptr) {
  struct Frame {
    bool object = false;
    std::vector<std::string> keys;  // seen so far, the last one the value being parsed
  };
  std::vector<Frame> open;
  ParsedJson out;
  // The key path of the value being parsed: the last key of each object around it.
  auto current_path = [&open] {
    std::string path;
    for (const Frame& f : open)
      if (f.object && !f.keys.empty()) path += (path.empty() ? "" : ".") + f.keys.back();
    return path;
  };
  auto callback = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start || event == E::array_start) {
      open.push_back(Frame{event == E::object_start, {}});
    } else if (event == E::object_end || event == E::array_end) {
      if (!open.empty()) open.pop_back();
    } else if (event == E::key && !open.empty()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      auto& seen = open.back().keys;
      const bool again = std::find(seen.begin(), seen.end(), key) != seen.end();
      seen.push_back(key);
      if (again && out.duplicate_key.empty()) {
        out.duplicate_key = key;
        out.duplicate_path = current_path();
      }
    }
    return true;
  };
  try {
    out.value = nlohmann::json::parse(text.begin(), text.end(), callback);
  } catch (const nlohmann::json::exception&) {
    if (key_at_error != nullptr) *key_at_error = current_path();
    throw;
  }
  return out;
}

struct TextPosition {
  std::size_t line = 1, column = 1;  // both from 1
};

// Where byte `byte` (nlohmann's parse_error::byte(): 1-based, the last byte
// read) lies in `text`.
inline TextPosition text_position(std::string_view text, std::size_t byte) {
  TextPosition at;
  const std::size_t end = byte == 0 ? 0 : (byte - 1 < text.size() ? byte - 1 : text.size());
  for (std::size_t i = 0; i < end; ++i) {
    if (text[i] == '\n') {
      ++at.line;
      at.column = 1;
    } else {
      ++at.column;
    }
  }
  return at;
}

// A value for an error message: its JSON type and (the start of) its text,
// `string "64M"`.
inline std::string describe_json_value(const nlohmann::json& v) {
  std::string text = v.dump();
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return std::string(v.type_name()) + " " + text;
}

}  // namespace zero::detail
