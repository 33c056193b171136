// Why: a training run's choices belong in a file that is versioned with the
// run, as DeepSpeed users keep theirs (ds_config.json), not in a command line
// retyped each time. The file's keys are zero::Config's own, described once
// below (config_keys, Options' from their field table) for both reading and
// writing, so the two cannot drift;
// the reader is strict: an unknown key (a typo) is an error naming its path
// and the keys that exist there, a wrong type names the key, the type found
// and the type expected, and a key given twice is an error, since a setting
// that is silently ignored is worse than one that stops the run. The keys
// and a full example: docs/configuration.md. Needs nlohmann-json.
#pragma once

#include "zero/compiler.hpp"

#include <cerrno>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "zero/error.hpp"
#include "zero/json_parse.hpp"
#include "zero/runtime/config.hpp"
#include "zero/runtime/enum_values.hpp"
#include "zero/runtime/name_list.hpp"

namespace zero {

namespace detail {

// The keys of an options struct, from its field table (Options::fields()):
// v.field(key, member) for a field, v.object(key, body) for a group.
// Options::nvme has its keys in "offload" instead, beside the tier that
// reads them (config_keys).
template <class S, class Visit>
void option_keys(S& options, Visit& v) {
  for_each_option_row(options, [&]<class Row, class M>(const Row& row, M& value) {
    if constexpr (!Row::group) v.field(row.key, value);
    else if constexpr (!std::is_same_v<std::remove_const_t<M>, NvmeOptions>)
      v.object(row.key, [&](Visit& inner) { option_keys(value, inner); });
  });
}

// Every key of a configuration file, where it lives in zero::Config. `C` is
// Config (reading) or const Config (writing); `v` visits each key in turn:
// v.field(key, member) for a value, v.object(key, body) for a nested object
// whose keys `body` visits. Every key is optional: one not in a file keeps
// Config's default.
template <class C, class Visit>
void config_keys(C& c, Visit& v) {
  v.field("precision", c.precision);
  v.object("optimizer", [&](Visit& opt) {
    opt.field("type", c.optimizer);
    opt.field("params", c.hyper);
  });
  v.field("stage", c.stage);
  v.object("offload", [&](Visit& off) {
    off.field("tier", c.offload);
    option_keys(c.options.nvme, off);
  });
  option_keys(c.options, v);
}

// Reads one JSON object into the members config_keys names; `source` starts
// every message ("zero config", "zero config file 'run.json'"), `path` is the
// object's key path ("" at the top, "offload").
class ConfigReader {
 public:
  ConfigReader(const nlohmann::json& object, std::string source, std::string path)
      : json_(object), source_(std::move(source)), path_(std::move(path)) {}

  template <class T>
  void field(const char* key, T& value) {
    if (const nlohmann::json* v = take(key)) read(*v, key_path(key), value);
  }

  template <class Body>
  void object(const char* key, Body&& body) {
    const nlohmann::json* v = take(key);
    if (v == nullptr) return;
    if (!v->is_object()) wrong_type(key_path(key), "an object {...}", *v);
    ConfigReader inner(*v, source_, key_path(key));
    body(inner);
    inner.reject_unknown_keys();
  }

  // After every known key was visited: a key no visit took is an error.
  void reject_unknown_keys() const {
    for (const auto& item : json_.items()) {
      const std::string& key = item.key();
      bool known = false;
      for (const char* k : known_) known = known || key == k;
      if (known) continue;
      const std::string where = path_.empty() ? "the top-level keys are " : "the keys of '" + path_ + "' are ";
      throw InvalidArgument(concat(source_, ": unknown key '", key_path(key), "'", did_you_mean(key, known_), "; ",
                                   where, join_names(known_), " (docs/configuration.md)"));
    }
  }

 private:
  const nlohmann::json* take(const char* key) {
    known_.push_back(key);
    const auto it = json_.find(key);
    return it == json_.end() ? nullptr : &*it;
  }
  std::string key_path(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }

