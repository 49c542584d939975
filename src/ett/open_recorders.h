#pragma once
// What the report needs to know about the Recorders open in this process (recorder.cpp keeps them; see
// current_recorder() in recorder.h).

#include <string>
#include <utility>
#include <vector>

namespace ettkit::ett::detail {

/// Flushes every Recorder open in this process whose ledger file lies in `ledger_dir` (RUN_DIR/ett), so a
/// report built now sees what they recorded so far, and returns each one's (canonical ledger path,
/// attempt): attempts that are running, not killed, although they have no end record yet.
std::vector<std::pair<std::string, int>> flush_open_ledgers_in(const std::string& ledger_dir, double timeout_s);

}  // namespace ettkit::ett::detail
