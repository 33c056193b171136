// Why: a checkpoint is only worth its resume. A run saved after k steps and
// resumed in a fresh optimizer with the same configuration must continue bit
// for bit (master, every state slot, 16-bit parameters with stochastic
// rounding, step counter, loss scaler); a checkpoint saved with N ranks at
// one stage, or from another offload tier, must load on M ranks at another
// stage with every master value where it belongs; and loading into another
// optimizer is an error on every rank.
#include <catch2/catch.hpp>

#include <stdlib.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "../engine/late_copies.hpp"
#include "../engine/reference.hpp"
#include "optimizer_fixture.hpp"
#include "rank_errors.hpp"
#include "zero/checkpoint/hugging_face.hpp"
#include "zero/checkpoint/optimizer_io.hpp"
#include "zero/offload/disk_state_store.hpp"
#include "zero/zero.hpp"

namespace {
namespace fs = std::filesystem;
using zero::bf16;
using zero::fp16;
using namespace zero::precision;
using namespace zero::test::ckpt;
}  // namespace

TEMPLATE_TEST_CASE("a resumed run continues bit for bit", "[checkpoint][resume]",
                   (zero::ZeroOptimizer<Mixed<bf16>, zero::optim::AdamW, zero::stage<2>>),
                   (zero::ZeroOptimizer<Mixed<fp16>, zero::optim::Adam, zero::stage<3>>),
                   (zero::ZeroOptimizer<Full<float>, zero::optim::Sgd, zero::stage<1>>),
                   (zero::ZeroOptimizer<Mixed<bf16>, zero::optim::Adam, zero::stage<0>>)) {
  using Opt = TestType;
  TempDir dir;
  const zero::Options options = options_for<Opt>();
  const auto hyper = zero::test::test_hyper<typename Opt::optimizer_policy>();
  const int ranks = 2;
  std::vector<Final> uninterrupted(ranks), resumed(ranks);
  std::vector<std::string> errors(ranks);
  zero::comm::LocalGroup group(ranks);
  group.run([&](zero::comm::Local& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    {
      Opt opt(c, hyper, options);
      build(opt, true);
      train_steps(opt, c.rank(), 1, 4);
      opt.save((dir.path / "step-4").string());
      train_steps(opt, c.rank(), 5, 7);
      uninterrupted[r] = final_state(opt);
    }
    Opt fresh(c, hyper, options);
    build(fresh, false);  // no set_param: everything comes from the checkpoint
    const auto loaded = fresh.load(dir.path.string());
    if (loaded.manifest.run.step != 4) errors[r] = "step " + std::to_string(loaded.manifest.run.step);
    train_steps(fresh, c.rank(), 5, 7);
    resumed[r] = final_state(fresh);
  });
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r);
    CHECK(errors[r].empty());
    CHECK(resumed[r].masters == uninterrupted[r].masters);
    CHECK(resumed[r].params == uninterrupted[r].params);
    CHECK(resumed[r].steps == uninterrupted[r].steps);
    CHECK(resumed[r].loss_scale == uninterrupted[r].loss_scale);
  }
}

TEST_CASE("stage 3: load with a unit acquired is refused, naming the unit, and nothing is lost",
          "[checkpoint][errors]") {
  using Opt = zero::ZeroOptimizer<Mixed<bf16>, zero::optim::AdamW, zero::stage<3>>;
  TempDir dir;
  const zero::Options options = options_for<Opt>();
  const auto hyper = zero::test::test_hyper<zero::optim::AdamW>();
  const int ranks = 2;
  std::vector<std::string> errors(ranks);
  std::vector<std::vector<float>> saved(ranks), loaded(ranks);
  zero::comm::LocalGroup group(ranks);
  group.run([&](zero::comm::Local& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    Opt opt(c, hyper, options);
    build(opt, true);
    train_steps(opt, c.rank(), 1, 2);
    opt.save((dir.path / "ckpt").string());
    saved[r] = forward_params(opt);
    train_steps(opt, c.rank(), 3, 3);
    opt.acquire_unit(zero::UnitId{1});
    try {
      opt.load((dir.path / "ckpt").string());
    } catch (const zero::InvalidArgument& e) {
      errors[r] = e.what();
    }
    opt.release_unit(zero::UnitId{1});  // the acquisition survived the refusal
    opt.load((dir.path / "ckpt").string());
    loaded[r] = forward_params(opt);
  });
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r);
    CHECK_THAT(errors[static_cast<std::size_t>(r)],
               Catch::Contains("load: unit 'block1' is acquired") && Catch::Contains("release_unit()"));
    CHECK(loaded[static_cast<std::size_t>(r)] == saved[static_cast<std::size_t>(r)]);
  }
}

