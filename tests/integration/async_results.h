// Results of a burst of Client::AsyncInfer calls, collected by their
// callbacks. The collector is shared (std::shared_ptr) with every callback,
// so it lives until the last callback has returned: a waiter that wakes on
// the last result may return at once, with no callback still touching a
// mutex or vector on the waiter's stack.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/client.h"

namespace layerserve::integration {

class AsyncResults : public std::enable_shared_from_this<AsyncResults> {
 public:
  static std::shared_ptr<AsyncResults> Create(int calls) {
    return std::shared_ptr<AsyncResults>(new AsyncResults(calls));
  }

  // The callback of call `index`.
  client::Client::InferCallback Callback(int index) {
    return [self = shared_from_this(), index](absl::StatusOr<client::Tensor> result) {
      absl::MutexLock lock(&self->mu_);
      self->results_[index] = std::move(result);
      --self->pending_;
    };
  }

  // Calls not yet completed.
  int Pending() {
    absl::MutexLock lock(&mu_);
    return pending_;
  }

  // Waits until every call has completed, at most `timeout`; then the results
  // in call order (calls that never completed hold "no reply").
  absl::StatusOr<std::vector<absl::StatusOr<client::Tensor>>> Wait(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    if (!mu_.AwaitWithTimeout(absl::Condition(
                                  +[](int* pending) { return *pending == 0; }, &pending_),
                              timeout)) {
      return absl::DeadlineExceededError(absl::StrCat(pending_, " async calls never completed"));
    }
    return results_;
  }

 private:
  explicit AsyncResults(int calls)
      : pending_(calls), results_(calls, absl::UnknownError("no reply")) {}

  absl::Mutex mu_;
  int pending_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::StatusOr<client::Tensor>> results_ ABSL_GUARDED_BY(mu_);
};

}  // namespace layerserve::integration
