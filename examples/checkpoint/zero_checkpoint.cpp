// zero_checkpoint: a checkpoint directory without the program that saved it.
// Everything here reads the manifest and the rank files' fp32 master ranges
// (checksums verified); no ZeroOptimizer, no model code, any rank count.
//
//   zero_checkpoint inspect DIR [--no-checksums] what the checkpoint holds, every rank file
//                                                checked (present, size, header, checksums)
//   zero_checkpoint export DIR OUT [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]
//                                                Hugging Face sharded safetensors, in bounded memory
//   zero_checkpoint verify HF DIR                does the safetensors file set HF hold the
//                                                parameters of DIR: names, shapes, values
//   zero_checkpoint import HF DIR OUT [--keep-state]
//                                                a checkpoint OUT of DIR's run with HF's parameters
//
// DIR is a checkpoint directory or a root of step-* checkpoints (the newest
// complete one). `import` writes OUT as one rank (any rank count and stage
// loads it): the fp32 master from HF by name, the optimizer state zero and
// the step 0 (fine-tuning from the weights; --keep-state keeps DIR's state,
// step and loss scale instead); a run resumes from it with --resume OUT. A
// running program can also take the weights directly: opt.load_hf(path)
// (zero/checkpoint/optimizer_io.hpp). Exit codes: 0 done (verify:
// everything matches), 1 verify found a difference, 2 a bad command line or
// an unusable input (inspect: 1 when a rank file is missing, truncated or
// corrupt, each named with what is wrong).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "zero/checkpoint/hugging_face.hpp"

