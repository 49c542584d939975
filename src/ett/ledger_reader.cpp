#include "ett/ledger_reader.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "common/logging.h"
#include "ett/ledger_format.h"
#include "ettkit/common/error.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace ettkit::ett::detail {

namespace {

std::optional<int64_t> opt_int(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_integer()) return std::nullopt;
  return it->get<int64_t>();
}

int64_t req_int(const json& j, const char* key) {
  auto v = opt_int(j, key);
  if (!v) throw std::invalid_argument(key);
  return *v;
}

class NameTable {
 public:
  explicit NameTable(std::vector<std::string>& names) : names_(names) {}
  uint32_t intern(const std::string& name) {
    auto [it, inserted] = index_.try_emplace(name, static_cast<uint32_t>(names_.size()));
    if (inserted) names_.push_back(name);
    return it->second;
  }

 private:
  std::vector<std::string>& names_;
  std::unordered_map<std::string, uint32_t> index_;
};

void read_file(const fs::path& path, int rank, LedgerSet& set, NameTable& names) {
  std::ifstream in(path, std::ios::binary);
  ETTKIT_CHECK(in, IoError, "cannot read ledger file '", path.string(), "'");
  RankLedger ledger;
  ledger.rank = rank;
  ledger.path = path.string();
  std::string line;
  uint64_t line_no = 0;
  uint64_t corrupt_here = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    bool last_without_newline = in.eof();
    json rec = json::parse(line, nullptr, /*allow_exceptions=*/false);
    auto bad = [&] {
      if (last_without_newline) {
        ++set.torn_lines;
      } else {
        ++set.corrupt_lines;
        if (++corrupt_here <= 3) {
          set.warnings.push_back(path.string() + ":" + std::to_string(line_no) + ": corrupt record skipped");
        }
      }
    };
    if (!rec.is_object()) {
      bad();
      continue;
    }
    auto version = opt_int(rec, "v");
    auto type_it = rec.find("t");
    if (!version || type_it == rec.end() || !type_it->is_string()) {
      bad();
      continue;
    }
    ETTKIT_CHECK(*version <= ledger::kFormatVersion, Unsupported, "ledger '", path.string(), "' line ",
                 line_no, " has format version ", *version, "; this ettkit reads up to version ",
                 ledger::kFormatVersion, " — upgrade ettkit to read it");
    const std::string& type = type_it->get_ref<const std::string&>();
    try {
      if (type == "attempt") {
        AttemptLedger a;
        a.attempt = static_cast<int>(req_int(rec, "attempt"));
        a.rank = static_cast<int>(opt_int(rec, "rank").value_or(rank));
        a.world = static_cast<int>(opt_int(rec, "world").value_or(1));
        a.ts = req_int(rec, "ts");
        a.proc_start = opt_int(rec, "proc_start");
        a.restart_count = opt_int(rec, "restart_count");
        a.last_ts = a.ts;
        set.world_size = std::max(set.world_size, a.world);
        ledger.attempts.push_back(std::move(a));
        ++set.records;
        continue;
      }
      if (ledger.attempts.empty()) {
        ++set.orphan_records;
        continue;
      }
      AttemptLedger& a = ledger.attempts.back();
      if (type == "step") {
        StepRecord s{req_int(rec, "n"), req_int(rec, "b"), req_int(rec, "e")};
        if (s.e < s.b) throw std::invalid_argument("e<b");
        a.steps.push_back(s);
        a.activity_end = std::max(a.activity_end, s.e);
        a.last_ts = std::max(a.last_ts, s.e);
      } else if (type == "phase" || type == "bg") {
        auto name_it = rec.find("name");
        if (name_it == rec.end() || !name_it->is_string()) throw std::invalid_argument("name");
        PhaseRecord p;
        p.b = req_int(rec, "b");
        p.e = req_int(rec, "e");
        if (p.e < p.b) throw std::invalid_argument("e<b");
        p.step = opt_int(rec, "step").value_or(-1);
        p.name = names.intern(name_it->get<std::string>());
        auto src = rec.find("src");
        p.launcher = src != rec.end() && src->is_string() && *src == "launcher";
        if (type == "phase") {
          a.phases.push_back(p);
          a.activity_end = std::max(a.activity_end, p.e);
        } else {
          a.background.push_back(p);
        }
        a.last_ts = std::max(a.last_ts, p.e);
      } else if (type == "hb") {
        a.last_ts = std::max(a.last_ts, req_int(rec, "ts"));
      } else if (type == "config") {
        auto key = rec.find("key");
        auto value = rec.find("value");
        if (key == rec.end() || !key->is_string() || value == rec.end() || !value->is_number()) {
          throw std::invalid_argument("config");
        }
        a.config[key->get<std::string>()] = value->get<double>();
      } else if (type == "dropped") {
        a.dropped = static_cast<uint64_t>(req_int(rec, "n"));
      } else if (type == "end") {
        a.has_end = true;
        a.end_ts = req_int(rec, "ts");
        a.last_ts = std::max(a.last_ts, a.end_ts);
        auto status = rec.find("status");
        a.status = status != rec.end() && status->is_string() ? status->get<std::string>() : "clean";
        auto detail = rec.find("detail");
        a.detail = detail != rec.end() && detail->is_string() ? detail->get<std::string>() : "";
      } else {
        // An unknown record type of a known version: written by a newer minor ettkit; skip quietly.
        continue;
      }
      ++set.records;
    } catch (const std::exception&) {
      bad();
    }
  }
  if (corrupt_here > 3) {
    set.warnings.push_back(path.string() + ": " + std::to_string(corrupt_here) + " corrupt records skipped in all");
  }
  // Processes phases in time order later; sort once here.
  for (auto& a : ledger.attempts) {
    std::sort(a.steps.begin(), a.steps.end(), [](const StepRecord& x, const StepRecord& y) { return x.b < y.b; });
    if (a.dropped > 0) {
      set.warnings.push_back(path.string() + ": attempt " + std::to_string(a.attempt) + " dropped " +
                             std::to_string(a.dropped) + " events (recorder queue full)");
    }
  }
  set.ranks.push_back(std::move(ledger));
}

}  // namespace

