#include "ett/ledger_reader.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "common/logging.h"
#include "ett/flat_record.h"
#include "ett/ledger_format.h"
#include "ettkit/common/error.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace ettkit::ett::detail {

namespace {

// A record the reader skips; message() says why (it ends up in ledger.warnings). One of ettkit's errors
// (CorruptData), like everything the library throws, although the reader catches every one of them.
class CorruptRecord : public CorruptData {
 public:
  explicit CorruptRecord(std::string why, const char* file = __builtin_FILE(), int line = __builtin_LINE())
      : CorruptData(std::move(why), file, line) {}
};

// UTC epoch microseconds a ledger time may take: 1970-01-01 up to 9999-12-31T23:59:59 (a whole second, so
// that the time still prints as a date after the conversion to double seconds). A time outside this range
// is a corrupt record. The bound also keeps every difference of two ledger times (durations, E2E) far
// from int64 overflow.
constexpr int64_t kMaxEpochUs = 253'402'300'799'000'000;

// The full parser's document, seen through the same accessors as FlatRecord, so that one function reads a
// record whichever parser produced it.
class JsonRecord {
 public:
  explicit JsonRecord(const json& j) : j_(j) {}
  std::optional<int64_t> integer(const char* key) const {
    auto it = j_.find(key);
    if (it == j_.end() || !it->is_number_integer()) return std::nullopt;
    return it->get<int64_t>();
  }
  std::optional<std::string_view> string(const char* key) const {
    auto it = j_.find(key);
    if (it == j_.end() || !it->is_string()) return std::nullopt;
    return std::string_view(it->get_ref<const std::string&>());
  }
  std::optional<double> number(const char* key) const {
    auto it = j_.find(key);
    if (it == j_.end() || !it->is_number()) return std::nullopt;
    return it->get<double>();
  }

