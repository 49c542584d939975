#pragma once
// Scheduling of ettkit's background threads (checkpoint copy pool, checkpoint writer).

namespace ettkit::detail {

/// Puts the calling thread in the SCHED_BATCH class. Why: on a machine whose cores are all busy with the
/// training loop (intra-op threads included), a background thread woken by the training thread (a copy
/// job, a queued save) would otherwise preempt it at once, and the save call that only meant to hand
/// work over would lose a whole scheduler slice (milliseconds). SCHED_BATCH threads get the same CPU
/// share over time but never preempt on wake-up. Best effort: a failure leaves the thread as it was.
void mark_background_thread() noexcept;

}  // namespace ettkit::detail
