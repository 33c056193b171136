// The Fashion-MNIST example's model and data reader: gradients against central
// finite differences of a double-precision host reference, the hook order the
// ZeRO engine relies on (stage 3 gathers in forward and again in backward),
// the grad_divisor contract that makes N ranks sum to one rank's gradient, and
// the IDX reader on files this test writes itself (plus the real data set
// when it is installed).
#include <catch2/catch.hpp>

#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "fashion_mnist/idx_dataset.hpp"
#include "fashion_mnist/mlp.hpp"

using fashion_mnist::GradHooks;
using fashion_mnist::LayerShape;
using fashion_mnist::Mlp;
using fashion_mnist::ParamHooks;

namespace {

// Parameters and gradients of an Mlp, one flat buffer per layer.
struct Flat {
  std::vector<std::vector<float>> params, grads;
  std::vector<const float*> param_ptrs;
  std::vector<float*> grad_ptrs;

  Flat(const Mlp& mlp, std::uint64_t seed) {
    for (int l = 0; l < mlp.num_layers(); ++l) {
      params.emplace_back(mlp.layers()[l].numel());
      grads.emplace_back(mlp.layers()[l].numel(), -123.0f);  // backward must overwrite
    }
    for (auto& p : params) param_ptrs.push_back(p.data());
    for (auto& g : grads) grad_ptrs.push_back(g.data());
    std::vector<float*> mutable_params;
    for (auto& p : params) mutable_params.push_back(p.data());
    mlp.init_params(mutable_params, seed);
  }
};

struct Batch {
  std::vector<float> x;
  std::vector<std::uint8_t> y;
};

Batch random_batch(const Mlp& mlp, int batch, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Batch b;
  b.x.resize(static_cast<std::size_t>(batch) * mlp.input_size());
  for (float& v : b.x) v = normal(gen);
  for (int i = 0; i < batch; ++i) b.y.push_back(static_cast<std::uint8_t>(gen() % mlp.num_classes()));
  return b;
}

// Host reference in double: sum over the batch of the cross-entropy losses, divided by `divisor`.
// `logits_out`, when given, receives the logits.
double reference_loss(const Mlp& mlp, const std::vector<std::vector<double>>& params, const Batch& b, int batch,
                      double divisor, std::vector<double>* logits_out = nullptr) {
  double total = 0.0;
  for (int i = 0; i < batch; ++i) {
    std::vector<double> a(b.x.begin() + static_cast<std::ptrdiff_t>(i) * mlp.input_size(),
                          b.x.begin() + static_cast<std::ptrdiff_t>(i + 1) * mlp.input_size());
    for (int l = 0; l < mlp.num_layers(); ++l) {
      const LayerShape& s = mlp.layers()[l];
      std::vector<double> z(s.out);
      for (int o = 0; o < s.out; ++o) {
        double acc = params[l][s.bias_offset() + o];
        for (int k = 0; k < s.in; ++k) acc += params[l][static_cast<std::size_t>(o) * s.in + k] * a[k];
        z[o] = (l + 1 < mlp.num_layers()) ? std::max(acc, 0.0) : acc;
      }
      a = std::move(z);
    }
    if (logits_out) logits_out->insert(logits_out->end(), a.begin(), a.end());
    const double zmax = *std::max_element(a.begin(), a.end());
    double sum = 0.0;
    for (double v : a) sum += std::exp(v - zmax);
    total += std::log(sum) + zmax - a[b.y[i]];
  }
  return total / divisor;
}

std::vector<std::vector<double>> to_double(const std::vector<std::vector<float>>& p) {
  std::vector<std::vector<double>> out;
  for (const auto& layer : p) out.emplace_back(layer.begin(), layer.end());
  return out;
}

}  // namespace