LedgerSet read_ledger_dir(const std::string& run_dir) {
  fs::path root(run_dir);
  std::error_code ec;
  ETTKIT_EXPECTS(fs::is_directory(root, ec), "run directory '", run_dir,
                 "' does not exist or is not a directory; pass the directory given to ettkit.ett.Recorder");
  fs::path dir = root / ledger::kDirName;
  ETTKIT_EXPECTS(fs::is_directory(dir, ec), "run directory '", run_dir, "' has no '", ledger::kDirName,
                 "/' ledger folder; it is written by ettkit.ett.Recorder(run_dir)");
  LedgerSet set;
  std::vector<std::pair<int, fs::path>> files;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    std::string name = entry.path().filename().string();
    if (!entry.is_regular_file() || name.rfind(ledger::kFilePrefix, 0) != 0 ||
        name.size() <= ledger::kFilePrefix.size() + ledger::kFileSuffix.size() ||
        name.compare(name.size() - ledger::kFileSuffix.size(), ledger::kFileSuffix.size(), ledger::kFileSuffix) != 0) {
      continue;
    }
    std::string digits = name.substr(ledger::kFilePrefix.size(),
                                     name.size() - ledger::kFilePrefix.size() - ledger::kFileSuffix.size());
    if (digits.empty() || !std::all_of(digits.begin(), digits.end(), ::isdigit)) continue;
    files.emplace_back(std::stoi(digits), entry.path());
  }
  ETTKIT_EXPECTS(!files.empty(), "run directory '", run_dir, "' has no ledger files (", dir.string(),
                 "/rank-<r>.jsonl); was the Recorder created with this run_dir?");
  std::sort(files.begin(), files.end());
  NameTable names(set.names);
  for (const auto& [rank, path] : files) {
    read_file(path, rank, set, names);
    ++set.files;
  }
  bool any_attempt = false;
  for (const auto& r : set.ranks) any_attempt = any_attempt || !r.attempts.empty();
  ETTKIT_EXPECTS(any_attempt, "ledger files under '", dir.string(),
                 "' hold no attempt record (empty or corrupt); nothing to report");
  if (set.corrupt_lines > 0) {
    ETTKIT_LOG_WARN("ETT ledger under '", dir.string(), "': ", set.corrupt_lines, " corrupt lines skipped");
  }
  return set;
}

}  // namespace ettkit::ett::detail