  [[noreturn]] void wrong_type(const std::string& path, const std::string& expected, const nlohmann::json& v) const {
    throw InvalidArgument(concat(source_, ": '", path, "' must be ", expected, ", not ", describe_json_value(v)));
  }

  void read(const nlohmann::json& v, const std::string& path, bool& out) const {
    if (!v.is_boolean()) wrong_type(path, "true or false", v);
    out = v.get<bool>();
  }
  void read(const nlohmann::json& v, const std::string& path, double& out) const {
    if (!v.is_number()) wrong_type(path, "a number", v);
    out = v.get<double>();
  }
  void read(const nlohmann::json& v, const std::string& path, std::string& out) const {
    if (!v.is_string()) wrong_type(path, "a string", v);
    out = v.get<std::string>();
  }
  // Integers; a number with an integral value too, since 5e8 is how one
  // writes half a gigabyte (and how DeepSpeed files write bucket sizes).
  template <std::integral T>
    requires(!std::same_as<T, bool>)
  void read(const nlohmann::json& v, const std::string& path, T& out) const {
    using limits = std::numeric_limits<T>;
    const std::string expected =
        std::is_signed_v<T> ? concat("an integer in [", limits::min(), ", ", limits::max(), "]")
                            : concat("a non-negative integer (at most ", limits::max(), ")");
    if (v.is_number_unsigned()) {
      const auto u = v.get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(limits::max())) wrong_type(path, expected, v);
      out = static_cast<T>(u);
    } else if (v.is_number_integer()) {
      const auto i = v.get<std::int64_t>();
      if (!std::is_signed_v<T> || i < static_cast<std::int64_t>(limits::min())) wrong_type(path, expected, v);
      out = static_cast<T>(i);
    } else if (v.is_number_float()) {
      // [-2^digits, 2^digits): exactly the values of T that a double can hold or exceed.
      const double d = v.get<double>(), bound = std::ldexp(1.0, limits::digits);
      const double lowest = std::is_signed_v<T> ? -bound : 0.0;
      if (!(d == std::floor(d) && d >= lowest && d < bound)) wrong_type(path, expected, v);
      out = static_cast<T>(d);
    } else {
      wrong_type(path, expected, v);
    }
  }
  template <class E>
    requires std::is_enum_v<E>
  void read(const nlohmann::json& v, const std::string& path, E& out) const {
    const auto& values = all_values_of(E{});
    const auto parsed = v.is_string() ? parse_by_name(v.get_ref<const std::string&>(), values) : std::nullopt;
    if (!parsed) wrong_type(path, concat("one of the strings ", names_of(values)), v);
    out = *parsed;
  }
  // optimizer.params: numbers, and true/false for a flag (kept as 1/0).
  void read(const nlohmann::json& v, const std::string& path, std::map<std::string, double>& out) const {
    if (!v.is_object()) wrong_type(path, "an object of hyper-parameters {\"lr\": 0.001, ...}", v);
    out.clear();
    for (const auto& item : v.items()) {
      const auto& value = item.value();
      if (value.is_boolean()) {
        out[item.key()] = value.get<bool>() ? 1.0 : 0.0;
      } else if (value.is_number()) {
        out[item.key()] = value.get<double>();
      } else {
        wrong_type(path + "." + item.key(), "a number (or true/false for a flag)", value);
      }
    }
  }

  const nlohmann::json& json_;
  std::string source_, path_;
  std::vector<const char*> known_;
};

// Writes the members config_keys names into a JSON object.
class ConfigWriter {
 public:
  explicit ConfigWriter(nlohmann::json& object) : json_(object) {}

  template <class T>
  void field(const char* key, const T& value) {
    if constexpr (std::is_enum_v<T>) json_[key] = name(value);
    else json_[key] = value;
  }
  template <class Body>
  void object(const char* key, Body&& body) {
    nlohmann::json inner = nlohmann::json::object();
    ConfigWriter writer(inner);
    body(writer);
    json_[key] = std::move(inner);
  }