TEST_CASE("MLP gradients match central finite differences of a double reference", "[examples][mlp]") {
  const std::vector<int> sizes = GENERATE(std::vector<int>{5, 4, 3}, std::vector<int>{6, 5, 4, 3});
  const float divisor = GENERATE(7.0f, 11.0f);  // the local batch, or a larger global batch
  CAPTURE(sizes, divisor);
  Mlp mlp(sizes);
  const int batch = 7;
  Flat f(mlp, 42);
  const Batch b = random_batch(mlp, batch, 7);

  const float mean_loss = mlp.forward_backward(b.x.data(), b.y.data(), batch, f.param_ptrs, f.grad_ptrs, divisor);
  auto p = to_double(f.params);
  REQUIRE(mean_loss == Approx(reference_loss(mlp, p, b, batch, batch)).epsilon(1e-5));

  const double h = 1e-6;
  for (int l = 0; l < mlp.num_layers(); ++l) {
    double diff2 = 0.0, norm2 = 0.0;
    for (std::size_t k = 0; k < p[l].size(); ++k) {
      const double saved = p[l][k];
      p[l][k] = saved + h;
      const double up = reference_loss(mlp, p, b, batch, divisor);
      p[l][k] = saved - h;
      const double down = reference_loss(mlp, p, b, batch, divisor);
      p[l][k] = saved;
      const double numeric = (up - down) / (2.0 * h);
      const double analytic = f.grads[l][k];
      CAPTURE(l, k, numeric, analytic);
      REQUIRE(std::abs(analytic - numeric) <= 1e-5 + 1e-3 * std::abs(numeric));
      diff2 += (analytic - numeric) * (analytic - numeric);
      norm2 += numeric * numeric;
    }
    CAPTURE(l);
    REQUIRE(norm2 > 0.0);
    REQUIRE(std::sqrt(diff2 / norm2) < 1e-3);
  }
}

TEST_CASE("Cross-entropy of uniform logits is log(classes)", "[examples][mlp]") {
  Mlp mlp({8, 6, 10});
  std::vector<std::vector<float>> params, grads;
  std::vector<const float*> pp;
  std::vector<float*> gp;
  for (const LayerShape& s : mlp.layers()) {
    params.emplace_back(s.numel(), 0.0f);  // zero weights and biases: every logit is 0
    grads.emplace_back(s.numel(), 0.0f);
  }
  for (auto& v : params) pp.push_back(v.data());
  for (auto& v : grads) gp.push_back(v.data());
  const Batch b = random_batch(mlp, 5, 3);
  const float loss = mlp.forward_backward(b.x.data(), b.y.data(), 5, pp, gp, 5.0f);
  REQUIRE(loss == Approx(std::log(10.0)).epsilon(1e-6));
  // d(loss)/d(bias) of the last layer is mean(softmax - onehot): 0.1 - (share of the class), summing to 0.
  const LayerShape& last = mlp.layers().back();
  const float* db = gp.back() + last.bias_offset();
  REQUIRE(std::accumulate(db, db + last.out, 0.0) == Approx(0.0).margin(1e-6));
  for (int c = 0; c < last.out; ++c) {
    const double share = static_cast<double>(std::count(b.y.begin(), b.y.end(), c)) / 5.0;
    REQUIRE(db[c] == Approx(0.1 - share).margin(1e-6));
  }
}

TEST_CASE("Hooks run forward 0..L-1, backward L-1..0, gradient ready before release", "[examples][mlp]") {
  Mlp mlp({6, 5, 4, 3});
  Flat f(mlp, 1);
  const Batch b = random_batch(mlp, 4, 2);
  std::vector<std::string> events;
  ParamHooks params{[&](int l) {
                      events.push_back("acquire" + std::to_string(l));
                      return f.param_ptrs[l];
                    },
                    [&](int l) { events.push_back("release" + std::to_string(l)); }};
  GradHooks grads{[&](int l) {
                    events.push_back("buffer" + std::to_string(l));
                    return f.grad_ptrs[l];
                  },
                  [&](int l) { events.push_back("ready" + std::to_string(l)); }};
  mlp.forward_backward(b.x.data(), b.y.data(), 4, params, grads, 4.0f);
  const std::vector<std::string> expected = {
      "acquire0", "release0", "acquire1", "release1", "acquire2", "release2",                  // forward
      "acquire2", "buffer2",  "ready2",   "release2",                                          // backward
      "acquire1", "buffer1",  "ready1",   "release1", "acquire0", "buffer0", "ready0", "release0"};
  REQUIRE(events == expected);

  events.clear();
  std::vector<int> labels(4);
  mlp.predict(b.x.data(), 4, params, labels.data());
  REQUIRE(events == std::vector<std::string>{"acquire0", "release0", "acquire1", "release1", "acquire2", "release2"});
}

