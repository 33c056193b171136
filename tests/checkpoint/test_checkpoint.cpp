// Checkpoints: the safetensors reader and writer, the manifest, sharded save
// and load across rank counts and ownerships, every kind of bad input, crash
// safety of asynchronous saves, and the Hugging Face export and import with
// its memory bound. The model is a fake StateSource whose ranks own padded
// shards the way the engine's layout does; every stored value is a formula
// of (slot, unit, element), so what a load produces is checked against the
// formula, not against another run of the same code.
#include <catch2/catch.hpp>

#include "rank_errors.hpp"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "zero/checkpoint/checkpoint.hpp"
#include "zero/checkpoint/hugging_face.hpp"
#include "zero/checkpoint/manifest.hpp"
#include "zero/checkpoint/safetensors.hpp"
#include "zero/comm/local.hpp"
#include "zero/precision/convert.hpp"

namespace fs = std::filesystem;
using namespace zero::checkpoint;
using zero::DType;

namespace {

// A directory removed at scope exit.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string t = (fs::temp_directory_path() / "zero-ckpt-XXXXXX").string();
    REQUIRE(::mkdtemp(t.data()) != nullptr);
    path = t;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_text(const fs::path& p, const std::string& s) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << s;
}

// The value every slot holds at element i of unit u: distinct per slot, unit
// and element, exactly representable in bf16 for the "param" slot (the
// formula is rounded there, as the engine's cast would).
float formula(std::size_t slot, std::size_t unit, std::uint64_t i, std::uint64_t salt = 0) {
  return static_cast<float>(slot + 1) * 1000.0f + static_cast<float>(unit) * 10.0f +
         static_cast<float>(i % 4093) * 0.0625f + static_cast<float>(salt);
}

// A model of four units (sizes chosen to leave padding and empty shards)
// with parameters at offsets aligned as the engine's layout does.
std::vector<UnitDesc> model_units(std::uint64_t scale = 1) {
  std::vector<UnitDesc> units;
  const std::vector<std::vector<std::uint64_t>> params = {{300, 701}, {37}, {129, 8, 1}, {2500 * scale}};
  for (std::size_t u = 0; u < params.size(); ++u) {
    UnitDesc d;
    d.name = "layer" + std::to_string(u);
    for (std::size_t p = 0; p < params[u].size(); ++p) {
      const std::uint64_t offset = (d.numel + 7) / 8 * 8;
      ParamDesc pd{d.name + ".w" + std::to_string(p), offset, params[u][p], {}};
      if (params[u][p] == 300) pd.shape = {20, 15};
      d.params.push_back(pd);
      d.numel = offset + params[u][p];
    }
    units.push_back(d);
  }
  return units;
}

std::vector<SlotDesc> mixed_slots() {
  return {{"master", DType::f32, true}, {"exp_avg", DType::f32, true}, {"exp_avg_sq", DType::f32, true},
          {"param", DType::bf16, true}};
}

// One rank of the fake model. `sharded`: rank r owns shard r of each unit
// padded to a multiple of 64 x ranks (as zero::Layout pads), clipped to the
// unpadded data (so some shards are short or empty). Otherwise (stage 0)
// every rank owns everything and saves an even split.
class FakeRank : public StateSource {
 public:
  FakeRank(std::vector<UnitDesc> units, std::vector<SlotDesc> slots, std::uint64_t rank, std::uint64_t ranks,
           bool sharded, std::string optimizer = "adamw")
      : units_(std::move(units)), slots_(std::move(slots)), sharded_(sharded) {
    run_.optimizer = std::move(optimizer);
    run_.precision = "bf16";
    run_.stage = sharded ? 3 : 0;
    run_.step = 17;
    run_.hyper = {{"lr", 0.001}, {"betas", {0.9, 0.999}}};
    run_.loss_scaler = {65536.0, 12, 2};
    run_.rounding_seed = 1234;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      const std::uint64_t numel = units_[u].numel;
      if (sharded_) {
        const std::uint64_t shard = ((numel + ranks - 1) / ranks + 63) / 64 * 64;
        const std::uint64_t b = std::min(numel, rank * shard), e = std::min(numel, (rank + 1) * shard);
        if (e > b) owned_.push_back({u, b, e - b});
      } else {
        owned_.push_back({u, 0, numel});
      }
      const std::uint64_t b = numel * rank / ranks, e = numel * (rank + 1) / ranks;
      if (e > b) split_.push_back({u, b, e - b});
    }
    data_.resize(slots_.size());
    for (std::size_t s = 0; s < slots_.size(); ++s)
      for (const auto& o : owned_) data_[s].emplace_back(o.count * zero::dtype_bytes(slots_[s].dtype), char(0x55));
  }

  // Sets every owned element of every slot to formula(..., salt).
  void fill(std::uint64_t salt = 0) {
    for (std::size_t s = 0; s < slots_.size(); ++s)
      for (std::size_t k = 0; k < owned_.size(); ++k)
        for (std::uint64_t i = 0; i < owned_[k].count; ++i)
          store(s, k, i, formula(s, owned_[k].unit, owned_[k].begin + i, salt));
  }
  // The number of owned elements of `slot` whose value is not formula(...).
  std::uint64_t mismatches(std::size_t slot, std::size_t formula_slot, std::uint64_t salt = 0) const {
    std::uint64_t bad = 0;
    for (std::size_t k = 0; k < owned_.size(); ++k)
      for (std::uint64_t i = 0; i < owned_[k].count; ++i) {
        const float want = expected(slot, formula(formula_slot, owned_[k].unit, owned_[k].begin + i, salt));
        bad += load(slot, k, i) != want;
      }
    return bad;
  }

  // The same against want(unit, element), the exact value expected after a load.
  template <class Want>
  std::uint64_t mismatches_with(std::size_t slot, Want&& want) const {
    std::uint64_t bad = 0;
    for (std::size_t k = 0; k < owned_.size(); ++k)
      for (std::uint64_t i = 0; i < owned_[k].count; ++i) bad += load(slot, k, i) != want(owned_[k].unit, owned_[k].begin + i);
    return bad;
  }

  std::vector<UnitDesc> units() const override { return units_; }
  std::vector<SlotDesc> slots() const override { return slots_; }
  std::vector<OwnedRange> owned() const override { return owned_; }
  std::vector<OwnedRange> save_ranges() const override { return sharded_ ? owned_ : split_; }
  void read(std::size_t slot, const OwnedRange& r, void* dst) const override {
    const auto [k, off] = locate(r);
    const std::size_t es = zero::dtype_bytes(slots_[slot].dtype);
    std::memcpy(dst, data_[slot][k].data() + off * es, r.count * es);
  }
  void write(std::size_t slot, const OwnedRange& r, const void* src) override {
    const auto [k, off] = locate(r);
    const std::size_t es = zero::dtype_bytes(slots_[slot].dtype);
    std::memcpy(data_[slot][k].data() + off * es, src, r.count * es);
  }
  RunState run_state() const override { return run_; }

  RunState run_;

 private:
  std::pair<std::size_t, std::uint64_t> locate(const OwnedRange& r) const {
    for (std::size_t k = 0; k < owned_.size(); ++k)
      if (owned_[k].unit == r.unit && r.begin >= owned_[k].begin && r.begin + r.count <= owned_[k].begin + owned_[k].count)
        return {k, r.begin - owned_[k].begin};
    FAIL("range outside the owned ranges: unit " << r.unit << " [" << r.begin << ", +" << r.count << ")");
    return {0, 0};
  }
  float expected(std::size_t s, float v) const {
    switch (slots_[s].dtype) {
      case DType::bf16: return zero::to_float(zero::from_float<zero::bf16>(v));
      case DType::f16: return zero::to_float(zero::from_float<zero::fp16>(v));
      default: return v;
    }
  }
  void store(std::size_t s, std::size_t k, std::uint64_t i, float v) {
    char* p = data_[s][k].data();
    switch (slots_[s].dtype) {
      case DType::bf16: { auto b = zero::from_float<zero::bf16>(v); std::memcpy(p + 2 * i, &b, 2); break; }
      case DType::f16: { auto h = zero::from_float<zero::fp16>(v); std::memcpy(p + 2 * i, &h, 2); break; }
      default: std::memcpy(p + 4 * i, &v, 4);
    }
  }
  float load(std::size_t s, std::size_t k, std::uint64_t i) const {
    const char* p = data_[s][k].data();
    switch (slots_[s].dtype) {
      case DType::bf16: { zero::bf16 b; std::memcpy(&b, p + 2 * i, 2); return zero::to_float(b); }
      case DType::f16: { zero::fp16 h; std::memcpy(&h, p + 2 * i, 2); return zero::to_float(h); }
      default: { float v; std::memcpy(&v, p + 4 * i, 4); return v; }
    }
  }

  std::vector<UnitDesc> units_;
  std::vector<SlotDesc> slots_;
  bool sharded_;
  std::vector<OwnedRange> owned_, split_;
  std::vector<std::vector<std::vector<char>>> data_;  // [slot][owned range] bytes
};