namespace {

namespace ck = zero::checkpoint;

std::string bytes_text(std::uint64_t b) {
  char s[32];
  if (b < 1024) {
    std::snprintf(s, sizeof s, "%llu B", static_cast<unsigned long long>(b));
  } else {
    const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
    double v = static_cast<double>(b);
    int u = -1;
    while (v >= 1024 && u < 3) {
      v /= 1024;
      ++u;
    }
    std::snprintf(s, sizeof s, "%.1f %s", v, units[u]);
  }
  return s;
}

// "5GB" (10^9, as transformers reads it), "5GiB" (2^30), "500MB", "4096":
// bytes, or nullopt.
std::optional<std::uint64_t> parse_size(const std::string& text) {
  std::size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  std::string unit = text.substr(used);
  for (auto& ch : unit) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  const std::pair<const char*, double> units[] = {{"", 1},       {"B", 1},     {"KB", 1e3},        {"MB", 1e6},
                                                  {"GB", 1e9},   {"TB", 1e12}, {"KIB", 1024.0},    {"MIB", 1048576.0},
                                                  {"GIB", 1073741824.0}, {"TIB", 1099511627776.0}};
  for (const auto& [name, scale] : units)
    if (unit == name) {
      const double bytes = std::round(value * scale);
      if (!(bytes >= 1) || bytes > 1e18) return std::nullopt;
      return static_cast<std::uint64_t>(bytes);
    }
  return std::nullopt;
}

zero::DType dtype_of(const std::string& name) {
  if (name == "bf16") return zero::DType::bf16;
  if (name == "fp16") return zero::DType::f16;
  return zero::DType::f32;
}

std::string param_shape(const ck::ParamDesc& p) {
  return p.shape.empty() ? zero::shape_text({p.numel}) + " (flat)" : zero::shape_text(p.shape);
}

// The checkpoint at `path`, or an error that says what DIR must be.
std::unique_ptr<ck::CheckpointReader> open_checkpoint(const std::string& path) {
  try {
    return std::make_unique<ck::CheckpointReader>(path);
  } catch (const zero::CheckpointError& e) {
    throw zero::CheckpointError(std::string(e.what()) +
                                "\n(DIR must be a checkpoint directory, holding the manifest.json that "
                                "ZeroOptimizer::save or the trainer's --save writes last, or a root of step-* ones)");
  }
}

int inspect(const std::string& path, bool checksums) {
  const auto opened = open_checkpoint(path);
  const ck::CheckpointReader& reader = *opened;
  const ck::Manifest& m = reader.manifest();
  const ck::RunState& run = m.run;
  std::printf("checkpoint %s (format version %llu)\n", reader.directory().c_str(),
              static_cast<unsigned long long>(ck::manifest_format_version));
  std::printf("saved by %llu rank(s) at ZeRO stage %llu, precision %s, optimizer %s %s\n",
              static_cast<unsigned long long>(run.world_size), static_cast<unsigned long long>(run.stage),
              run.precision.c_str(), run.optimizer.c_str(), run.hyper.dump().c_str());
  std::printf("step %llu, loss scale %g (growth counter %llu, hysteresis left %llu), rounding seed %s\n",
              static_cast<unsigned long long>(run.step), run.loss_scaler.scale,
              static_cast<unsigned long long>(run.loss_scaler.growth_counter),
              static_cast<unsigned long long>(run.loss_scaler.hysteresis_left),
              run.rounding_seed ? std::to_string(*run.rounding_seed).c_str() : "none");
  if (!run.extra.empty()) std::printf("extra %s\n", run.extra.dump().c_str());
  std::string slots;
  for (const auto& s : m.slots)
    slots += (slots.empty() ? "" : ", ") + s.name + " " + ck::tensor_type_name(ck::tensor_type_of(s.dtype));
  std::printf("slots: %s\n", slots.c_str());
  std::uint64_t params = 0, elements = 0, file_bytes = 0;
  for (const auto& u : m.units)
    for (const auto& p : u.params) {
      ++params;
      elements += p.numel;
    }
  for (const auto& f : m.files) file_bytes += f.bytes;
  std::printf("%zu unit(s), %llu parameter(s), %llu elements (%s as fp32); %zu rank file(s), %s\n", m.units.size(),
              static_cast<unsigned long long>(params), static_cast<unsigned long long>(elements),
              bytes_text(4 * elements).c_str(), m.files.size(), bytes_text(file_bytes).c_str());
  for (const auto& u : m.units) {
    std::printf("unit %s (%llu elements)\n", u.name.c_str(), static_cast<unsigned long long>(u.numel));
    for (const auto& p : u.params)
      std::printf("  %-40s %-24s at %llu\n", p.name.c_str(), param_shape(p).c_str(),
                  static_cast<unsigned long long>(p.offset));
  }
  // What is on disk, checked as a load would (CheckpointReader::verify_file):
  // a missing, truncated or corrupt rank file is reported, not the size the
  // manifest recorded for it.
  std::size_t damaged = 0;
  for (std::size_t i = 0; i < m.files.size(); ++i) {
    const ck::FileRecord& f = m.files[i];
    try {
      opened->verify_file(i, checksums);
      std::printf("file %s: rank %llu, %s, %zu tensors, %s\n", f.name.c_str(), static_cast<unsigned long long>(f.rank),
                  bytes_text(f.bytes).c_str(), f.tensors.size(),
                  checksums ? "checksums verified" : "size and header checked (--no-checksums)");
    } catch (const zero::CheckpointError& e) {
      ++damaged;
      std::printf("file %s: rank %llu: DAMAGED: %s\n", f.name.c_str(), static_cast<unsigned long long>(f.rank),
                  e.what());
    }
  }
  if (damaged == 0) return 0;
  std::fprintf(stderr,
               "zero_checkpoint: error: %zu of %zu rank file(s) of %s are missing, truncated or corrupt (above): the "
               "checkpoint cannot be loaded; resume from an older one (a root's other step-* directories)\n",
               damaged, m.files.size(), reader.directory().c_str());
  return 1;
}

int export_hf(const std::string& path, const std::string& out, const std::string& dtype, std::uint64_t max_shard) {
  open_checkpoint(path);  // its errors say what DIR must be
  ck::HfExportOptions options;
  options.max_shard_bytes = max_shard;
  const auto result = ck::hf_export_checkpoint(path, out, dtype_of(dtype), options);
  for (const auto& f : result.files) std::printf("wrote %s/%s\n", out.c_str(), f.c_str());
  std::printf("wrote %s/%s: %zu file(s), %s of %s tensor data\n", out.c_str(), ck::hf_index_file_name,
              result.files.size(), bytes_text(result.total_size).c_str(), dtype.c_str());
  return 0;
}

// The manifest's index of the fp32 master, which verify and import read.
std::size_t master_slot(const ck::CheckpointReader& reader) {
  const std::size_t master = reader.manifest().slot_index("master");
  if (master == reader.manifest().slots.size())
    ck::fail(reader.directory() / ck::manifest_file_name, "has no 'master' slot: not a checkpoint of a ZeroOptimizer");
  return master;
}

// Why parameter p cannot be read from the file set, or "" when it can. With
// `flat_takes_any_shape` a parameter registered flat takes any shape of its
// element count (as opt.load_hf does); verify holds an export to the flat
// shape export writes.
std::string tensor_problem(const ck::HfReader& hf, const ck::ParamDesc& p, bool flat_takes_any_shape) {
  if (!hf.contains(p.name)) return "has no tensor '" + p.name + "'";
  const ck::TensorEntry& t = hf.tensor(p.name);
  const zero::Shape want = p.shape.empty() ? zero::Shape{p.numel} : p.shape;
  if (t.shape != want && !(flat_takes_any_shape && p.shape.empty() && t.numel() == p.numel))
    return "'" + p.name + "' has shape " + zero::shape_text(t.shape) + ", the checkpoint's is " +
           zero::shape_text(want);
  if (t.dtype == ck::TensorType::I64) return "'" + p.name + "' is I64, not a floating-point tensor";
  return "";
}

// Every parameter of the checkpoint in the file set, with its shape, and
// its values equal to the master rounded to the file's dtype.
int verify(const std::string& hf_path, const std::string& path) {
  const auto opened = open_checkpoint(path);
  ck::CheckpointReader& reader = *opened;
  const ck::HfReader hf(hf_path);
  const ck::Manifest& m = reader.manifest();
  const std::size_t master = master_slot(reader);
  std::vector<std::string> problems;
  std::uint64_t checked = 0;
  constexpr std::uint64_t piece = std::uint64_t{1} << 20;  // elements compared at once
  std::vector<float> file_values, saved;
  std::vector<char> rounded;
  std::vector<std::string> names;
  for (std::size_t u = 0; u < m.units.size(); ++u)
    for (const ck::ParamDesc& p : m.units[u].params) {
      names.push_back(p.name);
      if (std::string problem = tensor_problem(hf, p, false); !problem.empty()) {
        problems.push_back(std::move(problem));
        continue;
      }
      const ck::TensorEntry& t = hf.tensor(p.name);
      std::uint64_t differ = 0;
      double largest = 0;
      for (std::uint64_t first = 0; first < p.numel; first += piece) {
        const std::uint64_t n = std::min(piece, p.numel - first);
        file_values.resize(n);
        saved.resize(n);
        rounded.resize(n * ck::tensor_type_bytes(t.dtype));
        hf.read(p.name, first, n, zero::DType::f32, file_values.data());
        reader.read(master, u, p.offset + first, n, rounded.data(), ck::storage_type_of(t.dtype));
        zero::checkpoint::detail::convert_elements(rounded.data(), ck::storage_type_of(t.dtype), saved.data(),
                                                   zero::DType::f32, n);
        for (std::uint64_t i = 0; i < n; ++i)
          if (std::memcmp(&file_values[i], &saved[i], sizeof(float)) != 0) {
            ++differ;
            largest = std::max(largest, std::fabs(static_cast<double>(file_values[i]) - saved[i]));
          }
      }
      checked += p.numel;
      if (differ > 0) {
        char by[32];
        std::snprintf(by, sizeof by, "%.6g", largest);
        problems.push_back("'" + p.name + "': " + std::to_string(differ) + " of " + std::to_string(p.numel) +
                           " values differ from the checkpoint's master (rounded to " +
                           ck::tensor_type_name(t.dtype) + "), by up to " + by);
      }
    }
  std::sort(names.begin(), names.end());
  for (const auto& name : hf.names())
    if (!std::binary_search(names.begin(), names.end(), name))
      std::printf("note: '%s' is not a parameter of the checkpoint (ignored by opt.load_hf)\n", name.c_str());
  for (const auto& p : problems) std::printf("differs: %s\n", p.c_str());
  std::printf("%s: %zu parameter(s), %llu values compared with %s: %s\n", hf.origin().c_str(), names.size(),
              static_cast<unsigned long long>(checked), reader.directory().c_str(),
              problems.empty() ? "all match" : (std::to_string(problems.size()) + " differ").c_str());
  return problems.empty() ? 0 : 1;
}

// What `import` writes: DIR's units and slots (but "param", the 16-bit copy,
// which a load rounds from the master), every element owned by one rank; the master
// read from the Hugging Face file set, the other slots zero or DIR's.
class ImportSource final : public ck::StateSource {
 public:
  ImportSource(ck::CheckpointReader& checkpoint, const ck::HfReader& hf, bool keep_state)
      : checkpoint_(checkpoint), hf_(hf), keep_state_(keep_state) {
    const ck::Manifest& m = checkpoint.manifest();
    for (const ck::SavedSlot& slot : m.slots)
      if (slot.name != "param") slots_.push_back({slot.name, slot.dtype, true});
    master_slot(checkpoint);
    // Every parameter there, with its shape, before anything is written.
    for (const ck::UnitDesc& u : m.units)
      for (const ck::ParamDesc& p : u.params)
        if (const std::string problem = tensor_problem(hf, p, true); !problem.empty())
          ck::fail(hf.origin(), problem, " (a parameter of the checkpoint ", checkpoint.directory().string(), ")");
  }

