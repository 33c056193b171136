// Why this header exists: the Fashion-MNIST example must not depend on Python
// or a downloader, so it reads the original gzip'd IDX files (Debian package
// `dataset-fashion-mnist`) straight into memory with zlib. The whole data set
// is 55 MB as float, so it is decoded once and shared read-only by every rank
// thread. Every malformed input (missing file, wrong magic, truncated or
// over-long payload, inconsistent counts) is a DatasetError that names the
// file and says what to do, never a silent short read.
#pragma once

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "zero/error.hpp"

namespace fashion_mnist {

// Where `apt-get install dataset-fashion-mnist` puts the files.
inline constexpr const char* kDefaultDataDir = "/usr/share/datasets/fashion-mnist";

class DatasetError : public zero::Error {
 public:
  using zero::Error::Error;
};

// One decoded IDX file: the dimensions from its header and the raw payload.
// Only the unsigned-byte element type (0x08) is supported, which is what the
// MNIST family uses.
struct IdxArray {
  std::vector<std::uint32_t> dims;
  std::vector<std::uint8_t> data;  // product(dims) bytes, row-major
};

// How pixels become model inputs: x = (byte / 255 - mean) / stddev.
// {0, 1} keeps [0, 1]; kFashionMnistStandardize centres on the training set's
// statistics (mean 0.2860, std 0.3530), which trains slightly faster.
struct Normalization {
  float mean = 0.0f;
  float stddev = 1.0f;
};
inline constexpr Normalization kUnitRange{0.0f, 1.0f};
inline constexpr Normalization kFashionMnistStandardize{0.2860f, 0.3530f};

// Images and labels of one split, decoded and normalised.
struct Dataset {
  std::vector<float> images;          // count x (rows * cols), row-major
  std::vector<std::uint8_t> labels;   // count
  std::size_t count = 0;
  int rows = 0;
  int cols = 0;

  std::size_t features() const { return static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols); }
  const float* image(std::size_t i) const { return images.data() + i * features(); }
};

struct FashionMnist {
  Dataset train;  // 60000 examples
  Dataset test;   // 10000 examples
};

namespace detail {

inline std::string install_hint() {
  return "install it with `apt-get install dataset-fashion-mnist` (files go to " + std::string(kDefaultDataDir) +
         ") or pass `--data DIR` pointing at a directory holding train-images-idx3-ubyte.gz, "
         "train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz";
}

// Owns a gzFile so every error path closes it.
class GzReader {
 public:
  explicit GzReader(const std::filesystem::path& path) : path_(path.string()) {
    file_ = gzopen(path_.c_str(), "rb");
    if (file_ == nullptr) throw DatasetError("cannot open IDX file '" + path_ + "': " + install_hint());
    gzbuffer(file_, 1u << 17);
  }
  GzReader(const GzReader&) = delete;
  GzReader& operator=(const GzReader&) = delete;
  ~GzReader() { gzclose(file_); }

  // Reads up to `size` bytes; returns how many were read (short only at end of data).
  std::size_t read_some(void* out, std::size_t size) {
    auto* dst = static_cast<unsigned char*>(out);
    std::size_t done = 0;
    while (done < size) {
      const std::size_t chunk = std::min<std::size_t>(size - done, 1u << 30);  // gzread takes unsigned
      const int got = gzread(file_, dst + done, static_cast<unsigned>(chunk));
      if (got < 0) {
        int code = 0;
        const char* message = gzerror(file_, &code);
        throw DatasetError("corrupt gzip data in '" + path_ + "': " + (message ? message : "unknown zlib error") +
                           "; reinstall the data (" + install_hint() + ")");
      }
      if (got == 0) break;
      done += static_cast<std::size_t>(got);
    }
    return done;
  }

  void read_exact(void* out, std::size_t size, const char* what) {
    const std::size_t got = read_some(out, size);
    if (got != size)
      throw DatasetError("IDX file '" + path_ + "' is truncated: expected " + std::to_string(size) + " bytes of " +
                         what + ", got " + std::to_string(got) + "; the file is incomplete, reinstall it (" +
                         install_hint() + ")");
  }

  bool at_end() {
    unsigned char extra = 0;
    return read_some(&extra, 1) == 0;
  }

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  gzFile file_ = nullptr;
};

inline std::uint32_t big_endian_u32(const std::array<unsigned char, 4>& b) {
  return (std::uint32_t{b[0]} << 24) | (std::uint32_t{b[1]} << 16) | (std::uint32_t{b[2]} << 8) | std::uint32_t{b[3]};
}

}  // namespace detail

