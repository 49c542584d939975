#pragma once
// What a decoder of untrusted bytes must do with any input, checked one input at a time: the seeded gtest
// loops (tests/cpp/*/*_fuzz_test.cpp) and the libFuzzer harnesses (tests/cpp/fuzz/*_fuzzer.cpp) call the
// same functions. kDecoded: the input decoded and the result keeps the decoder's promises. kRefused: the
// documented error. kBroken: anything else (another exception type, a broken promise); the reason is in
// last_decoder_problem().
#include <algorithm>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/storage.h"
#include "ettkit/common/error.h"
#include "ettkit/ett/report.h"

namespace ettkit::testing {

enum class DecoderOutcome { kDecoded, kRefused, kBroken };

inline std::string& last_decoder_problem() {
  static std::string problem;  // one fuzz loop per process at a time
  return problem;
}

inline DecoderOutcome broken(std::string why) {
  last_decoder_problem() = std::move(why);
  return DecoderOutcome::kBroken;
}

/// decode_manifest: CorruptData or Unsupported, or a manifest whose fields are in range and which encodes
/// and decodes back to itself.
inline DecoderOutcome check_manifest_decoder(const std::string& text) {
  namespace ckd = ettkit::checkpoint::detail;
  ckd::Manifest m;
  try {
    m = ckd::decode_manifest(text, "fuzz.json");
  } catch (const ettkit::CorruptData&) {
    return DecoderOutcome::kRefused;
  } catch (const ettkit::Unsupported&) {
    return DecoderOutcome::kRefused;
  } catch (const std::exception& e) {
    return broken(std::string("decode_manifest threw something else: ") + e.what());
  }
  if (m.step < 0 || m.step > ckd::kMaxStep || m.world_size < 1) return broken("step or world_size out of range");
  for (const auto& [name, d] : m.files) {
    if (d.xxh3.size() != 16) return broken("file '" + name + "' has a checksum that is not 16 digits");
    if (d.chunk_bytes == 0 ? !d.chunks.empty()
                           : d.chunks.size() != d.size / d.chunk_bytes + (d.size % d.chunk_bytes != 0)) {
      return broken("file '" + name + "': chunk count does not cover its size");
    }
  }
  ckd::Manifest back;
  try {
    back = ckd::decode_manifest(ckd::encode_manifest(m), "fuzz-again.json");
  } catch (const std::exception& e) {
    return broken(std::string("a decoded manifest does not decode after encoding: ") + e.what());
  }
  if (back.step != m.step || back.world_size != m.world_size || back.commit_seq != m.commit_seq ||
      back.metadata != m.metadata || back.files.size() != m.files.size()) {
    return broken("encode(decode(x)) lost fields");
  }
  for (const auto& [name, d] : m.files) {
    const auto& o = back.files.at(name);
    if (o.size != d.size || o.xxh3 != d.xxh3 || o.chunk_bytes != d.chunk_bytes || o.chunks != d.chunks) {
      return broken("encode(decode(x)) changed file '" + name + "'");
    }
  }
  return DecoderOutcome::kDecoded;
}

/// read_safetensors_index of `bytes` written to `path`: CorruptData, or an index whose entries lie inside
/// the data section, do not overlap and hold exactly their dtype times their shape.
inline DecoderOutcome check_safetensors_decoder(const std::string& bytes, const std::string& path) {
  namespace ckd = ettkit::checkpoint::detail;
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  ckd::SafetensorsIndex index;
  try {
    index = ckd::read_safetensors_index(path, bytes.size());
  } catch (const ettkit::CorruptData&) {
    return DecoderOutcome::kRefused;
  } catch (const std::exception& e) {
    return broken(std::string("read_safetensors_index threw something else: ") + e.what());
  }
  if (index.data_offset + index.data_size != bytes.size()) return broken("data section does not end the file");
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, e] : index.tensors) {
    const int elem = ckd::safetensors_dtype_size(e.dtype);
    if (elem <= 0) return broken("entry '" + name + "' has an unknown dtype " + e.dtype);
    uint64_t numel = 1;
    for (int64_t d : e.shape) {
      if (d < 0) return broken("entry '" + name + "' has a negative dimension");
      numel *= static_cast<uint64_t>(d);
    }
    if (e.begin > e.end || e.end > index.data_size) return broken("entry '" + name + "' lies outside the data");
    if (e.end - e.begin != numel * static_cast<uint64_t>(elem)) return broken("entry '" + name + "' size");
    if (e.end > e.begin) ranges.emplace_back(e.begin, e.end);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) return broken("two entries overlap");
  }
  return DecoderOutcome::kDecoded;
}

/// The report of RUN_DIR with `text` as its only ledger (rank-0.jsonl). The ledger reader tolerates torn
/// and corrupt lines (it counts them), so only InvalidArgument (nothing usable) and Unsupported (a newer
/// format version) may come out, and the JSON of a report that built must parse.
inline DecoderOutcome check_ledger_reader(const std::string& text, const std::string& run_dir) {
  {
    std::ofstream out(run_dir + "/ett/rank-0.jsonl", std::ios::binary | std::ios::trunc);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
  }
  std::string json_text;
  try {
    json_text = ettkit::ett::build_report_json(run_dir);
  } catch (const ettkit::InvalidArgument&) {
    return DecoderOutcome::kRefused;
  } catch (const ettkit::Unsupported&) {
    return DecoderOutcome::kRefused;
  } catch (const std::exception& e) {
    return broken(std::string("build_report_json threw something else: ") + e.what());
  }
  if (!nlohmann::json::accept(json_text)) return broken("the report is not valid JSON");
  return DecoderOutcome::kDecoded;
}

}  // namespace ettkit::testing
