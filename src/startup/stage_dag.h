#pragma once
// The stage graph's DAG algorithms, on dependency lists (preds[i]: the stages stage i needs), shared by the
// scheduler (stage_graph.cpp: validation, run order) and the report (stage_report.cpp: critical path).

#include <cstddef>
#include <vector>

namespace ettkit::startup::detail {

/// Kahn's algorithm taking the smallest index first among ready stages: deterministic, so every rank
/// computes the same order (collective groups rely on it). Returns fewer than preds.size() stages when
/// the graph has a cycle.
std::vector<size_t> topological_order(const std::vector<std::vector<size_t>>& preds);

/// A cycle of the graph as stage indices [c0, c1, ..., ck] where each needs the next and ck needs c0, or
/// empty when there is none.
std::vector<size_t> find_cycle(const std::vector<std::vector<size_t>>& preds);

}  // namespace ettkit::startup::detail