TEST_CASE("a checkpoint loads on another rank count, stage and offload tier", "[checkpoint][reshard]") {
  using Saved = zero::ZeroOptimizer<Mixed<bf16>, zero::optim::AdamW, zero::stage<2>, zero::offload::Nvme>;
  TempDir dir, swap;
  zero::Options options = options_for<Saved>();
  options.nvme.directory = swap.path.string();
  const auto hyper = zero::test::test_hyper<zero::optim::AdamW>();
  std::vector<float> saved_masters, saved_params;
  {
    zero::comm::LocalGroup group(3);
    group.run([&](zero::comm::Local& c) {
      Saved opt(c, hyper, options);
      build(opt, true);
      train_steps(opt, c.rank(), 1, 3);
      opt.save((dir.path / "ckpt").string());
      const Final f = final_state(opt);
      if (c.rank() == 0) {
        saved_masters = unpadded(opt.layout(), f.masters);
        saved_params = unpadded(opt.layout(), f.params);
      }
    });
  }
  auto check_loaded = [&](auto tag, int ranks, bool fp32) {
    using Opt = typename decltype(tag)::type;
    std::vector<std::vector<float>> masters(static_cast<std::size_t>(ranks)), params(masters.size()),
        forward(masters.size());
    TempDir resumed_swap;
    zero::Options resumed_options = options_for<Opt>();  // (stochastic rounding for bf16 copies only)
    resumed_options.nvme.directory = resumed_swap.path.string();
    zero::comm::LocalGroup group(ranks);
    group.run([&](zero::comm::Local& c) {
      Opt opt(c, hyper, resumed_options);
      build(opt, false);
      opt.load((dir.path / "ckpt").string());
      const Final f = final_state(opt);
      masters[static_cast<std::size_t>(c.rank())] = unpadded(opt.layout(), f.masters);
      params[static_cast<std::size_t>(c.rank())] = unpadded(opt.layout(), f.params);
      forward[static_cast<std::size_t>(c.rank())] = unpadded(opt.layout(), forward_params(opt));
      train_steps(opt, c.rank(), 4, 4);  // and it trains on
    });
    for (int r = 0; r < ranks; ++r) {
      INFO(ranks << " rank(s), rank " << r << ", " << Opt::offload_policy::name);
      CHECK(masters[static_cast<std::size_t>(r)] == saved_masters);
      // The 16-bit copy is the saved one, or (fp32) the master itself; and
      // it is what forward reads.
      CHECK(params[static_cast<std::size_t>(r)] == (fp32 ? saved_masters : saved_params));
      CHECK(forward[static_cast<std::size_t>(r)] == (fp32 ? saved_masters : saved_params));
    }
  };
  check_loaded(std::type_identity<zero::ZeroOptimizer<Mixed<bf16>, zero::optim::AdamW, zero::stage<3>>>{}, 2, false);
  check_loaded(std::type_identity<zero::ZeroOptimizer<Mixed<bf16>, zero::optim::AdamW, zero::stage<0>>>{}, 1, false);
  check_loaded(std::type_identity<zero::ZeroOptimizer<Full<float>, zero::optim::AdamW, zero::stage<1>>>{}, 4, true);
  // fp32 whose parameters are a working copy of the master (offload): they
  // must come from the loaded master, not stay the fresh optimizer's.
  check_loaded(std::type_identity<zero::ZeroOptimizer<Full<float>, zero::optim::AdamW, zero::stage<3>,
                                                      zero::offload::Nvme>>{},
               2, true);
  check_loaded(std::type_identity<zero::ZeroOptimizer<Full<float>, zero::optim::AdamW, zero::stage<2>,
                                                      zero::offload::Cpu, zero::backend::LateCopies>>{},
               3, true);
}

TEST_CASE("loading into another optimizer is an error on every rank", "[checkpoint][errors]") {
  TempDir dir;
  const zero::Options options;
  std::vector<std::string> errors(2);
  zero::comm::LocalGroup group(2);
  group.run([&](zero::comm::Local& c) {
    {
      zero::ZeroOptimizer<Mixed<bf16>, zero::optim::AdamW, zero::stage<2>> opt(
          c, zero::test::test_hyper<zero::optim::AdamW>(), options);
      build(opt, true);
      opt.save(dir.path.string() + "/a");
    }
    zero::ZeroOptimizer<Mixed<bf16>, zero::optim::Sgd, zero::stage<2>> other(
        c, zero::test::test_hyper<zero::optim::Sgd>(), options);
    build(other, false);
    try {
      other.load(dir.path.string() + "/a");
    } catch (const zero::Error& e) {
      errors[static_cast<std::size_t>(c.rank())] = e.what();
    }
  });
  for (const auto& e : errors) CHECK_THAT(e, Catch::Contains("adamw") && Catch::Contains("sgd"));
}

