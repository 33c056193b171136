// Why: safetensors is what every framework reads, so both the rank files of a
// checkpoint and the Hugging Face export use it. The writer streams (tensors
// are declared up front, their bytes follow in order through a bounded
// buffer), so no file needs the whole model in memory. The reader is strict:
// a header that lies about sizes or offsets, overlaps, leaves holes or points
// past the end is an error naming the file, the tensor and the problem
// before a single data byte is used, whatever the bytes are (it is fuzzed).
//
// The layout (docs/checkpoint-format.md): 8-byte little-endian header length
// N; N bytes of JSON, padded with spaces so the data starts at a multiple of
// 8; then the data region, which the tensors' data_offsets (relative to its
// start) cover exactly, without holes or overlaps, as every safetensors
// reader requires. The writer lays tensors out in the declared order and
// requires each to start at a multiple of its element size (declare 8- and
// 4-byte types before 2-byte ones), so every tensor is aligned to its type.
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "zero/checkpoint/files.hpp"
#include "zero/error.hpp"
#include "zero/json_parse.hpp"
#include "zero/precision/types.hpp"

namespace zero::checkpoint {

// The element types a safetensors header may declare, spelled as it spells
// them: what a file holds, I64 included (Hugging Face files keep integer
// buffers such as position_ids, which the reader must parse past). Values
// the library reads or writes are typed zero::DType everywhere (slots,
// exports, reads); a TensorType compares equal to the DType it stores
// (TensorType::BF16 == DType::bf16), and tensor_type_of/storage_type_of
// convert.
enum class TensorType : std::uint8_t { F32, F16, BF16, I64 };

inline constexpr const char* tensor_type_name(TensorType t) {
  switch (t) {
    case TensorType::F32: return "F32";
    case TensorType::F16: return "F16";
    case TensorType::BF16: return "BF16";
    case TensorType::I64: return "I64";
  }
  return "?";
}
inline constexpr std::size_t tensor_type_bytes(TensorType t) {
  switch (t) {
    case TensorType::F32: return 4;
    case TensorType::F16:
    case TensorType::BF16: return 2;
    case TensorType::I64: return 8;
  }
  return 0;
}
inline std::optional<TensorType> parse_tensor_type(std::string_view s) {
  for (TensorType t : {TensorType::F32, TensorType::F16, TensorType::BF16, TensorType::I64})
    if (s == tensor_type_name(t)) return t;
  return std::nullopt;
}
// The file type of a storage type of the library (fp32, fp16, bf16).
inline TensorType tensor_type_of(DType t) {
  switch (t) {
    case DType::f32: return TensorType::F32;
    case DType::f16: return TensorType::F16;
    case DType::bf16: return TensorType::BF16;
    default: break;
  }
  throw InvalidArgument(zero::detail::concat("safetensors: element type ", dtype_name(t),
                                             " is not stored in checkpoints (fp32, fp16 or bf16)"));
}
inline DType storage_type_of(TensorType t) {
  switch (t) {
    case TensorType::F32: return DType::f32;
    case TensorType::F16: return DType::f16;
    case TensorType::BF16: return DType::bf16;
    case TensorType::I64: break;
  }
  throw InvalidArgument("safetensors: I64 tensors hold no floating-point state");
}

// The floating-point storage types, the ones files hold values of.
inline constexpr bool is_stored_type(DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16; }

inline constexpr bool operator==(TensorType a, DType b) {
  switch (a) {
    case TensorType::F32: return b == DType::f32;
    case TensorType::F16: return b == DType::f16;
    case TensorType::BF16: return b == DType::bf16;
    case TensorType::I64: return false;
  }
  return false;
}

// A tensor as declared to the writer.
struct TensorSpec {
  std::string name;
  TensorType dtype = TensorType::F32;
  std::vector<std::uint64_t> shape;

