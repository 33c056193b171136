// Why: the manifest is what makes a checkpoint exist. Written last, by rank 0,
// after every rank's file is durable, it records everything a resume needs
// besides the tensors (step counter, loss scaler, rounding seed, optimizer and
// its hyper-parameters) and where every element of every state slot lies: in
// coordinates no rank count changes (unit, element range of the unit's
// unpadded data), so any number of ranks at any stage finds its bytes. Its
// parser is strict and fuzzed: an unknown version, a missing field, a wrong
// type, a state format this library does not write or ranges that overlap or
// leave holes are errors naming the field.
#pragma once

#include "zero/compiler.hpp"

#include "zero/xxhash.hpp"  // (xxHash compiled in, header only)

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "zero/checkpoint/safetensors.hpp"
#include "zero/error.hpp"
#include "zero/json_parse.hpp"
#include "zero/precision/types.hpp"
#include "zero/runtime/config.hpp"
#include "zero/shape.hpp"

namespace zero::checkpoint {

inline constexpr const char* manifest_format_name = "zero-checkpoint";
inline constexpr std::uint64_t manifest_format_version = 1;
inline constexpr const char* manifest_file_name = "manifest.json";
inline constexpr const char* checksum_algorithm = "xxh3_64";
// Checksums cover fixed chunks of each tensor's bytes, so a rank that reads
// part of a tensor verifies what it reads (at most one chunk more at each
// end) without reading the whole tensor.
inline constexpr std::uint64_t default_checksum_chunk_bytes = std::uint64_t{1} << 20;

// A parameter inside its unit: elements [offset, offset + numel) of the
// unit's unpadded data; shape empty means flat.
struct ParamDesc {
  std::string name;
  std::uint64_t offset = 0;
  std::uint64_t numel = 0;
  Shape shape;
  friend bool operator==(const ParamDesc&, const ParamDesc&) = default;
};

// A unit: its unpadded data is `numel` elements (parameters and the
// alignment gaps between them, no padding for sharding).
struct UnitDesc {
  std::string name;
  std::uint64_t numel = 0;
  std::vector<ParamDesc> params;
  friend bool operator==(const UnitDesc&, const UnitDesc&) = default;
};

// A state slot: one value per element of every unit ("master", "exp_avg",
// "exp_avg_sq", "momentum", "param"; "state<k>" for an optimizer without
// state_names). A slot that is not `required` may be
// absent from a checkpoint (the 16-bit "param" copy when resuming a run saved
// in fp32: the caller derives it from the master).
struct SlotDesc {
  std::string name;
  DType dtype = DType::f32;
  bool required = true;
  // Another name a checkpoint may give the slot, loaded when `name` is not
  // there: "state0" for "exp_avg" (what checkpoints said before slots were
  // named after the optimizer's state).
  std::string saved_as = {};
};

struct LossScalerState {
  double scale = 1.0;
  std::uint64_t growth_counter = 0;   // overflow-free steps since the scale last changed
  std::uint64_t hysteresis_left = 0;  // overflows still tolerated before the scale drops
  friend bool operator==(const LossScalerState&, const LossScalerState&) = default;
};

// Everything besides the tensors that a resume restores or checks.
struct RunState {
  std::uint64_t world_size = 1;
  std::uint64_t stage = 0;
  std::string precision;             // e.g. "bf16", "fp16", "fp32"
  std::string optimizer;             // e.g. "adamw": loading into another optimizer is an error
  nlohmann::json hyper = nlohmann::json::object();  // the optimizer's hyper-parameters, as the caller names them
  std::uint64_t step = 0;
  LossScalerState loss_scaler;
  std::optional<std::uint64_t> rounding_seed;  // stochastic rounding's seed, when it is on
  // How the saving run stored its optimizer state (Options::states, and for
  // blockwise8 its block and small-parameter size; 0 and 0 for the other
  // formats). The files hold fp32 values either way; a load into another
  // format converts (and says so). Empty in a manifest from before it was
  // recorded.
  std::string state_format;
  std::uint64_t state_block = 0, state_fp32_below = 0;
  nlohmann::json extra = nlohmann::json::object();  // the caller's own (epoch, data order, ...)
};

// One tensor of a rank file: elements [begin, begin + count) of `unit` in
// slot `slot` (indices into Manifest::units and Manifest::slots), and the
// XXH3-64 of each checksum chunk of its bytes.
struct TensorRecord {
  std::string name;
  std::size_t slot = 0;
  std::size_t unit = 0;
  std::uint64_t begin = 0, count = 0;
  std::vector<std::uint64_t> chunk_xxh3;
};

struct FileRecord {
  std::string name;  // relative to the checkpoint directory
  std::uint64_t rank = 0;
  std::uint64_t bytes = 0;  // the file's size
  std::vector<TensorRecord> tensors;
};

struct SavedSlot {
  std::string name;
  DType dtype = DType::f32;  // fp32, fp16 or bf16 (the header says "F32", "F16", "BF16")
};

struct Manifest {
  RunState run;
  std::uint64_t checksum_chunk_bytes = default_checksum_chunk_bytes;
  std::vector<SavedSlot> slots;
  std::vector<UnitDesc> units;
  std::vector<FileRecord> files;