namespace {

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The parameters' fp32 masters, unpadded, per parameter.
template <class Opt>
std::vector<std::vector<float>> param_masters(Opt& opt) {
  std::vector<std::vector<float>> out;
  for (std::size_t p = 0; p < opt.layout().params().size(); ++p) out.push_back(opt.master_values(zero::ParamId{p}));
  return out;
}

std::vector<float> hf_values(const zero::checkpoint::HfReader& r, const std::string& name) {
  const auto& t = r.tensor(name);
  std::vector<float> v(t.numel());
  r.read(name, 0, v.size(), zero::DType::f32, v.data());
  return v;
}

}  // namespace

TEST_CASE("shapes given at add_param: checked, kept in the manifest, exported and imported", "[checkpoint][shape][hf]") {
  using Opt = zero::ZeroOptimizer<Mixed<bf16>, zero::optim::AdamW, zero::stage<3>>;
  using zero::checkpoint::TensorType;
  const auto hyper = zero::test::test_hyper<zero::optim::AdamW>();
  const zero::Options options = options_for<Opt>();
  {
    zero::comm::LocalGroup group(1);
    group.run([&](zero::comm::Local& c) {
      Opt opt(c, hyper, options);
      const auto u = opt.add_unit("fc");
      REQUIRE_THROWS_MATCHES(opt.add_param(u, "fc.weight", 700, {28, 24}), zero::Error,
                             Catch::Matchers::Message("add_param: parameter 'fc.weight' has 700 elements but its shape "
                                                      "[28, 24] holds 672; give the shape of exactly those elements (or "
                                                      "none: flat)"));
      REQUIRE_THROWS_WITH(opt.add_param(u, "fc.huge", 8, {1ull << 32, 1ull << 32, 2}),
                          Catch::Contains("'fc.huge'") && Catch::Contains("more than 2^64"));
      CHECK(opt.layout().params().empty());
      const auto w = opt.add_param(u, "fc.weight", 700, {28, 25});
      CHECK(opt.layout().param(w).shape == zero::Shape{28, 25});
    });
  }
  TempDir dir;
  std::vector<std::vector<float>> saved;
  {
    zero::comm::LocalGroup group(2);
    group.run([&](zero::comm::Local& c) {
      Opt opt(c, hyper, options);
      build(opt, true, true);
      train_steps(opt, c.rank(), 1, 2);
      opt.save((dir.path / "ckpt").string());
      auto m = param_masters(opt);
      if (c.rank() == 0) saved = std::move(m);
    });
  }
  const auto manifest_path = dir.path / "ckpt" / zero::checkpoint::manifest_file_name;
  const auto manifest = zero::checkpoint::parse_manifest(file_bytes(manifest_path), manifest_path);
  REQUIRE(manifest.units.size() == 3);
  for (std::size_t u = 0; u < 3; ++u) CHECK(manifest.units[u].params[0].shape == kShapes[u]);

  // Exported by name with the registered shapes (flat where none was
  // given), fp32 exactly the master, bf16 the master rounded to nearest even.
  zero::checkpoint::HfExportOptions small;
  small.max_shard_bytes = 3000;  // w0 (2800 bytes) alone, then w1 (5204 bytes) alone, then w2
  small.buffer_bytes = 1000;
  const auto result = zero::checkpoint::hf_export_checkpoint(dir.path / "ckpt", dir.path / "hf", zero::DType::f32, small);
  CHECK(result.files.size() == 3);
  CHECK(result.total_size == 4 * (700 + 1301 + 257));
  zero::checkpoint::hf_export_checkpoint(dir.path / "ckpt", dir.path / "hf-bf16", zero::DType::bf16);
  zero::checkpoint::HfReader hf(dir.path / "hf"), hf16(dir.path / "hf-bf16");
  const zero::Shape exported[] = {{7, 4, 25}, {1301}, {257}};
  for (std::size_t p = 0; p < 3; ++p) {
    const std::string name = "w" + std::to_string(p);
    INFO(name);
    CHECK(hf.tensor(name).shape == exported[p]);
    CHECK(hf.tensor(name).dtype == TensorType::F32);
    CHECK(hf_values(hf, name) == saved[p]);
    CHECK(hf16.tensor(name).dtype == TensorType::BF16);
    std::vector<float> rounded;
    for (float x : saved[p]) rounded.push_back(zero::to_float(zero::from_float<bf16>(x)));
    CHECK(hf_values(hf16, name) == rounded);
  }

  // Imported by name into a fresh model on another rank count and stage.
  std::vector<std::string> errors(3);
  std::vector<std::vector<std::vector<float>>> imported(3);
  {
    zero::comm::LocalGroup group(3);
    group.run([&](zero::comm::Local& c) {
      const auto r = static_cast<std::size_t>(c.rank());
      zero::ZeroOptimizer<Full<float>, zero::optim::Sgd, zero::stage<2>> opt(
          c, zero::test::test_hyper<zero::optim::Sgd>(), zero::Options{});
      build(opt, false, true);
      opt.load_hf((dir.path / "hf" / zero::checkpoint::hf_index_file_name).string());
      imported[r] = param_masters(opt);
      // A model registered flat takes any shape of its element count.
      zero::ZeroOptimizer<Mixed<bf16>, zero::optim::AdamW, zero::stage<1>> flat(c, hyper, zero::Options{});
      build(flat, false, false);
      flat.load_hf((dir.path / "hf").string());
      if (param_masters(flat) != saved) errors[r] = "the flat model imported other values";
    });
  }
  for (std::size_t r = 0; r < 3; ++r) {
    CHECK(errors[r].empty());
    CHECK(imported[r] == saved);
  }

  // A shape or a name the file set does not have: an error on every rank,
  // naming the tensor and both shapes, and no parameter changed.
  auto import_error = [&](auto register_params) {
    std::vector<std::string> what(2);
    zero::comm::LocalGroup group(2);
    group.run([&](zero::comm::Local& c) {
      Opt opt(c, hyper, options);
      register_params(opt);
      opt.finalize();
      const auto before = param_masters(opt);
      try {
        opt.load_hf((dir.path / "hf").string());
      } catch (const zero::Error& e) {
        what[static_cast<std::size_t>(c.rank())] = e.what();
      }
      if (param_masters(opt) != before) what[static_cast<std::size_t>(c.rank())] += " (and parameters changed)";
    });
    CHECK(what[0] == what[1]);
    return what[0];
  };
  CHECK_THAT(import_error([](Opt& opt) {
               opt.add_param(opt.add_unit("block0"), "w0", 700, {28, 25});
               opt.add_param(opt.add_unit("block1"), "w1", 1301);
             }),
             Catch::Contains("model-00001-of-00003.safetensors") &&
                 Catch::EndsWith("tensor 'w0' has shape [7, 4, 25], the model expects [28, 25]"));
  CHECK_THAT(import_error([](Opt& opt) { opt.add_param(opt.add_unit("block1"), "w1", 1300); }),
             Catch::EndsWith("tensor 'w1' has shape [1301], the model expects [1300]"));
  CHECK_THAT(import_error([](Opt& opt) { opt.add_param(opt.add_unit("u"), "w9", 5); }),
             Catch::Contains("has no tensor named 'w9'"));

  // Loading the checkpoint into a model of another shape is an error naming
  // both; a manifest from before shapes (none recorded) loads into a shaped model.
  std::vector<std::string> load_errors(1);
  std::vector<std::vector<float>> from_old;
  {
    nlohmann::json j = nlohmann::json::parse(file_bytes(manifest_path));
    for (auto& u : j["units"])
      for (auto& p : u["params"]) p.erase("shape");
    fs::copy(dir.path / "ckpt", dir.path / "old");
    zero::checkpoint::write_file_atomically(dir.path / "old" / zero::checkpoint::manifest_file_name, j.dump());
    zero::comm::LocalGroup group(1);
    group.run([&](zero::comm::Local& c) {
      Opt other(c, hyper, options);
      other.add_param(other.add_unit("block0"), "w0", 700, {28, 25});
      other.add_param(other.add_unit("block1"), "w1", 1301);
      other.add_param(other.add_unit("block2"), "w2", 257);
      other.finalize();
      try {
        other.load((dir.path / "ckpt").string());
      } catch (const zero::Error& e) {
        load_errors[0] = e.what();
      }
      Opt opt(c, hyper, options);
      build(opt, false, true);
      opt.load((dir.path / "old").string());
      from_old = param_masters(opt);
    });
  }
  CHECK_THAT(load_errors[0], Catch::Contains("is a checkpoint of another model: parameter 0 of unit 'block0' is 'w0' "
                                             "(700 elements at 0, shape [7, 4, 25]) there, 'w0' (700 elements at 0, "
                                             "shape [28, 25]) here"));
  CHECK(from_old == saved);
}

