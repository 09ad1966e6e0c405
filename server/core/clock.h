// The time source of the batcher, injectable so tests control time.
#pragma once

#include <atomic>
#include <chrono>

namespace layerserve {

using SteadyTime = std::chrono::steady_clock::time_point;

class Clock {
 public:
  virtual ~Clock() = default;
  virtual SteadyTime Now() const = 0;
};

// The real monotonic clock.
class SteadyClock final : public Clock {
 public:
  SteadyTime Now() const override { return std::chrono::steady_clock::now(); }
  static SteadyClock* Get() {
    static SteadyClock clock;
    return &clock;
  }
};

// A clock that moves only when a test says so. Thread-safe.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(SteadyTime start = SteadyTime{}) : now_ns_(start.time_since_epoch().count()) {}
  SteadyTime Now() const override { return SteadyTime(SteadyTime::duration(now_ns_.load())); }
  void Advance(std::chrono::nanoseconds d) { now_ns_ += SteadyTime::duration(d).count(); }

 private:
  std::atomic<SteadyTime::rep> now_ns_;
};

}  // namespace layerserve
