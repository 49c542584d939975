#pragma once
// The ledger's on-disk format (one JSON object per line in RUN_DIR/ett/rank-<r>.jsonl). Every record has
// "v" (format version) and "t" (type). Times are UTC epoch microseconds. docs/ett.md documents each type:
//   attempt  {attempt, rank, world, pid, host, ts, proc_start, restart_count, run_id, meta, ettkit}
//   phase    {name, b, e, [step], [src:"launcher"]}
//   step     {n, b, e}
//   bg       {name, b, e, [step]}                      background track (checkpoint persistence)
//   hb       {ts}                                       heartbeat
//   config   {key, value}
//   dropped  {n, ts}                                    events lost to a full queue (running total)
//   end      {ts, status:"clean"|"exception"|"signal", detail}
//   process_exit {ts, attempt, pid}                      the closing process's last instant (written at exit,
//                                                       after the end record; absent after os._exit or a kill)

#include <cstddef>
#include <string_view>

namespace ettkit::ett::ledger {
inline constexpr int kFormatVersion = 1;
inline constexpr std::string_view kDirName = "ett";
inline constexpr std::string_view kFilePrefix = "rank-";
inline constexpr std::string_view kFileSuffix = ".jsonl";

// What one line may cost a reader (the report's and python/ettkit/ett/live_ledger.py's). The Recorder writes
// flat objects of well under a kilobyte (user metadata one level deeper), so a longer or deeper line is no
// record of ours: it is counted as corrupt and skipped, never held in memory whole or parsed. A run directory
// is input that anyone who can write into it controls (docs/security.md).
inline constexpr size_t kMaxLineBytes = size_t{1} << 20;  // 1 MiB, without the newline
inline constexpr int kMaxNestingDepth = 64;               // arrays and objects inside each other
}  // namespace ettkit::ett::ledger