  std::vector<ck::UnitDesc> units() const override { return checkpoint_.manifest().units; }
  std::vector<ck::SlotDesc> slots() const override { return slots_; }
  std::vector<ck::OwnedRange> owned() const override {
    std::vector<ck::OwnedRange> all;
    const auto& units = checkpoint_.manifest().units;
    for (std::size_t u = 0; u < units.size(); ++u) all.push_back({u, 0, units[u].numel});
    return all;
  }
  void read(std::size_t slot, const ck::OwnedRange& r, void* dst) const override {
    const ck::SlotDesc& desc = slots_[slot];
    if (desc.name == "master") return read_master(r, static_cast<float*>(dst));
    if (keep_state_) {
      checkpoint_.read(checkpoint_.manifest().slot_index(desc.name), r.unit, r.begin, r.count, dst, desc.dtype);
    } else {
      std::memset(dst, 0, r.count * zero::dtype_bytes(desc.dtype));
    }
  }
  void write(std::size_t, const ck::OwnedRange&, const void*) override {
    throw zero::Error("zero_checkpoint import writes a checkpoint; it loads none");
  }
  ck::RunState run_state() const override {
    ck::RunState run = checkpoint_.manifest().run;
    if (!keep_state_) run.step = 0;
    return run;
  }

 private:
  // Elements [r.begin, r.begin + r.count) of the unit: each parameter's
  // values from its tensor, the alignment gaps between parameters zero.
  void read_master(const ck::OwnedRange& r, float* dst) const {
    std::fill(dst, dst + r.count, 0.0f);
    const std::uint64_t end = r.begin + r.count;
    for (const ck::ParamDesc& p : checkpoint_.manifest().units[r.unit].params) {
      const std::uint64_t from = std::max(r.begin, p.offset), to = std::min(end, p.offset + p.numel);
      if (from < to) hf_.read(p.name, from - p.offset, to - from, zero::DType::f32, dst + (from - r.begin));
    }
  }