  std::size_t slot_index(std::string_view name) const {
    for (std::size_t i = 0; i < slots.size(); ++i)
      if (slots[i].name == name) return i;
    return slots.size();
  }
};

// The XXH3-64 of each `chunk` bytes of data (the last chunk may be shorter).
inline std::vector<std::uint64_t> chunk_checksums(const void* data, std::uint64_t bytes, std::uint64_t chunk) {
  std::vector<std::uint64_t> out;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::uint64_t at = 0; at < bytes; at += chunk) out.push_back(XXH3_64bits(p + at, std::min(chunk, bytes - at)));
  return out;
}
// More elements than any unit can have (2^56): keeps byte counts in 64 bits.
inline constexpr std::uint64_t max_unit_elements = std::uint64_t{1} << 56;
inline std::uint64_t chunks_of(std::uint64_t bytes, std::uint64_t chunk) { return bytes / chunk + (bytes % chunk != 0); }

inline std::string hex64(std::uint64_t v) {
  char s[17];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(v));
  return s;
}

namespace detail {

// Typed access to the manifest's fields with errors naming the file and the
// field's path ("units[2].params[0].numel").
class ManifestFields {
 public:
  explicit ManifestFields(std::filesystem::path file) : file_(std::move(file)) {}

  const nlohmann::json& field(const nlohmann::json& obj, const std::string& where, const char* key) const {
    if (!obj.is_object()) fail(file_, "field '", where, "' must be an object, not ", obj.type_name());
    auto it = obj.find(key);
    if (it == obj.end()) fail(file_, "field '", join(where, key), "' is missing");
    return *it;
  }
  std::uint64_t u64(const nlohmann::json& obj, const std::string& where, const char* key) const {
    const auto& v = field(obj, where, key);
    if (!v.is_number_unsigned())
      fail(file_, "field '", join(where, key), "' must be a non-negative integer, not ", describe(v));
    return v.get<std::uint64_t>();
  }
  std::string str(const nlohmann::json& obj, const std::string& where, const char* key) const {
    const auto& v = field(obj, where, key);
    if (!v.is_string()) fail(file_, "field '", join(where, key), "' must be a string, not ", describe(v));
    return v.get<std::string>();
  }
  double number(const nlohmann::json& obj, const std::string& where, const char* key) const {
    const auto& v = field(obj, where, key);
    if (!v.is_number()) fail(file_, "field '", join(where, key), "' must be a number, not ", describe(v));
    return v.get<double>();
  }
  const nlohmann::json& object(const nlohmann::json& obj, const std::string& where, const char* key) const {
    const auto& v = field(obj, where, key);
    if (!v.is_object()) fail(file_, "field '", join(where, key), "' must be an object, not ", describe(v));
    return v;
  }
  const nlohmann::json& array(const nlohmann::json& obj, const std::string& where, const char* key) const {
    const auto& v = field(obj, where, key);
    if (!v.is_array()) fail(file_, "field '", join(where, key), "' must be an array, not ", describe(v));
    return v;
  }
  std::vector<std::uint64_t> u64_array(const nlohmann::json& obj, const std::string& where, const char* key) const {
    return unsigned_array(array(obj, where, key), file_, "field '" + join(where, key) + "'");
  }
  std::uint64_t hex(const nlohmann::json& v, const std::string& where) const {
    const bool ok = v.is_string() && v.get_ref<const std::string&>().size() == 16 &&
                    v.get_ref<const std::string&>().find_first_not_of("0123456789abcdef") == std::string::npos;
    if (!ok) fail(file_, "field '", where, "' must be 16 lower-case hexadecimal digits, not ", describe(v));
    return std::stoull(v.get<std::string>(), nullptr, 16);
  }
  static std::string join(const std::string& where, const std::string& key) {
    return where.empty() ? key : where + "." + key;
  }
  static std::string at(const std::string& where, std::size_t i) { return where + "[" + std::to_string(i) + "]"; }
  const std::filesystem::path& file() const { return file_; }