TEST_CASE("an asynchronous save returns before it is written and equals a synchronous one byte for byte",
          "[checkpoint][async]") {
  using Opt = zero::ZeroOptimizer<Mixed<bf16>, zero::optim::AdamW, zero::stage<2>>;
  TempDir dir;
  const zero::Options options = options_for<Opt>();
  const auto hyper = zero::test::test_hyper<zero::optim::AdamW>();
  const fs::path async_dir = dir.path / "async", sync_dir = dir.path / "sync";
  const fs::path async_manifest = async_dir / zero::checkpoint::manifest_file_name;
  std::vector<std::string> errors(2);
  std::vector<Final> continued(2), reference(2);
  zero::comm::LocalGroup group(2);
  group.run([&](zero::comm::Local& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    auto expect = [&](bool ok, const char* what) {
      if (!ok && errors[r].empty()) errors[r] = what;
    };
    {
      Opt opt(c, hyper, options);
      build(opt, true);
      train_steps(opt, c.rank(), 1, 3);
      opt.save(async_dir.string(), {.async = true});
      // The checkpoint does not exist yet (its manifest comes at completion),
      // and training goes on while the rank files are written.
      expect(!fs::exists(async_manifest), "the manifest exists before the save completed");
      train_steps(opt, c.rank(), 4, 6);
      expect(!fs::exists(async_manifest), "the manifest appeared before wait_save");
      opt.wait_save();
      expect(fs::exists(async_manifest), "no manifest after wait_save");
      continued[r] = final_state(opt);
      // A second save waits for the first; the destructor completes the last.
      opt.save((dir.path / "a1").string(), {.async = true});
      opt.save((dir.path / "a2").string(), {.async = true});
      expect(fs::exists(dir.path / "a1" / zero::checkpoint::manifest_file_name), "the second save did not complete the first");
    }
    expect(fs::exists(dir.path / "a2" / zero::checkpoint::manifest_file_name), "the destructor did not complete the save");
    {
      Opt opt(c, hyper, options);
      build(opt, true);
      train_steps(opt, c.rank(), 1, 3);
      opt.save(sync_dir.string());
      train_steps(opt, c.rank(), 4, 6);
      reference[r] = final_state(opt);
      // load completes a save in flight first (here: of the state it loads).
      opt.save((dir.path / "a3").string(), {.async = true});
      const auto loaded = opt.load((dir.path / "a3").string());
      expect(loaded.manifest.run.step == 6, "load did not read the save it completed");
    }
  });
  for (std::size_t r = 0; r < 2; ++r) {
    INFO("rank " << r);
    CHECK(errors[r].empty());
    CHECK(continued[r].masters == reference[r].masters);  // the snapshot did not disturb training
    CHECK(continued[r].params == reference[r].params);
  }
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(sync_dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"manifest.json", "rank-0-of-2.json", "rank-0-of-2.safetensors",
                                          "rank-1-of-2.json", "rank-1-of-2.safetensors"});
  for (const auto& name : names) {
    INFO(name);
    REQUIRE(fs::exists(async_dir / name));
    CHECK(file_bytes(async_dir / name) == file_bytes(sync_dir / name));
  }
}