  // Elements and bytes; nullopt when the product does not fit in 64 bits.
  std::optional<std::uint64_t> checked_numel() const {
    std::uint64_t n = 1;
    for (std::uint64_t d : shape)
      if (__builtin_mul_overflow(n, d, &n)) return std::nullopt;
    return n;
  }
  std::optional<std::uint64_t> checked_bytes() const {
    auto n = checked_numel();
    std::uint64_t b = 0;
    if (!n || __builtin_mul_overflow(*n, std::uint64_t{tensor_type_bytes(dtype)}, &b)) return std::nullopt;
    return b;
  }
  std::uint64_t numel() const { return checked_numel().value(); }
  std::uint64_t bytes() const { return checked_bytes().value(); }
};

// A tensor of a file: its spec and its bytes [begin, end) of the data region.
struct TensorEntry : TensorSpec {
  std::uint64_t begin = 0, end = 0;
};

struct SafetensorsHeader {
  std::vector<TensorEntry> tensors;  // in the order of their data
  std::map<std::string, std::string> metadata;
  std::uint64_t data_start = 0;  // 8 + header length: where offset 0 of data_offsets is

  const TensorEntry* find(std::string_view name) const {
    for (const auto& t : tensors)
      if (t.name == name) return &t;
    return nullptr;
  }
};

// The largest header the reader accepts (the reference implementation's limit).
inline constexpr std::uint64_t max_safetensors_header_bytes = 100'000'000;

namespace detail {

// A header with two entries for one name (or two data_offsets) is a lie:
// nlohmann would keep the last silently (zero/json_parse.hpp catches it). A
// number beyond a double's range names its key (nlohmann's error does not).
inline nlohmann::json parse_json_strict(std::string_view text, const std::filesystem::path& file, std::string_view what) {
  zero::detail::ParsedJson parsed;
  std::string key_at_error;
  try {
    parsed = zero::detail::parse_json_noting_duplicates(text, &key_at_error);
  } catch (const nlohmann::json::out_of_range& e) {
    fail(file, what, ": ", key_at_error.empty() ? std::string("the top-level value") : "field '" + key_at_error + "'",
         " holds a number no double holds (", e.what(), "); zero writes no such file (was it edited?)");
  } catch (const nlohmann::json::exception& e) {
    fail(file, what, " is not valid JSON (", e.what(), ")");
  }
  if (!parsed.duplicate_key.empty()) fail(file, what, " has the key \"", parsed.duplicate_key, "\" twice");
  return std::move(parsed.value);
}

inline std::uint64_t le64(const unsigned char* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// A JSON array of unsigned integers, or an error naming `what`.
inline std::vector<std::uint64_t> unsigned_array(const nlohmann::json& j, const std::filesystem::path& file,
                                                 std::string_view what) {
  if (!j.is_array()) fail(file, what, " must be an array of non-negative integers, not ", j.type_name());
  std::vector<std::uint64_t> out;
  out.reserve(j.size());
  for (const auto& v : j) {
    if (!v.is_number_unsigned()) fail(file, what, " must hold non-negative integers; it holds ", v.dump());
    out.push_back(v.get<std::uint64_t>());
  }
  return out;
}

}  // namespace detail

// The header length from the first 8 bytes, checked against the file size.
inline std::uint64_t safetensors_header_length(const unsigned char* first8, std::uint64_t file_size,
                                               const std::filesystem::path& file) {
  if (file_size < 8) fail(file, "truncated: ", file_size, " bytes, shorter than the 8-byte safetensors header length");
  const std::uint64_t n = detail::le64(first8);
  if (n == 0) fail(file, "the safetensors header length is 0 (not a safetensors file?)");
  if (n > max_safetensors_header_bytes)
    fail(file, "the safetensors header length ", n, " exceeds the ", max_safetensors_header_bytes,
         "-byte limit (not a safetensors file, or a corrupt one)");
  if (n > file_size - 8) fail(file, "truncated: the header claims ", n, " bytes but the file has ", file_size, " bytes");
  return n;
}

// Parses and validates a header: `json_text` is the N header bytes of a file
// of `file_size` bytes. Every tensor's dtype is known, its shape's product
// times its element size equals its byte length, its offsets lie inside the
// data region, and the tensors tile the data region exactly.
inline SafetensorsHeader parse_safetensors_header(std::string_view json_text, std::uint64_t file_size,
                                                  const std::filesystem::path& file) {
  SafetensorsHeader h;
  h.data_start = 8 + json_text.size();
  if (h.data_start > file_size) fail(file, "truncated: the header ends past the end of the file");
  const std::uint64_t data_bytes = file_size - h.data_start;
  const nlohmann::json j = detail::parse_json_strict(json_text, file, "the safetensors header");
  if (!j.is_object()) fail(file, "the safetensors header must be a JSON object, not ", j.type_name());
  for (const auto& [name, entry] : j.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) fail(file, "__metadata__ must be an object of strings, not ", entry.type_name());
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) fail(file, "__metadata__[\"", k, "\"] must be a string, not ", v.type_name());
        h.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string what = "tensor '" + name + "'";
    if (!entry.is_object()) fail(file, what, ": the entry must be an object, not ", entry.type_name());
    for (const auto& [k, v] : entry.items())
      if (k != "dtype" && k != "shape" && k != "data_offsets") fail(file, what, ": unknown field \"", k, "\"");
    if (!entry.contains("dtype") || !entry["dtype"].is_string())
      fail(file, what, ": \"dtype\" is missing or not a string");
    TensorEntry t;
    t.name = name;
    const auto type = parse_tensor_type(entry["dtype"].get_ref<const std::string&>());
    if (!type) fail(file, what, ": dtype \"", entry["dtype"].get<std::string>(), "\" is not one of F32, F16, BF16, I64");
    t.dtype = *type;
    if (!entry.contains("shape")) fail(file, what, ": \"shape\" is missing");
    t.shape = detail::unsigned_array(entry["shape"], file, what + ": \"shape\"");
    if (!entry.contains("data_offsets")) fail(file, what, ": \"data_offsets\" is missing");
    const auto off = detail::unsigned_array(entry["data_offsets"], file, what + ": \"data_offsets\"");
    if (off.size() != 2) fail(file, what, ": \"data_offsets\" must be [begin, end], it has ", off.size(), " values");
    t.begin = off[0];
    t.end = off[1];
    if (t.end < t.begin) fail(file, what, ": data_offsets [", t.begin, ", ", t.end, "] end before they begin");
    const auto bytes = t.checked_bytes();
    if (!bytes) fail(file, what, ": the shape's size in bytes does not fit in 64 bits");
    if (*bytes != t.end - t.begin)
      fail(file, what, ": shape ", entry["shape"].dump(), " of ", tensor_type_name(t.dtype), " is ", *bytes,
           " bytes but data_offsets [", t.begin, ", ", t.end, "] span ", t.end - t.begin);
    if (t.end > data_bytes)
      fail(file, "truncated: ", what, " ends at data byte ", t.end, " but the file holds ", data_bytes,
           " bytes of data");
    h.tensors.push_back(std::move(t));
  }
  std::sort(h.tensors.begin(), h.tensors.end(),
            [](const TensorEntry& a, const TensorEntry& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  std::uint64_t cursor = 0;
  const TensorEntry* previous = nullptr;
  for (const auto& t : h.tensors) {
    if (t.begin < cursor)
      fail(file, "tensor '", t.name, "' (bytes [", t.begin, ", ", t.end, ")) overlaps tensor '", previous->name,
           "' (bytes [", previous->begin, ", ", previous->end, "))");
    if (t.begin > cursor)
      fail(file, "a hole of ", t.begin - cursor, " bytes lies before tensor '", t.name, "' (data bytes [", cursor,
           ", ", t.begin, ") belong to no tensor)");
    cursor = t.end;
    previous = &t;
  }
  if (cursor != data_bytes)
    fail(file, "the tensors cover ", cursor, " bytes of data but the file holds ", data_bytes,
         " (trailing bytes after the last tensor)");
  return h;
}

// Parses a whole file held in memory (the fuzzer's entry point).
inline SafetensorsHeader parse_safetensors_bytes(std::string_view file_bytes, const std::filesystem::path& file) {
  const auto* p = reinterpret_cast<const unsigned char*>(file_bytes.data());
  const std::uint64_t n = safetensors_header_length(p, file_bytes.size(), file);
  return parse_safetensors_header(file_bytes.substr(8, static_cast<std::size_t>(n)), file_bytes.size(), file);
}

// A safetensors file opened for reading ranges of its tensors (pread).
class SafetensorsReader {
 public:
  explicit SafetensorsReader(std::filesystem::path path) : file_(std::move(path)) {
    unsigned char first8[8] = {};
    if (file_.size() >= 8) file_.read_at(0, 8, first8, "the header length");
    const std::uint64_t n = safetensors_header_length(first8, file_.size(), file_.path());
    std::string text(static_cast<std::size_t>(n), '\0');
    file_.read_at(8, n, text.data(), "the header");
    header_ = parse_safetensors_header(text, file_.size(), file_.path());
  }

  const std::filesystem::path& path() const { return file_.path(); }
  const SafetensorsHeader& header() const { return header_; }
  const std::vector<TensorEntry>& tensors() const { return header_.tensors; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }

  const TensorEntry& at(std::string_view name) const {
    const TensorEntry* t = header_.find(name);
    if (!t) fail(path(), "has no tensor named '", name, "'");
    return *t;
  }

  // Bytes [byte_offset, byte_offset + bytes) of tensor t into dst.
  void read(const TensorEntry& t, std::uint64_t byte_offset, std::uint64_t bytes, void* dst) const {
    if (byte_offset > t.end - t.begin || bytes > t.end - t.begin - byte_offset)
      fail(path(), "read of bytes [", byte_offset, ", ", byte_offset + bytes, ") of tensor '", t.name, "', which has ",
           t.end - t.begin, " bytes");
    file_.read_at(header_.data_start + t.begin + byte_offset, bytes, dst, "tensor '" + t.name + "'");
  }

 private:
  ReadFile file_;
  SafetensorsHeader header_;
};

// Streams a safetensors file: the tensors are declared up front, then their
// bytes are written in declaration order, in pieces of any size; commit()
// checks that every byte arrived and makes the file appear atomically.
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::filesystem::path path, const std::vector<TensorSpec>& tensors,
                    const std::map<std::string, std::string>& metadata = {},
                    std::size_t buffer_bytes = AtomicFile::default_buffer_bytes)
      : file_(std::move(path), buffer_bytes) {
    nlohmann::ordered_json j = nlohmann::ordered_json::object();
    if (!metadata.empty()) j["__metadata__"] = metadata;
    std::uint64_t offset = 0;
    std::set<std::string_view> names;
    for (const TensorSpec& s : tensors) {
      require(!s.name.empty() && s.name != "__metadata__", file_.path().string(), ": tensor name '", s.name,
              "' is empty or reserved");
      require(names.insert(s.name).second, file_.path().string(), ": tensor '", s.name, "' is declared twice");
      const auto bytes = s.checked_bytes();
      require(bytes.has_value(), file_.path().string(), ": tensor '", s.name, "' has more bytes than fit in 64 bits");
      require(offset % tensor_type_bytes(s.dtype) == 0, file_.path().string(), ": tensor '", s.name, "' (",
              tensor_type_name(s.dtype), ") would start at data byte ", offset,
              ", not a multiple of its element size; declare tensors of larger elements first");
      TensorEntry e;
      static_cast<TensorSpec&>(e) = s;
      e.begin = offset;
      e.end = offset + *bytes;
      offset = e.end;
      j[s.name] = {{"dtype", tensor_type_name(s.dtype)}, {"shape", s.shape}, {"data_offsets", {e.begin, e.end}}};
      header_.tensors.push_back(std::move(e));
    }
    header_.metadata = metadata;
    std::string text = j.dump();
    text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
    header_.data_start = 8 + text.size();
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(static_cast<std::uint64_t>(text.size()) >> (8 * i));
    file_.write(len, 8);
    file_.write(text);
    data_bytes_ = offset;
  }

  const SafetensorsHeader& header() const { return header_; }
  const std::filesystem::path& path() const { return file_.path(); }
  // Bytes of the data region still to write.
  std::uint64_t remaining() const { return data_bytes_ - written_; }

  void write(const void* data, std::size_t bytes) {
    require(bytes <= remaining(), path().string(), ": ", bytes, " bytes written past the declared tensors (",
            remaining(), " left)");
    file_.write(data, bytes);
    written_ += bytes;
  }

  void commit() {
    require(remaining() == 0, path().string(), ": commit() with ", remaining(), " bytes of tensor data unwritten");
    file_.commit();
  }

 private:
  AtomicFile file_;
  SafetensorsHeader header_;
  std::uint64_t data_bytes_ = 0, written_ = 0;
};

}  // namespace zero::checkpoint
