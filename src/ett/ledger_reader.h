#pragma once
// Reads a run directory's ledger files into per-rank, per-attempt records for the report.
// Tolerant by design: a torn last line (a process killed mid-write) or a corrupt line is skipped and
// counted; only a missing/empty directory or a newer format version is an error.
// Hostile directories (docs/security.md): the ledger folder and its files are opened relative to the run
// directory without following symbolic links, and only regular files are read (any other entry named like a
// ledger file is skipped with a warning); a line longer than ledger::kMaxLineBytes or nested deeper than
// ledger::kMaxNestingDepth is a corrupt line, skipped without being held in memory whole. What the reader
// holds is a 64 KiB chunk, at most one line and the records it read.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace ettkit::ett::detail {

struct PhaseRecord {
  int64_t b = 0;
  int64_t e = 0;
  int64_t step = -1;
  uint32_t name = 0;  // index into LedgerSet::names
  bool launcher = false;
};

struct StepRecord {
  int64_t n = 0;
  int64_t b = 0;
  int64_t e = 0;
};

struct AttemptLedger {
  int attempt = 0;
  int rank = 0;
  int world = 1;
  int64_t ts = 0;  // recorder start
  std::optional<int64_t> proc_start;
  std::optional<int64_t> restart_count;
  std::vector<PhaseRecord> phases;
  std::vector<StepRecord> steps;
  std::vector<PhaseRecord> background;
  std::map<std::string, double> config;
  std::map<std::string, std::string> notes;  // Recorder::set_note; the last value of a key wins
  int64_t last_ts = 0;        // latest time any record mentions (heartbeats included)
  int64_t activity_end = 0;   // latest end of a phase or step (0 if none)
  bool has_end = false;
  int64_t end_ts = 0;
  std::string status;         // "clean" | "exception" | "signal" (when has_end)
  std::string detail;
  // The process_exit record of the process that recorded this attempt: the last instant of that process
  // (after interpreter and process-group teardown), later than end_ts. Empty when it was not written.
  std::optional<int64_t> process_exit_ts;
  uint64_t dropped = 0;
  int64_t pid = -1;           // the recording process (attempt record), -1 when unknown
  std::string host;
  // Set by the report, not read from the file: no end record yet because the recording process still runs
  // (see mark_running in report.cpp).
  bool running = false;
};

struct RankLedger {
  int rank = 0;
  std::string path;
  std::vector<AttemptLedger> attempts;  // in file order; attempt numbers as written
};

struct LedgerSet {
  std::vector<RankLedger> ranks;  // sorted by rank
  std::vector<std::string> names;  // interned phase names
  uint64_t files = 0;
  uint64_t records = 0;
  uint64_t corrupt_lines = 0;
  uint64_t torn_lines = 0;
  uint64_t orphan_records = 0;  // records before any attempt record
  int world_size = 0;
  std::vector<std::string> warnings;
};

/// Reads RUN_DIR/ett/rank-*.jsonl. Throws InvalidArgument when the directory or ledger is missing,
/// Unsupported when a record has a newer format version than this build reads, IoError (naming the path)
/// when the OS refuses to open, list or read something, or RUN_DIR/ett is a symbolic link.
LedgerSet read_ledger_dir(const std::string& run_dir);

}  // namespace ettkit::ett::detail
