#include "ett/event_queue.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace ettkit::ett::detail {
namespace {

struct Item {
  uint32_t producer;
  uint32_t seq;
};

TEST(BoundedMpscQueue, FifoAndFullAndReuse) {
  BoundedMpscQueue<Item> q(3);  // rounded up to 4
  EXPECT_EQ(q.capacity(), 4u);
  for (uint32_t i = 0; i < 4; ++i) EXPECT_TRUE(q.try_push({0, i}));
  EXPECT_FALSE(q.try_push({0, 99})) << "a full queue refuses instead of overwriting";
  Item out{};
  for (uint32_t i = 0; i < 4; ++i) {
    ASSERT_TRUE(q.try_pop(out));
    EXPECT_EQ(out.seq, i);
  }
  EXPECT_FALSE(q.try_pop(out));
  // The cells are recycled for the next lap.
  for (uint32_t lap = 0; lap < 10; ++lap) {
    EXPECT_TRUE(q.try_push({1, lap}));
    ASSERT_TRUE(q.try_pop(out));
    EXPECT_EQ(out.seq, lap);
  }
  EXPECT_EQ(q.enqueued(), q.dequeued());
}

TEST(BoundedMpscQueue, ManyProducersLoseNothingThatWasAccepted) {
  constexpr uint32_t kProducers = 4, kPerProducer = 50000;
  BoundedMpscQueue<Item> q(1024);
  std::atomic<uint64_t> refused{0};
  std::atomic<bool> done{false};
  std::vector<std::vector<uint32_t>> seen(kProducers);
  std::thread consumer([&] {
    Item it{};
    for (;;) {
      bool got = q.try_pop(it);
      if (got) {
        seen[it.producer].push_back(it.seq);
      } else if (done.load()) {
        while (q.try_pop(it)) seen[it.producer].push_back(it.seq);
        return;
      }
    }
  });
  std::vector<std::thread> producers;
  for (uint32_t p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      for (uint32_t i = 0; i < kPerProducer; ++i) {
        while (!q.try_push({p, i})) refused.fetch_add(1);  // retry: here we want every item through
      }
    });
  }
  for (auto& t : producers) t.join();
  done.store(true);
  consumer.join();
  for (uint32_t p = 0; p < kProducers; ++p) {
    ASSERT_EQ(seen[p].size(), kPerProducer) << "producer " << p;
    for (uint32_t i = 0; i < kPerProducer; ++i) ASSERT_EQ(seen[p][i], i) << "per-producer order";
  }
}

}  // namespace
}  // namespace ettkit::ett::detail