TEST_CASE("keep_last keeps the newest complete step checkpoints only", "[checkpoint][retention]") {
  using Opt = zero::ZeroOptimizer<Full<float>, zero::optim::Sgd, zero::stage<1>>;
  using Io = zero::checkpoint::OptimizerIo<Opt>;
  TempDir dir;
  const auto hyper = zero::test::test_hyper<zero::optim::Sgd>();
  fs::create_directories(dir.path / "step-000000000");  // an interrupted save (no manifest), older
  fs::create_directories(dir.path / "step-000000099");  // newer than any complete one: left alone
  std::vector<std::vector<std::string>> listings;
  zero::comm::LocalGroup group(2);
  group.run([&](zero::comm::Local& c) {
    Opt opt(c, hyper, zero::Options{});
    build(opt, true);
    Io::SaveOptions keep2;
    keep2.io.keep_last = 2;
    for (int step = 1; step <= 4; ++step) {
      train_steps(opt, c.rank(), step, step);
      Io::save_step(opt, dir.path.string(), keep2);
      if (c.rank() == 0) {
        std::vector<std::string> names;
        for (const auto& e : fs::directory_iterator(dir.path)) names.push_back(e.path().filename().string());
        std::sort(names.begin(), names.end());
        listings.push_back(names);
      }
    }
    keep2.async = true;
    keep2.io.keep_last = 1;
    train_steps(opt, c.rank(), 5, 5);
    Io::save_step(opt, dir.path.string(), keep2);
    opt.wait_save();
    if (c.rank() == 0) {
      std::vector<std::string> names;
      for (const auto& e : fs::directory_iterator(dir.path)) names.push_back(e.path().filename().string());
      std::sort(names.begin(), names.end());
      listings.push_back(names);
    }
  });
  REQUIRE(listings.size() == 5);
  using V = std::vector<std::string>;
  CHECK(listings[0] == V{"latest", "step-000000001", "step-000000099"});
  CHECK(listings[1] == V{"latest", "step-000000001", "step-000000002", "step-000000099"});
  CHECK(listings[2] == V{"latest", "step-000000002", "step-000000003", "step-000000099"});
  CHECK(listings[3] == V{"latest", "step-000000003", "step-000000004", "step-000000099"});
  CHECK(listings[4] == V{"latest", "step-000000005", "step-000000099"});
  CHECK(file_bytes(dir.path / "latest") == "step-000000005\n");
  CHECK_THROWS_WITH(zero::checkpoint::Checkpointer::remove_old_checkpoints(dir.path, 0),
                    Catch::Contains("keep must be at least 1"));
}