 private:
  static std::string describe(const nlohmann::json& v) { return zero::detail::describe_json_value(v); }
  std::filesystem::path file_;
};

// state_format as the saver writes it (optimizer_io.hpp): a name of
// Options::states and, for blockwise8, an Options::state_block and
// state_fp32_below (any size is one), 0 and 0 for the other formats. Anything
// else is a manifest this library did not write, whose word on how the state
// was kept cannot be trusted: refused, naming the field.
inline void read_state_format(const nlohmann::json& state_format, const ManifestFields& f, RunState& run) {
  const char* fix = "; zero writes no such manifest (was it edited?): correct the field, or remove 'state_format' "
                    "to read the state as fp32, which the files hold in every format";
  run.state_format = f.str(state_format, "state_format", "name");
  run.state_block = f.u64(state_format, "state_format", "block");
  run.state_fp32_below = f.u64(state_format, "state_format", "fp32_below");
  const std::optional<StateFormat> format = parse_state_format(run.state_format);
  if (!format)
    fail(f.file(), "field 'state_format.name' is \"", run.state_format, "\", not one of ",
         zero::detail::names_of(all_state_formats), fix);
  if (*format == StateFormat::blockwise8) {
    if (!allowed_state_block(run.state_block))
      fail(f.file(), "field 'state_format.block' is ", run.state_block, ", but blockwise8 blocks are ",
           state_block_rule, " elements (Options::state_block)", fix);
    return;
  }
  for (const auto& [key, value] : {std::pair{"block", run.state_block}, std::pair{"fp32_below", run.state_fp32_below}})
    if (value != 0)
      fail(f.file(), "field 'state_format.", key, "' is ", value, ", but ", run.state_format,
           " states have no blocks: the saver writes 0", fix);
}

}  // namespace detail