TEST_CASE("Gradients of batch slices with the global divisor sum to the whole batch's", "[examples][mlp]") {
  Mlp mlp({6, 5, 4, 3});
  Flat whole(mlp, 9), part(mlp, 9);
  const int batch = 12;
  const Batch b = random_batch(mlp, batch, 4);
  const float loss = mlp.forward_backward(b.x.data(), b.y.data(), batch, whole.param_ptrs, whole.grad_ptrs, batch);

  std::vector<std::vector<float>> sum(whole.grads.size());
  for (std::size_t l = 0; l < sum.size(); ++l) sum[l].assign(whole.grads[l].size(), 0.0f);
  double loss_sum = 0.0;
  const int ranks = 3, local = batch / ranks;
  for (int r = 0; r < ranks; ++r) {
    loss_sum += local * mlp.forward_backward(b.x.data() + static_cast<std::size_t>(r) * local * mlp.input_size(),
                                             b.y.data() + r * local, local, part.param_ptrs, part.grad_ptrs, batch);
    for (std::size_t l = 0; l < sum.size(); ++l)
      for (std::size_t k = 0; k < sum[l].size(); ++k) sum[l][k] += part.grads[l][k];
  }
  REQUIRE(loss_sum / batch == Approx(loss).epsilon(1e-5));
  for (std::size_t l = 0; l < sum.size(); ++l)
    for (std::size_t k = 0; k < sum[l].size(); ++k)
      REQUIRE(sum[l][k] == Approx(whole.grads[l][k]).margin(1e-6).epsilon(1e-5));
}

TEST_CASE("predict returns the argmax of the reference logits", "[examples][mlp]") {
  Mlp mlp({6, 5, 4});
  Flat f(mlp, 5);
  const int batch = 9;
  const Batch b = random_batch(mlp, batch, 6);
  std::vector<double> logits;
  reference_loss(mlp, to_double(f.params), b, batch, 1.0, &logits);
  std::vector<int> labels(batch);
  mlp.predict(b.x.data(), batch, f.param_ptrs, labels.data());
  for (int i = 0; i < batch; ++i) {
    const auto row = logits.begin() + static_cast<std::ptrdiff_t>(i) * 4;
    REQUIRE(labels[i] == std::max_element(row, row + 4) - row);
  }
}

TEST_CASE("MLP rejects bad arguments with a clear message", "[examples][mlp]") {
  REQUIRE_THROWS_WITH(Mlp({784}), Catch::Contains("at least an input and an output"));
  REQUIRE_THROWS_WITH(Mlp({784, 0, 10}), Catch::Contains("sizes[1]"));
  Mlp mlp({4, 3, 2});
  Flat f(mlp, 1);
  Batch b = random_batch(mlp, 2, 1);
  b.y[1] = 2;
  REQUIRE_THROWS_AS(mlp.forward_backward(b.x.data(), b.y.data(), 2, f.param_ptrs, f.grad_ptrs, 2.0f),
                    zero::InvalidArgument);
  REQUIRE_THROWS_WITH(mlp.forward_backward(b.x.data(), b.y.data(), 2, f.param_ptrs, f.grad_ptrs, 2.0f),
                      Catch::Contains("label 2"));
  b.y[1] = 0;
  REQUIRE_THROWS_WITH(mlp.forward_backward(b.x.data(), b.y.data(), 2, f.param_ptrs, f.grad_ptrs, 0.0f),
                      Catch::Contains("grad_divisor"));
  std::vector<const float*> one_layer = {f.param_ptrs[0]};
  REQUIRE_THROWS_WITH(mlp.forward_backward(b.x.data(), b.y.data(), 2, one_layer, f.grad_ptrs, 2.0f),
                      Catch::Contains("one per layer"));
}

TEST_CASE("Layer initialisation is deterministic and bounded like torch.nn.Linear", "[examples][mlp]") {
  const LayerShape s{100, 30};
  std::vector<float> a(s.numel()), b(s.numel()), c(s.numel());
  Mlp::init_layer(s, a.data(), 7);
  Mlp::init_layer(s, b.data(), 7);
  Mlp::init_layer(s, c.data(), 8);
  REQUIRE(a == b);
  REQUIRE(a != c);
  const float bound = 0.1f;  // 1 / sqrt(100)
  REQUIRE(*std::max_element(a.begin(), a.end()) <= bound);
  REQUIRE(*std::min_element(a.begin(), a.end()) >= -bound);
  REQUIRE(*std::max_element(a.begin(), a.end()) > 0.9f * bound);  // fills the range
  REQUIRE(*std::min_element(a.begin(), a.end()) < -0.9f * bound);
}

