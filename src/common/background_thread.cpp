#include "common/background_thread.h"

#include <pthread.h>
#include <sched.h>

namespace ettkit::detail {

void mark_background_thread() noexcept {
#ifdef SCHED_BATCH
  sched_param p{};
  p.sched_priority = 0;
  (void)pthread_setschedparam(pthread_self(), SCHED_BATCH, &p);
#endif
}

}  // namespace ettkit::detail