 private:
  const json& j_;
};

template <class Record>
int64_t req_int(const Record& r, const char* key) {
  auto v = r.integer(key);
  if (!v) throw CorruptRecord(std::string("'") + key + "' is missing or not an integer");
  return *v;
}

bool is_epoch_us(int64_t t) { return t >= 0 && t <= kMaxEpochUs; }

template <class Record>
int64_t req_time(const Record& r, const char* key) {
  int64_t t = req_int(r, key);
  if (!is_epoch_us(t)) {
    throw CorruptRecord(std::string("'") + key + "' = " + std::to_string(t) +
                        " is out of range for UTC epoch microseconds (1970 to 9999)");
  }
  return t;
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

// Outcome of reading one record into the ledger.
enum class RecordOutcome { kRead, kSkipped, kOrphan };

// Reads one record (either parser's) into `ledger`. Throws CorruptRecord (or std::exception for a field of
// the wrong type) when the record is unusable; the caller counts it.
template <class Record>
RecordOutcome read_record(const Record& rec, std::string_view type, int rank, const fs::path& path,
                          uint64_t line_no, RankLedger& ledger, LedgerSet& set, NameTable& names) {
  if (type == "attempt") {
    AttemptLedger a;
    a.attempt = static_cast<int>(req_int(rec, "attempt"));
    a.rank = static_cast<int>(rec.integer("rank").value_or(rank));
    a.world = static_cast<int>(rec.integer("world").value_or(1));
    a.ts = req_time(rec, "ts");
    a.proc_start = rec.integer("proc_start");
    if (a.proc_start && !is_epoch_us(*a.proc_start)) {
      // Only dates process_bootstrap / worker_spawn: the attempt itself is still usable.
      set.warnings.push_back(path.string() + ":" + std::to_string(line_no) + ": proc_start " +
                             std::to_string(*a.proc_start) + " is out of range; ignored");
      a.proc_start.reset();
    }
    a.restart_count = rec.integer("restart_count");
    a.pid = rec.integer("pid").value_or(-1);
    if (auto host = rec.string("host")) a.host = std::string(*host);
    a.last_ts = a.ts;
    set.world_size = std::max(set.world_size, a.world);
    ledger.attempts.push_back(std::move(a));
    return RecordOutcome::kRead;
  }
  if (ledger.attempts.empty()) return RecordOutcome::kOrphan;
  AttemptLedger& a = ledger.attempts.back();
  if (type == "step") {
    StepRecord s{req_int(rec, "n"), req_time(rec, "b"), req_time(rec, "e")};
    if (s.e < s.b) throw CorruptRecord("ends before it begins");
    a.steps.push_back(s);
    a.activity_end = std::max(a.activity_end, s.e);
    a.last_ts = std::max(a.last_ts, s.e);
  } else if (type == "phase" || type == "bg") {
    auto name = rec.string("name");
    if (!name) throw CorruptRecord("'name' is missing or not a string");
    PhaseRecord p;
    p.b = req_time(rec, "b");
    p.e = req_time(rec, "e");
    if (p.e < p.b) throw CorruptRecord("ends before it begins");
    p.step = rec.integer("step").value_or(-1);
    p.name = names.intern(std::string(*name));
    p.launcher = rec.string("src") == std::optional<std::string_view>("launcher");
    if (type == "phase") {
      a.phases.push_back(p);
      a.activity_end = std::max(a.activity_end, p.e);
    } else {
      a.background.push_back(p);
    }
    a.last_ts = std::max(a.last_ts, p.e);
  } else if (type == "hb") {
    a.last_ts = std::max(a.last_ts, req_time(rec, "ts"));
  } else if (type == "config") {
    auto key = rec.string("key");
    auto value = rec.number("value");
    if (!key || !value) throw CorruptRecord("'key' or 'value' is missing or of the wrong type");
    a.config[std::string(*key)] = *value;
  } else if (type == "note") {
    auto key = rec.string("key");
    auto value = rec.string("value");
    if (!key || !value) throw CorruptRecord("'key' or 'value' is missing or not a string");
    a.notes[std::string(*key)] = std::string(*value);
  } else if (type == "dropped") {
    a.dropped = static_cast<uint64_t>(req_int(rec, "n"));
  } else if (type == "end") {
    a.has_end = true;
    a.end_ts = req_time(rec, "ts");
    a.last_ts = std::max(a.last_ts, a.end_ts);
    a.status = std::string(rec.string("status").value_or("clean"));
    a.detail = std::string(rec.string("detail").value_or(""));
  } else {
    // An unknown record type of a known version: written by a newer minor ettkit; skip quietly.
    return RecordOutcome::kSkipped;
  }
  return RecordOutcome::kRead;
}

void read_file(const fs::path& path, int rank, LedgerSet& set, NameTable& names, bool fast_scan) {
  std::ifstream in(path, std::ios::binary);
  ETTKIT_CHECK(in, IoError, "cannot read ledger file '", path.string(), "'");
  RankLedger ledger;
  ledger.rank = rank;
  ledger.path = path.string();
  std::string line;
  uint64_t line_no = 0;
  uint64_t corrupt_here = 0;
  FlatRecord flat;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    bool last_without_newline = in.eof();
    auto bad = [&](const std::string& why = "") {
      if (last_without_newline) {
        ++set.torn_lines;
      } else {
        ++set.corrupt_lines;
        if (++corrupt_here <= 3) {
          set.warnings.push_back(path.string() + ":" + std::to_string(line_no) + ": corrupt record skipped" +
                                 (why.empty() ? "" : " (" + why + ")"));
        }
      }
    };
    // Both parsers feed the same checks: the fast one reads the Recorder's own lines, the full one the rest.
    auto read = [&](const auto& rec) {
      auto version = rec.integer("v");
      auto type = rec.string("t");
      if (!version || !type) {
        bad();
        return;
      }
      ETTKIT_CHECK(*version <= ledger::kFormatVersion, Unsupported, "ledger '", path.string(), "' line ",
                   line_no, " has format version ", *version, "; this ettkit reads up to version ",
                   ledger::kFormatVersion, " — upgrade ettkit to read it");
      try {
        switch (read_record(rec, *type, rank, path, line_no, ledger, set, names)) {
          case RecordOutcome::kRead:
            ++set.records;
            break;
          case RecordOutcome::kOrphan:
            ++set.orphan_records;
            break;
          case RecordOutcome::kSkipped:
            break;
        }
      } catch (const CorruptRecord& e) {
        bad(e.message());
      } catch (const std::exception&) {
        bad();  // a field of the wrong JSON type
      }
    };
    if (fast_scan && flat.scan(line)) {
      read(flat);
      continue;
    }
    json doc = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!doc.is_object()) {
      bad();
      continue;
    }
    read(JsonRecord(doc));
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

bool is_ledger_file_name(const std::string& name) {
  return name.size() > ledger::kFilePrefix.size() + ledger::kFileSuffix.size() &&
         name.rfind(ledger::kFilePrefix, 0) == 0 &&
         name.compare(name.size() - ledger::kFileSuffix.size(), ledger::kFileSuffix.size(), ledger::kFileSuffix) == 0;
}

// The rank of "rank-<r>.jsonl" exactly as the Recorder writes it (std::to_string of a non-negative int), or
// nullopt. A stray copy ("rank-99999999999", "rank-007") must neither crash the report nor read as a
// second file of an existing rank.
std::optional<int> rank_of_ledger_file(const std::string& name) {
  std::string_view digits(name);
  digits.remove_prefix(ledger::kFilePrefix.size());
  digits.remove_suffix(ledger::kFileSuffix.size());
  int rank = 0;
  auto [end, err] = std::from_chars(digits.data(), digits.data() + digits.size(), rank);
  if (err != std::errc() || end != digits.data() + digits.size() || rank < 0) return std::nullopt;
  if (std::to_string(rank) != digits) return std::nullopt;  // leading zeros or a sign
  return rank;
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
    if (!entry.is_regular_file() || !is_ledger_file_name(name)) continue;
    std::optional<int> rank = rank_of_ledger_file(name);
    if (!rank) {
      set.warnings.push_back(entry.path().string() + ": skipped; a ledger file is named rank-<r>.jsonl with r a "
                             "rank in plain decimal (0 to 2147483647, no leading zeros)");
      ETTKIT_LOG_WARN(set.warnings.back());
      continue;
    }
    files.emplace_back(*rank, entry.path());
  }
  ETTKIT_EXPECTS(!files.empty(), "run directory '", run_dir, "' has no ledger files (", dir.string(),
                 "/rank-<r>.jsonl); was the Recorder created with this run_dir?");
  std::sort(files.begin(), files.end());
  NameTable names(set.names);
  // ETTKIT_LEDGER_FULL_PARSER=1 reads every line with the full JSON parser: the fast scanner's reference,
  // for measuring what it saves and for checking that a report does not depend on it.
  const char* full = std::getenv("ETTKIT_LEDGER_FULL_PARSER");
  const bool fast_scan = full == nullptr || std::string_view(full) != "1";
  for (const auto& [rank, path] : files) {
    read_file(path, rank, set, names, fast_scan);
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
