// Greedy decoding from a dsv4_compile package with libtorch alone (no Python).
//
//   dsv4_generate PACKAGE MAX_NEW_TOKENS PROMPT [PROMPT ...]
//
// Each PROMPT is a comma-separated list of token ids; one line per prompt is printed: its new
// token ids, comma-separated. The package must be built with inline_ops=True (every op compiled
// in) and hold the "extend" and "decode" programs (dsv4_compile.export.package).
//
// The loop is the one dsv4_compile.deploy.greedy_generate runs, step for step: each prompt is
// prefilled alone in chunks of at most max_tokens rows ("extend"), then every request decodes one
// token per step together ("decode"). The host side owns the cache tensors and writes the index
// maps the steps read (docs/deploy.md, "The C++ runner"): request r (1..B) holds the full pages
// 1 + (r - 1) * P .. r * P for P pages of 256 positions, and every full slot is its own SWA slot.

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/torch.h>

#include <iostream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr int64_t kPageSize = 256;
const std::string kKey = "dsv4_compile.";

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  for (std::string part; std::getline(stream, part, sep);) parts.push_back(part);
  return parts;
}

std::vector<int64_t> parse_ids(const std::string& text) {
  std::vector<int64_t> ids;
  for (const auto& part : split(text, ',')) ids.push_back(std::stoll(part));
  if (ids.empty()) throw std::invalid_argument("PROMPT: an empty prompt");
  return ids;
}

torch::Dtype parse_dtype(const std::string& name) {
  static const std::map<std::string, torch::Dtype> dtypes = {
      {"uint8", torch::kUInt8}, {"int32", torch::kInt32}, {"int64", torch::kInt64},
      {"float32", torch::kFloat32}, {"bfloat16", torch::kBFloat16}};
  auto it = dtypes.find(name);
  if (it == dtypes.end()) throw std::runtime_error("cache buffer of unsupported dtype " + name);
  return it->second;
}

// The package's metadata entry `dsv4_compile.<name>`; a clear error when it is missing.
std::string meta(const std::unordered_map<std::string, std::string>& metadata, const std::string& name) {
  auto it = metadata.find(kKey + name);
  if (it == metadata.end()) throw std::runtime_error("not a dsv4_compile package: no " + kKey + name);
  return it->second;
}

// The cache: every buffer the programs take after the step inputs, by name, zero-initialised.
struct Cache {
  std::vector<std::string> names;
  std::vector<torch::Tensor> buffers;

  torch::Tensor& get(const std::string& name) {
    for (size_t i = 0; i < names.size(); ++i)
      if (names[i] == name) return buffers[i];
    throw std::runtime_error("the package has no cache buffer " + name);
  }
};

Cache make_cache(const std::unordered_map<std::string, std::string>& metadata) {
  Cache cache;
  const int64_t count = std::stoll(meta(metadata, "num_cache_buffers"));
  for (int64_t i = 0; i < count; ++i) {
    auto fields = split(meta(metadata, "cache." + std::to_string(i)), ':');  // name:dtype:d0,d1
    std::vector<int64_t> shape;
    for (const auto& d : split(fields.at(2), ',')) shape.push_back(std::stoll(d));
    cache.names.push_back(fields.at(0));
    cache.buffers.push_back(torch::zeros(shape, torch::TensorOptions().dtype(parse_dtype(fields.at(1)))));
  }
  return cache;
}

// Host side of the index maps: request rows, their pages and the slots of their positions.
class Requests {
 public:
  Requests(Cache& cache, int64_t max_seq_len)
      : req_to_token_(cache.get("req_to_token")), req_to_page_(cache.get("req_to_page")),
        full_to_swa_(cache.get("full_to_swa")), pages_per_request_(max_seq_len / kPageSize) {
    const int64_t full_pages = full_to_swa_.size(0) / kPageSize;
    const int64_t swa_pages = cache.get("layers.0.swa_kv").size(0);
    if (swa_pages != full_pages)
      throw std::runtime_error("this runner maps every full slot to its own SWA slot: it needs a package "
                               "whose cache has as many SWA pages as full pages");
    max_requests_ = std::min<int64_t>(req_to_token_.size(0) - 1, (full_pages - 1) / pages_per_request_);
  }

  // Admit a request on row `row` (1-based): its page table row.
  void admit(int64_t row) {
    if (row > max_requests_) throw std::runtime_error("more prompts than the cache has request rows");
    auto pages = req_to_page_.accessor<int32_t, 2>();
    for (int64_t i = 0; i < pages_per_request_; ++i) pages[row][i] = 1 + (row - 1) * pages_per_request_ + i;
    lengths_.resize(std::max<size_t>(lengths_.size(), row + 1), 0);
  }