// ---- IDX reader ------------------------------------------------------------

namespace {

// A temporary directory removed at the end of the test.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::random_device rd;
    path = std::filesystem::temp_directory_path() / ("zero_test_idx_" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

// Writes a gzip'd IDX file: magic 00 00 08 rank (overridable), big-endian dims, payload.
void write_idx(const std::filesystem::path& path, const std::vector<std::uint32_t>& dims,
               const std::vector<std::uint8_t>& payload, int magic_rank = -1, int magic_type = 0x08) {
  std::vector<std::uint8_t> bytes = {0, 0, static_cast<std::uint8_t>(magic_type),
                                     static_cast<std::uint8_t>(magic_rank < 0 ? dims.size() : magic_rank)};
  for (std::uint32_t d : dims)
    for (int shift = 24; shift >= 0; shift -= 8) bytes.push_back(static_cast<std::uint8_t>(d >> shift));
  bytes.insert(bytes.end(), payload.begin(), payload.end());
  gzFile f = gzopen(path.string().c_str(), "wb");
  REQUIRE(f != nullptr);
  REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) == static_cast<int>(bytes.size()));
  REQUIRE(gzclose(f) == Z_OK);
}

std::vector<std::uint8_t> iota_bytes(std::size_t n) {
  std::vector<std::uint8_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint8_t>(i * 37 % 256);
  return v;
}

}  // namespace

TEST_CASE("IDX reader loads a small gzip file it wrote", "[examples][idx]") {
  TempDir dir;
  const auto pixels = iota_bytes(3 * 2 * 4);
  write_idx(dir.path / "images.gz", {3, 2, 4}, pixels);
  write_idx(dir.path / "labels.gz", {3}, {7, 0, 9});

  const auto raw = fashion_mnist::read_idx(dir.path / "images.gz", 3);
  REQUIRE(raw.dims == std::vector<std::uint32_t>{3, 2, 4});
  REQUIRE(raw.data == pixels);

  const auto unit =
      fashion_mnist::load_split(dir.path / "images.gz", dir.path / "labels.gz", fashion_mnist::kUnitRange);
  REQUIRE(unit.count == 3);
  REQUIRE(unit.rows == 2);
  REQUIRE(unit.cols == 4);
  REQUIRE(unit.features() == 8);
  REQUIRE(unit.labels == std::vector<std::uint8_t>{7, 0, 9});
  REQUIRE(unit.images.size() == pixels.size());
  for (std::size_t i = 0; i < pixels.size(); ++i) REQUIRE(unit.images[i] == Approx(pixels[i] / 255.0f));
  REQUIRE(unit.image(2)[0] == Approx(pixels[16] / 255.0f));

  const fashion_mnist::Normalization norm{0.5f, 0.25f};
  const auto standard = fashion_mnist::load_split(dir.path / "images.gz", dir.path / "labels.gz", norm);
  for (std::size_t i = 0; i < pixels.size(); ++i)
    REQUIRE(standard.images[i] == Approx((pixels[i] / 255.0f - 0.5f) / 0.25f));
}