TEST_CASE("save or load on one rank only: the error names the call each rank was in", "[checkpoint][errors]") {
  using Opt = zero::ZeroOptimizer<Full<float>, zero::optim::AdamW, zero::stage<2>, zero::offload::None,
                                  zero::backend::Host>;
  TempDir dir;
  for (const bool loading : {false, true}) {
    std::vector<std::string> messages(2);
    zero::comm::LocalGroup group(2);
    group.run([&](zero::comm::Local& c) {
      Opt opt(c, {}, zero::Options{});
      build(opt, true);
      train_steps(opt, c.rank(), 1, 1);
      if (loading) opt.save(dir.path.string());  // (by both ranks)
      try {
        if (c.rank() == 0) {
          if (loading)
            opt.load(dir.path.string());
          else
            opt.save(dir.path.string());
        } else {
          train_steps(opt, c.rank(), 2, 2);  // rank 1 trains on instead
        }
      } catch (const zero::CommError& e) {
        messages[static_cast<std::size_t>(c.rank())] = e.what();
      }
    });
    for (const auto& m : messages) {
      CHECK_THAT(m, Catch::Contains("rank 1 reduce-scatters the gradient of unit "));
      CHECK_THAT(m, Catch::Contains(") in grad_ready() while rank 0 exchanges control values (exchange #"));
      CHECK_THAT(m, Catch::Contains(") with all_gather(1 x u64) in " + std::string(loading ? "load()" : "save()")));
    }
  }
}

namespace {

// Each rank's error from `save(opt)` on a fresh trained optimizer: "" when it
// succeeded; any exception that is not a zero::Error is marked as such.
template <class Save>
std::vector<std::string> save_errors(Save&& save) {
  using Opt = zero::ZeroOptimizer<Full<float>, zero::optim::Sgd, zero::stage<1>>;
  return zero::test::rank_errors(2, [&](zero::comm::Local& c) {
    Opt opt(c, zero::test::test_hyper<zero::optim::Sgd>(), zero::Options{});
    build(opt, true);
    train_steps(opt, c.rank(), 1, 1);
    save(opt);
    opt.wait_save();
  });
}

}  // namespace

TEST_CASE("a save where no directory can be created is a zero::Error naming it and the cause, on every rank",
          "[checkpoint][errors][unwritable]") {
  using Opt = zero::ZeroOptimizer<Full<float>, zero::optim::Sgd, zero::stage<1>>;
  using Io = zero::checkpoint::OptimizerIo<Opt>;
  TempDir dir;
  // A path under a regular file cannot be created (ENOTDIR), even by root,
  // which a directory of mode 0555 would not stop; a read-only file system
  // fails in the same call (EROFS).
  const fs::path file = dir.path / "a-file";
  std::ofstream(file) << "not a directory";
  const std::string cause = "cannot create the checkpoint directory: Not a directory";
  auto check_every_rank = [&](const std::vector<std::string>& errors, const fs::path& where) {
    for (const auto& e : errors) {
      INFO(e);
      CHECK_THAT(e, Catch::StartsWith(where.string() + ": ") && Catch::Contains(cause) &&
                        !Catch::Contains("not a zero::Error"));
    }
  };
  check_every_rank(save_errors([&](Opt& opt) { opt.save((file / "ckpt").string()); }), file / "ckpt");
  check_every_rank(save_errors([&](Opt& opt) { opt.save((file / "async").string(), {.async = true}); }),
                   file / "async");
  check_every_rank(save_errors([&](Opt& opt) { Io::save_step(opt, (file / "root").string(), Io::SaveOptions{}); }),
                   file / "root" / "step-000000001");
  // The step directory's name taken by a file.
  fs::create_directories(dir.path / "taken");
  std::ofstream(dir.path / "taken" / "step-000000001") << "x";
  check_every_rank(save_errors([&](Opt& opt) { Io::save_step(opt, (dir.path / "taken").string(), Io::SaveOptions{}); }),
                   dir.path / "taken" / "step-000000001");

  // root/latest that cannot be replaced, an old checkpoint that cannot be
  // removed, a rank file written in the background that cannot be renamed:
  // the rank that meets it names the file and the cause, the other says
  // which rank failed; both throw zero::Error.
  auto check_named = [&](const std::vector<std::string>& errors, const std::string& rank0, const std::string& rank1) {
    INFO(errors[0] << "\n" << errors[1]);
    CHECK_THAT(errors[0], Catch::Contains(rank0));
    CHECK_THAT(errors[1], Catch::Contains(rank1));
  };
  fs::create_directories(dir.path / "latest-dir" / "latest" / "in-the-way");
  check_named(save_errors([&](Opt& opt) { Io::save_step(opt, (dir.path / "latest-dir").string(), Io::SaveOptions{}); }),
              (dir.path / "latest-dir" / "latest").string() + ": rename from latest.tmp-",
              "writing the manifest failed on rank(s) 0");
  fs::create_directories(dir.path / "old" / "step-000000000" / "manifest.json" / "in-the-way");
  Io::SaveOptions keep1;
  keep1.io.keep_last = 1;
  check_named(save_errors([&](Opt& opt) { Io::save_step(opt, (dir.path / "old").string(), keep1); }),
              (dir.path / "old" / "step-000000000" / "manifest.json").string() +
                  ": cannot remove it to retire the checkpoint",
              "removing old checkpoints failed on rank(s) 0");
  fs::create_directories(dir.path / "bg" / "rank-1-of-2.safetensors" / "in-the-way");
  const auto background = save_errors([&](Opt& opt) { opt.save((dir.path / "bg").string(), {.async = true}); });
  check_named({background[1], background[0]}, (dir.path / "bg" / "rank-1-of-2.safetensors").string() + ": rename from",
              "writing the rank files failed on rank(s) 1");
}