  // Take `count` new positions of `row`: their full slots (written into the index maps).
  std::vector<int64_t> extend(int64_t row, int64_t count) {
    auto tokens = req_to_token_.accessor<int32_t, 2>();
    auto pages = req_to_page_.accessor<int32_t, 2>();
    auto swa = full_to_swa_.accessor<int32_t, 1>();
    std::vector<int64_t> slots;
    for (int64_t p = lengths_[row]; p < lengths_[row] + count; ++p) {
      if (p >= req_to_token_.size(1)) throw std::runtime_error("a request outgrew the cache's max_seq_len");
      const int64_t slot = pages[row][p / kPageSize] * kPageSize + p % kPageSize;
      tokens[row][p] = static_cast<int32_t>(slot);
      swa[slot] = static_cast<int32_t>(slot);
      slots.push_back(slot);
    }
    lengths_[row] += count;
    return slots;
  }

  int64_t length(int64_t row) const { return lengths_[row]; }

 private:
  torch::Tensor &req_to_token_, &req_to_page_, &full_to_swa_;
  int64_t pages_per_request_, max_requests_ = 0;
  std::vector<int64_t> lengths_;
};

torch::Tensor i64(const std::vector<int64_t>& values) { return torch::tensor(values, torch::kInt64); }
torch::Tensor i32(const std::vector<int64_t>& values) { return torch::tensor(values, torch::kInt64).to(torch::kInt32); }

// One step: the logits of `logit_rows` ([R, vocab]); the program writes the cache in place.
torch::Tensor run_step(torch::inductor::AOTIModelPackageLoader& program, Cache& cache,
                       const std::vector<int64_t>& ids, const std::vector<int64_t>& rows,
                       const std::vector<int64_t>& seq_lens, const std::vector<int64_t>& extend_lens,
                       const std::vector<int64_t>& slots, const std::vector<int64_t>& logit_rows) {
  std::vector<torch::Tensor> inputs = {i64(ids), i32(rows), i32(seq_lens), i32(extend_lens), i64(slots),
                                       i64(logit_rows)};
  inputs.insert(inputs.end(), cache.buffers.begin(), cache.buffers.end());
  return program.run(inputs).at(0);
}

std::vector<int64_t> greedy_tokens(const torch::Tensor& logits) {
  auto best = logits.to(torch::kFloat32).argmax(-1).contiguous();
  return std::vector<int64_t>(best.data_ptr<int64_t>(), best.data_ptr<int64_t>() + best.numel());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: " << argv[0] << " PACKAGE MAX_NEW_TOKENS PROMPT [PROMPT ...]\n";
    return 2;
  }
  try {
    torch::NoGradGuard no_grad;
    const std::string path = argv[1];
    const int64_t max_new = std::stoll(argv[2]);
    std::vector<std::vector<int64_t>> prompts;
    for (int i = 3; i < argc; ++i) prompts.push_back(parse_ids(argv[i]));

    torch::inductor::AOTIModelPackageLoader extend(path, "extend"), decode(path, "decode");
    const auto metadata = extend.get_metadata();
    const int64_t max_tokens = std::stoll(meta(metadata, "max_tokens"));
    const int64_t vocab = std::stoll(meta(metadata, "vocab_size"));
    Cache cache = make_cache(metadata);
    Requests requests(cache, std::stoll(meta(metadata, "max_seq_len")));
    const int64_t batch = static_cast<int64_t>(prompts.size());
    if (batch > std::stoll(meta(metadata, "max_batch")))
      throw std::runtime_error("more prompts than the package's max_batch");

    std::vector<int64_t> next(batch), rows(batch);
    std::vector<std::vector<int64_t>> generated(batch);
    if (max_new < 1) throw std::invalid_argument("MAX_NEW_TOKENS must be >= 1");
    for (int64_t b = 0; b < batch; ++b) {  // prefill, one prompt at a time, in chunks of max_tokens
      rows[b] = b + 1;
      requests.admit(rows[b]);
      const auto& prompt = prompts[b];
      for (size_t start = 0; start < prompt.size(); start += max_tokens) {
        const int64_t n = std::min<int64_t>(max_tokens, prompt.size() - start);
        std::vector<int64_t> ids(prompt.begin() + start, prompt.begin() + start + n);
        for (int64_t t : ids)
          if (t < 0 || t >= vocab) throw std::invalid_argument("PROMPT: token id out of the vocabulary");
        auto slots = requests.extend(rows[b], n);
        auto logits = run_step(extend, cache, ids, {rows[b]}, {requests.length(rows[b])}, {n}, slots, {n - 1});
        next[b] = greedy_tokens(logits)[0];
      }
    }
    for (int64_t b = 0; b < batch; ++b) generated[b].push_back(next[b]);
    for (int64_t k = 1; k < max_new; ++k) {  // decode: one token of every request per step
      std::vector<int64_t> seq_lens, ones(batch, 1), slots, logit_rows;
      for (int64_t b = 0; b < batch; ++b) {
        slots.push_back(requests.extend(rows[b], 1)[0]);
        seq_lens.push_back(requests.length(rows[b]));
        logit_rows.push_back(b);
      }
      next = greedy_tokens(run_step(decode, cache, next, rows, seq_lens, ones, slots, logit_rows));
      for (int64_t b = 0; b < batch; ++b) generated[b].push_back(next[b]);
    }
    for (const auto& tokens : generated) {
      for (size_t i = 0; i < tokens.size(); ++i) std::cout << (i ? "," : "") << tokens[i];
      std::cout << "\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "dsv4_generate: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