// Checks what the parser and the saver both rely on: names unique, parameters
// inside their units without overlapping, and, per slot, the files' tensors
// tiling every unit's [0, numel) exactly once with the right checksum counts.
inline void validate_manifest(const Manifest& m, const std::filesystem::path& file) {
  if (m.run.world_size < 1) fail(file, "world_size is 0");
  if (m.run.stage > 3) fail(file, "stage ", m.run.stage, " is not one of 0, 1, 2, 3");
  if (m.checksum_chunk_bytes == 0 || m.checksum_chunk_bytes % 8 != 0)
    fail(file, "checksum chunk_bytes ", m.checksum_chunk_bytes, " must be a positive multiple of 8");
  std::set<std::string_view> names;
  for (const auto& s : m.slots)
    if (!names.insert(s.name).second) fail(file, "slot '", s.name, "' is listed twice");
  names.clear();
  std::set<std::string_view> param_names;
  for (const auto& u : m.units) {
    if (!names.insert(u.name).second) fail(file, "unit '", u.name, "' is listed twice");
    if (u.numel > max_unit_elements) fail(file, "unit '", u.name, "' claims ", u.numel, " elements, more than any file can hold");
    std::uint64_t cursor = 0;
    for (const auto& p : u.params) {
      if (!param_names.insert(p.name).second) fail(file, "parameter '", p.name, "' is listed twice");
      if (p.offset < cursor || p.offset > u.numel || p.numel > u.numel - p.offset)
        fail(file, "parameter '", p.name, "' (elements [", p.offset, ", +", p.numel, ")) overlaps the one before it or",
             " leaves unit '", u.name, "' (", u.numel, " elements)");
      cursor = p.offset + p.numel;
      if (!p.shape.empty()) {
        const auto n = TensorSpec{p.name, TensorType::F32, p.shape}.checked_numel();
        if (n != p.numel)
          fail(file, "parameter '", p.name, "': its shape ", shape_text(p.shape), " does not hold its ", p.numel,
               " elements");
      }
    }
  }
  // Ranges per (slot, unit), then checked to tile each unit.
  std::vector<std::vector<std::vector<std::pair<std::uint64_t, std::uint64_t>>>> ranges(
      m.slots.size(), std::vector<std::vector<std::pair<std::uint64_t, std::uint64_t>>>(m.units.size()));
  std::set<std::uint64_t> ranks;
  std::set<std::string_view> file_names;
  for (const auto& f : m.files) {
    if (f.rank >= m.run.world_size) fail(file, "file '", f.name, "' was written by rank ", f.rank, " of ", m.run.world_size);
    if (!ranks.insert(f.rank).second) fail(file, "rank ", f.rank, " is listed with two files");
    if (!file_names.insert(f.name).second) fail(file, "file '", f.name, "' is listed twice");
    if (f.name.empty() || f.name.find('/') != std::string::npos || f.name == "." || f.name == "..")
      fail(file, "file name '", f.name, "' must be a plain file name inside the checkpoint directory");
    names.clear();
    for (const auto& t : f.tensors) {
      if (!names.insert(t.name).second) fail(file, "file '", f.name, "': tensor '", t.name, "' is listed twice");
      if (t.slot >= m.slots.size() || t.unit >= m.units.size())
        fail(file, "file '", f.name, "': tensor '", t.name, "' names slot ", t.slot, " or unit ", t.unit,
             ", which do not exist");
      const UnitDesc& u = m.units[t.unit];
      if (t.count == 0 || t.begin > u.numel || t.count > u.numel - t.begin)
        fail(file, "file '", f.name, "': tensor '", t.name, "' holds elements [", t.begin, ", +", t.count, ") of unit '",
             u.name, "', which has ", u.numel);
      const std::uint64_t bytes = t.count * dtype_bytes(m.slots[t.slot].dtype);  // count <= 2^56: no overflow
      if (t.chunk_xxh3.size() != chunks_of(bytes, m.checksum_chunk_bytes))
        fail(file, "file '", f.name, "': tensor '", t.name, "' has ", t.chunk_xxh3.size(), " checksums for ",
             chunks_of(bytes, m.checksum_chunk_bytes), " chunks");
      ranges[t.slot][t.unit].emplace_back(t.begin, t.begin + t.count);
    }
  }
  if (ranks.size() != m.run.world_size)
    fail(file, m.files.size(), " rank files are listed for world_size ", m.run.world_size);
  for (std::size_t s = 0; s < m.slots.size(); ++s)
    for (std::size_t u = 0; u < m.units.size(); ++u) {
      auto& r = ranges[s][u];
      std::sort(r.begin(), r.end());
      std::uint64_t cursor = 0;
      for (const auto& [b, e] : r) {
        if (b != cursor)
          fail(file, "slot '", m.slots[s].name, "' of unit '", m.units[u].name, "': ",
               b < cursor ? "two tensors overlap at element " : "no tensor holds elements from ", std::min(b, cursor),
               b < cursor ? "" : " on");
        cursor = e;
      }
      if (cursor != m.units[u].numel)
        fail(file, "slot '", m.slots[s].name, "' of unit '", m.units[u].name, "': elements [", cursor, ", ",
             m.units[u].numel, ") are in no file");
    }
}