TEST_CASE("save options as {} or designated initialisers are unambiguous; extra json still goes in",
          "[checkpoint][options]") {
  using Opt = zero::ZeroOptimizer<Full<float>, zero::optim::Sgd, zero::stage<1>>;
  using Io = zero::checkpoint::OptimizerIo<Opt>;
  TempDir dir;
  const auto root = dir.path.string();
  zero::comm::LocalGroup group(2);
  group.run([&](zero::comm::Local& c) {
    Opt opt(c, zero::test::test_hyper<zero::optim::Sgd>(), zero::Options{});
    build(opt, true);
    // Each of these was ambiguous between the options and nlohmann::json.
    Io::save_step(opt, root, {});
    Io::save(opt, (dir.path / "a").string(), {});
    Io::save(opt, (dir.path / "b").string(), {.async = true, .extra = {{"epoch", 3}}});
    train_steps(opt, c.rank(), 1, 1);
    Io::save_step(opt, root, {.async = true});
    opt.save((dir.path / "c").string(), {});
    // The json itself, as before.
    Io::save(opt, (dir.path / "d").string(), nlohmann::json{{"epoch", 4}});
    const nlohmann::json extra = {{"epoch", 5}};
    Io::save_step(opt, (dir.path / "e").string(), extra);
  });
  auto extra_of = [&](const fs::path& d) {
    return nlohmann::json::parse(file_bytes(d / zero::checkpoint::manifest_file_name))["extra"];
  };
  CHECK(extra_of(dir.path / "step-000000000") == nlohmann::json::object());
  CHECK(extra_of(dir.path / "step-000000001") == nlohmann::json::object());
  CHECK(extra_of(dir.path / "b") == nlohmann::json{{"epoch", 3}});
  CHECK(extra_of(dir.path / "d") == nlohmann::json{{"epoch", 4}});
  CHECK(extra_of(dir.path / "e" / "step-000000001") == nlohmann::json{{"epoch", 5}});
  CHECK(fs::exists(dir.path / "a" / zero::checkpoint::manifest_file_name));
  CHECK(fs::exists(dir.path / "c" / zero::checkpoint::manifest_file_name));
}

namespace {

// A checkpoint as saved before slots were named after the optimizer's
// state: the source's slots as "state0".."stateK-1".
class NumberedSlots final : public zero::checkpoint::StateSource {
 public:
  explicit NumberedSlots(const zero::checkpoint::StateSource& inner) : inner_(inner) {}
  std::vector<zero::checkpoint::UnitDesc> units() const override { return inner_.units(); }
  std::vector<zero::checkpoint::SlotDesc> slots() const override {
    auto s = inner_.slots();
    for (std::size_t k = 1; k + 1 < s.size(); ++k) s[k] = {"state" + std::to_string(k - 1), s[k].dtype, true};
    return s;
  }
  std::vector<zero::checkpoint::OwnedRange> owned() const override { return inner_.owned(); }
  std::vector<zero::checkpoint::OwnedRange> save_ranges() const override { return inner_.save_ranges(); }
  void read(std::size_t slot, const zero::checkpoint::OwnedRange& r, void* dst) const override {
    inner_.read(slot, r, dst);
  }
  void write(std::size_t, const zero::checkpoint::OwnedRange&, const void*) override {}
  zero::checkpoint::RunState run_state() const override { return inner_.run_state(); }

 private:
  const zero::checkpoint::StateSource& inner_;
};

std::vector<std::string> slot_names(const fs::path& dir) {
  const auto m = nlohmann::json::parse(file_bytes(dir / zero::checkpoint::manifest_file_name));
  std::vector<std::string> names;
  for (const auto& s : m["slots"]) names.push_back(s["name"]);
  return names;
}

}  // namespace

