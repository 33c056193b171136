// Why: the trained model has to leave the library in the format everyone
// loads (transformers, safetensors, candle), and come back in from it,
// without the whole model in memory: DeepSpeed's zero_to_fp32 needing more
// RAM than the checkpoint is what users complain about. Export streams one
// tensor at a time through one bounded buffer into shard files of at most
// max_shard_bytes; import reads by name, range by range, with a clear error
// for a missing name or another shape.
//
// The file set: model-00001-of-0000K.safetensors ... plus
// model.safetensors.index.json {"metadata": {"total_size": bytes of tensor
// data}, "weight_map": {name: file}}, as transformers' save_pretrained
// writes it.
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "zero/checkpoint/checkpoint.hpp"
#include "zero/checkpoint/files.hpp"
#include "zero/checkpoint/safetensors.hpp"
#include "zero/error.hpp"
#include "zero/shape.hpp"

namespace zero::checkpoint {

inline constexpr const char* hf_index_file_name = "model.safetensors.index.json";

// A named tensor of the exported or imported model: fp32, fp16 or bf16. For
// import, `dtype` is the type the sink receives (the file's values are
// converted to it).
struct HfTensor {
  std::string name;
  std::vector<std::uint64_t> shape;
  DType dtype = DType::f32;
};

struct HfExportOptions {
  std::uint64_t max_shard_bytes = 5'000'000'000;  // transformers' "5GB"; a larger tensor gets a shard of its own
  std::size_t buffer_bytes = std::size_t{16} << 20;  // the one buffer every tensor streams through
};

struct HfExportResult {
  std::vector<std::string> files;
  std::uint64_t total_size = 0;  // bytes of tensor data
};

// fill(tensor, first, count, dst): write elements [first, first + count) of
// tensors[tensor], in its dtype, to dst.
using HfFill = std::function<void(std::size_t tensor, std::uint64_t first, std::uint64_t count, void* dst)>;
// sink(tensor, first, count, src): elements [first, first + count) of
// tensors[tensor], in the dtype asked for, from src.
using HfSink = std::function<void(std::size_t tensor, std::uint64_t first, std::uint64_t count, const void* src)>;

inline std::string hf_shard_name(std::size_t index, std::size_t count) {
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return name;
}

// Writes `tensors` as a sharded safetensors file set into `dir` (created if
// needed), the index last. Memory: one buffer of options.buffer_bytes.
inline HfExportResult hf_export(const std::filesystem::path& dir, const std::vector<HfTensor>& tensors,
                                const HfFill& fill, const HfExportOptions& options = {}) {
  require(options.max_shard_bytes > 0, "hf_export: max_shard_bytes must be positive");
  require(options.buffer_bytes >= 8, "hf_export: buffer_bytes must be at least 8");
  std::vector<std::vector<std::size_t>> shards;
  std::uint64_t shard_bytes = 0;
  HfExportResult result;
  std::set<std::string_view> names;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const HfTensor& t = tensors[i];
    require(names.insert(t.name).second, "hf_export: two tensors are named '", t.name, "'");
    require(is_stored_type(t.dtype), "hf_export: tensor '", t.name, "' is ", dtype_name(t.dtype),
            ": export fp32, fp16 or bf16");
    const auto bytes = TensorSpec{t.name, tensor_type_of(t.dtype), t.shape}.checked_bytes();
    require(bytes.has_value(), "hf_export: tensor '", t.name, "' has more bytes than fit in 64 bits");
    if (shards.empty() || (shard_bytes > 0 && shard_bytes + *bytes > options.max_shard_bytes)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += *bytes;
    result.total_size += *bytes;
  }
  make_directories(dir, "the export directory");
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  std::vector<char> buffer(options.buffer_bytes);
  for (std::size_t s = 0; s < shards.size(); ++s) {
    // Larger elements first: every tensor starts aligned to its type.
    auto& order = shards[s];
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return dtype_bytes(tensors[a].dtype) > dtype_bytes(tensors[b].dtype);
    });
    const std::string name = hf_shard_name(s, shards.size());
    std::vector<TensorSpec> specs;
    for (std::size_t i : order) {
      specs.push_back({tensors[i].name, tensor_type_of(tensors[i].dtype), tensors[i].shape});
      weight_map[tensors[i].name] = name;
    }
    SafetensorsWriter out(dir / name, specs, {{"format", "pt"}}, 0);
    for (std::size_t k = 0; k < order.size(); ++k) {
      const std::size_t i = order[k];
      const std::uint64_t es = dtype_bytes(tensors[i].dtype);
      const std::uint64_t numel = specs[k].numel();
      const std::uint64_t per_piece = buffer.size() / es;
      for (std::uint64_t first = 0; first < numel; first += per_piece) {
        const std::uint64_t n = std::min(per_piece, numel - first);
        fill(i, first, n, buffer.data());
        out.write(buffer.data(), static_cast<std::size_t>(n * es));
      }
    }
    out.commit();
    result.files.push_back(name);
  }
  nlohmann::ordered_json index = {{"metadata", {{"total_size", result.total_size}}}, {"weight_map", weight_map}};
  write_file_atomically(dir / hf_index_file_name, index.dump(2) + "\n");
  return result;
}

