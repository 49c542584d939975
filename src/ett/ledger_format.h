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

#include <string_view>

namespace ettkit::ett::ledger {
inline constexpr int kFormatVersion = 1;
inline constexpr std::string_view kDirName = "ett";
inline constexpr std::string_view kFilePrefix = "rank-";
inline constexpr std::string_view kFileSuffix = ".jsonl";
}  // namespace ettkit::ett::ledger