TEST_CASE("state slots are saved by the optimizer's state names; checkpoints saying state0, state1 still load",
          "[checkpoint][slots]") {
  using Opt = zero::ZeroOptimizer<Mixed<bf16>, zero::optim::AdamW, zero::stage<2>>;
  using Io = zero::checkpoint::OptimizerIo<Opt>;
  TempDir dir;
  const zero::Options options = options_for<Opt>();
  const auto hyper = zero::test::test_hyper<zero::optim::AdamW>();
  std::vector<Final> uninterrupted(2), resumed(2);
  zero::comm::LocalGroup group(2);
  group.run([&](zero::comm::Local& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    {
      Opt opt(c, hyper, options);
      build(opt, true);
      train_steps(opt, c.rank(), 1, 3);
      opt.save((dir.path / "named").string());
      const Io::Source source(opt);
      const NumberedSlots numbered(source);
      zero::checkpoint::Checkpointer(Io::collective(opt)).save(dir.path / "numbered", numbered);
      train_steps(opt, c.rank(), 4, 5);
      uninterrupted[r] = final_state(opt);
    }
    Opt fresh(c, hyper, options);
    build(fresh, false);
    fresh.load((dir.path / "numbered").string());
    train_steps(fresh, c.rank(), 4, 5);
    resumed[r] = final_state(fresh);
  });
  using V = std::vector<std::string>;
  CHECK(slot_names(dir.path / "named") == V{"master", "exp_avg", "exp_avg_sq", "param"});
  CHECK(slot_names(dir.path / "numbered") == V{"master", "state0", "state1", "param"});
  for (std::size_t r = 0; r < 2; ++r) {
    INFO("rank " << r);
    CHECK(resumed[r].masters == uninterrupted[r].masters);  // exp_avg and exp_avg_sq came from state0, state1
    CHECK(resumed[r].params == uninterrupted[r].params);
  }
  // SGD's buffer is "momentum" (its keep_last test saves with it).
  zero::comm::LocalGroup one(1);
  one.run([&](zero::comm::Local& c) {
    zero::ZeroOptimizer<Full<float>, zero::optim::Sgd, zero::stage<1>> sgd(c, zero::test::test_hyper<zero::optim::Sgd>(),
                                                                           zero::Options{});
    build(sgd, true);
    sgd.save((dir.path / "sgd").string());
  });
  CHECK(slot_names(dir.path / "sgd") == V{"master", "momentum"});
}

namespace {
// A user's policy's Hyper with a field no built-in optimizer has.
struct GammaHyper {
  double lr = 0.25;
  double gamma = 0.75;
  bool centered = true;
  static constexpr auto fields() {
    using F = zero::optim::HyperField<GammaHyper>;
    return std::array{F{"lr", &GammaHyper::lr}, F{"gamma", &GammaHyper::gamma}, F{"centered", &GammaHyper::centered}};
  }
};
struct UnlistedHyper {  // no fields(): its lr alone
  double lr = 0.125;
  double gamma = 2.0;
};
}  // namespace

// The manifest's optimizer.hyper comes from Hyper::fields(), so a user's
// policy's own fields are saved (the writer listed eight built-in names by
// hand, and 'gamma' was lost).
TEST_CASE("the manifest records every hyper-parameter the policy lists", "[checkpoint][hyper]") {
  using zero::checkpoint::detail::hyper_json;
  CHECK(hyper_json(GammaHyper{}) == nlohmann::json{{"lr", 0.25}, {"gamma", 0.75}, {"centered", true}});
  CHECK(hyper_json(UnlistedHyper{}) == nlohmann::json{{"lr", 0.125}});
  const zero::optim::Sgd::Hyper sgd{.lr = 0.5, .momentum = 0.9, .nesterov = true};
  CHECK(hyper_json(sgd) == nlohmann::json{{"lr", 0.5}, {"momentum", 0.9}, {"dampening", 0.0}, {"weight_decay", 0.0},
                                          {"nesterov", true}});
  const zero::optim::AdamW::Hyper adamw{};
  CHECK(hyper_json(adamw).size() == std::size(zero::optim::AdamW::Hyper::fields()));
  CHECK(hyper_json(adamw)["beta2"] == adamw.beta2);
}

// The checkpoint layer's view of the engine's state is private to the
// engine (checkpoint::EngineIo is its friend): a user's doors are save(),
// load() and load_hf(), not settle(), read_state() or restore_progress().
template <class E>
concept ExposesCheckpointPlumbing = requires(E& e, float* host) {
  e.settle("");
} || requires(E& e, float* host) { e.read_state(zero::StateSlot{}, 0, 0, 0, host); } || requires(E& e) {
  e.all_gather_control(std::vector<std::uint64_t>{});
};
using PlainEngine = zero::detail::Engine<zero::precision::Full<float>, zero::optim::AdamW, zero::backend::Host>;
static_assert(!ExposesCheckpointPlumbing<PlainEngine>);
static_assert(!ExposesCheckpointPlumbing<zero::ZeroOptimizer<zero::precision::Full<float>, zero::optim::AdamW,
                                                              zero::stage<1>>>);
static_assert(requires(PlainEngine& e) { e.save(""); });