// One entry of "files" (also what each rank leaves beside its file for rank 0).
inline nlohmann::json file_record_to_json(const FileRecord& f) {
  using nlohmann::json;
  json tensors = json::array();
  for (const auto& t : f.tensors) {
    json sums = json::array();
    for (auto h : t.chunk_xxh3) sums.push_back(hex64(h));
    tensors.push_back({{"name", t.name}, {"slot", t.slot}, {"unit", t.unit}, {"begin", t.begin}, {"count", t.count},
                       {"xxh3_64", std::move(sums)}});
  }
  return {{"name", f.name}, {"rank", f.rank}, {"bytes", f.bytes}, {"tensors", std::move(tensors)}};
}

inline FileRecord parse_file_record(const nlohmann::json& j, const std::string& w, const detail::ManifestFields& f) {
  using F = detail::ManifestFields;
  FileRecord fr;
  fr.name = f.str(j, w, "name");
  fr.rank = f.u64(j, w, "rank");
  fr.bytes = f.u64(j, w, "bytes");
  const auto& tensors = f.array(j, w, "tensors");
  for (std::size_t k = 0; k < tensors.size(); ++k) {
    const std::string wt = F::at(F::join(w, "tensors"), k);
    TensorRecord t;
    t.name = f.str(tensors[k], wt, "name");
    t.slot = static_cast<std::size_t>(f.u64(tensors[k], wt, "slot"));
    t.unit = static_cast<std::size_t>(f.u64(tensors[k], wt, "unit"));
    t.begin = f.u64(tensors[k], wt, "begin");
    t.count = f.u64(tensors[k], wt, "count");
    const auto& sums = f.array(tensors[k], wt, "xxh3_64");
    for (std::size_t c = 0; c < sums.size(); ++c) t.chunk_xxh3.push_back(f.hex(sums[c], F::at(wt + ".xxh3_64", c)));
    fr.tensors.push_back(std::move(t));
  }
  return fr;
}

inline nlohmann::json manifest_to_json(const Manifest& m) {
  using nlohmann::json;
  json j = json::object();
  j["format"] = manifest_format_name;
  j["format_version"] = manifest_format_version;
  j["world_size"] = m.run.world_size;
  j["stage"] = m.run.stage;
  j["precision"] = m.run.precision;
  j["optimizer"] = {{"name", m.run.optimizer}, {"hyper", m.run.hyper}};
  j["step"] = m.run.step;
  j["loss_scaler"] = {{"scale", m.run.loss_scaler.scale},
                      {"growth_counter", m.run.loss_scaler.growth_counter},
                      {"hysteresis_left", m.run.loss_scaler.hysteresis_left}};
  j["rounding_seed"] = m.run.rounding_seed ? json(*m.run.rounding_seed) : json(nullptr);
  if (!m.run.state_format.empty())
    j["state_format"] = {{"name", m.run.state_format},
                         {"block", m.run.state_block},
                         {"fp32_below", m.run.state_fp32_below}};
  j["extra"] = m.run.extra;
  j["checksum"] = {{"algorithm", checksum_algorithm}, {"chunk_bytes", m.checksum_chunk_bytes}};
  json slots = json::array();
  for (const auto& s : m.slots) slots.push_back({{"name", s.name}, {"dtype", tensor_type_name(tensor_type_of(s.dtype))}});
  j["slots"] = slots;
  json units = json::array();
  for (const auto& u : m.units) {
    json params = json::array();
    for (const auto& p : u.params) {
      json jp = {{"name", p.name}, {"offset", p.offset}, {"numel", p.numel}};
      if (!p.shape.empty()) jp["shape"] = p.shape;
      params.push_back(std::move(jp));
    }
    units.push_back({{"name", u.name}, {"numel", u.numel}, {"params", std::move(params)}});
  }
  j["units"] = units;
  json files = json::array();
  for (const auto& f : m.files) files.push_back(file_record_to_json(f));
  j["files"] = files;
  return j;
}