// Reads one gzip'd (or plain: zlib reads both) IDX file of unsigned bytes.
// `expected_rank` is the number of dimensions the caller needs (1 for labels,
// 3 for images); the magic number must be 0x00 0x00 0x08 expected_rank.
inline IdxArray read_idx(const std::filesystem::path& path, std::uint32_t expected_rank) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw DatasetError("IDX file '" + path.string() + "' not found: " + detail::install_hint());

  detail::GzReader in(path);
  std::array<unsigned char, 4> magic{};
  in.read_exact(magic.data(), magic.size(), "magic number");
  if (magic[0] != 0 || magic[1] != 0 || magic[2] != 0x08 || magic[3] != expected_rank) {
    char got[16];
    std::snprintf(got, sizeof got, "%02x%02x%02x%02x", magic[0], magic[1], magic[2], magic[3]);
    char want[16];
    std::snprintf(want, sizeof want, "000008%02x", static_cast<unsigned>(expected_rank));
    throw DatasetError("'" + path.string() + "' is not an IDX file of unsigned bytes with " +
                       std::to_string(expected_rank) + " dimension(s): bad magic number 0x" + got + " (expected 0x" +
                       want + "); check that images and labels files are not swapped, or reinstall the data (" +
                       detail::install_hint() + ")");
  }

  IdxArray out;
  std::size_t total = 1;
  for (std::uint32_t d = 0; d < expected_rank; ++d) {
    std::array<unsigned char, 4> raw{};
    in.read_exact(raw.data(), raw.size(), "header dimensions");
    const std::uint32_t n = detail::big_endian_u32(raw);
    if (n == 0 || n > (1u << 24))
      throw DatasetError("IDX file '" + path.string() + "': dimension " + std::to_string(d) + " is " +
                         std::to_string(n) + ", outside 1.." + std::to_string(1u << 24) + "; the header is corrupt");
    out.dims.push_back(n);
    total *= n;
  }
  if (total > (std::size_t{1} << 32))
    throw DatasetError("IDX file '" + path.string() + "': payload of " + std::to_string(total) +
                       " bytes is implausibly large; the header is corrupt");
  out.data.resize(total);
  in.read_exact(out.data.data(), total, "payload");
  if (!in.at_end())
    throw DatasetError("IDX file '" + path.string() + "' has data after the " + std::to_string(total) +
                       "-byte payload its header announces; the header is corrupt");
  return out;
}

// Loads one split from an images file (3-D IDX) and a labels file (1-D IDX),
// checking that the counts agree and every label is below `num_classes`.
inline Dataset load_split(const std::filesystem::path& images_path, const std::filesystem::path& labels_path,
                          Normalization norm = kUnitRange, int num_classes = 10) {
  zero::require(norm.stddev > 0.0f, "Normalization::stddev must be positive, got ", norm.stddev);
  IdxArray images = read_idx(images_path, 3);
  IdxArray labels = read_idx(labels_path, 1);
  if (images.dims[0] != labels.dims[0])
    throw DatasetError("'" + images_path.string() + "' holds " + std::to_string(images.dims[0]) + " images but '" +
                       labels_path.string() + "' holds " + std::to_string(labels.dims[0]) +
                       " labels; the files belong to different splits");
  for (std::size_t i = 0; i < labels.data.size(); ++i)
    if (labels.data[i] >= num_classes)
      throw DatasetError("'" + labels_path.string() + "': label " + std::to_string(labels.data[i]) + " at index " +
                         std::to_string(i) + " is not below the " + std::to_string(num_classes) + " classes");

  Dataset out;
  out.count = images.dims[0];
  out.rows = static_cast<int>(images.dims[1]);
  out.cols = static_cast<int>(images.dims[2]);
  out.labels = std::move(labels.data);
  // One lookup table: every byte maps to the same float, on every rank.
  std::array<float, 256> table{};
  for (int v = 0; v < 256; ++v) table[v] = (static_cast<float>(v) / 255.0f - norm.mean) / norm.stddev;
  out.images.resize(images.data.size());
  for (std::size_t i = 0; i < images.data.size(); ++i) out.images[i] = table[images.data[i]];
  return out;
}

// Loads the train and test splits from `dir` (by default where the Debian
// package installs them) and checks they are 28x28 images.
inline FashionMnist load_fashion_mnist(const std::filesystem::path& dir = kDefaultDataDir,
                                       Normalization norm = kFashionMnistStandardize) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    throw DatasetError("Fashion-MNIST directory '" + dir.string() + "' does not exist: " + detail::install_hint());
  FashionMnist out;
  out.train = load_split(dir / "train-images-idx3-ubyte.gz", dir / "train-labels-idx1-ubyte.gz", norm);
  out.test = load_split(dir / "t10k-images-idx3-ubyte.gz", dir / "t10k-labels-idx1-ubyte.gz", norm);
  for (const Dataset* split : {&out.train, &out.test})
    if (split->rows != 28 || split->cols != 28)
      throw DatasetError("Fashion-MNIST in '" + dir.string() + "' has " + std::to_string(split->rows) + "x" +
                         std::to_string(split->cols) + " images, expected 28x28; is this a different data set?");
  return out;
}

}  // namespace fashion_mnist