 private:
  nlohmann::json& json_;
};

// Sets each key of `j` in `config`; `source` starts every message.
inline void read_config(const nlohmann::json& j, const std::string& source, Config& config) {
  if (!j.is_object())
    throw InvalidArgument(concat(source, ": a configuration is a JSON object ({\"stage\": 2, ...}), not ",
                                 describe_json_value(j)));
  ConfigReader reader(j, source, "");
  config_keys(config, reader);
  reader.reject_unknown_keys();
}

}  // namespace detail

// The Config a JSON object describes: Config's defaults, with each key the
// object has set. Checks the keys and their types (InvalidArgument naming
// the key); the combination (offload against stage, the backend) is checked
// by Config::validate once everything that sets the Config (say, a command
// line after the file) has had its say: zero::make_optimizer calls it.
inline Config config_from_json(const nlohmann::json& j) {
  Config config;
  detail::read_config(j, "zero config", config);
  return config;
}

// The settings of the JSON file at `path` over those `config` holds (a key
// the file does not have keeps its value; optimizer.params replaces all the
// hyper-parameters). Every error is an InvalidArgument naming the path: a
// file that cannot be read, JSON syntax (with the line, the column and the
// byte), a number beyond a double's range (with its key), a key given twice,
// and config_from_json's; `config` is then unchanged.
inline void load_config_into(Config& config, const std::string& path) {
  const std::string source = "zero config file '" + path + "'";
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw InvalidArgument(source + " is a directory; name a JSON file (docs/configuration.md has an example)");
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw InvalidArgument(detail::concat(source, " cannot be opened (", std::strerror(errno), "); check the path"));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw InvalidArgument(detail::concat(source, " cannot be read (", std::strerror(errno), ")"));
  detail::ParsedJson parsed;
  std::string key_at_error;
  try {
    parsed = detail::parse_json_noting_duplicates(text, &key_at_error);
  } catch (const nlohmann::json::parse_error& e) {
    // nlohmann's message without its "[json.exception.parse_error.101] parse error at ...: " preamble.
    std::string problem = e.what();
    if (const auto colon = problem.find(": "); problem.rfind("[json.exception", 0) == 0 && colon != std::string::npos)
      problem = problem.substr(colon + 2);
    const auto at = detail::text_position(text, e.byte);
    throw InvalidArgument(detail::concat(source, " is not valid JSON: line ", at.line, ", column ", at.column,
                                         " (byte ", e.byte, "): ", problem));
  } catch (const nlohmann::json::out_of_range& e) {
    // The one out_of_range nlohmann's parser throws: "[json.exception.out_of_range.406] number overflow parsing
    // '1e400'", a number no double holds (it would read as infinity).
    const std::string message = e.what();
    const auto quote = message.find('\'');
    const std::string number =
        quote == std::string::npos ? message : message.substr(quote + 1, message.rfind('\'') - quote - 1);
    const std::string whose = key_at_error.empty() ? "the top-level value" : "'" + key_at_error + "'";
    throw InvalidArgument(detail::concat(source, ": ", whose, " must be a number a double holds (of at most about "
                                         "1.8e308 in magnitude), not ", number, "; each key's bounds are in "
                                         "docs/configuration.md"));
  }
  if (!parsed.duplicate_key.empty())
    throw InvalidArgument(detail::concat(source, ": the key '", parsed.duplicate_path,
                                 "' is given twice; keep one (JSON readers differ on which one counts)"));
  Config updated = config;
  detail::read_config(parsed.value, source, updated);
  config = std::move(updated);
}

// config_from_json of the file at `path` (load_config_into a default Config).
inline Config load_config(const std::string& path) {
  Config config;
  load_config_into(config, path);
  return config;
}

// Every setting of `config`, defaults included, under the keys
// config_from_json reads: config_from_json(to_json(c)) == c.
inline nlohmann::json to_json(const Config& config) {
  nlohmann::json j = nlohmann::json::object();
  detail::ConfigWriter writer(j);
  detail::config_keys(config, writer);
  return j;
}

}  // namespace zero
