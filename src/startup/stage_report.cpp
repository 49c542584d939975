// StageReport arithmetic: serial sum, makespan, time saved and the critical path (the heaviest chain of
// dependencies, weighted by measured durations), and the plain-text table.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "ettkit/startup/stage_graph.h"
#include "startup/stage_dag.h"

namespace ettkit::startup {

const StageRecord* StageReport::find(const std::string& name) const {
  for (const auto& s : stages) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

void summarize(StageReport& report, const std::vector<std::pair<size_t, size_t>>& edges) {
  const auto& st = report.stages;
  size_t n = st.size();
  report.serial_sum_s = 0.0;
  double first = 0.0;
  double last = 0.0;
  bool any = false;
  for (const auto& s : st) {
    if (!s.started) continue;
    report.serial_sum_s += s.duration_s();
    first = any ? std::min(first, s.begin_s) : s.begin_s;
    last = any ? std::max(last, s.end_s) : s.end_s;
    any = true;
  }
  report.makespan_s = any ? last - first : 0.0;
  report.saved_s = report.serial_sum_s - report.makespan_s;

  // Longest path in the DAG: stages in topological order, best[i] = d[i] + the best of its preds.
  std::vector<std::vector<size_t>> preds(n);
  for (const auto& [a, b] : edges) {
    if (a < n && b < n) preds[b].push_back(a);
  }
  std::vector<double> best(n, 0.0);
  std::vector<size_t> via(n, n);
  for (size_t i : detail::topological_order(preds)) {
    for (size_t p : preds[i]) {
      if (via[i] == n || best[p] > best[via[i]]) via[i] = p;
    }
    best[i] = (via[i] == n ? 0.0 : best[via[i]]) + st[i].duration_s();
  }
  report.critical_path.clear();
  report.critical_path_s = 0.0;
  if (n == 0 || !any) return;
  size_t end = static_cast<size_t>(std::max_element(best.begin(), best.end()) - best.begin());
  report.critical_path_s = best[end];
  std::vector<std::string> path;
  for (size_t i = end; i != n; i = via[i]) {
    if (st[i].started) path.push_back(st[i].name);
  }
  std::reverse(path.begin(), path.end());
  report.critical_path = std::move(path);
}

std::string StageReport::to_table() const {
  size_t w = 5;
  for (const auto& s : stages) w = std::max(w, s.name.size());
  std::string out;
  char line[512];
  std::snprintf(line, sizeof line, "%-*s %-10s %9s %9s %9s %6s  %s\n", static_cast<int>(w), "stage", "status",
                "begin_s", "end_s", "dur_s", "thread", "flags");
  out += line;
  for (const auto& s : stages) {
    std::string flags;
    if (s.forks) flags += "forks ";
    if (s.runs_dynamo) flags += "dynamo ";
    if (!s.collective_group.empty()) flags += "collectives:" + s.collective_group + " ";
    std::string thread = s.worker < 0 ? std::string(s.started ? "caller" : "-") : std::to_string(s.worker);
    if (s.started) {
      std::snprintf(line, sizeof line, "%-*s %-10s %9.3f %9.3f %9.3f %6s  %s\n", static_cast<int>(w),
                    s.name.c_str(), to_string(s.status), s.begin_s, s.end_s, s.duration_s(), thread.c_str(),
                    flags.c_str());
    } else {
      std::snprintf(line, sizeof line, "%-*s %-10s %9s %9s %9s %6s  %s\n", static_cast<int>(w), s.name.c_str(),
                    to_string(s.status), "-", "-", "-", thread.c_str(), flags.c_str());
    }
    out += line;
  }
  std::string path;
  for (const auto& p : critical_path) path += (path.empty() ? "" : " -> ") + p;
  std::snprintf(line, sizeof line, "serial sum %.3f s, makespan %.3f s, saved %.3f s; critical path %.3f s: ",
                serial_sum_s, makespan_s, saved_s, critical_path_s);
  out += line;
  out += path.empty() ? "-" : path;
  out += "\n";
  return out;
}

}  // namespace ettkit::startup
