// Why: the GPT example trains on a text everyone with Debian has, The Devil's
// Dictionary (apt `dict-devil`), at the level of characters (bytes), so the
// model needs no tokenizer and its loss reads directly in nats per
// character. The file is dictzip, which is gzip with an index in an extra
// header field: zlib's gzread decodes it whole. The corpus is read once and
// shared read-only by every rank thread.
#pragma once

#include <zlib.h>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "zero/error.hpp"

namespace gpt {

inline constexpr const char* kDefaultCorpus = "/usr/share/dictd/devil.dict.dz";

// The corpus file is missing or unreadable.
class CorpusError : public zero::Error {
 public:
  using zero::Error::Error;
};

// The whole text as token ids, its vocabulary, and a 90/10 split.
struct TextCorpus {
  std::vector<unsigned char> alphabet;       // token id -> byte; sorted, every byte the text uses
  std::array<int, 256> token_of{};            // byte -> token id (-1: not in the text)
  std::vector<std::uint8_t> tokens;           // the text as token ids
  std::size_t train_size = 0;                 // tokens[0, train_size) train, the rest validation

  int vocab_size() const { return static_cast<int>(alphabet.size()); }
  const std::uint8_t* train() const { return tokens.data(); }
  const std::uint8_t* validation() const { return tokens.data() + train_size; }
  std::size_t validation_size() const { return tokens.size() - train_size; }

  // Entropy of the byte frequencies of the whole text, in nats per character:
  // the loss of a model that knows only how often each character occurs.
  double unigram_entropy() const {
    std::vector<std::size_t> count(alphabet.size(), 0);
    for (std::uint8_t t : tokens) ++count[t];
    double h = 0.0;
    const double n = static_cast<double>(tokens.size());
    for (std::size_t c : count)
      if (c > 0) h -= static_cast<double>(c) / n * std::log(static_cast<double>(c) / n);
    return h;
  }

  std::string decode(const std::uint8_t* ids, std::size_t n) const {
    std::string s(n, ' ');
    for (std::size_t i = 0; i < n; ++i) s[i] = static_cast<char>(alphabet[ids[i]]);
    return s;
  }
};

// Builds the vocabulary (the distinct bytes of `text`, in byte order) and the
// split: the first `train_fraction` of the text trains, the rest validates.
inline TextCorpus make_corpus(const std::string& text, double train_fraction = 0.9) {
  zero::require(train_fraction > 0.0 && train_fraction < 1.0, "make_corpus: train_fraction is ", train_fraction,
                "; it must be in (0, 1)");
  TextCorpus c;
  std::array<bool, 256> used{};
  for (char ch : text) used[static_cast<unsigned char>(ch)] = true;
  c.token_of.fill(-1);
  for (int b = 0; b < 256; ++b)
    if (used[static_cast<std::size_t>(b)]) {
      c.token_of[static_cast<std::size_t>(b)] = static_cast<int>(c.alphabet.size());
      c.alphabet.push_back(static_cast<unsigned char>(b));
    }
  c.tokens.resize(text.size());
  for (std::size_t i = 0; i < text.size(); ++i)
    c.tokens[i] = static_cast<std::uint8_t>(c.token_of[static_cast<unsigned char>(text[i])]);
  c.train_size = static_cast<std::size_t>(static_cast<double>(text.size()) * train_fraction);
  return c;
}

// The decompressed contents of a gzip (or dictzip) file.
inline std::string read_gzip_text(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr)
    throw CorpusError("cannot open the corpus '" + path +
                      "': install The Devil's Dictionary with `apt-get install dict-devil`, or pass --data FILE "
                      "(any gzip or plain text file)");
  std::string text;
  std::vector<char> chunk(1 << 16);
  for (;;) {
    const int got = gzread(f, chunk.data(), static_cast<unsigned>(chunk.size()));
    if (got < 0) {
      int code = 0;
      const char* message = gzerror(f, &code);
      const std::string why = message ? message : "unknown zlib error";
      gzclose(f);
      throw CorpusError("corrupt gzip data in the corpus '" + path + "': " + why +
                        " (reinstall it with `apt-get install --reinstall dict-devil`)");
    }
    if (got == 0) break;
    text.append(chunk.data(), static_cast<std::size_t>(got));
  }
  gzclose(f);
  return text;
}

// The corpus at `path`, split 90/10. It must hold enough text for a few
// training windows of `context` characters in both parts.
inline TextCorpus load_corpus(const std::string& path, int context) {
  TextCorpus c = make_corpus(read_gzip_text(path));
  const std::size_t need = static_cast<std::size_t>(context) + 1;
  if (c.validation_size() < need || c.train_size < need)
    throw CorpusError("the corpus '" + path + "' holds " + std::to_string(c.tokens.size()) +
                      " characters: too few for a 90/10 split with windows of --context " + std::to_string(context) +
                      " + 1 characters in each part");
  if (c.vocab_size() < 2)
    throw CorpusError("the corpus '" + path + "' uses fewer than 2 distinct characters: nothing to learn");
  return c;
}

}  // namespace gpt