// Runs fn(rank, collective) on `ranks` threads over comm::Local; returns each
// rank's CheckpointError message ("" when it succeeded).
template <class Fn>
std::vector<std::string> on_ranks(int ranks, Fn&& fn) {
  std::vector<std::string> errors(static_cast<std::size_t>(ranks));
  zero::comm::LocalGroup group(ranks);
  group.run([&](zero::comm::Local& comm) {
    try {
      fn(static_cast<std::uint64_t>(comm.rank()), make_collective(comm));
    } catch (const zero::CheckpointError& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  return errors;
}

SaveOptions small_chunks() {
  SaveOptions o;
  o.checksum_chunk_bytes = 64;  // many chunks per tensor: partial reads verify partial chunks
  o.io_buffer_bytes = 256;      // and stream in several pieces
  return o;
}

// Saves the formula model from `ranks` sharded ranks into dir.
void save_model(const fs::path& dir, int ranks, std::vector<SlotDesc> slots = mixed_slots()) {
  const auto errors = on_ranks(ranks, [&](std::uint64_t r, Collective c) {
    FakeRank m(model_units(), slots, r, static_cast<std::uint64_t>(ranks), true);
    m.fill();
    Checkpointer(c, small_chunks()).save(dir, m);
  });
  for (const auto& e : errors) REQUIRE(e.empty());
}

// Every rank's error after loading dir into `ranks` sharded ranks.
std::vector<std::string> load_errors(const fs::path& dir, int ranks, std::string optimizer = "adamw",
                                     std::vector<UnitDesc> units = model_units()) {
  return on_ranks(ranks, [&](std::uint64_t r, Collective c) {
    FakeRank m(units, mixed_slots(), r, static_cast<std::uint64_t>(ranks), true, optimizer);
    LoadOptions o;
    o.io_buffer_bytes = 200;
    load_checkpoint(dir, m, c, o);
  });
}

// Every rank failed; at least one message has all of `parts`.
void require_error_everywhere(const std::vector<std::string>& errors, std::vector<std::string> parts) {
  bool named = false;
  for (const auto& e : errors) {
    INFO(e);
    REQUIRE_FALSE(e.empty());
    bool all = true;
    for (const auto& p : parts) all = all && e.find(p) != std::string::npos;
    named = named || all;
  }
  INFO(errors[0]);
  REQUIRE(named);
}

}  // namespace

TEST_CASE("safetensors: written files parse back and hold the bytes written", "[checkpoint][safetensors]") {
  TempDir tmp;
  const fs::path file = tmp.path / "a.safetensors";
  std::vector<TensorSpec> specs = {{"ids", TensorType::I64, {3}}, {"w", TensorType::F32, {2, 3}},
                                   {"h", TensorType::BF16, {5}}, {"empty", TensorType::F16, {0}}};
  std::vector<char> bytes(3 * 8 + 6 * 4 + 5 * 2);
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7 + 1);
  {
    SafetensorsWriter w(file, specs, {{"note", "x"}});
    w.write(bytes.data(), 5);  // pieces of any size
    w.write(bytes.data() + 5, bytes.size() - 5);
    REQUIRE_FALSE(fs::exists(file));  // not before commit
    w.commit();
  }
  REQUIRE(fs::exists(file));
  const std::string raw = read_text(file);
  REQUIRE((raw.size() - bytes.size()) % 8 == 0);  // the data starts 8-byte aligned
  SafetensorsReader r(file);
  REQUIRE(r.metadata().at("note") == "x");
  REQUIRE(r.tensors().size() == 4);
  const TensorEntry& w = r.at("w");
  REQUIRE(w.shape == std::vector<std::uint64_t>{2, 3});
  REQUIRE(w.begin == 24);
  REQUIRE(w.begin % 4 == 0);
  REQUIRE(r.at("h").begin % 2 == 0);
  std::vector<char> got(8);
  r.read(w, 4, 8, got.data());
  REQUIRE(std::memcmp(got.data(), bytes.data() + 24 + 4, 8) == 0);
  REQUIRE_THROWS_WITH(r.read(w, 20, 8, got.data()), Catch::Contains("tensor 'w'"));
  REQUIRE_THROWS_WITH(r.at("nope"), Catch::Contains("has no tensor named 'nope'"));

  // Misuse of the writer: wrong order for alignment, too many or too few bytes.
  REQUIRE_THROWS_WITH(SafetensorsWriter(tmp.path / "b", {{"h", TensorType::BF16, {1}}, {"w", TensorType::F32, {1}}}),
                      Catch::Contains("declare tensors of larger elements first"));
  {
    SafetensorsWriter w2(tmp.path / "c", {{"w", TensorType::F32, {1}}});
    REQUIRE_THROWS_WITH(w2.write(bytes.data(), 5), Catch::Contains("past the declared tensors"));
    REQUIRE_THROWS_WITH(w2.commit(), Catch::Contains("4 bytes of tensor data unwritten"));
  }
  REQUIRE_FALSE(fs::exists(tmp.path / "c"));  // an uncommitted file leaves nothing, not even its temporary
  for (const auto& e : fs::directory_iterator(tmp.path)) REQUIRE(e.path().filename().string().find(".tmp-") == std::string::npos);
}

namespace {
// A file whose header is `json` (padded to 8) followed by `data_bytes` bytes.
std::string crafted(const std::string& json, std::size_t data_bytes) {
  std::string h = json;
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((h.size() >> (8 * i)) & 0xff);
  return out + h + std::string(data_bytes, '\x01');
}
}  // namespace

TEST_CASE("safetensors: the reader rejects every lie a header can tell", "[checkpoint][safetensors]") {
  const fs::path f = "x.safetensors";
  auto parse = [&](const std::string& bytes) { return parse_safetensors_bytes(bytes, f); };
  const std::string good = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[3],"data_offsets":[8,14]}})";
  REQUIRE(parse(crafted(good, 14)).tensors.size() == 2);
  struct Case {
    std::string bytes, message;
  };
  const std::vector<Case> cases = {
      {"", "shorter than the 8-byte"},
      {std::string(8, '\0'), "header length is 0"},
      {std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}", "exceeds the"},
      {std::string("\x40\0\0\0\0\0\0\0", 8) + "{}", "truncated: the header claims 64 bytes"},
      {crafted("{\"a\":", 0), "not valid JSON"},
      {crafted("[1,2]", 0), "must be a JSON object"},
      {crafted(good, 13), "truncated: tensor 'b' ends at data byte 14"},
      {crafted(good, 15), "trailing bytes"},
      {crafted(R"({"a":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}})", 16), "dtype \"F64\" is not one of"},
      {crafted(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "is 12 bytes but data_offsets [0, 8] span 8"},
      {crafted(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
       "tensor 'b' (bytes [4, 12)) overlaps tensor 'a'"},
      {crafted(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})", 16),
       "a hole of 4 bytes lies before tensor 'b'"},
      {crafted(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "end before they begin"},
      {crafted(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "non-negative integers"},
      {crafted(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8), "does not fit in 64 bits"},
      {crafted(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8),
       "has the key \"a\" twice"},
      {crafted(R"({"a":{"dtype":"F32","shape":[2]}})", 8), "\"data_offsets\" is missing"},
      {crafted(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", 8), "unknown field \"x\""},
      {crafted(R"({"__metadata__":{"k":1}})", 0), "__metadata__[\"k\"] must be a string"},
  };
  for (const auto& c : cases) {
    INFO(c.message);
    REQUIRE_THROWS_AS(parse(c.bytes), zero::CheckpointError);
    REQUIRE_THROWS_WITH(parse(c.bytes), Catch::Contains("x.safetensors: ") && Catch::Contains(c.message));
  }
}

TEST_CASE("manifest: round trip and precise errors", "[checkpoint][manifest]") {
  TempDir tmp;
  save_model(tmp.path, 2);
  const fs::path file = tmp.path / manifest_file_name;
  const std::string text = read_text(file);
  const Manifest m = parse_manifest(text, file);
  REQUIRE(m.run.world_size == 2);
  REQUIRE(m.run.step == 17);
  REQUIRE(m.run.optimizer == "adamw");
  REQUIRE(m.run.hyper["lr"].get<double>() == 0.001);
  REQUIRE(m.run.loss_scaler == LossScalerState{65536.0, 12, 2});
  REQUIRE(m.run.rounding_seed == std::optional<std::uint64_t>(1234));
  REQUIRE(m.units == model_units());
  REQUIRE(m.slots.size() == 4);
  REQUIRE(m.slots[3].dtype == TensorType::BF16);
  REQUIRE(m.files.size() == 2);
  REQUIRE(manifest_to_json(parse_manifest(manifest_to_json(m).dump(), file)) == manifest_to_json(m));

  const nlohmann::json j = nlohmann::json::parse(text);
  auto error_of = [&](nlohmann::json changed) {
    try {
      parse_manifest(changed.dump(), file);
    } catch (const zero::CheckpointError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  auto with = [&](auto&& edit) {
    nlohmann::json c = j;
    edit(c);
    return error_of(c);
  };
  CHECK_THAT(with([](auto& c) { c["format_version"] = 2; }),
             Catch::Contains("format version 2 is not supported") && Catch::Contains("upgrade"));
  CHECK_THAT(with([](auto& c) { c.erase("step"); }), Catch::Contains("field 'step' is missing"));
  CHECK_THAT(with([](auto& c) { c["units"][1]["numel"] = "37"; }),
             Catch::Contains("field 'units[1].numel' must be a non-negative integer, not string"));
  CHECK_THAT(with([](auto& c) { c["optimizer"].erase("hyper"); }), Catch::Contains("'optimizer.hyper' is missing"));
  CHECK_THAT(with([](auto& c) { c["files"][0]["tensors"][0]["xxh3_64"][0] = "xyz"; }),
             Catch::Contains("files[0].tensors[0].xxh3_64[0]' must be 16 lower-case hexadecimal digits"));
  CHECK_THAT(with([](auto& c) { c["files"][1]["tensors"][0]["begin"] = 0; }), Catch::Contains("overlap"));
  CHECK_THAT(with([](auto& c) { c["files"].erase(1); }), Catch::Contains("1 rank files are listed for world_size 2"));
  CHECK_THAT(with([](auto& c) { c["format"] = "other"; }), Catch::Contains("not a zero checkpoint manifest"));
  CHECK_THAT(with([](auto& c) { c["slots"][0]["dtype"] = "I64"; }), Catch::Contains("'slots[0].dtype' is \"I64\""));
  CHECK_THAT(error_of(nullptr), Catch::Contains("must be a JSON object"));
  // A number no double holds names its field, not only the file.
  nlohmann::json marked = j;
  marked["step"] = 987654321;
  std::string overflowing = marked.dump();
  overflowing.replace(overflowing.find("987654321"), 9, "1e400");
  CHECK_THROWS_WITH(parse_manifest(overflowing, file),
                    Catch::Contains(file.string()) && Catch::Contains("field 'step' holds a number no double holds"));
  try {
    parse_manifest(text.substr(0, text.size() / 2), file);
    FAIL("a corrupt manifest parsed");
  } catch (const zero::CheckpointError& e) {
    REQUIRE_THAT(e.what(), Catch::Contains(file.string()) && Catch::Contains("not valid JSON"));
  }
}

TEST_CASE("manifest: a state_format this library does not write is refused, naming the file and the key",
          "[checkpoint][manifest][errors]") {
  TempDir tmp;
  save_model(tmp.path, 2);
  const fs::path file = tmp.path / manifest_file_name;
  const nlohmann::json j = nlohmann::json::parse(read_text(file));
  auto error_with = [&](const std::string& name, std::uint64_t block, std::uint64_t fp32_below) {
    nlohmann::json c = j;
    c["state_format"] = {{"name", name}, {"block", block}, {"fp32_below", fp32_below}};
    try {
      parse_manifest(c.dump(), file);
    } catch (const zero::CheckpointError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  // What Options::states, state_block and state_fp32_below write.
  CHECK(error_with("fp32", 0, 0) == "(no error)");
  CHECK(error_with("bf16", 0, 0) == "(no error)");
  CHECK(error_with("bf16_stochastic", 0, 0) == "(no error)");
  CHECK(error_with("blockwise8", 2048, 4096) == "(no error)");
  CHECK(error_with("blockwise8", 64, 0) == "(no error)");
  CHECK(error_with("blockwise8", 4096, 1) == "(no error)");

  const std::string at = file.string() + ": ";
  CHECK_THAT(error_with("blockwise9", 2048, 4096),
             Catch::Contains(at + "field 'state_format.name' is \"blockwise9\", not one of fp32, bf16, "
                                  "bf16_stochastic, blockwise8"));
  CHECK_THAT(error_with("", 0, 0), Catch::Contains(at + "field 'state_format.name' is \"\""));
  for (const std::uint64_t block : {0, 65, 32, 4160, 8192}) {
    INFO(block);
    CHECK_THAT(error_with("blockwise8", block, 4096),
               Catch::Contains(at + "field 'state_format.block' is " + std::to_string(block) +
                               ", but blockwise8 blocks are a multiple of 64 in [64, 4096] elements"));
  }
  // The other formats keep no blocks: the saver writes 0 for both.
  CHECK_THAT(error_with("fp32", 2048, 0),
             Catch::Contains(at + "field 'state_format.block' is 2048, but fp32 states have no blocks"));
  CHECK_THAT(error_with("bf16", 0, 4096),
             Catch::Contains(at + "field 'state_format.fp32_below' is 4096, but bf16 states have no blocks"));

  // At load, on every rank, before anything is read.
  nlohmann::json edited = j;
  edited["state_format"] = {{"name", "blockwise9"}, {"block", 2048}, {"fp32_below", 4096}};
  write_text(file, edited.dump());
  require_error_everywhere(load_errors(tmp.path, 2), {"manifest.json", "'state_format.name'", "blockwise9"});
}

TEST_CASE("checkpoint: saved by 3 ranks, loaded by 1, 2, 4 and a stage-0 replica, exactly", "[checkpoint][reshard]") {
  TempDir tmp;
  save_model(tmp.path, 3);
  REQUIRE(fs::exists(tmp.path / "rank-2-of-3.safetensors"));
  std::uint64_t total_data = 0;
  for (const auto& e : fs::directory_iterator(tmp.path))
    if (e.path().extension() == ".safetensors") total_data += SafetensorsReader(e.path()).tensors().back().end;

  for (int m : {1, 2, 4, 5}) {
    for (bool sharded : {true, false}) {
      if (!sharded && m != 2) continue;
      DYNAMIC_SECTION(m << " ranks, " << (sharded ? "sharded" : "replicated")) {
        std::vector<std::uint64_t> bad(static_cast<std::size_t>(m), 99), read(static_cast<std::size_t>(m));
        const auto errors = on_ranks(m, [&](std::uint64_t r, Collective c) {
          FakeRank model(model_units(), mixed_slots(), r, static_cast<std::uint64_t>(m), sharded);
          LoadOptions o;
          o.io_buffer_bytes = 200;
          const LoadResult res = load_checkpoint(tmp.path, model, c, o);
          REQUIRE(res.manifest.run.step == 17);
          REQUIRE(res.slots_not_loaded.empty());
          std::uint64_t b = 0;
          for (std::size_t s = 0; s < 4; ++s) b += model.mismatches(s, s);
          bad[r] = b;
          read[r] = res.bytes_read;
        });
        for (int r = 0; r < m; ++r) {
          INFO("rank " << r << ": " << errors[static_cast<std::size_t>(r)]);
          REQUIRE(errors[static_cast<std::size_t>(r)].empty());
          REQUIRE(bad[static_cast<std::size_t>(r)] == 0);
          // No sharded rank reads the whole model: its share plus at most a
          // chunk at either end of each piece it reads.
          if (sharded && m > 1) REQUIRE(read[static_cast<std::size_t>(r)] < total_data * 3 / static_cast<std::uint64_t>(m) / 2 + 64 * 2 * 4 * 4 * 3);
        }
        if (!sharded) REQUIRE(read[0] >= total_data);  // a replica reads everything
      }
    }
  }
}

TEST_CASE("checkpoint: a stage-0 save (every rank owns everything) writes each element once", "[checkpoint][reshard]") {
  TempDir tmp;
  const auto errors = on_ranks(3, [&](std::uint64_t r, Collective c) {
    FakeRank m(model_units(), mixed_slots(), r, 3, false);
    m.fill();
    save_checkpoint(tmp.path, m, c, small_chunks());
  });
  for (const auto& e : errors) REQUIRE(e.empty());
  const auto loaded = on_ranks(2, [&](std::uint64_t r, Collective c) {
    FakeRank m(model_units(), mixed_slots(), r, 2, true);
    load_checkpoint(tmp.path, m, c);
    for (std::size_t s = 0; s < 4; ++s) REQUIRE(m.mismatches(s, s) == 0);
  });
  for (const auto& e : loaded) REQUIRE(e.empty());
}

TEST_CASE("checkpoint: precision changes on load", "[checkpoint][precision]") {
  TempDir tmp;
  save_model(tmp.path, 2);
  SECTION("fp32 run: the bf16 param slot of the checkpoint is not needed") {
    const auto errors = on_ranks(3, [&](std::uint64_t r, Collective c) {
      FakeRank m(model_units(), {{"master", DType::f32}, {"exp_avg", DType::f32}, {"exp_avg_sq", DType::f32}}, r, 3, true);
      const auto res = load_checkpoint(tmp.path, m, c);
      REQUIRE(res.slots_not_loaded.empty());
      for (std::size_t s = 0; s < 3; ++s) REQUIRE(m.mismatches(s, s) == 0);
    });
    for (const auto& e : errors) REQUIRE(e.empty());
  }
  SECTION("fp16 run from a bf16 one: the master loads exactly, the missing fp16 param is reported") {
    const auto errors = on_ranks(2, [&](std::uint64_t r, Collective c) {
      FakeRank m(model_units(), {{"master", DType::f32}, {"exp_avg", DType::f32}, {"exp_avg_sq", DType::f32},
                                 {"param16", DType::f16, false}}, r, 2, true);
      const auto res = load_checkpoint(tmp.path, m, c);
      REQUIRE(res.slots_not_loaded == std::vector<std::string>{"param16"});
      REQUIRE(m.mismatches(0, 0) == 0);
    });
    for (const auto& e : errors) REQUIRE(e.empty());
  }
  SECTION("a slot saved in bf16 loads into fp16 and fp32, converted") {
    for (DType to : {DType::f32, DType::f16}) {
      const auto errors = on_ranks(2, [&](std::uint64_t r, Collective c) {
        FakeRank m(model_units(), {{"master", DType::f32}, {"exp_avg", DType::f32}, {"exp_avg_sq", DType::f32},
                                   {"param", to}}, r, 2, true);
        load_checkpoint(tmp.path, m, c);
        // The saved bf16 value, widened exactly (fp32) or rounded again (fp16).
        const std::uint64_t bad = m.mismatches_with(3, [&](std::size_t unit, std::uint64_t i) {
          const float saved = zero::to_float(zero::from_float<zero::bf16>(formula(3, unit, i)));
          return to == DType::f32 ? saved : zero::to_float(zero::from_float<zero::fp16>(saved));
        });
        REQUIRE(bad == 0);
      });
      for (const auto& e : errors) REQUIRE(e.empty());
    }
  }
}

TEST_CASE("checkpoint: bad input is an error on every rank naming the file and the problem", "[checkpoint][errors]") {
  TempDir tmp;
  save_model(tmp.path, 3);
  const fs::path rank1 = tmp.path / "rank-1-of-3.safetensors";
  const std::string original = read_text(rank1);
  const std::string manifest = read_text(tmp.path / manifest_file_name);

  SECTION("a missing rank file") {
    fs::remove(rank1);
    require_error_everywhere(load_errors(tmp.path, 2), {"rank-1-of-3.safetensors", "does not exist"});
  }
  SECTION("a truncated rank file") {
    write_text(rank1, original.substr(0, original.size() - 10));
    require_error_everywhere(load_errors(tmp.path, 2), {"rank-1-of-3.safetensors", "(truncated)"});
  }
  SECTION("a flipped byte in the data") {
    std::string s = original;
    s[s.size() - 100] ^= 0x10;
    write_text(rank1, s);
    require_error_everywhere(load_errors(tmp.path, 2), {"rank-1-of-3.safetensors", "checksum mismatch in tensor"});
  }
  SECTION("a header that lies about offsets") {
    // Shift the second tensor's offsets by 4 bytes, keeping the file size.
    std::string s = original;
    const std::uint64_t n = zero::checkpoint::detail::le64(reinterpret_cast<const unsigned char*>(s.data()));
    nlohmann::ordered_json h = nlohmann::ordered_json::parse(s.substr(8, n));
    auto it = h.begin();
    ++it;
    ++it;  // past __metadata__ and the first tensor
    (*it)["data_offsets"][0] = (*it)["data_offsets"][0].get<std::uint64_t>() - 4;
    std::string text = h.dump();
    REQUIRE(text.size() <= n);
    text.append(n - text.size(), ' ');
    s.replace(8, n, text);
    write_text(rank1, s);
    require_error_everywhere(load_errors(tmp.path, 2), {"rank-1-of-3.safetensors", "data_offsets"});
  }
  SECTION("a manifest of another model") {
    auto units = model_units();
    units[2].params[1].name = "renamed";
    require_error_everywhere(load_errors(tmp.path, 2, "adamw", units), {"manifest.json", "another model", "renamed"});
    require_error_everywhere(load_errors(tmp.path, 2, "adamw", model_units(2)), {"manifest.json", "another model", "layer3"});
  }
  SECTION("another optimizer") {
    require_error_everywhere(load_errors(tmp.path, 2, "sgd"), {"manifest.json", "optimizer 'adamw'", "'sgd'"});
  }
  SECTION("an unknown format version") {
    auto j = nlohmann::json::parse(manifest);
    j["format_version"] = 7;
    write_text(tmp.path / manifest_file_name, j.dump());
    require_error_everywhere(load_errors(tmp.path, 2), {"manifest.json", "format version 7 is not supported"});
  }
  SECTION("corrupt JSON") {
    write_text(tmp.path / manifest_file_name, manifest.substr(0, 100));
    require_error_everywhere(load_errors(tmp.path, 2), {"manifest.json", "not valid JSON"});
  }
  SECTION("an empty directory") {
    TempDir empty;
    require_error_everywhere(load_errors(empty.path, 2), {empty.path.string(), "is empty"});
  }
  SECTION("a half-written directory (no manifest)") {
    fs::remove(tmp.path / manifest_file_name);
    require_error_everywhere(load_errors(tmp.path, 2), {tmp.path.string(), "holds no complete checkpoint"});
  }
  SECTION("nothing is written into the model when any rank fails") {
    std::string s = original;
    s[s.size() - 100] ^= 0x10;
    write_text(rank1, s);
    std::vector<std::uint64_t> untouched(4, 0);
    on_ranks(4, [&](std::uint64_t r, Collective c) {
      FakeRank m(model_units(), mixed_slots(), r, 4, true);
      m.fill(5);
      try {
        load_checkpoint(tmp.path, m, c);
      } catch (const zero::CheckpointError&) {
        untouched[r] = m.mismatches(0, 0, 5) == 0 && m.mismatches(1, 1, 5) == 0;
        throw;
      }
    });
    for (auto u : untouched) REQUIRE(u == 1);
  }
}

TEST_CASE("checkpoint: asynchronous saves, step directories and crash safety", "[checkpoint][async]") {
  TempDir tmp;
  const int n = 2;
  const auto errors = on_ranks(n, [&](std::uint64_t r, Collective c) {
    FakeRank m(model_units(), mixed_slots(), r, n, true);
    Checkpointer ck(c, small_chunks());
    m.fill(1);
    m.run_.step = 1;
    ck.save_step(tmp.path, m, true);
    m.fill(2);  // training goes on while the first save writes: it must keep step 1's values
    m.run_.step = 2;
    ck.save_step(tmp.path, m, true);  // waits for the first, which completes now
    REQUIRE(fs::exists(step_directory(tmp.path, 1) / manifest_file_name));
    ck.finish();
    REQUIRE(read_text(tmp.path / "latest") == "step-000000002\n");
    // A third save whose writer "crashes" before finish(): no manifest, so
    // it does not exist and the newest complete checkpoint is still step 2.
    m.fill(3);
    m.run_.step = 3;
    {
      Checkpointer crashing(c, small_chunks());
      crashing.save_step(tmp.path, m, true);
    }  // destroyed without finish(): the rank files may be there, the manifest is not
  });
  for (const auto& e : errors) REQUIRE(e.empty());
  REQUIRE(fs::exists(step_directory(tmp.path, 3)));
  REQUIRE_FALSE(fs::exists(step_directory(tmp.path, 3) / manifest_file_name));
  REQUIRE(*find_latest_checkpoint(tmp.path) == step_directory(tmp.path, 2));
  for (std::uint64_t step : {1, 2}) {
    const auto loaded = on_ranks(3, [&](std::uint64_t r, Collective c) {
      FakeRank m(model_units(), mixed_slots(), r, 3, true);
      const auto res = load_checkpoint(step == 2 ? tmp.path : step_directory(tmp.path, 1), m, c);
      REQUIRE(res.manifest.run.step == step);
      for (std::size_t s = 0; s < 4; ++s) REQUIRE(m.mismatches(s, s, step) == 0);
    });
    for (const auto& e : loaded) REQUIRE(e.empty());
  }
  // Saving again into a complete checkpoint's directory removes its manifest first.
  const auto again = on_ranks(2, [&](std::uint64_t r, Collective c) {
    FakeRank m(model_units(), mixed_slots(), r, 2, true);
    m.fill(4);
    m.run_.step = 2;
    Checkpointer ck(c, small_chunks());
    ck.save_step(tmp.path, m, true);
    if (r == 0) REQUIRE_FALSE(fs::exists(step_directory(tmp.path, 2) / manifest_file_name));
    ck.finish();
  });
  for (const auto& e : again) REQUIRE(e.empty());
  REQUIRE(parse_manifest(read_text(step_directory(tmp.path, 2) / manifest_file_name), "m").run.step == 2);
}

TEST_CASE("checkpoint: a process killed (SIGKILL) while saving leaves the newest complete checkpoint loadable",
          "[checkpoint][crash]") {
  TempDir tmp;
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {  // saves step after step until killed
    try {
      FakeRank m(model_units(40), mixed_slots(), 0, 1, true);
      SaveOptions o;
      o.checksum_chunk_bytes = 4096;
      Checkpointer ck(Collective{}, o);
      for (std::uint64_t step = 1;; ++step) {
        m.fill(step);
        m.run_.step = step;
        ck.save_step(tmp.path, m, step % 2 == 0);  // every other one in the background
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "saving child: %s\n", e.what());
    }
    std::_Exit(3);
  }
  // Kill it at some point after its first checkpoint, mid-save most likely.
  for (int i = 0; i < 2000 && !fs::exists(tmp.path / "latest"); ++i) ::usleep(5000);
  ::usleep(150000);
  ::kill(pid, SIGKILL);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFSIGNALED(status));
  const auto latest = find_latest_checkpoint(tmp.path);
  REQUIRE(latest.has_value());
  std::vector<std::uint64_t> steps(2);
  const auto errors = on_ranks(2, [&](std::uint64_t r, Collective c) {
    FakeRank m(model_units(40), mixed_slots(), r, 2, true);
    const auto res = load_checkpoint(tmp.path, m, c);
    steps[r] = res.manifest.run.step;
    for (std::size_t s = 0; s < 4; ++s) REQUIRE(m.mismatches(s, s, res.manifest.run.step) == 0);
  });
  for (const auto& e : errors) REQUIRE(e.empty());
  INFO("killed after step " << steps[0]);
  REQUIRE(steps[0] >= 1);
  REQUIRE(steps[0] == steps[1]);
}

TEST_CASE("checkpoint: ranks that pass different directories all stop", "[checkpoint][errors]") {
  TempDir tmp;
  const auto errors = on_ranks(2, [&](std::uint64_t r, Collective c) {
    FakeRank m(model_units(), mixed_slots(), r, 2, true);
    save_checkpoint(tmp.path / ("d" + std::to_string(r)), m, c);
  });
  require_error_everywhere(errors, {"saves to another directory than rank 0"});
}

namespace {
std::vector<HfTensor> hf_model(std::uint64_t scale, DType t = DType::f32) {
  return {{"embed.weight", {50 * scale, 40}, t}, {"h.0.bias", {40}, t}, {"h.0.weight", {40, 40 * scale}, t},
          {"head.weight", {7, 40}, DType::bf16}};
}
float hf_value(std::size_t tensor, std::uint64_t i) { return static_cast<float>(tensor) * 100.0f + static_cast<float>(i % 1000) * 0.125f; }
void hf_fill(const std::vector<HfTensor>& ts, std::size_t t, std::uint64_t first, std::uint64_t n, void* dst) {
  for (std::uint64_t i = 0; i < n; ++i) {
    const float v = hf_value(t, first + i);
    if (ts[t].dtype == DType::bf16) {
      const auto b = zero::from_float<zero::bf16>(v);
      std::memcpy(static_cast<char*>(dst) + 2 * i, &b, 2);
    } else {
      std::memcpy(static_cast<char*>(dst) + 4 * i, &v, 4);
    }
  }
}
std::uint64_t hf_bytes(const std::vector<HfTensor>& ts) {
  std::uint64_t b = 0;
  for (const auto& t : ts) b += TensorSpec{t.name, zero::checkpoint::tensor_type_of(t.dtype), t.shape}.bytes();
  return b;
}
}  // namespace

TEST_CASE("hugging face: sharded export, index, import by name", "[checkpoint][hf]") {
  TempDir tmp;
  const auto model = hf_model(2);
  HfExportOptions o;
  o.max_shard_bytes = 13000;
  o.buffer_bytes = 1000;
  const auto res = hf_export(tmp.path, model, [&](std::size_t t, std::uint64_t f, std::uint64_t n, void* d) {
    REQUIRE(n * zero::dtype_bytes(model[t].dtype) <= 1000);
    hf_fill(model, t, f, n, d);
  }, o);
  REQUIRE(res.files.size() == 3);  // 16000 | 160 + 12800 | 560 bytes
  REQUIRE(res.files[0] == "model-00001-of-00003.safetensors");
  REQUIRE(res.total_size == hf_bytes(model));
  const auto index = nlohmann::json::parse(read_text(tmp.path / hf_index_file_name));
  REQUIRE(index["metadata"]["total_size"] == hf_bytes(model));
  REQUIRE(index["weight_map"]["h.0.weight"] == "model-00002-of-00003.safetensors");
  for (const auto& f : res.files) REQUIRE(SafetensorsReader(tmp.path / f).metadata().at("format") == "pt");

  // Import every tensor as fp32 (head.weight converted from bf16) and compare.
  auto want = model;
  for (auto& t : want) t.dtype = DType::f32;
  std::uint64_t checked = 0, bad = 0;
  hf_import(tmp.path, want, [&](std::size_t t, std::uint64_t first, std::uint64_t n, const void* src) {
    for (std::uint64_t i = 0; i < n; ++i) {
      float v;
      std::memcpy(&v, static_cast<const char*>(src) + 4 * i, 4);
      float ref = hf_value(t, first + i);
      if (model[t].dtype == DType::bf16) ref = zero::to_float(zero::from_float<zero::bf16>(ref));
      bad += v != ref;
      ++checked;
    }
  }, 512);
  REQUIRE(bad == 0);
  REQUIRE(checked == 50 * 2 * 40 + 40 + 40 * 80 + 7 * 40);

  // Errors: a name the files lack, a shape that differs.
  auto missing = want;
  missing[1].name = "h.0.bias_x";
  REQUIRE_THROWS_WITH(hf_import(tmp.path, missing, [](auto...) {}),
                      Catch::Contains(hf_index_file_name) && Catch::Contains("has no tensor named 'h.0.bias_x'"));
  auto reshaped = want;
  reshaped[2].shape = {80, 40};
  REQUIRE_THROWS_WITH(hf_import(tmp.path, reshaped, [](auto...) {}),
                      Catch::Contains("model-00002-of-00003.safetensors") &&
                          Catch::Contains("tensor 'h.0.weight' has shape [40, 80], the model expects [80, 40]"));

  auto twice = model;
  twice[3].name = "h.0.bias";
  REQUIRE_THROWS_WITH(hf_export(tmp.path / "twice", twice, [](auto...) {}), Catch::Contains("two tensors are named 'h.0.bias'"));

  // A single file works the same way.
  const auto single = hf_model(1);
  HfExportOptions big;
  TempDir one;
  hf_export(one.path, single, [&](std::size_t t, std::uint64_t f, std::uint64_t n, void* d) { hf_fill(single, t, f, n, d); }, big);
  HfReader r(one.path / "model-00001-of-00001.safetensors");
  REQUIRE(r.names().size() == 4);
  float v = 0;
  r.read("h.0.weight", 123, 1, DType::f32, &v);
  REQUIRE(v == hf_value(2, 123));
}

// Runs fn in a child process (a fresh peak) and says whether it raised the
// peak resident set by less than limit_kib (printing by how much, as `what`).
template <class Fn>
bool child_peak_growth_below(long limit_kib, const char* what, Fn&& fn) {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    auto status_kib = [](const std::string& key) {  // a line of /proc/self/status, in KiB
      std::ifstream in("/proc/self/status");
      std::string line;
      while (std::getline(in, line))
        if (line.rfind(key, 0) == 0) return std::stol(line.substr(key.size()));
      return -1L;
    };
    // Reset the peak to the present (Linux >= 4.0: writing 5 to clear_refs).
    { std::ofstream("/proc/self/clear_refs") << "5"; }
    const long before = status_kib("VmRSS:");
    fn();
    const long growth = status_kib("VmHWM:") - before;
    std::printf("%s: peak RSS grew by %ld KiB\n", what, growth);
    std::fflush(stdout);
    std::_Exit(growth >= 0 && growth < limit_kib ? 0 : 1);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  return WEXITSTATUS(status) == 0;
}

TEST_CASE("hugging face: export streams in bounded memory", "[checkpoint][hf][memory]") {
  // A model of 128 MiB through a 4 MiB buffer must raise the peak resident
  // set by far less than the model.
  TempDir tmp;
  CHECK(child_peak_growth_below(16 * 1024, "hf_export of 128 MiB through a 4 MiB buffer", [&] {
    const std::vector<HfTensor> model = {{"a", {16 << 20}, DType::f32}, {"b", {16 << 20}, DType::f32}};
    HfExportOptions o;
    o.buffer_bytes = 4 << 20;
    o.max_shard_bytes = 48 << 20;
    hf_export(tmp.path, model, [](std::size_t, std::uint64_t first, std::uint64_t n, void* d) {
      for (std::uint64_t i = 0; i < n; ++i) static_cast<float*>(d)[i] = static_cast<float>(first + i);
    }, o);
  }));
  REQUIRE(fs::file_size(tmp.path / "model-00002-of-00002.safetensors") > (64u << 20));
}

TEST_CASE("hugging face: a checkpoint exports in bounded memory, without the program that saved it",
          "[checkpoint][hf][memory]") {
  // A master of 64 MiB saved by 3 ranks, its largest unit 64 MiB: the export
  // reads it through one 4 MiB buffer and writes through another.
  TempDir tmp;
  const auto units = model_units(6711);  // layer3: 16.8M elements
  const std::vector<SlotDesc> slots = {{"master", DType::f32, true}};
  {
    zero::comm::LocalGroup group(3);
    group.run([&](zero::comm::Local& c) {
      FakeRank rank(units, slots, static_cast<std::uint64_t>(c.rank()), 3, true);
      rank.fill();
      save_checkpoint(tmp.path / "ckpt", rank, make_collective(c));
    });
  }
  CHECK(child_peak_growth_below(16 * 1024, "hf_export_checkpoint of a 64 MiB master through 4 MiB buffers", [&] {
    HfExportOptions o;
    o.buffer_bytes = 4 << 20;
    hf_export_checkpoint(tmp.path / "ckpt", tmp.path / "hf", DType::f32, o);
  }));
  // Every parameter, named and shaped as registered, holds its master values.
  HfReader hf(tmp.path / "hf");
  std::vector<float> v;
  for (std::size_t u = 0; u < units.size(); ++u)
    for (const ParamDesc& p : units[u].params) {
      INFO(p.name);
      CHECK(hf.tensor(p.name).shape == (p.shape.empty() ? zero::Shape{p.numel} : p.shape));
      v.resize(p.numel);
      hf.read(p.name, 0, p.numel, DType::f32, v.data());
      std::uint64_t bad = 0;
      for (std::uint64_t i = 0; i < p.numel; ++i) bad += v[i] != formula(0, u, p.offset + i);
      CHECK(bad == 0);
    }
  CHECK(hf.tensor("layer0.w0").shape == zero::Shape{20, 15});
}

// Not run by default: writes a checkpoint and an export for
// tests/checkpoint/check_files.py (an independent reader) into $ZERO_CHECKPOINT_OUT.
TEST_CASE("files for the independent reader", "[.python]") {
  const char* out = std::getenv("ZERO_CHECKPOINT_OUT");
  REQUIRE(out != nullptr);
  const fs::path root = out;
  save_model(root / "checkpoint", 3);
  const auto model = hf_model(1);
  HfExportOptions o;
  o.max_shard_bytes = 10000;
  hf_export(root / "hf", model, [&](std::size_t t, std::uint64_t f, std::uint64_t n, void* d) { hf_fill(model, t, f, n, d); }, o);
}

namespace {

// A FakeRank whose read() fails on rank `failing` with an exception that is
// not the library's (a std::filesystem or JSON error in a user's source).
class ThrowingRank : public FakeRank {
 public:
  ThrowingRank(std::uint64_t rank, std::uint64_t ranks, std::uint64_t failing)
      : FakeRank(model_units(), mixed_slots(), rank, ranks, true), throws_(rank == failing) {}
  void read(std::size_t slot, const OwnedRange& r, void* dst) const override {
    if (throws_) throw std::out_of_range("the source's own failure");
    FakeRank::read(slot, r, dst);
  }

 private:
  bool throws_;
};

// Each rank's zero::Error message; another exception is marked as such.
template <class Fn>
std::vector<std::string> any_errors(int ranks, Fn&& fn) {
  return zero::test::rank_errors(
      ranks, [&](zero::comm::Local& comm) { fn(static_cast<std::uint64_t>(comm.rank()), make_collective(comm)); });
}

}  // namespace

TEST_CASE("checkpoint: an error that is not the library's becomes a zero::Error on every rank, naming the directory",
          "[checkpoint][errors]") {
  TempDir tmp;
  for (const bool async : {false, true}) {
    INFO("async " << async);
    const auto errors = any_errors(2, [&](std::uint64_t r, Collective c) {
      ThrowingRank m(r, 2, 1);
      Checkpointer ck(c, small_chunks());
      ck.save(tmp.path, m, async);
      ck.finish();
    });
    CHECK(errors[1] == tmp.path.string() + ": " + (async ? "copying the state" : "writing the rank files") +
                           " failed on rank 1: the source's own failure");
    CHECK_THAT(errors[0], Catch::StartsWith(tmp.path.string()) && Catch::Contains("failed on rank(s) 1"));
  }
  // Names the files cannot hold, from a source that is not the engine's
  // Layout: refused before anything is written (was: nlohmann's
  // type_error.316 on rank 0 when the manifest was written).
  auto units = model_units();
  units[1].params[0].name = "layer1.\xC3";
  const auto errors = any_errors(2, [&](std::uint64_t r, Collective c) {
    FakeRank m(units, mixed_slots(), r, 2, true);
    Checkpointer(c, small_chunks()).save(tmp.path / "names", m);
  });
  for (const auto& e : errors)
    CHECK_THAT(e, Catch::Contains("the parameter name 'layer1.\\xC3' is not valid UTF-8 (byte 7)"));
  CHECK_FALSE(fs::exists(tmp.path / "names" / manifest_file_name));
}

TEST_CASE("checkpoint: two state slots of one name are refused before anything is written", "[checkpoint][errors]") {
  TempDir tmp;
  // An optimizer policy whose state_names repeat, or name "master".
  const std::vector<SlotDesc> slots = {{"master", DType::f32, true}, {"exp_avg", DType::f32, true},
                                       {"master", DType::f32, true}};
  const auto errors = any_errors(2, [&](std::uint64_t r, Collective c) {
    FakeRank m(model_units(), slots, r, 2, true);
    Checkpointer(c, small_chunks()).save(tmp.path / "dup", m);
  });
  for (const auto& e : errors) CHECK_THAT(e, Catch::Contains("two state slots are named 'master'"));
  CHECK_FALSE(fs::exists(tmp.path / "dup"));
}

TEST_CASE("one element type for values: zero::DType in slots, exports and reads; file tags compare to it",
          "[checkpoint][dtype]") {
  static_assert(TensorType::BF16 == DType::bf16 && DType::f32 == TensorType::F32 && TensorType::I64 != DType::u64);
  static_assert(std::is_same_v<decltype(zero::checkpoint::SavedSlot::dtype), DType>);
  static_assert(std::is_same_v<decltype(HfTensor::dtype), DType>);
  TempDir tmp;
  save_model(tmp.path / "ckpt", 2);
  CheckpointReader reader(tmp.path / "ckpt");
  // A slot's type goes straight into a read and an export: no conversion.
  const auto& slot = reader.manifest().slots[reader.manifest().slot_index("param")];
  CHECK(slot.dtype == DType::bf16);
  std::vector<zero::bf16> low(4);
  reader.read(reader.manifest().slot_index("param"), 0, 0, 4, low.data(), slot.dtype);
  hf_export_checkpoint(tmp.path / "ckpt", tmp.path / "hf", DType::bf16);
  const HfReader hf(tmp.path / "hf");
  CHECK(hf.tensor("layer0.w0").dtype == DType::bf16);
  std::vector<float> v(4);
  hf.read("layer0.w0", 0, 4, DType::f32, v.data());
  CHECK(v[0] == zero::to_float(zero::from_float<zero::bf16>(formula(0, 0, 0))));
  CHECK_THROWS_WITH(hf_export_checkpoint(tmp.path / "ckpt", tmp.path / "x", DType::u64),
                    Catch::Contains("export as fp32, bf16 or fp16, not u64"));
}
