// Size arithmetic that saturates instead of overflowing: byte counts computed
// from client- or operator-given numbers (tokens x hidden, blocks x block
// bytes) stay comparable with a limit however large the inputs.
#pragma once

#include <cstdint>
#include <limits>

namespace layerserve {

// a * b, or INT64_MAX when the product overflows; a, b >= 0.
inline int64_t SaturatingMul(int64_t a, int64_t b) {
  int64_t product;
  if (__builtin_mul_overflow(a, b, &product)) return std::numeric_limits<int64_t>::max();
  return product;
}

// a + b, or INT64_MAX when the sum overflows; a, b >= 0.
inline int64_t SaturatingAdd(int64_t a, int64_t b) {
  int64_t sum;
  if (__builtin_add_overflow(a, b, &sum)) return std::numeric_limits<int64_t>::max();
  return sum;
}

}  // namespace layerserve