// A Hugging Face safetensors file set opened by name: a .safetensors file,
// a model.safetensors.index.json, or a directory holding either.
class HfReader {
 public:
  explicit HfReader(const std::filesystem::path& path) {
    std::error_code ec;
    std::filesystem::path p = path;
    if (std::filesystem::is_directory(p, ec)) {
      if (std::filesystem::exists(p / hf_index_file_name, ec)) {
        p = p / hf_index_file_name;
      } else if (std::filesystem::exists(p / "model.safetensors", ec)) {
        p = p / "model.safetensors";
      } else {
        fail(path, "holds neither ", hf_index_file_name, " nor model.safetensors");
      }
    }
    origin_ = p;
    if (p.extension() == ".json") {
      const nlohmann::json j = detail::parse_json_strict(read_whole_file(p), p, "the index");
      if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
        fail(p, "has no \"weight_map\" object: not a safetensors index");
      for (const auto& [name, file] : j["weight_map"].items()) {
        if (!file.is_string()) fail(p, "weight_map[\"", name, "\"] must be a file name, not ", file.type_name());
        const std::string& f = file.get_ref<const std::string&>();
        if (f.empty() || f.find('/') != std::string::npos || f == "..")
          fail(p, "weight_map[\"", name, "\"] = \"", f, "\" is not a file name beside the index");
        where_[name] = open_file(p.parent_path() / f);
      }
      for (const auto& [name, file] : where_) files_[file].at(name);  // each named tensor is in its file
    } else {
      const std::size_t file = open_file(p);
      for (const auto& t : files_[file].tensors()) where_[t.name] = file;
    }
  }

  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [name, file] : where_) out.push_back(name);
    return out;
  }
  bool contains(std::string_view name) const { return where_.count(std::string(name)) != 0; }

  const SafetensorsReader& file_of(std::string_view name) const {
    auto it = where_.find(std::string(name));
    if (it == where_.end()) fail(origin_, "has no tensor named '", name, "'");
    return files_[it->second];
  }
  const TensorEntry& tensor(std::string_view name) const { return file_of(name).at(name); }

  // Elements [first, first + count) of `name`, converted to `to`.
  void read(std::string_view name, std::uint64_t first, std::uint64_t count, DType to, void* dst) const {
    const SafetensorsReader& f = file_of(name);
    const TensorEntry& t = f.at(name);
    require(t.dtype != TensorType::I64, f.path().string(), ": tensor '", name,
            "' is I64: only floating-point tensors are imported");
    require(is_stored_type(to), "HfReader::read of '", name, "' as ", dtype_name(to), ": read as fp32, fp16 or bf16");
    const std::uint64_t es = tensor_type_bytes(t.dtype);
    require(first <= t.numel() && count <= t.numel() - first, f.path().string(), ": elements [", first, ", +", count,
            ") of tensor '", name, "' which has ", t.numel());
    if (t.dtype == to) {
      f.read(t, first * es, count * es, dst);
      return;
    }
    scratch_.resize(static_cast<std::size_t>(count * es));
    f.read(t, first * es, count * es, scratch_.data());
    detail::convert_elements(scratch_.data(), storage_type_of(t.dtype), dst, to, count);
  }

  const std::filesystem::path& origin() const { return origin_; }

 private:
  std::size_t open_file(const std::filesystem::path& p) {
    for (std::size_t i = 0; i < files_.size(); ++i)
      if (files_[i].path() == p) return i;
    files_.emplace_back(p);
    return files_.size() - 1;
  }

  std::filesystem::path origin_;
  std::vector<SafetensorsReader> files_;
  std::map<std::string, std::size_t> where_;
  mutable std::vector<char> scratch_;
};