  ck::CheckpointReader& checkpoint_;
  const ck::HfReader& hf_;
  bool keep_state_;
  std::vector<ck::SlotDesc> slots_;
};

int import_hf(const std::string& hf_path, const std::string& path, const std::string& out, bool keep_state) {
  const auto opened = open_checkpoint(path);
  const ck::HfReader hf(hf_path);
  ImportSource source(*opened, hf, keep_state);
  ck::save_checkpoint(out, source, ck::Collective{});
  std::uint64_t params = 0;
  for (const auto& u : opened->manifest().units) params += u.params.size();
  std::printf("wrote %s: %llu parameter(s) from %s, %s, as 1 rank at stage %llu\n", out.c_str(),
              static_cast<unsigned long long>(params), hf.origin().c_str(),
              keep_state ? ("the optimizer state and step " + std::to_string(opened->manifest().run.step) + " of " +
                            opened->directory().string())
                               .c_str()
                         : "the optimizer state zero, step 0",
              static_cast<unsigned long long>(opened->manifest().run.stage));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"zero_checkpoint: inspect a zero checkpoint, export it as Hugging Face safetensors, verify a "
               "safetensors file set against it, or import one into a new checkpoint, without the training program.",
               "zero_checkpoint"};
  app.require_subcommand(1);
  std::string dir, out, hf, dtype = "fp32", max_shard_text = "5GB";
  std::uint64_t max_shard = 0;