TEST_CASE("IDX reader rejects malformed files with a message naming the file and the fix", "[examples][idx]") {
  TempDir dir;
  write_idx(dir.path / "labels.gz", {3}, {1, 2, 3});
  using Catch::Contains;
  using fashion_mnist::DatasetError;
  using fashion_mnist::read_idx;

  SECTION("corrupted magic number") {
    write_idx(dir.path / "bad.gz", {3, 2, 4}, iota_bytes(24), 4);
    REQUIRE_THROWS_AS(read_idx(dir.path / "bad.gz", 3), DatasetError);
    REQUIRE_THROWS_WITH(read_idx(dir.path / "bad.gz", 3), Contains("bad magic number 0x00000804") &&
                                                              Contains("bad.gz") && Contains("expected 0x00000803"));
    write_idx(dir.path / "float.gz", {3, 2, 4}, iota_bytes(24), -1, 0x0D);
    REQUIRE_THROWS_WITH(read_idx(dir.path / "float.gz", 3), Contains("bad magic number 0x00000d03"));
  }
  SECTION("images and labels swapped") {
    REQUIRE_THROWS_WITH(read_idx(dir.path / "labels.gz", 3), Contains("bad magic number") && Contains("swapped"));
  }
  SECTION("truncated payload") {
    write_idx(dir.path / "short.gz", {3, 2, 4}, iota_bytes(23));
    REQUIRE_THROWS_WITH(read_idx(dir.path / "short.gz", 3), Contains("truncated") && Contains("got 23"));
  }
  SECTION("payload longer than the header says") {
    write_idx(dir.path / "long.gz", {3, 2, 4}, iota_bytes(25));
    REQUIRE_THROWS_WITH(read_idx(dir.path / "long.gz", 3), Contains("data after"));
  }
  SECTION("zero dimension") {
    write_idx(dir.path / "zero.gz", {0, 2, 4}, {});
    REQUIRE_THROWS_WITH(read_idx(dir.path / "zero.gz", 3), Contains("dimension 0 is 0"));
  }
  SECTION("not gzip and not IDX") {
    {
      std::FILE* f = std::fopen((dir.path / "text.gz").string().c_str(), "wb");
      REQUIRE(f != nullptr);
      std::fputs("hello, world", f);
      std::fclose(f);
    }
    REQUIRE_THROWS_AS(read_idx(dir.path / "text.gz", 3), DatasetError);
  }
  SECTION("image and label counts disagree") {
    write_idx(dir.path / "images.gz", {2, 2, 4}, iota_bytes(16));
    REQUIRE_THROWS_WITH(fashion_mnist::load_split(dir.path / "images.gz", dir.path / "labels.gz"),
                        Contains("2 images") && Contains("3 labels"));
  }
  SECTION("label out of range") {
    write_idx(dir.path / "images.gz", {3, 2, 4}, iota_bytes(24));
    write_idx(dir.path / "labels10.gz", {3}, {1, 10, 3});
    REQUIRE_THROWS_WITH(fashion_mnist::load_split(dir.path / "images.gz", dir.path / "labels10.gz"),
                        Contains("label 10 at index 1"));
  }
  SECTION("missing file and missing directory tell the user how to install the data") {
    REQUIRE_THROWS_WITH(read_idx(dir.path / "absent.gz", 1),
                        Contains("absent.gz") && Contains("apt-get install dataset-fashion-mnist"));
    REQUIRE_THROWS_AS(fashion_mnist::load_fashion_mnist(dir.path / "no_such_dir"), DatasetError);
    REQUIRE_THROWS_WITH(fashion_mnist::load_fashion_mnist(dir.path / "no_such_dir"),
                        Contains("no_such_dir") && Contains("apt-get install dataset-fashion-mnist") &&
                            Contains("--data DIR"));
    // A directory without the files names the first missing one.
    REQUIRE_THROWS_WITH(fashion_mnist::load_fashion_mnist(dir.path),
                        Contains("train-images-idx3-ubyte.gz") && Contains("apt-get install dataset-fashion-mnist"));
  }
}

TEST_CASE("The installed Fashion-MNIST loads 60000 + 10000 images of 28x28", "[examples][idx][dataset]") {
  std::error_code ec;
  if (!std::filesystem::is_directory(fashion_mnist::kDefaultDataDir, ec)) {
    WARN("Fashion-MNIST is not installed at " << fashion_mnist::kDefaultDataDir
                                              << " (apt-get install dataset-fashion-mnist); skipping");
    return;
  }
  const auto data = fashion_mnist::load_fashion_mnist();
  REQUIRE(data.train.count == 60000);
  REQUIRE(data.test.count == 10000);
  for (const auto* split : {&data.train, &data.test}) {
    REQUIRE(split->rows == 28);
    REQUIRE(split->cols == 28);
    REQUIRE(split->images.size() == split->count * 784);
    REQUIRE(split->labels.size() == split->count);
    // Fashion-MNIST is balanced: every class has count / 10 examples.
    for (int c = 0; c < 10; ++c)
      REQUIRE(static_cast<std::size_t>(std::count(split->labels.begin(), split->labels.end(), c)) == split->count / 10);
  }
  // The default normalisation standardises the training pixels.
  double sum = 0.0, sum2 = 0.0;
  for (float v : data.train.images) {
    sum += v;
    sum2 += static_cast<double>(v) * v;
  }
  const double n = static_cast<double>(data.train.images.size());
  const double mean = sum / n;
  REQUIRE(mean == Approx(0.0).margin(0.01));
  REQUIRE(std::sqrt(sum2 / n - mean * mean) == Approx(1.0).margin(0.01));
}
