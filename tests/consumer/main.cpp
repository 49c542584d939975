// Records two attempts of a tiny "training" run with the C++ API and prints the report summary.
#include <ettkit/ett/recorder.h>
#include <ettkit/ett/report.h>

#include <cstdio>
#include <string>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer RUN_DIR\n");
    return 2;
  }
  const std::string run_dir = argv[1];
  for (int attempt = 0; attempt < 2; ++attempt) {
    ettkit::ett::RecorderOptions options;
    options.run_dir = run_dir;
    options.rank = 0;
    options.world_size = 1;
    ettkit::ett::Recorder rec(options);
    { auto scope = rec.phase("train_module_creation"); }
    for (int step = 1; step <= 5; ++step) rec.step(step);
    if (attempt == 0) rec.close(ettkit::ett::EndStatus::kException, "RuntimeError: injected");
  }
  auto summary = ettkit::ett::build_report(run_dir);
  std::printf("attempts=%d failures=%d ett_pct=%.3f\n", summary.attempts, summary.failures, summary.ett_pct);
  return 0;
}
