#include "ettkit/startup/stage_graph.h"

#include <gtest/gtest.h>
#include <pthread.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "ett/test_dir.h"
#include "ettkit/common/error.h"
#include "ettkit/ett/recorder.h"
#include "test_scale.h"

namespace ettkit::startup {
namespace {

using namespace std::chrono_literals;

// A one-shot gate: stages block on it, the test (or another stage) opens it. Waits are bounded so a
// scheduling bug fails the test instead of hanging it.
class Gate {
 public:
  void open() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  bool wait(std::chrono::milliseconds timeout = 10s) {
    std::unique_lock<std::mutex> lk(mu_);
    return cv_.wait_for(lk, timeout, [&] { return open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// Both parties must arrive before either leaves: succeeds only if the two stages run at the same time.
class Rendezvous {
 public:
  bool arrive_and_wait(std::chrono::milliseconds timeout = 10s) {
    std::unique_lock<std::mutex> lk(mu_);
    ++arrived_;
    cv_.notify_all();
    return cv_.wait_for(lk, timeout, [&] { return arrived_ >= 2; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
};

StageOptions after(std::vector<std::string> deps) {
  StageOptions o;
  o.after = std::move(deps);
  return o;
}

StageFn noop() {
  return [](StageContext&) {};
}

int thread_count() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

TEST(StageGraph, IndependentStagesRunConcurrently) {
  StageGraph graph({.max_workers = 2});
  Rendezvous meet;
  std::atomic<bool> a_met{false}, b_met{false};
  graph.add("load_model", [&](StageContext&) { a_met = meet.arrive_and_wait(); });
  graph.add("get_first_batch_data", [&](StageContext&) { b_met = meet.arrive_and_wait(); });
  StageReport report = graph.run();
  EXPECT_TRUE(a_met) << "the two independent stages did not run at the same time";
  EXPECT_TRUE(b_met);
  const auto* a = report.find("load_model");
  const auto* b = report.find("get_first_batch_data");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(a->status, StageStatus::kSucceeded);
  EXPECT_NE(a->worker, b->worker);
  EXPECT_LT(a->begin_s, b->end_s);
  EXPECT_LT(b->begin_s, a->end_s);
  EXPECT_GT(report.saved_s, 0.0) << "overlapping stages must save time against the serial sum";
  EXPECT_NEAR(report.serial_sum_s - report.makespan_s, report.saved_s, 1e-12);
}

TEST(StageGraph, DependenciesOrderStagesAndDefineTheCriticalPath) {
  StageGraph graph({.max_workers = 3});
  std::mutex mu;
  std::vector<std::string> order;
  auto log = [&](const std::string& name) {
    return [&, name](StageContext& ctx) {
      EXPECT_EQ(ctx.stage(), name);
      std::lock_guard<std::mutex> lk(mu);
      order.push_back(name);
    };
  };
  // Added out of order on purpose: dependencies may name stages added later.
  graph.add("first_step", log("first_step"), after({"compile", "get_first_batch_data"}));
  graph.add("device_init", log("device_init"));
  graph.add("compile", log("compile"), after({"device_init"}));
  graph.add("get_first_batch_data", log("get_first_batch_data"), after({"device_init"}));
  EXPECT_EQ(graph.topological_order(),
            (std::vector<std::string>{"device_init", "compile", "get_first_batch_data", "first_step"}));
  StageReport report = graph.run();
  ASSERT_EQ(order.size(), 4u);
  EXPECT_EQ(order.front(), "device_init");
  EXPECT_EQ(order.back(), "first_step");
  for (const auto& s : report.stages) {
    EXPECT_EQ(s.status, StageStatus::kSucceeded) << s.name;
    for (const auto& dep : s.after) {
      EXPECT_GE(s.begin_s, report.find(dep)->end_s) << s.name << " began before its dependency " << dep << " ended";
    }
  }
  ASSERT_EQ(report.critical_path.size(), 3u);
  EXPECT_EQ(report.critical_path.front(), "device_init");
  EXPECT_EQ(report.critical_path.back(), "first_step");
  EXPECT_LE(report.critical_path_s, report.serial_sum_s);
}

TEST(StageGraph, AtMostOneDynamoStageRunsAtATime) {
  StageGraph graph({.max_workers = 3});
  Gate release_compile;
  std::atomic<int> active{0}, max_active{0};
  auto dynamo = [&](bool block) {
    return [&, block](StageContext&) {
      int now = ++active;
      int prev = max_active.load();
      while (now > prev && !max_active.compare_exchange_weak(prev, now)) {
      }
      if (block) {
        EXPECT_TRUE(release_compile.wait());
      }
      --active;
    };
  };
  StageOptions dyn;
  dyn.runs_dynamo = true;
  graph.add("compile_model", dynamo(true), dyn);
  graph.add("compile_loss", dynamo(false), dyn);
  std::atomic<bool> held{false};
  // A third, unrelated stage: waits until the scheduler has seen compile_loss ready but held back (a worker
  // was free), then lets compile_model finish.
  graph.add("data_warmup", [&](StageContext&) {
    held = graph.wait_held_for_testing("compile_loss", 10.0);
    release_compile.open();
  });
  StageReport report = graph.run();
  EXPECT_TRUE(held) << "compile_loss was never held back while compile_model ran";
  EXPECT_EQ(max_active.load(), 1);
  EXPECT_GE(report.find("compile_loss")->begin_s, report.find("compile_model")->end_s);
}

TEST(StageGraph, CollectiveStagesOfOneGroupRunInOrderAndNeverOverlap) {
  StageGraph graph({.max_workers = 4});
  Gate release;
  StageOptions pg;
  pg.collective_group = "world";
  graph.add("broadcast_plan", [&](StageContext&) { EXPECT_TRUE(release.wait()); }, pg);
  graph.add("barrier", noop(), pg);
  std::atomic<bool> held{false};
  graph.add("watch", [&](StageContext&) {
    held = graph.wait_held_for_testing("barrier", 10.0);
    release.open();
  });
  // Stages on different groups are independent of each other.
  Rendezvous meet;
  std::atomic<bool> met_a{false}, met_b{false};
  StageOptions ga;
  ga.collective_group = "group_a";
  StageOptions gb;
  gb.collective_group = "group_b";
  graph.add("allreduce_a", [&](StageContext&) { met_a = meet.arrive_and_wait(); }, ga);
  graph.add("allreduce_b", [&](StageContext&) { met_b = meet.arrive_and_wait(); }, gb);
  StageReport report = graph.run();
  EXPECT_TRUE(held);
  EXPECT_GE(report.find("barrier")->begin_s, report.find("broadcast_plan")->end_s);
  EXPECT_TRUE(met_a && met_b) << "collectives on different groups should run concurrently";
}

TEST(StageGraph, ForkingStagesRunOnTheCallerBeforeAnyThreadStarts) {
  StageGraph graph({.max_workers = 2});
  auto caller = std::this_thread::get_id();
  std::atomic<int> threads_at_fork{-1};
  std::atomic<int> child_status{-1};
  StageOptions forks;
  forks.forks = true;
  graph.add("create_loader_iter", [&](StageContext&) {
    EXPECT_EQ(std::this_thread::get_id(), caller);
    threads_at_fork = thread_count();
    pid_t pid = fork();
    if (pid == 0) _exit(7);
    int status = 0;
    waitpid(pid, &status, 0);
    child_status = WIFEXITED(status) ? WEXITSTATUS(status) : -2;
  }, forks);
  graph.add("compile", noop());
  graph.add("first_batch", noop(), after({"create_loader_iter"}));
  int threads_before = thread_count();
  StageReport report = graph.run();
  EXPECT_EQ(threads_at_fork.load(), threads_before) << "the graph started a thread before the forking stage";
  EXPECT_EQ(child_status.load(), 7);
  const auto* f = report.find("create_loader_iter");
  EXPECT_EQ(f->worker, -1);
  EXPECT_GE(report.find("compile")->begin_s, f->end_s);
  EXPECT_GE(report.find("first_batch")->begin_s, f->end_s);
}

TEST(StageGraph, ForkingStageCannotDependOnAThreadedStage) {
  StageGraph graph;
  StageOptions forks;
  forks.forks = true;
  forks.after = {"device_init"};
  graph.add("device_init", noop());
  graph.add("create_loader_iter", noop(), forks);
  try {
    graph.validate();
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(e.message().find("'create_loader_iter' forks processes"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("'device_init'"), std::string::npos) << e.message();
  }
}

TEST(StageGraph, FailureCancelsDependentsAndNamesTheStage) {
  StageGraph graph({.max_workers = 2});
  std::atomic<bool> c_ran{false}, e_ran{false}, d_ran{false};
  graph.add("a", noop());
  graph.add("b", [](StageContext&) { ETTKIT_THROW(InvalidArgument, "bad value 42"); }, after({"a"}));
  graph.add("c", [&](StageContext&) { c_ran = true; }, after({"b"}));
  graph.add("e", [&](StageContext&) { e_ran = true; }, after({"c"}));
  graph.add("d", [&](StageContext&) { d_ran = true; });
  try {
    graph.run();
    FAIL() << "expected StageFailed";
  } catch (const StageFailed& e) {
    EXPECT_EQ(e.stage(), "b");
    EXPECT_NE(e.message().find("start-up stage 'b' failed: bad value 42"), std::string::npos) << e.message();
    EXPECT_THROW(std::rethrow_exception(e.cause()), InvalidArgument);
  }
  EXPECT_FALSE(c_ran);
  EXPECT_FALSE(e_ran);
  EXPECT_TRUE(d_ran) << "a stage independent of the failure still runs";
  StageReport report = graph.report();
  EXPECT_EQ(report.find("b")->status, StageStatus::kFailed);
  EXPECT_EQ(report.find("c")->status, StageStatus::kCancelled);
  EXPECT_NE(report.find("c")->error.find("'b'"), std::string::npos) << report.find("c")->error;
  EXPECT_EQ(report.find("e")->status, StageStatus::kCancelled);
  EXPECT_EQ(report.find("d")->status, StageStatus::kSucceeded);
  EXPECT_FALSE(report.find("c")->started);
}

TEST(StageGraph, FailFastCancelsStagesThatHaveNotStarted) {
  StageGraph graph({.max_workers = 1, .fail_fast = true});
  std::atomic<bool> later_ran{false};
  graph.add("first", [](StageContext&) { throw std::runtime_error("disk full"); });
  graph.add("independent", [&](StageContext&) { later_ran = true; });
  EXPECT_THROW(graph.run(), StageFailed);
  EXPECT_FALSE(later_ran);
  EXPECT_EQ(graph.report().find("independent")->status, StageStatus::kCancelled);
}

TEST(StageGraph, CyclesAndUnknownDependenciesAreRejectedBeforeAnythingRuns) {
  std::atomic<int> runs{0};
  auto count = [&](StageContext&) { ++runs; };
  {
    StageGraph graph;
    graph.add("independent", count);
    graph.add("a", count, after({"c"}));
    graph.add("b", count, after({"a"}));
    graph.add("c", count, after({"b"}));
    try {
      graph.run();
      FAIL() << "expected InvalidArgument";
    } catch (const InvalidArgument& e) {
      std::string m = e.message();
      EXPECT_NE(m.find("cycle"), std::string::npos) << m;
      for (const char* name : {"a", "b", "c"}) EXPECT_NE(m.find(name), std::string::npos) << m;
      EXPECT_EQ(m.find("independent"), std::string::npos) << "only the cycle is shown: " << m;
    }
  }
  {
    StageGraph graph;
    graph.add("cache_load", count);
    graph.add("compile", count, after({"cache_laod"}));
    try {
      graph.run();
      FAIL() << "expected InvalidArgument";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(e.message().find("'compile' depends on 'cache_laod', which is not a stage"), std::string::npos)
          << e.message();
    }
  }
  EXPECT_EQ(runs.load(), 0);

  StageGraph graph;
  graph.add("a", count);
  EXPECT_THROW(graph.add("a", count), InvalidArgument);
  EXPECT_THROW(graph.add("self", count, after({"self"})), InvalidArgument);
  EXPECT_THROW(graph.add("bad phase!", count), InvalidArgument);
  StageOptions timed_fork;
  timed_fork.forks = true;
  timed_fork.timeout_s = 1.0;
  EXPECT_THROW(graph.add("fork_with_deadline", count, timed_fork), InvalidArgument);
  EXPECT_THROW(StageGraph({.max_workers = 0}), InvalidArgument);
}

TEST(StageGraph, StageTimeoutCancelsDependentsAndThrowsTimeout) {
  StageGraph graph({.max_workers = 2});
  StageOptions deadline;
  deadline.timeout_s = 0.05;
  std::atomic<bool> saw_cancel{false};
  graph.add("compile", [&](StageContext& ctx) { saw_cancel = ctx.wait_cancelled(30.0); }, deadline);
  graph.add("first_step", noop(), after({"compile"}));
  graph.add("get_first_batch_data", noop());
  try {
    graph.run();
    FAIL() << "expected Timeout";
  } catch (const Timeout& e) {
    EXPECT_NE(e.message().find("start-up stage 'compile' exceeded its deadline of 0.05 s"), std::string::npos)
        << e.message();
  }
  EXPECT_TRUE(graph.join(10.0)) << "the stage observed its cancellation and returned";
  EXPECT_TRUE(saw_cancel);
  StageReport report = graph.report();
  EXPECT_EQ(report.find("compile")->status, StageStatus::kTimedOut);
  EXPECT_GE(report.find("compile")->duration_s(), 0.05);
  EXPECT_EQ(report.find("first_step")->status, StageStatus::kCancelled);
  EXPECT_EQ(report.find("get_first_batch_data")->status, StageStatus::kSucceeded);
}

TEST(StageGraph, GraphTimeoutLeavesAStuckStageToJoin) {
  StageGraph graph({.max_workers = 1, .timeout_s = 0.05});
  Gate release;
  std::atomic<bool> later_ran{false};
  StageOptions dyn;
  dyn.runs_dynamo = true;
  graph.add("stuck", [&](StageContext&) { release.wait(); }, dyn);  // ignores cancellation
  graph.add("later", [&](StageContext&) { later_ran = true; }, after({"stuck"}));
  try {
    graph.run();
    FAIL() << "expected Timeout";
  } catch (const Timeout& e) {
    EXPECT_NE(e.message().find("still running: 'stuck'"), std::string::npos) << e.message();
  }
  EXPECT_FALSE(graph.join(0.0)) << "the stuck stage still holds its thread";
  release.open();
  EXPECT_TRUE(graph.join(10.0));
  EXPECT_FALSE(later_ran);
  EXPECT_EQ(graph.report().find("stuck")->status, StageStatus::kTimedOut);
  EXPECT_EQ(graph.report().find("later")->status, StageStatus::kCancelled);
}

TEST(StageGraph, ATimedOutDynamoStageCancelsTheOtherDynamoStages) {
  StageGraph graph({.max_workers = 2});
  StageOptions dyn;
  dyn.runs_dynamo = true;
  StageOptions dyn_deadline = dyn;
  dyn_deadline.timeout_s = 0.05;
  Gate release;
  graph.add("compile_model", [&](StageContext&) { release.wait(); }, dyn_deadline);
  graph.add("compile_optimizer", noop(), dyn);
  EXPECT_THROW(graph.run(), Timeout);
  release.open();
  EXPECT_TRUE(graph.join(10.0));
  EXPECT_EQ(graph.report().find("compile_optimizer")->status, StageStatus::kCancelled);
}

TEST(StageGraph, CancelledContextThrowsCancelled) {
  StageGraph graph;
  StageOptions deadline;
  deadline.timeout_s = 0.02;
  std::atomic<bool> threw{false};
  graph.add("poll", [&](StageContext& ctx) {
    ctx.wait_cancelled(30.0);
    try {
      ctx.throw_if_cancelled();
    } catch (const Cancelled& e) {
      threw = std::string(e.message()).find("'poll' was cancelled") != std::string::npos;
      throw;
    }
  }, deadline);
  EXPECT_THROW(graph.run(), Timeout);
  EXPECT_TRUE(graph.join(10.0));
  EXPECT_TRUE(threw);
}

TEST(StageGraph, AnInterruptCancelsRunningAndPendingStagesAndThrowsCancelled) {
  StageGraph graph({.max_workers = 2});
  std::atomic<bool> compiling{false};
  std::atomic<bool> saw_cancel{false};
  graph.add("compile", [&](StageContext& ctx) {
    compiling = true;
    saw_cancel = ctx.wait_cancelled(30.0);
  });
  graph.add("first_step", noop(), after({"compile"}));
  int polls = 0;
  // The check says "stop" once the stage is inside its body: a handshake, not a sleep.
  auto interrupted = [&] {
    ++polls;
    return compiling.load();
  };
  try {
    graph.run(interrupted, 0.01);
    FAIL() << "expected Cancelled";
  } catch (const Cancelled& e) {
    EXPECT_NE(e.message().find("start-up graph was interrupted (still running: 'compile'"), std::string::npos)
        << e.message();
  }
  EXPECT_GE(polls, 1);
  EXPECT_TRUE(graph.join(10.0)) << "the stage saw its cancellation and returned";
  EXPECT_TRUE(saw_cancel);
  StageReport report = graph.report();
  EXPECT_EQ(report.find("compile")->status, StageStatus::kCancelled);
  EXPECT_EQ(report.find("compile")->error, "the start-up graph was interrupted while it ran");
  EXPECT_EQ(report.find("first_step")->status, StageStatus::kCancelled);
  EXPECT_FALSE(report.find("first_step")->started);
}

TEST(StageGraph, AnInterruptBeforeAForkingStageRunsNothing) {
  StageGraph graph;
  StageOptions forks;
  forks.forks = true;
  std::atomic<int> ran{0};
  graph.add("loader_iter", [&](StageContext&) { ++ran; }, forks);
  graph.add("compile", [&](StageContext&) { ++ran; });
  EXPECT_THROW(graph.run([] { return true; }), Cancelled);
  EXPECT_EQ(ran.load(), 0);
  EXPECT_EQ(graph.report().find("loader_iter")->status, StageStatus::kCancelled);
  EXPECT_EQ(graph.report().find("compile")->status, StageStatus::kCancelled);
}

TEST(StageGraph, AnInterruptCheckThatThrowsInterruptsAndIsRethrown) {
  StageGraph graph;
  graph.add("stuck", [&](StageContext& ctx) { ctx.wait_cancelled(30.0); });
  try {
    graph.run([]() -> bool { throw std::runtime_error("signal handler raised"); }, 0.01);
    FAIL() << "expected the check's exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "signal handler raised");
  }
  EXPECT_TRUE(graph.join(10.0));
  EXPECT_EQ(graph.report().find("stuck")->status, StageStatus::kCancelled);
  StageGraph fresh;
  EXPECT_THROW(fresh.run([] { return false; }, 0.0), InvalidArgument);
}

TEST(StageGraph, DetachOnDestroyLeavesAStuckStageToFinishOnItsOwn) {
  // Everything the stage touches is owned by the stage (as in the Python binding).
  auto release = std::make_shared<Gate>();
  auto returned = std::make_shared<std::atomic<bool>>(false);
  // A sanitizer runtime (TSan) starts its own background thread at the process's first pthread_create: make
  // that happen before counting, so the count compares ettkit's threads only.
  std::thread([] {}).join();
  const int threads_before = thread_count();
  {
    StageGraph graph({.max_workers = 1, .timeout_s = 0.05, .detach_on_destroy = true});
    graph.add("stuck", [release, returned](StageContext&) {
      release->wait(30s);  // ignores cancellation
      *returned = true;
    });
    EXPECT_THROW(graph.run(), Timeout);
  }  // without detach_on_destroy this would wait until the gate opens (30 s), then `returned` would be true
  EXPECT_FALSE(*returned) << "the destructor waited for the stuck stage";
  release->open();
  for (int i = 0; i < 1000 && thread_count() > threads_before; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(*returned) << "the detached stage finished after the graph was gone";
  EXPECT_EQ(thread_count(), threads_before) << "the detached worker thread ended";
}

TEST(StageGraphDeathTest, AForcedUnwindOutOfAStageEndsItsWorkerCleanly) {
  // pthread_exit inside a stage is what CPython does to a thread that asks for the GIL during interpreter
  // exit. A catch (...) that swallows the unwind makes glibc abort ("FATAL: exception not rethrown").
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        StageGraph graph({.max_workers = 1});
        graph.add("exits_its_thread", [](StageContext&) { pthread_exit(nullptr); });
        graph.add("after_it", noop(), after({"exits_its_thread"}));
        int code = 10;
        try {
          graph.run();
        } catch (const StageFailed& e) {
          code = e.stage() == "exits_its_thread" && e.message().find("ended its thread") != std::string::npos ? 0 : 11;
        }
        if (code == 0 && !graph.join(10.0)) code = 12;  // the worker's exit was recorded
        if (code == 0 && graph.report().find("after_it")->status != StageStatus::kCancelled) code = 13;
        std::fflush(nullptr);
        std::_Exit(code);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(StageGraph, RecordsEveryStageIntoTheEttRecorder) {
  testing::TempDir dir;
  ett::RecorderOptions ro;
  ro.run_dir = dir.str();
  ro.rank = 0;
  ro.world_size = 1;
  ro.launcher_phases_from_env = false;
  ett::Recorder recorder(ro);
  StageGraph graph({.max_workers = 2, .recorder = &recorder});
  StageOptions compile;
  compile.phase = "compile";
  graph.add("device_init", noop());
  graph.add("pt2_compile", noop(), compile);
  graph.add("get_first_batch_data", noop(), after({"device_init"}));
  StageReport report = graph.run();
  recorder.flush();
  std::map<std::string, nlohmann::json> phases;
  for (const auto& line : testing::read_lines(recorder.ledger_path())) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j["t"] == "phase") phases[j["name"].get<std::string>()] = j;
  }
  const std::vector<std::pair<std::string, std::string>> expected = {
      {"device_init", "device_init"}, {"pt2_compile", "compile"}, {"get_first_batch_data", "get_first_batch_data"}};
  for (const auto& [stage, phase] : expected) {
    ASSERT_TRUE(phases.count(phase)) << "phase " << phase << " missing from the ledger";
    EXPECT_EQ(phases[phase]["b"].get<int64_t>(), report.find(stage)->begin_epoch_us) << stage;
    EXPECT_EQ(phases[phase]["e"].get<int64_t>(), report.find(stage)->end_epoch_us) << stage;
  }
}

TEST(StageGraph, WithoutARecorderRecordsIntoTheCurrentOne) {
  testing::TempDir dir;
  ett::RecorderOptions ro;
  ro.run_dir = dir.str();
  ro.rank = 0;
  ro.world_size = 1;
  ro.launcher_phases_from_env = false;
  ett::Recorder recorder(ro);
  StageGraph graph;  // no recorder in the options: the current one, `recorder`
  StageOptions compile;
  compile.phase = "compile";
  graph.add("pt2_compile", noop(), compile);
  graph.run();
  StageGraphOptions no_recording;
  no_recording.use_current_recorder = false;
  StageGraph opted_out(no_recording);
  StageOptions other;
  other.phase = "never_recorded";
  opted_out.add("x", noop(), other);
  opted_out.run();
  recorder.flush();
  std::set<std::string> names;
  for (const auto& line : testing::read_lines(recorder.ledger_path())) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j["t"] == "phase") names.insert(j["name"].get<std::string>());
  }
  EXPECT_TRUE(names.count("compile"));
  EXPECT_FALSE(names.count("never_recorded"));
}

TEST(StageGraph, RunsOnceAndAnEmptyGraphIsFine) {
  StageGraph empty;
  StageReport r = empty.run();
  EXPECT_TRUE(r.stages.empty());
  EXPECT_EQ(r.makespan_s, 0.0);
  EXPECT_THROW(empty.run(), InvalidArgument);
  EXPECT_THROW(empty.add("late", noop()), InvalidArgument);
}

// For ThreadSanitizer (make tsan): cancellation from each of its sources (an interrupt, a failure with
// fail_fast, the graph's deadline) racing stages that run, start and finish on four workers, with dynamo and
// collective-group stages held back meanwhile. Whatever the interleaving: a stage starts only after its
// dependency succeeded, every stage that started ends with a final status, and every worker is joined.
TEST(StageGraph, CancellationRacingRunningStagesKeepsTheGraphConsistent) {
  const int rounds = ettkit::testing::scaled_trials(30, 6);
  constexpr int kStages = 12;
  for (int round = 0; round < rounds; ++round) {
    const int kind = round % 3;  // 0: interrupt, 1: a failure with fail_fast, 2: the graph's deadline
    StageGraphOptions go;
    go.max_workers = 4;
    go.fail_fast = kind == 1;
    go.timeout_s = kind == 2 ? 0.015 : 0.0;
    StageGraph graph(go);
    std::atomic<int> started{0};
    for (int k = 0; k < kStages; ++k) {
      StageOptions so;
      if (k >= 4) so.after = {"s" + std::to_string(k - 4)};
      so.runs_dynamo = k % 5 == 1;
      if (k % 4 == 2) so.collective_group = "pg";
      graph.add("s" + std::to_string(k), [&started, k, kind](StageContext& ctx) {
        ++started;
        if (kind == 1 && k == 5) throw std::runtime_error("stage s5 failed");
        ctx.wait_cancelled(0.001 * (1 + k % 4));
      }, so);
    }
    auto interrupted = [&] { return kind == 0 && started.load() >= 3; };
    bool threw = false;
    try {
      graph.run(interrupted, 0.001);
    } catch (const Error&) {
      threw = true;
    }
    ASSERT_TRUE(graph.join(10.0)) << "round " << round;
    StageReport report = graph.report();
    ASSERT_EQ(report.stages.size(), static_cast<size_t>(kStages));
    int n_started = 0;
    for (int k = 0; k < kStages; ++k) {
      const StageRecord& r = report.stages[static_cast<size_t>(k)];
      n_started += r.started;
      if (r.started) {
        EXPECT_NE(r.status, StageStatus::kNotRun) << r.name << " round " << round;
        if (k >= 4) {
          EXPECT_EQ(report.stages[static_cast<size_t>(k - 4)].status, StageStatus::kSucceeded)
              << r.name << " started although its dependency did not succeed (round " << round << ")";
        }
      }
      if (!threw) {
        EXPECT_EQ(r.status, StageStatus::kSucceeded) << r.name << " round " << round;
      }
    }
    EXPECT_EQ(n_started, started.load()) << "round " << round;
    if (kind == 1) {
      EXPECT_TRUE(threw);
    }
  }
}

StageRecord rec(const std::string& name, double b, double e) {
  StageRecord r;
  r.name = name;
  r.started = true;
  r.status = StageStatus::kSucceeded;
  r.begin_s = b;
  r.end_s = e;
  return r;
}

TEST(StageReportTest, CriticalPathSerialSumAndSavings) {
  // a(2 s) -> {b(1 s), c(4 s)} -> d(1 s): the heaviest chain is a, c, d = 7 s; serial 8 s.
  StageReport report;
  report.stages = {rec("a", 0, 2), rec("b", 2, 3), rec("c", 2, 6), rec("d", 6, 7)};
  summarize(report, {{0, 1}, {0, 2}, {1, 3}, {2, 3}});
  EXPECT_EQ(report.critical_path, (std::vector<std::string>{"a", "c", "d"}));
  EXPECT_DOUBLE_EQ(report.critical_path_s, 7.0);
  EXPECT_DOUBLE_EQ(report.serial_sum_s, 8.0);
  EXPECT_DOUBLE_EQ(report.makespan_s, 7.0);
  EXPECT_DOUBLE_EQ(report.saved_s, 1.0);
  std::string table = report.to_table();
  EXPECT_NE(table.find("critical path 7.000 s: a -> c -> d"), std::string::npos) << table;
  EXPECT_NE(table.find("saved 1.000 s"), std::string::npos) << table;
}

TEST(StageReportTest, StagesThatNeverRanCountAsZero) {
  StageReport report;
  StageRecord skipped;
  skipped.name = "cancelled";
  skipped.status = StageStatus::kCancelled;
  report.stages = {rec("a", 0, 1), skipped};
  summarize(report, {{0, 1}});
  EXPECT_EQ(report.critical_path, (std::vector<std::string>{"a"}));
  EXPECT_DOUBLE_EQ(report.serial_sum_s, 1.0);
  EXPECT_NE(report.to_table().find("cancelled cancelled"), std::string::npos) << report.to_table();
}

}  // namespace
}  // namespace ettkit::startup