// Parses and validates manifest text; `file` names it in errors.
inline Manifest parse_manifest(std::string_view text, const std::filesystem::path& file) {
  const nlohmann::json j = detail::parse_json_strict(text, file, "the manifest");
  const detail::ManifestFields f(file);
  using F = detail::ManifestFields;
  if (!j.is_object()) fail(file, "the manifest must be a JSON object, not ", j.type_name());
  if (f.str(j, "", "format") != manifest_format_name)
    fail(file, "field 'format' is \"", f.str(j, "", "format"), "\", not \"", manifest_format_name,
         "\": not a zero checkpoint manifest");
  const std::uint64_t version = f.u64(j, "", "format_version");
  if (version != manifest_format_version)
    fail(file, "format version ", version, " is not supported: this build reads version ", manifest_format_version,
         version > manifest_format_version ? " (saved by a newer zero: upgrade to load it)" : "");
  Manifest m;
  m.run.world_size = f.u64(j, "", "world_size");
  m.run.stage = f.u64(j, "", "stage");
  m.run.precision = f.str(j, "", "precision");
  const auto& opt = f.object(j, "", "optimizer");
  m.run.optimizer = f.str(opt, "optimizer", "name");
  m.run.hyper = f.object(opt, "optimizer", "hyper");
  m.run.step = f.u64(j, "", "step");
  const auto& ls = f.object(j, "", "loss_scaler");
  m.run.loss_scaler.scale = f.number(ls, "loss_scaler", "scale");
  m.run.loss_scaler.growth_counter = f.u64(ls, "loss_scaler", "growth_counter");
  m.run.loss_scaler.hysteresis_left = f.u64(ls, "loss_scaler", "hysteresis_left");
  if (!f.field(j, "", "rounding_seed").is_null()) m.run.rounding_seed = f.u64(j, "", "rounding_seed");
  if (j.contains("state_format")) detail::read_state_format(f.object(j, "", "state_format"), f, m.run);
  m.run.extra = f.object(j, "", "extra");
  const auto& cs = f.object(j, "", "checksum");
  if (f.str(cs, "checksum", "algorithm") != checksum_algorithm)
    fail(file, "checksum algorithm \"", f.str(cs, "checksum", "algorithm"), "\" is not supported (", checksum_algorithm,
         ")");
  m.checksum_chunk_bytes = f.u64(cs, "checksum", "chunk_bytes");
  const auto& slots = f.array(j, "", "slots");
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const std::string w = F::at("slots", i);
    SavedSlot s;
    s.name = f.str(slots[i], w, "name");
    const std::string type = f.str(slots[i], w, "dtype");
    const auto t = parse_tensor_type(type);
    if (!t || *t == TensorType::I64) fail(file, "field '", w, ".dtype' is \"", type, "\", not one of F32, F16, BF16");
    s.dtype = storage_type_of(*t);
    m.slots.push_back(std::move(s));
  }
  const auto& units = f.array(j, "", "units");
  for (std::size_t i = 0; i < units.size(); ++i) {
    const std::string w = F::at("units", i);
    UnitDesc u;
    u.name = f.str(units[i], w, "name");
    u.numel = f.u64(units[i], w, "numel");
    const auto& params = f.array(units[i], w, "params");
    for (std::size_t k = 0; k < params.size(); ++k) {
      const std::string wp = F::at(w + ".params", k);
      ParamDesc p;
      p.name = f.str(params[k], wp, "name");
      p.offset = f.u64(params[k], wp, "offset");
      p.numel = f.u64(params[k], wp, "numel");
      if (params[k].contains("shape")) p.shape = f.u64_array(params[k], wp, "shape");
      u.params.push_back(std::move(p));
    }
    m.units.push_back(std::move(u));
  }
  const auto& files = f.array(j, "", "files");
  for (std::size_t i = 0; i < files.size(); ++i) m.files.push_back(parse_file_record(files[i], F::at("files", i), f));
  validate_manifest(m, file);
  return m;
}

}  // namespace zero::checkpoint