  auto* inspect_cmd = app.add_subcommand("inspect", "print what a checkpoint holds: run, units, parameters and shapes");
  inspect_cmd->add_option("DIR", dir, "checkpoint directory, or a root of step-* checkpoints (the newest)")->required();
  bool no_checksums = false;
  inspect_cmd->add_flag("--no-checksums", no_checksums,
                        "check each rank file's presence, size and header only, without reading its data");

  auto* export_cmd = app.add_subcommand(
      "export", "write the fp32 master as Hugging Face sharded safetensors (model-0000K-of-0000N.safetensors and "
                "model.safetensors.index.json), streaming in bounded memory");
  export_cmd->add_option("DIR", dir, "checkpoint directory, or a root of step-* checkpoints (the newest)")->required();
  export_cmd->add_option("OUT", out, "output directory (created if needed)")->required();
  export_cmd->add_option("--dtype", dtype, "tensor type of the export (bf16, fp16: rounded to nearest even)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
  export_cmd->add_option("--max-shard-size", max_shard_text,
                         "largest shard file: bytes, or with a suffix KB/MB/GB (powers of 1000) or KiB/MiB/GiB")
      ->capture_default_str();
  export_cmd->callback([&] {
    const auto bytes = parse_size(max_shard_text);
    if (!bytes)
      throw CLI::ValidationError("--max-shard-size", "'" + max_shard_text + "' is not a size: write e.g. 5GB, 500MB "
                                                                            "or 1048576");
    max_shard = *bytes;
  });

  auto* verify_cmd = app.add_subcommand(
      "verify", "check that a Hugging Face safetensors file set holds every parameter of a checkpoint with its shape "
                "and values (the master, rounded to the file's dtype): what opt.load_hf needs, and a test of an export");
  verify_cmd->add_option("HF", hf, "a .safetensors file, a model.safetensors.index.json, or a directory holding one")
      ->required();
  verify_cmd->add_option("DIR", dir, "checkpoint directory, or a root of step-* checkpoints (the newest)")->required();

  bool keep_state = false;
  auto* import_cmd = app.add_subcommand(
      "import", "write a checkpoint OUT of the run DIR describes with the parameters of a Hugging Face safetensors file "
                "set (by name; shapes checked): the optimizer state zero and step 0 unless --keep-state; one rank, "
                "loadable by any rank count and stage (--resume OUT)");
  import_cmd->add_option("HF", hf, "a .safetensors file, a model.safetensors.index.json, or a directory holding one")
      ->required();
  import_cmd->add_option("DIR", dir, "checkpoint of the run (its model, optimizer and settings), or a root of step-* ones")
      ->required();
  import_cmd->add_option("OUT", out, "the new checkpoint directory (must not hold one)")->required();
  import_cmd->add_flag("--keep-state", keep_state, "keep DIR's optimizer state, step and loss scale");

  zero::examples::parse_or_exit(app, argc, argv);
  try {
    if (*inspect_cmd) return inspect(dir, !no_checksums);
    if (*export_cmd) return export_hf(dir, out, dtype, max_shard);
    if (*import_cmd) return import_hf(hf, dir, out, keep_state);
    return verify(hf, dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zero_checkpoint: error: %s\n", e.what());
    return 2;
  }
}