namespace detail {

// Every name of `tensors` is in `reader`, with its shape: otherwise an error
// naming the missing tensors, or the tensor, both shapes and the file.
inline void check_hf_tensors(const HfReader& reader, const std::vector<HfTensor>& tensors) {
  std::string missing;
  for (const HfTensor& t : tensors)
    if (!reader.contains(t.name)) missing += (missing.empty() ? "'" : ", '") + t.name + "'";
  if (!missing.empty()) fail(reader.origin(), "has no tensor named ", missing);
  for (const HfTensor& t : tensors) {
    const TensorEntry& e = reader.tensor(t.name);
    if (e.shape != t.shape)
      fail(reader.file_of(t.name).path(), "tensor '", t.name, "' has shape ", shape_text(e.shape),
           ", the model expects ", shape_text(t.shape));
  }
}

}  // namespace detail

// Streams `tensors` by name from the file set at `path` into `sink`, in
// pieces of at most buffer_bytes. Every name and shape is checked before the
// first byte reaches the sink: a missing name or another shape is an error
// naming the tensor, both shapes and the file.
inline void hf_import(const std::filesystem::path& path, const std::vector<HfTensor>& tensors, const HfSink& sink,
                      std::size_t buffer_bytes = std::size_t{16} << 20) {
  require(buffer_bytes >= 8, "hf_import: buffer_bytes must be at least 8");
  HfReader reader(path);
  detail::check_hf_tensors(reader, tensors);
  std::vector<char> buffer(buffer_bytes);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::uint64_t numel = reader.tensor(tensors[i].name).numel();
    const std::uint64_t per_piece = buffer.size() / dtype_bytes(tensors[i].dtype);
    for (std::uint64_t first = 0; first < numel; first += per_piece) {
      const std::uint64_t n = std::min(per_piece, numel - first);
      reader.read(tensors[i].name, first, n, tensors[i].dtype, buffer.data());
      sink(i, first, n, buffer.data());
    }
  }
}

// The model's tensors as exported: every parameter of `units`, in order,
// with the shape it was registered with, or flat ([numel]).
inline std::vector<HfTensor> hf_tensors(const std::vector<UnitDesc>& units, DType dtype = DType::f32) {
  std::vector<HfTensor> out;
  for (const UnitDesc& u : units)
    for (const ParamDesc& p : u.params) out.push_back({p.name, p.shape.empty() ? Shape{p.numel} : p.shape, dtype});
  return out;
}

// Exports the fp32 master of the checkpoint at `checkpoint` (a checkpoint
// directory, or a root: its newest complete one) as a Hugging Face file set
// in `out`, without the program that saved it: parameters named and shaped
// as registered, in `dtype` (fp32, or bf16/fp16 rounded to nearest even).
// Memory: the export buffer plus the reader's I/O buffer, whatever the
// model size; every chunk read is checked against its checksum.
inline HfExportResult hf_export_checkpoint(const std::filesystem::path& checkpoint, const std::filesystem::path& out,
                                           DType dtype = DType::f32, const HfExportOptions& options = {}) {
  require(is_stored_type(dtype), "hf_export_checkpoint: export as fp32, bf16 or fp16, not ", dtype_name(dtype));
  CheckpointReader reader(checkpoint, options.buffer_bytes);
  const Manifest& m = reader.manifest();
  const std::size_t master = m.slot_index("master");
  if (master == m.slots.size())
    fail(reader.directory() / manifest_file_name, "has no 'master' slot: not a checkpoint of a ZeroOptimizer");
  // (unit, parameter) of each exported tensor, in hf_tensors' order.
  std::vector<std::pair<std::size_t, const ParamDesc*>> where;
  for (std::size_t u = 0; u < m.units.size(); ++u)
    for (const ParamDesc& p : m.units[u].params) where.emplace_back(u, &p);
  return hf_export(
      out, hf_tensors(m.units, dtype),
      [&](std::size_t t, std::uint64_t first, std::uint64_t count, void* dst) {
        reader.read(master, where[t].first, where[t].second->offset + first, count, dst, dtype);
      },
      options);
}

}  // namespace zero::checkpoint
